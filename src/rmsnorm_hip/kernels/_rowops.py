"""Row pieces shared by every forward variant: 16-byte chunk load/store in a dtype, the chunk's
sum of squares, the per-row sum and max across the threads of a row, and the store of a chunk
quantised to 8 bits.

A chunk is ``layout.chunk`` consecutive elements (16 bytes of x).  The vector form reads it with
128-bit accesses; the scalar form runs at any element alignment (a ragged last chunk is
zero-filled): a 16-byte span inside the row as the two aligned blocks around it, funnel-shifted
(``_config.scalar_shifted``), the row's edges element by element.  Both fill the same
float32 slots, so every float32 operation after the load is the same and a row gives bitwise the
same result whichever form ran.
"""
import numpy as np
from numba import float32, int8, int32, uint8, uint16, uint32, uint64

from .. import _dtypes
from ._config import CHUNK_BYTES, ceil_div


class ChunkIO:
    """``load(ptr, start, col0, vals, slot)`` / ``store(...)`` of one chunk of ``chunk`` elements
    of ``dtype`` at ``ptr[start + col0 ...]``, into / from ``vals[slot ...]`` (float32).
    ``shifted=False`` keeps a scalar form element by element (kernels whose registers are too
    few for a span's two aligned blocks: _config.scalar_shifted).

    Both forms also have ``load_words(ptr, start, col0, words, at)``, the chunk kept as the four
    uint32 words of its 128-bit load (eight 16-bit elements in four registers; the scalar form
    assembles them as ``load`` reads the chunk), and ``words_to_floats(w0, w1, w2, w3, vals,
    slot)``, which decodes them exactly as ``load`` does; the vector form also
    ``store_words(ptr, start, col0, words, at)``, four such words stored as they are (None in
    the scalar form).  ``store`` and ``load_words`` take chunks of 16 bytes (x's); ``load`` any
    number of 16-byte spans (a float32 weight's chunk of 8 is two).  ``stream``: the vector
    form loads through ``load_b128_stream`` (data read once)."""

    def __init__(self, intr, dtype, chunk, n, vector, shifted=True, stream=False):
        (self.load, self.store, self.load_words, self.words_to_floats,
         self.store_words) = _make_chunk_io(intr, dtype, chunk, n, vector, shifted, stream)


def _gpu_only(intr, name):
    """A GPU namespace's intrinsic ``name``; None on the CPU's, whose kernels never call it."""
    return getattr(intr, name) if "gpu" in intr.features else None


def _shifted_access(intr):
    """Whether scalar forms can take aligned accesses around unaligned spans: on a namespace
    with the intrinsics for them (not the CPU's)."""
    return "gpu" in intr.features


def codec(intr, dtype):
    """(decode, encode, pack two) between float32 and an element of ``dtype`` as stored
    (pack two: None for float32, whose elements are whole words).  The 8-bit quantised dtypes
    are encode-only: (None, float32 -> level, None), the level an integer (see intrinsics)."""
    if dtype == _dtypes.INT8:
        return None, intr.f32_to_i8, None
    if dtype == _dtypes.FLOAT8_E4M3FN:
        return None, intr.f32_to_e4m3, None
    if dtype == _dtypes.BFLOAT16:
        return intr.bf16_to_f32, intr.f32_to_bf16, intr.pack_bf16x2
    if dtype == _dtypes.FLOAT16:
        return intr.f16_to_f32, intr.f32_to_f16, intr.pack_f16x2
    as_f32 = intr.jitable(lambda v: float32(v))
    return as_f32, as_f32, None


