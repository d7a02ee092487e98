"""rms_norm_gated and rms_norm_gated_backward (Mamba 2's gated RMSNorm) on NumPy arrays (CPU
backend; a path-complete few cases on the simulator) and through the torch adapter
(rms_norm_gated with autograd, RMSNormGated, the custom ops), against a float64 reference
written here from docs/api.md, not from the kernels:

    s = silu(z) = z * sigmoid(z),   s' = sigmoid(z) * (1 + z * (1 - sigmoid(z)))
    norm_before_gate=False:  h = x * s (float32, never rounded),  y = h * rstd * W
    norm_before_gate=True:   h = x,                              y = h * rstd * W * s
    rstd = 1 / sqrt(mean(h**2) + eps) over each group of G columns (G = N without group_size),
    W = weight + weight_offset (the group's slice of it)

and its gradients, per group, with e = dy (input gate) or dy * s (output gate), h_hat = h * rstd:

    dh = (e W - h_hat * mean(h_hat * e W)) * rstd
    input gate:   dx = dh * s,   dz = dh * x * s'
    output gate:  dx = dh,       dz = dy * h_hat * W * s'
    dweight = sum over rows of e * h_hat

Tolerances are the contract's (docs/api.md): y like rms_norm's; dx against s = |dy * W * rstd|
per element as rms_norm_backward's, dz against s * |x * s'| (the size of its terms); dweight
like rms_norm_backward's.  Bitwise: strided rows == contiguous copies, a row alone == in its
batch, a group == that group's columns as their own row, in place == out of place, dweight run
to run."""
import re
from dataclasses import dataclass

import numpy as np
import pytest
from _guard import guarded_outputs
from conftest import (BFLOAT16, FLOAT16, FLOAT32, NUMPY, WEIGHT_COMBOS, aligned_copy,
                      assert_bitwise, assert_close, assert_dweight, full_tier_except,
                      random_array, ulp)
from test_sim import launched_specs

from rmsnorm_hip import rms_norm_gated, rms_norm_gated_backward
from rmsnorm_hip.backends import cpu as cpu_backend
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import to_float64

pytestmark = pytest.mark.quick

EPS = 1e-6


# ---- the float64 reference ---------------------------------------------------------------------

def _silu(z):
    """(silu(z), silu'(z)) in float64."""
    sig = 1.0 / (1.0 + np.exp(-z))
    return z * sig, sig * (1.0 + z * (1.0 - sig))


