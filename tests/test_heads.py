"""rms_norm and rms_norm_backward on rows at two strides (docs/api.md, "Shapes"): head-shaped
views whose leading dims do not flatten to one row stride but to two groups of one stride each,
such as the (T, H, D) view of a fused QKV buffer (strides (row, D, 1)), a transposed
(H, T, D) -> (T, H, D) view, and 4-D (B, S, H, D) views; on the CPU backend, the simulator and
through the torch adapter.

Every call is bitwise the same call on a contiguous copy (y, rstd, dx and dweight; on the
simulator also where the contiguous backward takes the paired kernel), within the contract of
the float64 reference, writes its outputs and nothing else (out= may be head-shaped itself, or x
in place), and layouts that need three strides, or overlapping, zero or negative strides, raise
ValueError naming the argument before anything is written."""
from dataclasses import dataclass

import numpy as np
import pytest
import re

from conftest import (BFLOAT16, FLOAT16, FLOAT32, NUMPY, WEIGHT_COMBOS, aligned_copy,
                      assert_bitwise, assert_close, assert_dweight, assert_dx, random_array)
from test_sim import launched_specs

from rmsnorm_hip import functional, rms_norm, rms_norm_backward
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import rms_norm_backward_ref, rms_norm_ref

pytestmark = pytest.mark.quick

EPS = 1e-6


# ---- layouts: a logical (..., H, D) array placed in a bigger buffer -----------------------------

@dataclass(frozen=True)
class Layout:
    """How a head-shaped view sits in its buffer: ``buffer_shape(lead, h, d)`` and ``view(buf,
    lead, h, d)`` -> the (*lead, h, d) view; ``lead`` is (T,) or (B, S)."""
    name: str
    buffer_shape: object
    view: object


LAYOUTS = [
    # q heads of a fused QKV projection: rows of 3 H D, head stride D
    Layout("qkv_q", lambda lead, h, d: lead + (3 * h * d,),
           lambda buf, lead, h, d: buf[..., :h * d].reshape(lead + (h, d))),
    # k heads: the same, starting H D elements into each row
    Layout("qkv_k", lambda lead, h, d: lead + (3 * h * d,),
           lambda buf, lead, h, d: buf[..., h * d:2 * h * d].reshape(lead + (h, d))),
    # heads-major storage seen token-major: token stride D, head stride T D (or B S D)
    Layout("heads_major", lambda lead, h, d: (h,) + lead + (d,),
           lambda buf, lead, h, d: (buf.movedim(0, -2) if hasattr(buf, "movedim")
                                    else np.moveaxis(buf, 0, -2))),
    # padded rows of (S) H D elements: a token (batch) stride, then (S) H rows at stride D
    Layout("padded_batch", lambda lead, h, d: (lead[0], int(np.prod(lead[1:])) * h * d + 8),
           lambda buf, lead, h, d: buf[:, :int(np.prod(lead[1:])) * h * d].reshape(
               lead + (h, d))),
]
LAYOUT = {layout.name: layout for layout in LAYOUTS}
# dy's layout beside x's: another whose 4-D views split where x's do (qkv and heads-major after
# (B, S), padded_batch after B: between them three strides, which are refused)
OTHER = {"qkv_q": LAYOUT["qkv_k"], "qkv_k": LAYOUT["heads_major"],
         "heads_major": LAYOUT["qkv_q"], "padded_batch": LAYOUT["padded_batch"]}


def place(rng, values, layout):
    """(view in ``layout`` holding ``values`` (*lead, H, D), its buffer, mask of the buffer's
    elements outside the view).  The rest of the buffer holds poison (values around -7)."""
    *lead, h, d = values.shape
    lead = tuple(lead)
    shape = layout.buffer_shape(lead, h, d)
    buf = random_array(rng, shape, values.dtype, loc=-7.0)
    view = layout.view(buf, lead, h, d)
    assert view.shape == values.shape and not np.shares_memory(view, values)
    view[...] = values
    index = layout.view(np.arange(buf.size).reshape(shape), lead, h, d)
    outside = np.ones(buf.size, bool)
    outside[index.reshape(-1)] = False
    return view, buf, outside.reshape(shape)


