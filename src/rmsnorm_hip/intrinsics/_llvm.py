"""LLVM IR codegen shared by the compiled GPU intrinsics (numba-cuda and numba-hip emit the same IR
for these; only the ``intrinsic`` decorator they are registered with differs)."""
from llvmlite import ir
from numba import types

I32 = ir.IntType(32)
I64 = ir.IntType(64)
V4I32 = ir.VectorType(I32, 4)
GLOBAL = 1  # global address space on both NVPTX and AMDGPU


def _global_vec_ptr(context, builder, ptrty, ptr, idxty, idx, vecty=V4I32):
    index = context.cast(builder, idx, idxty, types.int64)
    elem = builder.gep(ptr, [index])
    gptr = builder.addrspacecast(elem, ir.PointerType(elem.type.pointee, GLOBAL))
    return builder.bitcast(gptr, ir.PointerType(vecty, GLOBAL))


def _store_words(context, builder, sig, args, count):
    """Store args[2:2 + count] (uint32 words) as one aligned access at element args[1] of
    args[0]."""
    vecty = ir.VectorType(I32, count)
    vptr = _global_vec_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], vecty)
    vec = ir.Constant(vecty, ir.Undefined)
    for k in range(count):
        word = context.cast(builder, args[2 + k], sig.args[2 + k], types.uint32)
        vec = builder.insert_element(vec, word, ir.Constant(I32, k))
    builder.store(vec, vptr, align=4 * count)
    return context.get_dummy_value()


def is_pointer_index(ptr, idx):
    return isinstance(ptr, types.CPointer) and isinstance(idx, types.Integer)


def _load_b128(ptr, idx, read):
    """Typing and codegen of a 16-byte load at element ``idx`` of ``ptr`` (16-byte aligned) as
    four uint32: ``read(builder, vptr)`` gives the words of the vector pointer ``vptr``."""
    if not is_pointer_index(ptr, idx):
        return None
    sig = types.UniTuple(types.uint32, 4)(ptr, idx)

    def codegen(context, builder, sig, args):
        vptr = _global_vec_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return context.make_tuple(builder, sig.return_type, read(builder, vptr))

    return sig, codegen


def _plain_words(builder, vptr):
    vec = builder.load(vptr, align=16)
    return [builder.extract_element(vec, ir.Constant(I32, k)) for k in range(4)]


def _streamed_words(builder, vptr):
    address = builder.ptrtoint(vptr, ir.IntType(64))
    # no side effect and no memory clobber: the backward reads x, dy and dresidual, which it
    # never writes (its outputs are allocated for the call)
    asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([I32] * 4), [ir.IntType(64)]),
                       "ld.global.cs.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                       side_effect=False)
    value = builder.call(asm, [address])
    return [builder.extract_value(value, k) for k in range(4)]


def _float_function(module, name, arity):
    """The float32 function ``name`` of ``module`` (declared on first use)."""
    if name in module.globals:
        return module.globals[name]
    f32 = ir.FloatType()
    return ir.Function(module, ir.FunctionType(f32, [f32] * arity), name)