def _groups(a, group_size):
    """``a`` (..., N) as float64 (M, N // G, G)."""
    a = to_float64(a)
    n = a.shape[-1]
    g = n if group_size is None else group_size
    return a.reshape(-1, n // g, g)


def _gain(weight, weight_offset, like):
    """W = weight + weight_offset shaped (N // G, G) (1.0 without weight)."""
    return 1.0 if weight is None else to_float64(weight).reshape(like.shape[1:]) + weight_offset


def gated_ref(x, z, weight=None, eps=EPS, group_size=None, norm_before_gate=False,
              weight_offset=0.0):
    """(y shaped like x, rstd (M,) or (M, N // G)) in float64."""
    xg, zg = _groups(x, group_size), _groups(z, group_size)
    s, _ = _silu(zg)
    h = xg if norm_before_gate else xg * s
    rstd = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    y = h * rstd * _gain(weight, weight_offset, xg)
    if norm_before_gate:
        y = y * s
    rstd = rstd[..., 0]
    return y.reshape(np.shape(x)), rstd[:, 0] if group_size is None else rstd


def _rstd_of(x, z, rstd, eps, group_size, norm_before_gate):
    """The float64 rstd (M, N // G, 1) the backward uses: the given one, or recomputed."""
    if rstd is None:
        rstd = gated_ref(x, z, None, eps, group_size, norm_before_gate)[1]
    return to_float64(rstd).reshape(_groups(x, group_size).shape[:2] + (1,))


def gated_bwd_ref(dy, x, z, weight=None, rstd=None, eps=EPS, group_size=None,
                  norm_before_gate=False, weight_offset=0.0):
    """(dx, dz, dweight or None) in float64; rstd None: recomputed from x and z with eps."""
    xg, zg, dyg = (_groups(a, group_size) for a in (x, z, dy))
    s, ds = _silu(zg)
    w = _gain(weight, weight_offset, xg)
    r = _rstd_of(x, z, rstd, eps, group_size, norm_before_gate)
    h_hat = (xg if norm_before_gate else xg * s) * r
    e = dyg * s if norm_before_gate else dyg
    ew = e * w
    dh = (ew - h_hat * np.mean(h_hat * ew, axis=-1, keepdims=True)) * r
    if norm_before_gate:
        dx, dz = dh, dyg * h_hat * w * ds
    else:
        dx, dz = dh * s, dh * xg * ds
    dweight = None if weight is None else np.sum(e * h_hat, axis=0).reshape(-1)
    return dx.reshape(np.shape(x)), dz.reshape(np.shape(x)), dweight


def grad_scales(dy, x, z, weight=None, rstd=None, eps=EPS, group_size=None,
                norm_before_gate=False, weight_offset=0.0):
    """(s_dx, s_dz): docs/api.md's s = |dy * W * rstd| per element for dx, as for
    rms_norm_backward; for dz (whose contract is "as the backward above") the same s times the
    gate's factor |x * silu'(z)| (the size of dz's terms for the input gate, dz itself for the
    output gate)."""
    xg, zg, dyg = (_groups(a, group_size) for a in (x, z, dy))
    _, ds = _silu(zg)
    r = _rstd_of(x, z, rstd, eps, group_size, norm_before_gate)
    s = np.abs(dyg * _gain(weight, weight_offset, xg) * r)
    return s.reshape(np.shape(x)), (s * np.abs(xg * ds)).reshape(np.shape(x))


def assert_grad(got, ref, scale, dtype, what):
    """docs/api.md's dx contract with ``scale`` as s: float32 ||got - ref|| < 1e-5 ||s||;
    16-bit every element within 2 ulp of ref + 1e-5 s.  NaN fails."""
    got = to_float64(got)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference {ref.shape}"
    err = np.abs(got - ref)
    if dtype == FLOAT32:
        bound = 1e-5 * np.linalg.norm(scale) + 1e-30
        assert np.linalg.norm(err) < bound, (
            f"float32 {what}: ||err|| {np.linalg.norm(err):.3e} >= 1e-5 ||s|| {bound:.3e}")
        return
    bad = ~(err <= 2 * ulp(ref, dtype) + 1e-5 * scale)
    if bad.any():
        first = np.unravel_index(np.argmax(bad), bad.shape)
        raise AssertionError(f"{dtype} {what}: {int(bad.sum())} element(s) beyond 2 ulp + 1e-5 s;"
                             f" first {first}: got {got[first]!r} ref {ref[first]!r}")


def make_inputs(rng, shape, dtype, wdtype, weight_offset=0.0, row_scales=True):
    """x (rows scaled over 10**[-2, 2]: rows must not leak into each other), z (silu over its
    curved part), dy, and a weight around 1 - weight_offset in ``wdtype`` (None: no weight)."""
    x = random_array(rng, shape, FLOAT32)
    if row_scales and len(shape) > 1:
        x *= (10.0 ** rng.uniform(-2, 2, shape[:-1] + (1,))).astype(np.float32)
    x = x.astype(NUMPY[dtype])
    z = random_array(rng, shape, dtype, scale=2.0)
    dy = random_array(rng, shape, dtype)
    w = None if wdtype is None else random_array(rng, shape[-1], wdtype, loc=1.0 - weight_offset,
                                                 scale=0.3)
    return x, z, dy, w


def check_forward(x, z, w, y, rstd, dtype, **kw):
    y_ref, rstd_ref = gated_ref(x, z, w, **kw)
    assert type(y) is np.ndarray and y.dtype == x.dtype and y.shape == x.shape
    assert rstd.dtype == np.float32 and rstd.shape == rstd_ref.shape, rstd.shape
    assert_close(y, y_ref, dtype)
    assert_close(rstd, rstd_ref, FLOAT32)


def check_backward(dy, x, z, w, rstd, dx, dz, dw, dtype, wdtype, **kw):
    """rstd: what the backward was given (None: recomputed)."""
    dx_ref, dz_ref, dw_ref = gated_bwd_ref(dy, x, z, w, rstd, **kw)
    s_dx, s_dz = grad_scales(dy, x, z, w, rstd, **kw)
    for got in (dx, dz):
        assert type(got) is np.ndarray and got.dtype == x.dtype and got.shape == x.shape
    assert_grad(dx, dx_ref, s_dx, dtype, "dx")
    assert_grad(dz, dz_ref, s_dz, dtype, "dz")
    if w is None:
        assert dw is None
    else:
        assert dw.dtype == w.dtype and dw.shape == w.shape
        assert_dweight(dw, dw_ref, wdtype)


def test_reference_is_torch_autograd():
    """The hand-derived gradients above against torch's autograd of the forward (float64), so
    that the reference the kernels are held to is itself right: both gates, groups, offset."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for norm_before_gate in (False, True):
        for group_size in (None, 4):
            x, z, dy, w = make_inputs(rng, (3, 12), FLOAT32, FLOAT32, 0.5)
            kw = dict(eps=1e-3, group_size=group_size, norm_before_gate=norm_before_gate,
                      weight_offset=0.5)
            y_t, grads = torch_gated_ref(torch, x, z, w, dy, **kw)
            y_ref = gated_ref(x, z, w, **kw)[0]
            np.testing.assert_allclose(y_ref, y_t, rtol=1e-12, atol=1e-14)
            for got, want in zip(gated_bwd_ref(dy, x, z, w, None, **kw), grads):
                np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def torch_gated_ref(torch, x, z, w, dy, eps=EPS, group_size=None, norm_before_gate=False,
                    weight_offset=0.0):
    """y and the gradients of (x, z, weight) from torch autograd in float64, the forward written
    as mamba_ssm's reference (ops/triton/layernorm_gated.py, rms_norm_ref) has it."""
    def t(a):
        return None if a is None else torch.from_numpy(to_float64(a)).requires_grad_()

    x64, z64, w64 = t(x), t(z), t(w)
    h = x64 if norm_before_gate else x64 * torch.nn.functional.silu(z64)
    n = h.shape[-1]
    g = n if group_size is None else group_size
    hg = h.reshape(h.shape[:-1] + (n // g, g))
    rstd = 1 / torch.sqrt(hg.square().mean(dim=-1, keepdim=True) + eps)
    y = (hg * rstd).reshape(h.shape)
    if w64 is not None:
        y = y * (w64 + weight_offset)
    if norm_before_gate:
        y = y * torch.nn.functional.silu(z64)
    y.backward(torch.from_numpy(to_float64(dy)))
    return y.detach().numpy(), (x64.grad.numpy(), z64.grad.numpy(),
                                None if w64 is None else w64.grad.numpy())


# ---- the CPU matrix ------------------------------------------------------------------------------

def gate_id(norm_before_gate):
    return "norm_then_gate" if norm_before_gate else "gate_then_norm"


# (N, group_size): one element, a ragged few, 127 (15 eight-lane groups + tail 7), five groups of
# 40, four groups of 1024 (the GPU backward's multi-chunk groups)
NGS = [(1, None), (3, None), (127, None), (200, 40), (4096, 1024)]
SHAPES = [(m, n, g) for n, g in NGS for m in (1, 7, 33)]
# (x dtype, weight dtype, norm_before_gate, rstd given or recomputed): every one in CI.  A CPU
# kernel is a numba compile per variant and array layout (~1.5 s each, and CI's kernel cache starts
# empty), so the default tier runs three that between them take every dtype, kind of weight, gate
# and rstd form, and every other default test reuses them; only QUICK_STRIDED adds row-strided
# (non-contiguous) layouts.
VARIANTS = [(d, w, gate, given) for d, w in WEIGHT_COMBOS for gate in (False, True)
            for given in (True, False)]
QUICK_STRIDED = (BFLOAT16, FLOAT32, True, True)
QUICK = {QUICK_STRIDED, (FLOAT16, FLOAT16, False, False), (FLOAT32, None, False, True)}
# the strided and torch tests in CI: each dtype with both gates, the weights rotating
STRIDED = [v for v in VARIANTS if v in QUICK or v in {
    (FLOAT32, None, True, False), (FLOAT16, FLOAT32, True, True), (BFLOAT16, BFLOAT16, False,
                                                                    False)}]


def variant_id(v):
    dtype, wdtype, gate, given = v[:4]
    return f"{dtype}-w_{wdtype or 'none'}-{gate_id(gate)}-{'rstd' if given else 'recompute'}"


def tiered(values, quick, name=variant_id):
    """``values`` (tuples of arguments) as pytest params named by ``name``, those not ``quick``
    in the full tier only (conftest.full_tier_except, with ids)."""
    return [pytest.param(*v, id=name(v), marks=() if quick(v) else pytest.mark.full)
            for v in values]


VARIANT = "dtype,wdtype,norm_before_gate,given"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}-G{s[2]}")
@pytest.mark.parametrize(VARIANT, tiered(VARIANTS, QUICK.__contains__))
def test_matches_reference(rng, dtype, wdtype, norm_before_gate, given, shape):
    m, n, g = shape
    x, z, dy, w = make_inputs(rng, (m, n), dtype, wdtype)
    before = [None if a is None else a.copy() for a in (x, z, dy, w)]
    kw = dict(group_size=g, norm_before_gate=norm_before_gate)

    y, rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)
    dx, dz, dw = rms_norm_gated_backward(dy, x, z, w, rstd if given else None, **kw)

    check_forward(x, z, w, y, rstd, dtype, **kw)
    check_backward(dy, x, z, w, rstd if given else None, dx, dz, dw, dtype, wdtype, **kw)
    for a, a0, name in zip((x, z, dy, w), before, ("x", "z", "dy", "weight")):
        if a is not None:
            assert_bitwise(a, a0, f"{name} after the calls")
    y_only = rms_norm_gated(x, z, w, **kw)
    assert_bitwise(y_only, y, "y without and with return_rstd")


@pytest.mark.parametrize("weight_offset", [1.0, -0.25])
@pytest.mark.parametrize(VARIANT, tiered([v for v in VARIANTS if v[1]], QUICK.__contains__))
def test_weight_offset_and_eps(rng, dtype, wdtype, norm_before_gate, given, weight_offset):
    """W = weight + weight_offset (Gemma-style weights near 0), and eps where it matters (rows
    of small values): forward and backward."""
    x, z, dy, w = make_inputs(rng, (7, 200), dtype, wdtype, weight_offset)
    x = (x.astype(np.float32) * 1e-3).astype(x.dtype)
    kw = dict(eps=1e-5, group_size=40, norm_before_gate=norm_before_gate,
              weight_offset=weight_offset)

    y, rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)
    grads = rms_norm_gated_backward(dy, x, z, w, rstd if given else None, **kw)

    check_forward(x, z, w, y, rstd, dtype, **kw)
    check_backward(dy, x, z, w, rstd if given else None, *grads, dtype, wdtype, **kw)
    # neither the offset nor eps is absorbed elsewhere: without them the result is far off
    for drop in ("weight_offset", "eps"):
        with pytest.raises(AssertionError):
            assert_close(y, gated_ref(x, z, w, **{**kw, drop: 0.0})[0], dtype)


