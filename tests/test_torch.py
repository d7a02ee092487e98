"""The torch adapter (rmsnorm_hip.torch) on CPU tensors (the CPU backend): values and gradients
against torch's own F.rms_norm / autograd in float64 (docs/api.md's tolerances), the RMSNorm module
against torch.nn.RMSNorm (state_dict both ways, eps=None, normalized_shape tuples, repr), the
model swap, layouts, errors, every custom op through torch.library.opcheck, and a
torch.compile(fullgraph=True) trace with dynamic batch sizes (aot_eager: fake implementations and
autograd formulas, no code generation)."""
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

pytestmark = pytest.mark.quick

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


# ---- rms_norm: values and gradients --------------------------------------------------------------

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


# ---- fused add: values and gradients -------------------------------------------------------------

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


# ---- quantised forward ---------------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["int8", torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_quant_matches_functional_and_carries_no_gradient(quant, with_residual):
    x = leaf(randn((5, 128), "bfloat16", 1))
    w = leaf(randn((128,), "bfloat16", 2, loc=1.0, scale=0.1))
    xs = 0.5 + torch.rand(128, generator=gen(3))
    r = randn((5, 128), "bfloat16", 4) if with_residual else None
    got = rt.rms_norm_quant(x, w, 1e-6, xscale=xs, residual=r, quant_dtype=quant)
    expected = rmsnorm_hip.rms_norm_quant(x.detach(), w.detach(), 1e-6, xscale=xs, residual=r,
                                          quant_dtype=quant)
    assert len(got) == (3 if with_residual else 2)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and not a.requires_grad
        assert_bitwise(bits(a), bits(b), "quant output")


# ---- the RMSNorm module against torch.nn.RMSNorm -------------------------------------------------

