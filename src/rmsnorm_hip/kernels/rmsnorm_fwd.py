"""RMSNorm forward kernel, with the fused residual add and dynamic quantisation as compile-time
switches of the same row body (``FwdSpec.residual`` / ``quant`` / ``xscale``).

    h     = round(x + residual)  if residual, else x   (the exact sum, one rounding to x's dtype)
    rstd  = 1 / sqrt(mean(h**2) + eps)                 per row, float32
    y     = (h * rstd) * (weight + weight_offset)      one rounding to y's dtype
quantised (y never rounded before it; t is y without rstd, float32):
    g     = (weight + weight_offset) * xscale          the column's gain
    t     = h * g,                                     y = t * rstd
    yscale = rstd * max|t| / QMAX  (max|y| / QMAX up to float32 rounding; 1 for an all-zero row)
    q     = clamp(rne(t * (rstd / yscale)))          (rne((t * rstd) / yscale) where
                                                     rstd / yscale overflows, both scaled
                                                     by 2**64 for a subnormal yscale)

Blocks of ``threads x rows`` threads (blockDim = (threads, rows)); thread ``t`` of a row owns
chunks ``t, t + threads, ...``.  Pass 1 loads them, sums their squares and reduces across the
row; the last pass scales and stores them.  A quantised row takes max|t| in pass 1 too and
reduces it in the same round as the sum of squares (one barrier), so q is written only once the
whole row is known.  Cached layouts keep the row (h, or t when quantised) in registers between
the passes and store residual_out once all their loads are issued; looped ones re-read x (and
residual) in every pass and store residual_out in the last.  No pass reads what the kernel
wrote, and each thread reads a chunk before it writes that chunk and nothing else, so ``y`` may
be ``x`` and ``residual_out`` ``residual`` (the in-place entry point).  Each block owns ``rows``
rows; a row's arithmetic does not depend on the grid.  Rows past M take part in the reductions
and store nothing; absent arrays are never touched (null pointers in the fused kernel, None in
the plain one).

Streamed (``FwdSpec.stream``, cached vector rows; chosen per call, kernels/_config): a persistent
grid whose block p takes the row blocks p, p + P, ...; each thread holds a row's chunks as the
loaded 32-bit words and loads the next row's words before this row's stores and reduction (two
word buffers, used alternately).  Programs with a weight (or xscale) also hold their columns'
gains in registers, loaded once before the first row (``FwdSpec.held_weights``): w + offset, or
g when quantised, where a one-shot row loads them after its reduction.  The float32 operations
per row are the cached one-shot row's, so the bits are too; 16-bit rows with a residual form h
from the loaded words by one packed add a word (``intrinsics.add_bf16x2``), which rounds the
exact sum once as the one-shot row's float32 add and rounding do.  Rows of another program are
never read, so in place still holds.

Programmatic dependent launch (CUDA sm_90, opt-in: backends.cuda): every forward waits for the
kernel before it in the stream before its first load, and lets the next kernel start once its
first row's loads are issued.
"""
import math
from collections import namedtuple

from numba import float32, int64, types, uint32

from .. import _dtypes
from ._config import FwdSpec
from ._config import GROUP_SCALINGS
from ._rowops import (ChunkIO, codec, make_accumulate, make_chunk_sumsq, make_fp4_store,
                      make_group_scale, make_quant_store, make_row_sum, make_row_sum_max,
                      pair_adder, reduce_buffer_shape)


# Records the row pieces take, built once at the kernel's entry (numba named tuples: free after
# inlining).  Every use of an array sits under the compile-time switch that says the spec has
# it: the plain kernel passes None for the fused arrays (numba prunes their uses before typing),
# the fused kernel null pointers for those a call lacks.
Arrays = namedtuple("Arrays", "x residual weight xscale y residual_out rstd yscale z")
# element offsets (row strides, or one row's starts) of the row-strided arrays; ``weight``: a
# gated group's first column (0 otherwise)
Offsets = namedtuple("Offsets", "x residual y residual_out z weight")
# a call's arguments; ``heads`` (H) and ``head_strides`` (Offsets) for FwdSpec.heads rows;
# ``scale_strides`` (row, group) of a grouped quantised row's scales; ``static_scale`` a static
# quantiser's scale given by value (0: read it at yscale[0])
Call = namedtuple("Call", "arrays strides m eps weight_offset heads head_strides scale_strides "
                          "static_scale")
# a thread's scratch: its chunks of the row (h, or t when quantised), of residual, one chunk of
# weight (or of the quantiser's gain g: load_gain) and of xscale, and the gains a streamed
# program holds
Scratch = namedtuple("Scratch", "vals rvals wvals svals gains")
# a streamed row's chunks of x and residual as loaded 32-bit words
Words = namedtuple("Words", "x residual")