def test_gate_product_is_not_rounded():
    """h = x * silu(z) stays float32: float16 x and z whose product is past float16's range
    still normalise to finite values (and so do their gradients)."""
    x = np.array([[60000.0, -60000.0, 1000.0, 3.0]], np.float16)
    z = np.array([[4.0, 3.0, 2.0, 1.0]], np.float16)
    w = np.ones(4, np.float16)
    with np.errstate(over="ignore"):
        assert np.isinf((x.astype(np.float32) * z.astype(np.float32)).astype(np.float16)).any()
    y, rstd = rms_norm_gated(x, z, w, return_rstd=True)
    assert np.isfinite(y).all()
    check_forward(x, z, w, y, rstd, FLOAT16)
    dy = np.ones_like(x)
    check_backward(dy, x, z, w, None, *rms_norm_gated_backward(dy, x, z, w), FLOAT16, FLOAT16)


@pytest.mark.parametrize(VARIANT, tiered(STRIDED, lambda v: v == QUICK_STRIDED))
def test_strided_rows_out_and_in_place(rng, dtype, wdtype, norm_before_gate, given):
    """x, z and dy as column slices of wider buffers (three row strides): bitwise their
    contiguous copies' results.  out= a column slice of a poisoned buffer: written there only;
    out=x in place: bitwise the out-of-place y."""
    m, n, g = 7, 200, 40
    x0, z0, dy0, w = make_inputs(rng, (m, n), dtype, wdtype)
    x = random_array(rng, (m, n + 3), dtype)[:, 1:n + 1]
    z = random_array(rng, (m, n + 24), dtype)[:, 16:n + 16]
    dy = random_array(rng, (m, n + 8), dtype)[:, 8:]
    x[...], z[...], dy[...] = x0, z0, dy0
    kw = dict(group_size=g, norm_before_gate=norm_before_gate)
    y_c, rstd_c = rms_norm_gated(x0, z0, w, return_rstd=True, **kw)
    grads_c = rms_norm_gated_backward(dy0, x0, z0, w, rstd_c if given else None, **kw)

    y, rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)
    grads = rms_norm_gated_backward(dy, x, z, w, rstd if given else None, **kw)

    assert_bitwise(y, y_c, "strided y")
    assert_bitwise(rstd, rstd_c, "strided rstd")
    for got, want, what in zip(grads, grads_c, ("dx", "dz", "dweight")):
        if want is not None:
            assert_bitwise(got, want, f"strided {what}")
    buf = np.full((m, n + 11), np.nan, NUMPY[dtype])
    buf0 = buf.copy()
    out = buf[:, 5:n + 5]
    assert rms_norm_gated(x, z, w, out=out, **kw) is out
    assert_bitwise(out, y_c, "out= y")
    pad = np.ones(buf.shape, bool)
    pad[:, 5:n + 5] = False
    assert_bitwise(buf[pad], buf0[pad], "the buffer around out")
    x_before = x.base.copy()
    assert rms_norm_gated(x, z, w, out=x, **kw) is x
    assert_bitwise(x, y_c, "in place x")
    outside = np.ones(x.base.shape, bool)
    outside[:, 1:n + 1] = False
    assert_bitwise(x.base[outside], x_before[outside], "the buffer around x in place")


@pytest.mark.parametrize("group_size", [None, 40])
@pytest.mark.parametrize(VARIANT, tiered(VARIANTS, QUICK.__contains__))
def test_outputs_written_exactly(rng, dtype, wdtype, norm_before_gate, given, group_size):
    """Every output and workspace starts as poison inside guard bands: every element written,
    nothing outside (tests/_guard.py)."""
    x, z, dy, w = make_inputs(rng, (7, 200), dtype, wdtype)
    kw = dict(group_size=group_size, norm_before_gate=norm_before_gate)
    with guarded_outputs() as guards:
        _, rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)
    guards.check(written=True)
    with guarded_outputs() as guards:
        rms_norm_gated_backward(dy, x, z, w, rstd if given else None, **kw)
    guards.check(written=True)


@pytest.mark.parametrize(VARIANT, tiered(VARIANTS, QUICK.__contains__))
def test_batch_invariance(rng, monkeypatch, dtype, wdtype, norm_before_gate, given):
    """A row's y, rstd, dx and dz are the same bits alone (M = 1, a copy) as inside a batch of
    33 run on several threads, wherever it sits; NaN stays in its row (and its group)."""
    monkeypatch.setattr(cpu_backend, "PARALLEL_MIN_ELEMENTS", 1)   # threads for the batch
    m, n, g = 33, 200, 40
    x, z, dy, w = make_inputs(rng, (m, n), dtype, wdtype)
    kw = dict(group_size=g, norm_before_gate=norm_before_gate)
    y, rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)
    dx, dz, _ = rms_norm_gated_backward(dy, x, z, w, rstd if given else None, **kw)

    for i in (0, 16, m - 1):
        one = [aligned_copy(a[i]) for a in (x, z, dy)]
        y1, r1 = rms_norm_gated(one[0], one[1], w, return_rstd=True, **kw)
        assert_bitwise(y1, y[i], f"y of row {i} alone")
        assert_bitwise(r1[0], rstd[i], f"rstd of row {i} alone")
        dx1, dz1, _ = rms_norm_gated_backward(one[2], one[0], one[1], w,
                                              r1 if given else None, **kw)
        assert_bitwise(dx1, dx[i], f"dx of row {i} alone")
        assert_bitwise(dz1, dz[i], f"dz of row {i} alone")

    z_nan = z.copy()
    z_nan[5, g + 1] = np.nan            # row 5, group 1
    y_n, rstd_n = rms_norm_gated(x, z_nan, w, return_rstd=True, **kw)
    dx_n, dz_n, _ = rms_norm_gated_backward(dy, x, z_nan, w, rstd_n if given else None, **kw)
    rows = np.arange(m) != 5
    for got, want, what in ((y_n, y, "y"), (rstd_n, rstd, "rstd"), (dx_n, dx, "dx"),
                            (dz_n, dz, "dz")):
        assert_bitwise(got[rows], want[rows], f"{what} of the rows without NaN")
    others = np.r_[0:g, 2 * g:n]
    for got, want, what in ((y_n, y, "y"), (dx_n, dx, "dx"), (dz_n, dz, "dz")):
        assert_bitwise(got[5, others], want[5, others], f"{what} of the row's other groups")
    assert np.isnan(y_n[5, g + 1].astype(np.float32))
    assert np.isnan(dx_n[5, g:2 * g].astype(np.float32)).all()
    # the input gate normalises x * silu(z): NaN in its rstd too; the output gate's is x's
    assert np.isnan(rstd_n[5, 1]) != norm_before_gate