def splits_in_two(a):
    """Whether the view's leading dims need two strides (what these tests are about)."""
    from rmsnorm_hip import _arrays, _validate
    return _validate.row_split([_arrays.describe(a, "x", None, "test")]) is not None


def combo_id(combo):
    return f"{combo[0]}-w_{combo[1] or 'none'}"


# ---- forward and backward bitwise their contiguous copies' ---------------------------------------

# (x dtype, weight dtype, rstd given to the backward, dresidual): the default tier runs two, the
# layouts all in one array-layout signature each (the CPU kernels compile per signature), CI all
COMBOS = [(d, w, given, dres) for d, w in WEIGHT_COMBOS for given, dres in ((True, False),
                                                                           (False, True))]
QUICK = {(FLOAT32, FLOAT32, True, False), (BFLOAT16, None, False, True)}
# (lead, H, D): 3-D (T, H, D) and 4-D (B, S, H, D) shapes; D ragged (127), 64, and 4096 (16-bit
# rows with a weight pair up in the GPU backward)
SHAPES = [((5,), 3, 127), ((2, 3), 2, 64), ((2,), 2, 4096)]


def tiered_combos():
    return [pytest.param(*c, id=f"{combo_id(c)}-{'rstd' if c[2] else 'recompute'}"
                         + ("-dres" if c[3] else ""), marks=() if c in QUICK else pytest.mark.full)
            for c in COMBOS]


