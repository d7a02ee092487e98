"""A call's device time against the idle time between the L2 flush and the call.  The write
flush leaves the L2 full of dirty lines; session 24 found SmoothQuant int8 at 4096x4096 in two
states (14.6-15.0 us and 16.1-16.4 us per call, a whole timing in one or the other, clocks the
same) and always in the fast one when a sleep kernel or a host synchronize separated the flush
from the call.  This times 40 calls of ours and of a same-bytes torch copy after the write flush
with a GPU sleep of 0, 1, 2, 5, 10 and 20 us between (the sleep not counted), and after the read
flush (clean lines); median, min and max per call.  DIR/flush_gap_probe{tag}.json.

    PYTHONPATH=src python3 benchmarks/flush_gap_probe.py [--case quant:4096x4096] [--tag _x]
"""
import argparse
import json
import os
import statistics

SLEEP_CYCLES_PER_US = 1980     # torch.cuda._sleep spins SM clock cycles (H200: 1980 MHz)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--case", default="quant:4096x4096")
    ap.add_argument("--gaps", default="0,1,2,5,10,20")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import torch

    from rmsnorm_hip._bench import ops, runner, targets, timing

    target = targets.make_target("cuda")
    op, shape = args.case.split(":")
    m, n = runner._shape(shape)
    spec = ops.OPS[op]
    ours = runner._implementations(spec, "cuda", False)["ours"]
    inputs = spec.make_inputs(target, m, n, "bfloat16", 1000)
    nbytes = spec.bytes_moved(m, n, target.itemsize("bfloat16"))
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = target.copy_bandwidth()["gbps"]
    flushes = {"write": timing.L2Flush("write"), "read": timing.L2Flush("read")}
    impls = {"ours": lambda: ours(*inputs), "copy_same_bytes": lambda: dst.copy_(src)}
    rows = []
    settings = [("write", int(g)) for g in args.gaps.split(",")] + [("read", 0)]
    for rnd in range(2):
        for name, impl in impls.items():
            for mode, gap_us in settings:
                def fn(impl=impl, gap_us=gap_us):
                    if gap_us:
                        torch.cuda._sleep(gap_us * SLEEP_CYCLES_PER_US)
                    return impl()
                flush = flushes[mode]
                fn()
                calls = timing._split_calls(timing._profile_activities(fn, flush, args.calls),
                                            flush.kernel_names)
                # the sleep kernel is torch's spin kernel: count only the call's own activities
                per_call = [sum(us for kname, us in call if "spin" not in kname.lower()
                                and "sleep" not in kname.lower()) for call in calls]
                med = statistics.median(per_call)
                row = dict(case=args.case, round=rnd, impl=name, flush=mode, gap_us=gap_us,
                           us=med, us_min=min(per_call), us_max=max(per_call),
                           pct_copy=100 * nbytes / med / 1e3 / copy_gbps,
                           names=sorted({k for call in calls for k, _ in call})[:4])
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"flush_gap_probe{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
