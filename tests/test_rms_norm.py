"""rms_norm on NumPy arrays (CPU backend; the batch-invariance and NaN tests run on the simulator
too) against the float64 reference, plus out=, shapes, strides and torch CPU tensors."""
import numpy as np
import pytest
from _paths import pick_n
from conftest import (BFLOAT16, DTYPES, FLOAT32, NUMPY, WEIGHT_COMBOS, aligned_copy,
                      aligned_empty, assert_bitwise, assert_close, random_array)

from rmsnorm_hip import rms_norm
from rmsnorm_hip.backends import cpu as cpu_backend
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import rms_norm_ref

pytestmark = pytest.mark.quick

# N, with what it exercises.  CPU: 8 interleaved partial sums plus a scalar tail (N % 8).  GPU
# paths (kernels/_config.row_layout) for the same N, used by `rmsnorm-hip check` on a device:
NS = [
    1,      # tail only; GPU: one thread per row, ragged chunk (scalar)
    3,      # tail only; GPU: ragged chunk inside a multi-row block
    127,    # 15 lanes + tail 7; GPU: 32/16 threads per row, multi-row, scalar
    4097,   # tail 1; GPU: cached single-row, scalar (ragged)
    5000,   # no tail; GPU: cached single-row, vector
    65537,  # tail 1; GPU: looped (row re-read), scalar
]
MS = [1, 7, 333]


def combo_id(combo):
    dtype, wdtype = combo
    return f"{dtype}-w_{wdtype or 'none'}"


def make_inputs(rng, shape, dtype, wdtype, row_scales=True):
    """x with per-row magnitudes over 10**[-3, 3] (rows must not leak into each other), and a
    weight around 1 in ``wdtype`` (None for no weight)."""
    x = random_array(rng, shape, FLOAT32)
    if row_scales and len(shape) > 1:
        x *= (10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,))).astype(np.float32)
    x = x.astype(NUMPY[dtype])
    w = None if wdtype is None else random_array(rng, shape[-1], wdtype, loc=1.0, scale=0.5)
    return x, w


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_matches_reference(rng, combo, n, m):
    dtype, wdtype = combo
    x, w = make_inputs(rng, (m, n), dtype, wdtype)
    x0, w0 = x.copy(), None if w is None else w.copy()

    y, rstd = rms_norm(x, w, return_rstd=True)

    assert type(y) is np.ndarray and y.dtype == x.dtype and y.shape == (m, n)
    assert type(rstd) is np.ndarray and rstd.dtype == np.float32 and rstd.shape == (m,)
    y_ref, rstd_ref = rms_norm_ref(x, w)
    assert_close(y, y_ref, dtype)
    assert_close(rstd, rstd_ref, FLOAT32)
    assert_bitwise(x, x0, "x after the call")
    if w is not None:
        assert_bitwise(w, w0, "weight after the call")


@pytest.mark.parametrize("weight_offset", [1.0, -0.25])
@pytest.mark.parametrize("combo", [c for c in WEIGHT_COMBOS if c[1] is not None], ids=combo_id)
def test_weight_offset(rng, combo, weight_offset):
    """Gemma: y = x * rstd * (1 + w) with w near 0."""
    dtype, wdtype = combo
    x, _ = make_inputs(rng, (7, 4097), dtype, None)
    w = random_array(rng, 4097, wdtype, scale=0.1)

    y, rstd = rms_norm(x, w, weight_offset=weight_offset, return_rstd=True)

    y_ref, rstd_ref = rms_norm_ref(x, w, weight_offset=weight_offset)
    assert_close(y, y_ref, dtype)
    assert_close(rstd, rstd_ref, FLOAT32)
    # the offset is not absorbed elsewhere: without it the result is far off
    with pytest.raises(AssertionError):
        assert_close(y, rms_norm_ref(x, w)[0], dtype)


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.5, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_eps(rng, dtype, eps):
    """Rows with mean(x**2) ~ 1e-2, so eps = 0.5 dominates and eps = 0 is exact normalisation."""
    x = random_array(rng, (7, 127), dtype, scale=0.1)

    y, rstd = rms_norm(x, None, eps, return_rstd=True)

    y_ref, rstd_ref = rms_norm_ref(x, None, eps)
    assert_close(y, y_ref, dtype)
    assert_close(rstd, rstd_ref, FLOAT32)


@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_return_rstd(rng, combo):
    dtype, wdtype = combo
    x, w = make_inputs(rng, (2, 3, 127), dtype, wdtype)

    y_only = rms_norm(x, w)
    y, rstd = rms_norm(x, w, return_rstd=True)

    assert type(y_only) is np.ndarray
    assert_bitwise(y_only, y, "y with and without return_rstd")
    assert rstd.shape == (6,) and rstd.dtype == np.float32
    assert_close(rstd, rms_norm_ref(x, w)[1], FLOAT32)


