"""CPU row kernels (numba CPU JIT): each runs a range of rows on one thread, with the GIL released,
so the backend spreads the rows of a large call over a pool of threads (backends/cpu.py).

Every array reaches a kernel as one contiguous vector of its storage elements, from the array's
first element on, with its strides (in elements) as integers: numba compiles a kernel once per
argument type, and a strided view types apart from a packed one (and runs 16-bit rows two to
three times slower), so a row is sliced from the vector (``v[start:start + n]``, contiguous)
instead.  A kernel then has one compiled form whatever the callers' strides.

A CPU row runs on one core, so the GPU's thread layout has no meaning here; the row math and the
16-bit codecs are the same device helpers the GPU kernels use.  A row's sum of squares is kept in
eight interleaved float32 partial sums combined pairwise, a fixed order that depends on N only.
Division follows IEEE (numba's ``error_model="numpy"``), as on the GPU: an all-zero row with
eps = 0 gives NaN rather than raising ZeroDivisionError.
"""
import numba
import numpy as np
from numba import float32

from .. import _dtypes
from ._rowops import codec, make_group_scale

LANES = 8


BLOCK = 512      # elements a block's eight lanes sum before the blocks are added pairwise


def make_lane_sum(intr, term):
    """row_sum(a, b, w, off, n): sum of ``term(a, b, w, off, j)`` over j < n, in float32, in an
    order that depends on N only: blocks of BLOCK elements, each in eight interleaved partial
    sums combined pairwise, and the block sums added as a pairwise tree (the block sum k joins
    its neighbours as the binary carries of k say).  The error then grows with log N, not N
    (relative 1e-6 at N = 2**21, against 3.5e-5 for one pass of eight lanes)."""
    @intr.jitable
    def block_sum(a, b, w, off, start, stop):
        p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = float32(0.0)
        full = stop - (stop - start) % LANES
        for j in range(start, full, LANES):
            p0 += term(a, b, w, off, j)
            p1 += term(a, b, w, off, j + 1)
            p2 += term(a, b, w, off, j + 2)
            p3 += term(a, b, w, off, j + 3)
            p4 += term(a, b, w, off, j + 4)
            p5 += term(a, b, w, off, j + 5)
            p6 += term(a, b, w, off, j + 6)
            p7 += term(a, b, w, off, j + 7)
        for j in range(full, stop):
            p0 += term(a, b, w, off, j)
        return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))

    @intr.jitable
    def lane_sum(a, b, w, off, n):
        if n <= BLOCK:
            return block_sum(a, b, w, off, 0, n)
        stack = np.empty(64, np.float32)      # pending sums of 1, 2, 4, ... blocks
        depth = 0
        k = 0
        for start in range(0, n, BLOCK):
            s = block_sum(a, b, w, off, start, min(start + BLOCK, n))
            k += 1
            carry = k
            while carry & 1 == 0:
                depth -= 1
                s = stack[depth] + s
                carry >>= 1
            stack[depth] = s
            depth += 1
        total = stack[depth - 1]
        for d in range(depth - 2, -1, -1):
            total = stack[d] + total
        return total

    return lane_sum


def make_row_sumsq(intr, dtype):
    """row_sumsq(row, n): the row's sum of squares."""
    decode = codec(intr, dtype)[0]

    @intr.jitable
    def square(a, b, w, off, j):
        v = decode(a[j])
        return v * v

    lane_sum = make_lane_sum(intr, square)

    @intr.jitable
    def row_sumsq(row, n):
        return lane_sum(row, row, row, float32(0.0), n)

    return row_sumsq


def make_scale(intr, dtype, weight_dtype, xscale_dtype=""):
    """scale(h, j, r, weight, xscale, weight_offset): element ``j`` of a stored row ``h`` times
    rstd, (weight + weight_offset) and xscale as present, in that order (the GPU kernels' order
    for rows that are not quantised; quantised ones form (weight + weight_offset) * xscale
    first, so the two backends' q may differ by a level)."""
    decode = codec(intr, dtype)[0]
    decode_w = codec(intr, weight_dtype or _dtypes.FLOAT32)[0]
    decode_s = codec(intr, xscale_dtype or _dtypes.FLOAT32)[0]
    has_weight, has_xscale = bool(weight_dtype), bool(xscale_dtype)

    @intr.jitable
    def scale(h, j, r, weight, xscale, weight_offset):
        v = decode(h[j]) * r
        if has_weight:
            v = v * (decode_w(weight[j]) + weight_offset)
        if has_xscale:
            v = v * decode_s(xscale[j])
        return v

    return scale


