"""AMD backend: kernels compiled by numba-hip to an HSA code object for the device's gfx arch,
loaded once per device with ``hipModuleLoadData`` (hip-python's ``rocm.bindings.hip``) and launched
with ``hipModuleLaunchKernel`` on the caller's current stream, arguments packed by
:class:`~._argpack.ArgPack`.  numba-hip's per-call dispatcher is never on the launch path.

:func:`compile_code_objects` (:func:`variant_code_objects` through the disk cache) is the same
compile for named arches with no GPU and no HIP runtime (``rmsnorm-hip compile``,
:mod:`rmsnorm_hip.aot`).

numba-hip 0.2.1 asks the HIP runtime for the current device's arch in a few places even when the
arch is given explicitly (``Dispatcher.compile_device``, ``_Kernel.__init__``,
``compile_llvm_ir(amdgpu_arch=None)``); :func:`_targeting` answers those with the requested arch,
under a lock, and restores the originals.  It uses numba-hip internals (``compile_hip``,
``prepare_hip_kernel``, ``HIPCodeLibrary.get_codeobj``), hence the exact ``numba-hip==0.2.1`` pin.
"""
import ctypes
import os
import pickle
import re
import threading
from contextlib import contextmanager
from types import SimpleNamespace

from .. import _diskcache, intrinsics
from ..kernels._sharing import share_helpers
from ._argpack import ArgPack
from ._gpu import GpuBackend

_compile_lock = threading.RLock()
_PATCHED_MODULES = ("numba.hip.api", "numba.hip.dispatcher", "numba.hip.compiler")


@contextmanager
def _targeting(arch):
    """numba-hip's "current device" is a device of arch ``arch`` for the duration of the block."""
    import importlib
    modules = [importlib.import_module(m) for m in _PATCHED_MODULES]
    device = SimpleNamespace(amdgpu_arch=arch)
    with _compile_lock:
        originals = [m.get_current_device for m in modules]
        for m in modules:
            m.get_current_device = lambda: device
        try:
            yield
        finally:
            for m, original in zip(modules, originals):
                m.get_current_device = original


_attributes_patched = False


def _reset_target_attributes_per_link():
    """numba-hip 0.2.1 adds ``"target-cpu"`` / ``"target-features"`` to a code library's function
    attributes each time it links for an arch, and never removes them.  Device helpers are compiled
    once per process and shared by every kernel, so after one link for gfx950 they carry the
    attributes of both arches; a later gfx942 kernel then cannot inline them (the callee's features
    are not a subset of the caller's) and calls them through the stack: scratch, 2x VGPRs.  Drop
    the previous arch's attributes before numba-hip applies the current one's."""
    global _attributes_patched
    if _attributes_patched:
        return
    from numba.hip.codegen import HIPCodeLibrary

    apply = HIPCodeLibrary._apply_llvm_amdgpu_modifications

    def apply_for_one_arch(self, amdgpu_arch=None):
        for fn in self._module.functions:
            stale = [a for a in fn.attributes if isinstance(a, str) and a.startswith('"target-')]
            for attribute in stale:
                set.discard(fn.attributes, attribute)
        return apply(self, amdgpu_arch)

    HIPCodeLibrary._apply_llvm_amdgpu_modifications = apply_for_one_arch
    _attributes_patched = True


def _anchor_typed_pointer_rewrite():
    """numba-hip 0.2.1 rewrites typed pointers (``i8*``) to opaque ``ptr`` in every module it
    links with the regex ``\\w+\\*+``, which restarts at each character of an identifier that no
    ``*`` follows: quadratic in identifier length, a fifth of a kernel's link time.  A match always
    starts at its word's first character, so the pattern anchored there rewrites the same text."""
    from numba.hip.util import numbacompat
    if numbacompat._p_typed_ptr.pattern == r"\w+\*+":
        numbacompat._p_typed_ptr = re.compile(r"\b\w+\*+")


