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
``shared_alignment``              the byte alignment ``gpu.shared.array`` can be asked for (16),
                                  or None where it takes none (numba-hip 0.2.1: the element's)
``f32_as_u32``, ``u32_as_f32``     bit casts
``bf16_to_f32``, ``f32_to_bf16``,  16-bit float codecs on ``uint16`` bits, round-to-nearest-even,
``f16_to_f32``, ``f32_to_f16``     NaN kept NaN
``pack_bf16x2``, ``pack_f16x2``  two float32 -> one uint32 of two 16-bit floats (lo in bits
                                  0-15), round-to-nearest-even (NaN stays NaN; its bits may
                                  differ by backend)
``add_bf16x2``, ``add_f16x2``      two uint32 words of two 16-bit floats each -> the word of the
                                  elementwise sums, each the exact sum rounded once to nearest
                                  even (the fused add's h; CUDA: one packed instruction a word,
                                  the float32 form's words elsewhere)
``f32_to_i8``, ``f32_to_e4m3``     8-bit quantised levels: int8 (an int32 in [-127, 127]) and
                                  float8 e4m3fn bits (uint32), round-to-nearest-even, saturating
                                  (+-127 / +-448); NaN -> 0 (int8) / NaN (e4m3fn).  CUDA's int8
                                  saturates at -128 for inputs below -127.5, which the quantiser
                                  never passes
``load_b128``, ``store_b128``      16-byte global access at element ``i`` of a pointer: 4 x uint32
``load_b128_stream``               load_b128 of data read once (CUDA: ``ld.global.cs``, the lines
                                  evict-first; plain elsewhere).  No memory clobber: only for
                                  memory the kernel never writes
``store_b64``, ``store_b32``       8- / 4-byte global store of 2 / 1 uint32 (aligned to its size)
``max_nan``                       max of two floats where a NaN wins (CUDA: one ``max.NaN.f32``)
``max_abs``                       maxnum(acc, |v|): a running max|v| that ignores NaN
``max_abs_nan`` (cuda, sim only)  max(acc, |v|) where a NaN wins, in one instruction: with it
                                  the quantiser rounds int8 levels by one fma (kernels/_rowops)
``f32_to_e2m1``                    float4 e2m1 bits (uint32, low nibble), round-to-nearest-even,
                                  saturating to +-6, NaN -> +-6 (MX says NaN in the scale)
``pack_e4m3x2``                    two float32 -> two e4m3fn levels in one uint32 (lo in bits 0-7)
``mx_pack_e2m1x2``,                OCP MX element pairs: two float32 already in units of the block
``mx_pack_e4m3x2``                 scale -> two e2m1 nibbles (lo in bits 0-3, hi in 4-7; rne,
                                  saturating to +-6) / two e4m3fn bytes (lo in bits 0-7; rne,
                                  saturating to +-448).  The shared encoders everywhere but
                                  gfx950 (feature ``mx_hw_convert``: v_cvt_scalef32_pk_*), where
                                  NaN gives -6 / -448 (its block's scale byte says NaN anyway).
                                  CUDA (sm_90) computes e2m1 pairs in 16-bit halves: the same
                                  codes for finite inputs, NaN -> +-6 of either sign
``mx_pack_e2m1x8``                 eight float32 as above -> eight e2m1 nibbles in one uint32
                                  (element i in bits 4i to 4i + 3)
``warp_sum``, ``warp_max``         xor-butterfly over ``width`` contiguous lanes (width a power of
                                  two <= warp), every lane gets the result (warp_max: NaN wins)
``sigmoid``                       float32 1 / (1 + exp(-v)): on GPUs from the hardware's
                                  approximate exp2 and reciprocal (a few ulp + |v| * 6e-8
                                  relative; _llvm.define_fast_math), elsewhere exactly
                                  rounded
``rsqrt``                         float32 1 / sqrt(v), a row's rstd: on GPUs the hardware's
                                  reciprocal square root (within 2 ulp; _llvm.define_fast_math),
                                  elsewhere sqrt and division, each rounded
``shfl_xor(value, lanes)``         float32 ``value`` of lane ``lane ^ lanes``, every lane of the
                                  warp taking part (the CPU's: its own value)
``atomic_add_f32``                 float32 atomic add at ``ptr[i]`` (no result; CUDA: PTX ``red``)
``atomic_add_f32x4``               four at ``ptr[i:i + 4]``, 16-byte aligned (CUDA: one
                                  ``red.global.add.v4.f32``, sm_90; four adds elsewhere)
``wait_prior_grids()``,            programmatic dependent launch (CUDA sm_90: PTX
``release_dependents()``           ``griddepcontrol``): wait for the kernel before this one in
                                  the stream before reading its outputs; let the next one start.
                                  No-ops elsewhere, and wherever the launch did not ask for it
``prefetch_l2(ptr, i)``             ask the L2 for the line holding ``ptr[i]`` (CUDA: PTX
                                  ``prefetch.global.L2``; no-op elsewhere): a hint, never a read
``row_barrier(group, threads)``    a barrier of one row group's ``threads`` threads (CUDA: named
                                  barrier 1 + group); the whole block where there are no named
                                  barriers (AMD, the simulator): every group must then pass it
                                  as many times

The declaration below is checked whenever a namespace is built (``load``): a backend that lacks
a declared name, or has one nobody declared, fails there rather than in a kernel.
"""
import functools

# what every namespace provides, the CPU's included (a CPU "row" is one thread: its warp_sum is
# the identity)
COMMON = frozenset({
    "name", "warp", "gpu", "jitable", "features", "fma", "f32_as_u32", "u32_as_f32",
    "bf16_to_f32", "f32_to_bf16", "f16_to_f32", "f32_to_f16", "pack_bf16x2", "pack_f16x2",
    "add_bf16x2", "add_f16x2",
    "f32_to_i8", "f32_to_e4m3", "f32_to_e2m1", "pack_e4m3x2", "mx_pack_e2m1x2", "mx_pack_e2m1x8",
    "mx_pack_e4m3x2",
    "max_nan", "warp_sum", "warp_max", "shfl_xor", "sigmoid", "rsqrt"})
# what every GPU namespace adds
GPU = COMMON | frozenset({
    "shared_alignment", "align_offset", "load_b128", "load_b128_stream", "store_b128",
    "store_b64", "store_b32", "max_abs", "atomic_add_f32", "atomic_add_f32x4", "row_barrier",
    "wait_prior_grids", "release_dependents", "prefetch_l2"})
# optional capabilities a namespace lists in ``features``, with the names each brings
FEATURES = {
    "gpu": GPU - COMMON,            # 128-bit and aligned accesses, barriers, atomics, launches
    "max_abs_nan": frozenset({"max_abs_nan"}),  # NaN-propagating max|v| in one instruction
    "mx_hw_convert": frozenset(),   # mx_pack_* are the hardware's scaled conversions (gfx950)
}
# AMD arches whose namespace converts MX elements in hardware: LLVM also selects those
# instructions for gfx942, where they are illegal, so the arch is chosen here, per build
MX_HW_ARCHS = frozenset({"gfx950"})


def check(namespace):
    """``namespace`` if it provides exactly the declared names for its ``features``, else a
    TypeError listing the missing and the undeclared ones."""
    features = namespace.features
    unknown = set(features) - set(FEATURES)
    expected = set(COMMON).union(*(FEATURES[f] for f in features if f in FEATURES))
    names = set(vars(namespace))
    if unknown or names != expected:
        raise TypeError(f"intrinsics {namespace.name!r}: missing {sorted(expected - names)}, "
                        f"undeclared {sorted(names - expected)}, unknown features "
                        f"{sorted(unknown)}")
    return namespace


@functools.lru_cache(maxsize=None)
def load(name, warp=None, arch=None):
    """The intrinsics namespace of backend ``name`` (``warp`` only for the simulator; ``arch``
    only for AMD: an arch of MX_HW_ARCHS gets its own namespace, any other the generic one).
    Code built with an arch's namespace is for that arch alone."""
    if name == "cuda":
        from . import cuda
        return check(cuda.build())
    if name == "sim":
        from . import sim
        return check(sim.build(warp or 32))
    if name == "hip":
        if arch is not None and arch not in MX_HW_ARCHS:
            return load("hip")      # the same object: its kernels share their helpers
        from . import hip
        return check(hip.build(arch))
    if name == "cpu":
        from . import cpu
        return check(cpu.build())
    raise ValueError(f"unknown backend {name!r}")
