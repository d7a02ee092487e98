"""fused_add_rms_norm and fused_add_rms_norm_ (in place) on NumPy arrays (CPU backend; in-place,
invariance and NaN tests on the simulator too) against the float64 reference: residual_out is
x + residual rounded once to x's dtype (bitwise), y is rms_norm of that rounded residual_out
(bitwise), the in-place form gives the out-of-place bits and writes nothing else."""
import numpy as np
import pytest
from conftest import (DTYPES, FLOAT32, NUMPY, WEIGHT_COMBOS, aligned_copy, aligned_empty,
                      assert_bitwise, assert_close, random_array)
from test_rms_norm import MS, NS, combo_id, make_inputs, to_numpy, torch_dtype

from rmsnorm_hip import fused_add_rms_norm, fused_add_rms_norm_, rms_norm
from rmsnorm_hip.backends import cpu as cpu_backend
from rmsnorm_hip.reference import fused_add_rms_norm_ref, rms_norm_ref

pytestmark = pytest.mark.quick


def make_pair(rng, shape, dtype, wdtype, row_scales=True):
    """x, residual (rows of both scaled alike, so that x + residual rounds somewhere) and weight."""
    x, w = make_inputs(rng, shape, dtype, wdtype, row_scales)
    residual = make_inputs(rng, shape, dtype, None, row_scales)[0]
    return x, residual, w


def check_fused(x, residual, w, y, residual_out, rstd, dtype, weight_offset=0.0):
    """The contract of one out-of-place call: residual_out bitwise x + residual rounded once,
    y bitwise rms_norm(residual_out), and both against the float64 reference."""
    y_ref, h_ref, rstd_ref = fused_add_rms_norm_ref(x, residual, w, weight_offset=weight_offset)
    assert residual_out.dtype == x.dtype and residual_out.shape == x.shape
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_bitwise(residual_out, h_ref.astype(NUMPY[dtype]), "residual_out vs round(x + residual)")
    y_alone, rstd_alone = rms_norm(residual_out, w, weight_offset=weight_offset, return_rstd=True)
    assert_bitwise(y, y_alone, "fused y vs rms_norm(residual_out)")
    assert_close(y, y_ref, dtype)
    if rstd is not None:
        assert rstd.dtype == np.float32 and rstd.shape == (int(np.prod(x.shape[:-1])),)
        assert_bitwise(rstd, rstd_alone, "fused rstd vs rms_norm(residual_out)'s")
        assert_close(rstd, rstd_ref, FLOAT32)


# tests/test_rms_norm.py's N, with fewer rows at large N: every case here runs the serial CPU
# kernel (M * N < PARALLEL_MIN_ELEMENTS); the parallel one, a separate numba compile per
# variant, is covered per dtype by test_batch_invariance (a batch against its rows alone)
SHAPES = ([(m, n) for n in NS if n <= 127 for m in MS]
          + [(m, n) for n in NS if 127 < n < 65537 for m in (1, 7, 33)]
          + [(1, 65537), (7, 65537)])


def shape_id(shape):
    return f"{shape[0]}x{shape[1]}"


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_matches_reference(rng, combo, shape):
    m, n = shape
    dtype, wdtype = combo
    x, residual, w = make_pair(rng, (m, n), dtype, wdtype)
    before = [a.copy() for a in (x, residual)]

    y, residual_out, rstd = fused_add_rms_norm(x, residual, w, return_rstd=True)

    assert type(y) is np.ndarray and type(residual_out) is np.ndarray
    check_fused(x, residual, w, y, residual_out, rstd, dtype)
    assert_bitwise(x, before[0], "x after the call")
    assert_bitwise(residual, before[1], "residual after the call")


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_out_rounds_once(dtype):
    """Sums that x's dtype cannot hold: residual_out is their one rounding (ties to even), not x
    or residual passed through, and y is the normalisation of that rounded value."""
    ulp_at_one = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[dtype]
    big = {"float32": 3e38, "float16": 65504.0, "bfloat16": 3e38}[dtype]
    half = ulp_at_one / 2
    residual = np.array([[half, 1.5 * half, 3 * half, -half / 2, 0.25, -1.0, big, -3.0]])
    residual = residual.astype(NUMPY[dtype])
    one = np.ones((1, 8), NUMPY[dtype])

    y, residual_out = fused_add_rms_norm(one, residual)

    expected = (one.astype(np.float64) + residual.astype(np.float64)).astype(NUMPY[dtype])
    assert_bitwise(residual_out, expected, "residual_out")
    assert residual_out[0, 0] == 1.0, "1 + half an ulp is a tie: to even, 1"
    assert residual_out[0, 1] == 1.0 + ulp_at_one and residual_out[0, 2] == 1.0 + 2 * ulp_at_one
    assert_bitwise(y, rms_norm(expected), "y vs rms_norm of the rounded sums")