def make_cpu_rmsnorm_fwd(intr, dtype, weight_dtype):
    """fwd(x, weight, y, rstd, rows, eps, weight_offset, store_rstd, lo, hi): rows lo to hi, in
    storage dtypes; ``rows`` = (n, heads, x stride, x head stride, y stride, y head stride): row
    i at (i // heads) * stride + (i % heads) * head stride (heads = 1: rows at one stride)."""
    encode = codec(intr, dtype)[1]
    row_sumsq = make_row_sumsq(intr, dtype)
    scale = make_scale(intr, dtype, weight_dtype)

    @numba.njit(nogil=True, error_model="numpy")
    def rmsnorm_fwd(x, weight, y, rstd, rows, eps, weight_offset, store_rstd, lo, hi):
        n, heads, sx, hx, sy, hy = rows
        for i in range(lo, hi):
            t, k = i // heads, i % heads
            row = x[t * sx + k * hx:t * sx + k * hx + n]
            out = y[t * sy + k * hy:t * sy + k * hy + n]
            r = float32(1.0) / np.sqrt(row_sumsq(row, n) / float32(n) + eps)
            if store_rstd:
                rstd[i] = r
            for j in range(n):
                out[j] = encode(scale(row, j, r, weight, weight, weight_offset))

    return rmsnorm_fwd


def make_normalised_row(intr, dtype, has_residual):
    """normalised_row(x, residual, residual_out, n, eps) -> (h, rstd) of one row (each argument
    the row's n elements): h = x, or round(x + residual) written to residual_out first (and
    read back as stored)."""
    decode, encode, _ = codec(intr, dtype)
    row_sumsq = make_row_sumsq(intr, dtype)

    @intr.jitable
    def normalised_row(x, residual, residual_out, n, eps):
        h = x
        if has_residual:
            for j in range(n):
                residual_out[j] = encode(decode(x[j]) + decode(residual[j]))
            h = residual_out
        return h, float32(1.0) / np.sqrt(row_sumsq(h, n) / float32(n) + eps)

    return normalised_row


def make_cpu_fused_fwd(intr, dtype, weight_dtype, has_residual, quant, xscale_dtype):
    """fwd(x, residual, weight, xscale, y, residual_out, rstd, yscale, rows, eps, weight_offset,
    store_rstd, lo, hi): rows lo to hi, the forward's fused switches (see kernels/rmsnorm_fwd.py)
    on storage vectors; ``rows`` = (n, x, residual, y, residual_out row strides).  A row is one
    pass writing h = round(x + residual) to residual_out (which may be residual), then
    rms_norm's row over h as stored; quantised rows take max|y| in a pass before the one that
    writes q.  Each element is read before it is written, so y may be x and residual_out
    residual."""
    decode, encode, _ = codec(intr, dtype)
    encode_q = codec(intr, quant)[1] if quant else encode
    qmax = float32(_dtypes.QMAX[quant]) if quant else float32(1.0)
    scale = make_scale(intr, dtype, weight_dtype, xscale_dtype)
    normalised_row = make_normalised_row(intr, dtype, has_residual)
    max_nan = intr.max_nan

    @numba.njit(nogil=True, error_model="numpy")
    def fused_fwd(x, residual, weight, xscale, y, residual_out, rstd, yscale, rows, eps,
                  weight_offset, store_rstd, lo, hi):
        n, sx, sr, sy, so = rows
        for i in range(lo, hi):
            out = y[i * sy:i * sy + n]
            h, r = normalised_row(x[i * sx:i * sx + n], residual[i * sr:i * sr + n],
                                  residual_out[i * so:i * so + n], n, eps)
            if store_rstd:
                rstd[i] = r
            if quant:
                amax = float32(0.0)
                for j in range(n):
                    amax = max_nan(amax, abs(scale(h, j, r, weight, xscale, weight_offset)))
                s = float32(1.0) if amax == float32(0.0) else amax / qmax
                yscale[i] = s
                inv = float32(1.0) / s
                if inv <= float32(3.4028235e38):
                    for j in range(n):
                        out[j] = encode_q(scale(h, j, r, weight, xscale, weight_offset) * inv)
                else:           # a subnormal yscale, whose reciprocal overflows: divide
                    for j in range(n):
                        out[j] = encode_q(scale(h, j, r, weight, xscale, weight_offset) / s)
            else:
                for j in range(n):
                    out[j] = encode(scale(h, j, r, weight, xscale, weight_offset))

    return fused_fwd

