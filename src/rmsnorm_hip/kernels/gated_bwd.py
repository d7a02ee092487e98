"""Gated RMSNorm backward kernel: dx, dz and the dweight partial rows of ``rms_norm_gated``
(kernels/rmsnorm_fwd.py, FwdSpec.gate), over a row's groups of G columns.  With s = silu(z),
s' = sigmoid(z) * (1 + z * (1 - sigmoid(z))) and w = weight + weight_offset, per group row:

  input gate (norm_before_gate=False), h = x * s:
    g = dy * w,  h_hat = h * rstd,  c = sum(h * g) * rstd / G
    dh = (g - h_hat * c) * rstd;    dx = dh * s;    dz = dh * x * s';    dweight += dy * h_hat
  output gate (norm_before_gate=True):
    e = dy * s,  g = e * w,  x_hat = x * rstd,  c = sum(x * g) * rstd / G
    dx = (g - x_hat * c) * rstd;    dz = dy * (x_hat * w) * s';    dweight += e * x_hat

rstd is the forward's, or recomputed from h (x for the output gate) with eps.  Cached rows (a
thread's share of a group row in registers) keep x, z and dy as the words of their 128-bit
loads, decoded where used, and load the slot's next row while this one is reduced and its
gradients stored; held-words rows (GatedBwdSpec.held_words) keep their words too but ask the
L2 for the slot's next row (intrinsics prefetch_l2), as looped rows (read twice, a chunk at a
time) do.  The grid's blocks hold ``rows`` group rows each; block
slot q (block * rows + row in block) takes group q % H of rows q // H, q // H + S, ... (S =
slots / H, the grid sized so that H divides the slots), keeps its dweight partial of that
group's G columns in registers and stores it to workspace row q // H at columns group * G
(looped rows with more than _config.GATED_BWD_MAX_HELD_PARTIAL floats a thread keep it in that
row, read and written back per row): S partial rows, which kernels/rmsnorm_bwd's dweight
reduction sums in row order.  A function of M, H and the device only (never of pointers or
strides), so dweight is deterministic and every row's dx and dz are batch invariant.
"""
from collections import namedtuple

from numba import float32, int64, types, uint32

from .. import _dtypes
from . import _config
from ._config import GatedBwdSpec
from ._rowops import ChunkIO, make_row_sum, reduce_buffer_shape

# a call's arguments (strides: rows', in elements), and a thread's floats of its chunks
Arrays = namedtuple("Arrays", "dy x z weight rstd dx dz ws")
Strides = namedtuple("Strides", "dy x z dx dz")
Call = namedtuple("Call", "arrays strides m groups eps weight_offset")
Floats = namedtuple("Floats", "x z dy w acc")
Words = namedtuple("Words", "x z dy")       # a cached row's chunks as loaded (4 words a chunk)


def argtypes(spec: GatedBwdSpec):
    """(dy, x, z, weight, rstd, dx, dz, ws, m, groups, slots, dy_stride, x_stride, z_stride,
    dx_stride, dz_stride, eps, weight_offset): m full rows of ``groups`` group rows each, row
    strides in elements; rstd (m * groups,), ws (slots / groups, groups * G)."""
    from numba.np.numpy_support import from_dtype
    data = types.CPointer(from_dtype(_dtypes.STORAGE[spec.dtype]))
    weight = types.CPointer(from_dtype(_dtypes.STORAGE[spec.weight or _dtypes.FLOAT32]))
    f32 = types.CPointer(types.float32)
    return ((data, data, data, weight, f32, data, data, f32) + (types.int64,) * 8
            + (types.float32, types.float32))


