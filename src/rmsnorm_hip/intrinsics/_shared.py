"""Device helpers written once and compiled by every backend: 16-bit float codecs in integer
arithmetic (numba-hip has no half types; integer RNE is bit-exact everywhere), the 8-bit
quantised encoders (int8, float8 e4m3fn, float4 e2m1) and the butterfly reductions.  ``build``
binds them to one backend's bit casts, shuffle and ``jitable`` decorator.

Integer constants carry explicit widths: the simulator runs these as NumPy scalars, where
``np.uint16(x) << 16`` would stay 16-bit (NEP 50), while compiled numba widens.
"""
import math
from types import SimpleNamespace

from numba import float32, int32, uint16, uint32

# 1.5 * 2**23: adding it to a float32 of magnitude < 2**22 rounds to an integer, ties to even, and
# leaves that integer in the low mantissa bits (float32 bits 0x4B400000 + integer)
_RNE_MAGIC = 12582912.0


def portable_max_nan(a, b):
    """max(a, b) where a NaN wins, so a NaN row cannot hide behind a finite max."""
    if b > a or b != b:
        return b
    return a


def build(jitable, f32_as_u32, u32_as_f32, shfl_xor, max_nan=None):
    """The helpers over one backend's primitives; ``max_nan`` replaces the portable NaN-winning
    max where the backend has it in one instruction."""
    @jitable
    def bf16_to_f32(bits):
        return u32_as_f32(uint32(bits) << uint32(16))

    @jitable
    def f32_to_bf16(value):
        u = f32_as_u32(float32(value))
        # NaN -> canonical quiet NaN, as ml_dtypes
        if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
            return uint16(((u >> uint32(16)) & uint32(0x8000)) | uint32(0x7FC0))
        lsb = (u >> uint32(16)) & uint32(1)
        return uint16((u + uint32(0x7FFF) + lsb) >> uint32(16))

    @jitable
    def f16_to_f32(bits):
        h = uint32(bits)
        sign = (h & uint32(0x8000)) << uint32(16)
        exp = (h >> uint32(10)) & uint32(0x1F)
        man = h & uint32(0x3FF)
        if exp == uint32(0x1F):
            return u32_as_f32(sign | uint32(0x7F800000) | (man << uint32(13)))
        if exp != uint32(0):
            return u32_as_f32(sign | ((exp + uint32(112)) << uint32(23)) | (man << uint32(13)))
        # zero or subnormal: man * 2**-24 is exact in float32
        mag = float32(man) * float32(5.9604644775390625e-08)
        return u32_as_f32(f32_as_u32(mag) | sign)

    @jitable
    def f32_to_f16(value):
        u = f32_as_u32(float32(value))
        sign = (u >> uint32(16)) & uint32(0x8000)
        mag = u & uint32(0x7FFFFFFF)
        if mag > uint32(0x7F800000):  # NaN stays a quiet NaN
            return uint16(sign | uint32(0x7E00) | ((mag >> uint32(13)) & uint32(0x1FF)))
        if mag >= uint32(0x477FF000):  # >= 65520 rounds to infinity
            return uint16(sign | uint32(0x7C00))
        if mag >= uint32(0x38800000):  # normal half: rounding may carry into the exponent
            lsb = (mag >> uint32(13)) & uint32(1)
            return uint16(sign | (((mag + uint32(0xFFF) + lsb) >> uint32(13)) - uint32(0x1C000)))
        if mag < uint32(0x33000000):  # below half the smallest subnormal (ties to even: 0)
            return uint16(sign)
        exp = mag >> uint32(23)
        man = (mag & uint32(0x7FFFFF)) | uint32(0x800000)
        shift = uint32(126) - exp
        kept = man >> shift
        rest = man & ((uint32(1) << shift) - uint32(1))
        half = uint32(1) << (shift - uint32(1))
        if rest > half or (rest == half and (kept & uint32(1)) == uint32(1)):
            kept += uint32(1)
        return uint16(sign | kept)

    @jitable
    def pack_bf16x2(lo, hi):
        return uint32(f32_to_bf16(lo)) | (uint32(f32_to_bf16(hi)) << uint32(16))

    @jitable
    def pack_f16x2(lo, hi):
        return uint32(f32_to_f16(lo)) | (uint32(f32_to_f16(hi)) << uint32(16))

    @jitable
    def f32_to_i8(value):
        """int8 level of a float32 as an int32: round to nearest even, saturating to +-127,
        NaN -> 0."""
        v = float32(value)
        if v > float32(127.0):
            v = float32(127.0)
        elif v < float32(-127.0):
            v = float32(-127.0)
        elif v != v:
            v = float32(0.0)
        return int32(f32_as_u32(v + float32(_RNE_MAGIC))) - int32(0x4B400000)

    @jitable
    def f32_to_e4m3(value):
        """float8 e4m3fn bits of a float32 (low 8 bits of a uint32): round to nearest even,
        saturating to +-448 (infinities too), NaN -> NaN of the same sign."""
        u = f32_as_u32(float32(value))
        sign = (u >> uint32(24)) & uint32(0x80)
        mag = u & uint32(0x7FFFFFFF)
        if mag > uint32(0x7F800000):
            bits = uint32(0x7F)
        elif mag >= uint32(0x43E00000):             # >= 448, the largest finite e4m3fn
            bits = uint32(0x7E)
        elif mag >= uint32(0x3C800000):             # normal (>= 2**-6): keep 3 mantissa bits
            lsb = (mag >> uint32(20)) & uint32(1)
            bits = ((mag + uint32(0x7FFFF) + lsb) >> uint32(20)) - uint32(0x3C0)
        else:                                       # subnormal: a multiple of 2**-9 (8 -> 2**-6)
            scaled = u32_as_f32(mag) * float32(512.0) + float32(_RNE_MAGIC)
            bits = f32_as_u32(scaled) - uint32(0x4B400000)
        return sign | bits

    @jitable
    def pack_e4m3x2(lo, hi):
        """Two float8 e4m3fn levels in one uint32 (lo in bits 0-7, hi in bits 8-15)."""
        return f32_to_e4m3(lo) | (f32_to_e4m3(hi) << uint32(8))

    @jitable
    def f32_to_e2m1(value):
        """float4 e2m1 bits of a float32 (low 4 bits of a uint32): round to nearest even over
        the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, saturating to +-6 (infinities too); the sign
        bit kept, so a negative value that rounds to 0 is -0; NaN -> +-6 (e2m1 has no NaN:
        an MX block holding one says so in its scale).

        One float add rounds: a + 2**(e + 22), a = min(|v|, 6) and e its binade clamped below
        at e2m1's 0, has an ulp of e2m1's step there (0.5, 1, 2), so the sum's low bits count
        steps, k.  The code is k + 2e (0.5's subnormal code 1 falls out as k = 1 in binade 0)."""
        u = f32_as_u32(float32(value))
        a = abs(float32(value))
        if not a < float32(6.0):                            # NaN and infinities too
            a = float32(6.0)
        # 32-bit wraps throughout: numba widens uint32 arithmetic to 64 bits
        ebits = uint32(f32_as_u32(a) & uint32(0x7F800000))
        if ebits < uint32(0x3F800000):
            ebits = uint32(0x3F800000)
        magic = uint32(ebits + uint32(0x0B000000))          # 2**(e + 22)
        two_e = uint32(uint32(ebits >> uint32(22)) - uint32(254))
        code = uint32(uint32(f32_as_u32(a + u32_as_f32(magic)) - magic) + two_e)
        return ((u >> uint32(28)) & uint32(0x8)) | code

    @jitable
    def mx_pack_e2m1x2(lo, hi):
        """Two float4 e2m1 levels in one uint32 (lo in bits 0-3, hi in bits 4-7)."""
        return f32_to_e2m1(lo) | (f32_to_e2m1(hi) << uint32(4))

    max_nan = max_nan or jitable(portable_max_nan)

    @jitable
    def warp_sum(value, width):
        offset = width >> 1
        while offset > 0:
            value += shfl_xor(value, offset)
            offset >>= 1
        return value

    @jitable
    def warp_max(value, width):
        offset = width >> 1
        while offset > 0:
            value = max_nan(value, shfl_xor(value, offset))
            offset >>= 1
        return value

    @jitable
    def sigmoid(v):     # the GPU namespaces replace it with their approximate instructions
        return float32(1.0) / (float32(1.0) + math.exp(-v))

    @jitable
    def rsqrt(v):       # GPUs: the hardware's reciprocal square root
        return float32(1.0) / math.sqrt(v)

    return SimpleNamespace(bf16_to_f32=bf16_to_f32, f32_to_bf16=f32_to_bf16,
                           f16_to_f32=f16_to_f32, f32_to_f16=f32_to_f16,
                           pack_bf16x2=pack_bf16x2, pack_f16x2=pack_f16x2, f32_to_i8=f32_to_i8,
                           f32_to_e4m3=f32_to_e4m3, pack_e4m3x2=pack_e4m3x2,
                           f32_to_e2m1=f32_to_e2m1, mx_pack_e2m1x2=mx_pack_e2m1x2,
                           mx_pack_e2m1x8=make_pack_e2m1x8(jitable, mx_pack_e2m1x2),
                           # MX e4m3 elements are plain e4m3fn levels of pre-scaled values
                           mx_pack_e4m3x2=pack_e4m3x2,
                           max_nan=max_nan, warp_sum=warp_sum,
                           warp_max=warp_max, shfl_xor=shfl_xor, sigmoid=sigmoid,
                           rsqrt=rsqrt)


