"""RMSNorm forward kernel.

    rstd = 1 / sqrt(mean(x**2) + eps)            per row, float32
    y    = (x * rstd) * (weight + weight_offset)   one rounding to y's dtype

Blocks of ``threads x rows`` threads (blockDim = (threads, rows)); thread ``t`` of a row owns
chunks ``t, t + threads, ...``.  Pass 1 loads them, sums their squares and reduces across the
row; pass 2 scales and stores them.  Cached layouts keep the row in registers between the passes
(looped ones re-read x).  Each block owns ``rows`` rows; a row's arithmetic does not depend on
the grid.  Rows past M take part in the reductions and store nothing; absent arrays (no weight,
no rstd) are null pointers that are never touched.
"""
import math

from numba import float32, int64, types

from .. import _dtypes
from ._config import FwdSpec
from ._rowops import ChunkIO, make_chunk_sumsq, make_row_sum


def argtypes(spec: FwdSpec):
    """(x, weight, y, rstd, m, x_row_stride, y_row_stride, eps, weight_offset)"""
    data = types.CPointer(_numba_storage(spec.dtype))
    weight = types.CPointer(_numba_storage(spec.weight or _dtypes.FLOAT32))
    return (data, weight, data, types.CPointer(types.float32), types.int64, types.int64,
            types.int64, types.float32, types.float32)


def _numba_storage(dtype):
    from numba.np.numpy_support import from_dtype
    return from_dtype(_dtypes.STORAGE[dtype])


def make_rmsnorm_fwd(intr, spec: FwdSpec):
    layout = spec.layout
    n, chunk, threads = layout.n, layout.chunk, layout.threads
    per_thread, cached, rows = layout.chunks_per_thread, layout.cached, spec.rows
    cache_len = per_thread * chunk if cached else chunk
    has_weight, store_rstd = bool(spec.weight), spec.store_rstd
    gpu, jitable = intr.gpu, intr.jitable
    x_io = ChunkIO(intr, spec.dtype, chunk, n, spec.vector)
    w_io = ChunkIO(intr, spec.weight or _dtypes.FLOAT32, chunk, n, spec.vector)
    chunk_sumsq = make_chunk_sumsq(intr, chunk)
    row_sum, warps_per_row = make_row_sum(intr, threads)
    load_x, store_y, load_w = x_io.load, x_io.store, w_io.load
    n_f32 = float32(n)

    @jitable
    def load_row(x, x_start, live, tx, vals):
        """This thread's chunks of a row into vals (zeros where the row or chunk does not exist)."""
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if live and col0 < n:
                load_x(x, x_start, col0, vals, k * chunk)
            else:
                for e in range(chunk):
                    vals[k * chunk + e] = float32(0.0)

    @jitable
    def sumsq_row(x, x_start, live, tx, vals):
        """This thread's share of the row's sum of squares (loading chunks when not cached)."""
        acc = float32(0.0)
        for k in range(per_thread):
            slot = k * chunk if cached else 0
            if not cached:
                col0 = (tx + k * threads) * chunk
                if live and col0 < n:
                    load_x(x, x_start, col0, vals, 0)
                else:
                    for e in range(chunk):
                        vals[e] = float32(0.0)
            acc += chunk_sumsq(vals, slot)
        return acc

    @jitable
    def finish_row(x, weight, y, rstd, row, x_start, y_stride, tx, r, weight_offset, vals, wvals):
        """Pass 2 of a live row: scale this thread's chunks and store them."""
        if store_rstd and tx == 0:
            rstd[row] = r
        y_start = row * y_stride
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if col0 < n:
                slot = k * chunk if cached else 0
                if not cached:
                    load_x(x, x_start, col0, vals, slot)
                if has_weight:
                    load_w(weight, 0, col0, wvals, 0)
                for e in range(chunk):
                    v = vals[slot + e] * r
                    if has_weight:
                        v = v * (wvals[e] + weight_offset)
                    vals[slot + e] = v
                store_y(y, y_start, col0, vals, slot)

    def rmsnorm_fwd(x, weight, y, rstd, m, x_stride, y_stride, eps, weight_offset):
        tx = gpu.threadIdx.x
        ty = gpu.threadIdx.y
        red = gpu.shared.array((1, rows, warps_per_row), float32)
        vals = gpu.local.array(cache_len, float32)
        wvals = gpu.local.array(chunk, float32)
        row = int64(gpu.blockIdx.x) * rows + ty
        live = row < m
        x_start = row * x_stride
        if cached:
            load_row(x, x_start, live, tx, vals)
        acc = sumsq_row(x, x_start, live, tx, vals)
        total = row_sum(acc, red, 0, ty, tx)
        r = float32(1.0) / math.sqrt(total / n_f32 + eps)
        if live:
            finish_row(x, weight, y, rstd, row, x_start, y_stride, tx, r, weight_offset, vals,
                       wvals)

    return rmsnorm_fwd
