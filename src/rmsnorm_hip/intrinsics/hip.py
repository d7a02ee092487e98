"""numba-hip intrinsics (AMD gfx942 / gfx950): 64-lane wavefronts, HIP ``__shfl_xor`` with an
explicit width.

numba-hip 0.2.1 differs from numba-cuda in ways that stay in this file:

- its shuffles have HIP signatures, ``shfl_xor(var, int32 lane_mask, int32 width)``, with no
  ``*_sync`` forms and no default width: the width is always the full wavefront here;
- ``hip.atomic.add(array, idx, value)`` does not type, so the float atomic is the shared
  ``atomicrmw fadd`` intrinsic of ``_llvm`` (its ``amdgpu.no.fine.grained.memory`` metadata gives a
  native ``global_atomic_add_f32`` on gfx942/gfx950 instead of a compare-and-swap loop);
- it has no half types, so 16-bit floats are ``uint16`` bits: bfloat16 through ``_shared``'s
  integer codecs, float16 through the hardware conversions (``_llvm.define_hw_f16``, LLVM ``half``).

Device helpers use numba's ``register_jitable``: the ``hip`` target is a ``GPU`` target, so
generic overloads resolve under it as under numba-cuda.
"""
from types import SimpleNamespace

import rocm.bindings.clang.cindex as _cindex

# numba-hip parses the HIP device header at import with the cindex binding of the AMD LLVM it
# bundles; a libclang of another major version (ROCm's, or Debian's in the compile-only chroot)
# lacks a few symbols that binding registers and fails its check.  Must precede numba.hip.
_cindex.Config.compatibility_check = False

from numba import hip, int32  # noqa: E402
from numba.core.extending import register_jitable  # noqa: E402
from numba.hip.extending import intrinsic  # noqa: E402

from . import MX_HW_ARCHS, _llvm, _shared  # noqa: E402

WARP = 64


@register_jitable
def _shfl_xor(value, offset):
    return hip.shfl_xor(value, int32(offset), int32(WARP))


@register_jitable
def _no_grid_dependency():
    # no programmatic dependent launch on AMD: a kernel starts when the one before it ends
    pass


@register_jitable
def _no_prefetch(ptr, idx):
    # nothing measured on AMD (gfx942 has no prefetch to the L2 alone): rows are read on demand
    pass


@register_jitable
def _row_barrier(group, threads):
    # no named barriers on gfx942 / gfx950: the whole workgroup (callers keep the count uniform)
    hip.syncthreads()


def build(arch=None):
    """The namespace for any AMD arch, or for ``arch`` alone where it converts MX elements in
    hardware (intrinsics.MX_HW_ARCHS)."""
    compiled = _llvm.define(intrinsic)
    shared = vars(_shared.build(register_jitable, compiled["f32_as_u32"], compiled["u32_as_f32"],
                                _shfl_xor))
    # float16 through the hardware conversions (v_cvt_f32_f16 / v_cvt_f16_f32: round to nearest
    # even, f16 denormals kept by the default float mode).  The integer form's branches keep LLVM
    # from unrolling the chunk loop, and the row cache then lives in scratch memory.
    shared.update(_llvm.define_hw_f16(intrinsic))
    # no cache hint (nothing measured on AMD): the streaming load is the plain one
    shared.update(load_b128_stream=compiled["load_b128"])
    atomic_add = compiled["atomic_add_f32"]

    @register_jitable
    def atomic_add_f32x4(ptr, idx, a, b, c, d):   # four native global_atomic_add_f32
        atomic_add(ptr, idx, a)
        atomic_add(ptr, idx + 1, b)
        atomic_add(ptr, idx + 2, c)
        atomic_add(ptr, idx + 3, d)

    shared.update(atomic_add_f32x4=atomic_add_f32x4)
    shared.update(_llvm.define_fast_math(intrinsic, "amd"))
    shared.update(_shared.make_add_pairs(register_jitable, shared))
    features = {"gpu"}
    if arch in MX_HW_ARCHS:
        shared.update(_llvm.define_amd_mx_convert(intrinsic))
        shared.update(mx_pack_e2m1x8=_shared.make_pack_e2m1x8(register_jitable,
                                                              shared["mx_pack_e2m1x2"]))
        features.add("mx_hw_convert")
    return SimpleNamespace(features=frozenset(features), name="hip", warp=WARP,
                           shared_alignment=None,
                           gpu=hip, jitable=register_jitable, row_barrier=_row_barrier,
                           wait_prior_grids=_no_grid_dependency,
                           release_dependents=_no_grid_dependency, prefetch_l2=_no_prefetch,
                           **compiled, **shared)