def make_gated_bwd(intr, spec: GatedBwdSpec):
    layout = spec.layout
    n, chunk, threads, rows = layout.n, layout.chunk, layout.threads, spec.rows
    per_thread, cached = layout.chunks_per_thread, layout.cached
    # a thread decodes one chunk's floats at a time (its share of the row stays as words where
    # it is cached or held, else it is read twice: looped, the second read mostly from the L2).
    # The dweight partial of its whole share where it is held (GatedBwdSpec.held_partial), else
    # one chunk's, read from the workspace and written back per row
    held_partial, held_words = spec.held_partial, spec.held_words
    unrolled = held_partial or per_thread <= 2      # looped rows (looped_row)
    # looped rows ask the L2 for their slot's next row (prefetch_row), but for a held partial of
    # more than two chunks, where the prefetches' addresses spilled (sm_90: float32 G = 8192,
    # 24 bytes)
    prefetch = per_thread <= 2 or not held_partial
    acc_span = per_thread * chunk if held_partial else chunk
    has_weight, recompute = bool(spec.weight), spec.recompute_rstd
    gated_input = spec.gate == "input"
    gpu, jitable, fma, sigmoid = intr.gpu, intr.jitable, intr.fma, intr.sigmoid
    prefetch_l2, rsqrt = intr.prefetch_l2, intr.rsqrt
    shifted = _config.scalar_shifted(spec)
    io = ChunkIO(intr, spec.dtype, chunk, n, spec.vector, shifted)
    w_io = ChunkIO(intr, spec.weight or _dtypes.FLOAT32, chunk, n, spec.vector, shifted)
    # the float32 partial in 16-byte pieces (4 floats; a 16-bit chunk is two)
    ws_vector = spec.vector and n % 4 == 0
    store_ws4 = ChunkIO(intr, _dtypes.FLOAT32, 4, n, ws_vector, shifted).store
    load_ws = ChunkIO(intr, _dtypes.FLOAT32, chunk, n, ws_vector, shifted).load
    load, store, load_w = io.load, io.store, w_io.load
    load_words, words_to_floats = io.load_words, io.words_to_floats
    n_words = per_thread * 4
    row_sum = make_row_sum(intr, threads)
    red_shape, red_align = reduce_buffer_shape(intr, 2, rows, threads), intr.shared_alignment
    n_f32 = float32(n)

    @jitable
    def load_chunk(call, outer, inner, live, col0, f, slot):
        """One chunk of x, z, dy (and the group's weight) of a group row into ``slot``: zeros
        past the row, or for a row that is not live."""
        a, s = call.arrays, call.strides
        if live and col0 < n:
            load(a.x, outer * s.x + inner * n, col0, f.x, slot)
            load(a.z, outer * s.z + inner * n, col0, f.z, slot)
            load(a.dy, outer * s.dy + inner * n, col0, f.dy, slot)
            if has_weight:
                load_w(a.weight, inner * n, col0, f.w, slot)
        else:
            for e in range(chunk):
                f.x[slot + e] = float32(0.0)
                f.z[slot + e] = float32(0.0)
                f.dy[slot + e] = float32(0.0)
                if has_weight:
                    f.w[slot + e] = float32(0.0)

    @jitable
    def sums(f, lo, offset, sxg, ss):
        """sum(v * g) and sum(v * v) carried over one chunk's floats at ``lo``."""
        for i in range(lo, lo + chunk):
            sg = f.z[i] * sigmoid(f.z[i])               # silu(z)
            v = f.x[i] * sg if gated_input else f.x[i]
            d = f.dy[i] if gated_input else f.dy[i] * sg
            g = d * (f.w[i] + offset) if has_weight else d
            sxg = fma(v, g, sxg)
            if recompute:
                ss = fma(v, v, ss)
        return sxg, ss

    @jitable
    def gradients(f, lo, offset, r, c, acc_lo):
        """One chunk's dx (into f.x), dz (into f.z) at ``lo`` and dweight partial (f.acc at
        ``acc_lo``)."""
        for e in range(chunk):
            i, a = lo + e, acc_lo + e
            sgm = sigmoid(f.z[i])
            sg = f.z[i] * sgm
            dsg = sgm * (float32(1.0) + f.z[i] * (float32(1.0) - sgm))     # silu'(z)
            if gated_input:
                g = f.dy[i] * (f.w[i] + offset) if has_weight else f.dy[i]
                h_hat = (f.x[i] * sg) * r
                dh = fma(-h_hat, c, g) * r
                f.z[i] = (dh * f.x[i]) * dsg                         # dz
                f.x[i] = dh * sg                                     # dx
                f.acc[a] = fma(f.dy[i], h_hat, f.acc[a])
            else:
                ex = f.dy[i] * sg
                g = ex * (f.w[i] + offset) if has_weight else ex
                x_hat = f.x[i] * r
                w = f.w[i] + offset if has_weight else float32(1.0)
                f.z[i] = (f.dy[i] * (x_hat * w)) * dsg
                f.x[i] = fma(-x_hat, c, g) * r
                f.acc[a] = fma(ex, x_hat, f.acc[a])

    @jitable
    def store_chunk(call, outer, inner, col0, f, slot):
        a, s = call.arrays, call.strides
        store(a.dx, outer * s.dx + inner * n, col0, f.x, slot)
        store(a.dz, outer * s.dz + inner * n, col0, f.z, slot)

    @jitable
    def store_partial(ws, start, col0, f, slot):
        for q in range(0, chunk, 4):
            if col0 + q < n:
                store_ws4(ws, start, col0 + q, f.acc, slot + q)

    @jitable
    def row_sums(call, outer, inner, live, tx, ty, parity, red, sxg, ss):
        """(the row's sum(v * g), its rstd) from this thread's sum(v * g) and sum(v * v) (the
        row's reductions; rows past M take part and get rstd 1)."""
        sxg = row_sum(sxg, red, parity, ty, tx)
        if recompute:
            ss = row_sum(ss, red, parity ^ 1, ty, tx)
            r = rsqrt(ss / n_f32 + call.eps)
        else:
            r = call.arrays.rstd[outer * call.groups + inner] if live else float32(1.0)
        return sxg, r

    @jitable
    def load_row_words(call, outer, inner, live, tx, w):
        """A cached group row's chunks of x, z and dy as words (zeros past the row, or for a
        row that is not live)."""
        a, s = call.arrays, call.strides
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if live and col0 < n:
                load_words(a.x, outer * s.x + inner * n, col0, w.x, k * 4)
                load_words(a.z, outer * s.z + inner * n, col0, w.z, k * 4)
                load_words(a.dy, outer * s.dy + inner * n, col0, w.dy, k * 4)
            else:
                for j in range(k * 4, k * 4 + 4):
                    w.x[j] = uint32(0)
                    w.z[j] = uint32(0)
                    w.dy[j] = uint32(0)

    @jitable
    def decode_chunk(call, inner, tx, w, k, f, hide):
        """Chunk k's words (each XORed with ``hide``, 0) as floats in f, with the group's weight
        (read where used, mostly from the L1, rather than held in registers across the
        reductions)."""
        at = k * 4
        col0 = (tx + k * threads) * chunk
        if has_weight:
            if col0 < n:
                load_w(call.arrays.weight, inner * n, col0, f.w, 0)
            else:
                for e in range(chunk):
                    f.w[e] = float32(0.0)
        words_to_floats(w.x[at] ^ hide, w.x[at + 1] ^ hide, w.x[at + 2] ^ hide,
                        w.x[at + 3] ^ hide, f.x, 0)
        words_to_floats(w.z[at] ^ hide, w.z[at + 1] ^ hide, w.z[at + 2] ^ hide,
                        w.z[at + 3] ^ hide, f.z, 0)
        words_to_floats(w.dy[at] ^ hide, w.dy[at + 1] ^ hide, w.dy[at + 2] ^ hide,
                        w.dy[at + 3] ^ hide, f.dy, 0)

    @jitable
    def words_row(call, outer, inner, live, tx, ty, parity, red, f, w):
        """A cached or held-words group row from its words ``w``: dx and dz stored, the
        dweight partial accumulated in f.acc.  The floats are decoded for the sums and again
        for the gradients, so that only the words stay live across the row's reductions."""
        offset = call.weight_offset
        sxg = float32(0.0)
        ss = float32(0.0)
        for k in range(per_thread):
            decode_chunk(call, inner, tx, w, k, f, uint32(0))
            sxg, ss = sums(f, 0, offset, sxg, ss)
        sxg, r = row_sums(call, outer, inner, live, tx, ty, parity, red, sxg, ss)
        if not live:
            return
        c = sxg * r / n_f32
        # held words: a zero the compiler cannot see (m >> 63), or it reuses the first decode's
        # floats and sigmoids, live across the reduction (sm_90: 28-48 registers spilled)
        hide = uint32(call.m >> 63) if held_words else uint32(0)
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if col0 < n:
                decode_chunk(call, inner, tx, w, k, f, hide)
                gradients(f, 0, offset, r, c, k * chunk)
                store_chunk(call, outer, inner, col0, f, 0)

    @jitable
    def prefetch_row(call, outer, inner, tx):
        """Ask the L2 for this thread's chunks of x, z and dy of a looped group row read next:
        they arrive while this row is reduced and its gradients stored (no registers held)."""
        a, s = call.arrays, call.strides
        for k in range(per_thread):
            col0 = (tx + k * threads) * chunk
            if col0 < n:
                prefetch_l2(a.x, outer * s.x + inner * n + col0)
                prefetch_l2(a.z, outer * s.z + inner * n + col0)
                prefetch_l2(a.dy, outer * s.dy + inner * n + col0)

    @jitable
    def looped_row(call, outer, inner, live, tx, ty, parity, red, f, ws_start):
        """A looped group row, read twice a chunk at a time: dx and dz stored, the dweight
        partial accumulated in f.acc where it is held, else in the slot's workspace row.  Rows
        that are not live (past M) take part in the block's reductions only."""
        offset = call.weight_offset
        sxg = float32(0.0)
        ss = float32(0.0)
        # a held partial is indexed by chunk, and two chunks' loads fit: unrolled.  Else the
        # trip count is hidden from the compiler (m >> 63 is 0): unrolled, four chunks' loads
        # were hoisted and spilled (AMD, 16-bit G = 16384)
        trips = per_thread if unrolled else per_thread + (call.m >> 63)
        for k in range(trips):
            col0 = (tx + k * threads) * chunk
            load_chunk(call, outer, inner, live, col0, f, 0)
            sxg, ss = sums(f, 0, offset, sxg, ss)
        sxg, r = row_sums(call, outer, inner, live, tx, ty, parity, red, sxg, ss)
        if not live:
            return
        c = sxg * r / n_f32
        for k in range(trips):
            col0 = (tx + k * threads) * chunk
            if col0 < n:
                load_chunk(call, outer, inner, live, col0, f, 0)
                if not held_partial:
                    load_ws(call.arrays.ws, ws_start, col0, f.acc, 0)
                gradients(f, 0, offset, r, c, k * chunk if held_partial else 0)
                store_chunk(call, outer, inner, col0, f, 0)
                if not held_partial:
                    store_partial(call.arrays.ws, ws_start, col0, f, 0)

    def gated_bwd(dy, x, z, weight, rstd, dx, dz, ws, m, groups, slots, dy_stride, x_stride,
                  z_stride, dx_stride, dz_stride, eps, weight_offset):
        call = Call(Arrays(dy, x, z, weight, rstd, dx, dz, ws),
                    Strides(dy_stride, x_stride, z_stride, dx_stride, dz_stride), m, groups, eps,
                    weight_offset)
        if red_align:   # a constant: the other branch is pruned before typing (numba-hip)
            red = gpu.shared.array(red_shape, float32, alignment=red_align)
        else:
            red = gpu.shared.array(red_shape, float32)
        f = Floats(gpu.local.array(chunk, float32), gpu.local.array(chunk, float32),
                   gpu.local.array(chunk, float32), gpu.local.array(chunk, float32),
                   gpu.local.array(acc_span, float32))
        tx = gpu.threadIdx.x
        ty = gpu.threadIdx.y
        slot = int64(gpu.blockIdx.x) * rows + ty
        group = slot % groups
        first = slot // groups          # the slot's first full row, and its partial row
        step = slots // groups
        ws_start = first * (groups * n) + group * n
        for i in range(acc_span):
            f.acc[i] = float32(0.0)
        if not held_partial:    # the workspace row holds the partial: zeros first (its own)
            for k in range(per_thread):
                store_partial(ws, ws_start, (tx + k * threads) * chunk, f, 0)
        # every row of a block runs the block's most iterations: they share its barriers
        lead = int64(gpu.blockIdx.x) * rows // groups
        most = (m - lead + step - 1) // step
        # consecutive reductions alternate between the two halves of red (one barrier each):
        # a row that recomputes rstd runs two, parity then parity ^ 1; else rows alternate.
        # From the row's index, not carried: a toggled parity doubled the held-words loop and
        # spilled
        if cached:
            w = Words(gpu.local.array(n_words, uint32), gpu.local.array(n_words, uint32),
                      gpu.local.array(n_words, uint32))
            ahead = Words(gpu.local.array(n_words, uint32), gpu.local.array(n_words, uint32),
                          gpu.local.array(n_words, uint32))
            load_row_words(call, first, group, first < m, tx, w)
            for it in range(most):
                outer = first + it * step
                load_row_words(call, outer + step, group, outer + step < m, tx, ahead)
                words_row(call, outer, group, outer < m, tx, ty, 0 if recompute else it & 1,
                          red, f, w)
                for j in range(n_words):
                    w.x[j] = ahead.x[j]
                    w.z[j] = ahead.z[j]
                    w.dy[j] = ahead.dy[j]
        elif held_words:
            w = Words(gpu.local.array(n_words, uint32), gpu.local.array(n_words, uint32),
                      gpu.local.array(n_words, uint32))
            for it in range(most):
                outer = first + it * step
                if outer + step < m:
                    prefetch_row(call, outer + step, group, tx)
                load_row_words(call, outer, group, outer < m, tx, w)
                words_row(call, outer, group, outer < m, tx, ty, 0 if recompute else it & 1,
                          red, f, w)
        else:
            for it in range(most):
                outer = first + it * step
                if prefetch and outer + step < m:
                    prefetch_row(call, outer + step, group, tx)
                looped_row(call, outer, group, outer < m, tx, ty, 0 if recompute else it & 1,
                           red, f, ws_start)
        if held_partial:
            for k in range(per_thread):
                store_partial(ws, ws_start, (tx + k * threads) * chunk, f, k * chunk)

    return gated_bwd