@pytest.mark.parametrize(VARIANT, tiered([v for v in VARIANTS if v[3]], QUICK.__contains__))
def test_a_group_is_a_row(rng, dtype, wdtype, norm_before_gate, given):
    """With group_size G, each group's y, rstd, dx and dz are the bits of that group's columns
    normalised as rows of their own with their slice of the weight."""
    m, n, g = 7, 200, 40
    x, z, dy, w = make_inputs(rng, (m, n), dtype, wdtype)
    kw = dict(norm_before_gate=norm_before_gate)
    y, rstd = rms_norm_gated(x, z, w, group_size=g, return_rstd=True, **kw)
    dx, dz, _ = rms_norm_gated_backward(dy, x, z, w, rstd, group_size=g, **kw)
    for k in range(n // g):
        cols = slice(k * g, (k + 1) * g)
        part = [np.ascontiguousarray(a[:, cols]) for a in (x, z, dy)]
        w_k = None if w is None else w[cols]
        y_k, rstd_k = rms_norm_gated(part[0], part[1], w_k, return_rstd=True, **kw)
        dx_k, dz_k, _ = rms_norm_gated_backward(part[2], part[0], part[1], w_k, rstd_k, **kw)
        assert_bitwise(y_k, y[:, cols], f"y of group {k}")
        assert_bitwise(rstd_k, rstd[:, k], f"rstd of group {k}")
        assert_bitwise(dx_k, dx[:, cols], f"dx of group {k}")
        assert_bitwise(dz_k, dz[:, cols], f"dz of group {k}")


@pytest.mark.parametrize(VARIANT, tiered([v for v in VARIANTS if v[1]], QUICK.__contains__))
def test_deterministic_dweight(rng, monkeypatch, dtype, wdtype, norm_before_gate, given):
    """dweight is a fixed-order float32 sum: the same bits from run to run (several row groups,
    several threads), and deterministic=False changes nothing."""
    monkeypatch.setattr(cpu_backend, "PARALLEL_MIN_ELEMENTS", 1)
    x, z, dy, w = make_inputs(rng, (3000, 64), dtype, wdtype)
    kw = dict(group_size=16, norm_before_gate=norm_before_gate)
    rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)[1] if given else None
    first = rms_norm_gated_backward(dy, x, z, w, rstd, **kw)
    check_backward(dy, x, z, w, rstd, *first, dtype, wdtype, **kw)
    for deterministic in (True, False):
        again = rms_norm_gated_backward(dy, x, z, w, rstd, deterministic=deterministic, **kw)
        for got, want, what in zip(again, first, ("dx", "dz", "dweight")):
            assert_bitwise(got, want, f"{what} run to run (deterministic={deterministic})")


def test_leading_dims_and_one_row(rng):
    """x (..., N): rows flattened, rstd (M,) or (M, N // G); a 1-D x is one row."""
    x, z, dy, w = make_inputs(rng, (2, 3, 200), BFLOAT16, FLOAT32)
    kw = dict(group_size=40, norm_before_gate=True)
    y, rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)
    assert y.shape == (2, 3, 200) and rstd.shape == (6, 5)
    y2, rstd2 = rms_norm_gated(x.reshape(6, 200), z.reshape(6, 200), w, return_rstd=True, **kw)
    assert_bitwise(y.reshape(6, 200), y2, "y of (..., N) vs (M, N)")
    assert_bitwise(rstd, rstd2, "rstd of (..., N) vs (M, N)")
    dx, dz, dw = rms_norm_gated_backward(dy, x, z, w, rstd, **kw)
    grads2 = rms_norm_gated_backward(dy.reshape(6, 200), x.reshape(6, 200), z.reshape(6, 200),
                                     w, rstd2, **kw)
    assert dx.shape == dz.shape == (2, 3, 200)
    for got, want, what in zip((dx.reshape(6, 200), dz.reshape(6, 200), dw), grads2,
                               ("dx", "dz", "dweight")):
        assert_bitwise(got, want, f"{what} of (..., N) vs (M, N)")
    y1, rstd1 = rms_norm_gated(x[0, 0], z[0, 0], w, norm_before_gate=True, return_rstd=True)
    assert y1.shape == (200,) and rstd1.shape == (1,)
    check_forward(x[0, 0], z[0, 0], w, y1, rstd1, BFLOAT16, norm_before_gate=True)


@pytest.mark.parametrize("group_size", [None, 40])
def test_empty_batch(rng, group_size):
    """M == 0: empty y and rstd ((0,) or (0, N // G)), empty dx and dz, N zeros of dweight."""
    w = random_array(rng, 80, FLOAT32)
    e = np.empty((0, 80), NUMPY[BFLOAT16])
    y, rstd = rms_norm_gated(e, e, w, group_size=group_size, return_rstd=True)
    assert y.shape == (0, 80) and rstd.dtype == np.float32
    assert rstd.shape == ((0,) if group_size is None else (0, 2))
    dx, dz, dw = rms_norm_gated_backward(e, e, e, w, group_size=group_size)
    assert dx.shape == dz.shape == (0, 80)
    assert dw.shape == (80,) and dw.dtype == np.float32 and not dw.any()


@pytest.mark.parametrize("group_size", [None, 40])
def test_empty_batch_with_the_forwards_rstd(rng, group_size):
    e = np.empty((0, 80), NUMPY[BFLOAT16])
    _, rstd = rms_norm_gated(e, e, group_size=group_size, return_rstd=True)
    dx, dz, dw = rms_norm_gated_backward(e, e, e, None, rstd, group_size=group_size)
    assert dx.shape == dz.shape == (0, 80) and dw is None


@pytest.mark.full
def test_cpu_backward_accuracy_long_groups():
    """float16, 257 rows of 8 groups of 640 (Mamba 2's d_inner 5120, ngroups 8), input gate:
    every element of dx within the contract."""
    m, n, g = 257, 5120, 640
    rng = np.random.default_rng(m + n)
    x = rng.standard_normal((m, n)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-2, 2, (m, 1))).astype(np.float32)
    z = (2 * rng.standard_normal((m, n))).astype(np.float16)
    dy = rng.standard_normal((m, n)).astype(np.float16)
    w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    x = x.astype(np.float16)
    kw = dict(group_size=g, norm_before_gate=False)
    _, rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)
    check_backward(dy, x, z, w, rstd, *rms_norm_gated_backward(dy, x, z, w, rstd, **kw),
                   FLOAT16, FLOAT32, **kw)


# ---- errors: raised before anything is written ---------------------------------------------------

