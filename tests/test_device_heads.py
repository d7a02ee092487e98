"""The GPU tier for rows at two strides (mark ``device``): rms_norm and rms_norm_backward on
head-shaped views (tests/test_heads.py's layouts: q or k heads of a fused QKV buffer,
heads-major storage seen token-major, padded batches, 3-D and 4-D) on a real GPU: bitwise the
same call on a contiguous copy (y, rstd, dx, dweight; also where the contiguous backward pairs
rows: 16-bit N = 4096 with M >= 2 * SMs), bitwise from misaligned buffers (the scalar kernels),
within the contract of the float64 reference, every allocation guarded, out= head-shaped or in
place writing nothing else; then every array flavour, and the torch adapter (no copy, autograd
against float64, a CUDA graph of QK-norm forward and backward).

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -m device tests/test_device_heads.py

Skipped (with the reason) where there is no CUDA GPU or the simulator is on.
"""
import numpy as np
import pytest

from conftest import DTYPES, assert_close, assert_dweight, assert_dx, require_cuda_torch

pytestmark = pytest.mark.device

torch = require_cuda_torch()

import rmsnorm_hip  # noqa: E402
from _guard import guarded_outputs  # noqa: E402
from rmsnorm_hip import backends, functional, reference  # noqa: E402
from rmsnorm_hip import torch as rt  # noqa: E402
from test_device import TORCH, host, raw  # noqa: E402
from test_heads import LAYOUT, LAYOUTS, OTHER  # noqa: E402

EPS = 1e-6


def sm_count():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def shape_of(name):
    """(lead, H, D) of a named shape; "paired": 16-bit rows of 4096 whose contiguous backward
    pairs rows (M >= 2 * SMs)."""
    return {"T333-H4-D128": ((333,), 4, 128), "T5-H3-D127": ((5,), 3, 127),
            "B2-S64-H8-D128": ((2, 64), 8, 128),
            "paired": ((sm_count() + 3,), 2, 4096)}[name]


def place(values, layout, offset=0):
    """(CUDA view in ``layout`` holding the CUDA tensor ``values`` (*lead, H, D), its buffer,
    NumPy mask of the buffer's other elements).  The buffer is NaN elsewhere and starts
    ``offset`` elements past a 16-byte aligned allocation (offset 1: the scalar kernels)."""
    *lead, h, d = values.shape
    lead = tuple(lead)
    shape = layout.buffer_shape(lead, h, d)
    size = int(np.prod(shape))
    flat = torch.full((size + 8,), float("nan"), device="cuda", dtype=values.dtype)
    buf = flat[offset:offset + size].view(shape)
    view = layout.view(buf, lead, h, d)
    view.copy_(values)
    index = layout.view(np.arange(size).reshape(shape), lead, h, d)
    outside = np.ones(size, bool)
    outside[index.reshape(-1)] = False
    return view, buf, outside.reshape(shape)


def guarded(call):
    with guarded_outputs() as guards:
        result = call()
    guards.check(written=True)
    return result


def same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    diff = int((raw(a) != raw(b)).sum())
    assert diff == 0, f"{what}: {diff} bytes differ"


def backward_spec(call):
    """(result, the BwdSpec of the backward plan the call built; launch plans forgotten first so
    that the call builds its own)."""
    functional.forget_plans()
    result = call()
    specs = {plan[0] for plan in backends.get("cuda")._bwd_plans.values()}
    assert len(specs) == 1, specs
    return result, specs.pop()


