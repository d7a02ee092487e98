"""Device helpers written once and compiled by every backend: 16-bit float codecs in integer
arithmetic (numba-hip has no half types; integer RNE is bit-exact everywhere) and the butterfly
reductions.  ``build`` binds them to one backend's bit casts, shuffle and ``jitable`` decorator.

Integer constants carry explicit widths: the simulator runs these as NumPy scalars, where
``np.uint16(x) << 16`` would stay 16-bit (NEP 50), while compiled numba widens.
"""
from types import SimpleNamespace

from numba import float32, uint16, uint32


def build(jitable, f32_as_u32, u32_as_f32, shfl_xor):
    @jitable
    def bf16_to_f32(bits):
        return u32_as_f32(uint32(bits) << uint32(16))

    @jitable
    def f32_to_bf16(value):
        u = f32_as_u32(float32(value))
        if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):  # NaN -> canonical quiet NaN, as ml_dtypes
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
            other = shfl_xor(value, offset)
            # NaN wins, so a NaN row cannot hide behind a finite max
            if other > value or other != other:
                value = other
            offset >>= 1
        return value

    return SimpleNamespace(bf16_to_f32=bf16_to_f32, f32_to_bf16=f32_to_bf16,
                           f16_to_f32=f16_to_f32, f32_to_f16=f32_to_f16,
                           pack_bf16x2=pack_bf16x2, pack_f16x2=pack_f16x2, warp_sum=warp_sum, warp_max=warp_max)