@pytest.mark.parametrize("shape", [(7, 3), (2, 3, 4097), (127,)], ids=str)
@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_out_is_fully_overwritten(rng, combo, shape):
    dtype, wdtype = combo
    x, w = make_inputs(rng, shape, dtype, wdtype)
    out = np.full(shape, np.nan, NUMPY[dtype])

    result, rstd = rms_norm(x, w, out=out, return_rstd=True)

    assert result is out
    assert not np.isnan(out.astype(np.float32)).any()
    y, rstd_fresh = rms_norm(x, w, return_rstd=True)
    assert_bitwise(out, y, "out= vs a fresh y")
    assert_bitwise(rstd, rstd_fresh, "rstd with out= vs without")


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "row_strided"])
@pytest.mark.parametrize("n", [3, 4097])
@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_out_is_x_in_place(rng, combo, n, strided):
    dtype, wdtype = combo
    x_wide, _ = make_inputs(rng, (7, n + 5 if strided else n), dtype, None)
    _, w = make_inputs(rng, (n,), dtype, wdtype)
    x = x_wide[:, :n]
    wide_before = x_wide.copy()
    expected, rstd_expected = rms_norm(x.copy(), w, return_rstd=True)

    result, rstd = rms_norm(x, w, out=x, return_rstd=True)

    assert result is x
    assert_bitwise(x, expected, "in-place y vs out-of-place y")
    assert_bitwise(rstd, rstd_expected, "in-place rstd vs out-of-place rstd")
    assert_bitwise(x_wide[:, n:], wide_before[:, n:], "columns past the in-place rows")