def _args(rng):
    x, z, dy, w = make_inputs(rng, (4, 80), BFLOAT16, FLOAT32)
    rstd = rms_norm_gated(x, z, w, group_size=40, norm_before_gate=True, return_rstd=True)[1]
    return dict(x=x, z=z, dy=dy, w=w, rstd=rstd)


GROUP = "group_size must be None or an integer dividing N = 80, got "
RSTD = "rstd must be a contiguous array of shape (4, 2), got shape "
FWD_ERRORS = [
    ("group_size=0", dict(group_size=0), ValueError,
     GROUP + "0"),
    ("group_size=-40", dict(group_size=-40), ValueError, GROUP + "-40"),
    ("group_size=7", dict(group_size=7), ValueError, GROUP + "7"),
    ("group_size=160", dict(group_size=160), ValueError, GROUP + "160"),
    ("group_size=40.0", dict(group_size=40.0), TypeError, GROUP + "40.0"),
    ("group_size=True", dict(group_size=True), TypeError, GROUP + "True"),
    ("z=None", dict(z=None), TypeError, "z must be an array like x, got None"),
    ("z shape", dict(z="half"), ValueError, "z must have x's shape (4, 80), got (4, 40)"),
    ("z dtype", dict(z="float16"), TypeError, "z must have x's dtype bfloat16, got float16"),
    ("weight shape", dict(w="half"), ValueError, "weight must have shape (80,), got (40,)"),
    ("offset without weight", dict(w=None, weight_offset=1.0), ValueError,
     "weight_offset must be 0.0 when weight is None, got 1.0"),
    ("norm_before_gate=1", dict(norm_before_gate=1), TypeError,
     "norm_before_gate must be a bool, got int"),
    ("return_rstd=1", dict(return_rstd=1), TypeError, "return_rstd must be a bool, got int"),
    ("eps<0", dict(eps=-1.0), ValueError, "eps must be a finite number >= 0, got -1.0"),
    ("out dtype", dict(out="float16"), TypeError, "out must have dtype bfloat16, got float16"),
    ("out=z", dict(out="z"), ValueError, "out overlaps z"),
]