def make_cpu_quant_fwd(intr, dtype, weight_dtype, has_residual, quant, xscale_dtype, scaling,
                       group):
    """fwd(x, residual, weight, xscale, q, residual_out, scales, rows, eps, weight_offset, lo,
    hi): the quantised forward with scales per ``group`` columns ("group", "ue8m0", "mx") or a
    static scale (``scales[0]``), rows lo to hi; ``rows`` = (n, x, residual, q, residual_out row
    strides, the scales' row and column strides) (see kernels/rmsnorm_fwd.py, FwdSpec.scaling).  The
    scale of a group and its factors are the GPU kernels' (_rowops.make_group_scale); y is formed
    as in make_cpu_fused_fwd.  fp4 q holds two elements a byte, element 2i in the low nibble."""
    decode, encode, _ = codec(intr, dtype)
    element = _dtypes.MX_ELEMENT.get(quant, quant)
    fp4 = element == _dtypes.MXFP4
    encode_q = intr.f32_to_e2m1 if fp4 else codec(intr, element)[1]
    scale = make_scale(intr, dtype, weight_dtype, xscale_dtype)
    scale_of = make_group_scale(intr, scaling, quant)
    normalised_row = make_normalised_row(intr, dtype, has_residual)
    max_nan = intr.max_nan
    static = scaling == "static"
    one = float32(1.0)

    @intr.jitable
    def level(v, inv, pre):
        if pre == one:
            return encode_q(v * inv)
        return encode_q((v * pre) * inv)

    @numba.njit(nogil=True, error_model="numpy")
    def quant_fwd(x, residual, weight, xscale, q, residual_out, scales, rows, eps, weight_offset,
                  lo, hi):
        n, sx, sr, sq, so, ss, sg = rows
        size = n if static else group
        for i in range(lo, hi):
            h, r = normalised_row(x[i * sx:i * sx + n], residual[i * sr:i * sr + n],
                                  residual_out[i * so:i * so + n], n, eps)
            qi = i * sq
            for g0 in range(0, n, size):
                if static:
                    _, inv, pre = scale_of(scales[0])
                else:
                    amax = float32(0.0)
                    for j in range(g0, g0 + size):
                        amax = max_nan(amax, abs(scale(h, j, r, weight, xscale, weight_offset)))
                    stored, inv, pre = scale_of(amax)
                    scales[i * ss + (g0 // size) * sg] = stored
                if fp4:
                    for j in range(g0, g0 + size, 2):
                        lo_bits = level(scale(h, j, r, weight, xscale, weight_offset), inv, pre)
                        hi_bits = level(scale(h, j + 1, r, weight, xscale, weight_offset), inv,
                                        pre)
                        q[qi + j // 2] = lo_bits | (hi_bits << 4)
                else:
                    for j in range(g0, g0 + size):
                        q[qi + j] = level(scale(h, j, r, weight, xscale, weight_offset), inv, pre)

    return quant_fwd


BWD_GROUPS = 64   # row groups (dweight partial rows); a function of M only: deterministic


def bwd_group_rows(m, groups, g):
    """The first row of row group ``g`` of ``groups`` (a function of M only)."""
    return g * m // groups


def make_cpu_rmsnorm_bwd(intr, dtype, weight_dtype, recompute_rstd, has_dres):
    """bwd(dy, x, weight, rstd, dres, dx, partial (G, N) float32, rows, eps, weight_offset, g0,
    g1): dx row by row for the rows of groups g0 to g1 of M, and each group's dweight partial row
    (the sum of its rows' dy * x_hat; :func:`make_dweight_sum` adds the partial rows in group
    order).  ``rows`` = (M, N, H, then the (stride, head stride) of dy, x, dres and dx): row i
    at (i // H) * stride + (i % H) * head stride (H = 1 for rows at one stride)."""
    decode, encode, _ = codec(intr, dtype)
    decode_w = codec(intr, weight_dtype or _dtypes.FLOAT32)[0]
    has_weight = bool(weight_dtype)
    row_sumsq = make_row_sumsq(intr, dtype)

    @intr.jitable
    def x_times_wdy(x, dy, w, off, j):
        g = decode(dy[j])
        if has_weight:
            g = g * (decode_w(w[j]) + off)
        return decode(x[j]) * g

    row_dot = make_lane_sum(intr, x_times_wdy)

    @numba.njit(nogil=True, error_model="numpy")
    def rmsnorm_bwd(dy, x, weight, rstd, dres, dx, partial, rows, eps, weight_offset, g0, g1):
        m, n, h, s_dy, h_dy, s_x, h_x, s_dr, h_dr, s_dx, h_dx = rows
        groups = partial.shape[0]
        for g in range(g0, g1):
            for j in range(n):
                partial[g, j] = float32(0.0)
            for i in range(g * m // groups, (g + 1) * m // groups):
                t, k = i // h, i % h
                xi = x[t * s_x + k * h_x:t * s_x + k * h_x + n]
                dyi = dy[t * s_dy + k * h_dy:t * s_dy + k * h_dy + n]
                dxi = dx[t * s_dx + k * h_dx:t * s_dx + k * h_dx + n]
                dri = dres[t * s_dr + k * h_dr:t * s_dr + k * h_dr + n]
                if recompute_rstd:
                    r = float32(1.0) / np.sqrt(row_sumsq(xi, n) / float32(n) + eps)
                else:
                    r = rstd[i]
                c1 = row_dot(xi, dyi, weight, weight_offset, n) * r / float32(n)
                for j in range(n):
                    d = decode(dyi[j])
                    wdy = d
                    if has_weight:
                        wdy = d * (decode_w(weight[j]) + weight_offset)
                    x_hat = decode(xi[j]) * r
                    v = (wdy - x_hat * c1) * r
                    if has_dres:
                        v = v + decode(dri[j])
                    dxi[j] = encode(v)
                    partial[g, j] += d * x_hat

    return rmsnorm_bwd


def make_dweight_sum(intr, weight_dtype):
    """dweight_sum(partial (G, N) float32, dweight (N,)): the partial rows added in group order,
    rounded once to the weight's dtype."""
    encode_w = codec(intr, weight_dtype)[1]

    @numba.njit(nogil=True, error_model="numpy")
    def dweight_sum(partial, dweight):
        groups, n = partial.shape
        for j in range(n):
            total = float32(0.0)
            for g in range(groups):
                total += partial[g, j]
            dweight[j] = encode_w(total)

    return dweight_sum


def make_cpu_qk_norm(intr, dtype, weight_dtype, rope, cache_dtype):
    """qk(q, k, q_weight, k_weight, q_out, k_out, positions, cache, heads, eps, weight_offset, lo,
    hi): tokens lo to hi of q (T, Hq, D) and k (T, Hk, D); ``heads`` = (D, Hq, Hk, the (token,
    head) strides of q, k, q_out and k_out, the cache's row stride, rot).  Each head row as
    rms_norm's row, then RoPE (``rope``: "neox" | "gptj" | "") over its first ``rot`` elements
    in float32 with the GPU kernel's operations (kernels/qk_norm.py), then one rounding.  The row
    is read whole before it is written, so q_out may be q and k_out k.  Positions are checked by
    the caller."""
    decode, encode, _ = codec(intr, dtype)
    decode_w = codec(intr, weight_dtype)[0]
    decode_c = codec(intr, cache_dtype or _dtypes.FLOAT32)[0]
    row_sumsq = make_row_sumsq(intr, dtype)
    fma = intr.fma
    neox = rope == "neox"

    @numba.njit(nogil=True, error_model="numpy")
    def head(src, dst, weight, pos, cache, rot, eps, weight_offset, vals):
        n = src.shape[0]
        c0 = pos[0] * pos[1]            # (position, cache row stride): the row's cos at c0
        r = float32(1.0) / np.sqrt(row_sumsq(src, n) / float32(n) + eps)
        for j in range(n):
            vals[j] = (decode(src[j]) * r) * (decode_w(weight[j]) + weight_offset)
        if rope:
            half = rot // 2
            if neox:
                for i in range(half):
                    c, s = decode_c(cache[c0 + i]), decode_c(cache[c0 + half + i])
                    a, b = vals[i], vals[i + half]
                    vals[i] = fma(a, c, -(b * s))
                    vals[i + half] = fma(b, c, a * s)
            else:
                for i in range(half):
                    c, s = decode_c(cache[c0 + i]), decode_c(cache[c0 + half + i])
                    a, b = vals[2 * i], vals[2 * i + 1]
                    vals[2 * i] = fma(a, c, -(b * s))
                    vals[2 * i + 1] = fma(b, c, a * s)
        for j in range(n):
            dst[j] = encode(vals[j])

    @numba.njit(nogil=True, error_model="numpy")
    def qk_norm(q, k, q_weight, k_weight, q_out, k_out, positions, cache, heads, eps,
                weight_offset, lo, hi):
        d, hq, hk, sq, hsq, sk, hsk, sqo, hsqo, sko, hsko, cache_stride, rot = heads
        vals = np.empty(d, np.float32)
        for t in range(lo, hi):
            pos = (positions[t] if rope else 0, cache_stride)
            for h in range(hq):
                head(q[t * sq + h * hsq:t * sq + h * hsq + d],
                     q_out[t * sqo + h * hsqo:t * sqo + h * hsqo + d], q_weight, pos, cache, rot,
                     eps, weight_offset, vals)
            for h in range(hk):
                head(k[t * sk + h * hsk:t * sk + h * hsk + d],
                     k_out[t * sko + h * hsko:t * sko + h * hsko + d], k_weight, pos, cache, rot,
                     eps, weight_offset, vals)

    return qk_norm


def make_cpu_gated_fwd(intr, dtype, weight_dtype, gate):
    """fwd(x, z, weight, y, rstd, rows, eps, weight_offset, store_rstd, lo, hi): rows lo to hi
    of M rows of H groups of G columns (H = 1 without groups; ``rows`` = (H, G, then the
    (stride, group stride) of x, z and y), gated RMSNorm in
    float32 with the GPU kernel's operations: ``gate`` "input" normalises h = x * silu(z),
    "output" multiplies y by silu(z); group i takes weight[i * G:]; rstd (M * H,)."""
    decode, encode, _ = codec(intr, dtype)
    decode_w = codec(intr, weight_dtype or _dtypes.FLOAT32)[0]
    has_weight, gated_input = bool(weight_dtype), gate == "input"

    @intr.jitable
    def silu(v):
        return v / (float32(1.0) + np.exp(-v))

    @intr.jitable
    def h_of(x, z, j):
        v = decode(x[j])
        if gated_input:
            v = v * silu(decode(z[j]))
        return v

    @intr.jitable
    def square(x, z, w, off, j):
        v = h_of(x, z, j)
        return v * v

    row_sumsq = make_lane_sum(intr, square)

    @numba.njit(nogil=True, error_model="numpy")
    def gated_fwd(x, z, weight, y, rstd, rows, eps, weight_offset, store_rstd, lo, hi):
        groups, g, sx, hx, sz, hz, sy, hy = rows
        for i in range(lo, hi):
            for k in range(groups):
                xr = x[i * sx + k * hx:i * sx + k * hx + g]
                zr = z[i * sz + k * hz:i * sz + k * hz + g]
                yr = y[i * sy + k * hy:i * sy + k * hy + g]
                r = float32(1.0) / np.sqrt(row_sumsq(xr, zr, xr, float32(0.0), g) / float32(g)
                                           + eps)
                if store_rstd:
                    rstd[i * groups + k] = r
                for j in range(g):
                    v = h_of(xr, zr, j) * r
                    if has_weight:
                        v = v * (decode_w(weight[k * g + j]) + weight_offset)
                    if not gated_input:
                        v = v * silu(decode(zr[j]))
                    yr[j] = encode(v)

    return gated_fwd


def make_cpu_gated_bwd(intr, dtype, weight_dtype, recompute_rstd, gate):
    """bwd(dy, x, z, weight, rstd, dx, dz, partial (P, N) float32, rows, eps, weight_offset, p0,
    p1): the gated backward (kernels/gated_bwd.py's formulas, in float32) of the full rows of
    row groups p0 to p1 of M rows of H groups of G columns (``rows`` = (M, H, G, the row strides
    of dy, x, z, dx and dz; a group at G past the one before)), each group's dweight partial row
    over its rows
    (:func:`make_dweight_sum` adds them in order); rstd (M * H,)."""
    decode, encode, _ = codec(intr, dtype)
    decode_w = codec(intr, weight_dtype or _dtypes.FLOAT32)[0]
    has_weight, gated_input = bool(weight_dtype), gate == "input"

    @intr.jitable
    def product(a, b, w, off, j):
        return a[j] * b[j]

    # the row sums in the other CPU kernels' order (lanes and a pairwise tree)
    row_dot = make_lane_sum(intr, product)

    @numba.njit(nogil=True, error_model="numpy")
    def gated_bwd(dy, x, z, weight, rstd, dx, dz, partial, rows, eps, weight_offset, p0, p1):
        m, groups, g, s_dy, s_x, s_z, s_dx, s_dz = rows
        parts = partial.shape[0]
        sg = np.empty(g, np.float32)
        gv = np.empty(g, np.float32)
        hv = np.empty(g, np.float32)
        for p in range(p0, p1):
            for j in range(groups * g):
                partial[p, j] = float32(0.0)
            for i in range(p * m // parts, (p + 1) * m // parts):
                for k in range(groups):
                    # the group's first element in each array
                    bz, bx, bdy = i * s_z + k * g, i * s_x + k * g, i * s_dy + k * g
                    bdx, bdz = i * s_dx + k * g, i * s_dz + k * g
                    for j in range(g):
                        zv = decode(z[bz + j])
                        sg[j] = zv / (float32(1.0) + np.exp(-zv))
                        v = decode(x[bx + j]) * sg[j] if gated_input else decode(x[bx + j])
                        d = decode(dy[bdy + j])
                        if not gated_input:
                            d = d * sg[j]
                        if has_weight:
                            d = d * (decode_w(weight[k * g + j]) + weight_offset)
                        gv[j] = d
                        hv[j] = v
                    sxg = row_dot(hv, gv, hv, float32(0.0), g)
                    ss = row_dot(hv, hv, hv, float32(0.0), g)
                    if recompute_rstd:
                        r = float32(1.0) / np.sqrt(ss / float32(g) + eps)
                    else:
                        r = rstd[i * groups + k]
                    c = sxg * r / float32(g)
                    for j in range(g):
                        zv = decode(z[bz + j])
                        sgm = float32(1.0) / (float32(1.0) + np.exp(-zv))
                        dsg = sgm * (float32(1.0) + zv * (float32(1.0) - sgm))
                        xv = decode(x[bx + j])
                        d = decode(dy[bdy + j])
                        w = float32(1.0)
                        if has_weight:
                            w = decode_w(weight[k * g + j]) + weight_offset
                        if gated_input:
                            h_hat = (xv * sg[j]) * r
                            dh = (gv[j] - h_hat * c) * r
                            dx[bdx + j] = encode(dh * sg[j])
                            dz[bdz + j] = encode((dh * xv) * dsg)
                            partial[p, k * g + j] += d * h_hat
                        else:
                            x_hat = xv * r
                            dx[bdx + j] = encode((gv[j] - x_hat * c) * r)
                            dz[bdz + j] = encode((d * (x_hat * w)) * dsg)
                            partial[p, k * g + j] += (d * sg[j]) * x_hat

    return gated_bwd