def test_module_is_a_drop_in_for_torch_nn_rmsnorm():
    ours, theirs = rt.RMSNorm(64), torch.nn.RMSNorm(64)
    assert isinstance(ours, torch.nn.RMSNorm)
    assert repr(ours) == repr(theirs) == "RMSNorm((64,), eps=None, elementwise_affine=True)"
    assert ours.normalized_shape == (64,) and ours.eps is None and ours.elementwise_affine
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    assert torch.equal(ours.weight, theirs.weight)
    bare = rt.RMSNorm([4, 16], eps=1e-5, elementwise_affine=False)
    assert repr(bare) == repr(torch.nn.RMSNorm([4, 16], 1e-5, False))
    assert bare.weight is None and list(bare.state_dict()) == []
    gemma = rt.RMSNorm(8, weight_offset=1.0, dtype=torch.bfloat16)
    assert repr(gemma) == "RMSNorm((8,), eps=None, elementwise_affine=True, weight_offset=1.0)"
    assert gemma.weight.dtype == torch.bfloat16 and torch.equal(gemma.weight, torch.zeros(8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalized_shape", [(96,), (4, 24)], ids=str)
def test_state_dict_round_trip_with_torch_nn_rmsnorm(dtype, normalized_shape):
    theirs = torch.nn.RMSNorm(normalized_shape, eps=1e-5, dtype=TORCH[dtype])
    with torch.no_grad():
        theirs.weight.copy_(randn(normalized_shape, dtype, 1, loc=1.0, scale=0.2))
    ours = rt.RMSNorm(normalized_shape, eps=1e-5, dtype=TORCH[dtype])
    ours.load_state_dict(theirs.state_dict())              # torch -> ours
    x = randn((3, 5) + normalized_shape, dtype, 2)
    y = ours(x)
    n = math.prod(normalized_shape)
    y_ref = reference.rms_norm_ref(x.reshape(15, n), ours.weight.reshape(n), 1e-5)[0]
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y.detach().float().reshape(15, n).numpy(), y_ref, dtype)
    # torch's own module agrees with the same float64 reference (it rounds twice for 16-bit)
    y_theirs = theirs(x).detach().double().reshape(15, n).numpy()
    loose = 1e-5 if dtype == FLOAT32 else 2e-2
    assert np.linalg.norm(y_theirs - y_ref) / np.linalg.norm(y_ref) < loose
    back = torch.nn.RMSNorm(normalized_shape, eps=1e-5, dtype=TORCH[dtype])
    back.load_state_dict(ours.state_dict())                # ours -> torch
    assert_bitwise(bits(back(x)), bits(theirs(x)), "torch module after the round trip")


@pytest.mark.parametrize("dtype", DTYPES)
def test_eps_none_is_float32_epsilon_as_in_torch(dtype):
    # rows of size ~1e-3 * 1e-2: mean(x^2) ~ 1e-10 << float32 eps (1.2e-7) << 16-bit eps, so each
    # choice of eps gives a different output
    x = randn((4, 64), dtype, 1, scale=1e-4)
    eps_dtype = torch.finfo(TORCH[dtype]).eps
    # torch: eps=None means float32's epsilon for float32, float16 and bfloat16
    y_torch = F.rms_norm(x, (64,), None, None)
    assert torch.equal(y_torch, F.rms_norm(x, (64,), None, F32_EPS))
    if dtype != FLOAT32:
        assert not torch.equal(y_torch, F.rms_norm(x, (64,), None, eps_dtype))
    ours = rt.RMSNorm(64, dtype=TORCH[dtype])
    assert ours.eps is None
    y = ours(x)
    assert_bitwise(bits(y), bits(rt.RMSNorm(64, eps=F32_EPS, dtype=TORCH[dtype])(x)), "eps=None")
    assert_close(y.detach().float().numpy(),
                 reference.rms_norm_ref(x, ours.weight, F32_EPS)[0], dtype)
    if dtype != FLOAT32:
        with pytest.raises(AssertionError):
            assert_close(y.detach().float().numpy(),
                         reference.rms_norm_ref(x, ours.weight, eps_dtype)[0], dtype)


def test_normalized_shape_tuple_gradients():
    norm = rt.RMSNorm((4, 24), eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn((4, 24), "float32", 1, loc=1.0, scale=0.2))
    x = leaf(randn((2, 3, 4, 24), "float32", 2))
    dy = randn((2, 3, 4, 24), "float32", 3)
    y = norm(x)
    y.backward(dy)
    assert y.shape == x.shape and norm.weight.grad.shape == (4, 24)
    ref = torch_reference(x.reshape(6, 96), norm.weight.reshape(96), 1e-6, 0.0, dy.reshape(6, 96))
    check_grads(y.reshape(6, 96), x.grad.reshape(6, 96), norm.weight.grad.reshape(96),
                x.detach().reshape(6, 96), norm.weight.detach().reshape(96), dy.reshape(6, 96),
                1e-6, 0.0, ref, FLOAT32, FLOAT32)


def test_weight_offset_module_starts_as_the_identity_scale():
    x = randn((3, 128), "bfloat16", 1)
    gemma = rt.RMSNorm(128, eps=1e-6, weight_offset=1.0, dtype=torch.bfloat16)
    assert_bitwise(bits(gemma(x)), bits(rt.rms_norm(x, None, 1e-6)), "1 - offset + offset")
    with torch.no_grad():
        gemma.weight.copy_(randn((128,), "bfloat16", 2, scale=0.1))
    assert_close(gemma(x).detach().float().numpy(),
                 reference.rms_norm_ref(x, gemma.weight, 1e-6, weight_offset=1.0)[0], "bfloat16")
    gemma.reset_parameters()
    assert torch.equal(gemma.weight, torch.zeros(128, dtype=torch.bfloat16))


# ---- replace_rmsnorm -----------------------------------------------------------------------------

class MlpBlock(torch.nn.Module):
    def __init__(self, d, shared_norm=None):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-5)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                       torch.nn.Linear(2 * d, d))
        self.shared = shared_norm

    def forward(self, x):
        h = x + self.mlp(self.norm(x))
        return self.shared(h) if self.shared is not None else h


