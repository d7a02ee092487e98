"""Host time per call of the fused entry points on a GPU, with and without their repeat-call
runners (functional._fused_runners), beside torch eager composites of the same work: 1000 calls
back to back, then one synchronize; wall-clock per call, median of 3 runs (the benchmark's host
method, benchmarks/NOTES.md).  bf16, N = 4096, M = 1 and 32.  Writes --out (default $OUT or
.)/host_fused.json and prints a table.

    PYTHONPATH=src python3 benchmarks/host_fused.py
"""
import argparse
import json
import os
import statistics
import time


class _NoRunners(dict):
    """Every call takes the validated path (nothing is looked up or kept)."""

    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value):
        pass


def per_call_us(fn, calls=1000, repeats=3):
    import torch
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    import rmsnorm_hip
    from rmsnorm_hip import functional

    n = 4096
    rows = []
    for m in (1, 32):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        xi, ri = x.clone(), r.clone()
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        xs = (1 + 0.2 * torch.rand(n, device="cuda")).float()

        def eager_quant():
            y = F.rms_norm(x.float(), (n,), w.float(), 1e-6) * xs
            scale = y.abs().amax(-1, keepdim=True) / 127
            return torch.clamp(torch.round(y / scale), -127, 127).to(torch.int8), scale

        cases = {
            "fused_add_rms_norm": (lambda: rmsnorm_hip.fused_add_rms_norm(x, r, w, 1e-6),
                                   lambda: F.rms_norm(x + r, (n,), w, 1e-6)),
            "fused_add_rms_norm_": (lambda: rmsnorm_hip.fused_add_rms_norm_(xi, ri, w, 1e-6),
                                    lambda: (ri.add_(xi), xi.copy_(F.rms_norm(ri, (n,), w, 1e-6)))),
            "rms_norm_quant": (lambda: rmsnorm_hip.rms_norm_quant(x, w, 1e-6, xscale=xs),
                               eager_quant),
            "rms_norm": (lambda: rmsnorm_hip.rms_norm(x, w, 1e-6),
                         lambda: F.rms_norm(x, (n,), w, 1e-6)),
        }
        for name, (ours, eager) in cases.items():
            runners = functional._fused_runners
            with_runner = per_call_us(ours)
            functional._fused_runners = _NoRunners()
            try:
                validated = per_call_us(ours)
            finally:
                functional._fused_runners = runners
            row = dict(op=name, m=m, n=n, ours_us=with_runner,
                       ours_validated_us=validated if name != "rms_norm" else None,
                       torch_eager_us=per_call_us(eager))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nhost us per call, bf16 N={n}, 1000 calls + 1 sync, median of 3")
    print(f"{'op':22s} {'M':>3s} {'ours':>8s} {'validated':>10s} {'torch eager':>12s}")
    for row in rows:
        v = row["ours_validated_us"]
        print(f"{row['op']:22s} {row['m']:3d} {row['ours_us']:8.1f} "
              f"{'-' if v is None else f'{v:.1f}':>10s} {row['torch_eager_us']:12.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_fused.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
