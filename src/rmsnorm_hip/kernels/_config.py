"""Launch geometry: frozen specs and the one place their thresholds live.

Batch invariance (API.md) constrains what may depend on what.  A row's float32 reduction order is
fixed by its :class:`RowLayout` (threads per row, chunks per thread), which is a function of N and
the dtype only.  Everything else (rows per block, grid, vector or scalar access) may follow M and
the pointers, because every such variant computes the same per-chunk sums in the same order.
"""
from dataclasses import dataclass, replace

from .. import _dtypes

CHUNK_BYTES = 16            # one 128-bit access: 8 16-bit or 4 32-bit elements
MAX_THREADS = 1024          # per row
# target 128-bit loads in flight per thread per row, by element size.  H200, CUPTI device time,
# write flush (benchmarks/NOTES.md, results/tune_fwd_*.json), % of copy:
#   bf16 chunks 2/3/4: 32768x4096 96/97/97, 4096x4096 83/85/84, 1024x8192 69/71/70
#   fp32 4096x4096: 88/89/94
CHUNKS_PER_THREAD = {2: 3, 4: 4}
# quantised rows, by vendor.  NVIDIA: bound by instruction issue, not bandwidth (3 bytes per
# element against the forward's 4, ~20 instructions per element), so 4 chunks per thread spread
# the per-row work (reductions, rstd, index arithmetic) over 32 elements instead of 24 and at
# N = 4096 fill the row exactly (128 x 4 chunks: no column checks); ptxas sm_90, bf16
# SmoothQuant int8, main-path instructions per element: 23.1 at 3 chunks, 18.9 at 4
# (benchmarks/NOTES.md).  AMD takes 2 for 16-bit rows: the one-round quantised row (t, weight
# and xscale live across the reduction) took 66-68 VGPRs on gfx942/gfx950 at 3 and 68-101 at 4,
# over the 64 that keep 8 waves per SIMD (aot.MAIN_KERNEL_MAX_VGPRS); nothing measured there says
# the trade would pay.  The simulator runs the NVIDIA layouts.
QUANT_CHUNKS_PER_THREAD = {"cuda": {2: 4, 4: 4}, "hip": {2: 2, 4: 4}}
MAX_CACHED_FLOATS = 32      # row values a thread keeps in registers between the two passes
# threads per block when a row needs fewer (several rows per block); >= 64 so AMD wavefronts
# are full.  128 and 512 tied within 1 point at every shape on the H200 sweep.
BLOCK_THREADS = 128
# streamed forward (cached vector rows): a persistent grid whose programs walk rows, each
# thread loading the next row's words before it reduces and stores this one, so an SM keeps
# loads in flight through its rows' reductions and stores (one-shot blocks load, then compute,
# then store, in step when the batch is a few waves).  Same per-row operations: the same bits.
# Where it runs, per vendor and kind: the most rows per SM it takes (None: any M; 0: never).
# H200, % of copy one-shot -> streamed (results/tune_h200_20261129_s6/tune_stream*.json):
#   rms_norm bf16 1024x8192 71 -> 77, 4096x4096 84 -> 85, 8192x8192 94 -> 92, 32768x4096 97 -> 93
#   fused add bf16 92 -> 86 at 4096x4096, 3-7 points down elsewhere (95 registers: 3 blocks/SM)
#   SmoothQuant int8 bf16 (fma levels) 32768x4096 87.5 -> 93.6, 16384x8192 84 -> 92, 4096x4096
#     62 -> 67, 1024x8192 47 -> 49; float32 x 16384x4096 77 -> 89, 4096x4096 64 -> 72
#   quantised with a residual (bf16 fp8) 32768x4096 97 -> 92, 4096x4096 83 -> 81; with held
#     gains (results/tune_h200_20261130_s9/
#     tune_stream_quant_res_held.json, two runs each) 32768x4096 97.3 -> 92.7, 16384x8192 97.1
#     -> 93.3, 4096x4096 80.0 / 83.5 -> 83.9 / 84.7, 1024x8192 69.1 -> 72.6: streamed up to 32
#     rows per SM
# Decode batches: streamed programs hold their weight, read with the first row, where a one-shot
# row reads it after its reduction (a second memory latency).  H200, fused add bf16, us flushed /
# in a CUDA graph, one-shot -> streamed: 8x4096 3.26 / 3.16 -> 2.32 / 2.65, 128x4096 3.89 / 3.47
# -> 3.23 / 3.21, 512x4096 6.18 / 4.43 -> 6.14 / 4.54, 512x8192 11.76 / 8.02 -> 10.94 / 6.69,
# 2048x4096 18.91 / 18.68 -> 19.12 / 19.01: streamed up to 4 rows per SM (docs/performance.md).
# AMD: not measured, so not streamed.
FWD_STREAM_ROWS_PER_SM = {
    "cuda": {"plain": 16, "residual": 4, "quant": None, "quant_residual": 32},
    "hip": {"plain": 0, "residual": 0, "quant": 0, "quant_residual": 0},
}


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


def _layout(n, dtype, chunks_per_thread, max_cached_floats, max_threads=MAX_THREADS):
    """Threads per row for about ``chunks_per_thread`` chunks each (a power of two up to a warp,
    else a whole number of 64-lane wavefronts, at most MAX_THREADS)."""
    chunk = CHUNK_BYTES // _dtypes.ITEMSIZE[dtype]
    n_chunks = ceil_div(n, chunk)
    if n_chunks <= 32:
        # a power of two so the butterfly stays inside aligned lane groups on 32- and 64-lane warps
        threads = next_pow2(n_chunks)
    else:
        # a multiple of 64 is a whole number of warps on NVIDIA and of wavefronts on AMD
        threads = min(max_threads, 64 * ceil_div(ceil_div(n_chunks, chunks_per_thread), 64))
    per_thread = ceil_div(n_chunks, threads)
    return RowLayout(n=n, chunk=chunk, threads=threads, chunks_per_thread=per_thread,
                     cached=per_thread * chunk <= max_cached_floats)


