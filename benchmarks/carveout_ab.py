"""A/B of the shared-memory / L1 split our kernels ask for: no preference (-1, the driver keeps
or picks a split) against the largest L1 (0), per case, in alternating order over several rounds
(CUPTI device time, write flush, median of 20, as the benchmark).  carveout_probe (session 24)
found the largest shared split (100) 4-12% slower for SmoothQuant and the fused add at 4096x4096,
and the fused add a point or two ahead at 0.  DIR/carveout_ab{tag}.json.

    PYTHONPATH=src python3 benchmarks/carveout_ab.py [--cases fused:4096x4096,...] [--rounds 5]
"""
import json
import statistics

import _probe


def main():
    ap = _probe.parser(case=False)
    ap.add_argument("--cases", default="fused:4096x4096,quant:4096x4096,fwd:4096x4096,"
                                       "fused:32768x4096,fwd:1024x8192")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from rmsnorm_hip._bench import targets

    target = targets.make_target("cuda")
    copy_gbps = target.copy_bandwidth()["gbps"]
    rows, summary = [], []
    for name in args.cases.split(","):
        case = _probe.load_case(target, name)
        case.run()      # loads its kernels, which set_carveout then reaches
        times = {-1: [], 0: []}
        for rnd in range(args.rounds):
            for carveout in ((-1, 0) if rnd % 2 == 0 else (0, -1)):
                _probe.set_carveout(carveout)
                target.time(case.run)       # discarded
                us = target.time(case.run)["us"]
                times[carveout].append(us)
                rows.append(dict(case=name, round=rnd, carveout=carveout, us=us,
                                 pct_copy=case.pct_of(us, copy_gbps)))
                print(json.dumps(rows[-1]), flush=True)
        _probe.set_carveout(-1)
        for carveout, us in times.items():
            pct = [case.pct_of(u, copy_gbps) for u in us]
            summary.append(dict(case=name, carveout=carveout, us_median=statistics.median(us),
                                pct_median=statistics.median(pct), pct_min=min(pct),
                                pct_max=max(pct)))
        del case
        target.free_memory()
    print(f"copy {copy_gbps:.0f} GB/s; % of copy, median [min, max] of {args.rounds} rounds")
    for s in summary:
        print(f"  {s['case']:18s} carveout {s['carveout']:>2}: {s['us_median']:8.2f} us "
              f"{s['pct_median']:6.1f} [{s['pct_min']:.1f}, {s['pct_max']:.1f}]")
    _probe.write(args.out, "carveout_ab", args.tag, copy_gbps=copy_gbps, rows=rows,
                 summary=summary)


if __name__ == "__main__":
    main()
