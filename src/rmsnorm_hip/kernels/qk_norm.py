"""QK-norm kernel: the head rows of q (T, Hq, D) and k (T, Hk, D) normalised in one launch, each
with its own weight, optionally followed by rotary position embedding (RoPE).

    rstd = 1 / sqrt(mean(v**2) + eps)                per head row, float32
    y    = (v * rstd) * (weight + weight_offset)     float32, not rounded yet
    RoPE on y[:rot] (float32), with c = cos_sin_cache[pos, i], s = cos_sin_cache[pos, rot/2 + i]:
      neox (halves, h = rot/2): y[i], y[i + h]    <- y[i] c - y[i + h] s, y[i + h] c + y[i] s
      gptj (interleaved pairs): y[2i], y[2i + 1] <- y[2i] c - y[2i + 1] s, y[2i + 1] c + y[2i] s
    out  = round(y)                                  one rounding to q's dtype

A head row is rms_norm's row of N = D: the same layout (kernels/_config.row_layout) and the same
row pieces, so without RoPE each head's output is bitwise rms_norm's of that row.  Neox over the
whole head takes the layout in halves instead where D allows (_config.qk_halves): thread t
holds chunks t and t + D / 2, an element and its partner, so the rotation reads no other
thread.  The grid is (T, head blocks): block (t, b) takes heads b * rows ... of token t, heads
below Hq being q's and the rest k's, so no row index is ever divided.  Each thread reads its
chunks before it writes them and the neox partner comes from its own registers, a shuffle or
shared memory, never from the outputs: q_out may be q and k_out k (the in-place entry point).
A position outside [0, max_position) reads no cache and writes NaN over the token's rotated
elements.
"""
import math
from collections import namedtuple

from numba import float32, int64, types

from .. import _dtypes
from ._config import QkSpec
from ._rowops import ChunkIO, codec, make_chunk_sumsq, make_row_sum, reduce_buffer_shape

# a call's arguments (strides in elements: _ts per token, _hs per head)
Args = namedtuple("Args", "q k q_weight k_weight q_out k_out positions cache hq hk q_ts q_hs k_ts "
                          "k_hs qo_ts qo_hs ko_ts ko_hs cache_stride max_position rot eps "
                          "weight_offset")
# a call's shape as the host plans it: strides are (per token, per head) pairs in elements;
# rope: (style, cache dtype, positions dtype, cache row stride, max_position, rotary_dim) or None
Geometry = namedtuple("Geometry", "tokens hq hk d q k q_out k_out rope")
# one head row's arrays and element offsets (q's or k's)
Head = namedtuple("Head", "src dst weight start out")

_INDEX = {"int32": types.int32, "int64": types.int64}


def argtypes(spec: QkSpec):
    """(q, k, q_weight, k_weight, q_out, k_out, positions, cos_sin_cache, tokens, hq, hk,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride, q_out_token_stride,
    q_out_head_stride, k_out_token_stride, k_out_head_stride, cache_row_stride, max_position,
    rotary_dim, eps, weight_offset); strides in elements."""
    from numba.np.numpy_support import from_dtype
    data = types.CPointer(from_dtype(_dtypes.STORAGE[spec.dtype]))
    weight = types.CPointer(from_dtype(_dtypes.STORAGE[spec.weight]))
    positions = types.CPointer(_INDEX[spec.positions or "int64"])
    cache = types.CPointer(from_dtype(_dtypes.STORAGE[spec.cache or _dtypes.FLOAT32]))
    return ((data, data, weight, weight, data, data, positions, cache)
            + (types.int64,) * 14 + (types.float32, types.float32))


