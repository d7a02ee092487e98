"""Launch geometry: frozen specs and the one place their thresholds live.

Batch invariance (API.md) constrains what may depend on what.  A row's float32 reduction order is
fixed by its :class:`RowLayout` (threads per row, chunks per thread), which is a function of N and
the dtype only.  Everything else (rows per block, grid, vector or scalar access) may follow M and
the pointers, because every such variant computes the same per-chunk sums in the same order.
"""
from dataclasses import dataclass

from .. import _dtypes

CHUNK_BYTES = 16            # one 128-bit access: 8 16-bit or 4 32-bit elements
MAX_THREADS = 1024          # per row
# target 128-bit loads in flight per thread per row, by element size.  H200, CUPTI device time,
# write flush (benchmarks/NOTES.md, results/tune_fwd_*.json), % of copy:
#   bf16 chunks 2/3/4: 32768x4096 96/97/97, 4096x4096 83/85/84, 1024x8192 69/71/70
#   fp32 4096x4096: 88/89/94
CHUNKS_PER_THREAD = {2: 3, 4: 4}
MAX_CACHED_FLOATS = 32      # row values a thread keeps in registers between the two passes
# threads per block when a row needs fewer (several rows per block); >= 64 so AMD wavefronts
# are full.  128 and 512 tied within 1 point at every shape on the H200 sweep.
BLOCK_THREADS = 128


def ceil_div(a, b):
    return -(-a // b)


def next_pow2(n):
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class RowLayout:
    """How one row is split over threads: thread ``t`` owns chunks ``t, t+threads, ...``."""
    n: int
    chunk: int              # elements per 16-byte chunk
    threads: int
    chunks_per_thread: int
    cached: bool            # the row stays in registers between the passes (else it is re-read)

    @property
    def n_chunks(self):
        return ceil_div(self.n, self.chunk)


def row_layout(n, dtype):
    """The per-row reduction shape: a function of ``n`` and ``dtype`` only (batch invariance)."""
    itemsize = _dtypes.ITEMSIZE[dtype]
    chunk = CHUNK_BYTES // itemsize
    n_chunks = ceil_div(n, chunk)
    if n_chunks <= 32:
        # a power of two so the butterfly stays inside aligned lane groups on 32- and 64-lane warps
        threads = next_pow2(n_chunks)
    else:
        # a multiple of 64 is a whole number of warps on NVIDIA and of wavefronts on AMD
        threads = min(MAX_THREADS, 64 * ceil_div(ceil_div(n_chunks, CHUNKS_PER_THREAD[itemsize]), 64))
    per_thread = ceil_div(n_chunks, threads)
    return RowLayout(n=n, chunk=chunk, threads=threads, chunks_per_thread=per_thread,
                     cached=per_thread * chunk <= MAX_CACHED_FLOATS)


def rows_per_block(layout):
    return max(1, BLOCK_THREADS // layout.threads)


@dataclass(frozen=True)
class FwdSpec:
    """Compile-time constants of one forward kernel.  ``residual``, ``quant`` and ``xscale``
    switch the same row body to the fused residual add and to dynamic quantisation."""
    layout: RowLayout
    rows: int               # rows per block
    dtype: str              # x / y
    weight: str             # weight dtype, or "" for no weight
    vector: bool            # 128-bit accesses (row starts, strides and weight 16-byte aligned)
    store_rstd: bool
    residual: bool = False  # h = round(x + residual) is normalised and stored to residual_out
    quant: str = ""         # "int8" | "float8_e4m3fn": y quantised per row (q, yscale); "" not
    xscale: str = ""        # SmoothQuant scale dtype (float32 or x's), "" for none

    @property
    def fused(self):
        """Built with the fused signature (residual / quant / xscale) rather than rms_norm's."""
        return self.residual or bool(self.quant) or bool(self.xscale)


def fwd_spec(n, dtype, weight, vector, store_rstd, residual=False, quant="", xscale=""):
    """The forward kernel a call runs (the dispatcher's only decision for the forward)."""
    layout = row_layout(n, dtype)
    return FwdSpec(layout=layout, rows=rows_per_block(layout), dtype=dtype, weight=weight,
                   vector=vector, store_rstd=store_rstd, residual=residual, quant=quant,
                   xscale=xscale)
