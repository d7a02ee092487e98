"""A/B of the shared-memory / L1 split our kernels ask for: no preference (-1, the driver keeps
or picks a split) against the largest L1 (0), per case, in alternating order over several rounds
(CUPTI device time, write flush, median of 20, as the benchmark).  carveout_probe (session 24)
found the largest shared split (100) 4-12% slower for SmoothQuant and the fused add at 4096x4096,
and the fused add a point or two ahead at 0.  DIR/carveout_ab{tag}.json.

    PYTHONPATH=src python3 benchmarks/carveout_ab.py [--cases fused:4096x4096,...] [--rounds 5]
"""
import argparse
import json
import os
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="fused:4096x4096,quant:4096x4096,fwd:4096x4096,"
                                       "fused:32768x4096,fwd:1024x8192")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    from cuda.bindings import driver

    from rmsnorm_hip import _cache
    from rmsnorm_hip._bench import ops, runner, targets
    from rmsnorm_hip.backends.cuda import CudaKernel, _check

    target = targets.make_target("cuda")
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    copy_gbps = target.copy_bandwidth()["gbps"]
    rows, summary = [], []
    for case in args.cases.split(","):
        op, shape = case.split(":")
        m, n = runner._shape(shape)
        spec = ops.OPS[op]
        ours = runner._implementations(spec, "cuda", False)["ours"]
        inputs = spec.make_inputs(target, m, n, "bfloat16", 1000)
        nbytes = spec.bytes_moved(m, n, target.itemsize("bfloat16"))
        ours(*inputs)
        kernels = [k for k in _cache.entries().values() if isinstance(k, CudaKernel)]

        def use(carveout):
            for kernel in kernels:
                _check(driver.cuFuncSetAttribute(kernel.function, attr, carveout),
                       "cuFuncSetAttribute")

        times = {-1: [], 0: []}
        for rnd in range(args.rounds):
            for carveout in ((-1, 0) if rnd % 2 == 0 else (0, -1)):
                use(carveout)
                target.time(lambda: ours(*inputs))       # noqa: B023 (discarded)
                us = target.time(lambda: ours(*inputs))["us"]  # noqa: B023
                times[carveout].append(us)
                rows.append(dict(case=case, round=rnd, carveout=carveout, us=us,
                                 pct_copy=100 * nbytes / us / 1e3 / copy_gbps))
                print(json.dumps(rows[-1]), flush=True)
        use(-1)
        for carveout, us in times.items():
            pct = [100 * nbytes / u / 1e3 / copy_gbps for u in us]
            summary.append(dict(case=case, carveout=carveout, us_median=statistics.median(us),
                                pct_median=statistics.median(pct), pct_min=min(pct),
                                pct_max=max(pct)))
        del inputs
        target.free_memory()
    print(f"copy {copy_gbps:.0f} GB/s; % of copy, median [min, max] of {args.rounds} rounds")
    for s in summary:
        print(f"  {s['case']:18s} carveout {s['carveout']:>2}: {s['us_median']:8.2f} us "
              f"{s['pct_median']:6.1f} [{s['pct_min']:.1f}, {s['pct_max']:.1f}]")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"carveout_ab{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
