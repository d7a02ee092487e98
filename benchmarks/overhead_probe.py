"""Host overhead per call of rms_norm on torch bf16 tensors (M=1, N=4096): 1000 calls + one sync,
beside torch eager, with a cProfile breakdown of our call and the bare launch costs."""
import cProfile
import pstats
import time

import torch

import rmsnorm_hip
from rmsnorm_hip import _arrays


def per_call_us(fn, iters=1000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
ours = lambda: rmsnorm_hip.rms_norm(x, w, 1e-6)  # noqa: E731
eager = lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)  # noqa: E731
for rep in range(3):
    print(f"rep {rep}: ours {per_call_us(ours):6.2f} us  torch eager {per_call_us(eager):6.2f} us")

print(f"torch.empty:             {per_call_us(lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device=x.device)):6.2f} us")
print(f"fast key:                {per_call_us(lambda: _arrays.fast_key(x, w, False)):6.2f} us")
prof = cProfile.Profile()
prof.enable()
for _ in range(2000):
    ours()
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(12)
