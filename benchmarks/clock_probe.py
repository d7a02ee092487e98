"""Does what ran just before decide a call's time?  repeat_cases (session 24) timed SmoothQuant
int8 at 4096x4096 at 14.6-14.8 us right after torch.compile's composite was timed and at
16.1-16.4 us after anything else.  This times ours after each of several preceding workloads
(the same-bytes copy's timing, torch.compile's, an idle second, a matmul burn), with the SM and
memory clocks and power nvidia-smi reports just before and after our timing.  One JSON line per
(trial, preceding workload); all in DIR/clock_probe{tag}.json.

    PYTHONPATH=src python3 benchmarks/clock_probe.py [--case quant:4096x4096] [--trials 3]
"""
import argparse
import json
import os
import subprocess
import time


def smi():
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,"
                          "temperature.gpu,clocks_event_reasons.active", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--case", default="quant:4096x4096")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import torch

    from rmsnorm_hip._bench import ops, runner, targets

    target = targets.make_target("cuda")
    op, shape = args.case.split(":")
    m, n = runner._shape(shape)
    spec = ops.OPS[op]
    impls = runner._implementations(spec, "cuda", True)
    ours, compiled = impls["ours"], impls["torch_compile"]
    inputs = spec.make_inputs(target, m, n, "bfloat16", 1000)
    nbytes = spec.bytes_moved(m, n, target.itemsize("bfloat16"))
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    copy_gbps = target.copy_bandwidth()["gbps"]

    def burn():
        for _ in range(100):
            a @ a
        torch.cuda.synchronize()

    before = {
        "copy_timed": lambda: target.time(lambda: dst.copy_(src)),
        "compile_timed": lambda: target.time(lambda: compiled(*inputs)),
        "idle_1s": lambda: (torch.cuda.synchronize(), time.sleep(1.0)),
        "matmul_burn": burn,
        "ours_timed": lambda: target.time(lambda: ours(*inputs)),
    }
    for fn in before.values():     # compiles, warms
        fn()
    rows = []
    for trial in range(args.trials):
        for name, fn in before.items():
            fn()
            s0 = smi()
            t = target.time(lambda: ours(*inputs))
            s1 = smi()
            row = dict(case=args.case, trial=trial, before=name, us=t["us"], us_min=t["us_min"],
                       kernels=t["kernels"], kernels_per_call=t["kernels_per_call"],
                       us_max=t["us_max"], pct_copy=100 * nbytes / t["us"] / 1e3 / copy_gbps,
                       smi_before=s0, smi_after=s1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    # the per-call sequence after an idle second and after torch.compile's timing (where a fast
    # start turns slow, if it does); and with a gap between the flush and our call, host-side
    # (synchronize after the flush) or GPU-side (a ~10 us sleep kernel, not counted)
    from rmsnorm_hip._bench import timing

    def synced():
        torch.cuda.synchronize()
        return ours(*inputs)

    def slept():
        torch.cuda._sleep(20000)
        return ours(*inputs)

    for label, prep, fn in (("after_idle", before["idle_1s"], lambda: ours(*inputs)),
                            ("after_compile", before["compile_timed"], lambda: ours(*inputs)),
                            ("sync_gap", None, synced), ("gpu_sleep_gap", None, slept),
                            ("after_ours", before["ours_timed"], lambda: ours(*inputs))):
        if prep:
            prep()
        calls = timing._split_calls(timing._profile_activities(fn, target.flush, 60),
                                    target.flush.kernel_names)
        seq = [round(sum(us for name, us in call if "sleep" not in name.lower()), 2)
               for call in calls]
        rows.append(dict(case=args.case, sequence=label, us_per_call=seq))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"clock_probe{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
