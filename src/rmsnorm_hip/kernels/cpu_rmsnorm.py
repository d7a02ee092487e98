"""CPU row kernels (numba CPU JIT, rows in parallel with ``prange``).

A CPU row runs on one core, so the GPU's thread layout has no meaning here; the row math and the
16-bit codecs are the same device helpers the GPU kernels use.  A row's sum of squares is kept in
eight interleaved float32 partial sums combined pairwise, a fixed order that depends on N only.
"""
import numba
import numpy as np
from numba import float32, prange

from .. import _dtypes
from ._rowops import codec

LANES = 8


def make_row_sumsq(intr, dtype):
    decode = codec(intr, dtype)[0]

    @intr.jitable
    def row_sumsq(row, n):
        p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = float32(0.0)
        full = n - n % LANES
        for j in range(0, full, LANES):
            v0 = decode(row[j])
            v1 = decode(row[j + 1])
            v2 = decode(row[j + 2])
            v3 = decode(row[j + 3])
            v4 = decode(row[j + 4])
            v5 = decode(row[j + 5])
            v6 = decode(row[j + 6])
            v7 = decode(row[j + 7])
            p0 += v0 * v0
            p1 += v1 * v1
            p2 += v2 * v2
            p3 += v3 * v3
            p4 += v4 * v4
            p5 += v5 * v5
            p6 += v6 * v6
            p7 += v7 * v7
        for j in range(full, n):
            v = decode(row[j])
            p0 += v * v
        return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))

    return row_sumsq


def make_scale(intr, dtype, weight_dtype, xscale_dtype=""):
    """scale(h, j, r, weight, xscale, weight_offset): element ``j`` of a stored row ``h`` times
    rstd, (weight + weight_offset) and xscale as present (the GPU kernel's order)."""
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

    @numba.njit(parallel=parallel, nogil=True)
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

    @numba.njit(parallel=parallel, nogil=True)
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