def small_model(d=64):
    torch.manual_seed(0)
    final = torch.nn.RMSNorm(d)                     # eps=None
    return torch.nn.Sequential(MlpBlock(d), MlpBlock(d, final), torch.nn.ModuleList([final]),
                               torch.nn.RMSNorm((4, d // 4), elementwise_affine=False))


def test_replace_rmsnorm_swaps_every_norm_keeping_weights():
    model = small_model()
    norms = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.RMSNorm)}
    weights = {name: m.weight for name, m in norms.items()}
    x = randn((5, 64), "float32", 1)
    with torch.no_grad():
        for m in norms.values():
            if m.weight is not None:
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen(2)))
    model.eval()
    before = model[1](model[0](x))

    assert rt.replace_rmsnorm(model) is model
    swapped = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.RMSNorm)}
    assert swapped.keys() == norms.keys()
    for name, m in swapped.items():
        assert type(m) is rt.RMSNorm, name
        assert m.weight is weights[name], f"{name}: the weight parameter object is kept"
        assert (m.normalized_shape, m.eps, m.elementwise_affine, m.training) == (
            norms[name].normalized_shape, norms[name].eps, norms[name].elementwise_affine, False)
    assert model[1].shared is model[2][0], "a module reached twice stays one module"
    after = model[1](model[0](x))
    assert_close(after.detach().numpy(), before.detach().double().numpy(), FLOAT32)
    after.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert type(rt.replace_rmsnorm(torch.nn.RMSNorm(8))) is rt.RMSNorm


# ---- errors --------------------------------------------------------------------------------------

ERRORS = [
    # (call, exception, message pattern): functional's messages come through unchanged
    (lambda: rt.rms_norm(torch.ones(2, 8, dtype=torch.float64)), TypeError,
     r"rms_norm: x must have dtype float32, float16 or bfloat16, got float64"),
    (lambda: rt.rms_norm(leaf(torch.ones(2, 8, dtype=torch.float64))), TypeError,
     r"rms_norm: x must have dtype float32, float16 or bfloat16, got float64"),
    (lambda: rt.rms_norm(torch.ones(2, 8), torch.ones(7)), ValueError,
     r"rms_norm: weight must have shape \(8,\), got \(7,\)"),
    (lambda: rt.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8).half()), TypeError,
     r"rms_norm: weight must have dtype bfloat16 or float32 for x of dtype bfloat16, got float16"),
    (lambda: rt.rms_norm(torch.ones(2, 0)), ValueError,
     r"rms_norm: x must have a non-empty last dimension, got shape \(2, 0\)"),
    (lambda: rt.rms_norm(torch.ones(2, 8), None, -1.0), ValueError,
     r"rms_norm: eps must be a finite number >= 0, got -1.0"),
    (lambda: rt.rms_norm(torch.ones(2, 8), None, 1e-6, 1.0), ValueError,
     r"rms_norm: weight_offset must be 0.0 when weight is None, got 1.0"),
    (lambda: rt.rms_norm(np.ones((2, 8), np.float32)), TypeError,
     r"rms_norm: x must be a torch.Tensor, got numpy.ndarray"),
    (lambda: rt.rms_norm(None), TypeError,
     r"rms_norm: x must be a torch.Tensor, got builtins.NoneType"),
    (lambda: rt.fused_add_rms_norm(None, torch.ones(2, 8)), TypeError,
     r"fused_add_rms_norm: x must be a torch.Tensor, got builtins.NoneType"),
    (lambda: rt.fused_add_rms_norm(torch.ones(2, 8), None), TypeError,
     r"fused_add_rms_norm: residual must be a torch.Tensor, got builtins.NoneType"),
    (lambda: rt.rms_norm_quant(None), TypeError,
     r"rms_norm_quant: x must be a torch.Tensor, got builtins.NoneType"),
    (lambda: rt.rms_norm_quant(torch.ones(2, 8), xscale=[1.0]), TypeError,
     r"rms_norm_quant: xscale must be a torch.Tensor or None, got builtins.list"),
    (lambda: rt.fused_add_rms_norm(torch.ones(2, 8), torch.ones(2, 9)), ValueError,
     r"fused_add_rms_norm: residual must have shape \(2, 8\), got \(2, 9\)"),
    (lambda: rt.fused_add_rms_norm(leaf(torch.ones(2, 8)), torch.ones(2, 8).half()), TypeError,
     r"fused_add_rms_norm: residual must have dtype float32, got float16"),
    (lambda: rt.rms_norm_quant(torch.ones(2, 8), quant_dtype="int4"), ValueError,
     r"rms_norm_quant: quant_dtype must be 'int8', 'float8_e4m3fn', 'mxfp8_e4m3' or "
         r"'mxfp4_e2m1', got 'int4'"),
    (lambda: rt.RMSNorm(8)(torch.ones(2, 9)), ValueError,
     r"RMSNorm: x must have shape \(\.\.\., 8\) \(normalized_shape \(8,\)\), got \(2, 9\)"),
    (lambda: rt.RMSNorm(8, elementwise_affine=False, weight_offset=1.0), ValueError,
     r"RMSNorm: weight_offset must be 0.0 with elementwise_affine=False"),
    (lambda: rt.RMSNorm(()), ValueError, r"RMSNorm: normalized_shape must have at least one"),
    (lambda: rt.RMSNorm(8)([1.0] * 8), TypeError,
     r"RMSNorm: x must be a torch.Tensor, got builtins.list"),
    (lambda: rt.RMSNormGated(8, group_size=4)([1.0] * 8), TypeError,
     r"RMSNormGated: x must be a torch.Tensor, got builtins.list"),
    (lambda: rt.RMSNormGated(8, group_size=4)(torch.ones(2, 12)), ValueError,
     r"RMSNormGated: x must have shape \(\.\.\., 8\), got \(2, 12\)"),
    (lambda: rt.RMSNormGated(8)([1.0] * 8), TypeError,
     r"RMSNormGated: x must be a torch.Tensor, got builtins.list"),
    (lambda: rt.RMSNormGated(8, group_size=4)(torch.ones(2, 8, dtype=torch.float64)),
     TypeError, r"RMSNormGated: x must be float32, float16 or bfloat16 and the weight of x's "
                r"dtype or float32, got x torch.float64, weight torch.float32"),
    (lambda: rt.RMSNormGated(8, group_size=4, dtype=torch.bfloat16)(torch.ones(2, 8)),
     TypeError, r"got x torch.float32, weight torch.bfloat16"),
]


