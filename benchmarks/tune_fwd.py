"""Forward tuning sweep on a GPU (writes JSON to $OUT or --out).

Device time per call as the benchmark measures it (CUPTI kernel time, 256 MB write flush before
each call; rmsnorm_hip._bench.timing), for each shape under candidate geometries (chunks per
thread: kernels/_config.CHUNKS_PER_THREAD, patched here) and forms (worker processes with their
own environment).  Results feed the frozen constants in _config.py; the persistent-grid and
access-form sweeps in docs/performance.md ran earlier versions of this script.
"""
import argparse
import json
import os
import subprocess
import sys

SHAPES = [(32768, 4096), (16384, 8192), (8192, 8192), (4096, 4096), (1024, 8192), (4096, 5000)]
# worker variants: the environment each runs under (one process each, since the intrinsics are
# built once per process); add an entry to compare a knob read at import
FORMS = [("one-shot", {})]
CHUNKS = (2, 3, 4)


def worker():
    import torch

    import rmsnorm_hip
    from rmsnorm_hip._bench import timing
    from rmsnorm_hip.kernels import _config

    flush = timing.L2Flush("write")
    cases = [(m, n, torch.bfloat16) for m, n in SHAPES] + [(4096, 4096, torch.float32)]
    for m, n, dtype in cases:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
        nbytes = 2 * m * n * x.element_size() + n * w.element_size()
        for chunks in CHUNKS:
            _config.CHUNKS_PER_THREAD = {2: chunks, 4: chunks}
            rmsnorm_hip.functional.forget_plans()
            us = timing.cuda_device_time(lambda: rmsnorm_hip.rms_norm(x, w, 1e-6), flush)
            us = us["us"]
            print(json.dumps(dict(m=m, n=n, dtype=str(dtype), chunks=chunks, us=us,
                                  GBps=nbytes / us / 1e3)), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker()
    from rmsnorm_hip._bench import timing
    copy = timing.cuda_copy_bandwidth()["gbps"]
    rows = []
    for form, form_env in FORMS:
        env = dict(os.environ, **form_env)
        done = subprocess.run([sys.executable, __file__, "--worker"], env=env, text=True,
                              capture_output=True)
        if done.returncode:
            print(f"{form} failed:\n{done.stderr[-2000:]}", flush=True)
            continue
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                rows.append(dict(json.loads(line), form=form))
    with open(os.path.join(args.out, "tune_fwd.json"), "w") as f:
        json.dump(dict(copy=copy, rows=rows), f, indent=1)
    copy_gbps = copy
    print(f"copy: {copy:.0f} GB/s")
    shapes = sorted({(r["m"], r["n"], r["dtype"]) for r in rows}, key=lambda s: -s[0] * s[1])
    header = [f"{f}:{c}" for f, _ in FORMS for c in CHUNKS]
    print("shape               " + " ".join(f"{h:>14s}" for h in header))
    for m, n, dt in shapes:
        cells = []
        for f, _ in FORMS:
            for c in CHUNKS:
                r = [r for r in rows
                     if (r["m"], r["n"], r["dtype"], r["form"], r["chunks"]) == (m, n, dt, f, c)]
                cells.append(f"{r[0]['GBps']:>8.0f}"
                             + (f"({100 * r[0]['GBps'] / copy_gbps:3.0f})"
                                if r and copy_gbps else "     ")
                             if r else f"{'-':>14s}")
        print(f"{m}x{n} {dt[6:]:9s} " + " ".join(f"{c:>14s}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