def row_layout(n, dtype):
    """The per-row reduction shape: a function of ``n`` and ``dtype`` only (batch invariance)."""
    return _layout(n, dtype, CHUNKS_PER_THREAD[_dtypes.ITEMSIZE[dtype]], MAX_CACHED_FLOATS)


def quant_row_layout(n, dtype, vendor="cuda"):
    """The quantised forward's per-row reduction shape: a function of ``n`` and ``dtype`` only on
    a given vendor's GPUs."""
    chunks = QUANT_CHUNKS_PER_THREAD[vendor][_dtypes.ITEMSIZE[dtype]]
    return _layout(n, dtype, chunks, MAX_CACHED_FLOATS)


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
    exact: bool = False     # cached row, every chunk of every thread in it: no column checks
    offset: bool = True     # weight_offset added to the weight (False: the call's offset is 0)
    stream: bool = False    # persistent grid, the next row's words loaded during this row
    held_weights: bool = False      # streamed rows: gains held in registers

    def __post_init__(self):
        if self.xscale and not self.quant:
            raise ValueError(f"FwdSpec: xscale (SmoothQuant) needs quant, got xscale="
                             f"{self.xscale!r}, quant={self.quant!r}")
        # a one-shot block has one row to weigh: nothing to hold the gains across
        if self.held_weights and not (self.stream and (self.weight or self.xscale)):
            raise ValueError(f"FwdSpec: held_weights needs a streamed spec with a weight or "
                             f"xscale, got stream={self.stream}, weight={self.weight!r}, "
                             f"xscale={self.xscale!r}")

    @property
    def fused(self):
        """Built with the fused signature (residual / quant / xscale) rather than rms_norm's."""
        return self.residual or bool(self.quant) or bool(self.xscale)


def fwd_kind(residual, quant):
    """The forward's kinds as FWD_STREAM_ROWS_PER_SM names them."""
    if quant:
        return "quant_residual" if residual else "quant"
    return "residual" if residual else "plain"


def fwd_stream(vendor, residual, quant, m, sm_count):
    """Whether a forward of ``m`` rows takes the streamed grid (where its spec can)."""
    limit = FWD_STREAM_ROWS_PER_SM[vendor][fwd_kind(residual, quant)]
    return limit is None or m <= limit * sm_count


def fwd_spec(n, dtype, weight, vector, store_rstd, residual=False, quant="", xscale="",
             offset=True, stream=False, vendor="cuda"):
    """The forward kernel a call runs (the dispatcher's only decision for the forward) on a
    ``vendor`` ("cuda" or "hip") GPU.  ``offset=False`` (weight_offset == 0) is a variant of the
    quantised rows only: their issue slots are the bound, and it saves one FADD per element
    (the same switch measured nothing on rms_norm and the fused add: tune_stream.json).
    ``stream`` (fwd_stream) applies to cached vector rows.  Streamed rows hold their columns'
    gains in registers for the whole program, loaded with the first row: (weight + offset) *
    xscale when quantised (issue-bound rows: 2-5 points of copy at large M on the H200), weight +
    offset otherwise (a small batch's rows then wait on one memory latency, not two: the weight
    is read before the reduction, not after it).  Every variant forms the same float32 factor,
    so the bits do not depend on it."""
    layout = quant_row_layout(n, dtype, vendor) if quant else row_layout(n, dtype)
    # quantised rows on NVIDIA (issue-bound) drop the per-chunk column checks where the row is
    # exactly threads x chunks; on AMD the branch-free row took the fp32 N = 4096 quantised
    # kernel from 48 to 69 VGPRs (gfx942), over the 64-VGPR gate
    exact = (vendor == "cuda" and bool(quant) and layout.cached and n % layout.chunk == 0
             and layout.n_chunks == layout.threads * layout.chunks_per_thread)
    stream = stream and vector and layout.cached
    held = stream and bool(weight or xscale)
    return FwdSpec(layout=layout, rows=rows_per_block(layout), dtype=dtype, weight=weight,
                   vector=vector, store_rstd=store_rstd, residual=residual, quant=quant,
                   xscale=xscale, exact=exact, offset=offset or not (quant and weight),
                   stream=stream, held_weights=held)


def fwd_programs(spec, m, sm_count, resident_per_sm):
    """Blocks of a forward launch: one per ``rows`` rows, or for a streamed spec the programs
    the device holds at once, no more than there are blocks of rows (H200: capping them at 2 or
    4 per SM measured the same or worse, tune_stream.json; SmoothQuant rows holding their gains
    at 2 or 3 of their 4, 7-20 points worse at every M, tune_stream_cap.json)."""
    blocks = ceil_div(m, spec.rows)
    return max(1, min(blocks, resident_per_sm * sm_count)) if spec.stream else blocks


