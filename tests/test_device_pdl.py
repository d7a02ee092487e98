"""Programmatic dependent launch (``RMSNORM_HIP_PDL=1``, sm_90): forward kernels launched so
that they may start while the kernel before them in the stream finishes.  They must wait for it
before reading what it wrote: chains of dependent calls behind a producer matmul, eager and
replayed in a CUDA graph, give the bits of the same calls launched without the attribute.

The backend reads the variable when it is made, so the PDL run is a subprocess."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_cuda_torch

pytestmark = pytest.mark.device

torch = require_cuda_torch()

SRC = Path(__file__).resolve().parents[1] / "src"
# decode and prefill rows (streamed and one-shot grids), aligned and unaligned N
SHAPES = ((1, 4096), (32, 4096), (333, 5000), (4096, 4096))
CHAIN = 8

SCRIPT = r"""
import sys
import torch
import rmsnorm_hip
from rmsnorm_hip import backends, _arrays

def run(m, n, graph):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    a = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(256, n, device="cuda", dtype=torch.bfloat16, generator=gen) / 16
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)
    r0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step():
        x = a @ b                       # the producer our first read depends on
        y = x
        for _ in range(CHAIN):          # each call reads the one before it
            y = rmsnorm_hip.rms_norm(y, w, 1e-6)
        h, r = x.clone(), r0.clone()
        for _ in range(CHAIN):
            rmsnorm_hip.fused_add_rms_norm_(h, r, w, 1e-6)
        q, s = rmsnorm_hip.rms_norm_quant(h, w, 1e-6)
        return [y, h, r, q, s, (y.float() @ b.float().T)]   # a consumer after us

    if not graph:
        return step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    g.replay()
    g.replay()
    return outs

results = {}
for m, n in SHAPES:
    for graph in (False, True):
        results[(m, n, graph)] = [t.cpu() for t in run(m, n, graph)]
torch.cuda.synchronize()
backend = backends.for_array(_arrays.describe(torch.empty(1, device="cuda"), "x", None, "x"), "t")
results["pdl"] = backend.pdl
torch.save(results, sys.argv[1])
"""


def _run(tmp_path, pdl):
    path = tmp_path / f"pdl{pdl}.pt"
    script = f"SHAPES = {SHAPES!r}\nCHAIN = {CHAIN}\n" + SCRIPT
    env = dict(os.environ, RMSNORM_HIP_PDL=str(pdl), NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(path)


def test_programmatic_launch_gives_the_bits_of_plain_launches(tmp_path):
    with_pdl, without = _run(tmp_path, 1), _run(tmp_path, 0)
    assert with_pdl.pop("pdl") is (torch.cuda.get_device_capability() >= (9, 0))
    assert without.pop("pdl") is False
    assert with_pdl.keys() == without.keys()
    for key in without:
        for got, want in zip(with_pdl[key], without[key]):
            assert got.shape == want.shape and torch.equal(got.view(torch.uint8),
                                                           want.view(torch.uint8)), key
        # the eager and the replayed graph agree too (a graph that raced would not)
        m, n, graph = key
        if graph:
            for got, want in zip(with_pdl[key], with_pdl[(m, n, False)]):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