@pytest.mark.parametrize("weight_offset", [1.0, -0.25])
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_offset(rng, dtype, weight_offset):
    x, residual, _ = make_pair(rng, (7, 4097), dtype, None)
    w = random_array(rng, 4097, dtype, scale=0.1)

    y, residual_out, rstd = fused_add_rms_norm(x, residual, w, weight_offset=weight_offset,
                                               return_rstd=True)

    check_fused(x, residual, w, y, residual_out, rstd, dtype, weight_offset)


@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_return_rstd_and_leading_dims(rng, combo):
    dtype, wdtype = combo
    x, residual, w = make_pair(rng, (2, 3, 127), dtype, wdtype)

    pair = fused_add_rms_norm(x, residual, w)
    y, residual_out, rstd = fused_add_rms_norm(x, residual, w, return_rstd=True)

    assert len(pair) == 2
    assert_bitwise(pair[0], y, "y with and without return_rstd")
    assert_bitwise(pair[1], residual_out, "residual_out with and without return_rstd")
    assert y.shape == (2, 3, 127) and rstd.shape == (6,)
    y2, ro2 = fused_add_rms_norm(x.reshape(6, 127), residual.reshape(6, 127), w)
    assert_bitwise(y.reshape(6, 127), y2, "y of (..., N) vs (M, N)")
    assert_bitwise(residual_out.reshape(6, 127), ro2, "residual_out of (..., N) vs (M, N)")


def guarded(rng, m, n, dtype, pad, lead):
    """(buffer, an (m, n) view into it, mask of the buffer's other elements): poisoned guard
    elements around the view that must keep their bits.  ``pad`` None: a contiguous view with
    ``lead`` guards before and after; else a column slice ``lead`` columns into rows of
    n + lead + pad."""
    if pad is None:
        buf = random_array(rng, m * n + 2 * lead, dtype, loc=-7.0)
        view = buf[lead:lead + m * n].reshape(m, n)
        mask = np.ones(buf.shape, bool)
        mask[lead:lead + m * n] = False
    else:
        buf = random_array(rng, (m, n + lead + pad), dtype, loc=-7.0)
        view = buf[:, lead:lead + n]
        mask = np.ones(buf.shape, bool)
        mask[:, lead:lead + n] = False
    return buf, view, mask


IN_PLACE_SHAPES = [
    pytest.param(3, None, id="N3-contiguous"),
    pytest.param(3, 5, id="N3-strided"),
    pytest.param(4097, None, id="N4097-contiguous"),
    pytest.param(4097, 3, id="N4097-strided"),
    pytest.param(65537, 1, id="N65537-strided"),
]


@pytest.mark.parametrize("n,pad", IN_PLACE_SHAPES)
@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_in_place(rng, combo, n, pad):
    """residual <- round(x + residual), x <- rms_norm(residual): bitwise the out-of-place
    results; the guard elements around both and the weight keep their bits."""
    dtype, wdtype = combo
    m = 7
    x0, r0, w = make_pair(rng, (m, n), dtype, wdtype)
    x_buf, x, x_guard = guarded(rng, m, n, dtype, pad, lead=1)
    r_buf, residual, r_guard = guarded(rng, m, n, dtype, None if pad is None else pad + 2, 3)
    x[...] = x0
    residual[...] = r0
    x_buf0, r_buf0, w0 = x_buf.copy(), r_buf.copy(), None if w is None else w.copy()
    y_expected, ro_expected = fused_add_rms_norm(x0, r0, w)

    result = fused_add_rms_norm_(x, residual, w)

    assert result is None
    assert_bitwise(x, y_expected, "x after the in-place call vs y")
    assert_bitwise(residual, ro_expected, "residual after the in-place call vs residual_out")
    assert_bitwise(x_buf[x_guard], x_buf0[x_guard], "guard elements around x")
    assert_bitwise(r_buf[r_guard], r_buf0[r_guard], "guard elements around residual")
    if w is not None:
        assert_bitwise(w, w0, "weight after the in-place call")


