"""The device time a kernel costs before it does anything, under the benchmark's method (CUPTI,
256 MB write flush before each call): what bounds the backward's second kernel (the dweight
reduction, 2.7-3.2 us at every shape; benchmarks/NOTES.md, session 8) and so what a single-kernel
backward could save.  Times, with numba-cuda:

  empty_1       one block of 32 threads that stores nothing
  empty_grid    the reduction's grid at N = 4096 (128 blocks of 32 x 8 threads), storing nothing
  read_grid     that grid reading the workspace as the reduction does (264 rows of 4096 float32,
                each thread 33 rows of one column, all loads issued before the adds) and storing
                one float per column
  reduce        the library's dweight reduction itself on the same workspace (bf16 dweight)

One JSON line per kernel; all of them in OUT/launch_floor.json.  Session 9's run:
results/tune_h200_20261130_s9/launch_floor.json (0.64 us empty, 4.5 us for the reduction on a
workspace the flush evicted; the same reduction on a workspace just written: reduce_probe.py).

    PYTHONPATH=src python3 benchmarks/launch_floor.py [--out DIR]
"""
import argparse
import json
import os

ROWS, N, COLUMNS, GROUPS = 264, 4096, 32, 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import torch
    from numba import cuda, float32

    from rmsnorm_hip import backends
    from rmsnorm_hip._bench import timing
    from rmsnorm_hip.kernels import _config, rmsnorm_bwd

    @cuda.jit
    def empty(out, never):
        if cuda.threadIdx.x == never:       # never is -1: nothing is stored
            out[0] = 1.0

    @cuda.jit
    def read_columns(ws, out, rows, n):
        col = cuda.blockIdx.x * COLUMNS + cuda.threadIdx.x
        group = cuda.threadIdx.y
        vals = cuda.local.array(33, float32)
        count = (rows - group + GROUPS - 1) // GROUPS
        for i in range(33):
            if i < count:
                vals[i] = ws[(group + i * GROUPS) * n + col]
        total = float32(0.0)
        for i in range(33):
            if i < count:
                total += vals[i]
        part = cuda.shared.array((GROUPS, COLUMNS), float32)
        part[group, cuda.threadIdx.x] = total
        cuda.syncthreads()
        if group == 0:
            for g in range(1, GROUPS):
                total += part[g, cuda.threadIdx.x]
            out[col] = total

    flush = timing.L2Flush("write")
    out = torch.zeros(N, device="cuda", dtype=torch.float32)
    ws = torch.randn(ROWS * N, device="cuda", dtype=torch.float32)
    dweight = torch.empty(N, device="cuda", dtype=torch.bfloat16)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)

    be = backends.get("cuda")
    spec = _config.reduce_spec("bfloat16")
    reduce = be.kernel(rmsnorm_bwd.make_dweight_reduce, spec, rmsnorm_bwd.reduce_argtypes(spec))
    reduce_grid = ((N + spec.columns - 1) // spec.columns, 1, 1)
    reduce_block = (spec.columns, spec.groups, 1)

    cases = {
        "empty_1": lambda: empty[1, 32, stream](out, -1),
        "empty_grid": lambda: empty[N // COLUMNS, (COLUMNS, GROUPS), stream](out, -1),
        "read_grid": lambda: read_columns[N // COLUMNS, (COLUMNS, GROUPS), stream](ws, out, ROWS,
                                                                                   N),
        "reduce": lambda: be.launch(reduce, reduce_grid, reduce_block,
                                    (ws.data_ptr(), dweight.data_ptr(), ROWS, N),
                                    torch.cuda.current_stream().cuda_stream),
    }
    rows = []
    for name, call in cases.items():
        call()
        torch.cuda.synchronize()
        timing.cuda_device_time(call, flush)            # discarded, as the benchmark's warm-up
        t = timing.cuda_device_time(call, flush)
        row = dict(kernel=name, us=t["us"], us_min=t["us_min"], us_max=t["us_max"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_floor.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
