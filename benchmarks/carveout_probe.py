"""Is the slow state of a call the SM's shared-memory / L1 split left by an earlier kernel?  The
driver launches a kernel in the current carveout when the kernel fits it, so a matmul's large
shared-memory split can carry over to ours (a small L1: fewer bytes of loads in flight per SM).
This sets CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT on every loaded kernel of ours
(-1: the default, no preference; 0: the largest L1; 100: the largest shared memory) and times
ours (CUPTI, write flush, median of 20) after a matmul burn, after torch.compile's composite and
after an idle second, with the occupancy the driver reports for the kernel.
DIR/carveout_probe{tag}.json.

    PYTHONPATH=src python3 benchmarks/carveout_probe.py [--case quant:4096x4096]
        [--carveouts -1,0,100]
"""
import json
import time

import _probe


def main():
    ap = _probe.parser()
    ap.add_argument("--carveouts", default="-1,0,100,-1")
    args = ap.parse_args()

    import torch
    from cuda.bindings import driver

    from rmsnorm_hip._bench import targets
    from rmsnorm_hip.backends.cuda import _check

    target = targets.make_target("cuda")
    case = _probe.load_case(target, args.case, peers=True)
    copy_gbps = target.copy_bandwidth()["gbps"]
    before = {"matmul_burn": _probe.matmul_burn(50),
              "compile_timed": lambda: target.time(lambda: case.run("torch_compile")),
              "idle_1s": lambda: (torch.cuda.synchronize(), time.sleep(1.0))}
    case.run()
    case.run("torch_compile")
    torch.cuda.synchronize()
    rows = []
    for carveout in (int(c) for c in args.carveouts.split(",")):
        kernels = _probe.set_carveout(carveout)
        occupancy = {k.name: {threads: _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            k.function, threads, 0), "occupancy") for threads in k.resident} for k in kernels}
        for name, fn in before.items():
            fn()
            t = target.time(case.run)
            row = dict(case=args.case, carveout=carveout, before=name, us=t["us"],
                       us_min=t["us_min"], pct_copy=case.pct_of(t["us"], copy_gbps),
                       occupancy=occupancy)
            rows.append(row)
            print(json.dumps(row), flush=True)
    _probe.write(args.out, "carveout_probe", args.tag, copy_gbps=copy_gbps, rows=rows)


if __name__ == "__main__":
    main()
