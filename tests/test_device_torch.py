"""The GPU tier of the torch adapter (mark ``device``): torch.compile(fullgraph=True) of a
transformer block with no graph breaks and no recompilation across batch sizes, CUDA graph
capture and replay bitwise equal to eager (forward, and forward + backward), tensors on cuda:1
while cuda:0 is current, and 50 bf16 training steps against torch.nn.RMSNorm.  Run with the
simulator off:

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -m device tests/test_device_torch.py

Skipped (with the reason) where there is no CUDA GPU or the simulator is on; the cuda:1 test
needs two GPUs.
"""
import copy

import numpy as np
import pytest

from conftest import assert_close, require_cuda_torch
from test_backward import assert_dweight, assert_dx

pytestmark = pytest.mark.device

torch = require_cuda_torch()

import rmsnorm_hip  # noqa: E402
from rmsnorm_hip import reference  # noqa: E402
from rmsnorm_hip import torch as rt  # noqa: E402
from _torch_models import Block, TinyLM, markov_batches, train  # noqa: E402

F = torch.nn.functional


def bits(t):
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (
        f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}")
    diff = (bits(a) != bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ bitwise"


def leaf(t):
    return t.detach().clone().requires_grad_()


def host64(t):
    return t.detach().double().cpu().numpy()


def swapped_block(d=256, heads=4, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return rt.replace_rmsnorm(Block(d, heads)).to("cuda", dtype)


# ---- the adapter on the GPU against float64 ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", ["eager", "ops"])
def test_grads_against_float64(dtype, path):
    m, n = 333, 4096
    x = leaf(torch.randn(m, n, device="cuda", dtype=dtype))
    w = leaf((1 + 0.1 * torch.randn(n, device="cuda")).to(dtype))
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    if path == "eager":
        y = rt.rms_norm(x, w, 1e-6)
    else:
        y = torch.ops.rmsnorm_hip.rms_norm_fwd(x, w, 1e-6, 0.0)[0]
    y.backward(dy)
    name = str(dtype).replace("torch.", "")
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = F.rms_norm(x64, (n,), w64, 1e-6)
    y64.backward(dy.double())
    assert_close(host64(y), host64(y64), name)
    rstd = reference.rms_norm_ref(x.detach().cpu(), None, 1e-6)[1]
    assert_dx(x.grad.cpu(), dy.cpu(), x.detach().cpu(), w.detach().cpu(), rstd, host64(x64.grad),
              name)
    assert_dweight(w.grad.cpu(), host64(w64.grad), name)


# ---- torch.compile -------------------------------------------------------------------------------

def test_compile_fullgraph_no_graph_break_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    block = swapped_block()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    for batch, seq in ((2, 64), (3, 64), (5, 64)):
        x = leaf(torch.randn(batch, seq, 256, device="cuda"))
        torch._dynamo.mark_dynamic(x, 0)
        dout = torch.randn(x.shape, device="cuda")
        out = compiled(x)
        out.backward(dout)
        grads = {name: p.grad for name, p in block.named_parameters()}
        block.zero_grad(set_to_none=True)
        x_eager = leaf(x)
        eager = block(x_eager)
        eager.backward(dout)
        # inductor fuses the other ops differently: equal to float32 rounding, not bitwise
        torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-4, atol=1e-4)
        for name, p in block.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-3)
        block.zero_grad(set_to_none=True)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 batch sizes"
    explain = torch._dynamo.explain(block)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1


def test_compile_fused_add_and_quant_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)

    def step(x, residual):
        y, residual = rt.fused_add_rms_norm(x, residual, w, 1e-6)
        q, yscale = rt.rms_norm_quant(y * 2, w, 1e-6, quant_dtype="float8_e4m3fn")
        return y, residual, q, yscale

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for m in (7, 33, 128):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
        for got, expected, what in zip(compiled(x, r), step(x, r),
                                       ("y", "residual_out", "q", "yscale")):
            assert_same_bits(got, expected, f"M={m} {what}")
    assert counter.frame_count == 1


# ---- CUDA graphs ---------------------------------------------------------------------------------

def _call(kind, norm, x, r):
    if kind == "module":
        return norm(x)
    if kind == "fused":
        y, ro = rt.fused_add_rms_norm(x, r, norm.weight, 1e-6)
        return y + ro
    return torch.ops.rmsnorm_hip.rms_norm_fwd(x, norm.weight, 1e-6, 0.0)[0]


