"""How fast can the dweight reduction read its workspace when the workspace is where kernel 1
leaves it (just written, in L2)?  launch_floor.py timed it cold (4.5 us at P = 264, N = 4096,
after a flush); inside the backward it takes 2.5-3.2 us, of which an empty kernel is 0.6.  This
probe writes the workspace with one torch kernel right before each reduction (flush; write;
reduce) and times the reduction's own device time (CUPTI) for:

  lib            the library's dweight_reduce (32 columns x 8 row groups, loads 8 at a time)
  s{C}x{G}       C scalar columns x G row groups a block, every load of a thread issued before
                 its adds, the G group sums combined by a fixed tree in shared memory
  v{Q}x{G}       the same with Q column quads (128-bit loads, 4 columns a thread)

Each variant's result is compared with a float64 sum of the workspace.  One JSON line per
(shape, variant); all of them in OUT/reduce_probe.json.

    PYTHONPATH=src python3 benchmarks/reduce_probe.py [--out DIR]
"""
import argparse
import json
import os

SHAPES = [(264, 4096), (132, 8192)]       # (P, N) of the backward at N = 4096 / 8192 bf16
VARIANTS = ["lib", "s32x8", "s32x16", "s32x32", "v8x32", "v8x64", "v16x32", "v4x64"]


def make_probe_reduce(intr, spec):
    """spec: (vector, column slots C (or quads Q), groups G, rows per thread R)."""
    from numba import float32, int64

    gpu = intr.gpu
    vector, slots, groups, per = spec
    width = 4 if vector else 1
    cols = slots * width
    held = per * width
    depth = groups.bit_length() - 1         # groups is a power of two
    u2f, load_b128 = intr.u32_as_f32, intr.load_b128

    def probe_reduce(ws, out, rows, n):
        tx = gpu.threadIdx.x
        ty = gpu.threadIdx.y
        col = (int64(gpu.blockIdx.x) * slots + tx) * width
        part = gpu.shared.array((groups, cols), float32)
        vals = gpu.local.array(held, float32)
        acc = gpu.local.array(width, float32)
        for e in range(width):
            acc[e] = float32(0.0)
        if col < n:
            for i in range(per):
                r = ty + i * groups
                if r < rows:
                    if vector:
                        w0, w1, w2, w3 = load_b128(ws, r * n + col)
                        vals[i * 4] = u2f(w0)
                        vals[i * 4 + 1] = u2f(w1)
                        vals[i * 4 + 2] = u2f(w2)
                        vals[i * 4 + 3] = u2f(w3)
                    else:
                        vals[i] = ws[r * n + col]
            for i in range(per):
                if ty + i * groups < rows:
                    for e in range(width):
                        acc[e] += vals[i * width + e]
        for e in range(width):
            part[ty, tx * width + e] = acc[e]
        gpu.syncthreads()
        for level in range(depth):
            s = groups >> (level + 1)
            if ty < s:
                for e in range(width):
                    part[ty, tx * width + e] += part[ty + s, tx * width + e]
            gpu.syncthreads()
        if ty == 0 and col < n:
            for e in range(width):
                out[col + e] = part[0, tx * width + e]

    return probe_reduce


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()

    import torch
    from numba import types

    from rmsnorm_hip import backends
    from rmsnorm_hip._bench import timing
    from rmsnorm_hip.kernels import _config, rmsnorm_bwd

    be = backends.get("cuda")
    flush = timing.L2Flush("write")
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    f32p = types.CPointer(types.float32)
    argtypes = (f32p, f32p, types.int64, types.int64)
    rows = []
    for p, n in SHAPES:
        src = torch.randn(p, n, device="cuda", dtype=torch.float32)
        ws = torch.empty_like(src)
        expect = src.double().sum(0)
        for name in args.variants.split(","):
            if name == "lib":
                spec = _config.reduce_spec("float32")
                kernel = be.kernel(rmsnorm_bwd.make_dweight_reduce, spec,
                                   rmsnorm_bwd.reduce_argtypes(spec))
                grid, block = (-(-n // spec.columns), 1, 1), (spec.columns, spec.groups, 1)
            else:
                vector = name[0] == "v"
                slots, groups = (int(v) for v in name[1:].split("x"))
                spec = (vector, slots, groups, -(-p // groups))
                kernel = be.kernel(make_probe_reduce, spec, argtypes)
                grid = (-(-n // (slots * (4 if vector else 1))), 1, 1)
                block = (slots, groups, 1)
            out = torch.full((n,), float("nan"), device="cuda", dtype=torch.float32)

            def call():
                torch.mul(src, 1.0, out=ws)
                be.launch(kernel, grid, block, (ws.data_ptr(), out.data_ptr(), p, n), stream())

            call()
            torch.cuda.synchronize()
            err = ((out.double() - expect).abs().max() / expect.abs().max()).item()
            calls = []
            for _ in range(2):      # the first pass discarded, as the benchmark's warm-up
                calls = timing._split_calls(timing._profile_activities(call, flush, 20),
                                            flush.kernel_names)
            times = sorted(c[-1][1] for c in calls if len(c) == 2)
            row = dict(p=p, n=n, variant=name, us=times[len(times) // 2], us_min=times[0],
                       writer_us=sorted(c[0][1] for c in calls)[len(calls) // 2],
                       threads=block[0] * block[1], blocks=grid[0], rel_err=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "reduce_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