def _make_chunk_io(intr, dtype, chunk, n, vector, shifted, stream=False):
    jitable = intr.jitable
    itemsize = _dtypes.ITEMSIZE[dtype]
    n_vec = ceil_div(chunk * itemsize, CHUNK_BYTES)      # 128-bit accesses per chunk
    elems_per_vec = CHUNK_BYTES // itemsize
    decode, encode, pack2 = codec(intr, dtype)
    half = pack2 is not None
    u32_as_f32, f32_as_u32 = intr.u32_as_f32, intr.f32_as_u32
    load_b128, store_b128 = _gpu_only(intr, "load_b128"), _gpu_only(intr, "store_b128")
    if vector and stream:
        load_b128 = intr.load_b128_stream

    @jitable
    def words_to_floats(w0, w1, w2, w3, vals, at):
        if half:
            vals[at + 0] = decode(w0 & uint32(0xFFFF))
            vals[at + 1] = decode(w0 >> uint32(16))
            vals[at + 2] = decode(w1 & uint32(0xFFFF))
            vals[at + 3] = decode(w1 >> uint32(16))
            vals[at + 4] = decode(w2 & uint32(0xFFFF))
            vals[at + 5] = decode(w2 >> uint32(16))
            vals[at + 6] = decode(w3 & uint32(0xFFFF))
            vals[at + 7] = decode(w3 >> uint32(16))
        else:
            vals[at + 0] = u32_as_f32(w0)
            vals[at + 1] = u32_as_f32(w1)
            vals[at + 2] = u32_as_f32(w2)
            vals[at + 3] = u32_as_f32(w3)

    @jitable
    def pair(vals, at):
        return pack2(vals[at], vals[at + 1])

    load_words = store_words = None
    if vector:
        @jitable
        def store_words(ptr, start, col0, words, at):
            store_b128(ptr, start + col0, words[at], words[at + 1], words[at + 2], words[at + 3])

        @jitable
        def load_words(ptr, start, col0, words, at):
            w0, w1, w2, w3 = load_b128(ptr, start + col0)
            words[at] = w0
            words[at + 1] = w1
            words[at + 2] = w2
            words[at + 3] = w3

        @jitable
        def load(ptr, start, col0, vals, slot):
            for a in range(n_vec):
                w0, w1, w2, w3 = load_b128(ptr, start + col0 + a * elems_per_vec)
                words_to_floats(w0, w1, w2, w3, vals, slot + a * elems_per_vec)

        @jitable
        def store(ptr, start, col0, vals, slot):
            if half:
                store_b128(ptr, start + col0, pair(vals, slot), pair(vals, slot + 2),
                           pair(vals, slot + 4), pair(vals, slot + 6))
            else:
                store_b128(ptr, start + col0, f32_as_u32(vals[slot]), f32_as_u32(vals[slot + 1]),
                           f32_as_u32(vals[slot + 2]), f32_as_u32(vals[slot + 3]))
    else:
        align_offset = _gpu_only(intr, "align_offset")
        shifted = shifted and _shifted_access(intr)
        store_b64, store_b32 = _gpu_only(intr, "store_b64"), _gpu_only(intr, "store_b32")
        per_word = 4 // itemsize        # elements in a 32-bit word

        @jitable
        def inside(col):
            """Whether the two aligned 16-byte blocks around the span at column ``col`` (a
            multiple of a span's elements, as every caller's is) lie in the row: it is not the
            row's first span (the block before may start before the row) and a whole span
            follows it."""
            return shifted and col > 0 and col + 2 * elems_per_vec <= n

        @jitable
        def funnel(lo, hi, bits):
            return uint32(((uint64(hi) << uint64(32)) | uint64(lo)) >> uint64(bits))

        @jitable
        def span_words(ptr, idx):
            """The 16 bytes at element ``idx`` (any element alignment) as four words, from the
            two aligned 16-byte blocks around them."""
            off = align_offset(ptr, idx)
            if off == 0:        # an aligned array among unaligned ones (a weight, an output)
                return load_b128(ptr, idx)
            a0, a1, a2, a3 = load_b128(ptr, idx - off // itemsize)
            b0, b1, b2, b3 = load_b128(ptr, idx - off // itemsize + elems_per_vec)
            q = off >> 2
            if q == 0:
                c0, c1, c2, c3, c4 = a0, a1, a2, a3, b0
            elif q == 1:
                c0, c1, c2, c3, c4 = a1, a2, a3, b0, b1
            elif q == 2:
                c0, c1, c2, c3, c4 = a2, a3, b0, b1, b2
            else:
                c0, c1, c2, c3, c4 = a3, b0, b1, b2, b3
            bits = (off & 3) * 8
            return (funnel(c0, c1, bits), funnel(c1, c2, bits), funnel(c2, c3, bits),
                    funnel(c3, c4, bits))

        @jitable
        def store_span(ptr, idx, w0, w1, w2, w3):
            """Four words as the 16 bytes at element ``idx`` (any element alignment), in aligned
            pieces: one 128-bit store, two 64-bit, 32 + 64 + 32 bits, or (16-bit elements two
            bytes past a word) 16 + 3 x 32 + 16 bits.  A float32 array's elements are always
            word-aligned, so its offsets are multiples of 4."""
            off = align_offset(ptr, idx)
            if off == 0:
                store_b128(ptr, idx, w0, w1, w2, w3)
            elif off == 8:
                store_b64(ptr, idx, w0, w1)
                store_b64(ptr, idx + 2 * per_word, w2, w3)
            elif off & 3 == 0:
                store_b32(ptr, idx, w0)
                store_b64(ptr, idx + per_word, w1, w2)
                store_b32(ptr, idx + 3 * per_word, w3)
            elif half:      # 16-bit elements two bytes past a word
                ptr[idx] = uint16(w0 & uint32(0xFFFF))
                store_b32(ptr, idx + 1, (w0 >> uint32(16)) | (w1 << uint32(16)))
                store_b32(ptr, idx + 3, (w1 >> uint32(16)) | (w2 << uint32(16)))
                store_b32(ptr, idx + 5, (w2 >> uint32(16)) | (w3 << uint32(16)))
                ptr[idx + 7] = uint16(w3 >> uint32(16))

        @jitable
        def load_words(ptr, start, col0, words, at):
            """The chunk in the four words a 128-bit load would give (zeros past n): what
            ``load`` reads, for rows that keep it packed."""
            if inside(col0):
                w0, w1, w2, w3 = span_words(ptr, start + col0)
                words[at] = w0
                words[at + 1] = w1
                words[at + 2] = w2
                words[at + 3] = w3
                return
            for j in range(4):
                if half:
                    lo = uint32(0)
                    hi = uint32(0)
                    if col0 + 2 * j < n:
                        lo = uint32(ptr[start + col0 + 2 * j])
                    if col0 + 2 * j + 1 < n:
                        hi = uint32(ptr[start + col0 + 2 * j + 1])
                    words[at + j] = lo | (hi << uint32(16))
                else:
                    bits = uint32(0)
                    if col0 + j < n:
                        bits = f32_as_u32(float32(ptr[start + col0 + j]))
                    words[at + j] = bits

        @jitable
        def load(ptr, start, col0, vals, slot):
            for a in range(n_vec):
                col = col0 + a * elems_per_vec
                if inside(col):
                    w0, w1, w2, w3 = span_words(ptr, start + col)
                    words_to_floats(w0, w1, w2, w3, vals, slot + a * elems_per_vec)
                else:
                    for e in range(a * elems_per_vec, min(chunk, (a + 1) * elems_per_vec)):
                        value = float32(0.0)
                        if col0 + e < n:
                            if half:
                                value = decode(ptr[start + col0 + e])
                            else:
                                value = float32(ptr[start + col0 + e])
                        vals[slot + e] = value

        @jitable
        def store(ptr, start, col0, vals, slot):
            if shifted and col0 + chunk <= n:   # whole chunks (of one span: 16 bytes of x)
                if half:
                    store_span(ptr, start + col0, pair(vals, slot), pair(vals, slot + 2),
                               pair(vals, slot + 4), pair(vals, slot + 6))
                else:
                    store_span(ptr, start + col0, f32_as_u32(vals[slot]),
                               f32_as_u32(vals[slot + 1]), f32_as_u32(vals[slot + 2]),
                               f32_as_u32(vals[slot + 3]))
                return
            for e in range(chunk):
                if col0 + e < n:
                    if half:
                        ptr[start + col0 + e] = uint16(encode(vals[slot + e]))
                    else:
                        ptr[start + col0 + e] = vals[slot + e]

    return load, store, load_words, words_to_floats, store_words


def pair_adder(intr, dtype):
    """The intrinsic adding two words of 16-bit floats of ``dtype`` half by half, each sum
    rounded once (``add_bf16x2`` / ``add_f16x2``); None for float32."""
    return {_dtypes.BFLOAT16: intr.add_bf16x2, _dtypes.FLOAT16: intr.add_f16x2}.get(dtype)


def make_chunk_dot(intr, chunk):
    """Pairwise sum of ``a[i + k] * b[j + k]`` over a chunk (chunk 4 or 8), each pair one
    explicit fma (see intrinsics fma: the same rounding whatever code surrounds it)."""
    fma = intr.fma

    @intr.jitable
    def chunk_dot(a, i, b, j):
        s0 = fma(a[i], b[j], a[i + 1] * b[j + 1])
        s1 = fma(a[i + 2], b[j + 2], a[i + 3] * b[j + 3])
        total = s0 + s1
        if chunk == 8:
            s2 = fma(a[i + 4], b[j + 4], a[i + 5] * b[j + 5])
            s3 = fma(a[i + 6], b[j + 6], a[i + 7] * b[j + 7])
            total = total + (s2 + s3)
        return total

    return chunk_dot


def make_accumulate(intr, compensated):
    """add(acc, comp, term) -> (acc, comp): a thread's running sum over its chunks.  Looped rows
    (``compensated``: hundreds of chunks a thread at N = 2**21) carry Kahan's compensation, so the
    error does not grow with the number of chunks; cached rows (at most a few chunks) add plainly
    and ``comp`` stays 0."""
    @intr.jitable
    def add(acc, comp, term):
        if compensated:
            y = term - comp
            t = acc + y
            return t, (t - acc) - y
        return acc + term, comp

    return add


def make_chunk_sumsq(intr, chunk):
    """Pairwise sum of squares of ``vals[slot : slot + chunk]``."""
    chunk_dot = make_chunk_dot(intr, chunk)

    @intr.jitable
    def chunk_sumsq(vals, slot):
        return chunk_dot(vals, slot, vals, slot)

    return chunk_sumsq


def reduce_buffer_shape(intr, bufs, rows, threads):
    """Shape of the block's shared float32 ``red[bufs, rows, width]`` through which the warps of
    a row combine (make_row_sum, make_row_sum_max), to be allocated aligned to
    ``intr.shared_alignment`` where that is not None.  After the barrier every thread reads its
    row's warp partials in warp order: with rows of a multiple of 4 floats, 16-byte aligned, the
    compiler reads them 4 at a time (a 1024-thread row: 8 ld.shared.v4 a thread instead of 32
    ld.shared.f32, each of which holds the SM's shared-memory pipe a cycle per warp).  The same
    additions in the same order: the same bits.  H200, 4 at a time / one at a time, two runs each
    (docs/performance.md): level at most
    shapes, ahead at a few (backward 2048x8192 70.3-70.6 / 67.8-68.1% of copy, dresidual
    4096x4096 80.0-80.6 / 78.5-79.3, fused add 4096x4096 89.1-91.1 / 87.5-87.8)."""
    warps = ceil_div(threads, intr.warp)
    pad = warps > 1 and intr.shared_alignment
    return (bufs, rows, 4 * ceil_div(warps, 4) if pad else warps)


def make_row_sum(intr, threads, row_barriers=False):
    """Sum a float32 over the ``threads`` threads of a row (threadIdx.x), every thread gets it.
    Lanes of a warp combine by xor-butterfly, warps of a row through ``red[buf, row_in_block, :]``
    (``buf`` alternates between consecutive reductions of a block, so one barrier each suffices).
    ``row_barriers``: each row of the block waits at its own barrier (``intr.row_barrier``)
    instead of the block's, so rows sharing a block do not wait for each other."""
    return _make_row_reduce(intr, threads, intr.warp_sum, _add(intr), row_barriers)


def make_row_sum_max(intr, threads):
    """``row_sum_max(s, mx, red, buf, ty, tx)``: the sum of ``s`` (as :func:`make_row_sum`, in the
    same order) and the max of ``mx`` (NaN winning) over the threads of a row, in one round: one
    barrier, ``red[buf]`` and ``red[buf + 1]``."""
    warp = intr.warp
    lanes = min(threads, warp)
    warps_per_row = ceil_div(threads, warp)
    gpu, warp_sum, warp_max = intr.gpu, intr.warp_sum, intr.warp_max
    fold_sum = _make_fold(intr, warps_per_row, _add(intr))
    fold_max = _make_fold(intr, warps_per_row, intr.max_nan)

    @intr.jitable
    def row_sum_max(s, mx, red, buf, ty, tx):
        s = warp_sum(s, lanes)
        mx = warp_max(mx, lanes)
        if warps_per_row > 1:
            if tx % warp == 0:
                red[buf, ty, tx // warp] = s
                red[buf + 1, ty, tx // warp] = mx
            gpu.syncthreads()
            s = fold_sum(red, buf, ty)
            mx = fold_max(red, buf + 1, ty)
        return s, mx

    return row_sum_max


def _add(intr):
    @intr.jitable
    def add(a, b):
        return a + b

    return add


def _make_fold(intr, warps, combine):
    """``fold(red, b, ty)``: ``combine`` over ``red[b, ty, 0 .. warps - 1]`` in warp order, the
    partials read 4 at a time before they are combined, so that each 4 are one ld.shared.v4 on a
    16-byte aligned buffer (reduce_buffer_shape) even where the loop stays rolled."""
    quads = warps // 4
    tail = 4 * quads if quads else 1

    @intr.jitable
    def fold(red, b, ty):
        if quads:
            a0, a1, a2, a3 = red[b, ty, 0], red[b, ty, 1], red[b, ty, 2], red[b, ty, 3]
            value = combine(combine(combine(a0, a1), a2), a3)
            for q in range(1, quads):
                a0, a1 = red[b, ty, 4 * q], red[b, ty, 4 * q + 1]
                a2, a3 = red[b, ty, 4 * q + 2], red[b, ty, 4 * q + 3]
                value = combine(combine(combine(combine(value, a0), a1), a2), a3)
        else:
            value = red[b, ty, 0]
        for i in range(tail, warps):
            value = combine(value, red[b, ty, i])
        return value

    return fold


def _make_row_reduce(intr, threads, warp_reduce, combine, row_barriers=False):
    """``row_reduce(value, red, buf, ty, tx)``: ``warp_reduce`` over the lanes of each warp, then
    ``combine`` over the row's warps in warp order through shared memory."""
    warp = intr.warp
    lanes = min(threads, warp)
    warps_per_row = ceil_div(threads, warp)
    gpu, row_barrier = intr.gpu, _gpu_only(intr, "row_barrier")
    fold = _make_fold(intr, warps_per_row, combine)

    @intr.jitable
    def row_reduce(value, red, buf, ty, tx):
        value = warp_reduce(value, lanes)
        if warps_per_row > 1:
            if tx % warp == 0:
                red[buf, ty, tx // warp] = value
            if row_barriers:
                row_barrier(ty, threads)
            else:
                gpu.syncthreads()
            value = fold(red, buf, ty)
        return value

    return row_reduce


# 1.5 * 2**23: for |v| < 2**22, the float32 v + RNE_MAGIC is an integer, rne(v), held in the low
# mantissa bits (its low byte is rne(v) as an int8's bits for -128 <= rne(v) <= 127)
RNE_MAGIC = 12582912.0


def make_quant_store(intr, dtype, chunk, n, vector, fma_levels=False, shifted=True, mx=False,
                     unbounded=False):
    """``store(ptr, start, col0, vals, slot, inv)``: ``vals[slot : slot + chunk] * inv`` quantised
    to ``dtype`` (int8 or float8_e4m3fn, one byte each) at ``ptr[start + col0 ...]``.  The vector
    form packs a chunk into one 8-byte (chunk 8) or 4-byte (chunk 4) store; the scalar form stores
    a whole chunk as aligned 8- / 4-byte pieces where its address allows, else byte by byte, and
    a chunk reaching past ``n`` byte by byte up to ``n``.

    ``fma_levels`` (int8): each level is the low byte of fma(v, inv, RNE_MAGIC), rne of the exact
    product in one FFMA, where the conversion took an FMUL and an F2I (a quarter-rate instruction
    on NVIDIA).  Only for products known finite and within +-127.5, which the caller checks per
    row (a finite yscale from a max|t| that NaN cannot hide from); otherwise the converting form.

    ``mx`` (e4m3fn): MXFP8 elements, through ``intr.mx_pack_e4m3x2`` (gfx950's scaled
    conversion) rather than the plain quantiser's ``pack_e4m3x2``.  ``unbounded`` (int8): products
    may lie below -127.5 (a static scale), which CUDA's conversion would take to -128: they are
    raised to -127 first (a NaN passes, and becomes 0)."""
    jitable = intr.jitable
    encode = codec(intr, dtype)[1]
    signed = dtype == _dtypes.INT8
    fused = fma_levels and signed
    floor = signed and unbounded
    store_b64, store_b32 = _gpu_only(intr, "store_b64"), _gpu_only(intr, "store_b32")
    align_offset = _gpu_only(intr, "align_offset")
    # the scalar form's whole chunks go out as aligned 8- / 4-byte pieces where the address allows
    # (_config.scalar_shifted), where byte by byte each warp's store wrote 32 bytes over 256
    shifted = shifted and _shifted_access(intr)
    pack_e4m3x2 = intr.mx_pack_e4m3x2 if mx else intr.pack_e4m3x2
    f32_as_u32, fma = intr.f32_as_u32, intr.fma
    magic = float32(RNE_MAGIC)

    @jitable
    def byte(vals, at, inv):
        if fused:
            return f32_as_u32(fma(vals[at], inv, magic)) & uint32(0xFF)
        if mx:      # the pairs' conversion for single bytes too: one rounding per element
            return pack_e4m3x2(vals[at] * inv, float32(0.0)) & uint32(0xFF)
        v = vals[at] * inv
        if floor and v < float32(-127.0):
            v = float32(-127.0)
        return uint32(encode(v) & 0xFF)

    @jitable
    def word(vals, at, inv):
        if signed:
            return (byte(vals, at, inv) | (byte(vals, at + 1, inv) << uint32(8))
                    | (byte(vals, at + 2, inv) << uint32(16))
                    | (byte(vals, at + 3, inv) << uint32(24)))
        # e4m3fn pairs: one conversion instruction per pair where the hardware has it
        return (pack_e4m3x2(vals[at] * inv, vals[at + 1] * inv)
                | (pack_e4m3x2(vals[at + 2] * inv, vals[at + 3] * inv) << uint32(16)))

    if vector:
        @jitable
        def store(ptr, start, col0, vals, slot, inv):
            if chunk == 8:
                store_b64(ptr, start + col0, word(vals, slot, inv), word(vals, slot + 4, inv))
            else:
                store_b32(ptr, start + col0, word(vals, slot, inv))
    else:
        @jitable
        def level_bits(bits):
            """The low byte of ``bits`` as a stored level (int8, or uint8 bits of e4m3fn)."""
            byte = bits & uint32(0xFF)
            if signed:
                return int8(int32(byte) - int32((byte & uint32(0x80)) << uint32(1)))
            return uint8(byte)

        @jitable
        def store_word(ptr, idx, w, off):
            """One word's four levels at element ``idx``, ``off`` = its address mod 4."""
            if off == 0:
                store_b32(ptr, idx, w)
            else:
                for b in range(4):
                    ptr[idx + b] = level_bits(w >> uint32(8 * b))

        @jitable
        def store(ptr, start, col0, vals, slot, inv):
            if shifted and col0 + chunk <= n:
                idx = start + col0
                off = align_offset(ptr, idx)
                w0 = word(vals, slot, inv)      # converted once, whichever stores follow
                if chunk == 8:
                    w1 = word(vals, slot + 4, inv)
                    if off & 7 == 0:
                        store_b64(ptr, idx, w0, w1)
                    else:
                        store_word(ptr, idx, w0, off & 3)
                        store_word(ptr, idx + 4, w1, off & 3)
                else:
                    store_word(ptr, idx, w0, off & 3)
                return
            for e in range(chunk):
                if col0 + e < n:
                    if fused or mx:
                        ptr[start + col0 + e] = level_bits(byte(vals, slot + e, inv))
                    elif signed:
                        ptr[start + col0 + e] = int8(encode(vals[slot + e] * inv))
                    else:
                        ptr[start + col0 + e] = uint8(encode(vals[slot + e] * inv))

    return store


def make_fp4_store(intr, chunk):
    """``store(ptr, start, col0, vals, slot, inv)``: ``vals[slot : slot + chunk] * inv`` as
    float4 e2m1 pairs at byte ``start + col0 // 2`` of a uint8 array, element 2i in the low
    nibble: one 4-byte store (chunk 8; aligned, as q's rows are whole multiples of 16 bytes) or
    two bytes (chunk 4)."""
    pack_e2m1x2, pack_e2m1x8 = intr.mx_pack_e2m1x2, intr.mx_pack_e2m1x8
    store_b32 = _gpu_only(intr, "store_b32")

    @intr.jitable
    def pair(vals, at, inv):
        return pack_e2m1x2(vals[at] * inv, vals[at + 1] * inv)

    @intr.jitable
    def store(ptr, start, col0, vals, slot, inv):
        idx = start + col0 // 2
        if chunk == 8:
            store_b32(ptr, idx, pack_e2m1x8(
                vals[slot] * inv, vals[slot + 1] * inv, vals[slot + 2] * inv,
                vals[slot + 3] * inv, vals[slot + 4] * inv, vals[slot + 5] * inv,
                vals[slot + 6] * inv, vals[slot + 7] * inv))
        else:
            ptr[idx] = uint8(pair(vals, slot, inv))
            ptr[idx + 1] = uint8(pair(vals, slot + 2, inv))

    return store


_F32_MAX = float32(3.4028234663852886e38)


def make_group_scale(intr, scaling, quant):
    """``scale_of(a) -> (stored, inv, pre)`` of a group whose max|y| is ``a`` (float32; NaN or
    Inf where the group holds one): the scale as stored, and the factors its levels take,
    q = rne(y * pre * inv) with ``pre`` 1 unless a subnormal scale needs y scaled by 2**64
    first (its reciprocal would overflow).

    - "group": yscale = a / QMAX (1 for an all-zero group, NaN for a non-finite one);
    - "ue8m0": the least power of two p = 2**k >= 2**-127 with p * QMAX >= a, read from the
      bits of a = m * 2**E and QMAX = m_q * 2**E_q (1 <= m, m_q < 2): k = E - E_q, plus 1 where
      m > m_q (exact, no division; a zero or subnormal a takes the clamp); inv = 2**-k;
    - "mx": E8M0 byte e + 127 with e = max(floor(log2 a) - emax, -127) read from a's exponent
      field (0 for a zero or subnormal a: the clamp), 0xFF (NaN) for a non-finite a; inv = 2**-e
      is a normal float32 for every e (2**8 .. 2**127).
    - "static": ``scale_of(s)`` for the caller's scale s, the "group" form without its guards."""
    f32_as_u32, u32_as_f32 = intr.f32_as_u32, intr.u32_as_f32
    one, two64 = float32(1.0), float32(2.0 ** 64)
    tiny, two_m127 = float32(2.0 ** -126), float32(2.0 ** -127)
    qmax = float32(_dtypes.QMAX.get(quant, 1.0))
    qmax_bits = int(np.float32(qmax).view(np.uint32))
    qmax_exp = int32(qmax_bits >> 23)                    # biased: E - E_q needs no bias
    qmax_mantissa = uint32(qmax_bits & 0x7FFFFF)
    bias_emax = int32(127 + _dtypes.MX_EMAX.get(quant, 0))

    @intr.jitable
    def divided(s):
        pre = two64 if s < tiny else one
        return s, one / (s * pre), pre

    @intr.jitable
    def group(a):
        s = a / qmax
        if not a <= _F32_MAX:
            s = a * float32(0.0)
        elif s == float32(0.0):
            s = one
        return divided(s)

    @intr.jitable
    def ue8m0(a):
        if not a <= _F32_MAX:
            nan = a * float32(0.0)
            return nan, nan, one
        if a == float32(0.0):
            return one, one, one
        bits = f32_as_u32(a)
        k = (int32(bits >> uint32(23)) - qmax_exp
             + int32((bits & uint32(0x7FFFFF)) > qmax_mantissa))
        k = max(k, int32(-127))
        p = u32_as_f32(uint32(k + 127) << uint32(23)) if k > -127 else two_m127
        return p, u32_as_f32(uint32(127 - k) << uint32(23)), one

    @intr.jitable
    def mx(a):
        ebits = (f32_as_u32(a) >> uint32(23)) & uint32(0xFF)
        if ebits == uint32(0xFF):
            return uint8(0xFF), a * float32(0.0), one
        e = max(int32(ebits) - bias_emax, int32(-127))
        return uint8(e + 127), u32_as_f32(uint32(127 - e) << uint32(23)), one

    return {"group": group, "ue8m0": ue8m0, "mx": mx, "static": divided}[scaling]