# ---- backward ---------------------------------------------------------------------------------
# One 128-bit chunk of x and of dy per thread per row (K=1 up to 1024 threads): x, dy, the cached
# weight and the dweight partial then take 4 x 8 floats for 16-bit data.  research/numba-probe/
# BACKWARD.md (H200): N=4096 bf16 with 512 threads at 2 blocks per SM and N=8192 with 1024 threads
# reached 95% / 94% of copy; 128-thread blocks with 4 chunks each needed 168 registers.  (On CUDA
# the 1024-thread rows now take 2 chunks at 512 threads: BWD_TWO_CHUNK_MIN_THREADS.)
BWD_MAX_CACHED_FLOATS = 16       # per array (x, dy, weight, dweight partial) and thread
BWD_LOOPED_THREADS = 512         # threads per row of the looped (uncached) backward layouts
BWD_BLOCKS_PER_SM = 2            # programs per SM for 512-thread rows of one chunk (BACKWARD.md:
                                 # P = 2 x SMs); at most, see bwd_blocks_per_sm
# dweight reduction: blocks of 32 columns (one 128-byte line per warp row) x BWD_REDUCE_GROUPS
# row groups; each thread loads BWD_REDUCE_BATCH of its rows before adding them (in row order).
# H200, N = 4096 bf16, P = 264: 8 groups with the compiler's unroll by 4 (33 rows a thread) took
# 3.8-4.1 us of the 4096x4096 call's 40 (tune_bwd.json); see benchmarks/NOTES.md for the others
BWD_REDUCE_COLUMNS = 32
BWD_REDUCE_GROUPS = 8
BWD_REDUCE_BATCH = 8
# Cached rows (vector access; 16-bit scalar rows of BWD_PACK_SCALAR_MIN_CHUNKS or more) keep x
# and dy as the loaded words between the passes (56 registers instead of 69-77 at N = 4096 bf16:
# two blocks per SM) and load the next row's words, dresidual's and the next rstd ahead of this
# row's reduction where BWD_PREFETCH_MAX_CHUNKS allows (docs/performance.md).
# loads ahead of a row's reduction (the next row's words, dresidual's) only where a thread owns
# at most this many chunks of the row: with two (float32 N = 8192, 16-bit N = 16384: 1024
# threads) they do not fit the 64 registers of a 1024-thread block (ptxas 13.0: 8-132 B spilled
# with them).  H200, us, with them / without (results/tune_h200_20261130_s12/tune_bwd_n16384
# .json, tune_bwd_float32_n8192.json, two runs each): bf16 4096x16384 170.5, 170.1 / 131.0,
# 131.5; 1024x16384 54.2, 55.4 / 44.5, 44.4; float32 4096x8192 127.5, 127.2 / 106.3, 105.9;
# 1024x8192 38.8, 38.0 / 34.4, 34.1; bf16 dresidual 4096x16384 197.9 / 195.7
BWD_PREFETCH_MAX_CHUNKS = 1
# packed 16-bit rows hold their weight's floats for the whole program only where a thread owns at
# most this many chunks of the row; with two (N = 16384: 1024 threads) the held weight spilled
# 36-56 B (ptxas 13.0) and they load it with each chunk instead (an L1 hit; float32 rows of two
# chunks hold theirs without spilling, and loading it measured level or slower).  H200, bf16,
# us, held / loaded, two runs (results/tune_h200_20261130_s13/tune_bwd_n16k_loadw.json):
# 4096x16384 128.1, 128.9 / 118.6, 118.4 (75 -> 82% of copy); 8192x16384 243.1, 241.0 / 222.4,
# 222.2; 1024x16384 44.0, 43.8 / 41.0, 41.1; dresidual level (163.5 / 163.8 at 4096x16384)
BWD_HOLD_WEIGHT_MAX_CHUNKS = 1
# rows with the next row's rstd (BwdSpec.prefetch_rstd), unpaired, of more than 64 registers a
# thread: the dweight partial's fma in pass 1 and its stores with the last row's pass 1, ahead
# of that row's reduction and dx (BwdSpec.early_dweight).  In 64 registers (16-bit N = 4096
# rows of 512 threads, two blocks per SM) it spilled 12-24 B (ptxas 13.0); the 16-bit N = 8192
# rows took 113-119 registers instead of 111-126, float32 N = 4096 94 instead of 96.
# H200, us (kernel 1 + reduction), late / early, three rounds of bf16, two of the others
# (results/tune_h200_20261203_s22/tune_bwd*.json; the same bits in every case):
#   bf16 1024x8192 19.49, 19.34, 19.50 / 18.66, 18.74, 18.70 (kernel 1 17.3-17.6 / 16.6-16.8)
#   bf16 8192x8192 105.79, 105.74, 105.84 / 105.18, 105.12, 105.46
#   bf16 16384x8192 201.62, 201.81, 201.79 / 201.42, 200.69, 200.97
#   bf16 2048x8192 31.42, 32.56, 31.63 / 32.51, 31.54, 31.54 (level within its spread)
#   float32 4096x4096 55.81, 55.90 / 55.25, 55.15; 8192x4096 102.66, 102.74 / 103.09, 102.64;
#   1024x4096 17.79, 17.86 / 17.97, 17.79
#   bf16 rows, float32 weight: 1024x8192 19.57, 19.60 / 19.02, 18.56; 8192x8192 105.89, 105.62
#   / 105.71, 105.71
# With it the bench's backward at 1024x8192 read 74% of copy (16.6 us; 70 is the issue-4 target),
# five rounds 74.4 [73.5, 74.7] (results/bwd_h200_20261203_0801.json, repeat_cases_s22.json).
# AMD: not measured, not taken
BWD_EARLY_DWEIGHT = {"cuda": True, "hip": False}
# 16-bit scalar (unaligned) rows of at least this many chunks a thread keep x and dy as words,
# per vendor.  At one chunk (16-bit N = 4096 unaligned) the words would let two 512-thread blocks
# share an SM as the vector kernel's do (ptxas 13.0: 56-64 registers, no spills, under the
# 2-block bound), where as floats they take 80-97 and one fits: since the grid no longer follows
# the kernel's occupancy (bwd_programs) those rows run 264 programs in two waves, 4-10% slower
# than 132 at small M (H200, results/tune_h200_20261130_s14/tune_bwd_unaligned.json).  Measured
# at one chunk with the shifted spans (scalar_shifted, which words under the 2-block bound
# have no registers for), bf16 % of copy, floats / words (tune_bwd --unaligned, two runs each,
# results/tune_h200_20261201_s15/tune_bwd_unaligned.json): 4096x4096 26.7, 26.8 / 24.6, 24.6;
# 1024x4096 21.3, 21.4 / 16.7, 16.7; 32768x4096 30.5, 30.5 / 27.6, 27.8.  Words with the next row
# loaded ahead in one block (128 registers, shifted): 4096x4096 25.8, 32768x4096 28.6 against
# floats' 26.3 / 29.3 in the same run (unaligned_quant_bwd.json).  Floats stay
BWD_PACK_SCALAR_MIN_CHUNKS = {"cuda": 2, "hip": 2}
# rows of one chunk a thread over at least this many threads (per vendor; None: never) take two
# chunks a thread at half the threads, with at most 1024 chunks of rows per SM as before: one
# block per SM of 512 threads with 128 registers each, so the weight is held and the next row
# loaded ahead as in the one-chunk rows.  H200, us, 1024 x 1 / 512 x 2 (16-bit N = 8192, float32
# N = 4096), two runs each (results/tune_h200_20261130_s14/tune_bwd*.json):
#   bf16 16384x8192 203.5, 203.2 / 200.9, 201.5; 8192x8192 107.0, 107.2 / 105.5, 105.2;
#   4096x8192 58.2, 58.3 / 57.3, 57.6; 2048x8192 33.5, 33.6 / 34.2, 34.0; 1024x8192 20.9,
#   20.7 / 20.0, 20.1; dresidual 8192x8192 134.9, 134.6 / 133.4, 133.5, 1024x8192 24.6, 24.5 /
#   23.7, 23.4; float32 4096x4096 55.9, 55.8 / 54.8, 55.2; dx alone 8192x8192 102.5 / 100.7.
# Rows of 576-960 threads (N = 4097-7680 16-bit) measured level either way, and 16-bit N = 4096
# as 256 x 2 (two blocks per SM) 1-2.5% slower at every M: they keep one chunk.  AMD: not
# measured, so not changed
BWD_TWO_CHUNK_MIN_THREADS = {"cuda": 1024, "hip": None}


