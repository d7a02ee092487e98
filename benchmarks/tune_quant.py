"""Quantised-forward tuning sweep on a GPU: device time per call of rms_norm_quant (SmoothQuant,
float32 xscale, bf16 x and weight; CUPTI, 256 MB write flush before each call, as the benchmark
measures it) for each 8-bit format under candidate chunks per thread
(kernels/_config.QUANT_CHUNKS_PER_THREAD, patched here).  One JSON line per (shape, format,
chunks, weight_offset); all of them in --out (default $OUT or .)/tune_quant.json.  With
``--offsets 0,1`` each weight_offset runs on weight - offset (the same effective weight): 0 takes
the kernel without the per-element offset add (FwdSpec.offset), any other value the one with it.

    PYTHONPATH=src python3 benchmarks/tune_quant.py [--chunks 3,4] [--offsets 0,1]
"""
import argparse
import json
import os

SHAPES = [(32768, 4096), (16384, 8192), (4096, 4096), (1024, 8192)]
FORMATS = ("int8", "float8_e4m3fn")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--chunks", default="3,4")
    ap.add_argument("--offsets", default="0")
    args = ap.parse_args()

    import torch

    import rmsnorm_hip
    from rmsnorm_hip._bench import timing
    from rmsnorm_hip.kernels import _config

    copy = timing.cuda_copy_bandwidth()["gbps"]
    flush = timing.L2Flush("write")
    rows = []
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        xscale = (1 + 0.2 * torch.rand(n, device="cuda")).float()
        # bf16 x read, 8-bit q and float32 yscale written, weight and xscale read once
        nbytes = m * n * 2 + m * n + m * 4 + n * 2 + n * 4
        for fmt in FORMATS:
            reference = None
            for chunks, offset in ((int(c), float(o)) for c in args.chunks.split(",")
                                   for o in args.offsets.split(",")):
                _config.QUANT_CHUNKS_PER_THREAD["cuda"] = {2: chunks, 4: chunks}
                # runners hold their plans: without this every setting ran the first one's kernel
                # (the run in results/tune_h200_20261130c/tune_quant_chunks2.json)
                rmsnorm_hip.functional.forget_plans()
                w_call = (w.float() - offset).to(torch.bfloat16) if offset else w
                call = lambda: rmsnorm_hip.rms_norm_quant(x, w_call, 1e-6, xscale=xscale,  # noqa
                                                          quant_dtype=fmt, weight_offset=offset)
                q, yscale = call()
                q_bits = q.view(torch.uint8).int()
                if reference is None:
                    reference = (q_bits, yscale)
                # the reduction order moves with the layout: q within a level, yscale ~1 ulp
                q_diff = int((q_bits - reference[0]).abs().max()) if fmt == "int8" else None
                ys_rel = float(((yscale - reference[1]).abs() / reference[1]).max())
                t = timing.cuda_device_time(call, flush)
                row = dict(m=m, n=n, format=fmt, chunks=chunks, weight_offset=offset, us=t["us"],
                           GBps=nbytes / t["us"] / 1e3, int8_level_diff_vs_first=q_diff,
                           yscale_rel_diff_vs_first=ys_rel)
                row["pct_copy"] = 100 * row["GBps"] / copy
                rows.append(row)
                print(json.dumps(row), flush=True)
        del x
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_quant.json"), "w") as f:
        json.dump(dict(copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
