"""Forward + backward through autograd on a CUDA GPU: rmsnorm_hip.torch beside torch eager
F.rms_norm, Liger and QuACK (each skipped when it does not import), bf16.

1. Host overhead per fwd+bwd step (forward, then ``y.backward(dy)``; grads reset to None) at
   M = 1, 32, 4096 and N = 4096: ``host_us`` is the time to issue one step (100 steps, no sync
   inside, median of 5 repeats), ``wall_us`` the wall time per step over 1000 steps + one sync
   (median of 3).  Where the GPU is faster than the host, wall ~ host.
2. Device time per fwd+bwd step (CUDA events around each step, median) at the large shapes,
   with L2 flushed (a 256 MB buffer written) and the device kept busy for ~100 us (so the host
   can queue the step ahead) before each step.  GB/s over the minimal bytes 5*M*N*2 (forward
   reads x, writes y; backward reads dy and x, writes dx).

Also: ``ours (ops)`` is the custom-op path that torch.compile runs (dispatcher + the custom op's
autograd wrapper), ``ours (functional)`` the two entry points called without autograd (the
floor).  Each implementation's y, dx, dweight are checked against float64 first (relative
error, reported, not enforced).  Liger runs with its defaults (in_place=True writes dx into the
incoming dy: its dy buffer is its own here).

    PYTHONPATH=src python3 benchmarks/torch_overhead.py --json out.json

Writes JSON to --json, else to $OUT/torch_overhead.json when $OUT is set; always prints tables.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

N_HOST = 4096
M_HOST = (1, 32, 4096)
DEVICE_SHAPES = ((32768, 4096), (16384, 8192), (8192, 8192), (4096, 4096), (1024, 8192))
EPS = 1e-6
DTYPE = torch.bfloat16
FLUSH_BYTES = 256 << 20
# ~2 ms at H200 clocks: lets the host queue the whole step ahead.  The 2026-11-29 run used
# ~100 us, less than an autograd step's host time (150-800 us), so its device times for the
# autograd paths include the GPU waiting for the host; the functional row was unaffected.
SLEEP_CYCLES = 4_000_000


# ---- implementations: forward functions for autograd, and the autograd-free floor ----------------

def ours():
    from rmsnorm_hip.torch import rms_norm
    return lambda x, w: rms_norm(x, w, EPS)


def ours_ops():
    import rmsnorm_hip.torch  # noqa: F401  (registers torch.ops.rmsnorm_hip)
    op = torch.ops.rmsnorm_hip.rms_norm_fwd.default
    return lambda x, w: op(x, w, EPS, 0.0)[0]


def torch_eager():
    return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS)


def liger():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)


def quack():
    from quack.rmsnorm import rmsnorm
    return lambda x, w: rmsnorm(x, w, eps=EPS)


FORWARDS = {"rmsnorm_hip.torch": ours, "rmsnorm_hip.torch (ops)": ours_ops,
            "torch eager": torch_eager, "Liger": liger, "QuACK": quack}


def autograd_step(forward, x, w, dy):
    def step():
        x.grad = w.grad = None
        forward(x, w).backward(dy)
    return step


def functional_step(x, w, dy):
    import rmsnorm_hip

    def step():
        y, rstd = rmsnorm_hip.rms_norm(x, w, EPS, return_rstd=True)
        rmsnorm_hip.rms_norm_backward(dy, x, w, rstd)
    return step


def make_steps(m, n):
    """name -> (step, (x, w, dy)) for every implementation that imports; name -> error text."""
    steps, errors = {}, {}
    for name, factory in FORWARDS.items():
        try:
            forward = factory()
            x, w, dy = inputs(m, n)
            steps[name] = (autograd_step(forward, x, w, dy), (x, w, dy), forward)
        except Exception as exc:  # noqa: BLE001  (a broken peer must not stop the others)
            errors[name] = f"{type(exc).__name__}: {exc}"
    x, w, dy = inputs(m, n)
    steps["rmsnorm_hip (functional)"] = (functional_step(x.detach(), w.detach(), dy), None, None)
    return steps, errors


def inputs(m, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(DTYPE).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=DTYPE, generator=g)
    return x, w, dy


# ---- measurements --------------------------------------------------------------------------------

def check(forward, m=32, n=N_HOST):
    """Relative errors of y, dx, dweight against float64 autograd on the same bf16 inputs."""
    x, w, dy = inputs(m, n, seed=1)
    y = forward(x, w)
    y.backward(dy.clone())
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y64 = F.rms_norm(x64, (n,), w64, EPS)
    y64.backward(dy.double())

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())
    return {"y": rel(y.detach(), y64.detach()), "dx": rel(x.grad, x64.grad),
            "dweight": rel(w.grad, w64.grad)}


def host_times(step, issue_iters=100, wall_iters=1000):
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    issue = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(issue_iters):
            step()
        issue.append((time.perf_counter() - t0) / issue_iters * 1e6)
    torch.cuda.synchronize()
    wall = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(wall_iters):
            step()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) / wall_iters * 1e6)
    return statistics.median(issue), statistics.median(wall)


def device_time(step, flush, iters):
    for _ in range(3):
        step()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        flush.fill_(1)
        sleep(SLEEP_CYCLES)
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def sleep(cycles):
    fn = getattr(torch.cuda, "_sleep", None)
    if fn is not None:
        fn(cycles)


# ---- driver --------------------------------------------------------------------------------------

def versions():
    import importlib.metadata as md
    out = {}
    for name in ("torch", "numba", "numba-cuda", "liger-kernel", "quack-kernels", "triton",
                 "nvidia-cutlass-dsl"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="output file (default: $OUT/torch_overhead.json if $OUT)")
    parser.add_argument("--device-iters", type=int, default=20)
    parser.add_argument("--wall-iters", type=int, default=1000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("torch_overhead: needs a CUDA GPU")
    began = time.perf_counter()
    result = {"meta": {"gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "dtype": "bfloat16", "eps": EPS,
        "versions": versions()}, "errors": {}, "check": {}, "host": [], "device": []}

    print(f"{result['meta']['gpu']}  {result['meta']['versions']}")
    print(f"\nhost overhead per fwd+bwd step, N={N_HOST} bf16: issue us / wall us")
    for m in M_HOST:
        steps, errors = make_steps(m, N_HOST)
        result["errors"].update(errors)
        for name, (step, _, forward) in steps.items():
            row = {"impl": name, "M": m, "N": N_HOST}
            try:
                if forward is not None and name not in result["check"]:
                    result["check"][name] = check(forward)
                row["host_us"], row["wall_us"] = host_times(step, wall_iters=args.wall_iters)
                print(f"  M={m:<5} {name:26s} {row['host_us']:8.1f} / {row['wall_us']:8.1f}")
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"
                print(f"  M={m:<5} {name:26s} error: {row['error']}")
                traceback.print_exc()
            result["host"].append(row)
        del steps
    for name, error in result["errors"].items():
        print(f"  {name}: not run ({error})")
    print("\nrelative error vs float64 (M=32): y / dx / dweight")
    for name, errs in result["check"].items():
        print(f"  {name:26s} {errs['y']:.2e} / {errs['dx']:.2e} / {errs['dweight']:.2e}")
    print(f"({time.perf_counter() - began:.0f} s)")

    print("\ndevice time per fwd+bwd step (L2 flushed), us (GB/s over 5*M*N*2 bytes)")
    flush = torch.empty(FLUSH_BYTES // 4, device="cuda", dtype=torch.float32)
    for m, n in DEVICE_SHAPES:
        torch.cuda.empty_cache()
        steps, _ = make_steps(m, n)
        line = []
        for name, (step, _, _) in steps.items():
            row = {"impl": name, "M": m, "N": n}
            try:
                row["device_us"] = device_time(step, flush, args.device_iters)
                row["gbps"] = 5 * m * n * 2 / (row["device_us"] * 1e-6) / 1e9
                line.append(f"{name} {row['device_us']:.1f} ({row['gbps']:.0f})")
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"
                line.append(f"{name} error: {row['error']}")
            result["device"].append(row)
        del steps
        print(f"  {m}x{n}: " + ";  ".join(line))
    result["meta"]["seconds"] = round(time.perf_counter() - began, 1)
    print(f"({result['meta']['seconds']} s)")

    path = args.json or (os.path.join(os.environ["OUT"], "torch_overhead.json")
                         if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