@pytest.mark.parametrize("n", [3, 127, 4097])
@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_row_strided_inputs(rng, combo, n):
    """x and residual as column slices with different row strides: bitwise contiguous copies'
    results."""
    dtype, wdtype = combo
    x_wide, _, w = make_pair(rng, (7, n + 3), dtype, wdtype)
    r_wide = make_pair(rng, (7, n + 9), dtype, None)[0]
    x, residual = x_wide[:, 2:n + 2], r_wide[:, :n]
    w = None if w is None else w[:n].copy()

    y, residual_out, rstd = fused_add_rms_norm(x, residual, w, return_rstd=True)

    y_c, ro_c, rstd_c = fused_add_rms_norm(np.ascontiguousarray(x), np.ascontiguousarray(residual),
                                           w, return_rstd=True)
    assert_bitwise(y, y_c, "row-strided y vs contiguous")
    assert_bitwise(residual_out, ro_c, "row-strided residual_out vs contiguous")
    assert_bitwise(rstd, rstd_c, "row-strided rstd vs contiguous")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_uint16_storage_with_dtype_keyword(rng, dtype):
    x, residual, w = make_pair(rng, (7, 127), dtype, dtype)
    y, residual_out = fused_add_rms_norm(x, residual, w)

    y16, ro16 = fused_add_rms_norm(x.view(np.uint16), residual.view(np.uint16),
                                   w.view(np.uint16), dtype=dtype)
    x16, r16 = x.view(np.uint16).copy(), residual.view(np.uint16).copy()
    fused_add_rms_norm_(x16, r16, w.view(np.uint16), dtype=dtype)

    assert y16.dtype == np.uint16 and ro16.dtype == np.uint16
    assert_bitwise(y16, y.view(np.uint16), "uint16 + dtype= y")
    assert_bitwise(ro16, residual_out.view(np.uint16), "uint16 + dtype= residual_out")
    assert_bitwise(x16, y.view(np.uint16), "uint16 in place x")
    assert_bitwise(r16, residual_out.view(np.uint16), "uint16 in place residual")


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batch(dtype):
    x = np.empty((0, 127), NUMPY[dtype])
    y, residual_out, rstd = fused_add_rms_norm(x, x.copy(), return_rstd=True)
    assert y.shape == residual_out.shape == (0, 127) and rstd.shape == (0,)
    assert fused_add_rms_norm_(x, x.copy()) is None


# Batch invariance: a row's y, residual_out and rstd do not depend on M, its position or its
# alignment (CPU: the parallel kernel for the batch, the serial one for a row), and the batch
# meets the contract.
INVARIANCE_CASES = (
    [pytest.param("cpu", d, (333, n), id=f"cpu-{d}-N{n}") for d in DTYPES for n in (127, 4097)]
    + [pytest.param("cpu", "bfloat16", (33, 65537), id="cpu-bfloat16-N65537-parallel")]
    + [pytest.param("sim", d, (9, n), id=f"sim-{d}-N{n}",
                    marks=[pytest.mark.sim] + ([pytest.mark.full] if n > 24 else []))
       for d, n in (("float32", 24), ("bfloat16", 1000))]
)


