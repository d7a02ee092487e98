"""Forward launch-geometry sweep on a GPU (writes JSON to $OUT or --out).

For each shape, times the forward kernel under candidate geometries (chunks per thread, block
threads) by patching the two constants of kernels/_config.py that decide them, with CUDA events
around each call and a 256 MB L2 flush before it; also the copy ceiling, torch eager, registers of
every catalog variant and host overhead per call.  Results feed the frozen table in _config.py.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import rmsnorm_hip
from rmsnorm_hip import _cache, backends
from rmsnorm_hip.kernels import _config, catalog

SHAPES = [(32768, 4096), (16384, 8192), (8192, 8192), (4096, 4096), (1024, 8192), (4096, 5000)]
FLUSH = None


def flush():
    global FLUSH
    if FLUSH is None:
        FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    FLUSH.add_(1)


def device_us(fn, iters=30):
    times = []
    for _ in range(3):
        fn()
    for _ in range(iters):
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def copy_gbps():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = device_us(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / us / 1e3


def reset_plans():
    for b in list(backends._backends.values()):
        if hasattr(b, "_plans"):
            b._plans.clear()


def sweep(out):
    res = {"copy_GBps": copy_gbps(), "rows": []}
    print(f"copy {res['copy_GBps']:.0f} GB/s", flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        for m, n in (SHAPES if dtype == torch.bfloat16 else [(4096, 4096), (16384, 8192)]):
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
            nbytes = 2 * m * n * x.element_size() + n * w.element_size()
            t_torch = device_us(lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-6))
            row = dict(m=m, n=n, dtype=str(dtype), torch_us=t_torch, variants=[])
            seen = set()
            for cpt in (1, 2, 3, 4):
                for block in (128, 256, 512):
                    _config.CHUNKS_PER_THREAD, _config.BLOCK_THREADS = cpt, block
                    reset_plans()
                    layout = _config.row_layout(n, "bfloat16" if dtype == torch.bfloat16 else "float32")
                    geometry = (layout, _config.rows_per_block(layout))
                    if geometry in seen:
                        continue
                    seen.add(geometry)
                    us = device_us(lambda: rmsnorm_hip.rms_norm(x, w, 1e-6))
                    gbps = nbytes / us / 1e3
                    row["variants"].append(dict(cpt=cpt, block=block, threads=layout.threads,
                                                per_thread=layout.chunks_per_thread, us=us, GBps=gbps,
                                                pct=100 * gbps / res["copy_GBps"]))
            best = max(row["variants"], key=lambda v: v["GBps"])
            print(f"{m}x{n} {dtype}: torch {nbytes / t_torch / 1e3:6.0f} GB/s | best cpt={best['cpt']} "
                  f"block={best['block']} T={best['threads']} {best['GBps']:6.0f} GB/s "
                  f"{best['pct']:5.1f}% | " + " ".join(f"{v['cpt']}/{v['block']}:{v['pct']:.0f}"
                                                     for v in row["variants"]), flush=True)
            res["rows"].append(row)
    _config.CHUNKS_PER_THREAD, _config.BLOCK_THREADS = 2, 256
    reset_plans()
    return res


def registers():
    be = backends.get("cuda", 0)
    out = []
    for v in catalog.variants():
        k = be.kernel(v.builder, v.spec, v.argtypes)
        out.append(dict(label=v.label, **k.attributes()))
    worst = max(out, key=lambda r: r["registers"])
    spills = [r for r in out if r["local_bytes"]]
    print(f"{len(out)} variants: max registers {worst['registers']} ({worst['label']}), "
          f"local-memory variants {len(spills)}", flush=True)
    return out


def overhead():
    res = []
    for m in (1, 32):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
        for name, fn in (("rmsnorm_hip", lambda: rmsnorm_hip.rms_norm(x, w, 1e-6)),
                         ("torch", lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6))):
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(1000):
                fn()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t) / 1000 * 1e6
            res.append(dict(m=m, impl=name, us_per_call=us))
            print(f"overhead M={m} {name}: {us:.2f} us/call", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    result = dict(gpu=torch.cuda.get_device_name(), overhead=overhead(), sweep=sweep(args.out),
                  registers=registers())
    with open(os.path.join(args.out, "tune_fwd.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