def define(intrinsic, fabs="llvm.fabs.f32", fmax="llvm.maxnum.f32"):
    """The compiled intrinsics, registered with ``intrinsic`` (numba-cuda's or numba-hip's).
    ``fabs``, ``fmax``: float32 |x| and maxnum by the names the target's IR accepts (libNVVM
    rejects LLVM's generic ones and has its own)."""

    @intrinsic
    def f32_as_u32(typingctx, value):
        if not isinstance(value, types.Float):
            return None

        def codegen(context, builder, sig, args):
            f = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.bitcast(f, I32)

        return types.uint32(value), codegen

    @intrinsic
    def u32_as_f32(typingctx, value):
        if not isinstance(value, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            u = context.cast(builder, args[0], sig.args[0], types.uint32)
            return builder.bitcast(u, ir.FloatType())

        return types.float32(value), codegen

    @intrinsic
    def load_b128(typingctx, ptr, idx):
        """16 bytes at element ``idx`` of ``ptr`` (16-byte aligned) as four uint32."""
        return _load_b128(ptr, idx, _plain_words)

    @intrinsic
    def align_offset(typingctx, ptr, idx):
        """The byte offset of element ``idx`` of ``ptr`` within its 16-byte block (0-15), as an
        int32: what the scalar kernels step back by to reach the aligned blocks around it."""
        if not is_pointer_index(ptr, idx):
            return None

        def codegen(context, builder, sig, args):
            index = context.cast(builder, args[1], sig.args[1], types.int64)
            address = builder.ptrtoint(builder.gep(args[0], [index]), ir.IntType(64))
            low = builder.and_(address, ir.Constant(ir.IntType(64), 15))
            return builder.trunc(low, I32)

        return types.int32(ptr, idx), codegen

    @intrinsic
    def store_b128(typingctx, ptr, idx, w0, w1, w2, w3):
        """Store four uint32 as 16 bytes at element ``idx`` of ``ptr`` (16-byte aligned)."""
        if not is_pointer_index(ptr, idx):
            return None
        sig = types.void(ptr, idx, w0, w1, w2, w3)

        def codegen(context, builder, sig, args):
            return _store_words(context, builder, sig, args, 4)

        return sig, codegen

    @intrinsic
    def store_b64(typingctx, ptr, idx, w0, w1):
        """Store two uint32 as 8 bytes at element ``idx`` of ``ptr`` (8-byte aligned)."""
        if not is_pointer_index(ptr, idx):
            return None

        def codegen(context, builder, sig, args):
            return _store_words(context, builder, sig, args, 2)

        return types.void(ptr, idx, w0, w1), codegen

    @intrinsic
    def store_b32(typingctx, ptr, idx, w0):
        """Store one uint32 as 4 bytes at element ``idx`` of ``ptr`` (4-byte aligned)."""
        if not is_pointer_index(ptr, idx):
            return None

        def codegen(context, builder, sig, args):
            return _store_words(context, builder, sig, args, 1)

        return types.void(ptr, idx, w0), codegen

    @intrinsic
    def atomic_add_f32(typingctx, ptr, idx, value):
        """ptr[idx] += value atomically (float32).  On AMD the metadata lets LLVM emit a native
        global_atomic_add_f32 instead of a compare-and-swap loop.  CUDA takes define_ptx_red's
        instead: NVVM refuses ``atomicrmw fadd`` (ERROR_INVALID_IR)."""
        if not (is_pointer_index(ptr, idx) and ptr.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            index = context.cast(builder, args[1], sig.args[1], types.int64)
            elem = builder.gep(args[0], [index])
            gptr = builder.addrspacecast(elem, ir.PointerType(ir.FloatType(), GLOBAL))
            val = context.cast(builder, args[2], sig.args[2], types.float32)
            inst = builder.atomic_rmw("fadd", gptr, val, "monotonic")
            inst.set_metadata("amdgpu.no.fine.grained.memory", builder.module.add_metadata([]))
            return context.get_dummy_value()

        return types.void(ptr, idx, value), codegen

    @intrinsic
    def fma(typingctx, a, b, c):
        """a * b + c rounded once (llvm.fma.f32).  The kernels spell every multiply-add out with
        it: left to the backend, whether ``p * q - r * s`` fuses p * q or r * s depends on the
        surrounding code, and the vector and scalar forms of a row would round differently."""
        if not all(isinstance(v, types.Float) for v in (a, b, c)):
            return None

        def codegen(context, builder, sig, args):
            a_, b_, c_ = (context.cast(builder, v, t, types.float32)
                          for v, t in zip(args, sig.args))
            return builder.fma(a_, b_, c_)

        return types.float32(a, b, c), codegen

    @intrinsic
    def max_abs(typingctx, acc, value):
        """maxnum(acc, |value|) (llvm.maxnum: one max instruction with an abs operand modifier on
        both vendors).  A NaN ``value`` is ignored, unlike ``max_nan``: callers that must see NaN
        rows detect them another way."""
        if not (isinstance(acc, types.Float) and isinstance(value, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[0], sig.args[0], types.float32)
            f = context.cast(builder, args[1], sig.args[1], types.float32)
            module = builder.module
            maxnum, absolute = _float_function(module, fmax, 2), _float_function(module, fabs, 1)
            return builder.call(maxnum, [a, builder.call(absolute, [f])])

        return types.float32(acc, value), codegen

    return dict(f32_as_u32=f32_as_u32, u32_as_f32=u32_as_f32, load_b128=load_b128, fma=fma,
                align_offset=align_offset,
                max_abs=max_abs,
                store_b128=store_b128, store_b64=store_b64, store_b32=store_b32,
                atomic_add_f32=atomic_add_f32)


def define_hw_f16(intrinsic):
    """float16 <-> float32 with the hardware's conversions (``fpext``/``fptrunc`` on ``half``:
    cvt.f32.f16 / cvt.rn.f16x2.f32 on NVIDIA, v_cvt_f32_f16 / v_cvt_pk_f16_f32 style on AMD)."""
    half = ir.HalfType()

    @intrinsic
    def f16_to_f32(typingctx, bits):
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            u = context.cast(builder, args[0], sig.args[0], types.uint16)
            return builder.fpext(builder.bitcast(u, half), ir.FloatType())

        return types.float32(bits), codegen

    def _to_half_bits(context, builder, value, ty):
        f = context.cast(builder, value, ty, types.float32)
        return builder.zext(builder.bitcast(builder.fptrunc(f, half), ir.IntType(16)), I32)

    @intrinsic
    def f32_to_f16(typingctx, value):
        if not isinstance(value, types.Float):
            return None

        def codegen(context, builder, sig, args):
            return builder.trunc(_to_half_bits(context, builder, args[0], sig.args[0]),
                                 ir.IntType(16))

        return types.uint16(value), codegen

    @intrinsic
    def pack_f16x2(typingctx, lo, hi):
        if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            low = _to_half_bits(context, builder, args[0], sig.args[0])
            high = _to_half_bits(context, builder, args[1], sig.args[1])
            return builder.or_(low, builder.shl(high, ir.Constant(I32, 16)))

        return types.uint32(lo, hi), codegen

    return dict(f16_to_f32=f16_to_f32, f32_to_f16=f32_to_f16, pack_f16x2=pack_f16x2)


def define_amd_mx_convert(intrinsic):
    """``mx_pack_e2m1x2`` / ``mx_pack_e4m3x2`` through gfx950's ``v_cvt_scalef32_pk_fp4_f32`` /
    ``v_cvt_scalef32_pk_fp8_f32`` (round to nearest even; the first source goes to the low
    nibble / byte).  The values come pre-scaled, so the scale operand is 1.0.  Each input is
    clamped first: the fp8 conversion does not saturate (448 < |v| would give NaN) and fp4's
    overflow is undocumented.  gfx950 only: LLVM selects these for gfx942 too, without a word."""
    f32, i16x2 = ir.FloatType(), ir.VectorType(ir.IntType(16), 2)

    def clamped(context, builder, value, ty, limit):
        fmax = _float_function(builder.module, "llvm.maxnum.f32", 2)
        fmin = _float_function(builder.module, "llvm.minnum.f32", 2)
        v = context.cast(builder, value, ty, types.float32)
        v = builder.call(fmax, [v, ir.Constant(f32, -limit)])
        return builder.call(fmin, [v, ir.Constant(f32, limit)])

    def define_one(name, result, operands, limit, selector):
        @intrinsic
        def mx_pack(typingctx, lo, hi):
            if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
                return None

            def codegen(context, builder, sig, args):
                a, b = (clamped(context, builder, v, t, limit) for v, t in zip(args, sig.args))
                fn = builder.module.globals.get(name) or ir.Function(
                    builder.module, ir.FunctionType(result, operands), name)
                # old = 0: the bits the instruction does not write stay zero
                packed = builder.call(fn, [ir.Constant(result, None), a, b, ir.Constant(f32, 1.0),
                                           selector])
                return builder.bitcast(packed, I32)

            return types.uint32(lo, hi), codegen

        return mx_pack

    return dict(
        mx_pack_e2m1x2=define_one("llvm.amdgcn.cvt.scalef32.pk.fp4.f32", I32,
                                  [I32, f32, f32, f32, I32], 6.0, ir.Constant(I32, 0)),
        mx_pack_e4m3x2=define_one("llvm.amdgcn.cvt.scalef32.pk.fp8.f32", i16x2,
                                  [i16x2, f32, f32, f32, ir.IntType(1)], 448.0,
                                  ir.Constant(ir.IntType(1), 0)))


def define_ptx_pack(intrinsic, instruction):
    """(lo, hi) float32 -> uint32 through one PTX ``cvt.rn.<16-bit>x2.f32`` (its first source
    operand lands in the upper half)."""

    @intrinsic
    def pack(typingctx, lo, hi):
        if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            return _ptx_pair(context, builder, sig, args, instruction, 32)

        return types.uint32(lo, hi), codegen

    return pack


def _ptx_pair(context, builder, sig, args, instruction, bits):
    """uint32 of one PTX ``cvt`` packing float32 args (lo, hi) into ``bits`` bits; PTX puts its
    first source operand in the upper part, so hi goes first."""
    low = context.cast(builder, args[0], sig.args[0], types.float32)
    high = context.cast(builder, args[1], sig.args[1], types.float32)
    result = ir.IntType(bits)
    asm = ir.InlineAsm(ir.FunctionType(result, [ir.FloatType(), ir.FloatType()]),
                       f"{instruction} $0, $1, $2;", f"={'r' if bits == 32 else 'h'},f,f",
                       side_effect=False)
    packed = builder.call(asm, [high, low])
    return packed if bits == 32 else builder.zext(packed, I32)


def define_ptx_add_pairs(intrinsic):
    """``add_bf16x2`` / ``add_f16x2`` in one PTX instruction a word: ``fma.rn.bf16x2`` by 1.0
    (sm_80; ``add.rn.bf16x2`` is sm_90's) and ``add.rn.f16x2``, each half the exact sum rounded
    once.  The float32 sum rounded again to 16 bits is the same number (24 >= 2 * 11 + 2: one
    rounding after another of that width is the single rounding): the shared form's words, NaN
    bits included, for all 2^32 pairs of each format on an H100."""
    def define_one(template):
        @intrinsic
        def add_pairs(typingctx, a, b):
            if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                x = context.cast(builder, args[0], sig.args[0], types.uint32)
                y = context.cast(builder, args[1], sig.args[1], types.uint32)
                asm = ir.InlineAsm(ir.FunctionType(I32, [I32, I32]), template, "=r,r,r",
                                   side_effect=False)
                return builder.call(asm, [x, y])

            return types.uint32(a, b), codegen

        return add_pairs

    return dict(
        add_bf16x2=define_one("{ .reg .b32 one; mov.b32 one, 0x3F803F80; "
                              "fma.rn.bf16x2 $0, $1, one, $2; }"),
        add_f16x2=define_one("add.rn.f16x2 $0, $1, $2;"))


def define_ptx_quant(intrinsic, pack_e4m3x2_integer):
    """NVIDIA's 8-bit conversions: ``f32_to_i8`` through ``cvt.rni.sat.s8.f32`` alone (round to
    nearest even, NaN -> 0, saturating to [-128, 127]: the quantiser's |y / yscale| is at most
    127 plus three float32 roundings, so -128 never arises and a clamp would cost an instruction
    per element of an issue-bound kernel) and ``pack_e4m3x2`` through
    ``cvt.rn.satfinite.e4m3x2.f32`` where the target has it (sm_89+), else the integer encoder
    ``pack_e4m3x2_integer``.  Same levels as the integer forms for every non-NaN input."""

    @intrinsic
    def f32_to_i8(typingctx, value):
        if not isinstance(value, types.Float):
            return None

        def codegen(context, builder, sig, args):
            f = context.cast(builder, args[0], sig.args[0], types.float32)
            asm = ir.InlineAsm(ir.FunctionType(I32, [ir.FloatType()]),
                               "cvt.rni.sat.s8.f32 $0, $1;", "=r,f", side_effect=False)
            return builder.call(asm, [f])

        return types.int32(value), codegen

    @intrinsic
    def pack_e4m3x2(typingctx, lo, hi):
        if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
            return None
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            if _target_cc() < (8, 9):
                return context.compile_internal(builder, pack_e4m3x2_integer, sig, args)
            return _ptx_pair(context, builder, sig, args, "cvt.rn.satfinite.e4m3x2.f32", 16)

        return sig, codegen

    return dict(f32_to_i8=f32_to_i8, pack_e4m3x2=pack_e4m3x2)


# One e2m1 pair in 16-bit halves, lo in the low half (sm_90 for max.u16x2): 14 SASS
# instructions a pair where the float32 encoder took about 22.  A round-to-odd float16 (the
# truncation, its last bit set where the float32 had more: then the truncation of bits + 0x1FFF
# is one step up) keeps every bit e2m1's rounding needs; |m| clamped to 6 (NaN too) and its
# binade clamped at 1.0 give e, and a + e * 512 in one f16 fma rounds a to e2m1's step, its low
# bits counting the steps k; the code is k + 2 * binade, the sign bit 3 of each half's nibble.
# The float32 encoder's codes for every finite input (every float32 in [2**-30, 16) and random
# bit patterns checked); NaN gives +-6 of either sign.
_E2M1_PAIR_PTX = """cvt.rz.f16x2.f32 {t}, {hi}, {lo};
mov.b32 {u}, {lo}; add.u32 {u}, {u}, 8191; mov.b32 {f}, {u};
mov.b32 {v}, {hi}; add.u32 {v}, {v}, 8191; mov.b32 {g}, {v};
cvt.rz.f16x2.f32 {c}, {g}, {f};
and.b32 {c}, {c}, 0x00010001; or.b32 {m}, {t}, {c}; abs.f16x2 {m}, {m};
min.f16x2 {m}, {m}, k6; max.u16x2 {e}, {m}, k1; and.b32 {e}, {e}, 0x7C007C00;
fma.rn.f16x2 {s}, {e}, k512, {m};
shr.u32 {u}, {e}, 9; add.u32 {u}, {u}, 0xDBE1DBE2; sub.u32 {s}, {s}, {e}; add.u32 {s}, {s}, {u};
shr.u32 {t}, {t}, 12; and.b32 {t}, {t}, 0x00080008; or.b32 {w}, {s}, {t};
"""
_E2M1_TEMPS = "t u v f g c m e s".split()


def _e2m1_ptx(pairs, tail):
    """Inline PTX of ``pairs`` e2m1 pairs (inputs $1.. as lo, hi of each), their nibble words
    w0.. combined by ``tail`` (text, $0 the result)."""
    lines = ["{", ".reg .b32 k6, k1, k512;", ".reg .f32 f<%d>, g<%d>;" % (pairs, pairs),
             ".reg .b32 " + ", ".join(f"{n}<{pairs}>" for n in _E2M1_TEMPS if n not in "fg")
             + f", w<{pairs}>, x<2>, y<2>;",
             "mov.b32 k6, 0x46004600; mov.b32 k1, 0x3C003C00; mov.b32 k512, 0x60006000;"]
    for p in range(pairs):
        names = {n: f"{n}{p}" for n in _E2M1_TEMPS}
        lines.append(_E2M1_PAIR_PTX.format(lo=f"${1 + 2 * p}", hi=f"${2 + 2 * p}", w=f"w{p}",
                                           **names))
    lines += [tail, "}"]
    return "\n".join(lines)


# w: nibbles at bits 0-3 and 16-19; two words as u = w0 | w1 << 8 hold elements 0, 2 at 0-3,
# 8-11 and 1, 3 at 16-19, 24-27, so u | u >> 12 has the four in order in its low 16 bits
_E2M1_X2_TAIL = "shr.u32 x0, w0, 12; or.b32 x0, x0, w0; and.b32 $0, x0, 255;"
_E2M1_X8_TAIL = ("shl.b32 x0, w1, 8; or.b32 x0, x0, w0; shr.u32 y0, x0, 12; or.b32 y0, y0, x0;"
                 "shl.b32 x1, w3, 8; or.b32 x1, x1, w2; shr.u32 y1, x1, 12; or.b32 y1, y1, x1;"
                 "prmt.b32 $0, y0, y1, 0x5410;")


def define_ptx_e2m1(intrinsic, portable_x2, portable_x8):
    """CUDA's ``mx_pack_e2m1x2`` / ``mx_pack_e2m1x8`` in 16-bit halves (_E2M1_PAIR_PTX) on sm_90
    and later; ``portable_x2`` / ``portable_x8`` (the float32 encoders) below it."""

    def typed(values, portable, tail):
        if not all(isinstance(v, types.Float) for v in values):
            return None
        count = len(values)

        def codegen(context, builder, sig, args):
            floats = [context.cast(builder, a, t, types.float32) for a, t in zip(args, sig.args)]
            if _target_cc() < (9, 0):
                return context.compile_internal(
                    builder, portable, types.uint32(*[types.float32] * count), floats)
            asm = ir.InlineAsm(ir.FunctionType(I32, [ir.FloatType()] * count),
                               _e2m1_ptx(count // 2, tail), "=r" + ",f" * count,
                               side_effect=False)
            return builder.call(asm, floats)

        return types.uint32(*values), codegen

    @intrinsic
    def mx_pack_e2m1x2(typingctx, lo, hi):
        return typed((lo, hi), portable_x2, _E2M1_X2_TAIL)

    @intrinsic
    def mx_pack_e2m1x8(typingctx, v0, v1, v2, v3, v4, v5, v6, v7):
        return typed((v0, v1, v2, v3, v4, v5, v6, v7), portable_x8, _E2M1_X8_TAIL)

    return dict(mx_pack_e2m1x2=mx_pack_e2m1x2, mx_pack_e2m1x8=mx_pack_e2m1x8)


def define_ptx_max_nan(intrinsic, portable):
    """CUDA's ``max_nan``; ``portable`` (a Python function) is compiled below sm_80."""
    @intrinsic
    def max_nan(typingctx, a, b):
        """max(a, b) where a NaN wins: ``max.NaN.f32`` (sm_80+; one FMNMX.NAN where the portable
        form, compiled for older targets, takes a compare, a NaN test and a select; ptxas folds
        an abs of ``b`` into it)."""
        if not (isinstance(a, types.Float) and isinstance(b, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            x = context.cast(builder, args[0], sig.args[0], types.float32)
            y = context.cast(builder, args[1], sig.args[1], types.float32)
            if _target_cc() < (8, 0):
                return context.compile_internal(
                    builder, portable, types.float32(types.float32, types.float32),
                    [x, y])
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.FloatType(), ir.FloatType()]),
                               "max.NaN.f32 $0, $1, $2;", "=f,f,f", side_effect=False)
            return builder.call(asm, [x, y])

        return types.float32(a, b), codegen

    return max_nan


def _target_cc():
    """Compute capability being compiled for: numba-cuda asks ``get_current_device`` while it
    lowers, which ahead-of-time builds answer with their target (backends.cuda._targeting)."""
    from numba.cuda import dispatcher
    return tuple(dispatcher.get_current_device().compute_capability)


def define_named_barrier(intrinsic):
    """``row_barrier(group, threads)``: PTX ``bar.sync 1 + group, threads``, a barrier of the
    ``threads`` threads (whole warps) of one row group of a block, so that two rows sharing a
    block wait for their own warps only (barrier 0 stays ``syncthreads``'s).  Convergent: every
    thread of the group reaches it from the same place."""

    @intrinsic
    def row_barrier(typingctx, group, threads):
        if not (isinstance(group, types.Integer) and isinstance(threads, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            bar = context.cast(builder, args[0], sig.args[0], types.int32)
            count = context.cast(builder, args[1], sig.args[1], types.int32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I32, I32]),
                               "bar.sync $0, $1;", "r,r,~{memory}", side_effect=True)
            builder.call(asm, [builder.add(bar, ir.Constant(I32, 1)), count],
                         attrs=("convergent",))
            return context.get_dummy_value()

        return types.void(group, threads), codegen

    return row_barrier


def define_stream_load(intrinsic):
    """``load_b128_stream(ptr, idx)``: load_b128 through PTX ``ld.global.cs`` (cache streaming:
    the lines are allocated evict-first in L1 and L2), for data a kernel reads once: the lines
    the L2 then recycles are these rather than lines earlier work left there, which an eviction
    writes back when dirty.  The same bits as load_b128."""

    @intrinsic
    def load_b128_stream(typingctx, ptr, idx):
        return _load_b128(ptr, idx, _streamed_words)

    return load_b128_stream


def define_ptx_red(intrinsic):
    """``atomic_add_f32(ptr, idx, value)`` and ``atomic_add_f32x4(ptr, idx, a, b, c, d)`` as PTX
    ``red.global.add.f32`` / ``red.global.add.v4.f32`` (sm_90; ``ptr + idx`` 16-byte aligned):
    NVVM refuses LLVM's ``atomicrmw fadd`` (ERROR_INVALID_IR, CUDA 13.0), and a result-less
    reduction is what a dweight accumulator needs.  The address is converted to the global window
    in the same asm block."""

    def address(context, builder, sig, args):
        index = context.cast(builder, args[1], sig.args[1], types.int64)
        return builder.ptrtoint(builder.gep(args[0], [index]), I64)

    @intrinsic
    def atomic_add_f32(typingctx, ptr, idx, value):
        if not (is_pointer_index(ptr, idx) and ptr.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            val = context.cast(builder, args[2], sig.args[2], types.float32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I64, ir.FloatType()]),
                               "{ .reg .u64 g; cvta.to.global.u64 g, $0; "
                               "red.global.add.f32 [g], $1; }", "l,f,~{memory}",
                               side_effect=True)
            builder.call(asm, [address(context, builder, sig, args), val])
            return context.get_dummy_value()

        return types.void(ptr, idx, value), codegen

    @intrinsic
    def atomic_add_f32x4(typingctx, ptr, idx, a, b, c, d):
        if not (is_pointer_index(ptr, idx) and ptr.dtype == types.float32):
            return None

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.float32)
                    for v, t in zip(args[2:], sig.args[2:])]
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I64] + [ir.FloatType()] * 4),
                               "{ .reg .u64 g; cvta.to.global.u64 g, $0; "
                               "red.global.add.v4.f32 [g], {$1, $2, $3, $4}; }",
                               "l,f,f,f,f,~{memory}", side_effect=True)
            builder.call(asm, [address(context, builder, sig, args)] + vals)
            return context.get_dummy_value()

        return types.void(ptr, idx, a, b, c, d), codegen

    return dict(atomic_add_f32=atomic_add_f32, atomic_add_f32x4=atomic_add_f32x4)