def make_pack_e2m1x8(jitable, pack_x2):
    """``mx_pack_e2m1x8`` from a namespace's ``mx_pack_e2m1x2``: eight levels in one uint32,
    element i in bits 4i to 4i + 3."""
    @jitable
    def mx_pack_e2m1x8(v0, v1, v2, v3, v4, v5, v6, v7):
        return (pack_x2(v0, v1) | (pack_x2(v2, v3) << uint32(8))
                | (pack_x2(v4, v5) << uint32(16)) | (pack_x2(v6, v7) << uint32(24)))

    return mx_pack_e2m1x8


def make_add_pairs(jitable, namespace):
    """``add_bf16x2`` / ``add_f16x2`` from a namespace's codecs (a dict of its names): each half
    of two words of 16-bit floats decoded, added in float32 and the sum rounded to 16 bits, as
    the fused add rounds h.  The namespace's final codecs, so that NaN bits match its stores."""
    def adder(decode, pack):
        @jitable
        def add_pairs(a, b):
            x, y = uint32(a), uint32(b)
            return pack(decode(x & uint32(0xFFFF)) + decode(y & uint32(0xFFFF)),
                        decode(x >> uint32(16)) + decode(y >> uint32(16)))

        return add_pairs

    return dict(add_bf16x2=adder(namespace["bf16_to_f32"], namespace["pack_bf16x2"]),
                add_f16x2=adder(namespace["f16_to_f32"], namespace["pack_f16x2"]))
