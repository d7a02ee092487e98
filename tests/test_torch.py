"""The torch adapter (rmsnorm_hip.torch) on CPU tensors (the CPU backend): values and gradients
against torch's own F.rms_norm / autograd in float64 (API.md's tolerances), the RMSNorm module
against torch.nn.RMSNorm (state_dict both ways, eps=None, normalized_shape tuples, repr), the
model swap, layouts, errors, every custom op through torch.library.opcheck, and a
torch.compile(fullgraph=True) trace with dynamic batch sizes (aot_eager: fake implementations and
autograd formulas, no code generation)."""
import copy
import math

import numpy as np
import pytest

from conftest import DTYPES, FLOAT32, WEIGHT_COMBOS, assert_bitwise, assert_close
from test_backward import assert_dweight, assert_dx

torch = pytest.importorskip("torch")
F = torch.nn.functional

import rmsnorm_hip  # noqa: E402
from rmsnorm_hip import reference  # noqa: E402
from rmsnorm_hip import torch as rt  # noqa: E402

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
F32_EPS = torch.finfo(torch.float32).eps
# odd N (ragged rows) and leading dims
SHAPES = [(5, 127), (2, 3, 256)]


def combo_id(combo):
    return f"{combo[0]}-w{combo[1] or 'none'}"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, seed, loc=0.0, scale=1.0):
    t = loc + scale * torch.randn(shape, generator=gen(seed))
    return t.to(TORCH[dtype] if isinstance(dtype, str) else dtype)


def bits(t):
    """A tensor's raw bits as NumPy, for bitwise comparisons (bfloat16 included)."""
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).numpy()


def leaf(t):
    return t.detach().clone().requires_grad_()


def torch_reference(x, weight, eps, weight_offset, dy, dh=None, residual=None):
    """y, grad of the normalised input and grad of weight from torch's F.rms_norm and autograd in
    float64, from the same rounded inputs.  With ``residual``, the normalised input is the
    rounded ``x + residual`` (residual_out) and ``dh`` the gradient reaching it directly."""
    h = x if residual is None else torch.from_numpy(
        reference.fused_add_rms_norm_ref(x, residual)[1])
    h64 = h.detach().double().requires_grad_()
    w64 = None if weight is None else weight.detach().double().requires_grad_()
    n = h64.shape[-1]
    y64 = F.rms_norm(h64, (n,), None if w64 is None else w64 + weight_offset, eps)
    outs, grads = [y64], [dy.double()]
    if dh is not None:
        outs.append(h64)
        grads.append(dh.double())
    torch.autograd.backward(outs, grads)
    return (y64.detach().numpy(), h64.grad.numpy(),
            None if w64 is None else w64.grad.numpy())


def check_grads(y, dx, dweight, x_or_h, weight, dy, eps, weight_offset, ref, dtype, wdtype):
    y_ref, dx_ref, dw_ref = ref
    assert y.dtype == x_or_h.dtype and dx.dtype == x_or_h.dtype
    assert_close(y.detach().float().numpy(), y_ref, dtype)
    rstd = reference.rms_norm_ref(x_or_h, None, eps)[1]
    assert_dx(dx, dy, x_or_h, weight, rstd, dx_ref, dtype, weight_offset)
    if weight is None:
        assert dweight is None
    else:
        assert dweight.dtype == weight.dtype and dweight.shape == weight.shape
        assert_dweight(dweight, dw_ref, wdtype)


# ---- rms_norm: values and gradients ----------------------------------------------------------------

# every (x dtype, weight dtype) with weight_offset 0, and 1 (Gemma) where there is a weight
GRAD_CASES = [pytest.param(combo, offset, id=f"{combo_id(combo)}-offset{offset:g}")
              for combo in WEIGHT_COMBOS for offset in ((0.0,) if combo[1] is None else (0.0, 1.0))]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("combo,weight_offset", GRAD_CASES)
def test_rms_norm_grads_match_torch_float64(shape, combo, weight_offset):
    dtype, wdtype = combo
    n = shape[-1]
    x = leaf(randn(shape, dtype, 1))
    w = None if wdtype is None else leaf(randn((n,), wdtype, 2, loc=1.0 - weight_offset,
                                               scale=0.1))
    dy = randn(shape, dtype, 3)
    eps = 1e-5

    y = rt.rms_norm(x, w, eps, weight_offset)
    y.backward(dy)

    ref = torch_reference(x, w, eps, weight_offset, dy)
    check_grads(y, x.grad, None if w is None else w.grad, x, w, dy, eps, weight_offset, ref,
                dtype, wdtype)
    # the no-grad path runs the same kernel: bitwise the same y, and nothing kept for a backward
    with torch.no_grad():
        y_plain = rt.rms_norm(x, w, eps, weight_offset)
    assert y_plain.grad_fn is None and not y_plain.requires_grad
    assert_bitwise(bits(y_plain), bits(y), "no-grad y vs grad y")


