"""Simulator intrinsics: the numba-cuda simulator (``NUMBA_ENABLE_CUDASIM=1``) runs kernels as Python
threads, one OS thread per GPU thread.  It has no warp shuffles, so ``shfl_xor`` is emulated here
with a barrier per warp; the warp width is a parameter, so the AMD 64-lane wavefront logic runs on
the CPU too.  Shuffles assume warp-uniform control flow, which is how the kernels use them.
"""
import sys
import threading
from types import SimpleNamespace

import numpy as np
from numba import float32
from numba import types as numba_types
from numba.np import numpy_support

from . import _shared

_lock = threading.Lock()


def _kernel_module():
    from numba.cuda.simulator import kernel
    return kernel._get_kernel_context()


class _SimGpu:
    """Stands for ``numba.cuda`` inside kernels: resolves to the running launch's fake module."""

    def __getattr__(self, name):
        return getattr(_kernel_module(), name)


def _poison_shared_memory():
    """The simulator's shared arrays start as np.empty (often zeros); real shared memory holds
    whatever the last block left.  Fill each new allocation with 0xA5 bytes (a nonzero integer,
    a finite negative float32) so a kernel that reads shared memory before writing it fails here
    too.  Allocations stay keyed by the kernel's call site, as in numba's own method."""
    from numba.cuda.simulator import kernelapi
    shared = kernelapi.FakeCUDAShared
    if getattr(shared.array, "_rmsnorm_hip_poisoned", False):
        return
    original = shared.array

    def array(self, shape, dtype, alignment=None):
        # alignment (kernels ask 16 bytes for vector reads of shared memory, which the simulator
        # reads element by element): numba's simulator refuses it, so it is not passed on
        if shape == 0:
            return original(self, shape, dtype)
        if isinstance(dtype, numba_types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        res = self._allocations.get(caller)
        if res is None:
            res = np.empty(shape, dtype)
            res.view(np.uint8)[...] = 0xA5
            res = self._allocations.setdefault(caller, res)
        return res

    array._rmsnorm_hip_poisoned = True
    shared.array = array


def _identity(fn=None, **_options):
    return fn if fn is not None else _identity


def f32_as_u32(value):
    return np.float32(value).view(np.uint32)


def u32_as_f32(value):
    return np.uint32(value).view(np.float32)


def fma(a, b, c):
    # float32 a * b is exact in float64; the sum then rounds twice (to float64, to float32),
    # which differs from one rounding only in rare ties: the simulator tests logic, not bits
    return np.float32(np.float64(np.float32(a)) * np.float64(np.float32(b)) + np.float64(c))


def max_abs(acc, value):
    return np.fmax(np.float32(acc), np.abs(np.float32(value)))


def max_abs_nan(acc, value):
    return np.maximum(np.float32(acc), np.abs(np.float32(value)))   # NaN wins


def _address(ptr, idx):
    """The host address of element ``idx`` of a kernel's flat array (the simulator's pointer)."""
    return ptr.__array_interface__["data"][0] + int(idx) * ptr.dtype.itemsize


def _check_aligned(ptr, idx, nbytes=16):
    # as the hardware requires: an access of nbytes at an address that is a multiple of nbytes
    # (the flat arrays are views of the caller's memory from its first element, so a row-strided
    # or offset array's accesses are checked where they really fall)
    if _address(ptr, idx) % nbytes:
        raise AssertionError(f"misaligned {8 * nbytes}-bit access at element {idx} of a "
                             f"{ptr.dtype} array")
    if not (0 <= int(idx) and int(idx) + nbytes // ptr.dtype.itemsize <= ptr.size):
        raise AssertionError(f"{8 * nbytes}-bit access at element {idx} outside a "
                             f"{ptr.size}-element {ptr.dtype} array")


def align_offset(ptr, idx):
    return np.int32(_address(ptr, idx) % 16)


def load_b128(ptr, idx):
    _check_aligned(ptr, idx)
    per_word = 4 // ptr.dtype.itemsize if ptr.dtype.itemsize < 4 else 1
    elems = np.array([ptr[idx + k] for k in range(4 * per_word)], dtype=ptr.dtype)
    words = elems.view(np.uint32)
    return words[0], words[1], words[2], words[3]


def _store_words(ptr, idx, words):
    _check_aligned(ptr, idx, 4 * len(words))
    elems = np.array(words, dtype=np.uint32).view(ptr.dtype)
    for k in range(elems.size):
        ptr[idx + k] = elems[k]


def store_b128(ptr, idx, w0, w1, w2, w3):
    _store_words(ptr, idx, [w0, w1, w2, w3])


def store_b64(ptr, idx, w0, w1):
    _store_words(ptr, idx, [w0, w1])


def store_b32(ptr, idx, w0):
    _store_words(ptr, idx, [w0])


def atomic_add_f32(ptr, idx, value):
    with _lock:
        ptr[idx] = float32(ptr[idx] + float32(value))


def atomic_add_f32x4(ptr, idx, a, b, c, d):
    for k, value in enumerate((a, b, c, d)):
        atomic_add_f32(ptr, idx + k, value)


def row_barrier(group, threads):
    # the simulator's barrier is the block's: callers keep the count uniform across row groups
    _kernel_module().syncthreads()


def _make_shfl_xor(warp):
    def warp_state():
        thread = threading.current_thread()
        manager = thread._manager
        warp_id, lane = divmod(thread.thread_id, warp)
        states = manager.__dict__.setdefault("_rmsnorm_warps", {})
        state = states.get(warp_id)
        if state is None:
            with _lock:
                state = states.get(warp_id)
                if state is None:
                    bx, by, bz = (tuple(manager._block_dim) + (1, 1))[:3]
                    lanes = min(warp, bx * by * bz - warp_id * warp)
                    state = (threading.Barrier(lanes, timeout=300), [None] * warp)
                    states[warp_id] = state
        return state[0], state[1], lane

    def shfl_xor(value, offset):
        barrier, slots, lane = warp_state()
        slots[lane] = value
        barrier.wait()
        src = lane ^ int(offset)
        out = slots[src] if src < barrier.parties else value
        barrier.wait()  # nobody overwrites a slot before every lane has read
        return out

    return shfl_xor


def build(warp):
    _poison_shared_memory()
    shared = _shared.build(_identity, f32_as_u32, u32_as_f32, _make_shfl_xor(warp))
    return SimpleNamespace(name="sim", warp=warp, shared_alignment=16,
                           gpu=_SimGpu(), jitable=_identity,
                           f32_as_u32=f32_as_u32, u32_as_f32=u32_as_f32, load_b128=load_b128, fma=fma,
                           align_offset=align_offset,
                           max_abs=max_abs, max_abs_nan=max_abs_nan,
                           store_b128=store_b128, store_b64=store_b64, store_b32=store_b32,
                           atomic_add_f32=atomic_add_f32, atomic_add_f32x4=atomic_add_f32x4,
                           row_barrier=row_barrier,
                           # a cache hint changes where lines go, not what is read
                           load_b128_stream=load_b128, **vars(shared))