def define_l2_prefetch(intrinsic):
    """``prefetch_l2(ptr, idx)``: PTX ``prefetch.global.L2`` of the line holding ``ptr[idx]``:
    no register is written and nothing waits for it, so a kernel can ask for rows it reads
    later (a looped row's next one) while it works on this one.  The address is converted to
    the global window in the same asm block."""

    @intrinsic
    def prefetch_l2(typingctx, ptr, idx):
        if not is_pointer_index(ptr, idx):
            return None

        def codegen(context, builder, sig, args):
            index = context.cast(builder, args[1], sig.args[1], types.int64)
            at = builder.ptrtoint(builder.gep(args[0], [index]), I64)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I64]),
                               "{ .reg .u64 g; cvta.to.global.u64 g, $0; "
                               "prefetch.global.L2 [g]; }", "l", side_effect=True)
            builder.call(asm, [at])
            return context.get_dummy_value()

        return types.void(ptr, idx), codegen

    return dict(prefetch_l2=prefetch_l2)


def define_grid_dependency(intrinsic):
    """``wait_prior_grids()`` and ``release_dependents()``: PTX ``griddepcontrol.wait`` /
    ``griddepcontrol.launch_dependents`` (sm_90 and later; nothing below).  A kernel launched with
    programmatic stream serialization (backends.cuda, RMSNORM_HIP_PDL) may start while the
    kernel before it in the stream still runs: it must wait before its first read of what that
    kernel wrote, and it lets the kernel after it start once its own inputs are read.  Launched
    without the attribute, both are no-ops.  The wait is a memory clobber: no load moves above
    it."""
    def define_one(instruction):
        @intrinsic
        def grid_dependency(typingctx):
            def codegen(context, builder, sig, args):
                if _target_cc() >= (9, 0):
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), instruction,
                                       "~{memory}", side_effect=True)
                    builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return grid_dependency

    return dict(wait_prior_grids=define_one("griddepcontrol.wait;"),
                release_dependents=define_one("griddepcontrol.launch_dependents;"))


