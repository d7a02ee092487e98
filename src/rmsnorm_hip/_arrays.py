"""What the library knows about an array argument, whatever library it came from.

:func:`describe` turns a NumPy / torch / CuPy array, a ``__cuda_array_interface__`` object or a
DLPack object into an :class:`ArrayInfo` (pointer, shape, element strides, dtype name, device), with
no copy.  :func:`empty` allocates an output in the caller's library on the caller's device, and
:func:`current_stream` finds the caller's current stream.  torch and CuPy are never imported here:
when a tensor of theirs arrives, their module is already in ``sys.modules``.
"""
import ctypes
import importlib
import sys
from dataclasses import dataclass

import numpy as np

from . import _dtypes

CPU, CUDA, ROCM = "cpu", "cuda", "rocm"
_DLPACK_DEVICES = {1: CPU, 3: CPU, 2: CUDA, 10: ROCM}


@dataclass
class ArrayInfo:
    obj: object             # what the caller passed
    lib: str                # "numpy" | "torch" | "cupy" | "cai" | "dlpack"
    ptr: int
    shape: tuple
    strides: tuple          # in elements
    dtype: str              # library dtype name (see _dtypes), or the foreign name
    device: str             # "cpu" | "cuda" | "rocm"
    device_index: int
    host: np.ndarray = None  # host memory: a NumPy view in the storage dtype
    wrap: object = None     # turns a finished output into the caller's library (DLPack callers)
    readonly: bool = False
    numpy: np.ndarray = None  # host memory as the caller's NumPy dtype sees it
    bits16: bool = False    # a 16-bit float passed as uint16 storage with dtype=: outputs alike

    def result(self):
        return self.wrap(self.obj) if self.wrap is not None else self.obj

    @property
    def itemsize(self):
        return _dtypes.ITEMSIZE.get(self.dtype, 0)

    def extent_bytes(self):
        """Bytes from ptr to one past the last element (strides are non-negative here)."""
        if any(d == 0 for d in self.shape):
            return 0
        last = sum((d - 1) * s for d, s in zip(self.shape, self.strides))
        return (last + 1) * max(self.itemsize, 1)


def _torch():
    return sys.modules.get("torch")


def _cupy():
    return sys.modules.get("cupy")


