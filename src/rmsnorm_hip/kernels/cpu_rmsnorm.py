"""CPU row kernels (numba CPU JIT, rows in parallel with ``prange``).

A CPU row runs on one core, so the GPU's thread layout has no meaning here; the row math and the
16-bit codecs are the same device helpers the GPU kernels use.  A row's sum of squares is kept in
eight interleaved float32 partial sums combined pairwise, a fixed order that depends on N only.
Division follows IEEE (numba's ``error_model="numpy"``), as on the GPU: an all-zero row with
eps = 0 gives NaN rather than raising ZeroDivisionError.
"""
import numba
import numpy as np
from numba import float32, prange

from .. import _dtypes
from ._rowops import codec

LANES = 8


def make_lane_sum(intr, term):
    """row_sum(a, b, w, off, n): sum of ``term(a, b, w, off, j)`` over j < n in eight interleaved
    float32 partial sums combined pairwise (a fixed order that depends on N only)."""
    @intr.jitable
    def lane_sum(a, b, w, off, n):
        p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = float32(0.0)
        full = n - n % LANES
        for j in range(0, full, LANES):
            p0 += term(a, b, w, off, j)
            p1 += term(a, b, w, off, j + 1)
            p2 += term(a, b, w, off, j + 2)
            p3 += term(a, b, w, off, j + 3)
            p4 += term(a, b, w, off, j + 4)
            p5 += term(a, b, w, off, j + 5)
            p6 += term(a, b, w, off, j + 6)
            p7 += term(a, b, w, off, j + 7)
        for j in range(full, n):
            p0 += term(a, b, w, off, j)
        return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))

    return lane_sum


def make_row_sumsq(intr, dtype):
    """row_sumsq(row, n): the row's sum of squares."""
    decode = codec(intr, dtype)[0]

    @intr.jitable
    def square(a, b, w, off, j):
        v = decode(a[j])
        return v * v

    lane_sum = make_lane_sum(intr, square)

    @intr.jitable
    def row_sumsq(row, n):
        return lane_sum(row, row, row, float32(0.0), n)

    return row_sumsq


def make_scale(intr, dtype, weight_dtype, xscale_dtype=""):
    """scale(h, j, r, weight, xscale, weight_offset): element ``j`` of a stored row ``h`` times
    rstd, (weight + weight_offset) and xscale as present, in that order (the GPU kernels' order
    for rows that are not quantised; quantised ones form (weight + weight_offset) * xscale
    first, so the two backends' q may differ by a level)."""
    decode = codec(intr, dtype)[0]
    decode_w = codec(intr, weight_dtype or _dtypes.FLOAT32)[0]
    decode_s = codec(intr, xscale_dtype or _dtypes.FLOAT32)[0]
    has_weight, has_xscale = bool(weight_dtype), bool(xscale_dtype)

    @intr.jitable
    def scale(h, j, r, weight, xscale, weight_offset):
        v = decode(h[j]) * r
        if has_weight:
            v = v * (decode_w(weight[j]) + weight_offset)
        if has_xscale:
            v = v * decode_s(xscale[j])
        return v

    return scale


def make_cpu_rmsnorm_fwd(intr, dtype, weight_dtype, parallel):
    """fwd(x (M, N), weight (N,), y (M, N), rstd (M,), eps, weight_offset, store_rstd) in storage
    dtypes; rows may be strided.  ``parallel`` spreads rows over cores (worth it past ~1M
    elements: waking the thread pool costs milliseconds on small inputs)."""
    encode = codec(intr, dtype)[1]
    row_sumsq = make_row_sumsq(intr, dtype)
    scale = make_scale(intr, dtype, weight_dtype)

    @numba.njit(parallel=parallel, nogil=True, error_model="numpy")
    def rmsnorm_fwd(x, weight, y, rstd, eps, weight_offset, store_rstd):
        m, n = x.shape
        for i in prange(m):
            row = x[i]
            r = float32(1.0) / np.sqrt(row_sumsq(row, n) / float32(n) + eps)
            if store_rstd:
                rstd[i] = r
            for j in range(n):
                y[i, j] = encode(scale(row, j, r, weight, weight, weight_offset))

    return rmsnorm_fwd


