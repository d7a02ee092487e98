"""Is the slow state of a call the SM's shared-memory / L1 split left by an earlier kernel?  The
driver launches a kernel in the current carveout when the kernel fits it, so a matmul's large
shared-memory split can carry over to ours (a small L1: fewer bytes of loads in flight per SM).
This sets CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT on every loaded kernel of ours
(-1: the default, no preference; 0: the largest L1; 100: the largest shared memory) and times
ours (CUPTI, write flush, median of 20) after a matmul burn, after torch.compile's composite and
after an idle second, with the occupancy the driver reports for the kernel.
DIR/carveout_probe{tag}.json.

    PYTHONPATH=src python3 benchmarks/carveout_probe.py [--case quant:4096x4096] [--carveouts -1,0,100]
"""
import argparse
import json
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--case", default="quant:4096x4096")
    ap.add_argument("--carveouts", default="-1,0,100,-1")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import torch
    from cuda.bindings import driver

    from rmsnorm_hip import _cache
    from rmsnorm_hip._bench import ops, runner, targets
    from rmsnorm_hip.backends.cuda import CudaKernel, _check

    target = targets.make_target("cuda")
    op, shape = args.case.split(":")
    m, n = runner._shape(shape)
    spec = ops.OPS[op]
    impls = runner._implementations(spec, "cuda", True)
    ours, compiled = impls["ours"], impls["torch_compile"]
    inputs = spec.make_inputs(target, m, n, "bfloat16", 1000)
    nbytes = spec.bytes_moved(m, n, target.itemsize("bfloat16"))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    copy_gbps = target.copy_bandwidth()["gbps"]

    def burn():
        for _ in range(50):
            a @ a
        torch.cuda.synchronize()

    before = {"matmul_burn": burn,
              "compile_timed": lambda: target.time(lambda: compiled(*inputs)),
              "idle_1s": lambda: (torch.cuda.synchronize(), time.sleep(1.0))}
    ours(*inputs)
    compiled(*inputs)
    torch.cuda.synchronize()
    kernels = [k for k in _cache.entries().values() if isinstance(k, CudaKernel)]
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    rows = []
    for carveout in (int(c) for c in args.carveouts.split(",")):
        for kernel in kernels:
            _check(driver.cuFuncSetAttribute(kernel.function, attr, carveout),
                   "cuFuncSetAttribute")
        occupancy = {k.name: {threads: _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            k.function, threads, 0), "occupancy") for threads in k.resident} for k in kernels}
        for name, fn in before.items():
            fn()
            t = target.time(lambda: ours(*inputs))
            row = dict(case=args.case, carveout=carveout, before=name, us=t["us"],
                       us_min=t["us_min"], pct_copy=100 * nbytes / t["us"] / 1e3 / copy_gbps,
                       occupancy=occupancy)
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"carveout_probe{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