@pytest.mark.parametrize("lead", [(2, 3), (1, 1), (4, 1), (1, 5), (2, 1, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_flatten_to_rows(rng, dtype, lead):
    shape = lead + (127,)
    x, w = make_inputs(rng, shape, dtype, dtype)

    y, rstd = rms_norm(x, w, return_rstd=True)

    m = int(np.prod(lead))
    assert y.shape == shape and rstd.shape == (m,)
    y2, rstd2 = rms_norm(x.reshape(m, 127), w, return_rstd=True)
    assert_bitwise(y.reshape(m, 127), y2, "y of (..., N) vs y of (M, N)")
    assert_bitwise(rstd, rstd2, "rstd of (..., N) vs rstd of (M, N)")
    assert_close(y, rms_norm_ref(x, w)[0], dtype)


@pytest.mark.parametrize("n", [1, 127, 4097])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_dimensional_x_is_one_row(rng, dtype, n):
    x, w = make_inputs(rng, (n,), dtype, dtype)

    y, rstd = rms_norm(x, w, return_rstd=True)

    assert y.shape == (n,) and rstd.shape == (1,)
    y2, rstd2 = rms_norm(x[None, :], w, return_rstd=True)
    assert_bitwise(y, y2[0], "1-D y vs the same row in 2-D")
    assert_bitwise(rstd, rstd2, "1-D rstd vs 2-D rstd")
    assert_close(y, rms_norm_ref(x, w)[0], dtype)


@pytest.mark.parametrize("pads", [(1, 2), (8, 0), (61, 7)], ids=lambda p: f"xpad{p[0]}-opad{p[1]}")
@pytest.mark.parametrize("n", [3, 127, 4097])
@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_row_strided_x_and_out(rng, combo, n, pads):
    """x and out are column slices of wider matrices: bitwise the contiguous result, and the
    guard columns around out's rows keep their values."""
    dtype, wdtype = combo
    x_pad, out_pad = pads
    m = 7
    x_wide, _ = make_inputs(rng, (m, n + x_pad), dtype, None)
    _, w = make_inputs(rng, (n,), dtype, wdtype)
    x = x_wide[:, :n]
    guard = random_array(rng, (m, n + out_pad + 1), dtype, loc=-7.0)
    out_wide = guard.copy()
    out = out_wide[:, 1:n + 1]          # guards before and after every row
    x_before = x_wide.copy()

    result, rstd = rms_norm(x, w, out=out, return_rstd=True)
    fresh, rstd_fresh = rms_norm(x, w, return_rstd=True)

    assert result is out
    y_contig, rstd_contig = rms_norm(np.ascontiguousarray(x), w, return_rstd=True)
    assert_bitwise(out, y_contig, "row-strided out vs contiguous")
    assert_bitwise(fresh, y_contig, "row-strided x vs contiguous")
    assert_bitwise(rstd, rstd_contig, "rstd, row-strided vs contiguous")
    assert_bitwise(rstd_fresh, rstd_contig, "rstd, row-strided x vs contiguous")
    assert_bitwise(out_wide[:, :1], guard[:, :1], "guard column before out's rows")
    assert_bitwise(out_wide[:, n + 1:], guard[:, n + 1:], "guard columns after out's rows")
    assert_bitwise(x_wide, x_before, "x_wide after the call")
    assert_close(out, rms_norm_ref(x, w)[0], dtype)


@pytest.mark.parametrize("wdtype", ["same", FLOAT32])
@pytest.mark.parametrize("dtype", ["float16", BFLOAT16])
def test_uint16_storage_with_dtype_keyword(rng, dtype, wdtype):
    """dtype= reads uint16 storage (x, out, a 16-bit weight) as that 16-bit float: the same bits
    as the typed call."""
    x, w = make_inputs(rng, (7, 127), dtype, dtype if wdtype == "same" else wdtype)
    w_arg = w.view(np.uint16) if wdtype == "same" else w
    out = np.full(x.shape, 0x7FFF, np.uint16)
    expected, rstd_expected = rms_norm(x, w, return_rstd=True)

    y, rstd = rms_norm(x.view(np.uint16), w_arg, return_rstd=True, dtype=dtype)
    result = rms_norm(x.view(np.uint16), w_arg, out=out, dtype=dtype)

    assert y.dtype == np.uint16, "uint16 storage in, uint16 storage out (as for CuPy callers)"
    assert_bitwise(y, expected.view(np.uint16), "uint16 + dtype= y")
    assert_bitwise(rstd, rstd_expected, "uint16 + dtype= rstd")
    assert result is out
    assert_bitwise(out, expected.view(np.uint16), "uint16 out= with dtype=")


@pytest.mark.parametrize("shape", [(0, 127), (2, 0, 8), (0, 1)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batch(dtype, shape):
    """M == 0 (NumPy >= 2.4 gives an empty array zero strides: they must not matter)."""
    x = np.empty(shape, NUMPY[dtype])
    w = np.ones(shape[-1], NUMPY[dtype])

    y, rstd = rms_norm(x, w, return_rstd=True)
    out = np.empty(shape, NUMPY[dtype])
    result = rms_norm(x, w, out=out)

    assert type(y) is np.ndarray and y.shape == shape and y.dtype == x.dtype
    assert rstd.shape == (0,) and rstd.dtype == np.float32
    assert result is out


# Batch invariance (docs/api.md): a row's bits do not depend on M, its position or its alignment.
# CPU: M * N past PARALLEL_MIN_ELEMENTS runs the parallel kernel, a lone row the serial one.
# Simulator: flavors of tests/_paths.py (N picked per path), M spilling into a second block.
INVARIANCE_CASES = (
    [pytest.param("cpu", d, (333, n), id=f"cpu-{d}-N{n}-M333")
     for d in DTYPES for n in (1, 8, 127, 4096, 4097, 65537)]
    + [pytest.param("sim", d, flavor, id=f"sim-{d}-{flavor}",
                    marks=[pytest.mark.sim] + ([] if (d, flavor) == ("bfloat16", "multirow_warps")
                                               else [pytest.mark.full]))
       for d in DTYPES
       for flavor in ("multirow_1thread",   # one thread per row, 128+ rows per block
                      "multirow_warp",      # a warp per row, several rows per block
                      "multirow_warps")])   # two+ warps per row summed through shared memory


def sim_shape(dtype, flavor):
    n = pick_n(flavor, dtype, vector=True)
    rows = _config.rows_per_block(_config.row_layout(n, dtype))
    return min(rows + 3, 2 * rows + 1), n


@pytest.mark.parametrize("backend_name,dtype,size", INVARIANCE_CASES)
def test_batch_invariance(rng, use_backend, backend_name, dtype, size):
    """``size``: (M, N) on the CPU, a tests/_paths.py flavor on the simulator."""
    use_backend(backend_name)
    m, n = sim_shape(dtype, size) if backend_name == "sim" else size
    if backend_name == "cpu" and n == 65537:
        assert m * n >= cpu_backend.PARALLEL_MIN_ELEMENTS > n, \
            "this case must compare the parallel CPU kernel (batch) with the serial one (row)"
    x, w = make_inputs(rng, (m, n), dtype, dtype)
    x = aligned_copy(x)
    y, rstd = rms_norm(x, w, return_rstd=True)

    for i in sorted({0, 1, 5, m // 2, m - 2, m - 1} & set(range(m))):
        alone, r_alone = rms_norm(x[i:i + 1], w, return_rstd=True)        # a view into the batch
        assert_bitwise(alone[0], y[i], f"row {i} alone vs in a batch of {m}")
        assert_bitwise(r_alone[0], rstd[i], f"rstd of row {i} alone vs in the batch")
        copy, r_copy = rms_norm(aligned_copy(x[i]), w, return_rstd=True)  # fresh, 1-D
        assert_bitwise(copy, y[i], f"row {i} copied out vs in the batch")
        assert_bitwise(r_copy[0], rstd[i], f"rstd of row {i} copied out")

    x_wide = aligned_empty((m, n + 1), dtype)
    x_wide[:, 1:] = x
    shifted = x_wide[:, 1:n + 1]        # every row start one element past x's alignment
    y_shift, r_shift = rms_norm(shifted, w, return_rstd=True)
    assert_bitwise(y_shift, y, "batch at an unaligned start vs aligned")
    assert_bitwise(r_shift, rstd, "rstd at an unaligned start vs aligned")
    y_tail, r_tail = rms_norm(shifted[3:], w, return_rstd=True)
    assert_bitwise(y_tail, y[3:], "rows 3.. as their own unaligned batch")
    assert_bitwise(r_tail, rstd[3:], "rstd of rows 3.. as their own batch")
    assert_close(y, rms_norm_ref(x, w)[0], dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_stay_in_their_row(rng, backend, dtype):
    x, w = make_inputs(rng, (6, 127), dtype, dtype, row_scales=False)
    dirty = x.copy()
    dirty[1, 5] = np.nan
    dirty[3, 0] = np.inf

    y_clean, r_clean = rms_norm(x, w, return_rstd=True)
    y, rstd = rms_norm(dirty, w, return_rstd=True)

    clean_rows = [0, 2, 4, 5]
    assert_bitwise(y[clean_rows], y_clean[clean_rows], "rows without NaN/Inf")
    assert_bitwise(rstd[clean_rows], r_clean[clean_rows], "rstd of rows without NaN/Inf")
    assert np.isnan(rstd[1]) and np.isnan(y[1].astype(np.float32)).all()
    assert rstd[3] == 0 and not np.isfinite(y[3].astype(np.float32)).all()


# ---- torch CPU tensors -------------------------------------------------------------------------

def torch_dtype(torch, dtype):
    return getattr(torch, dtype)


def to_numpy(t):
    """The NumPy view of a CPU tensor's bits (bfloat16 through ml_dtypes), no copy."""
    import torch
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(NUMPY[BFLOAT16])
    return t.numpy()


@pytest.mark.parametrize("combo", WEIGHT_COMBOS, ids=combo_id)
def test_torch_cpu_tensors(rng, combo):
    torch = pytest.importorskip("torch")
    dtype, wdtype = combo
    xt = torch.randn(7, 4097, generator=torch.Generator().manual_seed(int(rng.integers(2**31))))
    xt = xt.to(torch_dtype(torch, dtype))
    wt = None if wdtype is None else (1 + 0.5 * torch.randn(4097)).to(torch_dtype(torch, wdtype))
    x_np = to_numpy(xt)
    w_np = None if wt is None else to_numpy(wt)

    y, rstd = rms_norm(xt, wt, return_rstd=True)

    assert isinstance(y, torch.Tensor) and y.dtype == xt.dtype and y.shape == xt.shape
    assert isinstance(rstd, torch.Tensor) and rstd.dtype == torch.float32 and rstd.shape == (7,)
    y_np, rstd_np = rms_norm(x_np, w_np, return_rstd=True)
    assert_bitwise(to_numpy(y), y_np, "torch y vs NumPy y")
    assert_bitwise(rstd.numpy(), rstd_np, "torch rstd vs NumPy rstd")
    assert_close(to_numpy(y), rms_norm_ref(x_np, w_np)[0], dtype)


def test_torch_requires_grad_input(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 127, requires_grad=True)
    w = torch.ones(127, requires_grad=True)

    y = rms_norm(x, w)

    assert isinstance(y, torch.Tensor) and not y.requires_grad
    expected = rms_norm(x.detach().numpy(), w.detach().numpy())
    assert_bitwise(y.numpy(), expected, "requires_grad tensors vs NumPy")


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_no_copy(rng, dtype):
    """out= and in-place writes land in the caller's tensors; a row-strided torch x is read in
    place (bitwise its contiguous copy)."""
    torch = pytest.importorskip("torch")
    x_wide = torch.randn(7, 140).to(torch_dtype(torch, dtype))
    x = x_wide[:, :127]
    out = torch.full((7, 127), float("nan"), dtype=x.dtype)
    ptr = out.data_ptr()

    result = rms_norm(x, out=out)

    assert result is out and out.data_ptr() == ptr
    assert_bitwise(to_numpy(out), rms_norm(to_numpy(x.contiguous())), "torch out= vs NumPy")
    expected = rms_norm(to_numpy(x.contiguous()))
    in_place = rms_norm(x, out=x)
    assert in_place is x
    assert_bitwise(to_numpy(x.contiguous()), expected, "torch in place vs NumPy")