class _DeviceLibrary:
    """The HIP device library of one arch cut to what a kernel calls.  numba-hip links the whole
    library into every kernel and then drops what no kernel function reaches, in a pass over the
    text of the linked module: 0.15 s a kernel and arch, 40% of its link and code generation.
    Cut first to the functions the kernel declares and what they call, the library is a few
    functions, and the linked module the same functions as numba-hip's."""

    _by_arch = {}

    def __init__(self, arch):
        from numba.hip.typing_lowering import hipdevicelib
        from numba.hip.util import llvmutils as u
        self._u = u
        self._context = u.LLVMContextCreate()
        (self._module,) = u._get_module_in_context(self._context, hipdevicelib.get_llvm_bc(arch))
        self._aliases = u._get_function_aliases(self._module)
        self._callees = {name: self._called_by(fn) for fn, name in u._iter_functions(self._module)}
        self._cuts = {}

    @classmethod
    def of(cls, arch):
        with _compile_lock:
            if arch not in cls._by_arch:
                cls._by_arch[arch] = cls(arch)
            return cls._by_arch[arch]

    def _called_by(self, fn):
        u, names = self._u, set()
        if u.LLVMIsDeclaration(fn) > 0:
            return names
        block = u.LLVMGetFirstBasicBlock(fn)
        while block:
            instruction = u.LLVMGetFirstInstruction(block)
            while instruction:
                if u.LLVMIsACallInst(instruction) is not None:
                    callee = u.LLVMGetCalledValue(instruction)
                    if u.LLVMIsAGlobalAlias(callee):
                        callee = self._aliases[u._llvm_value_name_as_str(callee)]
                    if u.LLVMIsAInlineAsm(callee) is None:
                        names.add(u._llvm_value_name_as_str(callee))
                instruction = u.LLVMGetNextInstruction(instruction)
            block = u.LLVMGetNextBasicBlock(block)
        return names

    def cut(self, declared):
        """LLVM IR of the functions ``declared`` names and every function they call."""
        key = frozenset(name for name in declared if name in self._callees)
        with _compile_lock:
            if key not in self._cuts:
                keep, todo = set(), list(key)
                while todo:
                    name = todo.pop()
                    if name not in keep:
                        keep.add(name)
                        todo.extend(self._callees.get(name, ()))
                self._cuts[key] = self._u._module_remove_unused_functions_v2(
                    self._module, keep, self._aliases).encode()
            return self._cuts[key]


_DECLARED = re.compile(rb"^declare [^@]*@([\w.$\"-]+)\(", re.M)


def _link(library, arch):
    """What numba-hip's ``HIPCodeLibrary.get_linked_llvm_ir(arch)`` returns for a kernel (its
    modules and the HIP device library, linked, the functions no kernel reaches dropped), linked
    against the device library cut to what the kernel declares (:class:`_DeviceLibrary`); left
    in the library's cache, where ``get_codeobj`` takes it."""
    from numba.hip import hipconfig
    from numba.hip.util import llvmutils
    if hipconfig.ENABLE_MIDEND_OPT:     # numba-hip's own path, which also optimises
        return
    inputs = library._get_linker_inputs(amdgpu_arch=arch)
    declared = {name.decode().strip('"') for module in inputs
                for name in _DECLARED.findall(module.ir)}
    inputs.append(_DeviceLibrary.of(arch).cut(declared))
    linked = llvmutils.clean_up_kernel_module(llvmutils.link_modules(inputs, True), to_bc=True)
    library._linked_amdgpu_llvm_ir_with_hipdevicelib_cache[arch] = linked


def _compile_library(pyfunc, argtypes, arch):
    """numba-hip's kernel code library of ``pyfunc`` for ``arch`` (typed, lowered, wrapped)."""
    from ..intrinsics import hip as _  # noqa: F401  (imports numba.hip the way it must be)
    from numba.core import types
    from numba.hip import compiler

    options = {"fastmath": False, "opt": 3}
    with _targeting(arch):
        _reset_target_attributes_per_link()
        _anchor_typed_pointer_rewrite()
        cres = compiler.compile_hip(pyfunc, types.void, tuple(argtypes), options=options,
                                    amdgpu_arch=arch)
        code = pyfunc.__code__
        library, _ = cres.target_context.prepare_hip_kernel(
            cres.library, cres.fndesc, False, False, options, code.co_filename,
            code.co_firstlineno)
    return library


