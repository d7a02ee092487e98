"""Same-bytes copy ceiling on a GPU: the device time (CUPTI, L2 flushed before each call, as the
benchmark measures) of a torch device-to-device copy that moves the bytes an op moves at a shape
(read + written), as % of the 2 GiB copy bandwidth; with the benchmark's write flush and with a
read-only flush.  What no kernel of that op and shape is expected to beat: at small shapes the
write flush's dirty lines and the launch ramp cost a copy too.  Each case is timed twice and the
first timing discarded, as the benchmark's warm-up pass does (runner._warm_up; the first
ceilings, results/tune_h200_20261130a/, timed once right after a larger case, came out below
what the forward later reached).
Writes copy_same_bytes{tag}.json.

    PYTHONPATH=src python3 benchmarks/copy_ceiling.py [--out DIR] [--flush write,read]
        [--shapes MxN,...] [--tag _x]
"""
import argparse
import json
import os

SHAPES = [(32768, 4096), (16384, 8192), (8192, 8192), (4096, 4096), (1024, 8192), (264, 4096)]
# bytes moved per element of x, bf16: fwd reads x, writes y; bwd reads x, dy, writes dx (+
# dresidual read); fused reads x, residual, writes y, residual_out; SmoothQuant int8 reads x
# (2 B), writes q (1 B)
BYTES_PER_ELEMENT = {"fwd": 4, "bwd": 6, "bwd_dres": 8, "fused": 8, "quant": 3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--flush", default="write,read", help="L2 flush modes, comma separated")
    ap.add_argument("--shapes", default="", help="MxN,... (default: SHAPES)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    args = ap.parse_args()

    import torch

    from rmsnorm_hip._bench import timing
    from rmsnorm_hip._bench.runner import _shape   # 'MxN' -> (M, N), checked

    shapes = [_shape(s) for s in args.shapes.split(",")] if args.shapes else SHAPES

    copy = timing.cuda_copy_bandwidth()["gbps"]
    rows = []
    for mode in args.flush.split(","):
        flush = timing.L2Flush(mode)
        for m, n in shapes:
            for op, per in BYTES_PER_ELEMENT.items():
                nbytes = per * m * n
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
                dst = torch.empty_like(src)
                timing.cuda_device_time(lambda: dst.copy_(src), flush)  # noqa: B023 (warm-up)
                t = timing.cuda_device_time(lambda: dst.copy_(src), flush)  # noqa: B023
                row = dict(flush=mode, m=m, n=n, op=op, bytes=nbytes, us=t["us"],
                           pct_copy=100 * nbytes / t["us"] / 1e3 / copy)
                rows.append(row)
                print(json.dumps(row), flush=True)
                src = dst = None        # free the buffers before the next size
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"copy_same_bytes{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