@pytest.mark.parametrize("call,exc,match", ERRORS, ids=[m[:40] for _, _, m in ERRORS])
def test_errors_name_argument_expected_and_given(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("loss", ["linear", "square"])
@pytest.mark.parametrize("fused", [False, True])
def test_second_derivative_raises(fused, loss):
    """The backward has no derivative of its own: on the eager path too, a second derivative
    raises (as through the custom ops), never comes back silently without its term, whether
    or not the gradient reaching y depends on x."""
    x = leaf(randn((4, 64), "float32", 1))
    w = leaf(randn((64,), "float32", 2, loc=1.0, scale=0.1))
    y = rt.fused_add_rms_norm(x, randn((4, 64), "float32", 3), w)[0] if fused else rt.rms_norm(x, w)
    g = torch.autograd.grad(y.sum() if loss == "linear" else (y * y).sum(), x,
                            create_graph=True)[0]
    with pytest.raises(RuntimeError, match="rms_norm_backward.*no autograd formula"):
        ((g * g).sum() + (x * x).sum()).backward()


def test_one_dimensional_x_is_one_row():
    x = leaf(randn((96,), "float16", 1))
    w = leaf(randn((96,), "float16", 2, loc=1.0, scale=0.1))
    dy = randn((96,), "float16", 3)
    y = rt.rms_norm(x, w)
    y.backward(dy)
    ref = torch_reference(x.reshape(1, 96), w, 1e-6, 0.0, dy.reshape(1, 96))
    check_grads(y.reshape(1, 96), x.grad.reshape(1, 96), w.grad, x.detach().reshape(1, 96), w,
                dy.reshape(1, 96), 1e-6, 0.0, ref, "float16", "float16")


def test_empty_batch():
    x = leaf(torch.ones(0, 3, 16))
    w = leaf(torch.ones(16))
    y = rt.rms_norm(x, w)
    y.backward(torch.ones_like(y))
    assert y.shape == (0, 3, 16) and x.grad.shape == (0, 3, 16)
    assert torch.equal(w.grad, torch.zeros(16)), "M = 0: dweight is N zeros"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_storages_stay_resizable(dtype):
    """FSDP frees an unsharded parameter by resizing its storage to 0 after the forward (and
    the backward): the CPU path must not leave the tensors it reads or returns non-resizable
    (Tensor.numpy() does, for the storage's lifetime)."""
    x = leaf(randn((4, 64), dtype, 1))
    r = randn((4, 64), dtype, 2)
    w = leaf(randn((64,), dtype, 3, loc=1.0))
    y, residual_out = rt.fused_add_rms_norm(x, r, w, 1e-6)
    z = rt.rms_norm(y, w)
    (z.sum() + residual_out.sum()).backward()
    q, yscale = rt.rms_norm_quant(z.detach(), w.detach())
    for name, t in dict(x=x, r=r, w=w, y=y, residual_out=residual_out, z=z, dx=x.grad,
                        dw=w.grad, q=q, yscale=yscale).items():
        storage = t.untyped_storage()
        size = storage.nbytes()
        storage.resize_(0)          # raises "Trying to resize storage that is not resizable"
        storage.resize_(size)
        assert storage.nbytes() == size, name


# ---- torch.library.opcheck for every custom op ---------------------------------------------------

def opcheck_cases():
    x = randn((3, 5, 32), "bfloat16", 1)
    r = randn((3, 5, 32), "bfloat16", 2)
    w = randn((32,), "float32", 3, loc=1.0, scale=0.1)
    dy = randn((3, 5, 32), "bfloat16", 4)
    rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1]
    xs = 0.5 + torch.rand(32, generator=gen(5))
    ops = torch.ops.rmsnorm_hip
    return [
        ("rms_norm", ops.rms_norm, (leaf(x), leaf(w), 1e-6, 0.5)),
        ("rms_norm-noweight", ops.rms_norm, (leaf(x), None, 1e-6, 0.0)),
        ("rms_norm_fwd", ops.rms_norm_fwd, (leaf(x), leaf(w), 1e-6, 0.0)),
        ("rms_norm_fwd-f32", ops.rms_norm_fwd, (leaf(x.float()), None, 1e-6, 0.0)),
        ("fused_add_rms_norm", ops.fused_add_rms_norm, (leaf(x), leaf(r), leaf(w), 1e-6, 0.0)),
        ("fused_add_rms_norm_fwd", ops.fused_add_rms_norm_fwd,
         (leaf(x), leaf(r), leaf(w), 1e-6, 1.0)),
        ("fused_add_rms_norm_fwd-noweight", ops.fused_add_rms_norm_fwd,
         (leaf(x), leaf(r), None, 1e-6, 0.0)),
        ("rms_norm_backward", ops.rms_norm_backward, (dy, x, w, rstd, r, 1e-6, 0.0)),
        ("rms_norm_backward-recompute", ops.rms_norm_backward,
         (dy, x, None, None, None, 1e-6, 0.0)),
        ("rms_norm_quant", ops.rms_norm_quant, (x, w, 1e-6, xs, None, "int8", 0.0)),
        ("rms_norm_quant-fp8-residual", ops.rms_norm_quant,
         (x, None, 1e-6, None, r, "float8_e4m3fn", 0.0)),
    ]


