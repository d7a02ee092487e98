"""The GPU matrix that benchmarks/sanitize_h200.sh runs under compute-sanitizer: every entry point x
dtype x awkward N (1, 3, 127, 4096, 4097, 65537) x aligned (vector) and unaligned (scalar) rows,
through tests/_fuzz.check_case (inputs in guarded poisoned buffers, outputs and workspaces
allocated poisoned and guarded, the float64 contract), with torch and CuPy arrays.

    python benchmarks/sanitize_matrix.py --mode full      # memcheck, initcheck
    python benchmarks/sanitize_matrix.py --mode quick     # racecheck, synccheck: fewer, smaller
    python benchmarks/sanitize_matrix.py --mode control   # writes one row past an output: a
                                                          # sanitizer that sees the launches
                                                          # must report it
    python benchmarks/sanitize_matrix.py --mode quick --lib numpy   # CPU smoke test of the driver

Prints one line per case and ``SANITIZE_MATRIX cases=.. failed=.. seconds=..``; exits 1 when a
check failed (a contract or guard failure: separate from what the sanitizer reports).  Run with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every tensor is its own allocation (the caching
allocator's pools would hide an overrun into a neighbouring tensor from memcheck); CuPy's pool is
switched off here.
"""
import argparse
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

from _fuzz import CONTIGUOUS, OPS, Case, Layout, check_case  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")
UNALIGNED = Layout(1, 7)            # starts one element past a 16-byte boundary: scalar path
ALIGNED = Layout(8, 8)              # 16-byte aligned starts and strides: vector path (N % 8 == 0)
MODES = {
    # mode: (dtypes, Ns, layouts, M for the forward variants, M for the backward, ops or None)
    "full": (DTYPES, (1, 3, 127, 4096, 4097, 65537), (UNALIGNED, ALIGNED), 5, 300, None),
    "quick": (("bfloat16", "float32"), (3, 127, 4096, 4097, 65537), (ALIGNED,), 3, 40, None),
    # the backward's rows of two chunks a thread on CUDA (16-bit N = 8192, float32 N = 4096) and
    # those one element short of them, several rows a program
    "bwd": (DTYPES, (4095, 4096, 8190, 8192), (UNALIGNED, ALIGNED), 5, 300, ("bwd",)),
    "bwd_quick": (("bfloat16", "float32"), (4096, 8192), (ALIGNED,), 3, 300, ("bwd",)),
}


# forward rows on the streamed grid (kernels/_config.FWD_STREAM_ROWS_PER_SM: cached vector rows,
# rms_norm up to 16 rows per SM, quantised rows at any M): enough rows that each of the H200's
# programs walks two or more of them (both word buffers, both halves of the reduction buffer)
STREAM_N, STREAM_M = 4096, 1500


def case(op, dtype, n, layout, m, m_bwd, quant="int8"):
    if op == "bwd":             # several programs of the persistent grid; 40 looped rows
        m = m_bwd if n <= 16384 else 40
    elif n == STREAM_N and layout is ALIGNED:
        m = STREAM_M
    return Case(op=op, dtype=dtype, lead=(m,), n=n, eps=1e-6,
                seed=n, weight="float32" if dtype != "float32" else "same",
                weight_offset=1.0 if n % 2 else 0.0, vec_offset=int(layout is UNALIGNED),
                x_layout=layout, other_layout=CONTIGUOUS if layout is UNALIGNED else layout,
                out=layout if op == "fwd" else None, return_rstd=True,
                residual=op == "quant", xscale="same" if op == "quant" else None, quant=quant,
                given_rstd=dtype == "float16", dresidual=dtype != "float16")


def matrix(mode, lib_names):
    dtypes, ns, layouts, m, m_bwd, ops = MODES[mode]
    for dtype in dtypes:
        for n in ns:
            for layout in layouts:
                for op in ops or OPS:
                    quant = "float8_e4m3fn" if (n + len(op)) % 2 else "int8"
                    yield lib_names[0], case(op, dtype, n, layout, m, m_bwd, quant)
    if mode == "full" and "cupy" in lib_names:       # uint16 storage and float8 as uint8 bits
        for op in OPS:
            for n in (3, 4097):
                yield "cupy", case(op, "bfloat16", n, UNALIGNED, m, m_bwd, "float8_e4m3fn")


def make_lib(name):
    import _fuzz
    if name == "torch":
        return _fuzz.TorchLib()
    if name == "cupy":
        import cupy
        cupy.cuda.set_allocator(None)        # one cudaMalloc per array: memcheck sees overruns
        return _fuzz.CupyLib()
    return _fuzz.NumpyLib()


def control():
    """One row written past the end of an output through the backend's own launch path (the
    package's ctypes cuLaunchKernel on a cuModuleLoadData module): memcheck must report it."""
    import torch

    from rmsnorm_hip import _arrays, backends
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(63, 4096, device="cuda", dtype=torch.bfloat16)      # one row short
    xi, yi = _arrays.describe(x, "x"), _arrays.describe(y, "out")
    backends.for_array(xi, "control").rms_norm_fwd(xi, None, yi, None, 64, 4096, 4096, 4096,
                                                   1e-6, 0.0)
    torch.cuda.synchronize()
    print("SANITIZE_CONTROL launched: a sanitizer that sees the kernel reports an invalid "
          "__global__ write past the 63-row output")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=[*MODES, "control"], default="full")
    parser.add_argument("--lib", choices=["torch", "numpy"], default="torch",
                        help="numpy: the CPU backend, to smoke-test this driver without a GPU")
    args = parser.parse_args()
    if args.mode == "control":
        control()
        return 0
    libs = ["numpy"] if args.lib == "numpy" else ["torch"]
    if args.lib == "torch":
        try:
            import cupy  # noqa: F401
            libs.append("cupy")
        except ImportError:
            print("SANITIZE_MATRIX cupy not installed: torch arrays only")
    made = {name: make_lib(name) for name in libs}
    start, done, failed = time.perf_counter(), 0, 0
    for lib_name, c in matrix(args.mode, libs):
        label = (f"{lib_name} {c.op} {c.dtype} M={c.m} N={c.n} x_layout={c.x_layout.offset},"
                 f"{c.x_layout.pad}" + (f" {c.quant}" if c.op == "quant" else ""))
        t0 = time.perf_counter()
        try:
            check_case(c, made[lib_name], invariance=False)
            status = "ok"
        except AssertionError as exc:
            failed += 1
            status = f"FAILED {exc}".splitlines()[0]
        except Exception:                 # a CUDA error leaves the context unusable: stop here
            failed += 1
            print(f"{label}: ERROR\n{traceback.format_exc()}", flush=True)
            break
        done += 1
        print(f"{label}: {status} ({time.perf_counter() - t0:.2f} s)", flush=True)
    print(f"SANITIZE_MATRIX mode={args.mode} libs={','.join(libs)} cases={done} failed={failed} "
          f"seconds={time.perf_counter() - start:.1f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