# packed 16-bit rows of 512 threads x 1 chunk (N = 3585..4096) run two to a 1024-thread block
# (one block per SM instead of two), each row waiting at its own named barrier
# (intrinsics row_barrier), and the two rows' dweight partials summed in shared memory into one
# workspace row: half the partial rows to write and to reduce.  Session 11 paired rows at the
# block's barrier and lost what it saved to rows waiting for each other (benchmarks/NOTES.md).
# H200, bf16 N = 4096, us (kernel 1 + reduction), three rounds, unpaired / paired
# (results/tune_h200_20261201_s17/tune_bwd_paired.json; dresidual two rounds):
#   1024 rows 12.8, 13.0, 12.8 / 11.9, 12.0, 12.0     2048 rows 19.3, 19.2, 19.4 / 18.7 (x3)
#   4096 rows 31.9, 31.6, 31.6 / 31.8, 31.8, 31.4     8192 rows 56.2, 56.3, 56.6 / 55.8 (x3)
#   32768 rows 197.8, 198.1, 197.6 / 196.9, 197.2, 197.1
#   dresidual 4096 rows 39.0, 39.1 / 39.3, 39.2; 2048 rows 23.3, 23.1 / 22.9, 23.0
# The reduction 2.3-2.7 -> 2.0-2.4 us everywhere; kernel 1 shorter at 1024-2048 rows, level
# from 4096.  Shorter rows (fewer threads, two blocks per SM that hold less than 1024 threads)
# were not measured and do not pair.  No named barriers on AMD: not there
BWD_PAIRED_ROWS = {"cuda": True, "hip": False}
# ...where the call has at least this many rows per SM (bwd_pair_rows): a grid of fewer rows runs
# a block or less per SM, and there the 1024-thread block is slower.  H200, bf16 N = 4096, us,
# unpaired / paired, two rounds (tune_bwd_paired_small.json): 1 row 4.06, 4.05 / 4.94, 4.96;
# 32 rows 4.48, 4.53 / 5.60, 5.54; 132 rows 6.31, 6.30 / 6.24, 6.24; 264 rows 8.38, 8.37 / 7.74,
# 7.76; 528 rows 9.74, 9.73 / 9.07, 9.02
BWD_PAIRED_MIN_ROWS_PER_SM = 2


def bwd_pair_rows(m, sm_count, vendor="cuda"):
    """Whether a backward call of ``m`` rows pairs its rows where the layout allows
    (BWD_PAIRED_ROWS): part of the call's kernel choice, as the grid's programs are.  dweight's
    summation order already depends on M; dx's does not (pairing leaves each row's reduction
    as it is)."""
    return bool(BWD_PAIRED_ROWS[vendor]) and m >= BWD_PAIRED_MIN_ROWS_PER_SM * sm_count


