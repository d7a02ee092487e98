"""CPU intrinsics (numba's CPU JIT): bit casts and the shared 16-bit codecs.  A CPU row has one
thread, so nothing here shuffles or issues 128-bit accesses."""
from types import SimpleNamespace

from numba.core.extending import intrinsic, register_jitable

from . import _llvm, _shared


@register_jitable
def _no_shuffle(value, offset):
    return value


def build():
    compiled = _llvm.define(intrinsic)
    shared = _shared.build(register_jitable, compiled["f32_as_u32"], compiled["u32_as_f32"],
                           _no_shuffle)
    return SimpleNamespace(features=frozenset(), name="cpu", warp=1, gpu=None,
                           jitable=register_jitable,
                           f32_as_u32=compiled["f32_as_u32"], u32_as_f32=compiled["u32_as_f32"],
                           fma=compiled["fma"],
                           **_shared.make_add_pairs(register_jitable, vars(shared)),
                           **vars(shared))
