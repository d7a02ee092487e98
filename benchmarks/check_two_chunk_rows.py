"""GPU check of the backward rows of two chunks a thread: 16-bit N = 16384 (1024 threads, the
weight loaded per chunk), and on CUDA 16-bit N = 8192 and float32 N = 4096 (512 threads, the next
row and dresidual loaded ahead, the weight held).  Unaligned rows (the scalar form; 16-bit words
read an element at a time) give bitwise the aligned rows' (vector) dx and dweight, and both are
within rounding of float64: every weight dtype, M = 1 / 7 / 333, rstd given and recomputed,
with and without dresidual, fresh inputs per case.  (Session 13 ran it as check_n16384.py, N =
16384 only.)

    PYTHONPATH=src python3 benchmarks/check_two_chunk_rows.py [--n 8192,4096]
        # writes $OUT/gpu_check_two_chunk_rows.json
"""
import argparse
import itertools
import json
import os
import sys

import numpy as np
import torch

import rmsnorm_hip
from rmsnorm_hip.reference import rms_norm_backward_ref

# (N, activation dtypes) of the two-chunk rows
CASES = [(16384, (torch.bfloat16, torch.float16)), (8192, (torch.bfloat16, torch.float16)),
         (4096, (torch.float32,))]
DX_TOL, DWEIGHT_TOL = 2e-2, 1e-2    # max-relative dx, norm-relative dweight: bf16 rounding x 5


def aligned_and_unaligned(m, n, dtype):
    """The same random values twice: rows 16-byte aligned, and one element off them."""
    aligned = torch.randn(m, n, device="cuda", dtype=dtype)
    unaligned = torch.empty(m, n + 1, device="cuda", dtype=dtype)[:, 1:]
    unaligned.copy_(aligned)
    return aligned, unaligned


def f64(t):
    return None if t is None else t.float().cpu().numpy().astype(np.float64)


def check(n, dtype, wdtype, m, with_rstd, with_dres):
    (x, xu), (dy, dyu), (dr, dru) = (aligned_and_unaligned(m, n, dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(wdtype)
    rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1] if with_rstd else None
    vec = rmsnorm_hip.rms_norm_backward(dy, x, w, rstd, dresidual=dr if with_dres else None)
    sca = rmsnorm_hip.rms_norm_backward(dyu, xu, w, rstd, dresidual=dru if with_dres else None)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(vec, sca))
    ref_dx, ref_dw = rms_norm_backward_ref(f64(dy), f64(x), f64(w), f64(rstd),
                                           dresidual=f64(dr) if with_dres else None)
    err_dx = float(np.abs(f64(vec[0]) - ref_dx).max() / np.abs(ref_dx).max())
    err_dw = float(np.linalg.norm(f64(vec[1]) - ref_dw) / np.linalg.norm(ref_dw))
    ok = bool(same and err_dx < DX_TOL and err_dw < DWEIGHT_TOL)   # NaN compares False
    return dict(n=n, dtype=str(dtype), weight=str(wdtype), m=m, rstd=with_rstd, dres=with_dres,
                same_bits=same, err_dx=err_dx, err_dw=err_dw, ok=ok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="", help="N,... of CASES to run (default: all)")
    only = {int(v) for v in ap.parse_args().n.split(",") if v}
    torch.manual_seed(0)
    rows = []
    for n, dtypes in CASES:
        if only and n not in only:
            continue
        for dtype in dtypes:
            for wdtype, m, with_rstd, with_dres in itertools.product(
                    sorted({dtype, torch.float32}, key=str), (1, 7, 333), (True, False),
                    (False, True)):
                rows.append(check(n, dtype, wdtype, m, with_rstd, with_dres))
                print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check_two_chunk_rows.json"),
              "w") as f:
        json.dump(rows, f, indent=1)
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed} / {len(rows)} OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
