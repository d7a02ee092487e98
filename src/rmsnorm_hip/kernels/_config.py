"""Launch geometry: frozen specs and the one place their thresholds live.

Batch invariance (docs/api.md) constrains what may depend on what.  A row's float32 reduction
order is fixed by its :class:`RowLayout` (threads per row, chunks per thread), which is a
function of N and the dtype only.  Everything else (rows per block, grid, vector or scalar
access) may follow M and the pointers, because every such variant computes the same per-chunk
sums in the same order.

Thresholds were measured on an H200 (docs/performance.md, "Record"); the AMD entries keep the
untuned choice wherever nothing was measured there.
"""
import math
from dataclasses import dataclass, replace

from .. import _dtypes

CHUNK_BYTES = 16            # one 128-bit access: 8 16-bit or 4 32-bit elements
MAX_THREADS = 1024          # per row
# target 128-bit loads in flight per thread per row, by element size: 3 (16-bit) and 4 (float32)
# measured best overall on the H200 (the other counts 0-2.5 points of copy behind, one chunk
# 15-30 behind; docs/performance.md)
CHUNKS_PER_THREAD = {2: 3, 4: 4}
# quantised rows, by vendor.  NVIDIA's are issue-bound: 4 chunks spread the per-row work over
# more elements and fill an N = 4096 row exactly (no column checks; int8 69 -> 79% of copy at
# 32768x4096).  AMD takes 2 at 16-bit: at 3 or 4 the row needs more than the 64 VGPRs that keep
# 8 waves per SIMD (aot.MAIN_KERNEL_MAX_VGPRS).  The simulator runs the NVIDIA layouts.
QUANT_CHUNKS_PER_THREAD = {"cuda": {2: 4, 4: 4}, "hip": {2: 2, 4: 4}}
# static-scaled rows with a residual: the quantised row with the least work an element, and two
# load streams.  A small batch's row is then bound by latency, which NVIDIA's 8 warps of 2
# chunks hide better than 4 warps of 4 (H100, bf16 N = 4096: 0.08-0.60 us less a call in a CUDA
# graph at M = 1-512, level at 4096x4096 and 32768x4096; docs/performance.md)
STATIC_RESIDUAL_CHUNKS_PER_THREAD = {"cuda": {2: 2, 4: 4}, "hip": {2: 2, 4: 4}}
MAX_CACHED_FLOATS = 32      # row values a thread keeps in registers between the two passes
# threads per block when a row needs fewer (several rows per block); >= 64 so AMD wavefronts
# are full.  128, 256 and 512 measured within a point of each other on the H200.
BLOCK_THREADS = 128
# streamed forward (cached vector rows): a persistent grid whose threads load the next row's
# words during this row's reduction and stores (same per-row operations: the same bits).  The
# most rows per SM it takes (None: any M; 0: never): it wins on small batches and loses 2-7
# points of copy at large M, except issue-bound quantised rows (H200; docs/performance.md).
# Within that limit the dispatcher (backends/_gpu) may still run one-shot: FWD_ONE_SHOT_WAVE,
# and programs too large for one block an SM.
FWD_STREAM_ROWS_PER_SM = {
    "cuda": {"plain": 16, "residual": 4, "quant": None, "quant_residual": 32},
    "hip": {"plain": 0, "residual": 0, "quant": 0, "quant_residual": 0},
}
# kinds whose batches run one-shot where one wave of one-shot blocks holds them and the streamed
# grid would walk two rows a program or more (fwd_one_shot_wave).  NVIDIA's streamed quantised
# rows with a residual hold 80-168 registers (1-5 programs an SM), their one-shot blocks 40-66
# (3-12; benchmarks/kernel_fit.py): in that window the wave finishes first in a CUDA graph,
# below it the streamed grid does (H100, bf16 N = 2048-8192, M = 512-1024; docs/performance.md)
FWD_ONE_SHOT_WAVE = {"cuda": ("quant_residual",), "hip": ()}


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


def _layout(n, dtype, chunks_per_thread, max_cached_floats, max_threads=MAX_THREADS,
            unit=64):
    """Threads per row for about ``chunks_per_thread`` chunks each (a power of two up to a warp,
    else a whole number of 64-lane wavefronts, at most MAX_THREADS; rows of more than ``unit``
    threads a multiple of ``unit``)."""
    chunk = CHUNK_BYTES // _dtypes.ITEMSIZE[dtype]
    n_chunks = ceil_div(n, chunk)
    if n_chunks <= 32:
        # a power of two so the butterfly stays inside aligned lane groups on 32- and 64-lane warps
        threads = next_pow2(n_chunks)
    else:
        # a multiple of 64 is a whole number of warps on NVIDIA and of wavefronts on AMD
        threads = min(max_threads, 64 * ceil_div(ceil_div(n_chunks, chunks_per_thread), 64))
        if threads > unit:
            threads = min(max_threads, unit * ceil_div(threads, unit))
    per_thread = ceil_div(n_chunks, threads)
    return RowLayout(n=n, chunk=chunk, threads=threads, chunks_per_thread=per_thread,
                     cached=per_thread * chunk <= max_cached_floats)


def row_layout(n, dtype):
    """The per-row reduction shape: a function of ``n`` and ``dtype`` only (batch invariance)."""
    return _layout(n, dtype, CHUNKS_PER_THREAD[_dtypes.ITEMSIZE[dtype]], MAX_CACHED_FLOATS)


