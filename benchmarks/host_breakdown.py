"""Where a repeat call's host time goes, piece by piece (torch bf16, M = 32, N = 4096): each piece
of the fast path timed alone in a loop of back-to-back calls, beside the whole call and torch
eager.  Host microseconds per call; device work is queued, never waited on inside a loop.

    PYTHONPATH=src python3 benchmarks/host_breakdown.py [--out DIR]
"""
import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--n", type=int, default=4096)
    args = ap.parse_args()
    import torch

    import rmsnorm_hip
    from rmsnorm_hip import _arrays, backends, functional
    from rmsnorm_hip._bench import timing

    def per_call_us(fn):        # the fastest of 3 runs of 2000 back-to-back calls, one sync each
        return min(timing.host_time(fn, torch.cuda.synchronize, calls=2000)["host_us_runs"])

    m, n = args.m, args.n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dy, r = torch.randn_like(x), torch.randn_like(x)
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    rstd = rmsnorm_hip.rms_norm(x, w, return_rstd=True)[1]
    rmsnorm_hip.rms_norm(x, w, 1e-6)       # each call once, so that its runner exists
    rmsnorm_hip.rms_norm_backward(dy, x, w, rstd)
    rmsnorm_hip.fused_add_rms_norm(x, r, w)
    env = functional._backend_env()
    fwd_key = _arrays.fast_key(x, w, (False, env))
    bwd_key = _arrays.fast_key(x, w, (env, False), (dy, rstd, None))
    fwd_run = functional._fwd_runners[fwd_key]
    bwd_run = functional._bwd_runners[bwd_key]
    backend = backends.for_array(_arrays.describe(x, "x", None, "x"), "probe")
    ptr, raw_stream = torch.Tensor.data_ptr, torch._C._cuda_getCurrentRawStream
    vector_key = backend.fwd_kernels(m, n, "bfloat16", "bfloat16", False, n)[0]
    kernel, grid, block = backend._fwd_launch_shape(vector_key, m)
    y = torch.empty_like(x)
    params = (x.data_ptr(), w.data_ptr(), y.data_ptr(), 0, m, n, n, 1e-6, 0.0)
    stream = raw_stream(0)

    pieces = {
        "rms_norm (whole call)": lambda: rmsnorm_hip.rms_norm(x, w, 1e-6),
        "torch F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-6),
        "rms_norm_backward (whole call)": lambda: rmsnorm_hip.rms_norm_backward(dy, x, w, rstd),
        "fused_add_rms_norm (whole call)": lambda: rmsnorm_hip.fused_add_rms_norm(x, r, w),
        "fwd: runner alone": lambda: fwd_run(x, w, 1e-6, 0.0),
        "bwd: runner alone": lambda: bwd_run(dy, x, w, rstd, None, 1e-6, 0.0),
        "fast_key (fwd)": lambda: _arrays.fast_key(x, w, (False, env)),
        "fast_key (bwd)": lambda: _arrays.fast_key(x, w, (env, False), (dy, rstd, None)),
        "backend variable": functional._backend_env,
        "x.shape, x.stride()": lambda: (x.dtype, x.shape, x.stride(), x.get_device()),
        "torch.empty (M, N) bf16": lambda: torch.empty((m, n), dtype=torch.bfloat16,
                                                      device=x.device),
        "torch.empty (N,) bf16": lambda: torch.empty((n,), dtype=torch.bfloat16, device=x.device),
        "torch.empty_like (M, N)": lambda: torch.empty_like(x),
        "data_ptr x3": lambda: (ptr(x), ptr(w), ptr(dy)),
        "current raw stream": lambda: raw_stream(0),
        "ArgPack.pack": lambda: kernel.args.pack(params),
        "pack + cuLaunchKernelEx (ctypes)": lambda: backend.launch(kernel, grid, block, params,
                                                                stream),
    }
    results = {}
    for name, fn in pieces.items():
        results[name] = per_call_us(fn)
        print(f"{name:36} {results[name]:7.2f} us", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_breakdown.json"), "w") as f:
        json.dump(dict(m=m, n=n, dtype="bfloat16", us_per_call=results), f, indent=1)


if __name__ == "__main__":
    main()
