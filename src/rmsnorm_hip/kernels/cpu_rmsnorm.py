"""CPU row kernels (numba CPU JIT): each runs a range of rows on one thread, with the GIL released,
so the backend spreads the rows of a large call over a pool of threads (backends/cpu.py).

A CPU row runs on one core, so the GPU's thread layout has no meaning here; the row math and the
16-bit codecs are the same device helpers the GPU kernels use.  A row's sum of squares is kept in
eight interleaved float32 partial sums combined pairwise, a fixed order that depends on N only.
Division follows IEEE (numba's ``error_model="numpy"``), as on the GPU: an all-zero row with
eps = 0 gives NaN rather than raising ZeroDivisionError.
"""
import numba
import numpy as np
from numba import float32

from .. import _dtypes
from ._rowops import codec

LANES = 8


BLOCK = 512      # elements a block's eight lanes sum before the blocks are added pairwise


def make_lane_sum(intr, term):
    """row_sum(a, b, w, off, n): sum of ``term(a, b, w, off, j)`` over j < n, in float32, in an
    order that depends on N only: blocks of BLOCK elements, each in eight interleaved partial
    sums combined pairwise, and the block sums added as a pairwise tree (the block sum k joins
    its neighbours as the binary carries of k say).  The error then grows with log N, not N
    (relative 1e-6 at N = 2**21, against 3.5e-5 for one pass of eight lanes)."""
    @intr.jitable
    def block_sum(a, b, w, off, start, stop):
        p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = float32(0.0)
        full = stop - (stop - start) % LANES
        for j in range(start, full, LANES):
            p0 += term(a, b, w, off, j)
            p1 += term(a, b, w, off, j + 1)
            p2 += term(a, b, w, off, j + 2)
            p3 += term(a, b, w, off, j + 3)
            p4 += term(a, b, w, off, j + 4)
            p5 += term(a, b, w, off, j + 5)
            p6 += term(a, b, w, off, j + 6)
            p7 += term(a, b, w, off, j + 7)
        for j in range(full, stop):
            p0 += term(a, b, w, off, j)
        return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))

    @intr.jitable
    def lane_sum(a, b, w, off, n):
        if n <= BLOCK:
            return block_sum(a, b, w, off, 0, n)
        stack = np.empty(64, np.float32)      # pending sums of 1, 2, 4, ... blocks
        depth = 0
        k = 0
        for start in range(0, n, BLOCK):
            s = block_sum(a, b, w, off, start, min(start + BLOCK, n))
            k += 1
            carry = k
            while carry & 1 == 0:
                depth -= 1
                s = stack[depth] + s
                carry >>= 1
            stack[depth] = s
            depth += 1
        total = stack[depth - 1]
        for d in range(depth - 2, -1, -1):
            total = stack[d] + total
        return total

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


def make_cpu_rmsnorm_fwd(intr, dtype, weight_dtype):
    """fwd(x (M, N), weight (N,), y (M, N), rstd (M,), eps, weight_offset, store_rstd, lo, hi):
    rows lo to hi, in storage dtypes; rows may be strided."""
    encode = codec(intr, dtype)[1]
    row_sumsq = make_row_sumsq(intr, dtype)
    scale = make_scale(intr, dtype, weight_dtype)

    @numba.njit(nogil=True, error_model="numpy")
    def rmsnorm_fwd(x, weight, y, rstd, eps, weight_offset, store_rstd, lo, hi):
        n = x.shape[1]
        for i in range(lo, hi):
            row = x[i]
            r = float32(1.0) / np.sqrt(row_sumsq(row, n) / float32(n) + eps)
            if store_rstd:
                rstd[i] = r
            for j in range(n):
                y[i, j] = encode(scale(row, j, r, weight, weight, weight_offset))

    return rmsnorm_fwd


def make_cpu_fused_fwd(intr, dtype, weight_dtype, has_residual, quant, xscale_dtype):
    """fwd(x, residual, weight, xscale, y, residual_out, rstd, yscale, eps, weight_offset,
    store_rstd, lo, hi): rows lo to hi, the forward's fused switches (see kernels/rmsnorm_fwd.py)
    on (M, N) storage views, rows may be strided.  A row is one pass writing h = round(x +
    residual) to residual_out (which may be residual), then rms_norm's row over h as stored;
    quantised rows take max|y| in a pass before the one that writes q.  Each element is read
    before it is written, so y may be x and residual_out residual."""
    decode, encode, _ = codec(intr, dtype)
    encode_q = codec(intr, quant)[1] if quant else encode
    qmax = float32(_dtypes.QMAX[quant]) if quant else float32(1.0)
    row_sumsq = make_row_sumsq(intr, dtype)
    scale = make_scale(intr, dtype, weight_dtype, xscale_dtype)
    max_nan = intr.max_nan

    @numba.njit(nogil=True, error_model="numpy")
    def fused_fwd(x, residual, weight, xscale, y, residual_out, rstd, yscale, eps, weight_offset,
                  store_rstd, lo, hi):
        n = x.shape[1]
        for i in range(lo, hi):
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
                if inv <= float32(3.4028235e38):
                    for j in range(n):
                        y[i, j] = encode_q(scale(h, j, r, weight, xscale, weight_offset) * inv)
                else:           # a subnormal yscale, whose reciprocal overflows: divide
                    for j in range(n):
                        y[i, j] = encode_q(scale(h, j, r, weight, xscale, weight_offset) / s)
            else:
                for j in range(n):
                    y[i, j] = encode(scale(h, j, r, weight, xscale, weight_offset))

    return fused_fwd

BWD_GROUPS = 64   # row groups (dweight partial rows); a function of M only: deterministic


def bwd_group_rows(m, groups, g):
    """The first row of row group ``g`` of ``groups`` (a function of M only)."""
    return g * m // groups


def make_cpu_rmsnorm_bwd(intr, dtype, weight_dtype, recompute_rstd, has_dres):
    """bwd(dy, x, weight, rstd, dres, dx, partial (G, N) float32, eps, weight_offset, g0, g1):
    dx row by row for the rows of groups g0 to g1, and each group's dweight partial row (the sum
    of its rows' dy * x_hat; :func:`make_dweight_sum` adds the partial rows in group order)."""
    decode, encode, _ = codec(intr, dtype)
    decode_w = codec(intr, weight_dtype or _dtypes.FLOAT32)[0]
    has_weight = bool(weight_dtype)
    row_sumsq = make_row_sumsq(intr, dtype)

    @intr.jitable
    def x_times_wdy(x, dy, w, off, j):
        g = decode(dy[j])
        if has_weight:
            g = g * (decode_w(w[j]) + off)
        return decode(x[j]) * g

    row_dot = make_lane_sum(intr, x_times_wdy)

    @numba.njit(nogil=True, error_model="numpy")
    def rmsnorm_bwd(dy, x, weight, rstd, dres, dx, partial, eps, weight_offset, g0, g1):
        m, n = x.shape
        groups = partial.shape[0]
        for g in range(g0, g1):
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

    return rmsnorm_bwd


def make_dweight_sum(intr, weight_dtype):
    """dweight_sum(partial (G, N) float32, dweight (N,)): the partial rows added in group order,
    rounded once to the weight's dtype."""
    encode_w = codec(intr, weight_dtype)[1]

    @numba.njit(nogil=True, error_model="numpy")
    def dweight_sum(partial, dweight):
        groups, n = partial.shape
        for j in range(n):
            total = float32(0.0)
            for g in range(groups):
                total += partial[g, j]
            dweight[j] = encode_w(total)

    return dweight_sum