def _change(a, how):
    if how == "half":
        return np.ascontiguousarray(a[..., :a.shape[-1] // 2])
    return a.astype(NUMPY[how])


@pytest.mark.parametrize("change,exc,match", [c[1:] for c in FWD_ERRORS],
                         ids=[c[0] for c in FWD_ERRORS])
def test_forward_errors(rng, change, exc, match):
    """ValueError / TypeError naming the argument, before out (poisoned) is written."""
    a = _args(rng)
    out = np.full(a["x"].shape, np.nan, a["x"].dtype)
    out0 = out.copy()
    kw = dict(group_size=40, out=out)
    for key, value in change.items():
        if key in ("z", "w"):
            a[key] = _change(a[key], value) if isinstance(value, str) else value
        elif key == "out":
            kw["out"] = a["z"] if value == "z" else np.full(out.shape, np.nan, NUMPY[value])
        else:
            kw[key] = value
    z0 = None if a["z"] is None else a["z"].copy()
    with pytest.raises(exc, match="^rms_norm_gated: " + re.escape(match)):
        rms_norm_gated(a["x"], a["z"], a["w"], **kw)
    assert_bitwise(out, out0, "out after the refused call")
    if z0 is not None:
        assert_bitwise(a["z"], z0, "z after the refused call")


BWD_ERRORS = [
    ("rstd (M,) with groups", dict(rstd="row"), ValueError, RSTD + "(4,)"),
    ("rstd flattened", dict(rstd="flat"), ValueError, RSTD + "(8,)"),
    ("rstd groups without group_size", dict(group_size=None), ValueError,
     "rstd must be a contiguous array of shape (4,), got shape (4, 2)"),
    ("rstd float64", dict(rstd="float64"), TypeError,
     "rstd must have dtype float32, got float64"),
    ("rstd column-major", dict(rstd="fortran"), ValueError, RSTD + "(4, 2) strides (1, 4)"),
    ("group_size=7", dict(group_size=7), ValueError, GROUP + "7"),
    ("dy shape", dict(dy="half"), ValueError, "dy must have x's shape (4, 80), got (4, 40)"),
    ("dy dtype", dict(dy="float32"), TypeError, "dy must have x's dtype bfloat16, got float32"),
    ("z dtype", dict(z="float16"), TypeError, "z must have x's dtype bfloat16, got float16"),
    ("z=None", dict(z=None), TypeError, "z must be an array like x, got None"),
    ("deterministic=0", dict(deterministic=0), TypeError, "deterministic must be a bool"),
    ("norm_before_gate='yes'", dict(norm_before_gate="yes"), TypeError,
     "norm_before_gate must be a bool, got str"),
    ("offset without weight", dict(w=None, weight_offset=0.5), ValueError,
     "weight_offset must be 0.0 when weight is None, got 0.5"),
]


@pytest.mark.parametrize("change,exc,match", [c[1:] for c in BWD_ERRORS],
                         ids=[c[0] for c in BWD_ERRORS])
def test_backward_errors(rng, change, exc, match):
    a = _args(rng)
    kw = dict(group_size=40)
    for key, value in change.items():
        if key == "rstd":
            r = a["rstd"]
            a["rstd"] = {"row": np.ascontiguousarray(r[:, 0]), "flat": r.reshape(-1),
                         "float64": r.astype(np.float64), "fortran": np.asfortranarray(r)}[value]
        elif key in ("z", "w", "dy"):
            a[key] = _change(a[key], value) if isinstance(value, str) else value
        else:
            kw[key] = value
    with pytest.raises(exc, match="^rms_norm_gated_backward: " + re.escape(match)):
        rms_norm_gated_backward(a["dy"], a["x"], a["z"], a["w"], a["rstd"], **kw)


@pytest.mark.parametrize(VARIANT, tiered([v for v in VARIANTS if v[0] != FLOAT32],
                                         QUICK.__contains__))
def test_uint16_storage_with_dtype_keyword(rng, dtype, wdtype, norm_before_gate, given):
    """dtype= reads uint16 storage (CuPy's bfloat16) as everywhere: uint16 in, uint16 out (a
    float32 weight and rstd stay float32), the native call's bits."""
    x, z, dy, w = make_inputs(rng, (3, 40), dtype, wdtype)
    kw = dict(norm_before_gate=norm_before_gate)

    def bits16(a):
        return a.view(np.uint16) if a is not None and a.dtype.itemsize == 2 else a

    y16, rstd16 = rms_norm_gated(bits16(x), bits16(z), bits16(w), return_rstd=True, dtype=dtype,
                                 **kw)
    grads16 = rms_norm_gated_backward(bits16(dy), bits16(x), bits16(z), bits16(w),
                                      rstd16 if given else None, dtype=dtype, **kw)
    y, rstd = rms_norm_gated(x, z, w, return_rstd=True, **kw)
    grads = rms_norm_gated_backward(dy, x, z, w, rstd if given else None, **kw)
    assert y16.dtype == np.uint16
    assert_bitwise(y16.view(y.dtype), y, "y from uint16 storage")
    assert_bitwise(rstd16, rstd, "rstd from uint16 storage")
    for got, want in zip(grads16, grads):
        if want is None:
            assert got is None
            continue
        assert got.dtype == bits16(want).dtype
        assert_bitwise(got.view(want.dtype), want, "gradient from uint16 storage")


# ---- the simulator: the GPU kernels (kernels/rmsnorm_fwd.py's gate, kernels/gated_bwd.py) ----

@dataclass(frozen=True)
class SimCase:
    dtype: str
    n: int
    m: int
    weight: str = None
    group_size: int = None
    norm_before_gate: bool = False
    given_rstd: bool = True
    weight_offset: float = 0.0

    @property
    def id(self):
        return (f"{self.dtype}-{self.m}x{self.n}-G{self.group_size}-w_{self.weight or 'none'}-"
                f"{gate_id(self.norm_before_gate)}-{'rstd' if self.given_rstd else 'recompute'}"
                + (f"-offset{self.weight_offset:g}" if self.weight_offset else ""))

    @property
    def g(self):
        return self.group_size or self.n

    def kw(self):
        return dict(group_size=self.group_size, norm_before_gate=self.norm_before_gate,
                    weight_offset=self.weight_offset)


S = SimCase
SIM_CASES = [
    # one thread a row, 128 rows a block, a ragged chunk (scalar only); 33 rows
    S(FLOAT32, 3, 33, FLOAT32, norm_before_gate=True, given_rstd=False),
    # two threads a row, 64 rows a block, no weight; 33 rows (the last row alone: a streamed
    # program, bitwise the batch's one-shot rows)
    S(BFLOAT16, 16, 33, None),
    # two warps a row (64 threads), summed through shared memory; offset; 6 rows (alone:
    # streamed, the weight held, the output gate after it)
    S(FLOAT32, 256, 6, FLOAT32, norm_before_gate=True, weight_offset=0.5),
    # groups: five of 40 a row (8 threads each, 16 group rows a block, 80-slot backward grid)
    S(FLOAT16, 200, 3, FLOAT16, group_size=40, given_rstd=False),
    # a backward row read twice (looped: 512 threads of 4-5 chunks), ragged over the threads
    S(FLOAT32, 8196, 1, FLOAT32, norm_before_gate=True),
    # full tier: groups with the output gate; a ragged 127 (scalar only); four groups of 1024
    # (128-thread group rows); a 4096 row whose backward threads take two chunks each; two
    # looped 16-bit groups of 8192
    S(BFLOAT16, 200, 3, FLOAT32, group_size=40, norm_before_gate=True, weight_offset=1.0),
    S(BFLOAT16, 127, 5, BFLOAT16, given_rstd=False),
    S(BFLOAT16, 4096, 2, BFLOAT16, group_size=1024, norm_before_gate=True),
    S(FLOAT32, 4096, 1, FLOAT32, given_rstd=False),
    S(BFLOAT16, 16384, 1, BFLOAT16, group_size=8192, given_rstd=False),
]
SIM_QUICK = 5


def _sim_run(be, x, z, dy, w, case):
    """((y, rstd), (dx, dz, dweight), forward spec, backward spec): one forward and one
    backward (given or recomputed rstd) with every output guarded (tests/_guard.py)."""
    with launched_specs(be) as specs, guarded_outputs() as guards:
        y, rstd = rms_norm_gated(x, z, w, return_rstd=True, **case.kw())
        grads = rms_norm_gated_backward(dy, x, z, w, rstd if case.given_rstd else None,
                                        **case.kw())
    guards.check(written=True)
    fwd = [s for s in specs if isinstance(s, _config.FwdSpec)]
    bwd = [s for s in specs if isinstance(s, _config.GatedBwdSpec)]
    assert len(fwd) == 1 and len(bwd) == 1, specs
    return (y, rstd), grads, fwd[0], bwd[0]


@pytest.mark.sim
@pytest.mark.parametrize("case", full_tier_except(SIM_CASES,
                                                  lambda c: c in SIM_CASES[:SIM_QUICK]),
                         ids=lambda c: c.id)
def test_sim_paths(rng, use_backend, monkeypatch, case):
    """The kernels' vector form (aligned rows) against the reference, bitwise against the
    scalar form (the same rows one element past a 16-byte boundary) and against the last row
    alone; dweight from the reduction kernel == the simulator's host form of its order, and run
    to run."""
    be = use_backend("sim")
    m, n = case.m, case.n
    x0, z0, dy0, w = make_inputs(rng, (m, n), case.dtype, case.weight, case.weight_offset)
    x, z, dy = (aligned_copy(a) for a in (x0, z0, dy0))
    w = None if w is None else aligned_copy(w)
    itemsize = NUMPY[case.dtype].itemsize
    vector = case.g * itemsize % 16 == 0
    # the dweight reduction kernel runs 8 simulated threads a column: where that is cheap
    monkeypatch.setattr(be, "reduce_on_host", case.n > 16)

    (y, rstd), grads, fwd, bwd = _sim_run(be, x, z, dy, w, case)

    assert fwd.gate == ("output" if case.norm_before_gate else "input"), fwd
    assert fwd.heads == (case.g != n) and fwd.vector == vector, fwd
    assert fwd.layout == _config.gated_row_layout(case.g, case.dtype), fwd
    assert bwd.layout == _config.gated_bwd_layout(case.g, case.dtype), bwd
    assert bwd.vector == vector and bwd.recompute_rstd != case.given_rstd, bwd
    assert bwd.gate == fwd.gate and bwd.weight == (case.weight or ""), bwd
    kw = dict(case.kw(), eps=EPS)
    check_forward(x, z, w, y, rstd, case.dtype, **kw)
    check_backward(dy, x, z, w, rstd if case.given_rstd else None, *grads, case.dtype,
                   case.weight, **kw)

    monkeypatch.setattr(be, "reduce_on_host", True)
    twin = [aligned_copy(a, offset=itemsize) for a in (x, z, dy)]
    (y_s, rstd_s), grads_s, fwd_s, bwd_s = _sim_run(be, *twin, w, case)
    assert not fwd_s.vector and not bwd_s.vector, (fwd_s, bwd_s)
    assert_bitwise(y_s, y, "scalar form vs vector y")
    assert_bitwise(rstd_s, rstd, "scalar form vs vector rstd")
    for got, want, what in zip(grads_s, grads, ("dx", "dz", "dweight")):
        if want is not None:
            assert_bitwise(got, want, f"scalar form vs vector {what}")

    i = m - 1
    y_1, rstd_1 = rms_norm_gated(x[i:], z[i:], w, return_rstd=True, **case.kw())
    assert_bitwise(y_1, y[i:], f"y of row {i} alone")
    assert_bitwise(rstd_1, rstd[i:], f"rstd of row {i} alone")
    dx_1, dz_1, _ = rms_norm_gated_backward(dy[i:], x[i:], z[i:], w,
                                            rstd[i:] if case.given_rstd else None, **case.kw())
    assert_bitwise(dx_1, grads[0][i:], f"dx of row {i} alone")
    assert_bitwise(dz_1, grads[1][i:], f"dz of row {i} alone")


# (looped rows' held form, x's dtype, the _config limit that turns it off): float32 rows of 4100
# are 512 threads of 2-3 chunks, too many words to hold; 16-bit ones 512 threads of 1-2 chunks
HELD_FORMS = {"held_partial": (FLOAT32, "GATED_BWD_MAX_HELD_PARTIAL"),
              "held_words": (BFLOAT16, "GATED_BWD_MAX_HELD_WORDS")}


@pytest.mark.sim
@pytest.mark.parametrize("form", list(HELD_FORMS))
@pytest.mark.parametrize("norm_before_gate", full_tier_except([False, True], lambda g: not g),
                         ids=gate_id)
def test_sim_held_forms_give_the_looped_bits(rng, use_backend, monkeypatch, norm_before_gate,
                                             form):
    """Looped group rows short enough keep their dweight partial in registers
    (GatedBwdSpec.held_partial) rather than in the slot's workspace row, and where their
    chunks' words fit too, read the row once and keep it as words (held_words) rather than
    read it twice: the same operations in the same order, so the same bits.  Three rows over
    the simulator's two slots: one slot accumulates two rows."""
    be = use_backend("sim")
    monkeypatch.setattr(be, "reduce_on_host", True)
    dtype, limits = HELD_FORMS[form]
    m, n = 3, 4100
    x, z, dy, w = (aligned_copy(a) if a is not None else None for a in
                   make_inputs(rng, (m, n), dtype, FLOAT32, 0.0))
    kw = dict(norm_before_gate=norm_before_gate)
    runs = []
    for held in (True, False):      # the simulator runs the NVIDIA configuration
        limit = getattr(_config, limits)["cuda"] if held else 0
        monkeypatch.setitem(getattr(_config, limits), "cuda", limit)
        with launched_specs(be) as specs:
            runs.append(rms_norm_gated_backward(dy, x, z, w, None, **kw))
        (spec,) = [s for s in specs if isinstance(s, _config.GatedBwdSpec)]
        assert not spec.layout.cached and getattr(spec, form) == held, spec
    check_backward(dy, x, z, w, None, *runs[0], dtype, FLOAT32, eps=EPS, **kw)
    for got, want, what in zip(runs[0], runs[1], ("dx", "dz", "dweight")):
        assert_bitwise(got, want, f"{what}: {form} vs looped")


# ---- the torch adapter ---------------------------------------------------------------------------

@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def rt(torch):
    from rmsnorm_hip import torch as adapter
    return adapter


TORCH_DTYPE = {FLOAT32: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16"}


def bits(torch, t):
    """A tensor's raw bits as NumPy (bfloat16 included)."""
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()]).numpy()


def np_bits(a):
    return a.view(f"i{a.itemsize}")


def to_torch(torch, a):
    """A NumPy array (bfloat16 included) as a CPU tensor of the same dtype and values."""
    if a is None:
        return None
    if a.dtype == NUMPY[BFLOAT16]:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


# (x dtype, weight dtype, norm_before_gate, group_size, x / z / dy row-strided): the torch backward
# is given the forward's rstd; the default tier's contiguous cases run its kernels, the strided one
# QUICK_STRIDED's
TORCH_CASES = ([(*v[:3], 40 if v[0] != FLOAT16 else None, True) for v in STRIDED if v[3]]
               + [(FLOAT32, None, False, None, False), (FLOAT16, FLOAT16, False, 40, False)])


def torch_case_id(c):
    return (f"{variant_id(c[:3] + (True,)).rsplit('-', 1)[0]}-G{c[3]}"
            + ("-strided" if c[4] else "-contiguous"))


@pytest.mark.parametrize("dtype,wdtype,norm_before_gate,group_size,strided", tiered(
    TORCH_CASES, lambda c: c[:3] == QUICK_STRIDED[:3] if c[4] else c[:3] + (True,) in QUICK,
    torch_case_id))
def test_torch_grads_match_float64(torch, rt, rng, monkeypatch, dtype, wdtype, norm_before_gate,
                                   group_size, strided):
    """rmsnorm_hip.torch.rms_norm_gated's y and autograd gradients of x, z and weight against
    torch's autograd in float64 (mamba_ssm's reference formula), with the contract's
    tolerances; row-strided x and z (halves of one projection) are read in place (no copy)."""
    from rmsnorm_hip import gated
    seen = []
    real = gated.rms_norm_gated

    def spy(x, z, *args, **kwargs):
        seen.append((x.data_ptr(), x.stride(), z.data_ptr(), z.stride()))
        return real(x, z, *args, **kwargs)
    monkeypatch.setattr(gated, "rms_norm_gated", spy)
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate,
              weight_offset=0.25 if wdtype else 0.0)
    x, z, dy, w = make_inputs(rng, (2, 3, 200), dtype, wdtype, kw["weight_offset"])
    if strided:
        wide = to_torch(torch, np.concatenate([x, z, dy], axis=-1))
        xt, zt, dyt = (wide[..., k * 200:(k + 1) * 200] for k in range(3))
        assert not xt.is_contiguous()
    else:
        xt, zt, dyt = (to_torch(torch, a) for a in (x, z, dy))
    xt, zt = xt.detach().requires_grad_(), zt.detach().requires_grad_()
    wt = None if w is None else to_torch(torch, w).requires_grad_()

    y = rt.rms_norm_gated(xt, zt, wt, **kw)
    y.backward(dyt)

    assert seen == [(xt.data_ptr(), xt.stride(), zt.data_ptr(), zt.stride())]

    y_ref, (dx_ref, dz_ref, dw_ref) = torch_gated_ref(torch, x, z, w, dy, **kw)
    assert y.dtype == xt.dtype and y.shape == xt.shape
    assert_close(y.detach().float().numpy(), y_ref, dtype)
    rstd = gated_ref(x, z, None, kw["eps"], group_size, norm_before_gate)[1]
    s_dx, s_dz = grad_scales(dy, x, z, w, rstd, **kw)
    assert_grad(xt.grad, dx_ref, s_dx, dtype, "x.grad")
    assert_grad(zt.grad, dz_ref, s_dz, dtype, "z.grad")
    if w is not None:
        assert wt.grad.dtype == wt.dtype
        assert_dweight(wt.grad, dw_ref, wdtype)
    # the adapter's y is the array API's, bitwise
    assert_bitwise(bits(torch, y), np_bits(rms_norm_gated(x, z, w, **kw)), "torch vs array y")


