"""A call's device time against the idle time between the L2 flush and the call.  The write
flush leaves the L2 full of dirty lines; session 24 found SmoothQuant int8 at 4096x4096 in two
states (14.6-15.0 us and 16.1-16.4 us per call, a whole timing in one or the other, clocks the
same) and always in the fast one when a sleep kernel or a host synchronize separated the flush
from the call.  This times 40 calls of ours and of a same-bytes torch copy after the write flush
with a GPU sleep of 0, 1, 2, 5, 10 and 20 us between (the sleep not counted), and after the read
flush (clean lines); median, min and max per call.  DIR/flush_gap_probe{tag}.json.

    PYTHONPATH=src python3 benchmarks/flush_gap_probe.py [--case quant:4096x4096] [--tag _x]
"""
import json
import statistics

import _probe

SLEEP_CYCLES_PER_US = 1980     # torch.cuda._sleep spins SM clock cycles (H200: 1980 MHz)


def main():
    ap = _probe.parser()
    ap.add_argument("--gaps", default="0,1,2,5,10,20")
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()

    import torch

    from rmsnorm_hip._bench import targets, timing

    target = targets.make_target("cuda")
    case = _probe.load_case(target, args.case)
    copy_gbps = target.copy_bandwidth()["gbps"]
    flushes = {"write": timing.L2Flush("write"), "read": timing.L2Flush("read")}
    impls = {"ours": case.run, "copy_same_bytes": _probe.same_bytes_copy(case.nbytes)}
    rows = []
    settings = [("write", int(g)) for g in args.gaps.split(",")] + [("read", 0)]
    for rnd in range(2):
        for name, impl in impls.items():
            for mode, gap_us in settings:
                def fn(impl=impl, gap_us=gap_us):
                    if gap_us:
                        torch.cuda._sleep(gap_us * SLEEP_CYCLES_PER_US)
                    return impl()
                fn()
                names = set()
                per_call = _probe.per_call_us(fn, flushes[mode], args.calls, names)
                med = statistics.median(per_call)
                row = dict(case=args.case, round=rnd, impl=name, flush=mode, gap_us=gap_us,
                           us=med, us_min=min(per_call), us_max=max(per_call),
                           pct_copy=case.pct_of(med, copy_gbps), names=sorted(names)[:4])
                rows.append(row)
                print(json.dumps(row), flush=True)
    _probe.write(args.out, "flush_gap_probe", args.tag, copy_gbps=copy_gbps, rows=rows)


if __name__ == "__main__":
    main()