@pytest.mark.parametrize("needs", ["x", "weight", "both"])
def test_only_the_gradients_asked_for(needs):
    x = randn((4, 64), "bfloat16", 1)
    w = randn((64,), "bfloat16", 2, loc=1.0, scale=0.1)
    x.requires_grad_(needs in ("x", "both"))
    w.requires_grad_(needs in ("weight", "both"))
    y = rt.rms_norm(x, w)
    # rstd is kept for the backward: (x, weight, rstd) with rstd float32 (M,)
    h, weight, rstd = y.grad_fn.saved_tensors
    assert h is x and weight is w and rstd.dtype == torch.float32 and rstd.shape == (4,)
    y.backward(torch.ones_like(y))
    assert (x.grad is not None) == x.requires_grad
    assert (w.grad is not None) == w.requires_grad


def test_rstd_is_computed_only_when_a_gradient_is_needed(monkeypatch):
    calls = []
    real = rt.functional.rms_norm

    def spy(*args, **kwargs):
        calls.append(kwargs["return_rstd"])
        return real(*args, **kwargs)

    monkeypatch.setattr(rt.functional, "rms_norm", spy)
    x = randn((3, 32), "float32", 1)
    w = torch.ones(32, requires_grad=True)
    rt.rms_norm(x, None)
    rt.rms_norm(x, w.detach())
    with torch.no_grad():
        rt.rms_norm(x, w)
    rt.rms_norm(x, w)
    rt.rms_norm(leaf(x), None)
    assert calls == [False, False, False, True, True]


# ---- fused add: values and gradients ---------------------------------------------------------------

@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
@pytest.mark.parametrize("uses", ["y", "residual_out", "both"])
def test_fused_add_grads_match_torch_float64(combo, uses):
    dtype, wdtype = combo
    shape, n = (2, 3, 256), 256
    weight_offset = 0.0 if wdtype is None else 1.0
    x, r = leaf(randn(shape, dtype, 1)), leaf(randn(shape, dtype, 2))
    w = None if wdtype is None else leaf(randn((n,), wdtype, 3, loc=0.0, scale=0.1))
    dy, dro = randn(shape, dtype, 4), randn(shape, dtype, 5)
    seen = []
    x.register_hook(lambda g: seen.append(("x", g.data_ptr())))
    r.register_hook(lambda g: seen.append(("residual", g.data_ptr())))

    y, ro = rt.fused_add_rms_norm(x, r, w, 1e-6, weight_offset)
    outs = {"y": [(y, dy)], "residual_out": [(ro, dro)], "both": [(y, dy), (ro, dro)]}[uses]
    torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])

    h_ref = reference.fused_add_rms_norm_ref(x, r)[1]
    assert np.array_equal(ro.detach().double().numpy(), h_ref), "residual_out: one rounding"
    # one gradient tensor for x and residual (no copy)
    assert len(seen) == 2 and seen[0][1] == seen[1][1], seen
    assert_bitwise(bits(x.grad), bits(r.grad), "x.grad vs residual.grad")
    if uses == "residual_out":           # nothing reaches y: the gradient is dro itself
        assert_bitwise(bits(x.grad), bits(dro), "x.grad vs the residual_out gradient")
        assert w is None or w.grad is None
        return
    ref = torch_reference(x, w, 1e-6, weight_offset, dy, dh=dro if uses == "both" else None,
                          residual=r)
    check_grads(y, x.grad, None if w is None else w.grad, ro.detach(), w, dy, 1e-6,
                weight_offset, ref, dtype, wdtype)


def test_fused_add_no_grad_matches_functional():
    x, r = randn((5, 96), "float16", 1), randn((5, 96), "float16", 2)
    w = randn((96,), "float32", 3, loc=1.0, scale=0.1)
    y, ro = rt.fused_add_rms_norm(x, r, w)
    y_f, ro_f = rmsnorm_hip.fused_add_rms_norm(x, r, w)
    assert y.grad_fn is None
    assert_bitwise(bits(y), bits(y_f), "y")
    assert_bitwise(bits(ro), bits(ro_f), "residual_out")


# ---- the ops path (torch.compile, tensor subclasses) against the eager path ----------------------