@pytest.mark.parametrize("shape", ["T333-H4-D128", "T5-H3-D127", "B2-S64-H8-D128", "paired"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight", ["same", None, "float32"])
def test_head_rows_contract_and_bits(shape, layout, dtype, weight):
    if weight == "float32" and dtype == "float32":
        pytest.skip("float32 x takes a float32 weight already")
    lead, h, d = shape_of(shape)
    if shape == "paired" and (dtype == "float32" or weight is None):
        pytest.skip("rows pair up for 16-bit data with a weight only")
    wdtype = {"same": dtype, None: None, "float32": "float32"}[weight]
    full = lead + (h, d)
    x0 = torch.randn(full, device="cuda", dtype=TORCH[dtype])
    dy0 = torch.randn(full, device="cuda", dtype=TORCH[dtype])
    w = None if wdtype is None else (1 + 0.1 * torch.randn(d, device="cuda")).to(TORCH[wdtype])
    x, x_buf, _ = place(x0, layout)
    dy = place(dy0, OTHER[layout.name])[0]
    x_before = raw(x_buf).clone()

    y, rstd = guarded(lambda: rmsnorm_hip.rms_norm(x, w, EPS, return_rstd=True))

    y_c, rstd_c = rmsnorm_hip.rms_norm(x0, w, EPS, return_rstd=True)
    same_bits(y, y_c, "y of the view vs of its contiguous copy")
    same_bits(rstd, rstd_c, "rstd of the view vs of its contiguous copy")
    y_ref, rstd_ref = reference.rms_norm_ref(host(x0), None if w is None else host(w), EPS)
    assert_close(host(y), y_ref, dtype)
    assert_close(rstd.cpu().numpy(), rstd_ref, "float32")
    # the scalar kernels: the same layout one element further into its buffer
    xu = place(x0, layout, offset=1)[0]
    same_bits(rmsnorm_hip.rms_norm(xu, w, EPS), y_c, "y of the misaligned view")

    for given in (True, False):
        r = rstd if given else None
        (dx_c, dw_c), spec_c = backward_spec(lambda: rmsnorm_hip.rms_norm_backward(dy0, x0, w, r))
        (dx, dw), spec = backward_spec(
            lambda: guarded(lambda: rmsnorm_hip.rms_norm_backward(dy, x, w, r)))
        assert spec.heads and not spec_c.heads, (spec, spec_c)
        if shape == "paired":
            assert spec_c.paired and spec.pair_twin, (spec_c, spec)
        same_bits(dx, dx_c, "dx of the views vs of contiguous copies")
        ref_dx, ref_dw = reference.rms_norm_backward_ref(
            host(dy0), host(x0), None if w is None else host(w), rstd.cpu().numpy(), EPS)
        assert_dx(host(dx), host(dy0), host(x0), None if w is None else host(w),
                  rstd.cpu().numpy(), ref_dx, dtype)
        if w is not None:
            same_bits(dw, dw_c, "dweight of the views vs of contiguous copies")
            assert_dweight(host(dw), ref_dw, wdtype)
        dyu = place(dy0, OTHER[layout.name], offset=1)[0]
        dxu, dwu = rmsnorm_hip.rms_norm_backward(dyu, xu, w, r)
        same_bits(dxu, dx_c, "dx of misaligned views")
        if w is not None:
            same_bits(dwu, dw_c, "dweight of misaligned views")
    same_bits(raw(x_buf), x_before, "x's buffer after the calls")


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_shaped_out_and_in_place(dtype):
    """out= a head view of a NaN buffer (for a contiguous x, and q normalised into k's slot of
    its own QKV buffer), and in place: the contiguous call's bits, nothing else written."""
    t, h, d = 257, 8, 128
    x0 = torch.randn(t, h, d, device="cuda", dtype=TORCH[dtype])
    w = (1 + 0.1 * torch.randn(d, device="cuda")).to(TORCH[dtype])
    y_c, rstd_c = rmsnorm_hip.rms_norm(x0, w, EPS, return_rstd=True)
    for layout in LAYOUTS[:3]:
        out, buf, outside = place(torch.zeros_like(x0), layout)
        before = host(buf)
        y, rstd = rmsnorm_hip.rms_norm(x0, w, EPS, out=out, return_rstd=True)
        assert y is out
        same_bits(out, y_c, f"out= {layout.name}")
        same_bits(rstd, rstd_c, f"rstd with out= {layout.name}")
        np.testing.assert_array_equal(host(buf)[outside].view(np.uint8),
                                      before[outside].view(np.uint8))
        x, buf, outside = place(x0, layout)
        before = host(buf)
        assert rmsnorm_hip.rms_norm(x, w, EPS, out=x) is x
        same_bits(x, y_c, f"in place {layout.name}")
        np.testing.assert_array_equal(host(buf)[outside].view(np.uint8),
                                      before[outside].view(np.uint8))
    q, buf, _ = place(x0, LAYOUT["qkv_q"])
    k = LAYOUT["qkv_k"].view(buf, (t,), h, d)
    before = host(buf)
    assert rmsnorm_hip.rms_norm(q, w, EPS, out=k) is k
    same_bits(k, y_c, "q normalised into k's slot")
    after = host(buf)
    keep = np.ones(after.shape, bool)
    keep[:, h * d:2 * h * d] = False
    np.testing.assert_array_equal(after[keep].view(np.uint8), before[keep].view(np.uint8))


def test_refused_layouts_on_the_gpu():
    """Three strides (heads-outer 4-D storage seen (B, S, H, D)) and overlapping head rows raise
    ValueError naming the argument; the torch adapter copies the first."""
    x = torch.randn(2, 8, 64, 128, device="cuda").transpose(1, 2)
    out = torch.full((2, 64, 8, 128), float("nan"), device="cuda")
    with pytest.raises(ValueError, match="^rms_norm: x leading dimensions must flatten"):
        rmsnorm_hip.rms_norm(x, out=out)
    with pytest.raises(ValueError, match="^rms_norm_backward: dy leading dimensions must"):
        rmsnorm_hip.rms_norm_backward(x, x.contiguous())
    assert torch.isnan(out).all()
    overlap = torch.randn(64 * 256, device="cuda").as_strided((64, 2, 128), (256, 64, 1))
    with pytest.raises(ValueError, match="^rms_norm: x rows must not overlap"):
        rmsnorm_hip.rms_norm(overlap)
    same_bits(rt.rms_norm(x), rt.rms_norm(x.contiguous()), "adapter on a three-stride view")


# ---- every array flavour ------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["qkv_k", "heads_major"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flavour_name", ["cupy", "torch", "cai", "dlpack"])
def test_flavours(flavour_name, dtype, layout):
    """Head views in every flavour that can hold them (numba device arrays cannot be reshaped
    into such views): outputs of the flavour's library, dtype and shape, y / rstd / dx /
    dweight bitwise the flavour's contiguous call and within the contract."""
    flv = pytest.importorskip("test_device_flavours")
    flavour = flv.Flavour(flavour_name)
    lay = LAYOUT[layout]
    t, h, d = 7, 3, 264
    rng = np.random.default_rng(0)
    x_h, dy_h = (rng.standard_normal((t, h, d)).astype(flv.NP[dtype]) for _ in range(2))
    w_h = (1 + 0.1 * rng.standard_normal(d)).astype(flv.NP[dtype])

    def head_view(values):
        buf_shape = lay.buffer_shape((t,), h, d)
        buf, kw = flavour.make(np.zeros(buf_shape, values.dtype))
        inner = flv.unwrap(buf)
        view = lay.view(inner, (t,), h, d)
        view[...] = flv.unwrap(flavour.make(values)[0])
        wrap = {"cai": flv.CAIOnly, "dlpack": flv.DLPackOnly}.get(flavour_name, lambda a: a)
        return wrap(view), kw

    (x, kw), (dy, _) = head_view(x_h), head_view(dy_h)
    (xc, _), (dyc, _), (w, _) = flavour.make(x_h), flavour.make(dy_h), flavour.make(w_h)
    extra = {} if kw is None else {"dtype": kw}
    y, rstd = rmsnorm_hip.rms_norm(x, w, EPS, return_rstd=True, **extra)
    y_c, rstd_c = rmsnorm_hip.rms_norm(xc, w, EPS, return_rstd=True, **extra)
    flv.check_output(flavour, y, dtype, (t, h, d))
    flv.check_output(flavour, rstd, "float32", (t * h,))
    flv.assert_same_bits(y, y_c, dtype)
    flv.assert_same_bits(rstd, rstd_c, "float32")
    y_ref, _ = reference.rms_norm_ref(x_h, w_h, EPS)
    assert_close(flv.to_host(y, dtype), y_ref, dtype)
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w, rstd, **extra)
    dx_c, dw_c = rmsnorm_hip.rms_norm_backward(dyc, xc, w, rstd, **extra)
    flv.check_output(flavour, dx, dtype, (t, h, d))
    flv.assert_same_bits(dx, dx_c, dtype)
    flv.assert_same_bits(dw, dw_c, dtype)


# ---- the torch adapter ---------------------------------------------------------------------------

def _qkv_heads(t, h, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(t, 3 * h * d, device="cuda", generator=gen).to(dtype).requires_grad_()
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:2 * h * d].view(t, h, d)
    return qkv, q, k


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_torch_qk_norm_autograd_without_copies(monkeypatch, dtype):
    """rmsnorm_hip.torch.rms_norm on the q and k heads of a QKV projection: the views reach the
    kernels uncopied, forward and backward; y, the projection's gradient and the weights'
    against F.rms_norm and autograd in float64."""
    t, h, d = 129, 8, 128
    qkv, q, k = _qkv_heads(t, h, d, TORCH[dtype])
    wq = (1 + 0.1 * torch.randn(d, device="cuda")).requires_grad_()
    wk = (1 + 0.1 * torch.randn(d, device="cuda")).requires_grad_()
    dq, dk = (torch.randn(t, h, d, device="cuda", dtype=TORCH[dtype]) for _ in range(2))
    seen = []
    for name in ("rms_norm", "rms_norm_backward"):
        real = getattr(functional, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            a = args[0] if _name == "rms_norm" else args[1]
            seen.append((a.data_ptr(), a.stride()))
            return _real(*args, **kwargs)
        monkeypatch.setattr(functional, name, spy)

    yq, yk = rt.rms_norm(q, wq, EPS), rt.rms_norm(k, wk, EPS)
    torch.autograd.backward([yq, yk], [dq, dk])

    views = {(q.data_ptr(), q.stride()), (k.data_ptr(), k.stride())}
    assert set(seen) == views and len(seen) == 4, seen
    for view, w, y, dy, what in ((q, wq, yq, dq, "q"), (k, wk, yk, dk, "k")):
        x64 = view.detach().double().requires_grad_()
        w64 = w.detach().double().requires_grad_()
        y64 = torch.nn.functional.rms_norm(x64, (d,), w64, EPS)
        y64.backward(dy.double())
        assert_close(host(y.detach()), y64.detach().cpu().numpy(), dtype)
        grad = qkv.grad[:, :h * d] if what == "q" else qkv.grad[:, h * d:2 * h * d]
        rstd = reference.rms_norm_ref(host(view.detach()))[1]
        assert_dx(host(grad.reshape(t, h, d)), host(dy), host(view.detach()), host(w.detach()),
                  rstd, x64.grad.cpu().numpy(), dtype)
        assert_dweight(host(w.grad), w64.grad.cpu().numpy(), "float32")
    assert not qkv.grad[:, 2 * h * d:].any(), "gradient in the v part"


def test_torch_qk_norm_cuda_graph_is_bitwise_eager():
    """QK-norm on head views (forward and backward) captured in a CUDA graph, replayed on new
    projections: the eager bits."""
    t, h, d = 96, 8, 128
    # no head view of qkv outlives this line: a view keeps qkv's gradient node, made on the
    # default stream, which a captured backward may not wait on
    qkv = _qkv_heads(t, h, d, torch.bfloat16)[0]
    w = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(t, 2, h, d, device="cuda", dtype=torch.bfloat16)

    def run(qkv):
        q = qkv[:, :h * d].view(t, h, d)
        k = qkv[:, h * d:2 * h * d].view(t, h, d)
        y = torch.stack([rt.rms_norm(q, w, EPS), rt.rms_norm(k, w, EPS)], dim=1)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run(qkv)
            qkv.grad = w.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run(qkv)
    grads = (qkv.grad, w.grad)
    qkv.grad = w.grad = None
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            qkv.copy_(torch.randn_like(qkv))
        graph.replay()
        fresh = qkv.detach().clone().requires_grad_()
        y = run(fresh)
        same_bits(static_y, y, f"y, replay {seed}")
        same_bits(grads[0], fresh.grad, f"d(qkv), replay {seed}")
        same_bits(grads[1], w.grad, f"dweight, replay {seed}")
        w.grad = None