def make_cpu_fused_fwd(intr, dtype, weight_dtype, parallel, has_residual, quant, xscale_dtype):
    """fwd(x, residual, weight, xscale, y, residual_out, rstd, yscale, eps, weight_offset,
    store_rstd): the forward's fused switches (see kernels/rmsnorm_fwd.py) on (M, N) storage
    views, rows may be strided.  A row is one pass writing h = round(x + residual) to
    residual_out (which may be residual), then rms_norm's row over h as stored; quantised rows
    take max|y| in a pass before the one that writes q.  Each element is read before it is
    written, so y may be x and residual_out residual."""
    decode, encode, _ = codec(intr, dtype)
    encode_q = codec(intr, quant)[1] if quant else encode
    qmax = float32(_dtypes.QMAX[quant]) if quant else float32(1.0)
    row_sumsq = make_row_sumsq(intr, dtype)
    scale = make_scale(intr, dtype, weight_dtype, xscale_dtype)
    max_nan = intr.max_nan

    @numba.njit(parallel=parallel, nogil=True, error_model="numpy")
    def fused_fwd(x, residual, weight, xscale, y, residual_out, rstd, yscale, eps, weight_offset,
                  store_rstd):
        m, n = x.shape
        for i in prange(m):
            h = x[i]
            if has_residual:
                for j in range(n):
                    residual_out[i, j] = encode(decode(x[i, j]) + decode(residual[i, j]))
                h = residual_out[i]
            r = float32(1.0) / np.sqrt(row_sumsq(h, n) / float32(n) + eps)
            if store_rstd:
                rstd[i] = r
            if quant:
                amax = float32(0.0)
                for j in range(n):
                    amax = max_nan(amax, abs(scale(h, j, r, weight, xscale, weight_offset)))
                s = float32(1.0) if amax == float32(0.0) else amax / qmax
                yscale[i] = s
                inv = float32(1.0) / s
                for j in range(n):
                    y[i, j] = encode_q(scale(h, j, r, weight, xscale, weight_offset) * inv)
            else:
                for j in range(n):
                    y[i, j] = encode(scale(h, j, r, weight, xscale, weight_offset))

    return fused_fwd

BWD_GROUPS = 64   # row groups (dweight partial rows); a function of M only: deterministic


def make_cpu_rmsnorm_bwd(intr, dtype, weight_dtype, recompute_rstd, has_dres, parallel):
    """bwd(dy, x, weight, rstd, dres, dx, partial (G, N) float32, dweight, eps, weight_offset):
    dx row by row, and dweight from G row-group partials added in group order."""
    decode, encode, _ = codec(intr, dtype)
    decode_w, encode_w, _ = codec(intr, weight_dtype or _dtypes.FLOAT32)
    has_weight = bool(weight_dtype)
    row_sumsq = make_row_sumsq(intr, dtype)

    @intr.jitable
    def x_times_wdy(x, dy, w, off, j):
        g = decode(dy[j])
        if has_weight:
            g = g * (decode_w(w[j]) + off)
        return decode(x[j]) * g

    row_dot = make_lane_sum(intr, x_times_wdy)

    @numba.njit(parallel=parallel, nogil=True, error_model="numpy")
    def rmsnorm_bwd(dy, x, weight, rstd, dres, dx, partial, dweight, eps, weight_offset):
        m, n = x.shape
        groups = partial.shape[0]
        for g in prange(groups):
            for j in range(n):
                partial[g, j] = float32(0.0)
            for i in range(g * m // groups, (g + 1) * m // groups):
                if recompute_rstd:
                    r = float32(1.0) / np.sqrt(row_sumsq(x[i], n) / float32(n) + eps)
                else:
                    r = rstd[i]
                c1 = row_dot(x[i], dy[i], weight, weight_offset, n) * r / float32(n)
                for j in range(n):
                    d = decode(dy[i, j])
                    wdy = d
                    if has_weight:
                        wdy = d * (decode_w(weight[j]) + weight_offset)
                    x_hat = decode(x[i, j]) * r
                    v = (wdy - x_hat * c1) * r
                    if has_dres:
                        v = v + decode(dres[i, j])
                    dx[i, j] = encode(v)
                    partial[g, j] += d * x_hat
        if has_weight:
            for j in range(n):
                total = float32(0.0)
                for g in range(groups):
                    total += partial[g, j]
                dweight[j] = encode_w(total)

    return rmsnorm_bwd