@pytest.mark.parametrize("kind", ["module", "fused", "ops"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
def test_cuda_graph_replay_is_bitwise_eager(kind, backward):
    m, n = 96, 4096
    norm = rt.RMSNorm(n, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, device="cuda"))
    norm.weight.requires_grad_(backward)
    static = {name: torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
              for name in ("x", "residual", "dy")}
    static["x"].requires_grad_(backward)
    static["residual"].requires_grad_(backward and kind == "fused")

    def run():
        y = _call(kind, norm, static["x"], static["residual"])
        if backward:
            y.backward(static["dy"])
        return y

    def clear_grads():
        static["x"].grad = static["residual"].grad = norm.weight.grad = None

    side = torch.cuda.Stream()          # warm-up off the capture: kernel builds, allocator
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
            clear_grads()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run()
    # the graph writes its gradients into these buffers on every replay
    graph_grads = {"dx": static["x"].grad, "dresidual": static["residual"].grad,
                   "dweight": norm.weight.grad}
    clear_grads()

    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            for t in static.values():
                t.copy_(torch.randn(m, n, device="cuda"))
        graph.replay()
        x = static["x"].detach().clone().requires_grad_(backward)
        r = static["residual"].detach().clone().requires_grad_(backward and kind == "fused")
        y = _call(kind, norm, x, r)
        assert_same_bits(static_y, y, f"{kind} y, replay {seed}")
        if backward:
            y.backward(static["dy"])
            eager_grads = {"dx": x.grad, "dresidual": r.grad, "dweight": norm.weight.grad}
            for what, expected in eager_grads.items():
                if expected is not None:
                    assert_same_bits(graph_grads[what], expected, f"{kind} {what}, replay {seed}")
            norm.weight.grad = None


# ---- another device than the current one ---------------------------------------------------------

@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_cuda1_while_cuda0_is_current():
    """On its default stream: a stream context of another device would make that device current."""
    torch.cuda.set_device(0)
    results = {}
    for index in (1, 0):
        device = torch.device("cuda", index)
        torch.manual_seed(0)
        x = leaf(torch.randn(65, 4096, dtype=torch.bfloat16).to(device))
        r = leaf(torch.randn(65, 4096, dtype=torch.bfloat16).to(device))
        norm = rt.RMSNorm(4096, device=device, dtype=torch.bfloat16)
        y, ro = rt.fused_add_rms_norm(x, r, norm.weight, 1e-6)
        out = norm(y) + ro
        assert torch.cuda.current_device() == 0, "the forward changed the current device"
        out.backward(torch.ones_like(out))
        q, yscale = rt.rms_norm_quant(ro.detach(), norm.weight.detach())
        assert torch.cuda.current_device() == 0, "the current device was changed"
        torch.cuda.synchronize(device)
        assert out.device == device and x.grad.device == device and q.device == device
        results[index] = [t.detach().cpu() for t in (y, ro, out, x.grad, r.grad,
                                                     norm.weight.grad, q, yscale)]
    for a, b, what in zip(results[0], results[1],
                          ("y", "residual_out", "out", "dx", "dresidual", "dweight", "q",
                           "yscale")):
        assert torch.equal(bits(a), bits(b)), f"{what}: cuda:1 differs from cuda:0"


# ---- training: 50 bf16 steps against torch.nn.RMSNorm --------------------------------------------

# Tolerance: every step's loss within 1% of torch's, and 0.3% on average over the curve.  The runs
# differ only in RMSNorm rounding (ours rounds once; torch's 16-bit path rounds the normalised x,
# then the product with weight), a perturbation of <= 1 bf16 ulp (2^-8 relative) on some
# elements that training carries forward.  1% is ~2.5 bf16 ulps of the loss itself; the bf16
# curve differs from float32's by several % (CPU calibration of this model: ours vs torch max
# 3e-4, mean 8e-5; bf16 vs float32 max 5e-2), so the bound separates "the same training up to
# bf16 rounding" from a different computation.
LOSS_MAX_REL, LOSS_MEAN_REL = 1e-2, 3e-3


def test_bf16_training_matches_torch_rmsnorm():
    torch.manual_seed(0)
    base = TinyLM().to("cuda", torch.bfloat16)
    data = markov_batches(50, 16, 128, 256, "cuda")
    theirs = np.array(train(copy.deepcopy(base), data))
    again = np.array(train(copy.deepcopy(base), data))      # the GPU's own run-to-run noise
    ours_model = rt.replace_rmsnorm(copy.deepcopy(base))
    assert not any(type(m) is torch.nn.RMSNorm for m in ours_model.modules())
    ours = np.array(train(ours_model, data))
    rel = np.abs(ours - theirs) / theirs
    noise = np.abs(again - theirs) / theirs
    report = (f"ours vs torch: max {rel.max():.2e} (step {rel.argmax()}), mean {rel.mean():.2e}; "
              f"torch vs torch: max {noise.max():.2e}; losses {theirs[0]:.3f} -> {theirs[-1]:.3f}")
    print(report)
    assert theirs[-1] < 0.7 * theirs[0], f"the model did not learn: {report}"
    assert rel.max() < LOSS_MAX_REL and rel.mean() < LOSS_MEAN_REL, report


def test_side_stream_and_functional_give_the_same_bits():
    """The adapter's eager path launches on torch's current stream, like functional."""
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    first = rt.rms_norm(x, w)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x2 = x * 1
        again = rt.rms_norm(x2, w)
    stream.synchronize()
    assert_same_bits(first, again, "side stream")
    assert_same_bits(first, rmsnorm_hip.rms_norm(x, w), "adapter vs functional")