# Calls that move few bytes load x, dy and dresidual evict-first (intrinsics load_b128_stream:
# CUDA ld.global.cs).  The benchmark's L2 flush, like the kernels before a backward in a model,
# leaves the L2 full of dirty lines; each line a plain load allocates evicts one of them (a DRAM
# write), where evict-first lines are recycled among themselves.  Larger calls lose: the hint
# costs them more than the write-backs they save.  H200, bf16, us, plain / hinted, two rounds
# each (results/tune_h200_20261201_s18/tune_bwd_stream*.json), by x's bytes:
#   16 MiB: 1024x8192 19.74, 19.82 / 19.14, 19.22 (again: 19.92, 20.06 / 19.06, 19.10);
#     2048x4096 18.70, 18.80 / 18.16, 18.06; dresidual 1024x8192 23.22, 23.01 / 22.22, 22.30
#   32 MiB: 2048x8192 33.47, 33.44 / 31.38, 31.36; 4096x4096 31.30, 31.81 / 31.12, 31.26 (again:
#     31.74, 31.94 / 31.70, 32.11); dresidual 4096x4096 39.05, 39.12 / 39.23, 38.51
#   48 MiB: 3072x8192 45.84, 45.77 / 45.81, 45.30; 6144x4096 44.24, 44.30 / 45.66, 46.00
#   64 MiB and up: 8192x4096 55.74, 55.89 / 58.21, 58.19; 4096x8192 57.28, 57.63 / 57.63, 57.63;
#     8192x8192 105.6, 105.7 / 109.3, 109.5; 32768x4096 197.5, 197.2 / 214.9, 215.0
# An L2 evict-first policy (createpolicy) instead of .cs measured within the rounds' spread, and
# the dx stores hinted too, alone or with the loads, level or slower.  The forward's fused add
# loses 6-10 points with its x and residual loads hinted at every size measured (2048x4096 to
# 8192x4096), SmoothQuant is level: neither takes it.  AMD: not measured, no hint.  Only the
# measured rows take it: 16-bit packed (vector) rows.  Hinted, ptxas 13.0 spilled 100-152 B in the
# float32 N = 16384 rows and 12 B in a looped bf16 row with dresidual.
BWD_STREAM_LOADS = {"cuda": True, "hip": False}
# ...in calls whose x is at most this many bytes
BWD_STREAM_MAX_BYTES = 32 << 20

# deterministic=False: a float32 weight's dweight summed by float32 atomics (a zeroed dweight,
# one red.global.add.v4.f32 per 4 columns of each program's partial) instead of P partial rows and
# dweight_reduce.  Issue 4 allows such a path only where it measurably wins.  H200, device time
# (us, two rounds each, the zero fill's 0.8 included; results/tune_h200_20261202_s20/), partial
# rows + reduction / atomics:
#   bf16 rows, float32 weight: 1x4096 4.03, 4.05 / 3.57, 3.55; 8x4096 4.22, 4.27 / 3.71, 3.71;
#     32x4096 4.46, 4.50 / 4.10, 4.13; 64x4096 4.91, 4.93 / 5.06, 5.04; 100x4096 5.97, 5.95 /
#     6.30, 6.34; 132x4096 6.54, 6.48 / 7.74, 7.73; 264x4096 7.92, 8.10 / 8.80, 8.77;
#     4096x4096 31.33, 31.92 / 31.50, 31.26; 8192x4096 56.51, 56.19 / 55.33, 55.62;
#     16384x4096 103.0, 103.2 / 101.8, 101.8; 32768x4096 198.1, 197.6 / 195.5, 195.6;
#     65536x4096 385.9, 385.6 / 384.5, 384.4; 1x8192 5.25, 5.27 / 4.74, 4.71; 32x8192 5.97,
#     5.98 / 6.13, 6.10; 132x8192 9.02, 9.06 / 11.73, 11.63; 1024x8192 19.47, 19.38 / 21.65,
#     21.55; 8192x8192 105.9, 106.0 / 105.8, 105.9; 16384x8192 202.4, 202.2 / 201.2, 201.6
#   float32 rows: 32x4096 4.27, 4.35 / 3.87, 3.92; 264x4096 8.05, 8.10 / 8.53, 8.54; 4096x4096
#     55.6, 55.7 / 54.9, 54.3; 16384x4096 197.7, 197.7 / 196.1, 196.3
#   bf16 with dresidual: 32x4096 4.51, 4.50 / 4.38, 4.40; 1024x8192 22.7, 22.6 / 24.2, 24.2;
#     4096x4096 39.0, 38.8 / 38.7, 38.9; 32768x4096 254.3, 253.6 / 253.4, 253.1
# As shipped (tune_bwd_wfloat32_shipped.json, tune_bwd_float32_shipped.json; deterministic /
# deterministic=False, two rounds): 1x4096 4.00, 4.06 / 3.55, 3.52; 8x4096 4.21, 4.19 / 3.71,
# 3.71; 8192x4096 56.1, 55.9 / 55.0, 55.3; 8192x8192 105.6, 105.3 / 105.2, 105.2; 32768x4096
# 197.6, 197.6 / 195.7, 195.5; float32 rows 16384x4096 197.3, 197.4 / 196.0, 195.8; where the
# rule keeps the reduction, the same kernels (132x4096 .. 4096x4096 within 0.5 us).  At
# 32x4096 (2^17 partial floats) the atomics measured 0.4 us ahead in one run and level in the
# next (bf16 rows; float32 rows 0.4 ahead in both): the bound is 2^16.
# The atomics cost little where few programs add or where programs walk many rows (their ends
# spread out); where 128-264 programs of a few rows each finish together, all adding into the
# same 16-32 KB, they cost kernel 1 2-4 us, more than the reduction.  A 16-bit weight needs a conversion after the sum as well: zero fill, atomics and
# conversion took as long as the two deterministic kernels or longer at every shape (bf16,
# 1x4096 4.1 / 4.9 us, 1024x8192 19.2 / 23.4, 32768x4096 196.9 / 196.7): not taken.  Nor by the
# scalar (unaligned-row) kernels, not measured.  AMD: not measured, not taken.
BWD_ATOMIC_DWEIGHT = {"cuda": True, "hip": False}
BWD_ATOMIC_MAX_FLOATS = 1 << 16         # few programs: partial rows x N at most this
BWD_ATOMIC_MIN_ROWS_PER_PROGRAM = 48    # or many rows a program (8192x4096: 62, 4096x4096: 31)