# gated rows are issue-bound (the sigmoid: two transcendental ops an element).  A one-row block
# of 6 warps runs 2 on two of an NVIDIA SM's four schedulers and 1 on the others: the row takes
# as long as 8 would.  Their rows of more than 128 threads take a multiple of 128 (4 warps) there.
GATED_ROW_UNIT = {"cuda": 128, "hip": 64}


def gated_row_layout(n, dtype, vendor="cuda"):
    """The gated forward's per-row reduction shape: a function of ``n`` and ``dtype`` only on a
    given vendor's GPUs."""
    return _layout(n, dtype, CHUNKS_PER_THREAD[_dtypes.ITEMSIZE[dtype]], MAX_CACHED_FLOATS,
                   unit=GATED_ROW_UNIT[vendor])


def quant_row_layout(n, dtype, vendor="cuda", static_residual=False):
    """The quantised forward's per-row reduction shape: a function of ``n`` and ``dtype`` only on
    a given vendor's GPUs, for each kind of quantised row (``static_residual``: a static scale
    and a residual)."""
    table = STATIC_RESIDUAL_CHUNKS_PER_THREAD if static_residual else QUANT_CHUNKS_PER_THREAD
    chunks = table[vendor][_dtypes.ITEMSIZE[dtype]]
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
    # rows of a (..., H, N) array whose leading dims do not flatten to one row stride: row r
    # starts at (r // H) * stride + (r % H) * head_stride (rms_norm, one-shot rows)
    heads: bool = False
    # gated RMSNorm (Mamba 2): "input" normalises h = x * silu(z), "output" multiplies y by
    # silu(z) (norm_before_gate); with ``heads`` the rows are a row's groups of N columns, each
    # with its own slice of the weight
    gate: str = ""
    # quantised rows' scales: "" one float32 yscale per row (dynamic); "group" one per ``group``
    # columns, "ue8m0" the same rounded up to a power of two, "mx" an E8M0 byte per 32 columns
    # (quant an MX format); "static" none written, q = y / s with s read from the yscale argument
    scaling: str = ""
    group: int = 0
    # built to its launch bounds (launch_bounds): a one-shot block whose free registers would
    # not fit on an SM (the dispatcher asks this where the driver holds no block of it)
    bounded: bool = False


    def __post_init__(self):
        if self.xscale and not self.quant:
            raise ValueError(f"FwdSpec: xscale (SmoothQuant) needs quant, got xscale="
                             f"{self.xscale!r}, quant={self.quant!r}")
        # a one-shot block has one row to weigh: nothing to hold the gains across
        if self.held_weights and not (self.stream and (self.weight or self.xscale)):
            raise ValueError(f"FwdSpec: held_weights needs a streamed spec with a weight or "
                             f"xscale, got stream={self.stream}, weight={self.weight!r}, "
                             f"xscale={self.xscale!r}")
        if self.gate and (self.fused or (self.stream and self.heads)):
            raise ValueError(f"FwdSpec: gated rows take none of the fused switches, and group "
                             f"rows are one-shot, got fused={self.fused}, stream={self.stream}, "
                             f"heads={self.heads}")
        if self.heads and (self.fused or self.stream):
            raise ValueError(f"FwdSpec: head rows are rms_norm's one-shot rows, got fused="
                             f"{self.fused}, stream={self.stream}")
        grouped = self.scaling in GROUP_SCALINGS
        if ((self.scaling and not self.quant) or (self.scaling not in SCALINGS)
                or (self.scaling == "mx") != (self.quant in _dtypes.MX_DTYPES)
                or bool(self.group) != grouped
                or (grouped and not group_fits(self.group, self.layout.chunk))):
            raise ValueError(f"FwdSpec: scaling {self.scaling!r} with quant {self.quant!r} and "
                             f"group {self.group} (chunk {self.layout.chunk}) is not a variant")

    @property
    def fused(self):
        """Built with the fused signature (residual / quant / xscale) rather than rms_norm's."""
        return self.residual or bool(self.quant) or bool(self.xscale)


SCALINGS = ("", "group", "ue8m0", "mx", "static")
GROUP_SCALINGS = ("group", "ue8m0", "mx")
# the columns of one scale (rms_norm_quant's group_size): a power of two whose chunks are a
# power-of-two run of lanes within a warp (their max is one xor-butterfly)
QUANT_GROUP_MIN, QUANT_GROUP_MAX = 16, 128


def group_fits(group, chunk):
    """Whether groups of ``group`` columns are whole runs of at most 32 chunks of ``chunk``
    (every thread layout of a row then holds a group in consecutive lanes of one warp)."""
    return group % chunk == 0 and 1 <= group // chunk <= 32 and group & (group - 1) == 0


def fwd_kind(residual, quant):
    """The forward's kinds as FWD_STREAM_ROWS_PER_SM names them."""
    if quant:
        return "quant_residual" if residual else "quant"
    return "residual" if residual else "plain"


def fwd_stream(vendor, residual, quant, m, sm_count):
    """Whether a forward of ``m`` rows is within its kind's streamed limit (the dispatcher then
    decides: GpuBackend._stream)."""
    limit = FWD_STREAM_ROWS_PER_SM[vendor][fwd_kind(residual, quant)]
    return limit is None or m <= limit * sm_count


def fwd_one_shot_wave(stream_rows, wave_rows, m):
    """Whether ``m`` rows of a FWD_ONE_SHOT_WAVE kind run one-shot: more than the streamed grid
    covers with one row a program (``stream_rows``) and no more than one wave of one-shot
    blocks holds (``wave_rows``).  Either grid gives the same bits."""
    return stream_rows < m <= wave_rows


