"""Quick GPU correctness probe of the forward on torch, CuPy and numba device arrays: contract
tolerances, batch/stride/alignment bitwise invariance, poisoned outputs, M == 0."""
import sys

import numpy as np
import torch

import rmsnorm_hip
from rmsnorm_hip import reference

failures = []


def check(name, ok):
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        failures.append(name)


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for n in (1, 3, 8, 127, 4096, 4097, 5000, 8192, 65536, 65537, 262144):
        m = 333 if n <= 8192 else 7
        wide = torch.randn(m, n + 24, device="cuda", dtype=dtype)
        x = wide[:, 8:8 + n]                       # row-strided, 16-byte aligned start
        xu = wide[:, 1:1 + n]                      # unaligned start -> scalar path
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
        y, rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)
        y_c = rmsnorm_hip.rms_norm(x.contiguous(), w, 1e-6)
        check(f"{dtype} n={n} strided == contiguous", torch.equal(bits(y), bits(y_c)))
        single = torch.stack([rmsnorm_hip.rms_norm(x[i:i + 1], w, 1e-6)[0] for i in (0, m // 2, m - 1)])
        check(f"{dtype} n={n} M=1 rows == batch rows",
              torch.equal(bits(single), bits(y[[0, m // 2, m - 1]])))
        yu = rmsnorm_hip.rms_norm(xu, w, 1e-6)
        yu_ref = rmsnorm_hip.rms_norm(xu.contiguous(), w, 1e-6)
        check(f"{dtype} n={n} unaligned == contiguous", torch.equal(bits(yu), bits(yu_ref)))
        out = torch.full_like(x, float("nan"))
        rmsnorm_hip.rms_norm(x, w, 1e-6, out=out)
        check(f"{dtype} n={n} out= fully written", torch.equal(bits(out), bits(y)))
        xd = x.double()
        ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        rel = float((y.double() - ref).norm() / ref.norm())
        check(f"{dtype} n={n} rel err {rel:.2e}", rel < (1e-5 if dtype == torch.float32 else 8e-3))

x = torch.randn(0, 4096, device="cuda", dtype=torch.bfloat16)
check("M == 0", rmsnorm_hip.rms_norm(x).shape == (0, 4096))
try:
    import cupy
    xc = cupy.asarray(np.random.default_rng(0).standard_normal((5, 4096)).astype(np.float32))
    import ml_dtypes
    xb = xc.astype(cupy.float32).get().astype(ml_dtypes.bfloat16).view(np.uint16)
    yc = rmsnorm_hip.rms_norm(cupy.asarray(xb), None, dtype="bfloat16")
    check(f"cupy bf16 -> {type(yc).__name__} {yc.dtype}", isinstance(yc, cupy.ndarray) and yc.dtype == np.uint16)
    ref, _ = reference.rms_norm_ref(xb.view(ml_dtypes.bfloat16), None, 1e-6)
    got = yc.get().view(ml_dtypes.bfloat16).astype(np.float64)
    check("cupy bf16 values", np.linalg.norm(got - ref) / np.linalg.norm(ref) < 8e-3)
    from numba import cuda
    xn = cuda.to_device(np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32))
    yn = rmsnorm_hip.rms_norm(xn)
    check(f"numba device array -> {type(yn).__name__}", hasattr(yn, "copy_to_host"))
except ImportError as e:
    print("cupy/numba part skipped:", e)
print("FAILURES:", failures if failures else "none")
sys.exit(1 if failures else 0)
