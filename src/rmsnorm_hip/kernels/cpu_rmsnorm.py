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


def make_cpu_rmsnorm_fwd(intr, dtype, weight_dtype, parallel):
    """fwd(x (M, N), weight (N,), y (M, N), rstd (M,), eps, weight_offset, store_rstd) in storage
    dtypes; rows may be strided.  ``parallel`` spreads rows over cores (worth it past ~1M
    elements: waking the thread pool costs milliseconds on small inputs)."""
    decode, encode, _ = codec(intr, dtype)
    decode_w = codec(intr, weight_dtype or _dtypes.FLOAT32)[0]
    has_weight = bool(weight_dtype)
    row_sumsq = make_row_sumsq(intr, dtype)

    @numba.njit(parallel=parallel, nogil=True)
    def rmsnorm_fwd(x, weight, y, rstd, eps, weight_offset, store_rstd):
        m, n = x.shape
        for i in prange(m):
            r = float32(1.0) / np.sqrt(row_sumsq(x[i], n) / float32(n) + eps)
            if store_rstd:
                rstd[i] = r
            for j in range(n):
                v = decode(x[i, j]) * r
                if has_weight:
                    v = v * (decode_w(weight[j]) + weight_offset)
                y[i, j] = encode(v)

    return rmsnorm_fwd
