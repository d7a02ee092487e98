# Run: PYTHONPATH=src python3 benchmarks/check_n16384.py (writes $OUT/gpu_check_n16384.json)
"""H200 check of the 16-bit N = 16384 backward rows (2 chunks a thread): aligned (vector, words,
weight per chunk) vs unaligned (scalar words) bitwise, and both against float64."""
import json, os, sys
import numpy as np, torch
import rmsnorm_hip
from rmsnorm_hip.reference import rms_norm_backward_ref
torch.manual_seed(0)
out = []
ok = True
for dtype in (torch.bfloat16, torch.float16):
    for wdt in (dtype, torch.float32):
        for m in (1, 7, 333):
            n = 16384
            def mk():
                """The same values twice: rows 16-byte aligned, and one element off (scalar)."""
                t = torch.randn(m, n, device="cuda", dtype=dtype)
                off = torch.empty(m, n + 1, device="cuda", dtype=dtype)[:, 1:]
                off.copy_(t)
                return t, off
            x, xu = mk(); dy, dyu = mk(); dr, dru = mk()
            w = (1 + 0.1 * torch.randn(n, device="cuda")).to(wdt)
            rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1]
            for r in (rstd, None):
                for dres in (None, True):
                    a = rmsnorm_hip.rms_norm_backward(dy, x, w, r, dresidual=dr if dres else None)
                    b = rmsnorm_hip.rms_norm_backward(dyu, xu, w, r, dresidual=dru if dres else None)
                    same = all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(a, b))
                    f = lambda t: None if t is None else t.float().cpu().numpy().astype(np.float64)
                    ref = rms_norm_backward_ref(f(dy), f(x), f(w), None if r is None else f(r),
                                                dresidual=f(dr) if dres else None)
                    err_dx = float(np.abs(f(a[0]) - ref[0]).max() / np.abs(ref[0]).max())
                    err_dw = float(np.linalg.norm(f(a[1]) - ref[1]) / np.linalg.norm(ref[1]))
                    good = bool(same and err_dx < 2e-2 and err_dw < 1e-2 and np.isfinite(err_dx))
                    ok &= good
                    row = dict(dtype=str(dtype), weight=str(wdt), m=m, rstd=r is not None,
                               dres=bool(dres), same_bits=same, err_dx=err_dx, err_dw=err_dw, ok=good)
                    out.append(row); print(json.dumps(row))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gpu_check_n16384.json"), "w"), indent=1)
print("ALL OK" if ok else "FAILURES", len(out))
sys.exit(0 if ok else 1)