@pytest.mark.parametrize("lead,h,d", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
@pytest.mark.parametrize("dtype,wdtype,given,dres", tiered_combos())
def test_head_rows_bitwise_contiguous(rng, layout, lead, h, d, dtype, wdtype, given, dres):
    """y and rstd of the view == of its contiguous copy, and within the contract; dx and
    dweight likewise, with dy in another layout that splits where x's does and dresidual in
    x's; x's buffer keeps its bits."""
    shape = lead + (h, d)
    scales = (10.0 ** rng.uniform(-2, 2, shape[:-1] + (1,))).astype(np.float32)
    x0 = (random_array(rng, shape, FLOAT32) * scales).astype(NUMPY[dtype])
    w = None if wdtype is None else random_array(rng, d, wdtype, loc=1.0, scale=0.3)
    x, x_buf, _ = place(rng, x0, layout)
    assert splits_in_two(x), (layout.name, x.strides)
    x_buf0 = x_buf.copy()

    y, rstd = rms_norm(x, w, return_rstd=True)

    y_c, rstd_c = rms_norm(x0, w, return_rstd=True)
    assert y.shape == shape and y.flags.c_contiguous and rstd.shape == (x0.size // d,)
    assert_bitwise(y, y_c, "y of the view vs of its contiguous copy")
    assert_bitwise(rstd, rstd_c, "rstd of the view vs of its contiguous copy")
    y_ref, rstd_ref = rms_norm_ref(x0, w)
    assert_close(y, y_ref, dtype)
    assert_close(rstd, rstd_ref, FLOAT32)
    assert_bitwise(x_buf, x_buf0, "x's buffer after the forward")

    dy0, dr0 = random_array(rng, shape, dtype), random_array(rng, shape, dtype) if dres else None
    dy = place(rng, dy0, OTHER[layout.name])[0]
    dr = None if dr0 is None else place(rng, dr0, layout)[0]
    r = rstd if given else None

    dx, dw = rms_norm_backward(dy, x, w, r, dresidual=dr)

    dx_c, dw_c = rms_norm_backward(dy0, x0, w, r, dresidual=dr0)
    assert dx.shape == shape and dx.flags.c_contiguous
    assert_bitwise(dx, dx_c, "dx of the views vs of contiguous copies")
    ref_dx, ref_dw = rms_norm_backward_ref(dy0, x0, w, r, dresidual=dr0)
    assert_dx(dx, dy0, x0, w, rstd, ref_dx, dtype)
    if w is None:
        assert dw is None and dw_c is None
    else:
        assert_bitwise(dw, dw_c, "dweight of the views vs of contiguous copies")
        assert_dweight(dw, ref_dw, wdtype)
    assert_bitwise(x_buf, x_buf0, "x's buffer after the backward")


# (x, dy, dresidual): which is head-shaped (a layout's name) and which contiguous (None); each
# mixture is a CPU kernel signature of its own: the default tier runs the one an autograd backward
# has (a head-view x, a contiguous dy) and a contiguous x with head-shaped dy and dresidual
MIXED = [("qkv_k", None, None), (None, "qkv_k", "qkv_k"), (None, "qkv_k", None),
         (None, None, "qkv_k"), ("qkv_k", "heads_major", None), ("heads_major", "qkv_k", "qkv_k")]
QUICK_MIXED = MIXED[:2]


@pytest.mark.parametrize("x_lay,dy_lay,dr_lay", [
    pytest.param(*mix, id="-".join(lay or "contiguous" for lay in mix),
                 marks=() if mix in QUICK_MIXED else pytest.mark.full) for mix in MIXED])
@pytest.mark.parametrize("dtype,wdtype", [
    (FLOAT32, FLOAT32), pytest.param(BFLOAT16, FLOAT32, marks=pytest.mark.full)], ids=str)
def test_mixed_layouts_in_the_backward(rng, dtype, wdtype, x_lay, dy_lay, dr_lay):
    """Any of x, dy and dresidual may be the head-shaped one (the others contiguous, or
    head-shaped in another layout): bitwise the all-contiguous dx and dweight."""
    shape = (4, 3, 64)
    x0, dy0, dr0 = (random_array(rng, shape, dtype) for _ in range(3))
    w = random_array(rng, 64, wdtype, loc=1.0, scale=0.3)
    rstd = rms_norm(x0, w, return_rstd=True)[1]
    expected = rms_norm_backward(dy0, x0, w, rstd, dresidual=dr0)
    x, dy, dr = (a if lay is None else place(rng, a, LAYOUT[lay])[0]
                 for a, lay in ((x0, x_lay), (dy0, dy_lay), (dr0, dr_lay)))
    dx, dw = rms_norm_backward(dy, x, w, rstd, dresidual=dr)
    assert_bitwise(dx, expected[0], "dx")
    assert_bitwise(dw, expected[1], "dweight")


# ---- out=: head-shaped outputs, in place, nothing else written -----------------------------------

@pytest.mark.parametrize("dtype,wdtype", [(FLOAT32, FLOAT32), (BFLOAT16, None), pytest.param(
    FLOAT16, FLOAT32, marks=pytest.mark.full)], ids=str)
def test_head_shaped_out_and_in_place(rng, dtype, wdtype):
    """out= a head-shaped view of a poisoned buffer (for a contiguous x, or normalising q into
    k's slot of the same QKV buffer), and in place (out=x): y and rstd bitwise the contiguous
    call's; every other element of the buffers keeps its bits."""
    t, h, d = 5, 3, 64
    x0 = random_array(rng, (t, h, d), dtype)
    w = None if wdtype is None else random_array(rng, d, wdtype, loc=1.0, scale=0.3)
    y_c, rstd_c = rms_norm(x0, w, return_rstd=True)

    for layout in LAYOUTS[:3]:
        out, buf, outside = place(rng, np.zeros_like(x0), layout)
        buf0 = buf.copy()
        y, rstd = rms_norm(x0, w, out=out, return_rstd=True)
        assert y is out
        assert_bitwise(out, y_c, f"out= {layout.name}")
        assert_bitwise(rstd, rstd_c, f"rstd with out= {layout.name}")
        assert_bitwise(buf[outside], buf0[outside], f"the buffer around out= {layout.name}")

    q, buf, _ = place(rng, x0, LAYOUT["qkv_q"])
    k = LAYOUT["qkv_k"].view(buf, (t,), h, d)
    buf0 = buf.copy()
    y, rstd = rms_norm(q, w, out=k, return_rstd=True)
    assert y is k
    assert_bitwise(k, y_c, "q normalised into k's slot")
    assert_bitwise(rstd, rstd_c, "rstd of q normalised into k's slot")
    k_cols = np.zeros(buf.shape, bool)
    k_cols[:, h * d:2 * h * d] = True
    assert_bitwise(buf[~k_cols], buf0[~k_cols], "q and v after normalising q into k's slot")

    for layout in LAYOUTS[:3]:
        x, buf, outside = place(rng, x0, layout)
        buf0 = buf.copy()
        y, rstd = rms_norm(x, w, out=x, return_rstd=True)
        assert y is x
        assert_bitwise(x, y_c, f"in place {layout.name}")
        assert_bitwise(rstd, rstd_c, f"rstd in place {layout.name}")
        assert_bitwise(buf[outside], buf0[outside], f"the buffer around x in place {layout.name}")


# ---- layouts that are refused -------------------------------------------------------------------

def _strided(base, shape, strides):
    item = base.itemsize
    return np.lib.stride_tricks.as_strided(base, shape, tuple(s * item for s in strides))


THREE = "leading dimensions must flatten to at most two strides (tokens, then heads)"
OVERLAP = "rows must not overlap (zero, negative and overlapping strides are not supported)"
BAD_LAYOUTS = [
    # (B, H, S, D) storage seen as (B, S, H, D): batch, sequence and heads at three strides
    pytest.param(lambda rng: random_array(rng, (2, 2, 3, 8), FLOAT32).transpose(0, 2, 1, 3),
                 THREE, id="three_strides"),
    pytest.param(lambda rng: np.broadcast_to(random_array(rng, (3, 1, 8), FLOAT32), (3, 2, 8)),
                 OVERLAP, id="zero_head_stride"),
    pytest.param(lambda rng: random_array(rng, (3, 32), FLOAT32)[:, :16].reshape(3, 2, 8)[:, ::-1],
                 OVERLAP, id="negative_head_stride"),
    pytest.param(lambda rng: _strided(random_array(rng, 64, FLOAT32), (3, 2, 8), (16, 4, 1)),
                 OVERLAP, id="heads_overlap"),
    pytest.param(lambda rng: _strided(random_array(rng, 64, FLOAT32), (3, 2, 8), (8, 16, 1)),
                 OVERLAP, id="tokens_overlap_heads"),
]


@pytest.mark.parametrize("arg", ["x", "out", "dy", "dresidual"])
@pytest.mark.parametrize("make,message", BAD_LAYOUTS)
def test_refused_layouts_name_the_argument(rng, arg, make, message):
    """A layout that needs three strides, or rows that overlap (zero, negative or too small
    strides), raises ValueError naming the argument before anything is written."""
    bad = make(rng)
    good = random_array(rng, bad.shape, FLOAT32)
    out = np.full(bad.shape, np.nan, np.float32)
    if arg == "out" and not bad.flags.writeable:      # a broadcast view: refused as such first
        message = "must be writeable, got a read-only array"
    fn = "rms_norm_backward" if arg in ("dy", "dresidual") else "rms_norm"
    with pytest.raises(ValueError, match=f"^{fn}: {arg} " + re.escape(message)):
        if arg == "x":
            rms_norm(bad, out=out)
        elif arg == "out":
            rms_norm(good, out=bad)
        elif arg == "dy":
            rms_norm_backward(bad, good)
        else:
            rms_norm_backward(good, good, dresidual=bad)
    assert np.isnan(out).all(), "out was written before the error"


def test_two_row_strides_that_do_not_agree_are_refused(rng):
    """x split after (B, S), out after B: between them three strides -> ValueError naming out;
    the same out for a contiguous x is fine."""
    b, s, h, d = 2, 3, 2, 8
    x = place(rng, random_array(rng, (b, s, h, d), FLOAT32), LAYOUT["qkv_q"])[0]
    w = random_array(rng, d, FLOAT32, loc=1.0, scale=0.3)
    out, buf, _ = place(rng, np.zeros((b, s, h, d), np.float32), LAYOUT["padded_batch"])
    buf0 = buf.copy()
    with pytest.raises(ValueError, match="^rms_norm: out leading dimensions must flatten"):
        rms_norm(x, w, out=out)
    assert_bitwise(buf, buf0, "out's buffer after the refused call")
    rms_norm(np.ascontiguousarray(x), w, out=out, return_rstd=True)
    assert_bitwise(out, rms_norm(x, w, return_rstd=True)[0], "out (batch split) for a "
                   "contiguous x")


def test_row_count_limit_and_empty_views():
    """Two-stride rows index with 32 bits: 2**31 rows or more raise ValueError (before any
    memory is touched); an empty head view returns empty outputs."""
    buf = np.zeros(8, np.float32)
    huge = _strided(buf, (1 << 16, (1 << 15) + 1, 1), ((1 << 15) + 2, 1, 1))
    with pytest.raises(ValueError, match="^rms_norm: x with two row strides may have at most "
                                         r"2\*\*31 - 1 rows"):
        rms_norm(huge)
    empty = np.zeros((0, 3 * 2 * 8), np.float32)[:, :16].reshape(0, 2, 8)
    y, rstd = rms_norm(empty, return_rstd=True)
    assert y.shape == (0, 2, 8) and rstd.shape == (0,)
    dx, dw = rms_norm_backward(empty, empty, np.ones(8, np.float32))
    assert dx.shape == (0, 2, 8) and not dw.any()


# ---- the simulator: the GPU kernels' head rows (FwdSpec.heads, BwdSpec.heads) --------------------

@dataclass(frozen=True)
class SimCase:
    dtype: str
    t: int
    h: int
    d: int
    layout: str
    weight: str = None
    given_rstd: bool = True
    dres: bool = False

    @property
    def id(self):
        return (f"{self.dtype}-T{self.t}-H{self.h}-D{self.d}-{self.layout}"
                f"-w_{self.weight or 'none'}-{'rstd' if self.given_rstd else 'recompute'}"
                + ("-dres" if self.dres else ""))


SIM_CASES = [
    # 16 threads a row, 8 rows a block (ragged: the last block part empty)
    SimCase(FLOAT32, 2, 3, 64, "qkv_q", FLOAT32),
    # two threads a row, 64 rows a block; heads-major storage; recomputed rstd and dresidual
    SimCase(BFLOAT16, 3, 2, 16, "heads_major", None, given_rstd=False, dres=True),
    # two warps a row summed through shared memory (full tier)
    SimCase(FLOAT16, 2, 2, 512, "qkv_k", FLOAT16),
]
SIM_QUICK = 2


def _sim_specs(be, call):
    with launched_specs(be) as specs:
        result = call()
    return result, specs


@pytest.mark.sim
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=() if k < SIM_QUICK
                                               else pytest.mark.full)
                                  for k, c in enumerate(SIM_CASES)])
