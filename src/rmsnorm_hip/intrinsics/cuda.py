"""numba-cuda intrinsics (NVIDIA): 32-lane warps, ``shfl_xor_sync``.

128-bit accesses are plain LLVM loads/stores: the same accesses written as inline PTX with cache
hints measured slower on the H200 (docs/performance.md): ld.global.nc with .L2::256B and
st.global.cs 3-15 points at every LLM shape; ld.global.cs, or an L2 evict-first cache policy, on
every load 8-17 points at the large shapes.  ``load_b128_stream`` (ld.global.cs) is for the
backward's calls of few bytes, where it measured faster (_config.BWD_STREAM_LOADS).
"""
from types import SimpleNamespace

from .. import _compat  # noqa: F401  (NumPy 2.5 alias before numba.cuda is imported)
from numba import cuda, float32, uint16, uint32
from numba.core.extending import register_jitable
from numba.cuda.extending import intrinsic

from . import _llvm, _shared

WARP = 32

_FULL_MASK = 0xFFFFFFFF


@register_jitable
def _shfl_xor(value, offset):
    return cuda.shfl_xor_sync(_FULL_MASK, value, offset)


def build():
    compiled = _llvm.define(intrinsic, fabs="llvm.nvvm.fabs.f", fmax="llvm.nvvm.fmax.f")
    max_nan = _llvm.define_ptx_max_nan(intrinsic, _shared.portable_max_nan)
    shared = vars(_shared.build(register_jitable, compiled["f32_as_u32"], compiled["u32_as_f32"],
                                _shfl_xor, max_nan))

    @register_jitable
    def max_abs_nan(acc, value):    # one FMNMX.NAN: ptxas folds the abs into its operand
        return max_nan(acc, abs(value))

    # hardware conversions: the integer forms cost ~15 ALU ops per element, which at H200 bandwidth
    # is the whole INT32 budget (bf16 forward measured at 59-89% of copy with them)
    shared.update(_llvm.define_hw_f16(intrinsic))
    pack_bf16x2 = _llvm.define_ptx_pack(intrinsic, "cvt.rn.bf16x2.f32")

    @register_jitable
    def f32_to_bf16(value):  # same instruction as the packed stores: one NaN pattern everywhere
        return uint16(pack_bf16x2(value, float32(0.0)) & uint32(0xFFFF))

    shared.update(pack_bf16x2=pack_bf16x2, f32_to_bf16=f32_to_bf16)
    # 8-bit levels in one conversion each, for the same reason (SmoothQuant int8 measured at
    # 35-53% of copy with the integer encoders: docs/performance.md)
    quant = _llvm.define_ptx_quant(intrinsic, shared["pack_e4m3x2"])
    pack_e4m3x2 = quant["pack_e4m3x2"]

    @register_jitable
    def f32_to_e4m3(value):  # the packed stores' instruction: one NaN pattern everywhere
        return pack_e4m3x2(value, float32(0.0)) & uint32(0xFF)

    shared.update(quant, f32_to_e4m3=f32_to_e4m3, mx_pack_e4m3x2=pack_e4m3x2,
                  max_abs_nan=max_abs_nan)
    # e2m1 pairs in 16-bit halves: MXFP4 rows are issue-bound (docs/performance.md)
    shared.update(_llvm.define_ptx_e2m1(intrinsic, shared["mx_pack_e2m1x2"],
                                        shared["mx_pack_e2m1x8"]))
    shared.update(row_barrier=_llvm.define_named_barrier(intrinsic))
    shared.update(load_b128_stream=_llvm.define_stream_load(intrinsic))
    compiled.update(_llvm.define_ptx_red(intrinsic))   # NVVM refuses atomicrmw fadd
    compiled.update(_llvm.define_grid_dependency(intrinsic))
    compiled.update(_llvm.define_l2_prefetch(intrinsic))
    shared.update(_llvm.define_fast_math(intrinsic, "nvidia"))
    # the fused add's h in one packed instruction a word of x and residual, where the float32
    # form converts each element three times (streamed rows are issue-bound at decode sizes)
    shared.update(_llvm.define_ptx_add_pairs(intrinsic))
    return SimpleNamespace(features=frozenset({"gpu", "max_abs_nan"}), name="cuda", warp=WARP,
                           shared_alignment=16,
                           gpu=cuda, jitable=register_jitable,
                           **compiled, **shared)