def make_qk_norm(intr, spec: QkSpec):
    """The QK-norm kernel of ``spec`` over the intrinsics ``intr`` (a Python function to
    compile)."""
    layout = spec.layout
    n, chunk, threads, rows = layout.n, layout.chunk, layout.threads, spec.rows
    per_thread = layout.chunks_per_thread
    cache_len = per_thread * chunk
    rope_len = cache_len if spec.rope else 1
    rope, neox = spec.rope, spec.rope == "neox"
    gpu, jitable, fma, rsqrt = intr.gpu, intr.jitable, intr.fma, intr.rsqrt
    x_io = ChunkIO(intr, spec.dtype, chunk, n, spec.vector)
    w_io = ChunkIO(intr, spec.weight, chunk, n, spec.vector)
    decode_cache = codec(intr, spec.cache or _dtypes.FLOAT32)[0]
    chunk_sumsq = make_chunk_sumsq(intr, chunk)
    row_sum = make_row_sum(intr, threads)
    load_x, store_y, load_w = x_io.load, x_io.store, w_io.load
    red_shape = reduce_buffer_shape(intr, 1, rows, threads)
    red_align = intr.shared_alignment
    n_f32 = float32(n)
    nan = float32(math.nan)
    # the neox partner of an element is another thread's.  The vector form is launched only
    # where the cache rows are 16-byte aligned and the partner is the same slot of the chunk
    # (rotary_dim / 2) / chunk threads away, a power of two (backends/_gpu.qk_norm): cos and sin
    # come by 128-bit loads and, where a row is one chunk a thread within a warp, the partner by
    # an xor shuffle.  Otherwise rows pass through shared memory, whose traffic bound the
    # rotation (L1 83% busy, 2.7x the norm's time at D = 128, T = 4096 on the H100).
    cache_vector = spec.vector and neox
    halves = spec.halves    # a thread's second chunk is its first's partner (_config.qk_halves)
    shuffle = cache_vector and per_thread == 1 and threads <= 32
    swap_shape = (rows, n if neox and not (shuffle or halves) else 1)
    shfl_xor = intr.shfl_xor
    load_cache = ChunkIO(intr, spec.cache or _dtypes.FLOAT32, chunk, n, cache_vector).load

    @jitable
    def head_of(a, t, h):
        """Head ``h`` of token ``t``: q's below hq, k's from there."""
        if h < a.hq:
            return Head(a.q, a.q_out, a.q_weight, t * a.q_ts + h * a.q_hs,
                        t * a.qo_ts + h * a.qo_hs)
        hk = h - a.hq
        return Head(a.k, a.k_out, a.k_weight, t * a.k_ts + hk * a.k_hs,
                    t * a.ko_ts + hk * a.ko_hs)

    @jitable
    def normalise(a, head, live, tx, vals, wvals, red):
        """vals <- (v * rstd) * (weight + weight_offset) for this thread's chunks (float32,
        rms_norm's operations in its order).  The weight is read with the row, before the
        reduction: no memory latency after it."""
        acc = float32(0.0)
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if live and col0 < n:
                load_x(head.src, head.start, col0, vals, k * chunk)
            else:
                for e in range(chunk):
                    vals[k * chunk + e] = float32(0.0)
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if live and col0 < n:
                load_w(head.weight, 0, col0, wvals, k * chunk)
        for k in range(per_thread):
            acc = acc + chunk_sumsq(vals, k * chunk)
        total = row_sum(acc, red, 0, gpu.threadIdx.y, tx)
        r = rsqrt(total / n_f32 + a.eps)
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if live and col0 < n:
                for e in range(chunk):
                    i = k * chunk + e
                    vals[i] = (vals[i] * r) * (wvals[i] + a.weight_offset)

    @jitable
    def load_cos_sin(a, t, live, tx, cos, sin):
        """This thread's cos and sin of its rotated elements, read before the row's reduction
        (they do not depend on it); whether the token's position is inside the cache."""
        pos = int64(a.positions[t])
        inside = pos >= 0 and pos < a.max_position
        row = pos * a.cache_stride
        half = a.rot >> 1
        if halves:  # one chunk's cos and sin serve both; NaN outside the cache
            col0 = tx * chunk
            if live and inside:
                if cache_vector:
                    load_cache(a.cache, row, col0, cos, 0)
                    load_cache(a.cache, row + half, col0, sin, 0)
                else:
                    for e in range(chunk):
                        cos[e] = decode_cache(a.cache[row + col0 + e])
                        sin[e] = decode_cache(a.cache[row + half + col0 + e])
            else:
                for e in range(chunk):
                    cos[e] = nan
                    sin[e] = nan
            return inside
        if cache_vector:
            for k in range(per_thread):
                col0 = (tx + k * threads) * chunk
                if live and inside and col0 < a.rot:
                    i = col0 if col0 < half else col0 - half
                    load_cache(a.cache, row, i, cos, k * chunk)
                    load_cache(a.cache, row + half, i, sin, k * chunk)
            return inside
        step = 1 if neox else 2     # a gptj pair's two elements share theirs (the even slot)
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            for e in range(0, chunk, step):
                col = col0 + e
                if live and inside and col < a.rot:
                    if neox:
                        i = col if col < half else col - half
                    else:
                        i = col >> 1
                    cos[k * chunk + e] = decode_cache(a.cache[row + i])
                    sin[k * chunk + e] = decode_cache(a.cache[row + half + i])
        return inside

    @jitable
    def neox_rotated(v, other, c, s, first_half, inside):
        """One neox element rotated against its partner ``other`` (NaN outside the cache)."""
        if not inside:
            return nan
        if first_half:
            return fma(v, c, -(other * s))
        return fma(v, c, other * s)

    @jitable
    def rotate(a, live, inside, tx, vals, cos, sin, swap):
        """RoPE over this thread's chunks of the first ``rot`` elements (vals float32)."""
        ty = gpu.threadIdx.y
        half = a.rot >> 1
        if halves:      # neox_rotated's operations; a NaN cos / sin outside the cache
            if live:
                for e in range(chunk):
                    first, second = vals[e], vals[chunk + e]
                    vals[e] = fma(first, cos[e], -(second * sin[e]))
                    vals[chunk + e] = fma(second, cos[e], first * sin[e])
            return
        if shuffle:     # every lane of the warp takes part, live or not
            lanes = half // chunk
            for e in range(chunk):
                other = shfl_xor(vals[e], lanes)
                if live and tx * chunk < a.rot:
                    vals[e] = neox_rotated(vals[e], other, cos[e], sin[e], tx * chunk < half,
                                           inside)
            return
        if neox:
            for k in range(per_thread):
                col0 = (tx + k * threads) * chunk
                for e in range(chunk):
                    if col0 + e < n:
                        swap[ty, col0 + e] = vals[k * chunk + e]
            gpu.syncthreads()
        if not live:
            return
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if neox:
                for e in range(chunk):
                    col = col0 + e
                    i = k * chunk + e
                    if col < a.rot:
                        other = swap[ty, col + half if col < half else col - half]
                        vals[i] = neox_rotated(vals[i], other, cos[i], sin[i], col < half,
                                               inside)
            else:
                for e in range(0, chunk, 2):
                    col = col0 + e
                    i = k * chunk + e
                    if col < a.rot:
                        even, odd = vals[i], vals[i + 1]
                        if not inside:
                            vals[i] = nan
                            vals[i + 1] = nan
                        else:
                            vals[i] = fma(even, cos[i], -(odd * sin[i]))
                            vals[i + 1] = fma(odd, cos[i], even * sin[i])

    @jitable
    def run(a):
        if red_align:   # a constant: the other branch is pruned before typing (numba-hip)
            red = gpu.shared.array(red_shape, float32, alignment=red_align)
        else:
            red = gpu.shared.array(red_shape, float32)
        swap = gpu.shared.array(swap_shape, float32)
        vals = gpu.local.array(cache_len, float32)
        wvals = gpu.local.array(cache_len, float32)
        cos = gpu.local.array(rope_len, float32)
        sin = gpu.local.array(rope_len, float32)
        tx = gpu.threadIdx.x
        t = int64(gpu.blockIdx.x)
        h = int64(gpu.blockIdx.y) * rows + gpu.threadIdx.y
        live = h < a.hq + a.hk
        head = head_of(a, t, h if live else int64(0))
        inside = True
        if rope:
            inside = load_cos_sin(a, t, live, tx, cos, sin)
        normalise(a, head, live, tx, vals, wvals, red)
        if rope:
            rotate(a, live, inside, tx, vals, cos, sin, swap)
        if live:
            for k in range(per_thread):
                col0 = (tx + k * threads) * chunk
                if col0 < n:
                    store_y(head.dst, head.out, col0, vals, k * chunk)

    def qk_norm(q, k, q_weight, k_weight, q_out, k_out, positions, cache, tokens, hq, hk, q_ts,
                q_hs, k_ts, k_hs, qo_ts, qo_hs, ko_ts, ko_hs, cache_stride, max_position, rot,
                eps, weight_offset):
        run(Args(q, k, q_weight, k_weight, q_out, k_out, positions, cache, hq, hk, q_ts, q_hs,
                 k_ts, k_hs, qo_ts, qo_hs, ko_ts, ko_hs, cache_stride, max_position, rot, eps,
                 weight_offset))

    return qk_norm
