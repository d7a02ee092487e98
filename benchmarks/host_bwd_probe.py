"""Why the bench's host column reads more for the backward at M = 32 than at M = 1 (bwd_h200_
20261202_0021.json: 56.8 / 34.0 us; host_breakdown.json, session 15, whole call at M = 32: 31.4):
the bench's own inputs and timer, per M, before and after CUPTI has traced a call, beside the
forward; then a cProfile of the slower case.

    PYTHONPATH=src python3 benchmarks/host_bwd_probe.py [--out DIR]
"""
import argparse
import cProfile
import io
import json
import os
import pstats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch

    import rmsnorm_hip
    from rmsnorm_hip import backends, functional
    from rmsnorm_hip._bench import ops, targets, timing

    target = targets.make_target("cuda")
    sync = torch.cuda.synchronize

    def host_us(fn):
        return timing.host_time(fn, sync)["host_us_runs"]

    inputs = {m: ops.OPS["bwd"].make_inputs(target, m, 4096, "bfloat16", 7 + m) for m in (1, 32)}
    bwd = {m: (lambda a=inputs[m]: rmsnorm_hip.rms_norm_backward(*a)) for m in inputs}
    fwd = {m: (lambda a=inputs[m]: rmsnorm_hip.rms_norm(a[1], a[2], 1e-6)) for m in inputs}
    result = {"before_cupti": {}, "after_cupti": {}}
    for m in (1, 32):
        result["before_cupti"][f"bwd M={m}"] = host_us(bwd[m])
        result["before_cupti"][f"fwd M={m}"] = host_us(fwd[m])
    result["device_us"] = {f"bwd M={m}": timing.cuda_device_time(bwd[m], target.flush, 20)["us"]
                           for m in (1, 32)}
    for m in (1, 32):
        result["after_cupti"][f"bwd M={m}"] = host_us(bwd[m])
        result["after_cupti"][f"fwd M={m}"] = host_us(fwd[m])
    result["bwd_runners"] = len(functional._bwd_runners)
    backend = backends.get("cuda")
    result["bwd_plans"] = [repr(k) for k in backend._bwd_plans]
    for m in (1, 32):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            bwd[m]()
        profile.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        result[f"profile bwd M={m}"] = text.getvalue().splitlines()
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("profile")}, indent=1,
                     default=str))
    for m in (1, 32):
        print("\n".join(result[f"profile bwd M={m}"]))
    with open(os.path.join(args.out, "host_bwd_probe.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