def test_sim_head_rows(rng, use_backend, case):
    """The head-row kernels (vector: every stride and pointer 16-byte aligned; scalar: the same
    views one element further into their buffers) bitwise the contiguous kernels' y, rstd, dx and
    dweight."""
    be = use_backend("sim")
    shape = (case.t, case.h, case.d)
    x0, dy0 = random_array(rng, shape, case.dtype), random_array(rng, shape, case.dtype)
    dr0 = random_array(rng, shape, case.dtype) if case.dres else None
    w = None if case.weight is None else random_array(rng, case.d, case.weight, loc=1.0,
                                                      scale=0.3)
    (y_c, rstd_c), _ = _sim_specs(be, lambda: rms_norm(x0, w, return_rstd=True))
    r = rstd_c if case.given_rstd else None
    dx_c, dw_c = rms_norm_backward(dy0, x0, w, r, dresidual=dr0)
    assert_close(y_c, rms_norm_ref(x0, w)[0], case.dtype)
    layout = LAYOUT[case.layout]
    itemsize = NUMPY[case.dtype].itemsize
    for vector in (True, False):
        views = []
        for a in (x0, dy0, dr0):
            if a is None:
                views.append(None)
                continue
            buf = place(rng, a, layout)[1]
            # 16-byte aligned, or the same layout one element further on
            buf = aligned_copy(buf, offset=0 if vector else itemsize)
            views.append(layout.view(buf, (case.t,), case.h, case.d))
        x, dy, dr = views
        assert splits_in_two(x)
        (y, rstd), specs = _sim_specs(be, lambda: rms_norm(x, w, return_rstd=True))
        assert len(specs) == 1 and specs[0].heads and specs[0].vector == vector, specs
        assert_bitwise(y, y_c, f"y ({'vector' if vector else 'scalar'})")
        assert_bitwise(rstd, rstd_c, f"rstd ({'vector' if vector else 'scalar'})")
        be._bwd_plans.clear()
        dx, dw = rms_norm_backward(dy, x, w, r, dresidual=dr)
        spec = {plan[0] for plan in be._bwd_plans.values()}.pop()
        assert spec.heads and spec.vector == (vector and case.d * itemsize % 16 == 0), spec
        assert_bitwise(dx, dx_c, f"dx ({'vector' if vector else 'scalar'})")
        if w is not None:
            assert_bitwise(dw, dw_c, f"dweight ({'vector' if vector else 'scalar'})")