@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "fused"])
def test_ops_path_is_bitwise_the_eager_path(fused):
    x, r = randn((6, 200), "bfloat16", 1), randn((6, 200), "bfloat16", 2)
    w = randn((200,), "bfloat16", 3, loc=1.0, scale=0.1)
    dy = randn((6, 200), "bfloat16", 4)

    def run(call):
        xs, rs, ws = leaf(x), leaf(r), leaf(w)
        y = call(xs, rs, ws)
        y.backward(dy)
        return y, xs.grad, ws.grad

    ops = torch.ops.rmsnorm_hip
    if fused:
        eager = run(lambda x_, r_, w_: rt.fused_add_rms_norm(x_, r_, w_, 1e-6, 0.0)[0])
        with_rstd = run(lambda x_, r_, w_: ops.fused_add_rms_norm_fwd(x_, r_, w_, 1e-6, 0.0)[0])
        recomputed = run(lambda x_, r_, w_: ops.fused_add_rms_norm(x_, r_, w_, 1e-6, 0.0)[0])
    else:
        eager = run(lambda x_, r_, w_: rt.rms_norm(x_, w_, 1e-6, 0.0))
        with_rstd = run(lambda x_, r_, w_: ops.rms_norm_fwd(x_, w_, 1e-6, 0.0)[0])
        recomputed = run(lambda x_, r_, w_: ops.rms_norm(x_, w_, 1e-6, 0.0))
    for got in (with_rstd, recomputed):
        for a, b, what in zip(got, eager, ("y", "dx", "dweight")):
            assert_bitwise(bits(a), bits(b), what)


def test_meta_tensors_take_the_fake_implementations():
    norm = rt.RMSNorm((4, 16), device="meta")
    y = norm(torch.empty(2, 3, 4, 16, device="meta", requires_grad=True))
    assert y.is_meta and y.shape == (2, 3, 4, 16)
    q, yscale = rt.rms_norm_quant(torch.empty(7, 32, device="meta", dtype=torch.bfloat16),
                                  quant_dtype=torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 32) and yscale.shape == (7,)


# ---- layouts -----------------------------------------------------------------------------------

LAYOUTS = {
    # name: (make x of shape (6, 64) from a (6, 80) base and a (64, 6) base, copied by the adapter?)
    "row_strided": (lambda wide, tall: wide[:, 8:72], False),
    "3d_row_strided": (lambda wide, tall: wide.reshape(2, 3, 80)[..., :64], False),
    "transposed": (lambda wide, tall: tall.t(), True),
    "column_stride_2": (lambda wide, tall: torch.cat([wide, wide], 1)[:, :128:2], True),
    "expanded": (lambda wide, tall: wide[:1, :64].expand(6, 64), True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_copied_only_when_the_kernels_cannot_read_them(monkeypatch, layout):
    make, copied = LAYOUTS[layout]
    wide, tall = randn((6, 80), "bfloat16", 1), randn((64, 6), "bfloat16", 2)
    w = randn((64,), "bfloat16", 3, loc=1.0, scale=0.1)
    seen = []
    real = rt.functional.rms_norm

    def spy(x_arg, *args, **kwargs):
        seen.append(x_arg)
        return real(x_arg, *args, **kwargs)

    monkeypatch.setattr(rt.functional, "rms_norm", spy)
    x = make(wide, tall)
    dy = randn(x.shape, "bfloat16", 4)
    y = rt.rms_norm(x, w)
    if copied:
        assert seen[0].is_contiguous() and seen[0].data_ptr() != x.data_ptr()
    else:
        assert seen[0] is x, "a layout the kernels read was copied"
    assert_bitwise(bits(y), bits(rt.rms_norm(x.contiguous(), w)), f"{layout} y vs contiguous")

    # the backward through the same layout gives the contiguous input's gradients
    x_view, w_view = make(leaf(wide), leaf(tall)), leaf(w)
    x_view.retain_grad()
    rt.rms_norm(x_view, w_view).backward(dy)
    x_cont, w_cont = leaf(x.contiguous()), leaf(w)
    rt.rms_norm(x_cont, w_cont).backward(dy)
    assert_bitwise(bits(x_view.grad), bits(x_cont.grad), f"{layout} dx vs contiguous")
    assert_bitwise(bits(w_view.grad), bits(w_cont.grad), f"{layout} dweight vs contiguous")


def test_row_strided_dy_gives_the_contiguous_gradients():
    x = leaf(randn((6, 64), "float32", 1))
    w = leaf(randn((64,), "float32", 2, loc=1.0, scale=0.1))
    dy = randn((6, 90), "float32", 3)[:, 4:68]
    rt.rms_norm(x, w).backward(dy)
    x2, w2 = leaf(x), leaf(w)
    rt.rms_norm(x2, w2).backward(dy.contiguous())
    assert_bitwise(bits(x.grad), bits(x2.grad), "dx")
    assert_bitwise(bits(w.grad), bits(w2.grad), "dweight")