_LOG2E = 1.4426950408889634


def define_fast_math(intrinsic, vendor):
    """``sigmoid(v)`` and ``rsqrt(v)`` from the hardware's approximate instructions.

    - ``sigmoid`` = 1 / (1 + 2^(-v * log2(e))) (NVIDIA: ``ex2.approx.ftz`` / ``rcp.approx.ftz``;
      AMD: ``v_exp_f32`` / ``v_rcp_f32``): four instructions where the IEEE expf and division
      take about forty, and a relative error of a few float32 ulp plus the argument's rounding,
      about |v| * 6e-8 (1e-6 at |v| = 20).  +-inf give 0 / 1, NaN stays NaN; NVIDIA's ``.ftz``
      flushes a result below 2**-126 (v below about -87.3) to 0.
    - ``rsqrt`` = 1 / sqrt(v) (NVIDIA: ``rsqrt.approx.f32``; AMD: ``v_rsq_f32``, a subnormal v
      scaled into the normal range first): one instruction where the IEEE square root and
      division take two dependent rounding sequences with their slow-path branches, on the
      critical path of every row; within 2 ulp (the two roundings': 1.5).  0 gives
      +inf, a negative or NaN input NaN."""
    f32 = ir.FloatType()

    def ptx_unary(builder, instruction, value):
        asm = ir.InlineAsm(ir.FunctionType(f32, [f32]), f"{instruction} $0, $1;", "=f,f",
                           side_effect=False)
        return builder.call(asm, [value])

    def amd_unary(builder, name, value):
        return builder.call(_float_function(builder.module, name, 1), [value])

    def float_unary(emit):
        """An intrinsic of one float argument, taken as float32: ``emit(builder, v)``."""
        @intrinsic
        def unary(typingctx, value):
            if not isinstance(value, types.Float):
                return None

            def codegen(context, builder, sig, args):
                return emit(builder, context.cast(builder, args[0], sig.args[0], types.float32))

            return types.float32(value), codegen

        return unary

    def sigmoid(builder, v):
        t = builder.fmul(v, ir.Constant(f32, -_LOG2E))
        if vendor == "nvidia":
            e = ptx_unary(builder, "ex2.approx.ftz.f32", t)
            return ptx_unary(builder, "rcp.approx.ftz.f32", builder.fadd(e, ir.Constant(f32, 1.0)))
        e = amd_unary(builder, "llvm.exp2.f32", t)
        return amd_unary(builder, "llvm.amdgcn.rcp.f32", builder.fadd(e, ir.Constant(f32, 1.0)))

    def rsqrt(builder, v):
        if vendor == "nvidia":
            return ptx_unary(builder, "rsqrt.approx.f32", v)
        # v_rsq_f32 may flush a subnormal input (inf out): such a v is taken as v * 2**24 and
        # its result scaled back by 2**12
        small = builder.fcmp_ordered("<", v, ir.Constant(f32, 2.0 ** -126))
        r = amd_unary(builder, "llvm.amdgcn.rsq.f32", builder.select(
            small, builder.fmul(v, ir.Constant(f32, 2.0 ** 24)), v))
        return builder.select(small, builder.fmul(r, ir.Constant(f32, 2.0 ** 12)), r)

    return dict(sigmoid=float_unary(sigmoid), rsqrt=float_unary(rsqrt))