@pytest.mark.sim
def test_sim_paired_backward_bits(rng, use_backend, monkeypatch):
    """16-bit rows of 4096 with a weight pair up in the contiguous backward once M >= 2 SMs'
    worth (the simulator has one SM: M >= 2) unless the kernel's column programs sum dweight
    (held off here: the calls they take do not pair); head rows walk them as the pair twin does:
    the same dx and dweight bits."""
    be = use_backend("sim")
    monkeypatch.setitem(_config.BWD_COLUMN_DWEIGHT_MAX_ROWS, "cuda", 0)
    t, h, d = 2, 2, 4096
    x0, dy0 = random_array(rng, (t, h, d), BFLOAT16), random_array(rng, (t, h, d), BFLOAT16)
    w = random_array(rng, d, BFLOAT16, loc=1.0, scale=0.3)
    rstd = rms_norm_ref(x0)[1].astype(np.float32)
    be._bwd_plans.clear()
    dx_c, dw_c = rms_norm_backward(dy0, x0, w, rstd)
    (contiguous,) = {plan[0] for plan in be._bwd_plans.values()}
    assert contiguous.paired and not contiguous.heads, contiguous
    x = place(rng, x0, LAYOUT["qkv_q"])[0]
    be._bwd_plans.clear()
    dx, dw = rms_norm_backward(dy0, x, w, rstd)
    (heads,) = {plan[0] for plan in be._bwd_plans.values()}
    assert heads.heads and heads.pair_twin and not heads.paired, heads
    assert_bitwise(dx, dx_c, "dx of head rows vs the paired kernel's")
    assert_bitwise(dw, dw_c, "dweight of head rows vs the paired kernel's")
    assert_dweight(dw, rms_norm_backward_ref(dy0, x0, w, rstd)[1], BFLOAT16)


