"""``rmsnorm-hip`` (also ``python -m rmsnorm_hip``): info, check, bench, compile, cache."""
import argparse
import importlib.metadata
import os
import sys

import numpy as np

from . import _dtypes, _numerics, backends
from ._argparse import Parser

CHECK_SHAPES = ((1, 1), (7, 3), (333, 127), (7, 4097), (33, 5000), (7, 8192), (3, 65537))


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect():
    """(backend name, device description) of the best backend on this machine."""
    forced = backends.requested("rmsnorm-hip")
    if forced in ("cpu", "sim"):
        return forced, "host"
    if forced in (None, "cuda"):
        try:
            from cuda.bindings import driver
            if int(driver.cuInit(0)[0]) == 0 and driver.cuDeviceGetCount()[1] > 0:
                name = driver.cuDeviceGetName(256, driver.cuDeviceGet(0)[1])[1]
                return "cuda", name.split(b"\0")[0].decode()
        except Exception:
            pass
    if forced in (None, "hip"):
        try:
            try:
                from rocm.bindings import hip   # hip-python as numba-hip installs it
            except ImportError:
                from hip import hip
            err, count = hip.hipGetDeviceCount()
            if int(err) == 0 and count > 0:
                return "hip", "AMD GPU"
        except Exception:
            pass
    return "cpu", "host"


def _host_arch():
    """The host's machine and the CPU numba compiles for (llvmlite's name for it)."""
    import platform

    import llvmlite.binding as llvm
    return f"{platform.machine()} ({llvm.get_host_cpu_name()})"


def cmd_info(args):
    name, device = detect()
    print(f"backend      {name}")
    print(f"device       {device}")
    if name in ("cuda", "hip"):
        b = backends.get(name, 0)
        print(f"arch         {b.arch}")
        print(f"SMs/CUs      {b.sm_count}")
    elif name == "cpu":
        print(f"arch         {_host_arch()}")
        import numba
        print(f"threads      {numba.config.NUMBA_NUM_THREADS}")
    else:   # the simulator runs the GPU kernels' source with this warp size
        print(f"arch         {backends.get(name, 0).arch}")
    for pkg in ("rmsnorm-hip", "numba", "numba-cuda", "numba-hip", "llvmlite", "numpy",
                "ml_dtypes", "cuda-bindings", "cupy-cuda13x", "cupy-cuda12x", "torch"):
        v = _version(pkg)
        if v:
            print(f"{pkg:12s} {v}")
    return 0


# What installs an array library for a GPU check: pyproject.toml's extras ([cuda] brings CuPy for
# CUDA 13, [cuda12] for CUDA 12); no extra installs a ROCm build of torch or CuPy.
_ARRAYS_HINT = {
    "cuda": 'pip install "rmsnorm-hip[cuda]" (CuPy; "rmsnorm-hip[cuda12]" for CUDA 12) or '
            '"rmsnorm-hip[torch]"',
    "hip": "install a ROCm build of torch or CuPy",
}


def _device_arrays(name="cuda"):
    """(to_device(np_array, dtype) -> (array, dtype kw), to_host, library) for a GPU check.
    Raises ImportError, its message naming what to install, when neither torch (with a GPU) nor
    CuPy imports."""
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError

        def to_device(a, dtype):
            raw = np.ascontiguousarray(a)
            if dtype == _dtypes.BFLOAT16:
                return torch.from_numpy(raw.view(np.int16)).cuda().view(torch.bfloat16), None
            return torch.from_numpy(raw).cuda(), None

        def to_host(t, dtype):
            if dtype == _dtypes.BFLOAT16:
                return t.view(torch.int16).cpu().numpy().view(_dtypes.NUMPY[dtype])
            if dtype == _dtypes.FLOAT8_E4M3FN:
                return t.view(torch.uint8).cpu().numpy().view(_dtypes.NUMPY[dtype])
            return t.cpu().numpy()
        return to_device, to_host, "torch"
    except ImportError:
        try:
            import cupy
        except ImportError as error:
            raise ImportError(f"checking the {name} backend needs torch or CuPy for device "
                              f"arrays ({error}): {_ARRAYS_HINT[name]}") from None

        def to_device(a, dtype):   # dtype: a name of _dtypes, or "int32" / "int64"
            kw = dtype if dtype in _dtypes.HALF_DTYPES else None
            a = np.ascontiguousarray(a)
            return cupy.asarray(a.view(_dtypes.STORAGE.get(dtype, a.dtype))), kw

        def to_host(c, dtype):
            return cupy.asnumpy(c).view(_dtypes.NUMPY[dtype])
        return to_device, to_host, "cupy"


def _check_fwd(case):
    """rms_norm: y and rstd within the contract."""
    from . import functional, reference
    y, rstd = functional.rms_norm(case.xd, case.wd, 1e-6, return_rstd=True, dtype=case.kw)
    y_ref, rstd_ref = reference.rms_norm_ref(case.x, case.w, 1e-6)
    ok, rel, ulps = _numerics.within_contract(case.to_host(y, case.dtype), y_ref, case.dtype)
    ok_r = _numerics.within_contract(case.to_host(rstd, "float32"), rstd_ref, "float32")[0]
    return ok and ok_r, rel, ulps


