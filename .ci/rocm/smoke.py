"""Is the compile-only numba-hip environment intact?  Run inside the chroot by .ci/rocm-env.sh
(after a build, and before reusing one).  Imports numba.hip, checks that COMGR knows every arch
asked for, and compiles a small kernel to a code object for each (shuffles, shared memory, the
device library), checking the ELF header.  Independent of the project's sources: a failure here
is the environment's.  Exit status 0 when intact; the reason on stderr otherwise."""
import sys
import time

ARCHS = sys.argv[1:] or ["gfx942", "gfx950"]
MACH = {"gfx942": 0x4C, "gfx950": 0x4F}     # ELF e_flags & EF_AMDGPU_MACH


def main():
    start = time.perf_counter()
    import rocm.bindings.clang.cindex as cindex
    cindex.Config.compatibility_check = False
    from numba import float32, hip, int32, types
    import numba.hip.api
    import numba.hip.compiler
    import numba.hip.dispatcher
    from rocm import comgr

    isas = comgr.get_isa_names()
    missing = [a for a in ARCHS if not any(n.endswith("--" + a) for n in isas)]
    if missing:
        sys.exit(f"COMGR does not know {missing}")

    class Device:
        amdgpu_arch = None

    for module in (numba.hip.api, numba.hip.dispatcher, numba.hip.compiler):
        module.get_current_device = lambda: Device

    def kernel(x, out):
        sm = hip.shared.array(64, float32)
        i = hip.threadIdx.x
        v = x[i] * x[i]
        v += hip.shfl_xor(v, int32(1), int32(64))
        sm[i] = v
        hip.syncthreads()
        out[i] = sm[63 - i]

    argtypes = (types.float32[::1], types.float32[::1])
    for arch in ARCHS:
        Device.amdgpu_arch = arch
        options = {"fastmath": False, "opt": 3}
        cres = numba.hip.compiler.compile_hip(kernel, types.void, argtypes, options=options,
                                              amdgpu_arch=arch)
        code = kernel.__code__
        library, _ = cres.target_context.prepare_hip_kernel(
            cres.library, cres.fndesc, False, False, options, code.co_filename,
            code.co_firstlineno)
        code_object = bytes(library.get_codeobj(amdgpu_arch=arch))
        machine = int.from_bytes(code_object[18:20], "little")
        mach = int.from_bytes(code_object[48:52], "little") & 0xFF
        if code_object[:4] != b"\x7fELF" or machine != 224 or mach != MACH.get(arch, mach):
            sys.exit(f"{arch}: not an AMDGPU {arch} code object "
                     f"(machine {machine}, mach {mach:#x})")
        metadata = comgr.parse_code_obj_metadata(code_object, len(code_object))
        if metadata.get("amdhsa.target") != f"amdgcn-amd-amdhsa--{arch}":
            sys.exit(f"{arch}: code object target {metadata.get('amdhsa.target')}")
    print(f"smoke: numba-hip compiles for {', '.join(ARCHS)} "
          f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