def fwd_spec(n, dtype, weight, vector, store_rstd, residual=False, quant="", xscale="",
             offset=True, stream=False, vendor="cuda", heads=False, gate="", scaling="",
             group=0):
    """The forward kernel a call runs (the dispatcher's only decision for the forward) on a
    ``vendor`` ("cuda" or "hip") GPU.  ``offset=False`` (weight_offset == 0) is a variant of the
    quantised rows only: their issue slots are the bound, and it saves one FADD per element
    (rms_norm and the fused add gain nothing from it).  ``stream`` (fwd_stream) applies to cached
    vector rows.  Streamed rows hold their columns' gains in registers for the whole program,
    loaded with the first row: (weight + offset) * xscale when quantised (fewer issue slots a
    row), weight + offset otherwise (the weight is read before the reduction, not after it: one
    memory latency a row, not two).  Every variant forms the same float32 factor, so the bits do
    not depend on it.  ``scaling`` and ``group``: a quantised row's scales (FwdSpec)."""
    layout = (quant_row_layout(n, dtype, vendor, residual and scaling == "static") if quant
              else gated_row_layout(n, dtype, vendor) if gate else row_layout(n, dtype))
    # quantised rows on NVIDIA (issue-bound) drop the per-chunk column checks where the row is
    # exactly threads x chunks; not on AMD, where the branch-free row took the fp32 N = 4096
    # quantised kernel over the 64-VGPR gate (48 -> 69 VGPRs, gfx942)
    exact = (vendor == "cuda" and bool(quant) and layout.cached and n % layout.chunk == 0
             and layout.n_chunks == layout.threads * layout.chunks_per_thread)
    stream = stream and vector and layout.cached and not heads
    held = stream and bool(weight or xscale)
    return FwdSpec(layout=layout, rows=rows_per_block(layout), dtype=dtype, weight=weight,
                   vector=vector, store_rstd=store_rstd, residual=residual, quant=quant,
                   xscale=xscale, exact=exact, offset=offset or not (quant and weight),
                   stream=stream, held_weights=held, heads=heads, gate=gate, scaling=scaling,
                   group=group)


def fwd_programs(spec, m, sm_count, resident_per_sm):
    """Blocks of a forward launch: one per ``rows`` rows, or for a streamed spec the programs
    the device holds at once, no more than there are blocks of rows (capping them lower
    measured the same or worse on the H200)."""
    blocks = ceil_div(m, spec.rows)
    return max(1, min(blocks, resident_per_sm * sm_count)) if spec.stream else blocks


# ---- gated RMSNorm backward ------------------------------------------------------------------
# a gated backward thread keeps x, z, dy, the weight and the dweight partial of its chunks: one
# chunk a thread up to 512 threads, then more chunks at 512, in registers up to
# GATED_BWD_MAX_CACHED_FLOATS each (a 512-thread block has 128 registers a thread); longer
# group rows are read twice, a chunk at a time.  Their dweight partial stays in registers up to
# GATED_BWD_MAX_HELD_PARTIAL floats a thread, by vendor (16-bit G = 8192: 512 threads x 2
# chunks; on AMD those rows spilled 6-13 VGPRs, so none there), else it lives in the slot's
# workspace row, read and written back for every row.  Looped rows whose chunks' words fit
# GATED_BWD_MAX_HELD_WORDS a thread per array (by vendor) and whose partial is held read their
# row once, kept as words across the reductions, the next row asked of the L2
GATED_BWD_MAX_THREADS = 512
GATED_BWD_MAX_CACHED_FLOATS = 8
GATED_BWD_MAX_HELD_PARTIAL = {"cuda": 16, "hip": 0}
GATED_BWD_MAX_HELD_WORDS = {"cuda": 8, "hip": 0}
GATED_BWD_BLOCKS_PER_SM = 2     # slots of the persistent grid: this many blocks per SM
# short group rows share blocks of up to this many threads (the 512-thread cap of 128 registers
# spilled the any-alignment form of short rows, with the next row's words held)
GATED_BWD_SHARED_BLOCK_THREADS = 256


@dataclass(frozen=True)
class GatedBwdSpec:
    """Compile-time constants of the gated backward (kernels/gated_bwd.py)."""
    layout: RowLayout
    rows: int               # group rows per block
    dtype: str
    weight: str             # "" for none
    vector: bool
    recompute_rstd: bool
    gate: str               # "input" | "output" (FwdSpec.gate)
    # the dweight partial in registers for the whole program (cached rows always), not in the
    # slot's workspace row
    held_partial: bool = True
    # a looped row read once: its chunks kept as words, the next row asked of the L2 (cached
    # rows load the next row's words instead)
    held_words: bool = False

    def __post_init__(self):
        if self.layout.cached and not self.held_partial:
            raise ValueError("GatedBwdSpec: cached rows hold their dweight partial, got "
                             "held_partial=False")
        if self.held_words and (self.layout.cached or not self.held_partial):
            raise ValueError("GatedBwdSpec: held words are for looped rows holding their "
                             f"partial, got cached={self.layout.cached}, "
                             f"held_partial={self.held_partial}")


def gated_bwd_layout(g, dtype):
    """The gated backward's layout of a group row of ``g`` elements."""
    return _layout(g, dtype, 1, GATED_BWD_MAX_CACHED_FLOATS, GATED_BWD_MAX_THREADS)