def bwd_stream_rows(m, n, dtype, vendor="cuda"):
    """Whether a backward call of ``m`` rows of ``n`` ``dtype`` elements asks for evict-first
    row loads (BWD_STREAM_LOADS; bwd_spec gives them to 16-bit packed vector rows only): part of
    the call's kernel choice.  The same bits either way."""
    return bool(BWD_STREAM_LOADS[vendor]) and m * n * _dtypes.ITEMSIZE[dtype] <= BWD_STREAM_MAX_BYTES


def bwd_row_layout(n, dtype, vendor="cuda"):
    """The backward's per-row layout (a function of N and dtype only on a given vendor's GPUs: dx
    is batch invariant).  Rows too long to cache take BWD_LOOPED_THREADS: at 1024 threads the
    dresidual forms need more than the 64 registers such a block may have (ptxas 13.5 spilled
    16-20 B)."""
    layout = _layout(n, dtype, 1, BWD_MAX_CACHED_FLOATS)
    two_chunks = BWD_TWO_CHUNK_MIN_THREADS[vendor]
    if (two_chunks is not None and layout.cached and layout.chunks_per_thread == 1
            and layout.threads >= two_chunks):
        # half the threads, whole 64-lane wavefronts (a tuned threshold may not be a multiple)
        layout = _layout(n, dtype, 2, BWD_MAX_CACHED_FLOATS, 64 * ceil_div(layout.threads, 128))
    if not layout.cached:
        layout = _layout(n, dtype, 1, BWD_MAX_CACHED_FLOATS, BWD_LOOPED_THREADS)
    return layout


@dataclass(frozen=True)
class BwdSpec:
    """Compile-time constants of the backward's row kernel."""
    layout: RowLayout
    rows: int               # rows per block (per program step)
    dtype: str              # dy, x, dx, dresidual
    weight: str             # weight / dweight dtype, "" for no weight
    vector: bool
    recompute_rstd: bool    # rstd from x (rstd=None) instead of the forward's
    dresidual: bool
    packed: bool = False    # x and dy kept as loaded 16-bit pairs between the passes
    prefetch: bool = False  # packed rows: the next row's words loaded before this row's reduction
    early_dres: bool = False    # packed rows: dresidual's words loaded before the reduction too
    prefetch_rstd: bool = False     # prefetching rows: the next row's rstd loaded with its words
    hold_weight: bool = True        # cached rows: the weight's floats held for the whole program
    paired: bool = False    # two rows a block at their own barriers, one partial row (BWD_PAIRED_ROWS)
    # one row a block standing in for a paired kernel (the scalar form of a call shape whose
    # vector form pairs): twice the paired grid's programs, so programs 2p and 2p + 1 walk paired
    # program p's two rows, and the reduction sums their partial rows pairwise first
    # (ReduceSpec.pairs): dweight is then bitwise the paired kernel's, as API.md asks of a
    # row-strided call against its contiguous copy
    pair_twin: bool = False
    # 16-bit packed vector (aligned) rows: x, dy and dresidual loaded evict-first (intrinsics
    # load_b128_stream), where the call takes it (bwd_stream_rows)
    stream_loads: bool = False
    # a float32 weight's dweight summed by float32 atomics from each program's partial, into a
    # zeroed dweight, with no reduction kernel (deterministic=False; cached rows;
    # bwd_atomic_dweight)
    atomic_dweight: bool = False
    # rows whose rstd is known before their reduction (prefetch_rstd), unpaired: the dweight
    # partial accumulated in pass 1 and stored with the last row's pass 1 (BWD_EARLY_DWEIGHT)
    early_dweight: bool = False