@pytest.mark.parametrize("backend_name,dtype,shape", INVARIANCE_CASES)
def test_batch_invariance(rng, use_backend, backend_name, dtype, shape):
    use_backend(backend_name)
    m, n = shape
    if backend_name == "cpu" and n > 127:
        assert m * n >= cpu_backend.PARALLEL_MIN_ELEMENTS > n, "must run the parallel kernel"
    x, residual, w = make_pair(rng, (m, n), dtype, dtype)
    x, residual = aligned_copy(x), aligned_copy(residual)
    y, ro, rstd = fused_add_rms_norm(x, residual, w, return_rstd=True)

    y_ref, ro_ref, rstd_ref = fused_add_rms_norm_ref(x, residual, w)
    assert_close(y, y_ref, dtype)
    assert_bitwise(ro, ro_ref.astype(NUMPY[dtype]), "residual_out vs round(x + residual)")
    assert_close(rstd, rstd_ref, FLOAT32)
    for i in sorted({0, 1, m // 2, m - 1}):
        y1, ro1, r1 = fused_add_rms_norm(aligned_copy(x[i:i + 1]), residual[i:i + 1], w,
                                         return_rstd=True)
        assert_bitwise(y1.reshape(-1), y[i], f"y of row {i} alone vs in the batch")
        assert_bitwise(ro1.reshape(-1), ro[i], f"residual_out of row {i} alone")
        assert_bitwise(r1, rstd[i:i + 1], f"rstd of row {i} alone")
    shifted = aligned_empty((m, n + 1), dtype)[:, 1:]
    shifted[...] = x
    y_s, ro_s, r_s = fused_add_rms_norm(shifted, residual, w, return_rstd=True)
    assert_bitwise(y_s, y, "batch at an unaligned start vs aligned")
    assert_bitwise(ro_s, ro, "residual_out at an unaligned start vs aligned")
    assert_bitwise(r_s, rstd, "rstd at an unaligned start vs aligned")


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_on_backends(rng, backend, dtype):
    """The in-place entry point on the simulator too (one kernel for y and residual_out), rows
    in guarded buffers: contiguous x, row-strided residual."""
    m, n = 5, 40
    x0, r0, w = make_pair(rng, (m, n), dtype, dtype, row_scales=False)
    x_buf, x, x_guard = guarded(rng, m, n, dtype, None, lead=8)
    r_buf, residual, r_guard = guarded(rng, m, n, dtype, 8, lead=8)
    x[...], residual[...] = x0, r0
    x_buf0, r_buf0 = x_buf.copy(), r_buf.copy()
    y, ro = fused_add_rms_norm(x0, r0, w)

    fused_add_rms_norm_(x, residual, w)

    assert_bitwise(x, y, "in-place x vs y")
    assert_bitwise(residual, ro, "in-place residual vs residual_out")
    assert_bitwise(x_buf[x_guard], x_buf0[x_guard], "guard elements around x")
    assert_bitwise(r_buf[r_guard], r_buf0[r_guard], "guard elements around residual")
    assert_close(y, rms_norm_ref(ro, w)[0], dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_stay_in_their_row(rng, backend, dtype):
    x, residual, w = make_pair(rng, (6, 40), dtype, dtype, row_scales=False)
    dirty = residual.copy()
    dirty[1, 5] = np.nan
    dirty[3, 0] = np.inf

    y_clean, ro_clean = fused_add_rms_norm(x, residual, w)
    y, ro = fused_add_rms_norm(x, dirty, w)

    clean = [0, 2, 4, 5]
    assert_bitwise(y[clean], y_clean[clean], "y of rows without NaN/Inf")
    assert_bitwise(ro[clean], ro_clean[clean], "residual_out of rows without NaN/Inf")
    assert np.isnan(y[1].astype(np.float32)).all() and np.isnan(ro[1, 5].astype(np.float32))
    assert np.isinf(ro[3, 0].astype(np.float32))


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
        xt = torch.randn(7, 127, generator=gen).to(torch_dtype(torch, dtype))
        rt = torch.randn(7, 127, generator=gen).to(torch_dtype(torch, dtype))
        wt = (1 + 0.1 * torch.randn(127, generator=gen)).to(torch_dtype(torch, dtype))
        y, ro = fused_add_rms_norm(xt, rt, wt)
        assert isinstance(y, torch.Tensor) and y.dtype == xt.dtype
        assert isinstance(ro, torch.Tensor) and ro.dtype == xt.dtype
        y_np, ro_np = fused_add_rms_norm(to_numpy(xt), to_numpy(rt), to_numpy(wt))
        assert_bitwise(to_numpy(y), y_np, f"{dtype} torch y vs NumPy")
        assert_bitwise(to_numpy(ro), ro_np, f"{dtype} torch residual_out vs NumPy")
        fused_add_rms_norm_(xt, rt, wt)
        assert_bitwise(to_numpy(xt), y_np, f"{dtype} torch in place x")
        assert_bitwise(to_numpy(rt), ro_np, f"{dtype} torch in place residual")
