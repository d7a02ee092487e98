"""RMSNorm backward: dx and a deterministic dweight.

    x_hat = x * rstd,  wdy = dy * (weight + weight_offset)
    c1    = mean(x_hat * wdy) = rstd * sum(x * wdy) / N          (pass 1, a row reduction)
    dx    = (wdy - x_hat * c1) * rstd  [+ dresidual]            (pass 2, one rounding)
    dweight = sum over rows of dy * x_hat                      (float32)

``rmsnorm_bwd`` runs a persistent grid of P programs (blocks of ``threads x rows``); program p
takes the row blocks p, p + P, ...  Each thread owns the same chunks of every row, so its share of
dweight stays in float32 registers (cached layouts, written to the workspace at the end, or with
the last row's pass 1 where ``spec.early_dweight``) or in its program's workspace row (looped
layouts, read-modify-write: that row and those columns belong to the thread alone).
``dweight_reduce`` then sums the workspace ``ws[P * rows, N]`` (``ws[P, N]`` for paired blocks)
column-wise in a fixed order: dweight is the same bits on every run with the same P (a function of
M, N and the device).  Small calls (``spec.column_dweight``) end the grid in column programs
instead, which sum dweight straight from x, dy and rstd (``column_dweight``) while the row
programs store dx only: one launch, no workspace.  With ``recompute_rstd`` the row's sum of
squares is reduced in the same pass as sum(x * wdy), exactly as the forward reduces it.  Paired
blocks (``spec.paired``, CUDA) hold two rows that wait at their own named barriers and sum their
partials into one workspace row; the scalar kernel of such a call shape stands in for the pair
(``spec.pair_twin``: two programs per paired program, their workspace rows summed pairwise first
by ``dweight_reduce``), so both sum dweight in the same order.
"""
import math
from collections import namedtuple

from numba import float32, int32, int64, types, uint32

from .. import _dtypes
from . import _config
from ._config import BwdSpec, ReduceSpec
from ._rowops import (ChunkIO, codec, make_accumulate, make_chunk_dot, make_chunk_sumsq,
                      make_row_sum, reduce_buffer_shape)

# Records the row pieces take (numba named tuples: free after inlining): the kernel's arrays,
# their row strides, and a call's arguments
Arrays = namedtuple("Arrays", "dy x weight rstd dres dx ws")
Offsets = namedtuple("Offsets", "dy x dres dx")
# ``heads`` (H) and ``head_strides`` (Offsets): BwdSpec.heads rows
Call = namedtuple("Call", "arrays strides m eps weight_offset heads head_strides")
# a thread's floats: x and dy (a row's chunks, or one chunk when packed or looped), the weight
# (held, or one chunk), the dweight partial, wdy, dx, dresidual and one decoded chunk of x / dy
Floats = namedtuple("Floats", "x dy w acc wdy out dres xt dt")
# a packed row's words of x, dy and dresidual
Packed = namedtuple("Packed", "x dy dres")


def _pointer(dtype):
    from numba.np.numpy_support import from_dtype
    return types.CPointer(from_dtype(_dtypes.STORAGE[dtype]))


def argtypes(spec: BwdSpec):
    """(dy, x, weight, rstd, dresidual, dx, ws, m, dy_stride, x_stride, dres_stride, dx_stride,
    eps, weight_offset, heads, dy_head_stride, x_head_stride, dres_head_stride, dx_head_stride);
    ws is dweight where ``spec.direct_dweight``; the last five are read by BwdSpec.heads kernels
    only (the row strides are then per H rows)."""
    data, f32 = _pointer(spec.dtype), types.CPointer(types.float32)
    # ws is dweight for a direct or column-summed dweight
    ws = _pointer(spec.weight) if spec.direct_dweight or spec.column_dweight else f32
    return (data, data, _pointer(spec.weight or _dtypes.FLOAT32), f32, data, data, ws,
            types.int64, types.int64, types.int64, types.int64, types.int64, types.float32,
            types.float32) + (types.int64,) * 5


