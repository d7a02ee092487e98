"""NVIDIA backend: kernels compiled to PTX by numba-cuda, loaded once per device with the driver API
(cuda-python's ``cuda.bindings``) and launched with ``cuLaunchKernelEx`` on the caller's stream.
numba's per-call dispatcher (80-140 us a call) is never on the launch path.

``RMSNORM_HIP_PDL=1`` (sm_90 and later) launches the forward kernels with programmatic stream
serialization: such a kernel may start while the kernel before it in the stream finishes, and
waits for it (``griddepcontrol.wait``) before its first load.  In a CUDA graph of back-to-back
kernels that hides part of each launch."""
import ctypes
import json
import re
import threading
from contextlib import contextmanager
from types import SimpleNamespace

from .. import _compat  # noqa: F401
from .. import _diskcache, intrinsics
from ..kernels import _config
from ..kernels._sharing import share_helpers
from ._argpack import ArgPack
from ._gpu import GpuBackend

_compile_lock = threading.Lock()
_INVALID_CONTEXT = 201
_UNSUPPORTED_PTX_VERSION = 222


def _driver_ptx_version(driver_version):
    """A PTX ISA version every driver of that CUDA major reads (13.0 -> 9.0, 12.x -> 8.0)."""
    return "9.0" if driver_version >= 13000 else "8.0"


@contextmanager
def _targeting(cc):
    """numba-cuda asks the current device for its compute capability when it compiles device
    functions; answer with ``cc`` so that ahead-of-time builds need no GPU."""
    import numba.cuda.dispatcher as dispatcher
    with _compile_lock:
        original = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)
        try:
            yield
        finally:
            dispatcher.get_current_device = original


def compile_ptx(pyfunc, argtypes, cc, max_threads=None, min_blocks=None):
    """(ptx text, entry name) of a kernel for compute capability ``cc``, no GPU needed.
    ``max_threads``: the block size it is launched with, declared as ``.maxntid`` (CUDA's
    __launch_bounds__) so ptxas keeps registers within what such a block may use: without it a
    1024-thread block of a kernel given more than 64 registers fails to launch.  ``min_blocks``:
    blocks that must fit on one SM at once (``.minnctapersm``), which caps registers further."""
    from numba import cuda
    with _targeting(cc):
        ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=cc)
    entry = re.search(r"\.entry\s+([\w$]+)\s*\([^()]*\)\s*\{", ptx)
    if max_threads:
        bounds = f".maxntid {int(max_threads)}, 1, 1\n"
        if min_blocks:
            bounds += f".minnctapersm {int(min_blocks)}\n"
        ptx = f"{ptx[:entry.end() - 1]}{bounds}{ptx[entry.end() - 1:]}"
    return ptx, entry.group(1)


def variant_ptx(builder, spec, argtypes, cc, intr=None):
    """(ptx, entry) of the kernel ``builder(intr, spec)`` for compute capability ``cc``, with the
    launch bounds its spec declares; from the disk cache when it holds it."""
    key = (builder.__module__, builder.__name__, spec, tuple(map(str, argtypes)), tuple(cc))

    def build():
        pyfunc = share_helpers(builder(intr or intrinsics.load("cuda"), spec))
        return compile_ptx(pyfunc, argtypes, cc, *_config.launch_bounds(spec))
    return _diskcache.cached("ptx", key, build, encode=lambda r: json.dumps(r).encode(),
                             decode=lambda b: tuple(json.loads(b)))


def _check(result, what):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        from cuda.bindings import driver
        name = driver.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what} failed: {name.decode() if name else int(err)}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


PDL_ENV = "RMSNORM_HIP_PDL"
_PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig of cuLaunchKernelEx."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


def _ctypes_launcher():
    """``cuLaunchKernelEx`` of the driver library (the one cuda.bindings loaded: same soname,
    same handle) called through ctypes with a launch configuration built once per kernel, grid
    and block: a call sets the stream and passes four pointers.  cuda.bindings' Python wrapper
    converts its arguments into objects on every call (5.5 us per launch on the H200 host)."""
    c = ctypes
    launch = c.CDLL("libcuda.so.1").cuLaunchKernelEx
    launch.restype = c.c_int
    launch.argtypes = [c.c_void_p] * 4
    return launch