def test_torch_only_the_gradients_asked_for(torch, rt, rng):
    x, z, _, w = make_inputs(rng, (4, 64), BFLOAT16, FLOAT32)
    xt, zt, wt = (to_torch(torch, a) for a in (x, z, w))
    zt.requires_grad_()
    y = rt.rms_norm_gated(xt, zt, wt, group_size=16, norm_before_gate=True)
    y.sum().backward()
    assert zt.grad is not None and xt.grad is None and wt.grad is None
    with torch.no_grad():
        y2 = rt.rms_norm_gated(xt, zt, wt, group_size=16, norm_before_gate=True)
    assert y2.grad_fn is None and torch.equal(y2, y.detach())


class MambaRMSNormGated:
    """What the module replaces (mamba_ssm.ops.triton.layernorm_gated.RMSNorm): its constructor
    defaults and its forward in float64 (``rms_norm_ref``: upcast, gate, normalise per group,
    scale, gate)."""
    DEFAULTS = dict(eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None)

    @staticmethod
    def forward(torch, x, z, weight, eps, group_size, norm_before_gate):
        x64, z64 = x.double(), None if z is None else z.double()
        if z64 is not None and not norm_before_gate:
            x64 = x64 * torch.nn.functional.silu(z64)
        n = x64.shape[-1]
        g = n if group_size is None else group_size
        xg = x64.reshape(x64.shape[:-1] + (n // g, g))
        out = (xg / torch.sqrt(xg.square().mean(-1, keepdim=True) + eps)).reshape(x64.shape)
        out = out * weight.double()
        if z64 is not None and norm_before_gate:
            out = out * torch.nn.functional.silu(z64)
        return out


def test_module_is_mamba_ssm_rmsnormgated(torch, rt, rng):
    """RMSNormGated: mamba_ssm's constructor and defaults, a ``weight`` of ones as the one
    state_dict entry (no bias), loads a trained weight from such a state_dict, and computes
    its forward within the contract: gated by z, per group or not, bitwise rms_norm_gated's;
    without z an RMSNorm of each group or of the row, differentiable."""
    import inspect
    params = inspect.signature(rt.RMSNormGated).parameters
    assert list(params) == ["hidden_size", *MambaRMSNormGated.DEFAULTS]
    assert {k: params[k].default for k in MambaRMSNormGated.DEFAULTS} == MambaRMSNormGated.DEFAULTS
    half = rt.RMSNormGated(200, group_size=40, norm_before_gate=False, dtype=torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16 and not half.norm_before_gate
    module = rt.RMSNormGated(200, group_size=40)
    assert list(module.state_dict()) == ["weight"] and module.bias is None
    assert module.eps == 1e-5 and module.norm_before_gate and module.group_size == 40
    assert module.weight.dtype == torch.float32 and torch.equal(module.weight.data,
                                                                torch.ones(200))
    trained = torch.from_numpy(random_array(rng, 200, FLOAT32, loc=1.0, scale=0.3))
    module.load_state_dict({"weight": trained}, strict=True)
    assert torch.equal(module.weight.data, trained)
    assert "group_size=40" in repr(module) and "norm_before_gate=True" in repr(module)
    x, z, _, _ = make_inputs(rng, (3, 200), BFLOAT16, None)
    xt, zt = to_torch(torch, x), to_torch(torch, z)
    for group_size in (40, None):
        module.group_size = group_size
        with torch.no_grad():
            y = module(xt, zt)
            y_fn = rt.rms_norm_gated(xt, zt, module.weight, 1e-5, group_size=group_size,
                                     norm_before_gate=True)
            ref = MambaRMSNormGated.forward(torch, xt, zt, module.weight, 1e-5, group_size,
                                            True)
        assert_close(y.float().numpy(), ref.numpy(), BFLOAT16)
        assert torch.equal(y.view(torch.int16), y_fn.view(torch.int16))
    for group_size in (None, 40):
        module.group_size = group_size
        xg, x64 = xt.detach().requires_grad_(), xt.detach().double().requires_grad_()
        w64 = module.weight.detach().double().requires_grad_()
        plain = module(xg)
        ref = MambaRMSNormGated.forward(torch, x64, None, w64, 1e-5, group_size, True)
        assert plain.dtype == torch.bfloat16
        assert_close(plain.detach().float().numpy(), ref.detach().numpy(), BFLOAT16)
        dy = torch.from_numpy(random_array(rng, (3, 200), FLOAT32))
        (plain.float() * dy).sum().backward()
        (ref * dy.double()).sum().backward()
        # dy reaches the kernels rounded to bfloat16: the gradient as a whole, not per element
        for got, want in ((xg.grad, x64.grad), (module.weight.grad, w64.grad)):
            got = got.double()
            assert torch.linalg.norm(got - want) < 1e-2 * torch.linalg.norm(want)
        module.weight.grad = None


# (op, x dtype, weight, eps, weight_offset, group_size, norm_before_gate): the default tier's
# kernels (test_matches_reference's QUICK), one forward and one backward there
OPCHECK = [("rms_norm_gated", BFLOAT16, FLOAT32, 1e-6, 0.5, 16, True),
           ("rms_norm_gated_backward", BFLOAT16, FLOAT32, 1e-6, 0.5, 16, True),
           ("rms_norm_gated", BFLOAT16, None, 1e-5, 0.0, None, False),
           ("rms_norm_gated", FLOAT32, FLOAT32, 1e-6, 0.0, 8, False),
           ("rms_norm_gated_backward", BFLOAT16, None, 1e-6, 0.0, None, False)]


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if k < 2 else pytest.mark.full)
                                  for k, c in enumerate(OPCHECK)],
                         ids=lambda c: f"{c[0]}-{c[1]}-w_{c[2] or 'none'}-G{c[5]}-{gate_id(c[6])}")