def compile_code_objects(pyfunc, argtypes, archs, listing=True):
    """Compile a kernel for each AMD arch in ``archs`` (e.g. ``("gfx942", "gfx950")``) without a
    GPU: ``{arch: (code_object, isa, metadata)}``.

    Typing and lowering run once (numba-hip's LLVM IR does not depend on the arch until it is
    linked with the HIP device library); linking and code generation run per arch.
    ``code_object`` is the HSA code object (ELF bytes, what ``hipModuleLoadData`` takes), ``isa``
    the kernel's disassembly from that code object (``""`` when ``listing`` is false; COMGR's
    disassembler, a twentieth of a second code generation's time) and ``metadata`` the code
    object's ``amdhsa`` metadata as a dict (``metadata["amdhsa.kernels"][0]`` has ``.name``,
    ``.vgpr_count``, ``.sgpr_count``, ``.agpr_count``, ``.vgpr_spill_count``,
    ``.sgpr_spill_count``, ``.private_segment_fixed_size``, ``.group_segment_fixed_size``, ...;
    values are strings).
    """
    from rocm import comgr

    archs = list(archs)
    out = {}
    # one compile at a time: linking rewrites the shared device helpers' attributes for its arch
    with _compile_lock:
        library = _compile_library(pyfunc, argtypes, archs[0])
        for arch in archs:
            with _targeting(arch):
                _link(library, arch)
                code_object = bytes(library.get_codeobj(amdgpu_arch=arch))
            metadata = comgr.parse_code_obj_metadata(code_object, len(code_object))
            isa = ""
            if listing:
                isa = comgr.disassemble_code_obj_function(
                    code_object, f"amdgcn-amd-amdhsa--{arch}",
                    metadata["amdhsa.kernels"][0][".name"])
            out[arch] = (code_object, isa, metadata)
    return out


def variant_code_objects(builder, spec, argtypes, archs, intr=None, listing=True):
    """:func:`compile_code_objects` of the kernel ``builder(intr, spec)``, from the disk cache
    when it holds it.  An arch's own namespace (``intrinsics.load("hip", arch=...)``) compiles
    for that arch only."""
    archs = tuple(archs)
    intr = intr or intrinsics.load("hip")
    if "mx_hw_convert" in intr.features and not set(archs) <= intrinsics.MX_HW_ARCHS:
        # its MX conversions would be linked, illegal, into the other arches' code objects
        raise ValueError(f"the intrinsics of {sorted(intrinsics.MX_HW_ARCHS)} cannot compile "
                         f"for {list(archs)}")
    key = (builder.__module__, builder.__name__, spec, tuple(map(str, argtypes)), archs, listing,
           intr.name, tuple(sorted(intr.features)))

    def build():
        return compile_code_objects(share_helpers(builder(intr, spec)), argtypes, archs, listing)
    return _diskcache.cached("hsaco", key, build, encode=pickle.dumps, decode=pickle.loads)


def is_mx(spec):
    """Whether ``spec``'s kernel stores OCP MX elements (the only code that differs per arch)."""
    return getattr(spec, "scaling", None) == "mx"


def intrinsics_for(spec, arch, generic=None):
    """The namespace that builds ``spec``'s kernel for ``arch``: ``arch``'s own for an MX kernel
    (gfx950's converts the elements in hardware), else ``generic`` (default the generic one)."""
    if is_mx(spec):
        return intrinsics.load("hip", arch=arch)
    return generic or intrinsics.load("hip")


def kernel_name(metadata):
    """The entry symbol of the single kernel in a code object's metadata."""
    kernels = metadata.get("amdhsa.kernels") or []
    if len(kernels) != 1:
        raise RuntimeError(f"expected one kernel in the code object, found {len(kernels)}")
    return kernels[0][".name"]


# ---- runtime ---------------------------------------------------------------------------------
def _hip():
    from rocm.bindings import hip
    return hip