def gated_bwd_spec(g, dtype, weight, vector, recompute_rstd, gate, vendor="cuda"):
    layout = gated_bwd_layout(g, dtype)
    rows = max(1, GATED_BWD_SHARED_BLOCK_THREADS // layout.threads)
    held = layout.cached or (layout.chunks_per_thread * layout.chunk
                             <= GATED_BWD_MAX_HELD_PARTIAL[vendor])
    words = (held and not layout.cached
             and layout.chunks_per_thread * 4 <= GATED_BWD_MAX_HELD_WORDS[vendor])
    return GatedBwdSpec(layout=layout, rows=rows, dtype=dtype, weight=weight,
                        vector=vector, recompute_rstd=recompute_rstd, gate=gate,
                        held_partial=held, held_words=words)


def gated_bwd_slots(spec, m, groups, sm_count):
    """Block slots (group rows walked at once) of a gated backward of ``m`` rows of ``groups``
    groups: a multiple of both the block's rows and ``groups`` (each slot keeps one group), no
    more than GATED_BWD_BLOCKS_PER_SM blocks per SM's worth or the rows need.  A function of M,
    the groups and the device: dweight's summation order."""
    unit = spec.rows * groups // math.gcd(spec.rows, groups)
    want = GATED_BWD_BLOCKS_PER_SM * sm_count * spec.rows
    return unit * max(1, min(ceil_div(m * groups, unit), ceil_div(want, unit)))


# ---- QK-norm: attention heads' rows, optionally rotated (RoPE) ----------------------------
# the longest head row: its neox rotation passes through a block's shared memory (32 KiB)
QK_MAX_HEAD_SIZE = 8192
# threads per block of head rows in halves (qk_halves): 64, so that 8-thread bf16 heads of 128 fill
# blocks of 8 heads, as the usual layout's 16-thread rows do 128-thread blocks
QK_HALVES_BLOCK_THREADS = 64


@dataclass(frozen=True)
class QkSpec:
    """Compile-time constants of the QK-norm kernel: q's and k's head rows of D elements in one
    launch, each normalised as rms_norm's row of N = D (the same layout, so the same bits without
    RoPE), then rotated where ``rope`` names a style."""
    layout: RowLayout
    rows: int               # head rows per block
    dtype: str              # q / k
    weight: str             # q_weight / k_weight dtype
    vector: bool            # 128-bit accesses (every row start and D 16-byte aligned)
    rope: str = ""          # "" | "neox" | "gptj"
    cache: str = ""         # cos_sin_cache's dtype (rope)
    positions: str = ""     # "int32" | "int64" (rope)
    halves: bool = False    # qk_halves: a thread holds chunk c and its neox partner c + D / 2

    def __post_init__(self):
        if bool(self.rope) != bool(self.cache and self.positions):
            raise ValueError(f"QkSpec: rope needs the cache's and the positions' dtypes, got "
                             f"rope={self.rope!r}, cache={self.cache!r}, "
                             f"positions={self.positions!r}")


def qk_halves(d, dtype, rope, rotary_dim):
    """Whether heads of ``d`` take the layout in halves: neox over the whole head, whose halves are
    a power of two of chunks, at most a warp's lanes.  Thread t then owns chunk t and its
    partner chunk t + D / 2 (two chunks a thread): the rotation needs no other thread's values
    and one cos / sin load serves both.  A function of the call's D, dtype, style and
    rotary_dim, never of the batch or the alignment (batch invariance)."""
    chunk = CHUNK_BYTES // _dtypes.ITEMSIZE[dtype]
    lanes, ragged = divmod(d, 2 * chunk)
    return (rope == "neox" and rotary_dim == d and not ragged and 1 <= lanes <= 32
            and lanes & (lanes - 1) == 0)


def qk_layout(d, dtype, halves=False):
    """A head row's layout: rms_norm's for N = d (cached: a head is at most a few chunks a
    thread), or the layout in halves (qk_halves)."""
    if not halves:
        return row_layout(d, dtype)
    chunk = CHUNK_BYTES // _dtypes.ITEMSIZE[dtype]
    return RowLayout(n=d, chunk=chunk, threads=d // (2 * chunk), chunks_per_thread=2,
                     cached=True)


def qk_rows(layout, halves=False):
    """Head rows per block."""
    if halves:
        return max(1, QK_HALVES_BLOCK_THREADS // layout.threads)
    return rows_per_block(layout)


def qk_spec(d, dtype, weight, vector, rope="", cache="", positions="", halves=False):
    """The QK-norm kernel of heads of ``d`` elements (qk_layout), several heads a block."""
    layout = qk_layout(d, dtype, halves)
    return QkSpec(layout=layout, rows=qk_rows(layout, halves), dtype=dtype, weight=weight,
                  vector=vector, rope=rope, cache=cache if rope else "",
                  positions=positions if rope else "", halves=halves)


# ---- backward ---------------------------------------------------------------------------------
# One 128-bit chunk of x and of dy per thread per row (up to 1024 threads): x, dy, the cached
# weight and the dweight partial then take 4 x 8 floats for 16-bit data, within 64 registers a
# thread (128-thread rows of 4 chunks needed 168; docs/performance.md).  On CUDA the 1024-thread
# rows take 2 chunks at 512 threads instead (BWD_TWO_CHUNK_MIN_THREADS).
BWD_MAX_CACHED_FLOATS = 16       # per array (x, dy, weight, dweight partial) and thread
BWD_LOOPED_THREADS = 512         # threads per row of the looped (uncached) backward layouts
BWD_BLOCKS_PER_SM = 2            # programs per SM for 512-thread rows of one chunk (P = 2 x SMs);
                                 # at most, see bwd_blocks_per_sm
# dweight reduction: blocks of 32 columns (one 128-byte line per warp row) x BWD_REDUCE_GROUPS
# row groups; each thread loads BWD_REDUCE_BATCH of its rows before adding them, in row order
# (batches of 8 took it from 2.8-4.1 to 2.5-2.9 us at 4096x4096; 16 or 32 groups no better;
# docs/performance.md)
BWD_REDUCE_COLUMNS = 32
BWD_REDUCE_GROUPS = 8
BWD_REDUCE_BATCH = 8
# Cached rows (vector access; 16-bit scalar rows of BWD_PACK_SCALAR_MIN_CHUNKS or more) keep x
# and dy as the loaded words between the passes (56 registers instead of 69-77 at N = 4096 bf16:
# two blocks per SM) and load the next row's words, dresidual's and the next rstd ahead of this
# row's reduction where BWD_PREFETCH_MAX_CHUNKS allows (docs/performance.md).

# loads ahead of a row's reduction (the next row's words, dresidual's) only where a thread owns
# at most this many chunks: with two (float32 N = 8192, 16-bit N = 16384: 1024 threads) they
# spill out of a 1024-thread block's 64 registers and measured up to 30% slower on the H200
BWD_PREFETCH_MAX_CHUNKS = 1
# packed 16-bit rows hold their weight's floats for the whole program only where a thread owns
# at most this many chunks; with two (N = 16384) the held weight spilled, and loading it with
# each chunk (an L1 hit) took 7-8% less time on the H200.  float32 rows of two chunks hold it
# without spilling (loading it there measured level or slower)
BWD_HOLD_WEIGHT_MAX_CHUNKS = 1
# unpaired rows with the next row's rstd and more than 64 registers a thread store their dweight
# partial right after the last row's pass 1, during that row's reduction (BwdSpec.early_dweight;
# the same bits): bf16 1024x8192 19.4 -> 18.7 us on the H200, level or faster elsewhere
# (docs/performance.md).  In 64 registers (16-bit N = 4096) it spilled: those rows do without
BWD_EARLY_DWEIGHT = {"cuda": True, "hip": False}
# 16-bit scalar (unaligned) rows of at least this many chunks a thread keep x and dy as words,
# as vector rows do (as floats, N = 16384 spilled; see bwd_spec).  At one chunk (N = 4096) floats
# fit one block per SM, not two, yet words (no registers left for the shifted spans) measured 2-5
# points of copy slower on the H200 (docs/performance.md)
BWD_PACK_SCALAR_MIN_CHUNKS = {"cuda": 2, "hip": 2}
# rows of one chunk a thread over at least this many threads (None: never) take two chunks at
# half the threads, still one block per SM, whose 128 registers a thread hold the weight and load
# the next row ahead: 1-4% faster on the H200 at 16-bit N = 8192 and float32 N = 4096 (2048x8192
# 2% slower); shorter rows measured level or slower and keep one chunk (docs/performance.md)
BWD_TWO_CHUNK_MIN_THREADS = {"cuda": 1024, "hip": None}


# packed 16-bit rows of 512 threads x 1 chunk (N = 3585..4096) run two to a 1024-thread block,
# each at its own named barrier (intrinsics row_barrier), their dweight partials summed into one
# workspace row: half the partial rows to write and reduce, 0.5-0.9 us a call on the H200 (4096
# rows level; docs/performance.md).  AMD has no named barriers
BWD_PAIRED_ROWS = {"cuda": True, "hip": False}
# ...where the call has at least this many rows per SM (bwd_pair_rows): at small M the
# 1024-thread block is about 1 us slower, level at one row per SM and ahead from two (H200,
# bf16 N = 4096)
BWD_PAIRED_MIN_ROWS_PER_SM = 2


# small backward calls: dweight summed by column programs appended to the row kernel's own
# grid, straight from x, dy and the forward's rstd, while the row programs write dx only: one
# launch, no workspace and no reduction kernel (bwd_column_dweight).  Up to this many rows and
# elements: the column programs read x and dy a second time, which under the L2 write flush
# cost more than the reduction saved at 256x8192 (H100: 10.1 -> 11.6 us; in a CUDA graph 8.2 ->
# 6.5).  AMD: not measured
BWD_COLUMN_DWEIGHT_MAX_ROWS = {"cuda": 256, "hip": 0}
BWD_COLUMN_DWEIGHT_MAX_ELEMENTS = 1 << 20
# a column program's threads take BWD_COLUMN_CHUNKS adjacent chunks (64 16-bit or 32 float32
# columns a program) and walk the rows in threads // BWD_COLUMN_CHUNKS groups
BWD_COLUMN_CHUNKS = 8
# ...in blocks of at most this many threads: 1024-thread rows (16-bit N = 16384) spilled out of
# their 64 registers with the column path beside the row's; 640 (16-bit N = 5120) keep 96
BWD_COLUMN_MAX_THREADS = 640


def bwd_column_dweight(n, dtype, weight, recompute_rstd, m, vendor="cuda"):
    """Whether a backward call of ``m`` rows sums dweight in column programs of its row kernel
    (BwdSpec.column_dweight): more than one row, at most BWD_COLUMN_DWEIGHT_MAX_ROWS rows and
    BWD_COLUMN_DWEIGHT_MAX_ELEMENTS elements, a weight, the forward's rstd (the column programs
    cannot wait for a recomputed one), and a cached layout of one row a block of at most
    BWD_COLUMN_MAX_THREADS.  Part of the call's kernel choice: dweight's summation order is
    then a function of M and the layout only, for every form of the call."""
    if not (1 < m <= BWD_COLUMN_DWEIGHT_MAX_ROWS[vendor]
            and m * n <= BWD_COLUMN_DWEIGHT_MAX_ELEMENTS and weight and not recompute_rstd):
        return False    # most calls: decided without building the layout
    layout = bwd_row_layout(n, dtype, vendor)
    return bool(layout.cached and rows_per_block(layout) == 1
                and layout.threads <= BWD_COLUMN_MAX_THREADS
                and layout.threads % (BWD_COLUMN_CHUNKS * layout.chunk) == 0)


def bwd_column_programs(spec):
    """Column programs of a BwdSpec.column_dweight grid (after its row programs)."""
    if not spec.column_dweight:
        return 0
    return ceil_div(spec.layout.n, BWD_COLUMN_CHUNKS * spec.layout.chunk)


def bwd_pair_rows(m, sm_count, vendor="cuda"):
    """Whether a backward call of ``m`` rows pairs its rows where the layout allows
    (BWD_PAIRED_ROWS): part of the call's kernel choice, as the grid's programs are.  dweight's
    summation order already depends on M; dx's does not (pairing leaves each row's reduction
    as it is)."""
    return bool(BWD_PAIRED_ROWS[vendor]) and m >= BWD_PAIRED_MIN_ROWS_PER_SM * sm_count


# calls that move few bytes load x, dy and dresidual evict-first (intrinsics load_b128_stream:
# CUDA ld.global.cs), so that an L2 full of dirty lines (the flush, a model's preceding kernels)
# evicts fewer of them.  16-bit packed vector rows only, where it was measured (hinted, float32
# N = 16384 rows spilled); the forward lost with it.  AMD: not measured (docs/performance.md)
BWD_STREAM_LOADS = {"cuda": True, "hip": False}
# ...in calls whose x is at most this many bytes: up to 32 MiB the hint saved 0-2 us on the H200;
# from 48 MiB it was level or up to 9% slower
BWD_STREAM_MAX_BYTES = 32 << 20

# deterministic=False with a float32 weight: dweight summed by float32 atomics into a zeroed
# dweight instead of partial rows and dweight_reduce, only where measured faster (issue 4): few
# partial floats, or many rows a program (H200; docs/performance.md).  A 16-bit weight (a
# conversion after the sum) never gained; scalar kernels and AMD were not measured
BWD_ATOMIC_DWEIGHT = {"cuda": True, "hip": False}
BWD_ATOMIC_MAX_FLOATS = 1 << 16         # few programs: partial rows x N at most this (2^17: level)
BWD_ATOMIC_MIN_ROWS_PER_PROGRAM = 48    # or many rows a program (8192x4096: 62, 4096x4096: 31)


def bwd_stream_rows(m, n, dtype, vendor="cuda"):
    """Whether a backward call of ``m`` rows of ``n`` ``dtype`` elements asks for evict-first
    row loads (BWD_STREAM_LOADS; bwd_spec gives them to 16-bit packed vector rows only): part of
    the call's kernel choice.  The same bits either way."""
    nbytes = m * n * _dtypes.ITEMSIZE[dtype]
    return bool(BWD_STREAM_LOADS[vendor]) and nbytes <= BWD_STREAM_MAX_BYTES


# threads a backward row takes at least.  AMD: rows of one wavefront or less (their reduction
# all shuffles, no shared memory) were compiled by numba-hip / ROCm LLVM into code objects without
# their row loop: no global load, only the zeroed dweight partial stored (seen in the gfx942 and
# gfx950 ISA of every such layout, 16-bit N <= 512 and float32 N <= 256).  Two wavefronts reduce
# through shared memory and compile whole; the rows' extra lanes hold no chunk
BWD_MIN_THREADS = {"cuda": 1, "hip": 128}


def bwd_row_layout(n, dtype, vendor="cuda"):
    """The backward's per-row layout (a function of N and dtype only on a given vendor's GPUs: dx
    is batch invariant).  Rows too long to cache take BWD_LOOPED_THREADS: at 1024 threads the
    dresidual forms need more than the 64 registers such a block may have (they spilled)."""
    layout = _layout(n, dtype, 1, BWD_MAX_CACHED_FLOATS)
    two_chunks = BWD_TWO_CHUNK_MIN_THREADS[vendor]
    if (two_chunks is not None and layout.cached and layout.chunks_per_thread == 1
            and layout.threads >= two_chunks):
        # half the threads, whole 64-lane wavefronts (a tuned threshold may not be a multiple)
        layout = _layout(n, dtype, 2, BWD_MAX_CACHED_FLOATS, 64 * ceil_div(layout.threads, 128))
    if not layout.cached:
        layout = _layout(n, dtype, 1, BWD_MAX_CACHED_FLOATS, BWD_LOOPED_THREADS)
    if layout.threads < BWD_MIN_THREADS[vendor]:
        layout = replace(layout, threads=BWD_MIN_THREADS[vendor], chunks_per_thread=1,
                         cached=True)
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
    paired: bool = False    # two rows a block at own barriers, one partial row (BWD_PAIRED_ROWS)
    # one row a block standing in for a paired kernel (the scalar form of a call shape whose
    # vector form pairs): twice the paired grid's programs, so programs 2p and 2p + 1 walk paired
    # program p's two rows, and the reduction sums their partial rows pairwise first
    # (ReduceSpec.pairs): dweight is then bitwise the paired kernel's, as docs/api.md asks of a
    # row-strided call against its contiguous copy
    pair_twin: bool = False
    # 16-bit packed vector (aligned) rows: x, dy and dresidual loaded evict-first (intrinsics
    # load_b128_stream), where the call takes it (bwd_stream_rows)
    stream_loads: bool = False
    # a float32 weight's dweight summed by float32 atomics from each program's partial, into a
    # zeroed dweight, with no reduction kernel (deterministic=False; cached rows;
    # bwd_atomic_dweight)
    atomic_dweight: bool = False
    # a 16-bit weight's dweight encoded by the kernel from its one partial row, where the call's
    # grid is one program of one row (bwd_direct_dweight), with no reduction kernel
    direct_dweight: bool = False
    # rows whose rstd is known before their reduction (prefetch_rstd), unpaired: the dweight
    # partial accumulated in pass 1 and stored with the last row's pass 1 (BWD_EARLY_DWEIGHT)
    early_dweight: bool = False
    # rows of a (..., H, N) array whose leading dims do not flatten to one row stride: row r
    # at (r // H) * stride + (r % H) * head_stride (the same programs and rows as the call's
    # one-stride kernel, so the same dweight bits)
    heads: bool = False
    # dweight summed by column programs after the row programs, from x, dy and rstd; the row
    # programs keep no partial (bwd_column_dweight); ``ws`` is dweight
    column_dweight: bool = False


def bwd_spec(n, dtype, weight, vector, recompute_rstd, dresidual, vendor="cuda", pair=True,
             stream=False, atomic=False, direct=False, heads=False, columns=False):
    """The backward kernel of a call shape; ``pair``: rows of the layouts that pair do
    (BWD_PAIRED_ROWS; bwd_pair_rows decides it per call); ``stream``: 16-bit packed vector rows
    load evict-first where the vendor does (BWD_STREAM_LOADS; bwd_stream_rows decides it per
    call; other rows ignore it); ``direct``: the call's grid is one program of one row
    (bwd_direct_dweight), whose 16-bit dweight the kernel encodes itself; ``heads``: rows at two
    strides (BwdSpec.heads), which a rows-that-pair call walks as the pair twin does, with
    neither evict-first loads nor a direct dweight; ``columns``: dweight from column programs
    (bwd_column_dweight), whose rows neither pair nor keep a partial."""
    layout = bwd_row_layout(n, dtype, vendor)
    pair = pair and not columns
    atomic = atomic and not columns
    direct = direct and not columns
    itemsize = _dtypes.ITEMSIZE[dtype]
    # 16-bit rows of 2 chunks a thread keep their words in the scalar (unaligned) form too: as
    # floats, x and dy spilled the N = 16384 rows' 1024-thread block.  The words are read one
    # element at a time and decoded as the vector form's are: the same floats, so the same bits
    packed = layout.cached and (
        vector or (itemsize == 2
                   and layout.chunks_per_thread >= BWD_PACK_SCALAR_MIN_CHUNKS[vendor]))
    # with rstd recomputed and dresidual too, the prefetch words take the kernel past 64
    # registers (it spilled at N = 4096 bf16 with weight): that pair goes without
    both = recompute_rstd and dresidual
    budget = _bwd_register_units(layout)
    ahead = layout.chunks_per_thread <= BWD_PREFETCH_MAX_CHUNKS * budget
    prefetch = packed and not both and ahead
    if packed:
        hold_weight = (itemsize == 4
                       or layout.chunks_per_thread <= BWD_HOLD_WEIGHT_MAX_CHUNKS * budget)
    else:
        # unpacked (scalar-access) 1024-thread rows hold x and dy as floats: with dresidual and
        # the weight held too they spilled (N = 8192 as 1024 x 1, which AMD keeps; float32
        # N = 8192 on CUDA too); they load it with each chunk
        hold_weight = not (dresidual and layout.threads >= 1024)
    rows = rows_per_block(layout)
    # rows that pair (BWD_PAIRED_ROWS) do in their packed (vector) form; the scalar form keeps
    # one row a block (as floats it takes 80-97 registers: a 1024-thread block would spill) and
    # stands in for the pair: see BwdSpec.pair_twin
    pairable = bool(pair and BWD_PAIRED_ROWS[vendor] and weight and itemsize == 2
                    and layout.cached and layout.chunks_per_thread == 1
                    and 2 * layout.threads == MAX_THREADS and bwd_blocks_per_sm(layout) == 2)
    paired = pairable and packed and not heads
    prefetch_rstd = prefetch and not recompute_rstd and not dresidual
    return BwdSpec(layout=layout, rows=2 if paired else rows, dtype=dtype, weight=weight,
                   vector=vector, recompute_rstd=recompute_rstd, dresidual=dresidual,
                   packed=packed, prefetch=prefetch,
                   early_dres=packed and dresidual and ahead,
                   prefetch_rstd=prefetch_rstd,
                   hold_weight=hold_weight, paired=paired,
                   pair_twin=pairable and (heads or not packed),
                   stream_loads=bool(stream and packed and vector and itemsize == 2
                                     and BWD_STREAM_LOADS[vendor] and not heads),
                   atomic_dweight=bool(atomic and not direct and weight == _dtypes.FLOAT32
                                       and layout.cached and vector),
                   direct_dweight=bool(direct and weight in _dtypes.HALF_DTYPES and layout.cached
                                       and rows == 1 and not paired and not heads),
                   early_dweight=bool(prefetch_rstd and weight and not paired and budget > 1
                                      and BWD_EARLY_DWEIGHT[vendor] and not columns),
                   heads=heads, column_dweight=bool(columns))


def bwd_direct_dweight(spec, m):
    """Whether a backward call of ``m`` rows writes dweight from its kernel: a grid of one
    program of one row (M = 1 where a block holds one row) has one partial row, and the
    reduction of one row is that row, so dweight is the partial (a float32 weight's, stored to
    dweight in place of the workspace) or its encoding (a 16-bit weight's:
    BwdSpec.direct_dweight), the same bits without the reduction kernel.  Cached rows, whose
    partial stays in registers."""
    return bool(m == 1 and spec.weight and spec.layout.cached and spec.rows == 1
                and not spec.paired and not spec.pair_twin)


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


SCALED_STREAM_MAX_REGISTERS = 128


def launch_bounds(spec):
    """(max threads per block, min blocks per SM) a kernel declares to CUDA (__launch_bounds__),
    or (None, None).  Backward kernels: their block size, so ptxas keeps a 1024-thread block
    within 64 registers (else the launch fails); and for packed rows bwd_blocks_per_sm where it
    is 2: 512-thread rows of one chunk then fit 64 registers without spilling (left free, the
    dresidual forms took 81-101 and so one block per SM), while 512 x 2 rows ask no minimum and
    take up to 128.  The gated backward declares its block size too.  Forward kernels stay
    free (with a bound alone ptxas squeezed the looped 1024-thread forward to 32 registers and
    spilled), but for streamed scaled-quant rows, held to SCALED_STREAM_MAX_REGISTERS, and
    bounded ones (FwdSpec.bounded), held to their block size."""
    if isinstance(spec, GatedBwdSpec):
        return spec.layout.threads * spec.rows, None
    if isinstance(spec, FwdSpec):
        threads = spec.layout.threads * spec.rows
        if spec.bounded:
            return threads, None
        if spec.stream and spec.scaling and spec.weight and not (spec.residual or spec.xscale):
            # streamed rows with scales per group, MX or static, holding their weight, took
            # 130-164 registers: one 256-thread program per SM at N = 8192 (8 warps; Nsight
            # Compute: 2 warps per scheduler, 0.41 instructions issued a cycle).  At 128 they
            # spill nothing and have the occupancy of the per-row SmoothQuant rows.  Not with a
            # residual or xscale (they spill there), nor without a weight (72 registers free;
            # bounded, ptxas took 128)
            return threads, max(1, 65536 // (threads * SCALED_STREAM_MAX_REGISTERS))
        return None, None
    if not isinstance(spec, BwdSpec):
        return None, None
    threads = spec.layout.threads * spec.rows
    blocks = bwd_spec_blocks_per_sm(spec) if spec.packed else 1
    if blocks == 1 and spec.column_dweight:
        # declared: without it ptxas held the unpacked head-row forms with column programs to
        # 64 registers and spilled 8 bytes (16-bit N = 4096); with it they take 75-97
        return threads, 1
    return threads, (blocks if blocks > 1 else None)


def scalar_shifted(spec):
    """Whether a scalar (any-alignment) kernel of ``spec`` moves the 16-byte spans inside its
    rows as the two aligned blocks around each, funnel-shifted (kernels/_rowops.ChunkIO: the
    same elements in the same float32 slots, so the same bits; faster than element-by-element
    access on the H200, docs/performance.md).  Not in backward blocks held to 64 registers a
    thread, where the blocks' words spilled (the float32 N = 8192 and the N = 16384 rows of 1024
    threads), nor in backward head rows (BwdSpec.heads), whose 16-bit N = 4096 rows spilled with
    them: those stay element by element, as do looped gated backward rows (GatedBwdSpec: the
    chunk's reloaded dweight partial besides, their blocks' words spilled 22-70 VGPRs on gfx942)."""
    if isinstance(spec, BwdSpec) and spec.heads:
        return False
    if isinstance(spec, GatedBwdSpec) and not spec.layout.cached:
        return False
    threads, blocks = launch_bounds(spec)
    return threads is None or 65536 // (threads * (blocks or 1)) >= 128


def bwd_blocks_per_sm(layout):
    """Backward blocks per SM for rows of this layout on CUDA: up to 1024 chunks of cached rows per
    SM (64 registers a thread; a 1024-thread block asked to fit twice got 32 registers and
    spilled), at most BWD_BLOCKS_PER_SM."""
    chunks = layout.chunks_per_thread if layout.cached else 1
    return max(1, min(BWD_BLOCKS_PER_SM, 1024 // (_block_threads(layout) * chunks)))


def _block_threads(layout):
    return layout.threads * rows_per_block(layout)


def _bwd_register_units(layout):
    """A thread's registers in units of 64 (1024 threads' worth per SM): 2 where its SM holds 512
    threads of these rows, 1 where it holds 1024."""
    return max(1, 1024 // (_block_threads(layout) * bwd_blocks_per_sm(layout)))


# grids whose busiest program walks at most this many row blocks take the fewest programs that
# keep that many (bwd_programs): the same critical path, fewer partial rows to write and reduce
# (H200, 4096x4096: 264 -> 256 programs, the reduction 2.6 -> 2.3 us).  With longer walks one
# program fewer leaves an SM idle for longer.  AMD: not measured
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
    copy's (vector) call does (docs/api.md: bitwise the same).  So not each kernel's occupancy:
    at 16-bit N = 4096 the vector kernel fits two blocks (64 registers) and the scalar one
    (80-97) one, 264 against 132 programs on an H200; a variant that fits fewer blocks runs its
    programs in more than one wave.  AMD (no occupancy query): as many blocks as a CU's 2048
    threads hold, at most BWD_BLOCKS_PER_SM.  Where no program walks more than
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