def test_opcheck(torch, rt, rng, case):
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) on
    rmsnorm_hip::rms_norm_gated and rms_norm_gated_backward."""
    op, dtype, wdtype, eps, offset, group_size, norm_before_gate = case
    x, z, dy, w = (to_torch(torch, a) for a in make_inputs(rng, (3, 5, 32), dtype, wdtype))
    ops = torch.ops.rmsnorm_hip
    flags = (eps, offset, group_size, norm_before_gate)
    if op == "rms_norm_gated":
        leaf = [None if t is None else t.detach().clone().requires_grad_() for t in (x, z, w)]
        torch.library.opcheck(ops.rms_norm_gated, (*leaf, *flags))
        return
    rstd = ops.rms_norm_gated(x, z, w, *flags)[1]
    assert rstd.shape == ((15,) if group_size is None else (15, 32 // group_size))
    torch.library.opcheck(ops.rms_norm_gated_backward, (dy, x, z, w, rstd, *flags))


class GatedBlock:
    """Mamba 2's output path: in_proj -> (x, z) -> gated norm (groups) -> out_proj."""

    @staticmethod
    def make(torch, rt, d):
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.in_proj = torch.nn.Linear(d, 2 * d)
                self.norm = rt.RMSNormGated(d, group_size=d // 4, norm_before_gate=False)
                self.out_proj = torch.nn.Linear(d, d)

            def forward(self, h):
                x, z = self.in_proj(h).chunk(2, dim=-1)     # row-strided views
                return self.out_proj(self.norm(x, z))

        return Block()


@pytest.mark.full
def test_compile_fullgraph_bitwise_eager(torch, rt):
    """torch.compile(fullgraph=True) traces the gated op (fake implementations, autograd) in one
    graph over dynamic batch sizes; outputs and every gradient bitwise the eager ones."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = GatedBlock.make(torch, rt, 64)
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    for m in (3, 5, 8):
        h = torch.randn(m, 64)
        h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
        torch._dynamo.mark_dynamic(h1, 0)
        out = compiled(h1)
        out.sum().backward()
        grads = [p.grad.clone() for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        eager = block(h2)
        eager.sum().backward()
        assert torch.equal(out, eager), f"M={m} compiled vs eager output"
        assert torch.equal(h1.grad, h2.grad), f"M={m} input grad"
        for a, (name, p) in zip(grads, block.named_parameters()):
            assert torch.equal(a, p.grad), f"M={m} {name}.grad compiled vs eager"
        block.zero_grad(set_to_none=True)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times over 3 batch sizes"
