"""Host-side profile of repeat calls (cProfile), to find where per-call host time goes.

    PYTHONPATH=src python3 benchmarks/profile_host.py [--op bwd|fwd|fused|quant|autograd|eager]
                                                      [--m 32]

``autograd``: a fwd+bwd step through rmsnorm_hip.torch.rms_norm (``y.backward(dy)``, grads reset
each step); ``eager``: the same step through torch's F.rms_norm, for comparison.
"""
import argparse
import cProfile
import pstats
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="bwd")
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    import torch

    import rmsnorm_hip
    x = torch.randn(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    dy, r = torch.randn_like(x), torch.randn_like(x)
    w = torch.ones(args.n, device="cuda", dtype=torch.bfloat16)
    rstd = rmsnorm_hip.rms_norm(x, w, return_rstd=True)[1]
    import rmsnorm_hip.torch as rt
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step(forward):
        def run():
            xg.grad = wg.grad = None
            forward(xg, wg).backward(dy)
        return run

    eager = step(lambda a, b: torch.nn.functional.rms_norm(a, (args.n,), b, 1e-6))
    call = {"autograd": step(lambda a, b: rt.rms_norm(a, b, 1e-6)), "eager": eager,
            "bwd": lambda: rmsnorm_hip.rms_norm_backward(dy, x, w, rstd),
            "fwd": lambda: rmsnorm_hip.rms_norm(x, w),
            "fused": lambda: rmsnorm_hip.fused_add_rms_norm(x, r, w),
            "quant": lambda: rmsnorm_hip.rms_norm_quant(x, w)}[args.op]
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"{args.op} M={args.m} N={args.n}: {1e6 * (time.perf_counter() - start) / args.calls:.1f}"
          " us per call (host, back to back)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        call()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(22)


if __name__ == "__main__":
    main()
