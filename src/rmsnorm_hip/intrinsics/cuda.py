"""numba-cuda intrinsics (NVIDIA): 32-lane warps, ``shfl_xor_sync``."""
from types import SimpleNamespace

from .. import _compat  # noqa: F401  (NumPy 2.5 alias before numba.cuda is imported)
from numba import cuda
from numba.core.extending import register_jitable
from numba.cuda.extending import intrinsic

from . import _llvm, _shared

WARP = 32
_FULL_MASK = 0xFFFFFFFF


@register_jitable
def _shfl_xor(value, offset):
    return cuda.shfl_xor_sync(_FULL_MASK, value, offset)


def build():
    compiled = _llvm.define(intrinsic)
    shared = _shared.build(register_jitable, compiled["f32_as_u32"], compiled["u32_as_f32"],
                           _shfl_xor)
    return SimpleNamespace(name="cuda", warp=WARP, gpu=cuda, jitable=register_jitable,
                           **compiled, **vars(shared))
