"""rms_norm_quant (dynamic per-token int8 / float8_e4m3fn, SmoothQuant xscale, fused residual) on
NumPy arrays (CPU backend; NaN and invariance tests on the simulator too) against the float64
reference: q within one level everywhere and equal for > 99.9%, yscale within 1e-5, zero rows,
NaN rows that do not leak, and the residual variant's three outputs."""
import ml_dtypes
import numpy as np
import pytest
from conftest import (DTYPES, FLOAT32, NUMPY, QUANT_DTYPES, QUANT_NUMPY, WEIGHT_COMBOS,
                      aligned_copy, aligned_empty, assert_bitwise, assert_quant_close,
                      quant_levels, random_array)
from test_fused import SHAPES, make_pair, shape_id
from test_rms_norm import combo_id, to_numpy, torch_dtype

from rmsnorm_hip import fused_add_rms_norm, rms_norm_quant
from rmsnorm_hip.backends import cpu as cpu_backend
from rmsnorm_hip.reference import rms_norm_quant_ref

pytestmark = pytest.mark.quick

QMAX = {"int8": 127, "float8_e4m3fn": 448}
# what a call adds to x and weight: SmoothQuant scale (float32 or x's dtype), fused residual
KINDS = {
    "plain": dict(),
    "xscale_f32": dict(xscale=FLOAT32),
    "xscale_x": dict(xscale="x"),
    "residual": dict(residual=True),
    "residual_xscale": dict(residual=True, xscale=FLOAT32),
}


def make_call(rng, shape, dtype, wdtype, kind, row_scales=True):
    """(x, weight, keyword arguments) of an rms_norm_quant call of ``kind``."""
    x, residual, w = make_pair(rng, shape, dtype, wdtype, row_scales)
    spec = KINDS[kind]
    kwargs = {}
    if spec.get("xscale"):
        xs_dtype = dtype if spec["xscale"] == "x" else spec["xscale"]
        # SmoothQuant scales spread over a decade, a few of them negative
        xs = (10.0 ** rng.uniform(-0.5, 0.5, shape[-1])).astype(np.float32)
        xs[::7] *= -1
        kwargs["xscale"] = xs.astype(NUMPY[xs_dtype])
    if spec.get("residual"):
        kwargs["residual"] = residual
    return x, w, kwargs


def check_quant(x, w, kwargs, quant_dtype, result):
    """The contract of one call: output types and shapes, q and yscale against the reference,
    and for the residual variant residual_out bitwise round(x + residual)."""
    m = int(np.prod(x.shape[:-1]))
    has_residual = kwargs.get("residual") is not None
    assert len(result) == (3 if has_residual else 2)
    q, yscale = result[:2]
    assert type(q) is np.ndarray and q.dtype == QUANT_NUMPY[quant_dtype] and q.shape == x.shape
    assert yscale.dtype == np.float32 and yscale.shape == (m,)
    ref = rms_norm_quant_ref(x, w, quant_dtype=quant_dtype, **kwargs)
    assert_quant_close(q, yscale, ref[0], ref[1], quant_dtype)
    if has_residual:
        residual_out = result[2]
        assert residual_out.dtype == x.dtype and residual_out.shape == x.shape
        assert_bitwise(residual_out, ref[2].astype(x.dtype), "residual_out vs round(x + residual)")


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_matches_reference(rng, quant_dtype, dtype, shape):
    x, w, kwargs = make_call(rng, shape, dtype, dtype, "plain")
    x0 = x.copy()

    result = rms_norm_quant(x, w, quant_dtype=quant_dtype)

    check_quant(x, w, kwargs, quant_dtype, result)
    assert_bitwise(x, x0, "x after the call")


def rotate(*axes):
    """The product of ``axes`` with QUANT_DTYPES rotating along it (each combination of the
    other axes once, each quant dtype on every value of each axis): half the CPU kernels of the
    full product to compile."""
    import itertools
    return [(QUANT_DTYPES[i % 2],) + combo for i, combo in enumerate(itertools.product(*axes))]


@pytest.mark.parametrize("quant_dtype,dtype,kind", rotate(DTYPES, list(KINDS)),
                         ids=lambda v: str(v))
def test_kinds(rng, quant_dtype, dtype, kind):
    """SmoothQuant scale in float32 and in x's dtype, fused residual, both (N with a tail of 1
    after the CPU's 8 lanes; the simulator tests take every GPU path)."""
    x, w, kwargs = make_call(rng, (7, 4097), dtype, dtype, kind)
    before = [a.copy() for a in [x] + [v for v in kwargs.values()]]

    result = rms_norm_quant(x, w, quant_dtype=quant_dtype, **kwargs)

    check_quant(x, w, kwargs, quant_dtype, result)
    for a, a0 in zip([x] + list(kwargs.values()), before):
        assert_bitwise(a, a0, "an input after the call")