# ---- the torch adapter ---------------------------------------------------------------------------

@pytest.fixture
def torch():
    return pytest.importorskip("torch")


TORCH_CASES = [pytest.param(FLOAT32, FLOAT32, "qkv_k", id="float32-w_float32-qkv_k"),
               pytest.param(BFLOAT16, FLOAT32, "heads_major", id="bfloat16-w_float32-heads_major",
                            marks=pytest.mark.full),
               pytest.param(FLOAT16, FLOAT16, "qkv_q", id="float16-w_float16-qkv_q",
                            marks=pytest.mark.full)]


@pytest.mark.parametrize("dtype,wdtype,layout", TORCH_CASES)
def test_torch_head_views_without_a_copy(torch, monkeypatch, dtype, wdtype, layout):
    """rmsnorm_hip.torch.rms_norm on a head view of a QKV projection: the view reaches the
    kernels as it is (forward and backward, no copy); y, the QKV buffer's gradient (the view's
    part; zeros elsewhere) and weight.grad against torch's F.rms_norm and autograd in
    float64."""
    from rmsnorm_hip import torch as rt
    tdtype = getattr(torch, dtype)
    t, h, d = 5, 3, 64
    lay = LAYOUT[layout]
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(lay.buffer_shape((t,), h, d), generator=gen).to(tdtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(d, generator=gen)).to(getattr(torch, wdtype)).requires_grad_()
    dy = torch.randn(t, h, d, generator=gen).to(tdtype)
    x = lay.view(buf, (t,), h, d)
    seen = []
    for name in ("rms_norm", "rms_norm_backward"):
        real = getattr(functional, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            a = args[0] if _name == "rms_norm" else args[1]
            seen.append((_name, a.data_ptr(), a.stride()))
            return _real(*args, **kwargs)
        monkeypatch.setattr(functional, name, spy)

    y = rt.rms_norm(x, w, EPS)
    y.backward(dy)

    assert seen == [("rms_norm", x.data_ptr(), x.stride()),
                    ("rms_norm_backward", x.data_ptr(), x.stride())], seen
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = torch.nn.functional.rms_norm(x64, (d,), w64, EPS)
    y64.backward(dy.double())
    assert_close(y.detach().float().numpy(), y64.detach().numpy(), dtype)
    rstd = rms_norm_ref(x.detach())[1]
    grad_view = lay.view(buf.grad, (t,), h, d)
    assert_dx(grad_view, dy, x.detach(), w.detach(), rstd, x64.grad.numpy(), dtype)
    assert_dweight(w.grad, w64.grad.numpy(), wdtype)
    rest = torch.ones_like(buf.grad, dtype=torch.bool)
    lay.view(rest, (t,), h, d)[...] = False
    assert not buf.grad[rest].any(), "gradient outside the view"


def test_torch_three_stride_views_are_copied(torch):
    """A (B, H, S, D) tensor seen as (B, S, H, D) needs three strides: the adapter copies it
    (the array API refuses it) and gives the contiguous tensor's bits."""
    from rmsnorm_hip import torch as rt
    x = torch.randn(2, 2, 3, 16).transpose(1, 2)
    w = 1 + 0.1 * torch.randn(16)
    assert torch.equal(rt.rms_norm(x, w), rt.rms_norm(x.contiguous(), w))
    with pytest.raises(ValueError, match="^rms_norm: x leading dimensions must flatten"):
        rms_norm(x, w)


def test_torch_backward_with_dy_split_elsewhere(torch):
    """QK-norm on the q heads of a (B, S, 3 H D) projection (split after (B, S)), then the
    sequence concatenated after a prefix: dy reaches the backward split after B."""
    from rmsnorm_hip import torch as rt
    b, s, h, d = 2, 3, 2, 8
    qkv = torch.randn(b, s, 3 * h * d, requires_grad=True)
    q = qkv[..., :h * d].view(b, s, h, d)
    w = 1 + 0.1 * torch.randn(d)
    y = rt.rms_norm(q, w, EPS)
    out = torch.cat([torch.randn(b, 4, h, d), y], dim=1)
    out.square().sum().backward()
    q64 = q.detach().double().requires_grad_()
    torch.cat([torch.zeros(b, 4, h, d).double(), torch.nn.functional.rms_norm(
        q64, (d,), w.double(), EPS)], dim=1).square().sum().backward()
    assert_close(qkv.grad[..., :h * d].reshape(b, s, h, d).numpy(), q64.grad.numpy(), FLOAT32)


@pytest.mark.full
def test_torch_opcheck_on_head_views(torch):
    """torch.library.opcheck of rmsnorm_hip::rms_norm and rms_norm_backward with head-view
    arguments (fake implementations and autograd registration agree with the kernels)."""
    qkv = torch.randn(4, 3 * 2 * 32)
    x = qkv[:, :64].view(4, 2, 32)
    w = 1 + 0.1 * torch.randn(32)
    ops = torch.ops.rmsnorm_hip
    torch.library.opcheck(ops.rms_norm, (x.detach().requires_grad_(), w.requires_grad_(), EPS,
                                         0.0))
    rstd = rms_norm(x, w.detach(), return_rstd=True)[1]
    dy = torch.randn(2, 4, 32).transpose(0, 1)
    torch.library.opcheck(ops.rms_norm_backward, (dy, x, w.detach(), rstd, None, EPS, 0.0))