@pytest.mark.parametrize("case", opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args = case
    torch.library.opcheck(op, args)


# ---- torch.compile: one graph, no recompilation over batch sizes ---------------------------------

class TinyBlock(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = rt.RMSNorm(d)
        self.norm2 = rt.RMSNorm(d, weight_offset=1.0)
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x, residual):
        y, residual = rt.fused_add_rms_norm(x, residual, self.norm1.weight, 1e-6)
        return self.norm2(self.proj(y)) + residual


def test_compile_fullgraph_dynamic_batch_bitwise_eager():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = TinyBlock(64)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    for m in (3, 5, 8):
        x, r = leaf(randn((m, 64), "float32", m)), leaf(randn((m, 64), "float32", m + 1))
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
        out = compiled(x, r)
        out.sum().backward()
        grads = [p.grad for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        x2, r2 = leaf(x), leaf(r)
        eager = block(x2, r2)
        eager.sum().backward()
        assert_bitwise(bits(out), bits(eager), f"M={m} compiled vs eager output")
        for a, b, what in zip((x.grad, r.grad, *grads),
                              (x2.grad, r2.grad, *(p.grad for p in block.parameters())),
                              ("dx", "dresidual", "dweight1", "dweight2", "dW", "db")):
            assert_bitwise(bits(a), bits(b), f"M={m} {what} compiled vs eager")
        block.zero_grad(set_to_none=True)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times over 3 batch sizes"
    explain = torch._dynamo.explain(block)(x, r)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


# ---- the array API on torch tensors: storage dtypes, lazy views, version counters ----------
ENTRY_POINTS = {
    "rms_norm": lambda x, w, **k: (rmsnorm_hip.rms_norm(x, w, return_rstd=True, **k),),
    "fused_add_rms_norm": lambda x, w, **k: rmsnorm_hip.fused_add_rms_norm(x, x, w, **k),
    "rms_norm_backward": lambda x, w, **k: rmsnorm_hip.rms_norm_backward(x, x, w, **k),
    "rms_norm_quant": lambda x, w, **k: rmsnorm_hip.rms_norm_quant(x, w, residual=x, **k),
}


def _flat(outputs):
    for out in outputs:
        yield from (_flat(out) if isinstance(out, tuple) else [out])


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", list(ENTRY_POINTS))
def test_uint16_storage_in_is_uint16_out(op, half):
    """torch uint16 read as a 16-bit float with dtype=: every 16-bit output comes back as uint16
    (storage in, storage out), with the bits of the call on the native dtype."""
    x = randn((3, 40), half, 1)
    w = randn(40, half, 2, loc=1.0, scale=0.1)
    native = list(_flat(ENTRY_POINTS[op](x, w)))
    bits = list(_flat(ENTRY_POINTS[op](x.view(torch.uint16), w.view(torch.uint16), dtype=half)))
    assert len(bits) == len(native)
    for got, want in zip(bits, native):
        if want.dtype == TORCH[half]:
            assert got.dtype == torch.uint16, (op, got.dtype)
            assert torch.equal(got, want.view(torch.uint16))
        else:                                   # float32 statistics, int8 levels
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("arg", ["x", "weight", "out"])
@pytest.mark.parametrize("view", ["neg", "conj_imag"])
def test_views_with_the_negative_bit_are_refused(arg, view):
    """A lazily negated view's memory holds the values without their sign: reading it would
    drop the sign, so it is refused with a ValueError naming the argument."""
    x, w, out = randn((3, 8), "float32", 1), randn(8, "float32", 2), torch.empty(3, 8)
    args = dict(x=x, weight=w, out=out)
    if view == "neg":
        args[arg] = torch._neg_view(args[arg])
    else:
        args[arg] = torch.complex(torch.zeros_like(args[arg]), args[arg]).conj().imag
        assert args[arg].is_neg()
    with pytest.raises(ValueError, match=f"rms_norm: {arg} is a torch view with the negative"):
        rmsnorm_hip.rms_norm(args["x"], args["weight"], out=args["out"])


@pytest.mark.parametrize("call", ["fused_add_rms_norm_", "rms_norm_out_x", "rms_norm_out"])
def test_in_place_calls_bump_the_version_counter(call):
    """Arrays written in place step torch's version counter, so autograd refuses a backward
    that would read a saved tensor since overwritten, rather than return a wrong gradient."""
    a = torch.randn(3, 16, requires_grad=True)
    h = a * 2
    loss = h.sin().sum()                        # saves h for its backward
    x, r, w = h.detach(), torch.randn(3, 16), torch.ones(16)
    before = (x._version, r._version)
    if call == "fused_add_rms_norm_":
        rmsnorm_hip.fused_add_rms_norm_(x, r, w)
        assert (x._version, r._version) == (before[0] + 1, before[1] + 1)
    elif call == "rms_norm_out_x":
        rmsnorm_hip.rms_norm(x, w, out=x)
        assert x._version == before[0] + 1
    else:
        rmsnorm_hip.rms_norm(r, w, out=x)
        assert x._version == before[0] + 1 and r._version == before[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