@pytest.mark.parametrize("quant_dtype,combo", rotate(WEIGHT_COMBOS),
                         ids=lambda v: combo_id(v) if isinstance(v, tuple) else v)
def test_weight_dtypes_and_offset(rng, quant_dtype, combo):
    dtype, wdtype = combo
    x, w, kwargs = make_call(rng, (7, 127), dtype, wdtype, "xscale_f32")
    check_quant(x, w, kwargs, quant_dtype, rms_norm_quant(x, w, quant_dtype=quant_dtype, **kwargs))
    if w is not None:
        wo = rms_norm_quant(x, w - 1, quant_dtype=quant_dtype, weight_offset=1.0, **kwargs)
        ref = rms_norm_quant_ref(x, w - 1, quant_dtype=quant_dtype, weight_offset=1.0, **kwargs)
        assert_quant_close(wo[0], wo[1], ref[0], ref[1], quant_dtype)


@pytest.mark.parametrize("kind", ["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_zero_rows(rng, quant_dtype, dtype, kind):
    """An all-zero row (h = 0; with a residual, x = -residual) gets yscale 1.0 and q 0; the
    other rows are unaffected."""
    x, w, kwargs = make_call(rng, (5, 127), dtype, dtype, kind)
    if kind == "residual":
        x[2] = -kwargs["residual"][2]
    else:
        x[2] = 0
    q, yscale = rms_norm_quant(x, w, quant_dtype=quant_dtype, **kwargs)[:2]

    assert yscale[2] == 1.0
    assert np.all(quant_levels(q[2], quant_dtype) == 0), "q of a zero row is 0 (+0 or -0)"
    check_quant(x, w, kwargs, quant_dtype, rms_norm_quant(x, w, quant_dtype=quant_dtype, **kwargs))


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_levels_reach_qmax_and_saturate(rng, quant_dtype):
    """Each row's largest |y| is +-QMAX exactly; one dominant element drives the rest of its row
    to small levels (and, for int8, to 0)."""
    x = random_array(rng, (4, 64), FLOAT32)
    x[1, 7] = 1e4
    x[2, 9] = -1e4
    q, yscale = rms_norm_quant(x, quant_dtype=quant_dtype)

    levels = quant_levels(q, quant_dtype)
    top = quant_levels(np.array([QMAX[quant_dtype]]), quant_dtype)[0]
    assert np.all(np.abs(levels).max(axis=1) == top)
    assert levels[1, 7] == top and levels[2, 9] == -top
    if quant_dtype == "int8":
        assert np.all(np.abs(np.delete(levels[1], 7)) <= 1)
    check_quant(x, None, {}, quant_dtype, (q, yscale))


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_subnormal_yscale(rng, backend, quant_dtype):
    """Gains small enough that yscale is subnormal (xscale 1e-39): 1 / yscale overflows float32,
    so q = rne(y / yscale) is divided out (it once saturated every element to +-QMAX)."""
    x = random_array(rng, (3, 64), FLOAT32)
    xscale = np.full(64, 1e-39, np.float32)
    q, yscale = rms_norm_quant(x, xscale=xscale, quant_dtype=quant_dtype)
    assert np.all(yscale < np.finfo(np.float32).tiny) and np.all(yscale > 0)
    levels = quant_levels(q, quant_dtype)
    top = quant_levels(np.array([QMAX[quant_dtype]]), quant_dtype)[0]
    assert np.mean(np.abs(levels) == top) < 0.1, "levels saturated"
    # float32 holds a subnormal yscale to a spacing of 2**-149: q is checked against y_ref over
    # the yscale the kernel wrote, yscale against its reference within that spacing
    q_ref, yscale_ref = rms_norm_quant_ref(x, None, xscale=xscale, quant_dtype=quant_dtype)[:2]
    assert np.all(np.abs(yscale - yscale_ref) <= 1e-5 * yscale_ref + 2.0 ** -149)
    assert_quant_close(q, yscale, q_ref * yscale_ref[:, None] / yscale[:, None], yscale,
                       quant_dtype)


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_residual_variant_is_quant_of_residual_out(rng, quant_dtype):
    """With a residual, q and yscale are bitwise those of rms_norm_quant(residual_out), and
    residual_out is bitwise fused_add_rms_norm's."""
    for dtype in DTYPES:
        x, w, kwargs = make_call(rng, (9, 1000), dtype, dtype, "residual_xscale")
        q, yscale, residual_out = rms_norm_quant(x, w, quant_dtype=quant_dtype, **kwargs)
        q2, yscale2 = rms_norm_quant(residual_out, w, quant_dtype=quant_dtype,
                                     xscale=kwargs["xscale"])
        assert_bitwise(q, q2, f"{dtype}: q with residual vs q of residual_out")
        assert_bitwise(yscale, yscale2, f"{dtype}: yscale with residual vs of residual_out")
        _, ro_fused = fused_add_rms_norm(x, kwargs["residual"], w)
        assert_bitwise(residual_out, ro_fused, f"{dtype}: residual_out vs fused_add_rms_norm's")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kind", ["plain", "residual_xscale"])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_nan_and_inf_stay_in_their_row(rng, backend, quant_dtype, kind):
    dtype = "bfloat16"
    x, w, kwargs = make_call(rng, (6, 40), dtype, dtype, kind, row_scales=False)
    dirty = x.copy()
    dirty[1, 5] = np.nan
    dirty[3, 0] = np.inf

    clean = rms_norm_quant(x, w, quant_dtype=quant_dtype, **kwargs)
    got = rms_norm_quant(dirty, w, quant_dtype=quant_dtype, **kwargs)

    rows = [0, 2, 4, 5]
    for name, a, b in zip(("q", "yscale", "residual_out"), got, clean):
        assert_bitwise(a[rows], b[rows], f"{name} of rows without NaN/Inf")
    assert not np.isfinite(got[1][1]), "a NaN row's yscale says so"


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_row_strided_inputs(rng, quant_dtype):
    x_wide, r_wide, w = make_pair(rng, (7, 140), "bfloat16", "bfloat16")
    x, residual, w = x_wide[:, 3:130], r_wide[:, :127], w[:127].copy()
    xs = np.linspace(0.5, 2, 127).astype(np.float32)

    got = rms_norm_quant(x, w, xscale=xs, residual=residual, quant_dtype=quant_dtype)
    contiguous = rms_norm_quant(np.ascontiguousarray(x), w, xscale=xs,
                                residual=np.ascontiguousarray(residual), quant_dtype=quant_dtype)
    for name, a, b in zip(("q", "yscale", "residual_out"), got, contiguous):
        assert_bitwise(a, b, f"row-strided {name} vs contiguous")


# Batch invariance: CPU batches run the parallel kernel, rows alone the serial one
INVARIANCE_CASES = (
    [pytest.param("cpu", q, d, (333, 4097), kind, id=f"cpu-{q}-{d}-{kind}")
     for q, d, kind in (("int8", "float32", "residual_xscale"), ("float8_e4m3fn", "float16",
                        "xscale_x"), ("int8", "bfloat16", "plain"))]
    + [pytest.param("sim", q, "float16", (9, 1000), "residual_xscale", id=f"sim-{q}",
                    marks=[pytest.mark.sim, pytest.mark.full]) for q in QUANT_DTYPES]
)


@pytest.mark.parametrize("backend_name,quant_dtype,dtype,shape,kind", INVARIANCE_CASES)
def test_batch_invariance(rng, use_backend, backend_name, quant_dtype, dtype, shape, kind):
    use_backend(backend_name)
    m, n = shape
    if backend_name == "cpu":
        assert m * n >= cpu_backend.PARALLEL_MIN_ELEMENTS > n, "must run the parallel kernel"
    x, w, kwargs = make_call(rng, (m, n), dtype, dtype, kind)
    x = aligned_copy(x)
    full = rms_norm_quant(x, w, quant_dtype=quant_dtype, **kwargs)
    check_quant(x, w, kwargs, quant_dtype, full)

    for i in sorted({0, 1, m // 2, m - 1}):
        row_kwargs = dict(kwargs)
        if "residual" in kwargs:
            row_kwargs["residual"] = kwargs["residual"][i:i + 1]
        alone = rms_norm_quant(aligned_copy(x[i:i + 1]), w, quant_dtype=quant_dtype,
                               **row_kwargs)
        for name, a, b in zip(("q", "yscale", "residual_out"), alone, full):
            assert_bitwise(a[0], b[i], f"{name} of row {i} alone vs in the batch")
    shifted = aligned_empty((m, n + 1), dtype)[:, 1:]
    shifted[...] = x
    moved = rms_norm_quant(shifted, w, quant_dtype=quant_dtype, **kwargs)
    for name, a, b in zip(("q", "yscale", "residual_out"), moved, full):
        assert_bitwise(a, b, f"{name} at an unaligned start vs aligned")


def test_output_types_and_quant_dtype_spellings(rng):
    x, w, _ = make_call(rng, (3, 127), "bfloat16", "bfloat16", "plain")
    q8, s8 = rms_norm_quant(x, w)                       # default int8
    assert q8.dtype == np.int8
    qf, sf = rms_norm_quant(x, w, quant_dtype="float8_e4m3fn")
    assert qf.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    for spelling in (np.int8, np.dtype(np.int8)):
        assert_bitwise(rms_norm_quant(x, w, quant_dtype=spelling)[0], q8, f"{spelling!r}")
    assert_bitwise(rms_norm_quant(x, w, quant_dtype=ml_dtypes.float8_e4m3fn)[0], qf,
                   "ml_dtypes.float8_e4m3fn")
    # uint16 storage + dtype= (CuPy's way of passing bf16) gives the same levels
    q16, s16 = rms_norm_quant(x.view(np.uint16), w.view(np.uint16), dtype="bfloat16",
                              quant_dtype="float8_e4m3fn")
    assert_bitwise(q16, qf, "uint16 + dtype= q")
    assert_bitwise(s16, sf, "uint16 + dtype= yscale")


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batch(dtype):
    x = np.empty((0, 127), NUMPY[dtype])
    q, yscale = rms_norm_quant(x, quant_dtype="float8_e4m3fn")
    assert q.shape == (0, 127) and q.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert yscale.shape == (0,) and yscale.dtype == np.float32
    q, yscale, residual_out = rms_norm_quant(x, residual=x.copy())
    assert q.dtype == np.int8 and residual_out.shape == (0, 127)


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    for dtype in DTYPES:
        xt = torch.randn(7, 127, generator=gen).to(torch_dtype(torch, dtype))
        rt = torch.randn(7, 127, generator=gen).to(torch_dtype(torch, dtype))
        wt = (1 + 0.1 * torch.randn(127, generator=gen)).to(torch_dtype(torch, dtype))
        for quant_dtype, tdtype in (("int8", torch.int8),
                                    ("float8_e4m3fn", torch.float8_e4m3fn)):
            q, yscale, ro = rms_norm_quant(xt, wt, residual=rt, quant_dtype=tdtype)
            assert isinstance(q, torch.Tensor) and q.dtype == tdtype and q.shape == xt.shape
            assert yscale.dtype == torch.float32 and ro.dtype == xt.dtype
            q_np, s_np, ro_np = rms_norm_quant(to_numpy(xt), to_numpy(wt), residual=to_numpy(rt),
                                               quant_dtype=quant_dtype)
            assert_bitwise(q.view(torch.uint8).numpy(), q_np.view(np.uint8), "torch q vs NumPy")
            assert_bitwise(yscale.numpy(), s_np, "torch yscale vs NumPy")
            assert_bitwise(to_numpy(ro), ro_np, "torch residual_out vs NumPy")


def test_rne_magic_low_byte_is_the_int8_level():
    """The identity behind the GPU's int8 levels (kernels/_rowops.make_quant_store, fma_levels):
    for |v| < 127.5 (the quantiser's |t s| is at most 127 plus a few float32 roundings), the
    float32 v + 1.5 * 2**23 is v rounded to the nearest integer, ties to even, and its low byte
    is that integer's int8 bits.  Every multiple of 1/64 in the range, every tie, zeros of both
    signs, tiny values and the values just inside the ends."""
    from rmsnorm_hip.kernels._rowops import RNE_MAGIC
    grid = np.arange(-127.5 * 64 + 1, 127.5 * 64) / 64
    ties = np.arange(-127, 127) + 0.5
    inside = np.nextafter(np.float32(127.5), np.float32(0))
    edges = np.array([-0.0, 0.0, 1e-30, -1e-30, 0.49999997, -0.49999997, inside, -inside],
                     np.float64)
    v = np.concatenate([grid, ties, edges]).astype(np.float32)
    bits = (v + np.float32(RNE_MAGIC)).view(np.uint32)
    level = (bits & 0xFF).astype(np.uint8).view(np.int8)
    expected = np.rint(v.astype(np.float64))          # numpy's rint: ties to even
    assert np.array_equal(level.astype(np.float64), expected)
    assert expected.min() == -127 and expected.max() == 127


@pytest.mark.sim
@pytest.mark.parametrize("where", ["weight", "xscale"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_sim_non_finite_t_takes_the_converting_levels(rng, use_backend, where, bad):
    """The GPU kernel rounds int8 levels with one fma only when every t = h w xscale of the row
    is finite, which its max|t| (NaN winning) says; a NaN / Inf weight or xscale puts one in
    every row, so every yscale is non-finite (docs/api.md leaves those rows' q and yscale
    unspecified) and the levels come from the converting form, not from the fma's bytes."""
    use_backend("sim")
    x, w, kwargs = make_call(rng, (3, 256), "bfloat16", "float32", "xscale_f32")
    x = aligned_copy(x)
    target = w if where == "weight" else kwargs["xscale"]
    target[5] = bad
    q, yscale = rms_norm_quant(x, aligned_copy(w), quant_dtype="int8",
                               xscale=aligned_copy(kwargs["xscale"]))
    assert not np.isfinite(yscale).any(), yscale
    assert (q == 0).all(), q          # t * (rstd / yscale) is 0 or NaN: the conversion gives 0
