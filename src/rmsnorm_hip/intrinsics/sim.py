"""Simulator intrinsics: the numba-cuda simulator (``NUMBA_ENABLE_CUDASIM=1``) runs kernels as
Python threads, one OS thread per GPU thread.  It has no warp shuffles, so ``shfl_xor`` is
emulated here with a barrier per warp; the warp width is a parameter, so the AMD 64-lane
wavefront logic runs on the CPU too.  Shuffles assume warp-uniform control flow, which is how the
kernels use them.
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


class _BlockBarrier:
    """syncthreads for one simulated block: the last live thread to arrive releases the others.
    A thread that returns leaves the count (as in numba's simulator, whose barrier waits for the
    threads still running); one that raises aborts the block, so that no thread waits forever."""

    def __init__(self, parties):
        self._cond = threading.Condition()
        self._live = parties
        self._waiting = 0
        self._generation = 0
        self._aborted = False

    def _release(self):
        self._waiting = 0
        self._generation += 1
        self._cond.notify_all()

    def wait(self):
        with self._cond:
            if self._aborted:
                raise RuntimeError("abort flag set on syncthreads call")
            generation = self._generation
            self._waiting += 1
            if self._waiting == self._live:
                self._release()
            while generation == self._generation and not self._aborted:
                self._cond.wait()
            if self._aborted:
                raise RuntimeError("abort flag set on syncthreads clear")

    def leave(self, failed):
        with self._cond:
            self._live -= 1
            if failed:
                self._aborted = True
                self._cond.notify_all()
            elif self._live and self._waiting == self._live:
                self._release()


def _event_driven_blocks():
    """numba's simulator runs a block's threads under a manager thread that polls every thread's
    flags in a loop, holding the interpreter lock the threads need: replace it with a barrier
    that wakes threads when the last one arrives (the same semantics, a fraction of the time)."""
    from numba.cuda.simulator import kernel
    manager = kernel.BlockManager
    if getattr(manager.run, "_rmsnorm_hip_events", False):
        return

    def run(self, grid_point, *args):
        barrier = self._rmsnorm_barrier = _BlockBarrier(int(np.prod(self._block_dim)))
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            def target():
                failed = True
                try:
                    self._f(*args)
                    failed = False
                finally:
                    barrier.leave(failed)
            thread = kernel.BlockThread(target, self, grid_point, block_point, self._debug)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        for thread in threads:
            if thread.exception and "abort flag" not in str(thread.exception[0]):
                raise thread.exception[0].with_traceback(thread.exception[1])
        for thread in threads:
            if thread.exception:
                raise thread.exception[0].with_traceback(thread.exception[1])

    def syncthreads(self):
        self._manager._rmsnorm_barrier.wait()

    run._rmsnorm_hip_events = True
    manager.run = run
    kernel.BlockThread.syncthreads = syncthreads


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


def no_grid_dependency():
    # the simulator runs one kernel at a time: nothing to wait for or release
    pass


def no_prefetch(ptr, idx):
    # a cache hint: nothing to simulate (the index is not even checked, as on the GPU)
    pass


def _warp_state(warp, name, make):
    """(the state ``name`` of the running thread's warp, its lane): ``make(lanes)`` builds it once
    per warp of the running block (a block's last warp may be partial)."""
    thread = threading.current_thread()
    manager = thread._manager
    warp_id, lane = divmod(thread.thread_id, warp)
    states = manager.__dict__.setdefault(name, {})
    state = states.get(warp_id)
    if state is None:
        with _lock:
            state = states.get(warp_id)
            if state is None:
                bx, by, bz = (tuple(manager._block_dim) + (1, 1))[:3]
                state = states[warp_id] = make(min(warp, bx * by * bz - warp_id * warp))
    return state, lane


def _make_shfl_xor(warp):
    def make(lanes):
        return threading.Barrier(lanes, timeout=300), [None] * warp

    def shfl_xor(value, offset):
        (barrier, slots), lane = _warp_state(warp, "_rmsnorm_warps", make)
        slots[lane] = value
        barrier.wait()
        src = lane ^ int(offset)
        out = slots[src] if src < barrier.parties else value
        barrier.wait()  # nobody overwrites a slot before every lane has read
        return out

    return shfl_xor


def _make_warp_reductions(warp, max_nan):
    """warp_sum / warp_max with the xor butterfly's exact order (lane l adds lane l ^ offset's
    value to its own, offsets width / 2 ... 1), computed for the whole warp by the last lane to
    arrive: two barriers a reduction instead of two a shuffle step."""
    def butterfly(state):
        values, width, combine = state["values"], state["width"], state["combine"]
        lanes = len(values)
        offset = width >> 1
        while offset > 0:
            values = [combine(values[lane], values[lane ^ offset] if lane ^ offset < lanes
                              else values[lane]) for lane in range(lanes)]
            offset >>= 1
        state["results"] = values

    def make(lanes):
        state = {"values": [None] * lanes}
        state["barrier"] = threading.Barrier(lanes, action=lambda: butterfly(state), timeout=300)
        return state

    def warp_state():
        return _warp_state(warp, "_rmsnorm_warp_reductions", make)

    def reduce(value, width, combine):
        state, lane = warp_state()
        state["values"][lane] = value
        state["width"], state["combine"] = int(width), combine
        state["barrier"].wait()
        out = state["results"][lane]
        state["barrier"].wait()       # nobody starts the next reduction before every lane read
        return out

    def warp_sum(value, width):
        return reduce(value, width, lambda a, b: a + b)

    def warp_max(value, width):
        return reduce(value, width, max_nan)

    return warp_sum, warp_max


def f32_to_i8(value):
    """CUDA's ``cvt.rni.sat.s8.f32``, -128 included (the portable encoder stops at -127): a
    kernel that lets a product of -127.5 or less reach it fails here as on the GPU."""
    v = float(np.float32(value))
    if v != v:
        return np.int32(0)
    return np.int32(min(127.0, max(-128.0, np.rint(v))))


def sigmoid(value):
    """float32 1 / (1 + exp(-v)), exactly rounded (GPUs approximate it: intrinsics/_llvm.py);
    exp overflowing to inf gives 0, as there."""
    with np.errstate(over="ignore"):
        e = np.exp(-np.float32(value))
    return np.float32(np.float32(1.0) / (np.float32(1.0) + e))


def build(warp):
    _poison_shared_memory()
    _event_driven_blocks()
    shared = _shared.build(_identity, f32_as_u32, u32_as_f32, _make_shfl_xor(warp))
    shared.warp_sum, shared.warp_max = _make_warp_reductions(warp, shared.max_nan)
    shared.f32_to_i8 = f32_to_i8
    shared.sigmoid = sigmoid
    vars(shared).update(_shared.make_add_pairs(_identity, vars(shared)))
    return SimpleNamespace(features=frozenset({"gpu", "max_abs_nan"}), name="sim", warp=warp,
                           shared_alignment=16, gpu=_SimGpu(), jitable=_identity,
                           f32_as_u32=f32_as_u32, u32_as_f32=u32_as_f32, load_b128=load_b128,
                           fma=fma,
                           align_offset=align_offset,
                           max_abs=max_abs, max_abs_nan=max_abs_nan,
                           store_b128=store_b128, store_b64=store_b64, store_b32=store_b32,
                           atomic_add_f32=atomic_add_f32, atomic_add_f32x4=atomic_add_f32x4,
                           row_barrier=row_barrier, wait_prior_grids=no_grid_dependency,
                           release_dependents=no_grid_dependency, prefetch_l2=no_prefetch,
                           # a cache hint changes where lines go, not what is read
                           load_b128_stream=load_b128, **vars(shared))
