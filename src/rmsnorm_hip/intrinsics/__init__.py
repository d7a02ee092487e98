"""The device-intrinsics layer: everything a kernel may call besides plain arithmetic.

One namespace per backend (``cuda``, ``hip``, ``sim``, ``cpu``), all exposing the same names, built
by :func:`load`.  Kernel modules receive a namespace and never import a vendor module themselves.

Names every GPU namespace provides
----------------------------------
``name``, ``warp``                backend name and wavefront/warp width (32 NVIDIA, 64 AMD)
``gpu``                           threadIdx / blockIdx / blockDim / gridDim, ``shared.array``,
                                  ``local.array``, ``syncthreads`` (numba.cuda / numba.hip / a
                                  simulator proxy)
``jitable``                       decorator for device helpers shared by every backend
``f32_as_u32``, ``u32_as_f32``     bit casts
``bf16_to_f32``, ``f32_to_bf16``,  16-bit float codecs on ``uint16`` bits, round-to-nearest-even,
``f16_to_f32``, ``f32_to_f16``     NaN kept NaN
``pack_bf16x2``, ``pack_f16x2``  two float32 -> one uint32 of two 16-bit floats (lo in bits 0-15),
                                  round-to-nearest-even (NaN stays NaN; its bits may differ by backend)
``load_b128``, ``store_b128``      16-byte global access at element ``i`` of a pointer: 4 x uint32
``warp_sum``, ``warp_max``         xor-butterfly over ``width`` contiguous lanes (width a power of
                                  two <= warp), every lane gets the result
``atomic_add_f32``                 float32 atomic add at ``ptr[i]``
"""
import functools


@functools.lru_cache(maxsize=None)
def load(name, warp=None):
    """The intrinsics namespace of backend ``name`` (``warp`` only for the simulator)."""
    if name == "cuda":
        from . import cuda
        return cuda.build()
    if name == "sim":
        from . import sim
        return sim.build(warp or 32)
    if name == "hip":
        from . import hip
        return hip.build()
    if name == "cpu":
        from . import cpu
        return cpu.build()
    raise ValueError(f"unknown backend {name!r}")