def bwd_spec(n, dtype, weight, vector, recompute_rstd, dresidual, vendor="cuda", pair=True,
             stream=False, atomic=False):
    """The backward kernel of a call shape; ``pair``: rows of the layouts that pair do
    (BWD_PAIRED_ROWS; bwd_pair_rows decides it per call); ``stream``: 16-bit packed vector rows
    load evict-first where the vendor does (BWD_STREAM_LOADS; bwd_stream_rows decides it per
    call; other rows ignore it)."""
    layout = bwd_row_layout(n, dtype, vendor)
    itemsize = _dtypes.ITEMSIZE[dtype]
    # 16-bit rows of 2 chunks a thread keep their words in the scalar (unaligned) form too: as
    # floats, x and dy took the 1024-thread block 148-240 B past its registers (ptxas 13.0,
    # N = 16384).  The words are read one element at a time and decoded as the vector form's
    # are: the same floats, so the same bits
    packed = layout.cached and (
        vector or (itemsize == 2
                   and layout.chunks_per_thread >= BWD_PACK_SCALAR_MIN_CHUNKS[vendor]))
    # with rstd recomputed and dresidual too, the prefetch words take the kernel past 64
    # registers (4 B spilled, ptxas 13.5, N = 4096 bf16 with weight): that pair goes without
    both = recompute_rstd and dresidual
    budget = _bwd_register_units(layout)
    ahead = layout.chunks_per_thread <= BWD_PREFETCH_MAX_CHUNKS * budget
    prefetch = packed and not both and ahead
    if packed:
        hold_weight = (itemsize == 4
                       or layout.chunks_per_thread <= BWD_HOLD_WEIGHT_MAX_CHUNKS * budget)
    else:
        # unpacked (scalar-access) 1024-thread rows hold x and dy as floats: with dresidual and
        # the weight held too they spilled 8-28 B (ptxas 13.0, N = 8192 as 1024 x 1, which AMD
        # keeps; float32 N = 8192 is such a row on CUDA too); they load it with each chunk
        hold_weight = not (dresidual and layout.threads >= 1024)
    rows = rows_per_block(layout)
    # rows that pair (BWD_PAIRED_ROWS) do in their packed (vector) form; the scalar form keeps
    # one row a block (as floats it takes 80-97 registers: a 1024-thread block would spill) and
    # stands in for the pair: see BwdSpec.pair_twin
    pairable = bool(pair and BWD_PAIRED_ROWS[vendor] and weight and itemsize == 2
                    and layout.cached and layout.chunks_per_thread == 1
                    and 2 * layout.threads == MAX_THREADS and bwd_blocks_per_sm(layout) == 2)
    paired = pairable and packed
    prefetch_rstd = prefetch and not recompute_rstd and not dresidual
    return BwdSpec(layout=layout, rows=2 if paired else rows, dtype=dtype, weight=weight,
                   vector=vector, recompute_rstd=recompute_rstd, dresidual=dresidual,
                   packed=packed, prefetch=prefetch,
                   early_dres=packed and dresidual and ahead,
                   prefetch_rstd=prefetch_rstd,
                   hold_weight=hold_weight, paired=paired, pair_twin=pairable and not packed,
                   stream_loads=bool(stream and packed and vector and itemsize == 2
                                     and BWD_STREAM_LOADS[vendor]),
                   atomic_dweight=bool(atomic and weight == _dtypes.FLOAT32 and layout.cached
                                       and vector),
                   early_dweight=bool(prefetch_rstd and weight and not paired and budget > 1
                                      and BWD_EARLY_DWEIGHT[vendor]))


def bwd_atomic_dweight(spec, m, programs, vendor="cuda"):
    """Whether a deterministic=False backward call of ``m`` rows (``spec`` its deterministic
    kernel, ``programs`` its grid) sums dweight by atomics: BWD_ATOMIC_DWEIGHT, where measured
    faster (a float32 weight, cached vector rows (the unaligned fallback keeps its partial rows);
    few partial floats in all, or many rows a program)."""
    if not (BWD_ATOMIC_DWEIGHT[vendor] and spec.weight == _dtypes.FLOAT32
            and spec.layout.cached and spec.vector):
        return False
    return (bwd_ws_rows(spec, programs) * spec.layout.n <= BWD_ATOMIC_MAX_FLOATS
            or m >= BWD_ATOMIC_MIN_ROWS_PER_PROGRAM * programs)


def bwd_kernel_spec(spec):
    """The spec a backward kernel is compiled from: a pair twin's grid and reduction differ
    from the unpaired scalar kernel's (bwd_programs, reduce_spec), its code does not, so both
    launch one compiled kernel."""
    return replace(spec, pair_twin=False) if spec.pair_twin else spec