def _check_bwd(case):
    """rms_norm_backward with rstd recomputed: dx (against s = |dy w rstd|) and dweight."""
    from . import functional, reference
    dx, dw = functional.rms_norm_backward(case.dyd, case.xd, case.wd, None, dtype=case.kw)
    dx_ref, dw_ref = reference.rms_norm_backward_ref(case.dy, case.x, case.w, None)
    rstd = reference.rms_norm_ref(case.x, None, 1e-6)[1][:, None]
    scale = 1.0 if case.w is None else case.w.astype(np.float64)
    s = np.abs(case.dy.astype(np.float64) * scale * rstd)
    ok, rel, ulps = _numerics.dx_within_contract(case.to_host(dx, case.dtype), dx_ref, s,
                                                 case.dtype)
    if case.w is not None:
        ok = ok and _numerics.dweight_within_contract(case.to_host(dw, case.wdtype), dw_ref,
                                                      case.wdtype)
    return ok, rel, ulps


CHECKS = {"fwd": _check_fwd, "bwd": _check_bwd}


class _Case:
    """One (dtype, weight dtype, shape) input set, on the host and on the checked device."""

    def __init__(self, rng, m, n, dtype, wdtype, to_device, to_host):
        self.dtype, self.wdtype, self.to_host = dtype, wdtype, to_host
        self.x = rng.standard_normal((m, n)).astype(_dtypes.NUMPY[dtype])
        self.dy = rng.standard_normal((m, n)).astype(_dtypes.NUMPY[dtype])
        self.w = None if wdtype is None else (1 + 0.1 * rng.standard_normal(n)).astype(
            _dtypes.NUMPY[wdtype])
        self.xd, self.kw = to_device(self.x, dtype)
        self.dyd = to_device(self.dy, dtype)[0]
        self.wd = None if self.w is None else to_device(self.w, wdtype)[0]