def describe(obj, name, reinterpret=None, fn="rmsnorm_hip"):
    """ArrayInfo of ``obj``; ``reinterpret`` ("bfloat16"/"float16") reads uint16 storage as that.
    ``fn`` names the calling entry point in errors."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _describe_torch(obj, torch, reinterpret, name, fn)
    if isinstance(obj, np.ndarray):
        return _describe_numpy(obj, obj, "numpy", reinterpret)
    cupy = _cupy()
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return _from_cai(obj, "cupy", obj.__cuda_array_interface__, obj.device.id, reinterpret)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, "cai", obj.__cuda_array_interface__, None, reinterpret)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _describe_dlpack(obj, reinterpret, name, fn)
    raise TypeError(f"{fn}: {name} must be a NumPy, CuPy or torch array, a "
                    f"__cuda_array_interface__ or DLPack object, got "
                    f"{type(obj).__module__}.{type(obj).__qualname__}")


def _describe_numpy(arr, obj, lib, reinterpret):
    name = _dtypes.name_of_numpy(arr.dtype, reinterpret)
    itemsize = arr.dtype.itemsize
    strides = tuple(s // itemsize if s % itemsize == 0 else s / itemsize for s in arr.strides)
    host = arr.view(_dtypes.STORAGE[name]) if name in _dtypes.STORAGE else arr
    return ArrayInfo(obj, lib, arr.__array_interface__["data"][0], tuple(arr.shape), strides,
                     name, CPU, -1, host, readonly=not arr.flags.writeable, numpy=arr,
                     bits16=arr.dtype == np.uint16 and name in _dtypes.HALF_DTYPES)


_TORCH_NAMES = {}


def _torch_dtype_name(dtype, torch):
    if not _TORCH_NAMES:
        for n in ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn"):
            _TORCH_NAMES[getattr(torch, n)] = n
    return _TORCH_NAMES.get(dtype) or str(dtype).replace("torch.", "")


def _describe_torch(t, torch, reinterpret, arg="x", fn="rmsnorm_hip"):
    name = _torch_dtype_name(t.dtype, torch)
    bits16 = name == "uint16" and reinterpret in _dtypes.HALF_DTYPES
    if bits16:
        name = reinterpret
    if t.is_neg() or t.is_conj():
        # a lazy view (torch._neg_view, .conj().imag): its memory holds the values unnegated
        raise ValueError(f"{fn}: {arg} is a torch view with the negative or conjugate bit set, "
                         f"whose memory does not hold its values; pass {arg}.resolve_neg() "
                         f"(or .resolve_conj())")
    dev = t.device
    if dev.type not in ("cpu", "cuda"):   # ROCm torch calls its devices "cuda" too
        raise ValueError(f"{fn}: {arg} must be on a CPU, CUDA or ROCm device, got torch device "
                         f"{dev}")
    if dev.type == "cpu":
        host = None
        if name in _dtypes.STORAGE:
            storage = _dtypes.STORAGE[name]
            view = t.detach()
            if storage.itemsize == 2 and name != "uint16":
                view = view.view(torch.int16)
            elif storage == np.uint8:
                view = view.view(torch.uint8)
            # through DLPack, not Tensor.numpy(): numpy() marks the tensor's storage as not
            # resizable for good, and FSDP frees an unsharded parameter by resizing its
            # storage to 0 ("Trying to resize storage that is not resizable")
            host = np.from_dlpack(view).view(storage)
        return ArrayInfo(t, "torch", t.data_ptr(), tuple(t.shape), tuple(t.stride()), name, CPU,
                         -1, host, bits16=bits16)
    kind = ROCM if getattr(torch.version, "hip", None) else CUDA
    return ArrayInfo(t, "torch", t.data_ptr(), tuple(t.shape), tuple(t.stride()), name, kind,
                     dev.index if dev.index is not None else torch.cuda.current_device(),
                     bits16=bits16)


_TYPESTR = {"<f4": "float32", "<f2": "float16", "<u2": "uint16", "|i1": "int8", "|u1": "uint8",
            "<f8": "float64", "<i4": "int32", "<i8": "int64", "|b1": "bool"}


def _from_cai(obj, lib, cai, device_index, reinterpret):
    """``reinterpret``: the library dtype the storage holds (a caller's dtype= for uint16, or the
    dtype :func:`empty` allocated, e.g. float8_e4m3fn in uint8)."""
    name = _TYPESTR.get(cai["typestr"], cai["typestr"])
    storage = _dtypes.STORAGE.get(reinterpret)
    bits16 = False
    if storage is not None and name == storage.name:
        bits16 = name == "uint16"
        name = reinterpret
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    if cai.get("strides") is None:
        strides = _contiguous(shape)
    else:
        strides = tuple(s // itemsize if s % itemsize == 0 else s / itemsize
                        for s in cai["strides"])
    ptr = cai["data"][0] or 0
    if device_index is None:
        device_index = _pointer_device(ptr)
    info = ArrayInfo(obj, lib, ptr, shape, strides, name, _cai_device_kind(lib, obj),
                     device_index, bits16=bits16)
    info.cai_stream = cai.get("stream")
    return info


def _cai_device_kind(lib, obj):
    """``__cuda_array_interface__`` is spoken by ROCm libraries too (CuPy-ROCm, numba-hip)."""
    cupy = _cupy()
    if lib == "cupy" and getattr(cupy.cuda.runtime, "is_hip", False):
        return ROCM
    if lib == "cai" and (_numba_gpu_module(obj) == "numba.hip" or (
            "numba.hip" in sys.modules and "numba.cuda" not in sys.modules)):
        return ROCM
    return CUDA


def _numba_gpu_module(obj):
    """"numba.hip" / "numba.cuda" for a device array of numba-hip / numba-cuda (numba-hip
    replicates numba.cuda's API under its own name), else None."""
    module = type(obj).__module__
    for name in ("numba.hip", "numba.cuda"):
        if module == name or module.startswith(name + "."):
            return name
    return None


def _pointer_device(ptr):
    """Device ordinal owning a CUDA pointer (0 when it cannot be asked)."""
    if not ptr:
        return 0
    try:
        from cuda.bindings import driver
        err, ordinal = driver.cuPointerGetAttribute(
            driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        return int(ordinal) if int(err) == 0 else 0
    except Exception:
        return 0


# DLPack C structs (dlpack.h v0.8+; the layout of DLTensor has not changed since v0.2)
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_NAMES = {(2, 32): "float32", (2, 16): "float16", (4, 16): "bfloat16", (0, 8): "int8",
             (1, 16): "uint16", (1, 8): "uint8", (2, 64): "float64", (0, 32): "int32",
             (0, 64): "int64", (6, 8): "bool", (1, 1): "bool"}

_get_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_capsule_pointer.restype = ctypes.c_void_p
_get_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _describe_dlpack(obj, reinterpret, arg="x", fn="rmsnorm_hip"):
    dev_type, dev_id = obj.__dlpack_device__()
    device = _DLPACK_DEVICES.get(int(dev_type))
    if device is None:
        raise ValueError(f"{fn}: {arg} must be on a CPU, CUDA or ROCm device (DLPack device type "
                         f"1, 2, 3 or 10), got DLPack device type {int(dev_type)}")
    if device == CPU:
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as error:
            arr = _host_dlpack_view(obj, error, arg, fn)    # bfloat16, which NumPy cannot import
        return _describe_numpy(arr, obj, "dlpack", reinterpret)
    capsule = obj.__dlpack__(stream=None)
    t, shape, strides = _dl_tensor(capsule)
    name = _DL_NAMES.get((t.dtype.code, t.dtype.bits), f"dlpack({t.dtype.code},{t.dtype.bits})")
    bits16 = name == "uint16" and reinterpret in _dtypes.HALF_DTYPES
    if bits16:
        name = reinterpret
    info = ArrayInfo(obj, "dlpack", (t.data or 0) + t.byte_offset, shape, strides, name, device,
                     int(dev_id), bits16=bits16)
    info.capsule = capsule
    return info


def _dl_tensor(capsule):
    """(DLTensor, shape, strides in elements) of an unversioned DLPack capsule.  The capsule
    owns a reference to the producer's memory while the struct is read; keep it with the view."""
    t = _DLTensor.from_address(_get_capsule_pointer(capsule, b"dltensor"))
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else _contiguous(shape)
    return t, shape, strides


# DLPack dtypes NumPy's from_dlpack refuses, read through the struct: (code, bits) -> NumPy dtype
_HOST_DL_DTYPES = {(4, 16): _dtypes.NUMPY[_dtypes.BFLOAT16]}


def _host_dlpack_view(obj, error, arg, fn):
    """A read-only NumPy view of a host DLPack tensor whose dtype NumPy's from_dlpack refuses
    (bfloat16: JAX or torch on the CPU), read from the DLPack struct; the view holds the
    capsule, which frees the producer's reference when the view goes.  Read-only as NumPy makes
    an unversioned import: such a capsule cannot say whether the memory may be written."""
    capsule = obj.__dlpack__()
    t, shape, strides = _dl_tensor(capsule)
    dtype = _HOST_DL_DTYPES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    if dtype is None:
        name = _DL_NAMES.get((t.dtype.code, t.dtype.bits))
        if name is not None and t.dtype.lanes == 1:     # a dtype NumPy reads: its own failure
            raise ValueError(f"{fn}: {arg} could not be read through DLPack ({error})") from None
        name = name or f"DLPack type code {t.dtype.code} of {t.dtype.bits} bits"
        raise TypeError(f"{fn}: {arg} must be a float32, float16 or bfloat16 array, got a host "
                        f"DLPack tensor of {name} ({error})") from None
    if any(s < 0 for s in strides):
        raise ValueError(f"{fn}: {arg} must have non-negative strides, got strides {strides}")
    extent = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    buffer = (ctypes.c_uint8 * (extent * dtype.itemsize)).from_address(
        (t.data or 0) + t.byte_offset) if extent else bytearray(0)
    flat = np.frombuffer(buffer, dtype)
    if extent:
        buffer.capsule = capsule
    return np.lib.stride_tricks.as_strided(flat, shape, tuple(s * dtype.itemsize for s in strides),
                                           writeable=False)


def bump_versions(*arrays):
    """Step torch's version counter of each torch tensor among ``arrays`` that a call wrote in
    place, as torch's own in-place ops do: autograd then refuses a backward that would read a
    saved tensor overwritten since, instead of computing a wrong gradient."""
    torch = _torch()
    if torch is None:
        return
    for a in arrays:
        if isinstance(a, torch.Tensor) and not a.is_inference():
            torch.autograd.graph.increment_version(a)


def current_stream(info):
    """The caller's current stream handle for ``info``'s library and device (0: legacy default)."""
    if info.lib == "torch":
        return _torch()._C._cuda_getCurrentRawStream(info.device_index)
    cupy = _cupy()
    if info.lib == "cai":
        stream = getattr(info, "cai_stream", None)
        if stream not in (None, 1, 2):
            return stream
    if cupy is not None:
        return cupy.cuda.get_current_stream().ptr
    return 0


def _torch_dtype(torch, dtype, bits16):
    return torch.uint16 if bits16 and dtype in _dtypes.HALF_DTYPES else getattr(torch, dtype)


def device_dtype(dtype, bits16=False):
    """The NumPy dtype of a CuPy / numba device output of library ``dtype``: float16 stays
    float16 (unless x came as uint16 storage: bits in, bits out), the dtypes they lack are
    bits."""
    return np.dtype(np.uint16) if bits16 and dtype in _dtypes.HALF_DTYPES else (
        _dtypes.DEVICE[dtype])


def empty(like, shape, dtype):
    """A new uninitialised array of ``shape`` / library ``dtype`` in ``like``'s library and device.
    Returns (array, ArrayInfo)."""
    lib = like.lib
    if like.device == CPU:
        if lib == "torch":
            torch = _torch()
            out = torch.empty(shape, dtype=_torch_dtype(torch, dtype, like.bits16))
            return out, describe(out, "out", dtype if like.bits16 else None)
        # like.numpy, not like.obj: a host DLPack object need not have a dtype
        storage_view = like.numpy.dtype == np.uint16 and dtype in _dtypes.HALF_DTYPES
        out = np.empty(shape, np.uint16 if storage_view else _dtypes.NUMPY[dtype])
        info = _describe_numpy(out, out, "numpy", dtype if storage_view else None)
        if lib == "dlpack":   # a host DLPack caller (JAX on the CPU) gets its own library back
            info.wrap = lambda done: _back_to_library(like.obj, done)
        return out, info
    if lib == "torch":
        torch = _torch()
        out = torch.empty(shape, dtype=_torch_dtype(torch, dtype, like.bits16),
                          device=like.obj.device)
        return out, ArrayInfo(out, "torch", out.data_ptr(), tuple(shape), _contiguous(shape),
                              dtype, like.device, like.device_index)
    numba_gpu = _numba_gpu_module(like.obj) if lib == "cai" else None
    if numba_gpu is not None:            # a numba-cuda or numba-hip caller gets its own arrays
        gpu = importlib.import_module(numba_gpu)
        with gpu.gpus[like.device_index]:
            out = gpu.device_array(shape, device_dtype(dtype, like.bits16))
        return out, _from_cai(out, "cai", out.__cuda_array_interface__, like.device_index, dtype)
    if lib == "cai" and simulated():
        out = SimulatedDeviceArray(np.empty(shape, device_dtype(dtype, like.bits16)))
        info = _from_cai(out, "cai", out.__cuda_array_interface__, like.device_index, dtype)
        info.host = out.array.view(_dtypes.STORAGE[dtype])
        return out, info
    cupy = _cupy()
    if cupy is None:
        try:
            import cupy
        except ImportError:
            raise TypeError(f"returning {lib} arrays needs CuPy (pip install 'rmsnorm-hip[cuda]')")
    with cupy.cuda.Device(like.device_index):
        out = cupy.empty(shape, device_dtype(dtype, like.bits16))
    info = _from_cai(out, "cupy", out.__cuda_array_interface__, like.device_index, dtype)
    if lib == "dlpack":
        info.wrap = lambda done: _back_to_library(like.obj, done)
    return out, info


def zeros(like, shape, dtype):
    """:func:`empty`, filled with zeros by the array's own library."""
    out, info = empty(like, shape, dtype)
    zero_fill(info)
    return out, info


def zero_fill(info):
    """Fill an array that :func:`empty` made with zeros, through its own library (on its
    current stream)."""
    out = info.obj
    if hasattr(out, "fill"):
        out.fill(0)                      # NumPy, CuPy
    elif hasattr(out, "zero_"):
        out.zero_()                      # torch
    else:                                # numba device arrays
        out.copy_to_device(np.zeros(info.shape, out.dtype))


def simulated():
    """Whether numba.cuda runs as the simulator in this process (its device memory is host
    memory)."""
    cuda = sys.modules.get("numba.cuda")
    return bool(cuda is not None and getattr(getattr(cuda, "config", None), "ENABLE_CUDASIM", 0))


def host_memory(info):
    """The host memory behind a simulated device array's pointer, from its first element to its
    last, in the storage dtype."""
    nbytes = max(info.extent_bytes(), _dtypes.ITEMSIZE[info.dtype])
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(info.ptr))
    return raw.view(_dtypes.STORAGE[info.dtype])


class SimulatedDeviceArray:
    """What a ``__cuda_array_interface__`` caller gets back when numba.cuda runs as the
    simulator (which has no device memory of its own): host memory behind the interface.  Only
    for testing kernel logic on a machine without a GPU; on a GPU such callers get CuPy arrays."""

    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = dict(
            shape=array.shape, typestr=array.dtype.str, version=3,
            strides=None if array.flags.c_contiguous else array.strides,
            data=(array.__array_interface__["data"][0], False))

    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: self.array.dtype)

    def fill(self, value):
        self.array.fill(value)

    def copy_to_host(self):
        return self.array.copy()