def bwd_spec_blocks_per_sm(spec):
    """Blocks per SM of a backward kernel: a paired block is two of its layout's."""
    return max(1, bwd_blocks_per_sm(spec.layout) // (2 if spec.paired else 1))


def bwd_partial_order(spec, m, sm_count, vendor="cuda"):
    """(row walkers, rows a partial is summed over before the reduction) of a backward grid:
    what sets dweight's summation order, the same for every variant of a call shape."""
    programs = bwd_programs(spec, m, sm_count, vendor)
    if spec.paired:
        return programs * 2, 2
    return programs * spec.rows, 2 if spec.pair_twin else 1


def bwd_ws_rows(spec, programs):
    """Partial dweight rows a backward grid of ``programs`` writes: one per row of each block,
    or one per block where its rows are summed first (paired)."""
    if spec.atomic_dweight:
        return 1
    return programs * (1 if spec.paired else spec.rows)


def launch_bounds(spec):
    """(max threads per block, min blocks per SM) a kernel declares to CUDA (__launch_bounds__),
    or (None, None).  Backward kernels: their block size, so ptxas keeps a 1024-thread block
    within 64 registers (else the launch fails); and for packed rows bwd_blocks_per_sm where it
    is 2: 512-thread rows of one chunk fit 64 registers without spilling (ptxas 13.5, every
    variant; left free, it gave the dresidual forms 81-101 and so one block per SM), while 512 x
    2 rows ask no minimum and take up to 128.  Forward kernels stay free: with a bound alone
    ptxas squeezed the looped 1024-thread forward to 32 registers and spilled."""
    if not isinstance(spec, BwdSpec):
        return None, None
    threads = spec.layout.threads * spec.rows
    blocks = bwd_spec_blocks_per_sm(spec) if spec.packed else 1
    return threads, (blocks if blocks > 1 else None)


def scalar_shifted(spec):
    """Whether a scalar (any-alignment) kernel of ``spec`` moves the 16-byte spans inside its
    rows as the two aligned blocks around each, funnel-shifted (kernels/_rowops.ChunkIO: the
    same elements in the same float32 slots, so the same bits; 10-26 points of copy over
    element-by-element access on the H200, docs/performance.md).  Not in backward blocks held
    to 64 registers a thread, where the blocks' words spilled (ptxas 13.0, sm_90: 8-380 B in the
    float32 N = 8192 and the N = 16384 rows of 1024 threads): those stay element by element."""
    threads, blocks = launch_bounds(spec)
    return threads is None or 65536 // (threads * (blocks or 1)) >= 128


def bwd_blocks_per_sm(layout):
    """Backward blocks per SM for rows of this layout on CUDA: up to 1024 chunks of cached rows per
    SM (64 registers a thread; a 1024-thread block asked to fit twice got 32 registers and
    spilled 100 bytes, ptxas, N = 8192 bf16), at most BWD_BLOCKS_PER_SM."""
    chunks = layout.chunks_per_thread if layout.cached else 1
    return max(1, min(BWD_BLOCKS_PER_SM, 1024 // (_block_threads(layout) * chunks)))


def _block_threads(layout):
    return layout.threads * rows_per_block(layout)


def _bwd_register_units(layout):
    """A thread's registers in units of 64 (1024 threads' worth per SM): 2 where its SM holds 512
    threads of these rows, 1 where it holds 1024."""
    return max(1, 1024 // (_block_threads(layout) * bwd_blocks_per_sm(layout)))


# grids whose busiest program walks at most this many row blocks take the fewest programs that
# keep that many (bwd_programs): the critical path is the same, and there are fewer partial
# dweight rows to write and reduce.  H200, bf16, us, as many as fit / balanced, three rounds each
# (results/tune_h200_20261201_s16/tune_bwd_programs.json, tune_bwd_dres_programs.json):
#   4096x4096 (264 -> 256) 31.9, 32.2, 33.0 / 32.0, 32.2, 31.6 (the reduction 2.6 -> 2.3)
#   2048x4096 (264 -> 256) 19.6, 19.5, 19.6 / 19.0, 19.1, 19.0
#   1024x8192 (132 -> 128) 20.2, 20.2, 20.2 / 19.8, 19.9, 19.8
#   dresidual 4096x4096 39.8, 39.9, 39.7 / 39.7, 39.2, 39.8; 1024x8192 23.7, 23.5, 23.6 / 23.0,
#   22.9, 23.0
# Where programs walk more rows, one program fewer is an SM idle for longer: 8192x8192 (63 row
# blocks, 132 -> 131) 105.3, 105.7, 105.2 / 105.6, 105.7, 105.7; 32768x4096 (264 -> 263) and
# 16384x8192 (132) level.  AMD: not measured, not changed
BWD_BALANCE_MAX_STEPS = {"cuda": 16, "hip": 0}


@dataclass(frozen=True)
class ReduceSpec:
    """Compile-time constants of the dweight reduction (block: columns x groups threads)."""
    weight: str             # dweight's dtype
    columns: int
    groups: int
    batch: int              # loads a thread issues before adding them
    pairs: bool = False     # workspace rows 2q and 2q + 1 summed first (BwdSpec.pair_twin)


def reduce_spec(weight, pairs=False):
    return ReduceSpec(weight=weight, columns=BWD_REDUCE_COLUMNS, groups=BWD_REDUCE_GROUPS,
                      batch=BWD_REDUCE_BATCH, pairs=pairs)


def bwd_programs(spec, m, sm_count, vendor="cuda"):
    """Programs of the persistent backward grid on a ``vendor`` GPU of ``sm_count`` SMs / CUs:
    a number per SM from the layout, and no more than there are blocks of rows.  A function of
    the layout, M and the device only, not of the variant: the programs' partial rows are
    dweight's summation order, so a row-strided (scalar) call must sum them as its contiguous
    copy's (vector) call does (API.md: bitwise the same).  On CUDA it once came from the
    driver's occupancy for each kernel: at 16-bit N = 4096 the vector kernel fits two blocks
    (64 registers) and the scalar one (80-97) one, 264 against 132 programs on an H200.  A
    variant that fits fewer blocks runs its programs in more than one wave.  AMD keeps the
    estimate its backend always made (there is no occupancy query there): as many blocks as a
    CU's 2048 threads hold, at most BWD_BLOCKS_PER_SM.  Where no program walks more than
    BWD_BALANCE_MAX_STEPS row blocks, the grid shrinks to the fewest programs that walk no more
    than the busiest would (4096x4096 on an H200: 256 programs of 16 rows instead of 264 of 15
    or 16)."""
    if spec.pair_twin:
        paired = replace(spec, rows=2, paired=True, pair_twin=False)
        return 2 * bwd_programs(paired, m, sm_count, vendor)
    if vendor == "hip":
        per_sm = max(1, min(BWD_BLOCKS_PER_SM, 2048 // (spec.layout.threads * spec.rows)))
    else:
        per_sm = bwd_spec_blocks_per_sm(spec)
    blocks = max(1, ceil_div(m, spec.rows))
    programs = min(blocks, per_sm * sm_count)
    steps = ceil_div(blocks, programs)      # row blocks the busiest program takes
    if steps <= BWD_BALANCE_MAX_STEPS[vendor]:
        # the fewest programs that take no more: the same critical path, fewer partial rows
        programs = ceil_div(blocks, steps)
    return programs