def argtypes(spec: FwdSpec):
    """rms_norm's (x, weight, y, rstd, m, x_row_stride, y_row_stride, eps, weight_offset[, heads,
    x_head_stride, y_head_stride] (FwdSpec.heads: row strides are then per H rows)); a gated
    spec's (x, z, weight, y, rstd, m, x_row_stride, z_row_stride, y_row_stride, eps,
    weight_offset, heads, x_head_stride, z_head_stride, y_head_stride) (heads: the groups of a
    row, 1 for none); or for
    a fused spec (x, residual, weight, xscale, y, residual_out, rstd, yscale, m, x_row_stride,
    residual_row_stride, y_row_stride, residual_out_row_stride, eps, weight_offset[,
    scale_row_stride, scale_group_stride] (grouped scales: FwdSpec.scaling) [, scale_value]
    (static)); y is q (int8 / uint8 bits; MX: uint8, fp4 pairs at half x's row stride) when
    quantised, yscale the scales (uint8 E8M0 for MX), or the static scale's array, read at
    yscale[0] when scale_value is 0."""
    data = types.CPointer(_numba_storage(spec.dtype))
    weight = types.CPointer(_numba_storage(spec.weight or _dtypes.FLOAT32))
    f32 = types.CPointer(types.float32)
    if spec.gate:
        return ((data, data, weight, data, f32) + (types.int64,) * 4
                + (types.float32, types.float32) + (types.int64,) * 4)
    if not spec.fused:
        heads = (types.int64,) * 3 if spec.heads else ()    # H, x's and y's head strides
        return (data, weight, data, f32, types.int64, types.int64, types.int64, types.float32,
                types.float32) + heads
    xscale = types.CPointer(_numba_storage(spec.xscale or _dtypes.FLOAT32))
    mx = spec.quant in _dtypes.MX_DTYPES
    out = (types.CPointer(_numba_storage(_dtypes.UINT8 if mx else spec.quant)) if spec.quant
           else data)
    scales = types.CPointer(types.uint8) if mx else f32
    extra = ((types.int64,) * 2 if spec.scaling in GROUP_SCALINGS
             else (types.float32,) if spec.scaling == "static" else ())
    return ((data, data, weight, xscale, out, data, f32, scales)
            + (types.int64,) * 5 + (types.float32, types.float32) + extra)


def _numba_storage(dtype):
    from numba.np.numpy_support import from_dtype
    return from_dtype(_dtypes.STORAGE[dtype])