def _back_to_library(like, out):
    """A DLPack-speaking library's own array over ``out`` (a CuPy array, or a NumPy one for a
    host caller), e.g. JAX's; else ``out`` itself (a library with no ``from_dlpack``, or a
    bfloat16 / float8 NumPy output, which NumPy cannot export: JAX gets a copy of that one on
    x's device)."""
    root = type(like).__module__.split(".")[0]
    mod = sys.modules.get(root)
    # ml_dtypes' bfloat16 and float8 (NumPy kind "V"): NumPy exports them through no DLPack
    unexported = isinstance(out, np.ndarray) and out.dtype.kind == "V"
    if root in ("jax", "jaxlib"):
        import jax
        import jax.numpy as jnp
        if unexported:  # JAX reads ml_dtypes arrays: a copy, on x's device (not JAX's default)
            devices = like.devices() if hasattr(like, "devices") else ()
            return jax.device_put(out, next(iter(devices), None))
        return jnp.from_dlpack(out)
    from_dlpack = getattr(mod, "from_dlpack", None)
    return from_dlpack(out) if from_dlpack and not unexported else out


def _contiguous(shape):
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


# ---- the repeat-call fast path ------------------------------------------------------------------
# A call's validation and kernel choice depend on its arrays' metadata only, so they are done once
# per key (functional.py caches a runner under it); a repeat call then only reads pointers,
# allocates its outputs and launches.  torch and CuPy device arrays have a cheap key.

