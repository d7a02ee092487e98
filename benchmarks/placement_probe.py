"""Does where the arrays lie decide a call's time?  SmoothQuant int8 at one shape (bf16, float32
xscale, as the benchmark's quant case), timed as the benchmark times it (CUPTI device time, 256
MB write flush before each call, median of 20), after the allocator's cache is emptied and a pad
of P MiB is allocated first, so that x and the output q land at other addresses for each P.  A
same-bytes torch copy is timed after each for reference.  One JSON line per P; all of them in
DIR/placement_probe{tag}.json.

    PYTHONPATH=src python3 benchmarks/placement_probe.py [--shape 4096x4096] [--pads 0,2,4,...]
        [--op quant|fused] [--tag _x] [--out DIR]
"""
import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--op", default="quant")
    ap.add_argument("--pads", default=",".join(str(p) for p in range(0, 34, 2)))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import torch

    import rmsnorm_hip
    from rmsnorm_hip._bench import timing

    m, n = (int(v) for v in args.shape.split("x"))
    copy = timing.cuda_copy_bandwidth()["gbps"]
    flush = timing.L2Flush("write")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for pad_mib in (int(p) for p in args.pads.split(",")):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        pad = torch.empty(pad_mib << 20, dtype=torch.uint8, device="cuda") if pad_mib else None
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)
        if args.op == "quant":
            xs = (1 + 0.2 * torch.rand(n, device="cuda", generator=gen)).float()
            nbytes = m * n * 2 + m * n + m * 4 + n * 2 + n * 4

            def fn():
                return rmsnorm_hip.rms_norm_quant(x, w, 1e-6, xscale=xs)  # noqa: B023
        else:
            r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            nbytes = 4 * m * n * 2 + n * 2

            def fn():
                return rmsnorm_hip.fused_add_rms_norm(x, r, w, 1e-6)  # noqa: B023
        out = fn()
        timing.cuda_device_time(fn, flush)
        t = timing.cuda_device_time(fn, flush)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        timing.cuda_device_time(lambda: dst.copy_(src), flush)  # noqa: B023
        c = timing.cuda_device_time(lambda: dst.copy_(src), flush)  # noqa: B023
        row = dict(op=args.op, m=m, n=n, pad_mib=pad_mib, x_ptr=hex(x.data_ptr()),
                   out_ptr=hex(out[0].data_ptr()), us=t["us"], us_min=t["us_min"],
                   us_max=t["us_max"], pct_copy=100 * nbytes / t["us"] / 1e3 / copy,
                   copy_us=c["us"], copy_pct=100 * nbytes / c["us"] / 1e3 / copy)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del pad, x, w, out, src, dst
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"placement_probe{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