def make_rmsnorm_bwd(intr, spec: BwdSpec):
    layout = spec.layout
    n, chunk, threads = layout.n, layout.chunk, layout.threads
    per_thread, cached, rows = layout.chunks_per_thread, layout.cached, spec.rows
    span = per_thread * chunk if cached else chunk        # floats kept per array and thread
    has_weight, recompute, has_dres = bool(spec.weight), spec.recompute_rstd, spec.dresidual
    # the weight's floats held by the thread for the whole program (cached layouts), or loaded
    # with each chunk (looped layouts, and cached ones that spec.hold_weight says cannot hold it)
    hold_w = has_weight and cached and spec.hold_weight
    gpu, jitable, fma = intr.gpu, intr.jitable, intr.fma
    shifted = _config.scalar_shifted(spec)
    # x, dy and dresidual are read once: calls of few bytes load them evict-first
    # (spec.stream_loads)
    io = ChunkIO(intr, spec.dtype, chunk, n, spec.vector, shifted, spec.stream_loads)
    w_io = ChunkIO(intr, spec.weight or _dtypes.FLOAT32, chunk, n, spec.vector, shifted)
    load, store, load_w, store_w = io.load, io.store, w_io.load, w_io.store
    load_words, words_to_floats = io.load_words, io.words_to_floats
    # packed (cached vector rows, and 16-bit scalar rows of 2 chunks): x and dy stay between the
    # passes as the loaded words (4 registers per chunk instead of 8 floats), re-decoded in
    # pass 2; with the weight and the dweight partial that is 24 registers of row state per
    # thread, which lets two 512-thread blocks share an SM (95% of copy at 32768x4096 with 2
    # blocks per SM, 76% with 1).  The float32 operations are
    # the same either way: packed and unpacked rows give the same bits.
    packed = spec.packed
    words = per_thread * 4 if packed else 1
    # prefetch (packed rows): the next row's words are loaded before this row's reduction, so
    # each thread has two rows' loads in flight instead of one
    prefetch = spec.prefetch
    next_words = words if prefetch else 1
    # the next row's rstd (given by the forward) is loaded with its words rather than in its
    # own row, where pass 2 waited on it (BwdSpec.prefetch_rstd)
    next_rstd = spec.prefetch_rstd
    # early dresidual (packed rows): the row's dresidual words are loaded with its x / dy, before
    # the reduction, instead of in pass 2 after it (where each row waited for them)
    early_dres = spec.early_dres
    dres_words = words if early_dres else 1
    # early dweight (rows whose rstd is known before their reduction): the partial's fma in
    # pass 1 instead of pass 2, and the partial row stored with the last row's pass 1, so its
    # stores drain while that row reduces and writes dx rather than after it.  The same fma on
    # the same operands in the same row order: the same bits
    early_dw = spec.early_dweight
    assert not early_dw or (next_rstd and has_weight and not spec.paired), spec
    chunk_dot = make_chunk_dot(intr, chunk)
    chunk_sumsq = make_chunk_sumsq(intr, chunk)
    accumulate = make_accumulate(intr, not cached)
    # paired rows (spec.paired: cached, weighted rows only): each row of the block at its own
    # barrier, one partial row
    paired = spec.paired
    assert not paired or (cached and has_weight), spec
    half = span // 2
    row_sum = make_row_sum(intr, threads, row_barriers=paired)
    red_shape, red_align = reduce_buffer_shape(intr, 2, rows, threads), intr.shared_alignment
    n_f32 = float32(n)
    # cached vector layouts write their partial dweight rows to the workspace (float32,
    # allocated here: rows 16-byte aligned when n % 4 == 0) in 128-bit stores.  As scalar
    # stores they cost ~7 us of every call on the H200 (4096x4096 bf16: 37.4 -> 30.4 us; one row
    # a program: 13.8 -> 6.1 us; docs/performance.md).  The scalar (unaligned-row) variants store
    # through ChunkIO's scalar form (aligned pieces where the address allows them, ``shifted``);
    # looped layouts keep their per-element read-modify-write: as 128-bit accesses the dresidual
    # forms spilled (ptxas 13.5)
    ws_store_4 = ChunkIO(intr, _dtypes.FLOAT32, 4, n, spec.vector and n % 4 == 0, shifted).store

    # deterministic=False (spec.atomic_dweight): the partials go into one float32 row by atomic
    # adds instead of into the program's workspace row; 4 at a time where they are 16-byte
    # aligned (the accumulator row is)
    atomic, atomic_add, atomic_add_4 = (spec.atomic_dweight, intr.atomic_add_f32,
                                        intr.atomic_add_f32x4)
    atomic_by_4 = spec.vector and n % 4 == 0

    @jitable
    def ws_add_4(ws, col0, vals, slot):
        """vals[slot:slot + 4] added into accumulator columns col0.. (those inside n)."""
        if atomic_by_4:
            atomic_add_4(ws, col0, vals[slot], vals[slot + 1], vals[slot + 2], vals[slot + 3])
        else:
            for e in range(4):
                if col0 + e < n:
                    atomic_add(ws, col0 + e, vals[slot + e])

    @jitable
    def ws_put(ws, start, col0, vals, slot):
        """4 floats of a paired block's partial row to its workspace row, or added into the
        accumulator row (``atomic``; the vector form's groups lie wholly inside or past n)."""
        if atomic:
            ws_add_4(ws, col0, vals, slot)
        else:
            ws_store_4(ws, start, col0, vals, slot)

    heads = spec.heads

    # column programs (spec.column_dweight): the grid's last programs sum dweight straight from
    # x, dy and rstd, a column block each; the row programs keep no partial
    columns = spec.column_dweight
    assert not columns or (rows == 1 and cached and has_weight and not recompute
                           and not spec.paired), spec
    col_programs = _config.bwd_column_programs(spec)
    col_width = _config.BWD_COLUMN_CHUNKS * chunk       # columns a column program sums
    col_groups = threads // _config.BWD_COLUMN_CHUNKS   # row groups walking them
    col_subs = threads // col_width if columns else 1   # partial sums of the groups' sums
    col_shape = (col_groups, col_width) if columns else (1, 1)

    encode_dw = codec(intr, spec.weight or _dtypes.FLOAT32)[1]

    @jitable
    def starts(call, row):
        """Row ``row``'s element offsets in dy, x, dresidual and dx: row * stride, or for
        head rows (outer * stride + inner * head_stride) with (outer, inner) = divmod(row, H)
        (a row index fits 32 bits: the host checks M)."""
        s = call.strides
        if heads:
            q = uint32(row) // uint32(call.heads)
            outer, inner = int64(q), int64(uint32(row) - q * uint32(call.heads))
            h = call.head_strides
            return Offsets(outer * s.dy + inner * h.dy, outer * s.x + inner * h.x,
                           outer * s.dres + inner * h.dres, outer * s.dx + inner * h.dx)
        return Offsets(row * s.dy, row * s.x, row * s.dres, row * s.dx)

    @jitable
    def load_or_zero(ptr, start, col0, live, vals, slot):
        if live and col0 < n:
            load(ptr, start, col0, vals, slot)
        else:
            for e in range(chunk):
                vals[slot + e] = float32(0.0)

    @jitable
    def load_weight(weight, col0, wv, slot):
        if col0 < n:
            load_w(weight, 0, col0, wv, slot)
        else:
            for e in range(chunk):
                wv[slot + e] = float32(0.0)

    @jitable
    def load_row_words(call, row, tx, pk):
        """This thread's chunks of row ``row`` of x and dy as loaded words into pk (zeros past
        M)."""
        a, at = call.arrays, starts(call, row)
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if row < call.m and col0 < n:
                load_words(a.x, at.x, col0, pk.x, k * 4)
                load_words(a.dy, at.dy, col0, pk.dy, k * 4)
            else:
                for e in range(4):
                    pk.x[k * 4 + e] = uint32(0)
                    pk.dy[k * 4 + e] = uint32(0)

    @jitable
    def ws_store(ws, start, col0, vals, slot):
        """A chunk's floats to the workspace, 4 at a time: groups past n are skipped (the
        vector form's groups lie wholly inside or past n; the scalar form checks each element)."""
        for a in range(chunk // 4):
            if col0 + a * 4 < n:
                ws_store_4(ws, start, col0 + a * 4, vals, slot + a * 4)

    # direct (spec.direct_dweight): the grid's one partial row is dweight, encoded here.  A
    # 16-bit weight's chunk is 16 bytes (x has its dtype): stored as x's chunks are, where byte
    # by byte the warp's stores took 8 times the L2 writes (1x8192: 2 us of a 4.8 us call)
    direct = spec.direct_dweight

    @jitable
    def store_partial(ws, ws_start, tx, acc):
        """An unpaired cached row's dweight partial to its workspace row, added into the
        accumulator row (``atomic``), or encoded to dweight (``direct``: the partial plus 0,
        as dweight_reduce sums it; acc is not read again)."""
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if direct:
                if col0 < n:
                    for e in range(chunk):
                        acc[k * chunk + e] = acc[k * chunk + e] + float32(0.0)
                    store_w(ws, 0, col0, acc, k * chunk)
            elif atomic:
                for a in range(chunk // 4):
                    if col0 + a * 4 < n:
                        ws_add_4(ws, col0 + a * 4, acc, k * chunk + a * 4)
            else:
                ws_store(ws, ws_start, col0, acc, k * chunk)

    @jitable
    def weighted(dv, wv, slot, wslot, weight_offset, out):
        """out[0:chunk] = wdy = dy * (weight + weight_offset) of one chunk."""
        for e in range(chunk):
            out[e] = dv[slot + e] * (wv[wslot + e] + weight_offset) if has_weight else dv[slot + e]

    @jitable
    def words_to_chunk(w, k, z, vals):
        """Chunk k of packed words (each XORed with ``z``) as floats in vals[0:chunk]."""
        words_to_floats(w[k * 4] ^ z, w[k * 4 + 1] ^ z, w[k * 4 + 2] ^ z, w[k * 4 + 3] ^ z, vals,
                        0)

    @jitable
    def start_program(call, tx, ws_start, sc):
        """A program's weight floats (held ones) and zeroed dweight partial: in registers for
        cached layouts, in its workspace row for looped ones."""
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if cached:
                if hold_w:
                    load_weight(call.arrays.weight, col0, sc.w, k * chunk)
                for e in range(chunk):
                    sc.acc[k * chunk + e] = float32(0.0)
            elif has_weight:
                for e in range(chunk):
                    if col0 + e < n:
                        call.arrays.ws[ws_start + col0 + e] = float32(0.0)

    @jitable
    def first_pass(call, row, live, tx, trips, r_row, sc, pk):
        """Pass 1 of a row: this thread's shares of sum(x * wdy) and, when rstd is recomputed,
        of sum(x * x).  Packed rows decode their words (loading them here unless prefetched);
        with ``early_dw`` the dweight partial takes the row's dy * x_hat here too."""
        a, at = call.arrays, starts(call, row)
        x_start = at.x
        dy_start = at.dy
        offset = call.weight_offset
        sxw = sxw_comp = float32(0.0)
        ss = ss_comp = float32(0.0)
        for k in range(trips):
            col0 = (tx + k * threads) * chunk
            slot = k * chunk if cached else 0
            wslot = slot if hold_w else 0
            if packed:
                if not prefetch:
                    if live and col0 < n:
                        load_words(a.x, x_start, col0, pk.x, k * 4)
                        load_words(a.dy, dy_start, col0, pk.dy, k * 4)
                    else:
                        for e in range(4):
                            pk.x[k * 4 + e] = uint32(0)
                            pk.dy[k * 4 + e] = uint32(0)
                words_to_chunk(pk.x, k, uint32(0), sc.xt)
                words_to_chunk(pk.dy, k, uint32(0), sc.dt)
                if has_weight and not hold_w:
                    load_weight(a.weight, col0, sc.w, 0)
                weighted(sc.dt, sc.w, 0, wslot, offset, sc.wdy)
                sxw, sxw_comp = accumulate(sxw, sxw_comp, chunk_dot(sc.xt, 0, sc.wdy, 0))
                if recompute:
                    ss, ss_comp = accumulate(ss, ss_comp, chunk_sumsq(sc.xt, 0))
                if early_dw and live:
                    for e in range(chunk):
                        sc.acc[slot + e] = fma(sc.dt[e], sc.xt[e] * r_row, sc.acc[slot + e])
                continue
            load_or_zero(a.x, x_start, col0, live, sc.x, slot)
            load_or_zero(a.dy, dy_start, col0, live, sc.dy, slot)
            if has_weight and not hold_w:
                load_weight(a.weight, col0, sc.w, 0)
            weighted(sc.dy, sc.w, slot, wslot, offset, sc.wdy)
            sxw, sxw_comp = accumulate(sxw, sxw_comp, chunk_dot(sc.x, slot, sc.wdy, 0))
            if recompute:
                ss, ss_comp = accumulate(ss, ss_comp, chunk_sumsq(sc.x, slot))
        return sxw, ss

    @jitable
    def pair_partials(ws, ws_start, tx, ty, part, acc):
        """Paired blocks: each row hands the other the half of its partial that the other
        stores, so both store 16 bytes; each sum is row 0's + row 1's (a + b is b + a, bit for
        bit)."""
        if ty == 0:
            for e in range(half):
                part[0, e, tx] = acc[half + e]
        else:
            for e in range(half):
                part[1, e, tx] = acc[e]
        gpu.syncthreads()
        col0 = tx * chunk
        if ty == 0:
            for e in range(half):
                acc[e] += part[1, e, tx]
            if col0 < n:
                ws_put(ws, ws_start, col0, acc, 0)
        else:
            for e in range(half):
                acc[half + e] += part[0, e, tx]
            if col0 + half < n:
                ws_put(ws, ws_start, col0 + half, acc, half)

    @jitable
    def load_dres_words(call, row, live, tx, pk):
        """``early_dres``: the row's dresidual words, loaded with its x and dy."""
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if live and col0 < n:
                load_words(call.arrays.dres, starts(call, row).dres, col0, pk.dres, k * 4)

    @jitable
    def column_dweight(call, block, tx, acc, xv, dv, xw, dw, part, subs):
        """dweight of columns [block * col_width, (block + 1) * col_width): thread (g, c) sums
        chunk c's dy * (x * rstd) over rows g, g + G, ... in row order (two rows' loads in
        flight), then the G group sums of each column are added in a fixed order: G / S
        strided runs, then their S sums.  A function of M and the layout only."""
        a = call.arrays
        c = tx % _config.BWD_COLUMN_CHUNKS
        g = tx // _config.BWD_COLUMN_CHUNKS
        col0 = block * col_width + c * chunk
        for e in range(chunk):
            acc[e] = float32(0.0)
        if col0 < n:
            row = int64(g)
            while row < call.m:
                later = row + col_groups
                both = later < call.m
                first_at = starts(call, row)
                load_words(a.x, first_at.x, col0, xw, 0)
                load_words(a.dy, first_at.dy, col0, dw, 0)
                r_first = a.rstd[row]
                r_later = float32(0.0)
                if both:
                    later_at = starts(call, later)
                    load_words(a.x, later_at.x, col0, xw, 4)
                    load_words(a.dy, later_at.dy, col0, dw, 4)
                    r_later = a.rstd[later]
                words_to_chunk(xw, 0, uint32(0), xv)
                words_to_chunk(dw, 0, uint32(0), dv)
                for e in range(chunk):
                    acc[e] = fma(dv[e], xv[e] * r_first, acc[e])
                if both:
                    words_to_chunk(xw, 1, uint32(0), xv)
                    words_to_chunk(dw, 1, uint32(0), dv)
                    for e in range(chunk):
                        acc[e] = fma(dv[e], xv[e] * r_later, acc[e])
                row += 2 * col_groups
        for e in range(chunk):
            part[g, c * chunk + e] = acc[e]
        gpu.syncthreads()
        j = tx % col_width
        sub = tx // col_width
        total = float32(0.0)
        for q in range(sub, col_groups, col_subs):
            total += part[q, j]
        subs[sub, j] = total
        gpu.syncthreads()
        col = block * col_width + tx
        if tx < col_width and col < n:
            total = subs[0, tx]
            for q in range(1, col_subs):
                total += subs[q, tx]
            a.ws[col] = encode_dw(total)

    def rmsnorm_bwd(dy, x, weight, rstd, dres, dx, ws, m, dy_stride, x_stride, dres_stride,
                    dx_stride, eps, weight_offset, heads, dy_head_stride, x_head_stride,
                    dres_head_stride, dx_head_stride):
        call = Call(Arrays(dy, x, weight, rstd, dres, dx, ws),
                    Offsets(dy_stride, x_stride, dres_stride, dx_stride), m, eps, weight_offset,
                    heads, Offsets(dy_head_stride, x_head_stride, dres_head_stride,
                                   dx_head_stride))
        tx = gpu.threadIdx.x
        ty = gpu.threadIdx.y
        program = int64(gpu.blockIdx.x)
        programs = int64(gpu.gridDim.x)
        if red_align:   # a constant: the other branch is pruned before typing (numba-hip)
            red = gpu.shared.array(red_shape, float32, alignment=red_align)
        else:
            red = gpu.shared.array(red_shape, float32)
        xv = gpu.local.array(chunk if packed else span, float32)
        dv = gpu.local.array(chunk if packed else span, float32)
        wv = gpu.local.array(span if hold_w else chunk, float32)
        acc = gpu.local.array(span, float32)
        wdy = gpu.local.array(chunk, float32)
        out = gpu.local.array(chunk, float32)
        rv = gpu.local.array(chunk, float32)
        xw = gpu.local.array(words, uint32)
        dw = gpu.local.array(words, uint32)
        rw = gpu.local.array(dres_words, uint32)
        xn = gpu.local.array(next_words, uint32)
        dn = gpu.local.array(next_words, uint32)
        xt = gpu.local.array(chunk, float32)
        dt = gpu.local.array(chunk, float32)
        sc = Floats(xv, dv, wv, acc, wdy, out, rv, xt, dt)
        pk = Packed(xw, dw, rw)         # this row's words (``packed``)
        nxt = Packed(xn, dn, rw)        # the next row's (``prefetch``; its dres is unused)
        # a column program's words of two rows' chunks (``columns``)
        cw = Packed(gpu.local.array(8 if columns else 1, uint32),
                    gpu.local.array(8 if columns else 1, uint32), rw)
        # a zero the compiler cannot prove: pass 2 decodes the packed words XORed with it, so no
        # decoded value or product of pass 1 is kept live across the row reduction.  Stored once,
        # before a barrier: rows of at most a warp reduce without one
        zero = gpu.shared.array(1, int32)
        if packed:
            if tx == 0 and ty == 0:
                zero[0] = int32(m >> 62)
            gpu.syncthreads()
        part = gpu.shared.array((2, half, threads) if paired else (1, 1, 1), float32)
        if columns:
            programs -= col_programs
            if program >= programs:
                column_dweight(call, program - programs, tx, sc.acc, sc.xt, sc.dt, cw.x, cw.dy,
                               gpu.shared.array(col_shape, float32),
                               gpu.shared.array((col_subs, col_width), float32))
                return
        ws_start = (program if paired else program * rows + ty) * n
        parity = 0
        r_next = float32(0.0)
        # the first row's words are asked for before the weight: every program loads the same
        # weight lines at once, and issued first they held up the loads the first row waits on.
        # H200, bf16, kernel 1 (us), weight first / row first: 8192x8192 104.9-105.1 /
        # 104.3-104.5, 4096x4096 30.1-30.8 / 29.4-30.3, 1024x8192 18.7-18.8 / 18.4, 16384x8192
        # 201.8-201.9 / 201.5
        if prefetch:
            first = program * rows + ty
            load_row_words(call, first, tx, pk)
            if next_rstd and first < m:
                r_next = rstd[first]
        start_program(call, tx, ws_start, sc)
        step = programs * rows
        iters = (m - program * rows + step - 1) // step   # uniform in the block
        # looped layouts walk many chunks: a trip count the compiler cannot see (m >> 63 is 0)
        # keeps those loops rolled; unrolled, their loads spill (seen on gfx942 at N=65536)
        trips = per_thread if cached else per_thread + (m >> 63)
        for it in range(iters):
            row = (program + it * programs) * rows + ty
            live = row < m
            if early_dres:
                load_dres_words(call, row, live, tx, pk)
            r_row = r_next
            if prefetch:
                load_row_words(call, row + step, tx, nxt)
                if next_rstd:
                    r_next = rstd[row + step] if row + step < m else float32(0.0)
            sxw, ss = first_pass(call, row, live, tx, trips, r_row, sc, pk)
            if early_dw and it == iters - 1:
                store_partial(ws, ws_start, tx, sc.acc)
            if recompute:
                ss = row_sum(ss, red, parity, ty, tx)
                parity ^= 1
                # not intr.rsqrt: its shorter schedule spilled the 16384-column rows on sm_90
                r = float32(1.0) / math.sqrt(ss / n_f32 + eps)
            elif next_rstd:
                r = r_row
            else:
                r = rstd[row] if live else float32(0.0)
            sxw = row_sum(sxw, red, parity, ty, tx)
            parity ^= 1
            c1 = sxw * r / n_f32
            if live:
                # pass 2: dx (+ dresidual) stored, and the dweight partial dy * x_hat (unless
                # early_dw took it in pass 1); packed words decoded XORed with ``z``.  Here, on
                # the kernel's own arguments, rather than in a function of ``call``: inlined
                # late, ptxas spilled the float32 N = 16384 rows beyond their allowance
                z = uint32(zero[0]) if packed else uint32(0)
                row_at = starts(call, row)
                dx_start = row_at.dx
                for k in range(trips):
                    col0 = (tx + k * threads) * chunk
                    if col0 < n:
                        slot = k * chunk if cached else 0
                        if packed:
                            words_to_chunk(pk.x, k, z, sc.x)
                            words_to_chunk(pk.dy, k, z, sc.dy)
                        elif not cached:
                            load(x, row_at.x, col0, sc.x, 0)
                            load(dy, row_at.dy, col0, sc.dy, 0)
                        if has_weight and not hold_w:
                            load_w(weight, 0, col0, sc.w, 0)
                        if early_dres:
                            words_to_chunk(pk.dres, k, uint32(0), sc.dres)
                        elif has_dres:
                            load(dres, row_at.dres, col0, sc.dres, 0)
                        vslot = 0 if packed else slot     # where this chunk's x / dy floats are
                        weighted(sc.dy, sc.w, vslot, slot if hold_w else 0, weight_offset,
                                 sc.wdy)
                        for e in range(chunk):
                            # every multiply-add an explicit fma: see intrinsics fma
                            x_hat = sc.x[vslot + e] * r
                            g = fma(-x_hat, c1, sc.wdy[e])
                            sc.out[e] = fma(g, r, sc.dres[e]) if has_dres else g * r
                            if has_weight and not (early_dw or columns):
                                if cached:
                                    sc.acc[slot + e] = fma(sc.dy[vslot + e], x_hat,
                                                           sc.acc[slot + e])
                                elif col0 + e < n:
                                    at = ws_start + col0 + e
                                    ws[at] = fma(sc.dy[e], x_hat, ws[at])
                        store(dx, dx_start, col0, sc.out, 0)
            if prefetch:
                for e in range(words):
                    pk.x[e] = nxt.x[e]
                    pk.dy[e] = nxt.dy[e]
        if paired:
            pair_partials(ws, ws_start, tx, ty, part, sc.acc)
        elif cached and has_weight and not (early_dw and iters > 0) and not columns:
            store_partial(ws, ws_start, tx, sc.acc)

    return rmsnorm_bwd


def reduce_argtypes(spec: ReduceSpec):
    """(ws, dweight, ws_rows, n)"""
    return (types.CPointer(types.float32), _pointer(spec.weight), types.int64, types.int64)


def make_dweight_reduce(intr, spec: ReduceSpec):
    """dweight[j] = sum over ws rows of ws[r, j], in a fixed order: thread (tx, ty) of block b sums
    rows ty, ty + G, ... of column ``columns * b + tx`` one after the other; the G partial sums
    are then added in group order.  The loads go out ``batch`` at a time before their adds (the
    adds keep row order, so the bits are those of one load at a time), the last batch too when
    it is short: the reduction is a chain of memory latencies, not of bandwidth (~4 MB).  With
    ``spec.pairs`` a "row" is the sum of workspace rows 2q and 2q + 1 (the rows of a paired
    kernel's program, BwdSpec.pair_twin)."""
    gpu, jitable = intr.gpu, intr.jitable
    encode = codec(intr, spec.weight)[1]
    columns, groups, batch, pairs = spec.columns, spec.groups, spec.batch, spec.pairs
    span = 2 if pairs else 1     # workspace rows per summed row

    @jitable
    def row_value(ws, at, n):
        if pairs:
            return ws[at] + ws[at + n]
        return ws[at]

    @jitable
    def column_sum(ws, col, first, count, n, vals):
        """sum of row first + i * groups of column col for i < count, in order."""
        total = float32(0.0)
        stride = int64(groups * span) * n
        at = int64(first * span) * n + col
        left = count
        while left > 0:
            # a short last batch loads its rows at once too (one latency, not one a row); its
            # missing rows add +0.0, which leaves every sum's bits as they were (total starts at
            # +0.0, and no float32 sum from there is -0.0)
            for k in range(batch):
                vals[k] = row_value(ws, at + k * stride, n) if k < left else float32(0.0)
            for k in range(batch):
                total += vals[k]
            at += batch * stride
            left -= batch
        return total

    def dweight_reduce(ws, dweight, ws_rows, n):
        tx = gpu.threadIdx.x
        ty = gpu.threadIdx.y
        col = int64(gpu.blockIdx.x) * columns + tx
        part = gpu.shared.array((groups, columns), float32)
        vals = gpu.local.array(batch, float32)
        rows = ws_rows // span
        total = float32(0.0)
        if col < n and ty < rows:
            total = column_sum(ws, col, ty, (rows - ty + groups - 1) // groups, n, vals)
        part[ty, tx] = total
        gpu.syncthreads()
        if ty == 0 and col < n:
            total = part[0, tx]
            for g in range(1, groups):
                total += part[g, tx]
            dweight[col] = encode(total)

    return dweight_reduce