def cmd_check(args):
    name, device = detect()
    forced = backends.requested("rmsnorm-hip")
    if forced in ("cuda", "hip") and name != forced:
        print(f"rmsnorm-hip check: {backends.ENV}={forced}, but no {forced.upper()} device was "
              f"found (unset it to check the {name} backend)", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    if name in ("cuda", "hip"):
        try:
            to_device, to_host, lib = _device_arrays(name)
        except ImportError as error:
            print(f"rmsnorm-hip check: {error}", file=sys.stderr)
            return 1
    else:
        lib = "numpy"
        to_device = lambda a, dtype: (a, None)  # noqa: E731
        to_host = lambda a, dtype: np.asarray(a)  # noqa: E731
    print(f"rmsnorm-hip check on {name} ({device}), arrays: {lib}")
    print(f"{'op':10s} {'dtype':9s} {'weight':9s} {'shape':>12s}  {'rel err':>9s} "
          f"{'max ulp':>8s}  result")
    failures = 0
    for op, check in CHECKS.items():
        for dtype in _dtypes.ACTIVATION_DTYPES:
            op_failures = 0
            for m, n in CHECK_SHAPES:
                wide = [_dtypes.FLOAT32] if dtype != _dtypes.FLOAT32 else []
                for wdtype in [None, dtype] + wide:
                    case = _Case(rng, m, n, dtype, wdtype, to_device, to_host)
                    ok, rel, ulps = check(case)
                    op_failures += not ok
                    if not ok or args.verbose:
                        print(f"{op:10s} {dtype:9s} {str(wdtype):9s} {f'{m}x{n}':>12s}  {rel:9.2e} "
                              f"{ulps:8.2f}  {'ok' if ok else 'FAIL'}")
            failures += op_failures
            print(f"{op:10s} {dtype:9s} {'all':9s} {len(CHECK_SHAPES):>5d} shapes  "
                  f"{'':9s} {'':8s}  {'ok' if not op_failures else 'FAIL'}")
    failures += _check_fused(rng, to_device, to_host, args.verbose)
    from . import _check_heads
    failures += _check_heads.check(rng, to_device, to_host, args.verbose, name)
    from . import _check_quant
    failures += _check_quant.check(rng, to_device, to_host, args.verbose)
    print("PASS" if not failures else f"FAIL: {failures} case(s)")
    return 1 if failures else 0


def _check_fused(rng, to_device, to_host, verbose):
    """``check`` rows of fused_add_rms_norm (residual_out bitwise the rounded sum, y within the
    contract), fused_add_rms_norm_ (bitwise the out-of-place results) and rms_norm_quant (int8
    and float8 with xscale and residual: levels and yscale within the contract); weight in x's
    dtype.  Returns the number of failing cases."""
    from . import functional, reference
    failures = 0
    for dtype in _dtypes.ACTIVATION_DTYPES:
        counts = dict(fused=0, fused_=0, int8=0, float8_e4m3fn=0)
        for m, n in CHECK_SHAPES:
            x, r = (rng.standard_normal((m, n)).astype(_dtypes.NUMPY[dtype]) for _ in range(2))
            w = (1 + 0.1 * rng.standard_normal(n)).astype(_dtypes.NUMPY[dtype])
            xscale = (0.5 + rng.random(n)).astype(np.float32)
            (xd, kw), rd, wd = to_device(x, dtype), to_device(r, dtype)[0], to_device(w, dtype)[0]
            results = {}

            y, residual_out = functional.fused_add_rms_norm(xd, rd, wd, 1e-6, dtype=kw)
            y_ref, h_ref, _ = reference.fused_add_rms_norm_ref(x, r, w, 1e-6)
            y_host, ro_host = to_host(y, dtype), to_host(residual_out, dtype)
            ok, rel, ulps = _numerics.within_contract(y_host, y_ref, dtype)
            results["fused"] = (ok and np.array_equal(ro_host.astype(np.float64), h_ref), rel, ulps)

            xi, ri = to_device(x.copy(), dtype)[0], to_device(r.copy(), dtype)[0]
            functional.fused_add_rms_norm_(xi, ri, wd, 1e-6, dtype=kw)
            same = (np.array_equal(to_host(xi, dtype).view(np.uint8), y_host.view(np.uint8))
                    and np.array_equal(to_host(ri, dtype).view(np.uint8),
                                       ro_host.view(np.uint8)))
            results["fused_"] = (same, rel, ulps)

            xsd = to_device(xscale, _dtypes.FLOAT32)[0]
            for quant in _dtypes.QUANT_DTYPES:
                q, yscale, _ = functional.rms_norm_quant(xd, wd, 1e-6, xscale=xsd, residual=rd,
                                                         quant_dtype=quant, dtype=kw)
                q_ref, yscale_ref, _ = reference.rms_norm_quant_ref(
                    x, w, 1e-6, xscale=xscale, residual=r, quant_dtype=quant)
                results[quant] = _numerics.quant_within_contract(
                    to_host(q, quant), to_host(yscale, _dtypes.FLOAT32), q_ref, yscale_ref, quant)
            for op, (ok, rel, worst) in results.items():
                counts[op] += not ok
                if not ok or verbose:
                    print(f"{op:10s} {dtype:9s} {dtype:9s} {f'{m}x{n}':>12s}  {rel:9.2e} "
                          f"{worst:8.2f}  {'ok' if ok else 'FAIL'}")
        for op, bad in counts.items():
            label = op if op.startswith("fused") else "quant " + op.replace("float8_e4m3fn", "fp8")
            print(f"{label:10s} {dtype:9s} {'all':9s} {len(CHECK_SHAPES):>5d} shapes  "
                  f"{'':9s} {'':8s}  {'ok' if not bad else 'FAIL'}")
            failures += bad
    return failures


def cmd_bench(args):
    from ._bench import runner
    return runner.main(args.rest)


def cmd_compile(args):
    from . import aot
    return aot.main(args.rest)


def cmd_cache(args):
    from . import _diskcache
    if args.action == "clear":
        removed = _diskcache.clear()
        print(f"removed {removed} cached kernel(s) from {_diskcache.directory()}")
        return 0
    summary = _diskcache.info()
    if not summary["enabled"]:
        print(f"disabled ({_diskcache.ENV}={os.environ.get(_diskcache.ENV)})")
        return 0
    print(f"directory    {summary['directory']}")
    print(f"size         {summary['bytes'] / 2**20:.1f} MiB")
    kinds = summary["entries"]
    for kind, what in (("cpu", "CPU machine code"), ("ptx", "NVIDIA PTX"),
                       ("hsaco", "AMD code objects")):
        print(f"{kind:12s} {kinds.get(kind, 0)} {what}")
    return 0


_PASS_THROUGH = {"bench": cmd_bench, "compile": cmd_compile}


def main(argv=None):
    try:
        return _main(argv)
    except BrokenPipeError:     # `rmsnorm-hip info | head`: the reader left; so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _PASS_THROUGH:  # their own argparse owns every option after the verb
        return _PASS_THROUGH[argv[0]](argparse.Namespace(rest=argv[1:]))
    parser = Parser(prog="rmsnorm-hip", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, device, arch and versions").set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help="every entry point vs the float64 reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("cache", help="the on-disk kernel cache: where it is and what it holds, "
                                     "or empty it")
    p.add_argument("action", choices=("info", "clear"))
    p.set_defaults(fn=cmd_cache)
    for name, fn, text in (("bench", cmd_bench, "device time, GB/s and %% of copy vs peers"),
                           ("compile", cmd_compile, "ahead-of-time compile every kernel variant")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    if args.command in ("info", "check"):
        prog = f"rmsnorm-hip {args.command}"
        try:
            backends.requested(prog)
        except ValueError as error:     # a bad RMSNORM_HIP_BACKEND: one line, as a bad argument
            print(f"{prog}: error: {str(error).removeprefix(prog + ': ')}", file=sys.stderr)
            return 2
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