def fast_key(x, weight, flags, others=()):
    """Hashable key of a call's metadata (x, weight and the ``others`` arrays, each or None), or
    None when ``x`` has no fast path."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cuda:
            return None

        if not all(a is None or isinstance(a, torch.Tensor) for a in (weight,) + tuple(others)):
            return None                 # arrays of several libraries: the full path
        # a negative or conjugate view (lazy bits the full path refuses) keys apart
        def key_of(a):
            return None if a is None else (a.dtype, a.shape, a.stride(), a.get_device(),
                                           a.is_neg() or a.is_conj())
        return (key_of(x), key_of(weight), tuple(key_of(a) for a in others), flags)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        if not all(a is None or isinstance(a, cupy.ndarray) for a in (weight,) + tuple(others)):
            return None
        def key_of(a):
            return None if a is None else (a.dtype, a.shape, a.strides, a.device.id)
        return ("cupy", x.dtype, x.shape, x.strides, x.device.id, key_of(weight),
                tuple(key_of(a) for a in others), flags)
    return None


class FastIO:
    """Pointer reader, allocator and stream of one library, for runners built once per key."""

    def __init__(self, like):
        self.lib, self.device_index = like.lib, like.device_index
        if like.lib == "torch":
            torch = _torch()
            self.ptr = torch.Tensor.data_ptr
            raw_stream, index = torch._C._cuda_getCurrentRawStream, like.device_index
            self.stream = lambda: raw_stream(index)
            empty, device = torch.empty, like.obj.device
            self.allocator = lambda shape, dtype: (
                lambda tdtype=getattr(torch, dtype): empty(shape, dtype=tdtype, device=device))
            zeros = torch.zeros
            self.zeros_allocator = lambda shape, dtype: (
                lambda tdtype=getattr(torch, dtype): zeros(shape, dtype=tdtype, device=device))
        else:
            cupy = _cupy()
            self.ptr = lambda a: a.data.ptr
            self.stream = lambda: cupy.cuda.get_current_stream().ptr
            device = cupy.cuda.Device(like.device_index)

            def allocator_of(make):
                def allocator(shape, dtype):
                    storage = device_dtype(dtype)

                    def allocate():
                        with device:
                            return make(shape, storage)
                    return allocate
                return allocator
            self.allocator = allocator_of(cupy.empty)
            self.zeros_allocator = allocator_of(cupy.zeros)

    def like_allocator(self, shape, dtype, like_x):
        """``allocate(x)``: an output of ``shape`` and ``dtype``; ``like_x`` says x is contiguous
        with that shape and dtype, where torch's ``empty_like(x)`` takes half the host time of
        ``torch.empty(shape, dtype=, device=)``."""
        if self.lib == "torch" and like_x:
            return _torch().empty_like
        plain = self.allocator(shape, dtype)
        return lambda x: plain()