def make_rmsnorm_fwd(intr, spec: FwdSpec):
    """The forward kernel of ``spec`` over the intrinsics ``intr`` (a Python function to
    compile)."""
    layout = spec.layout
    n, chunk, threads = layout.n, layout.chunk, layout.threads
    per_thread, cached, rows = layout.chunks_per_thread, layout.cached, spec.rows
    full = spec.exact           # every chunk of every thread lies in the row: no column checks
    cache_len = per_thread * chunk if cached else chunk
    has_weight, store_rstd, add_offset = bool(spec.weight), spec.store_rstd, spec.offset
    has_residual, quant, has_xscale = spec.residual, spec.quant, bool(spec.xscale)
    gpu, jitable = intr.gpu, intr.jitable
    x_io = ChunkIO(intr, spec.dtype, chunk, n, spec.vector)
    w_io = ChunkIO(intr, spec.weight or _dtypes.FLOAT32, chunk, n, spec.vector)
    s_io = ChunkIO(intr, spec.xscale or _dtypes.FLOAT32, chunk, n, spec.vector)
    chunk_sumsq = make_chunk_sumsq(intr, chunk)
    accumulate = make_accumulate(intr, not cached)
    row_sum = make_row_sum(intr, threads)
    row_sum_max = make_row_sum_max(intr, threads)
    scaling, group = spec.scaling, spec.group
    group_scaled, static = scaling in GROUP_SCALINGS, scaling == "static"
    group_lanes = group // chunk if group_scaled else 1
    # cached rows of a power-of-two number of chunks a thread, no more than a group has lanes,
    # compute one group's scale a lane rather than one a chunk (group_scales)
    scales_by_lane = (group_scaled and cached and 1 < per_thread <= group_lanes
                      and per_thread & (per_thread - 1) == 0)
    keepers = group_lanes // per_thread if scales_by_lane else 1    # lanes holding one group
    halvings = per_thread.bit_length() - 1 if scales_by_lane else 0
    pre_varies = scaling == "group"     # the other group scalings' pre is always 1
    # int8 levels by one fma where a NaN-propagating max|t| tells which rows may take it
    fma_levels = quant == _dtypes.INT8 and "max_abs_nan" in intr.features and not scaling
    element = _dtypes.MX_ELEMENT.get(quant, quant)
    if element == _dtypes.MXFP4:
        store_q = make_fp4_store(intr, chunk)
    else:
        store_q = (make_quant_store(intr, element, chunk, n, spec.vector, fma_levels,
                                    mx=quant == _dtypes.MXFP8, unbounded=static)
                   if quant else None)
    scale_of = make_group_scale(intr, scaling, quant) if scaling else None
    store_q_converted = (make_quant_store(intr, quant, chunk, n, spec.vector) if fma_levels
                         else store_q)
    load_x, store_y, load_w, load_s = x_io.load, x_io.store, w_io.load, s_io.load
    max_abs = intr.max_abs_nan if fma_levels else intr.max_abs
    decode, encode, _ = codec(intr, spec.dtype)
    round_x = spec.dtype != _dtypes.FLOAT32     # float32 h needs no second rounding
    n_f32 = float32(n)
    qmax = float32(_dtypes.QMAX.get(quant, 1.0))
    one, two64, tiny = float32(1.0), float32(2.0 ** 64), float32(2.0 ** -126)
    n_red = 2 if quant and not scaling else 1   # sum and max: one shared buffer each
    stream, heads = spec.stream, spec.heads
    gate, grouped = spec.gate, spec.gate and spec.heads    # gated; group rows (own weights)
    # a chunk's silu(z) sits in sc.rvals (the residual's scratch: a gated row has none)
    gated_input = gate == "input"
    held = spec.held_weights                    # streamed rows only (FwdSpec)
    has_gain = has_weight or has_xscale
    gains_len = cache_len if held else 1
    red_bufs = 2 * n_red if stream else n_red   # streamed rows alternate between two halves
    red_shape = reduce_buffer_shape(intr, red_bufs, rows, threads)
    red_align = intr.shared_alignment
    words = per_thread * 4 if stream else 1     # 32-bit words of a row's chunks per thread
    # the second word buffer: the residual's, or a gated row's z (a gated row has no residual)
    residual_words = words if has_residual or gate else 1
    load_words, words_to_floats = x_io.load_words, x_io.words_to_floats
    store_words = x_io.store_words
    # streamed 16-bit rows form h = round(x + residual) a word at a time and store residual_out
    # from those words: decoding, adding, rounding and re-decoding each element put 96 F2FP
    # ahead of a bf16 4096 row's reduction (now 24)
    add_pairs = pair_adder(intr, spec.dtype) if stream and has_residual else None
    packed_add = add_pairs is not None
    wait_prior_grids, release_dependents = intr.wait_prior_grids, intr.release_dependents
    warp_max, max_nan, shfl_xor = intr.warp_max, intr.max_nan, intr.shfl_xor
    sigmoid, rsqrt = intr.sigmoid, intr.rsqrt

    @jitable
    def add_residual(vals, slot, rvals, rslot):
        """vals[slot:] <- round(vals[slot:] + rvals[rslot:]) for one chunk (h in float32)."""
        for e in range(chunk):
            h = vals[slot + e] + rvals[rslot + e]
            if round_x:
                h = decode(encode(h))
            vals[slot + e] = h

    @jitable
    def row_starts(call, row):
        s = call.strides
        if heads:   # rows past M too: a row index fits 32 bits (the host checks M)
            outer = int64(uint32(row) // uint32(call.heads))
            inner = row - outer * call.heads
            h = call.head_strides
            return Offsets(outer * s.x + inner * h.x, int64(0), outer * s.y + inner * h.y,
                           int64(0), outer * s.z + inner * h.z,
                           inner * n if grouped else int64(0))
        return Offsets(row * s.x, row * s.residual, row * s.y, row * s.residual_out, row * s.z,
                       int64(0))

    @jitable
    def gate_chunk(vals, slot, gvals, gslot):
        """gvals[gslot:] <- silu(z) of a chunk of z; with the input gate vals[slot:] (x) is
        multiplied by it (h = x * silu(z), float32, not rounded)."""
        for e in range(chunk):
            zv = gvals[gslot + e]
            g = zv * sigmoid(zv)
            gvals[gslot + e] = g
            if gated_input:
                vals[slot + e] = vals[slot + e] * g

    @jitable
    def load_h(call, at, col0, sc, slot):
        """A chunk of h into sc.vals[slot:]: x's, or round(x + residual)."""
        a = call.arrays
        load_x(a.x, at.x, col0, sc.vals, slot)
        if has_residual:
            load_x(a.residual, at.residual, col0, sc.rvals, 0)
            add_residual(sc.vals, slot, sc.rvals, 0)
        if gate:    # looped layouts: slot 0, silu(z) in sc.rvals[0:chunk]
            load_x(a.z, at.z, col0, sc.rvals, slot)
            gate_chunk(sc.vals, slot, sc.rvals, slot)

    @jitable
    def load_row(call, at, live, tx, sc):
        """Cached layouts: this thread's chunks of h into sc.vals (zeros where the row or chunk
        does not exist), h stored to residual_out.  Every load is issued before the first store,
        which the compiler may not move loads across (the arrays may alias)."""
        a, vals, rvals = call.arrays, sc.vals, sc.rvals
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if live and (full or col0 < n):
                load_x(a.x, at.x, col0, vals, k * chunk)
                if has_residual:
                    load_x(a.residual, at.residual, col0, rvals, k * chunk)
                if gate:
                    load_x(a.z, at.z, col0, rvals, k * chunk)
            else:
                for e in range(chunk):
                    vals[k * chunk + e] = float32(0.0)
                    if has_residual or gate:
                        rvals[k * chunk + e] = float32(0.0)
        if gate:
            for k in range(per_thread):
                gate_chunk(vals, k * chunk, rvals, k * chunk)
        if has_residual:
            for k in range(per_thread):
                col0 = (tx + k * threads) * chunk
                add_residual(vals, k * chunk, rvals, k * chunk)
                if live and (full or col0 < n):
                    store_y(a.residual_out, at.residual_out, col0, vals, k * chunk)

    @jitable
    def zero_chunk(vals):
        for e in range(chunk):
            vals[e] = float32(0.0)

    @jitable
    def sumsq_row(call, at, live, tx, trips, sc):
        """This thread's share of the row's sum of squares (loading chunks when not cached)."""
        acc = comp = float32(0.0)
        for k in range(trips):
            slot = k * chunk if cached else 0
            if not cached:
                col0 = (tx + k * threads) * chunk
                if live and (full or col0 < n):
                    load_h(call, at, col0, sc, 0)
                else:
                    zero_chunk(sc.vals)
            acc, comp = accumulate(acc, comp, chunk_sumsq(sc.vals, slot))
        return acc

    @jitable
    def scale_chunk(call, at, col0, r, sc, slot):
        """sc.vals[slot:] <- y = h * r * (weight + weight_offset) for one chunk (rows that are
        not quantised, which have no xscale: FwdSpec); with ``held`` the factor is the program's
        ``sc.gains[slot:]``, the same float32 sum formed once (hold_gains).  The output gate
        then multiplies by silu(z) (sc.rvals[slot:])."""
        vals, wvals = sc.vals, sc.wvals
        if held:
            for e in range(chunk):
                v = (vals[slot + e] * r) * sc.gains[slot + e]
                if gate == "output":
                    v = v * sc.rvals[slot + e]
                vals[slot + e] = v
            return
        if has_weight:
            load_w(call.arrays.weight, at.weight, col0, wvals, 0)
        offset = call.weight_offset
        for e in range(chunk):
            v = vals[slot + e] * r
            if has_weight:
                v = v * (wvals[e] + offset if add_offset else wvals[e])
            if gate == "output":
                v = v * sc.rvals[slot + e]
            vals[slot + e] = v

    @jitable
    def load_gain(call, col0, sc):
        """sc.wvals[0:chunk] <- the quantiser's gain g = (weight + weight_offset) * xscale of one
        chunk (the factors present; 1 where neither is)."""
        a, wvals, svals = call.arrays, sc.wvals, sc.svals
        if has_weight:
            load_w(a.weight, 0, col0, wvals, 0)
        if has_xscale:
            load_s(a.xscale, 0, col0, svals, 0)
        for e in range(chunk):
            g = float32(1.0)
            if has_weight:
                g = wvals[e] + call.weight_offset if add_offset else wvals[e]
            if has_xscale:
                g = g * svals[e] if has_weight else svals[e]
            wvals[e] = g

    @jitable
    def weigh_chunk(call, col0, sc, slot):
        """sc.vals[slot:] <- t = h * g for one chunk: g loaded here, or with ``held`` taken from
        the program's ``sc.gains[slot:]`` (streamed rows, loaded once: hold_gains)."""
        vals = sc.vals
        if held:
            for e in range(chunk):
                vals[slot + e] = vals[slot + e] * sc.gains[slot + e]
        elif has_gain:
            load_gain(call, col0, sc)
            for e in range(chunk):
                vals[slot + e] = vals[slot + e] * sc.wvals[e]

    @jitable
    def hold_gains(call, tx, sc):
        """A streamed program's gains of its columns, once (zeros past the row): w + offset, or
        the quantiser's g."""
        gains = sc.gains
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if full or col0 < n:
                load_gain(call, col0, sc)
                for e in range(chunk):
                    gains[k * chunk + e] = sc.wvals[e]
            else:
                for e in range(chunk):
                    gains[k * chunk + e] = float32(0.0)

    @jitable
    def reload_h(call, at, col0, sc, slot):
        """Looped layouts, in the pass that stores the row: re-read a chunk of h (from x and
        residual, never from what this kernel wrote) and store it to residual_out."""
        load_h(call, at, col0, sc, slot)
        if has_residual:
            store_y(call.arrays.residual_out, at.residual_out, col0, sc.vals, slot)

    @jitable
    def finish_row(call, at, tx, trips, r, sc):
        """Last pass of a live row: scale this thread's chunks and store them."""
        for k in range(trips):
            col0 = (tx + k * threads) * chunk
            if full or col0 < n:
                slot = k * chunk if cached else 0
                if not cached:
                    reload_h(call, at, col0, sc, slot)
                scale_chunk(call, at, col0, r, sc, slot)
                store_y(call.arrays.y, at.y, col0, sc.vals, slot)

    @jitable
    def sumsq_amax_row(call, at, live, tx, trips, sc):
        """A quantised row's pass before its one reduction: this thread's share of sum(h**2)
        (the same operations as sumsq_row) and max|t| over its chunks, t kept in sc.vals when
        cached.  max_abs ignores NaN (a row holding NaN / Inf in h is caught by its sum of
        squares) unless fma_levels, where max|t| is NaN when a t is."""
        acc = comp = float32(0.0)
        amax = float32(0.0)
        for k in range(trips):
            col0 = (tx + k * threads) * chunk
            slot = k * chunk if cached else 0
            here = live and (full or col0 < n)
            if not cached:
                if here:
                    load_h(call, at, col0, sc, 0)
                else:
                    zero_chunk(sc.vals)
            acc, comp = accumulate(acc, comp, chunk_sumsq(sc.vals, slot))
            # held gains cost no loads: rows past M are weighed too (their h is zero and
            # nothing of them is stored) rather than branched around
            if (full or col0 < n) and (live or held):
                weigh_chunk(call, col0, sc, slot)
                for e in range(chunk):
                    amax = max_abs(amax, sc.vals[slot + e])
        return acc, amax

    def make_quantise_row(through_y):
        @jitable
        def quantise_row(call, at, tx, trips, r, s, pre, sc):
            """A quantised row's last pass: q = t * s in 8-bit levels, s = rstd / yscale; or
            ``through_y``, q = ((t * rstd) * pre) * s with s = 1 / (yscale * pre), pre a power
            of two that keeps s finite for a subnormal yscale (1 otherwise: exact).  Looped
            layouts recompute t with sumsq_amax_row's operations, so the same bits."""
            vals = sc.vals
            for k in range(trips):
                col0 = (tx + k * threads) * chunk
                if full or col0 < n:
                    slot = k * chunk if cached else 0
                    if not cached:
                        reload_h(call, at, col0, sc, slot)
                        weigh_chunk(call, col0, sc, slot)
                    if through_y:
                        for e in range(chunk):
                            vals[slot + e] = (vals[slot + e] * r) * pre
                        store_q_converted(call.arrays.y, at.y, col0, vals, slot, s)
                    else:
                        store_q(call.arrays.y, at.y, col0, vals, slot, s)

        return quantise_row

    # two copies rather than a select per element: ptxas predicates a per-element multiply,
    # which costs its issue slot on every row
    quantise_row, quantise_row_through_y = make_quantise_row(False), make_quantise_row(True)

    @jitable
    def quantise(call, at, row, live, tx, ty, trips, red, buf, sc):
        """A quantised row from its chunks on (cached layouts: h in sc.vals, residual_out
        stored): one reduction round for the sum of squares and max|t| (yscale = rstd * max|t|
        / QMAX is max|y| / QMAX up to float32 rounding, y = t * rstd), then q."""
        acc, amax = sumsq_amax_row(call, at, live, tx, trips, sc)
        total, amax = row_sum_max(acc, amax, red, buf, ty, tx)
        r = rsqrt(total / n_f32 + call.eps)
        scale = amax * r / qmax
        if not math.isfinite(total):
            scale = total * float32(0.0)    # NaN: a row holding NaN / Inf says so in yscale
        elif scale == float32(0.0):
            scale = float32(1.0)            # an all-zero row (or one that underflows)
        if live:
            if tx == 0:
                call.arrays.yscale[row] = scale
            inv = float32(1.0) / scale
            s = r * inv
            # fma levels need every t finite: a finite yscale from a max|t| NaN cannot hide
            # from says so (a non-finite one takes the converting form, through y)
            if math.isfinite(s) and (math.isfinite(scale) or not fma_levels):
                quantise_row(call, at, tx, trips, r, s, one, sc)
            else:   # max|t| below ~1e-36 (subnormal rows): rstd / yscale overflows; or a t
                # that is NaN / Inf.  A subnormal yscale's reciprocal overflows too: y and
                # yscale are both scaled by 2**64 first
                pre = two64 if scale < tiny else one
                quantise_row_through_y(call, at, tx, trips, r, one / (scale * pre), pre, sc)

    @jitable
    def store_levels(call, at, col0, sc, slot, a, inv):
        """q of a chunk of t: rne((t * a) * inv) with a = rstd * pre and inv from the scale
        (make_group_scale), so y = t * rstd is formed first (one rounding, as y's max|y| was)
        and a power-of-two scale's levels are exact scalings of it."""
        for e in range(chunk):
            sc.vals[slot + e] = sc.vals[slot + e] * a
        store_q(call.arrays.y, at.y, col0, sc.vals, slot, inv)

    @jitable
    def chunk_amax(here, sc, slot):
        """max|t| of the chunk at sc.vals[slot:] (NaN wins), 0 for a chunk past N or M."""
        amax = float32(0.0)
        if here:
            for e in range(chunk):
                amax = max_nan(amax, abs(sc.vals[slot + e]))
        return amax

    @jitable
    def store_group_scale(call, row, first, stored):
        """The scale of the group whose first column is ``first``."""
        strides = call.scale_strides
        call.arrays.yscale[row * strides[0] + (first // group) * strides[1]] = stored

    @jitable
    def group_scale(call, row, col0, here, r, sc, slot):
        """(a, inv) of the chunk at sc.vals[slot:] (t) after its group's scale is found: its
        max|t| over the group's lanes (one butterfly: a group is a run of lanes; every lane
        takes it, rows past M too) times rstd, which is max|y| exactly (rounding is monotonic),
        and the scale stored by the group's first lane."""
        stored, inv, pre = scale_of(warp_max(chunk_amax(here, sc, slot), group_lanes) * r)
        if here and col0 % group == 0:
            store_group_scale(call, row, col0, stored)
        return r * pre, inv

    @jitable
    def group_scales(call, row, live, tx, r, sc, muls, invs):
        """(muls[k], invs[k]) of every chunk k of a cached row, as group_scale gives them, with
        one scale computed a lane rather than one a chunk: the chunk maxima are halved over the
        group's lanes (lane bit group_lanes / 2 keeps the upper half of the chunks, and so on:
        lane l ends up with chunk j = l // keepers), a butterfly over ``keepers`` lanes
        finishes the maxima, and each chunk's factors come back from a lane that holds it.  A
        NaN-winning max of magnitudes does not depend on its order: the same scales, but for
        the payload of a NaN scale where a group holds NaNs of several payloads (the portable
        max keeps its second NaN; CUDA's gives one NaN)."""
        amax = gpu.local.array(per_thread, float32)
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            amax[k] = chunk_amax(live and (full or col0 < n), sc, k * chunk)
        lane = tx % group_lanes
        for level in range(halvings):      # constant trip counts: unrolled, amax in registers
            held = per_thread >> (level + 1)
            distance = group_lanes >> (level + 1)
            upper = (lane & distance) != 0
            for i in range(held):
                send = amax[i] if upper else amax[i + held]
                keep = amax[i + held] if upper else amax[i]
                amax[i] = max_nan(keep, shfl_xor(send, distance))
        mine = lane // keepers
        stored, inv, pre = scale_of(warp_max(amax[0], keepers) * r)
        first = ((tx - lane) + mine * threads) * chunk      # the group's first column
        if live and lane % keepers == 0 and (full or first < n):
            store_group_scale(call, row, first, stored)
        mul = r * pre
        for k in range(per_thread):
            source = (mine ^ k) * keepers
            invs[k] = shfl_xor(inv, source)
            muls[k] = shfl_xor(mul, source) if pre_varies else r

    @jitable
    def quantise_scaled(call, at, row, live, tx, ty, trips, red, buf, sc):
        """A quantised row with scales per group (or a static scale): its one reduction, the
        sum of squares, then per chunk t = h * g, its group's scale and q.  Cached rows take
        each step for all their chunks before the next, in loops small enough to unroll (one
        loop kept the row in local memory on sm_90)."""
        if static:
            # a scale given by value (a number: nothing to read, nothing a CUDA graph could
            # see freed), else the caller's array, read before the reduction
            given = call.static_scale
            _, inv, pre = scale_of(given if given > float32(0.0) else call.arrays.yscale[0])
        acc = sumsq_row(call, at, live, tx, trips, sc)
        total = row_sum(acc, red, buf, ty, tx)
        r = rsqrt(total / n_f32 + call.eps)
        if static:
            a = r * pre
        if cached:
            muls = gpu.local.array(per_thread, float32)
            invs = gpu.local.array(per_thread, float32)
            for k in range(per_thread):
                col0 = (tx + k * threads) * chunk
                if live and (full or col0 < n):
                    weigh_chunk(call, col0, sc, k * chunk)
            if scales_by_lane:
                group_scales(call, row, live, tx, r, sc, muls, invs)
            elif group_scaled:
                for k in range(per_thread):
                    col0 = (tx + k * threads) * chunk
                    muls[k], invs[k] = group_scale(call, row, col0, live and (full or col0 < n),
                                                   r, sc, k * chunk)
            for k in range(per_thread):
                col0 = (tx + k * threads) * chunk
                if live and (full or col0 < n):
                    if group_scaled:
                        store_levels(call, at, col0, sc, k * chunk, muls[k], invs[k])
                    else:
                        store_levels(call, at, col0, sc, k * chunk, a, inv)
            return
        for k in range(trips):
            col0 = (tx + k * threads) * chunk
            here = live and (full or col0 < n)
            if here:
                reload_h(call, at, col0, sc, 0)
                weigh_chunk(call, col0, sc, 0)
            if group_scaled:
                a, inv = group_scale(call, row, col0, here, r, sc, 0)
            if here:
                store_levels(call, at, col0, sc, 0, a, inv)

    @jitable
    def normalise_row(call, at, row, live, tx, ty, trips, red, buf, sc):
        """A row from its chunks on (cached layouts: h in sc.vals, residual_out stored);
        ``red[buf:]`` takes its reduction."""
        if scaling:
            quantise_scaled(call, at, row, live, tx, ty, trips, red, buf, sc)
            return
        if quant:
            quantise(call, at, row, live, tx, ty, trips, red, buf, sc)
            return
        acc = sumsq_row(call, at, live, tx, trips, sc)
        total = row_sum(acc, red, buf, ty, tx)
        r = rsqrt(total / n_f32 + call.eps)
        if store_rstd and live and tx == 0:
            call.arrays.rstd[row] = r
        if live:
            finish_row(call, at, tx, trips, r, sc)

    @jitable
    def one_shot(call, red, sc):
        """A block's ``rows`` rows, one each for the threads of a row (threadIdx.y)."""
        tx = gpu.threadIdx.x
        ty = gpu.threadIdx.y
        row = int64(gpu.blockIdx.x) * rows + ty
        live = row < call.m
        at = row_starts(call, row)
        # looped rows walk their chunks with a trip count the compiler cannot see (m >> 63 is
        # 0): unrolled, their loads were hoisted and spilled (gfx942, N = 65536)
        trips = per_thread if cached else per_thread + (call.m >> 63)
        wait_prior_grids()
        if cached:
            load_row(call, at, live, tx, sc)
        release_dependents()
        normalise_row(call, at, row, live, tx, ty, trips, red, 0, sc)

    # ---- streamed rows (spec.stream: cached vector layouts) -------------------------------
    @jitable
    def load_row_words(call, row, tx, buf):
        """This thread's chunks of row ``row`` of x (and residual, or z) as loaded 32-bit words,
        zeros past M or the row's end."""
        a, s = call.arrays, call.strides
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if row < call.m and (full or col0 < n):
                load_words(a.x, row * s.x, col0, buf.x, k * 4)
                if has_residual:
                    load_words(a.residual, row * s.residual, col0, buf.residual, k * 4)
                if gate:
                    load_words(a.z, row * s.z, col0, buf.residual, k * 4)
            else:
                for e in range(4):
                    buf.x[k * 4 + e] = uint32(0)
                    if has_residual or gate:
                        buf.residual[k * 4 + e] = uint32(0)

    @jitable
    def words_to_chunk(w, k, vals, slot):
        words_to_floats(w[k * 4], w[k * 4 + 1], w[k * 4 + 2], w[k * 4 + 3], vals, slot)

    @jitable
    def stream_row(call, row, step, red, buf, tx, ty, sc, this_words, next_words):
        """One row of a streamed program: h from ``this_words``, the next row's loaded
        into ``next_words`` before this row's stores and reduction."""
        live = row < call.m
        hw = this_words.x
        for k in range(per_thread):
            if packed_add:   # h's words in place of x's
                for j in range(k * 4, k * 4 + 4):
                    hw[j] = add_pairs(hw[j], this_words.residual[j])
            words_to_chunk(hw, k, sc.vals, k * chunk)
            if has_residual and not packed_add:
                words_to_chunk(this_words.residual, k, sc.rvals, 0)
                add_residual(sc.vals, k * chunk, sc.rvals, 0)
            if gate:
                words_to_chunk(this_words.residual, k, sc.rvals, k * chunk)
                gate_chunk(sc.vals, k * chunk, sc.rvals, k * chunk)
        load_row_words(call, row + step, tx, next_words)
        at = row_starts(call, row)
        if has_residual:
            for k in range(per_thread):
                col0 = (tx + k * threads) * chunk
                if live and (full or col0 < n):
                    if packed_add:
                        store_words(call.arrays.residual_out, at.residual_out, col0, hw, k * 4)
                    else:
                        store_y(call.arrays.residual_out, at.residual_out, col0, sc.vals,
                                k * chunk)
        normalise_row(call, at, row, live, tx, ty, per_thread, red, buf, sc)

    @jitable
    def stream_rows(call, red, sc, words_a, words_b):
        """A persistent program: block p takes the row blocks p, p + P, ...  Two word buffers
        alternate (``a``, ``b``) so no words are copied; consecutive rows reduce through
        alternate halves of ``red``, one barrier each."""
        tx = gpu.threadIdx.x
        ty = gpu.threadIdx.y
        step = int64(gpu.gridDim.x) * rows
        block_row = int64(gpu.blockIdx.x) * rows    # the block's first row: uniform in the block
        row = block_row + ty    # carried beside block_row: recomputed from it, the int8
        # group-scaled kernel (G = 32) spilled at its 128 registers
        wait_prior_grids()
        load_row_words(call, row, tx, words_a)
        if held:
            hold_gains(call, tx, sc)
        release_dependents()
        # walked while the block's first row is in the batch: a trip count would be a 64-bit
        # division, a subroutine of dependent instructions ahead of the first load
        while block_row < call.m:
            stream_row(call, row, step, red, 0, tx, ty, sc, words_a, words_b)
            if block_row + step < call.m:
                stream_row(call, row + step, step, red, n_red, tx, ty, sc, words_b, words_a)
            block_row += 2 * step
            row += 2 * step

    @jitable
    def run(call):
        """The block's shared reduction buffer and the thread's scratch, then its rows."""
        if red_align:   # a constant: the other branch is pruned before typing (numba-hip)
            red = gpu.shared.array(red_shape, float32, alignment=red_align)
        else:
            red = gpu.shared.array(red_shape, float32)
        sc = Scratch(gpu.local.array(cache_len, float32), gpu.local.array(cache_len, float32),
                     gpu.local.array(chunk, float32), gpu.local.array(chunk, float32),
                     gpu.local.array(gains_len, float32))
        if stream:
            words_a = Words(gpu.local.array(words, uint32),
                            gpu.local.array(residual_words, uint32))
            words_b = Words(gpu.local.array(words, uint32),
                            gpu.local.array(residual_words, uint32))
            stream_rows(call, red, sc, words_a, words_b)
        else:
            one_shot(call, red, sc)

    def rmsnorm_fwd(x, weight, y, rstd, m, x_stride, y_stride, eps, weight_offset):
        # the plain forward has no residual, residual_out, xscale or yscale: None, strides 0
        run(Call(Arrays(x, None, weight, None, y, None, rstd, None, None),
                 Offsets(x_stride, int64(0), y_stride, int64(0), int64(0), int64(0)), m, eps,
                 weight_offset, int64(1), None, None, None))

    def rmsnorm_fwd_heads(x, weight, y, rstd, m, x_stride, y_stride, eps, weight_offset, heads,
                          x_head_stride, y_head_stride):
        run(Call(Arrays(x, None, weight, None, y, None, rstd, None, None),
                 Offsets(x_stride, int64(0), y_stride, int64(0), int64(0), int64(0)), m, eps,
                 weight_offset, heads,
                 Offsets(x_head_stride, int64(0), y_head_stride, int64(0), int64(0), int64(0)),
                 None, None))

    def rmsnorm_gated_fwd(x, z, weight, y, rstd, m, x_stride, z_stride, y_stride, eps,
                          weight_offset, heads, x_head_stride, z_head_stride, y_head_stride):
        run(Call(Arrays(x, None, weight, None, y, None, rstd, None, z),
                 Offsets(x_stride, int64(0), y_stride, int64(0), z_stride, int64(0)), m, eps,
                 weight_offset, heads,
                 Offsets(x_head_stride, int64(0), y_head_stride, int64(0), z_head_stride,
                         int64(0)), None, None))

    def rmsnorm_fused_fwd(x, residual, weight, xscale, y, residual_out, rstd, yscale, m, x_stride,
                          r_stride, y_stride, ro_stride, eps, weight_offset):
        run(Call(Arrays(x, residual, weight, xscale, y, residual_out, rstd, yscale, None),
                 Offsets(x_stride, r_stride, y_stride, ro_stride, int64(0), int64(0)), m, eps,
                 weight_offset, int64(1), None, None, None))

    def rmsnorm_group_quant_fwd(x, residual, weight, xscale, y, residual_out, rstd, yscale, m,
                                x_stride, r_stride, y_stride, ro_stride, eps, weight_offset,
                                scale_row_stride, scale_group_stride):
        run(Call(Arrays(x, residual, weight, xscale, y, residual_out, rstd, yscale, None),
                 Offsets(x_stride, r_stride, y_stride, ro_stride, int64(0), int64(0)), m, eps,
                 weight_offset, int64(1), None, (scale_row_stride, scale_group_stride), None))

    def rmsnorm_static_quant_fwd(x, residual, weight, xscale, y, residual_out, rstd, scale, m,
                                 x_stride, r_stride, y_stride, ro_stride, eps, weight_offset,
                                 scale_value):
        run(Call(Arrays(x, residual, weight, xscale, y, residual_out, rstd, scale, None),
                 Offsets(x_stride, r_stride, y_stride, ro_stride, int64(0), int64(0)), m, eps,
                 weight_offset, int64(1), None, None, scale_value))

    if gate:
        return rmsnorm_gated_fwd
    if group_scaled:
        return rmsnorm_group_quant_fwd
    if static:
        return rmsnorm_static_quant_fwd
    if spec.fused:
        return rmsnorm_fused_fwd
    return rmsnorm_fwd_heads if heads else rmsnorm_fwd


# every forward kernel waits for the kernel before it (wait_prior_grids) before its first load:
# the CUDA backend may launch it with programmatic stream serialization
make_rmsnorm_fwd.waits_on_prior_grids = True