def _check(result, what):
    """The value of a hip-python call returning ``(hipError_t, value...)``; raises on an error."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        try:
            hip = _hip()
            name = hip.hipGetErrorName(hip.hipError_t(int(err)))[1]
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # an unknown code: the number says it all
            name = "?"
        raise RuntimeError(f"{what} failed: {name} ({int(err)})")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def _runtime_functions():
    """``hipModuleLaunchKernel`` / ``hipGetDevice`` / ``hipSetDevice`` of the HIP runtime that
    hip-python loaded (same file, so the same library handle), called through ctypes: the Python
    wrappers convert their arguments into objects on every call (see backends/cuda.py)."""
    from rocm.bindings.util import paths
    lib = ctypes.CDLL(os.fsdecode(paths.get_library_path("amdhip64")))
    c = ctypes
    launch = lib.hipModuleLaunchKernel
    launch.restype = c.c_int
    launch.argtypes = [c.c_void_p] + [c.c_uint] * 7 + [c.c_void_p] * 3
    get_device, set_device = lib.hipGetDevice, lib.hipSetDevice
    get_device.restype = set_device.restype = c.c_int
    get_device.argtypes = [c.POINTER(c.c_int)]
    set_device.argtypes = [c.c_int]
    return launch, get_device, set_device


def device_arch(device_index):
    """The gfx arch of HIP device ``device_index`` without target features ("gfx942")."""
    props = _check(_hip().hipGetDeviceProperties(device_index), "hipGetDeviceProperties")
    name = props.gcnArchName
    name = name.decode() if isinstance(name, bytes) else str(name)
    return name.split("\0")[0].split(":")[0]


class HipKernel:
    def __init__(self, function, argtypes, code_object, metadata, name):
        self.function = function
        self.handle = int(function)
        self.args = ArgPack(argtypes)
        self.code_object = code_object
        self.metadata = metadata
        self.name = name

    def attributes(self):
        """Resource usage from the code object's metadata (VGPRs, SGPRs, spills, scratch, LDS)."""
        k = self.metadata["amdhsa.kernels"][0]
        keys = ("vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count",
                "private_segment_fixed_size", "group_segment_fixed_size",
                "max_flat_workgroup_size")
        return {key: int(k["." + key]) for key in keys if "." + key in k}


class HipBackend(GpuBackend):
    name = "hip"

    def __init__(self, device_index):
        hip = _hip()
        self._hip = hip
        _check(hip.hipInit(0), "hipInit")
        count = _check(hip.hipGetDeviceCount(), "hipGetDeviceCount")
        if not 0 <= device_index < count:
            raise RuntimeError(f"HIP device {device_index} does not exist ({count} visible)")
        self.device_index = device_index
        self.arch = device_arch(device_index)
        self.sm_count = _check(hip.hipDeviceGetAttribute(
            hip.hipDeviceAttribute_t.hipDeviceAttributeMultiprocessorCount, device_index),
            "hipDeviceGetAttribute")
        self._launch, self._get_device, self._set_device = _runtime_functions()
        # with one device it is always current: no per-launch device check
        self._single_device = count == 1
        self._current = ctypes.c_int()
        super().__init__(intrinsics.load("hip"))

    @contextmanager
    def current(self):
        """This device current for the block (HIP's current device is per thread); restored."""
        hip = self._hip
        previous = _check(hip.hipGetDevice(), "hipGetDevice")
        if previous == self.device_index:
            yield
            return
        _check(hip.hipSetDevice(self.device_index), "hipSetDevice")
        try:
            yield
        finally:
            _check(hip.hipSetDevice(previous), "hipSetDevice")

    def compile(self, builder, spec, argtypes):
        # AMDGPU code objects are built for blocks of up to 1024 work items already (the VGPR
        # budget for 16 waves per CU; aot.block_vgpr_limit checks each variant)
        intr = intrinsics_for(spec, self.arch, self.intrinsics)
        code_object, _, metadata = variant_code_objects(builder, spec, argtypes, (self.arch,),
                                                        intr, listing=False)[self.arch]
        name = builder.__name__
        entry = kernel_name(metadata)
        hip = self._hip
        with self.current():
            module = _check(hip.hipModuleLoadData(code_object), "hipModuleLoadData")
            function = _check(hip.hipModuleGetFunction(module, entry.encode()),
                              "hipModuleGetFunction")
        kernel = HipKernel(function, argtypes, code_object, metadata, name)
        kernel.module = module
        return kernel

    @staticmethod
    def arg(info, dtype):
        return info.ptr if info is not None else 0

    def launch(self, kernel, grid, block, args, stream):
        params = kernel.args.pack(args)
        if not self._single_device:
            self._get_device(ctypes.byref(self._current))
            if self._current.value != self.device_index:
                with self.current():
                    return self._launch_now(kernel, grid, block, params, stream)
        self._launch_now(kernel, grid, block, params, stream)

    def _launch_now(self, kernel, grid, block, params, stream):
        err = self._launch(kernel.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                           0, stream, params, None)
        if err:
            _check((err,), f"hipModuleLaunchKernel({kernel.name})")