def pdl_requested():
    """Whether RMSNORM_HIP_PDL asks for programmatic dependent launch (read when a backend is
    made): "1" / "true" / "on" / "yes"."""
    import os
    value = os.environ.get(PDL_ENV, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{PDL_ENV} must be 1 or 0 (true / false, on / off), got {value!r}")


def _ctypes_current_context():
    """``cuCtxGetCurrent`` through ctypes (its argument: the address of a CUcontext slot)."""
    c = ctypes
    get = c.CDLL("libcuda.so.1").cuCtxGetCurrent
    get.restype = c.c_int
    get.argtypes = [c.c_void_p]
    return get


class CudaKernel:
    def __init__(self, function, argtypes, ptx, name, programmatic=False):
        self.function = function
        self.handle = int(function)
        self.resident = {}      # block threads -> blocks per SM (occupancy)
        self.args = ArgPack(argtypes)
        self.ptx = ptx
        self.name = name
        # launched with programmatic stream serialization (its code waits on prior grids)
        self.programmatic = programmatic
        self._configs = threading.local()

    def config(self, grid, block):
        """(this thread's launch configuration for grid x block, its address); the caller sets
        its stream."""
        configs = getattr(self._configs, "by_shape", None)
        if configs is None:
            configs = self._configs.by_shape = {}
        found = configs.get((grid, block))
        if found is None:
            config = _LaunchConfig()
            config.grid[:] = grid
            config.block[:] = block
            if self.programmatic:
                attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
                attribute.value[0] = 1
                config.attrs = ctypes.addressof(attribute)
                config.num_attrs = 1
                config._attribute = attribute       # kept alive with the configuration
            found = configs[(grid, block)] = (config, ctypes.addressof(config))
        return found

    def attributes(self):
        """Registers, local (spill) bytes and static shared memory of the loaded kernel."""
        from cuda.bindings import driver
        a = driver.CUfunction_attribute

        def get(attr):
            return _check(driver.cuFuncGetAttribute(attr, self.function), "cuFuncGetAttribute")
        return dict(registers=get(a.CU_FUNC_ATTRIBUTE_NUM_REGS),
                    local_bytes=get(a.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
                    shared_bytes=get(a.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
                    max_threads=get(a.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK))


class CudaBackend(GpuBackend):
    name = "cuda"

    def __init__(self, device_index):
        from cuda.bindings import driver
        self._driver = driver
        _check(driver.cuInit(0), "cuInit")
        self.device_index = device_index
        self._device = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        attr = driver.CUdevice_attribute
        major = _check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._device),
            "cuDeviceGetAttribute")
        minor = _check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._device),
            "cuDeviceGetAttribute")
        self.cc = (major, minor)
        self.arch = f"sm_{major}{minor}"
        self.sm_count = _check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._device), "cuDeviceGetAttribute")
        self._context = _check(driver.cuDevicePrimaryCtxRetain(self._device),
                               "cuDevicePrimaryCtxRetain")
        self._context_id = int(self._context)
        self._launch = _ctypes_launcher()
        # A function and a stream of this device's context launched while another device's
        # context is current (tensors on cuda:1, cuda:0 current in torch / CuPy) fail with
        # CUDA_ERROR_INVALID_HANDLE, so with several devices each launch checks the current
        # context (~0.1 us through ctypes) and makes this one current around it if needed.
        # With one device its primary context is the only one: no check.
        self._single_device = _check(driver.cuDeviceGetCount(), "cuDeviceGetCount") == 1
        self._get_current = _ctypes_current_context()
        self._slots = threading.local()     # per thread: a CUcontext slot and its address
        # programmatic dependent launch needs sm_90; the kernels' waits are no-ops below it
        self.pdl = pdl_requested() and self.cc >= (9, 0)
        super().__init__(intrinsics.load("cuda"))

    @property
    def cache_key(self):
        return (self.name, self.arch, self.device_index, self.pdl)

    @contextmanager
    def current(self):
        """This device's primary context, current for the block; the caller's is restored."""
        driver = self._driver
        if int(_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")) == self._context_id:
            yield
            return
        _check(driver.cuCtxPushCurrent(self._context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            _check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def compile(self, builder, spec, argtypes):
        # the driver keeps its own cache of the PTX's machine code (~/.nv/ComputeCache)
        ptx, entry = variant_ptx(builder, spec, argtypes, self.cc, self.intrinsics)
        name = builder.__name__
        with self.current():
            module = self._load_ptx(ptx)
            function = _check(self._driver.cuModuleGetFunction(module, entry.encode()),
                              "cuModuleGetFunction")
        kernel = CudaKernel(function, argtypes, ptx, name, programmatic=self.pdl and getattr(
            builder, "waits_on_prior_grids", False))
        kernel.module = module
        return kernel

    def _load_ptx(self, ptx):
        """cuModuleLoadData, stepping the PTX ISA version down to the driver's when the NVVM wheel
        is newer than the driver (NVVM 13.5 writes .version 9.5; a CUDA 13.0 driver reads up to
        9.0).  The kernels use no instruction newer than PTX 8.0 (sm_90)."""
        err, module = self._driver.cuModuleLoadData(ptx.encode() + b"\0")
        if int(err) == _UNSUPPORTED_PTX_VERSION:
            version = _driver_ptx_version(_check(self._driver.cuDriverGetVersion(),
                                                 "cuDriverGetVersion"))
            ptx = re.sub(r"^\.version\s+\d+\.\d+", f".version {version}", ptx, count=1,
                         flags=re.M)
            err, module = self._driver.cuModuleLoadData(ptx.encode() + b"\0")
        return _check((err, module), "cuModuleLoadData")

    @staticmethod
    def arg(info, dtype):
        return info.ptr if info is not None else 0

    def resident_per_sm(self, kernel, block_threads):
        per_sm = kernel.resident.get(block_threads)
        if per_sm is None:
            # once per kernel and block size; under this device's context, which a thread torch
            # runs autograd on may not have current
            with self.current():
                per_sm = kernel.resident[block_threads] = _check(
                    self._driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        kernel.function, block_threads, 0),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return per_sm

    def _current_context_id(self):
        """This thread's current context as an int (0: none), through ctypes."""
        slot = getattr(self._slots, "context", None)
        if slot is None:
            value = ctypes.c_void_p()
            slot = self._slots.context = (value, ctypes.addressof(value))
        err = self._get_current(slot[1])
        if err:
            _check(self._driver.CUresult(err), "cuCtxGetCurrent")
        return slot[0].value or 0

    def launch(self, kernel, grid, block, args, stream):
        params = kernel.args.pack(args)
        if not self._single_device and self._current_context_id() != self._context_id:
            with self.current():
                return self._launch_now(kernel, grid, block, params, stream)
        self._launch_now(kernel, grid, block, params, stream)

    def _launch_now(self, kernel, grid, block, params, stream):
        config, address = kernel.config(grid, block)
        config.stream = stream
        err = self._launch(address, kernel.handle, params, None)
        if err:
            if err == _INVALID_CONTEXT:  # no context current on this thread (e.g. a new thread)
                with self.current():
                    err = self._launch(address, kernel.handle, params, None)
            if err:
                _check(self._driver.CUresult(err), f"cuLaunchKernelEx({kernel.name})")
