"""The test harness itself: assert_close enforces docs/api.md's tolerances (and no looser), the
reference is float64 from the rounded inputs, and the aligned allocator aligns."""
import numpy as np
import pytest
from conftest import (BFLOAT16, DTYPES, FLOAT16, FLOAT32, NUMPY, aligned_empty, assert_bitwise,
                      assert_close, random_array, ulp)

from rmsnorm_hip.reference import rms_norm_ref

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16])
def test_assert_close_ulp_bound(rng, dtype):
    ref = random_array(rng, 1000, FLOAT32).astype(np.float64)
    assert_close(ref + ulp(ref, dtype), ref, dtype)          # 1 ulp everywhere
    near = ref.copy()
    near[17] += 2 * ulp(ref[17], dtype)                       # 2 ulp on one element
    assert_close(near, ref, dtype)
    off = ref.copy()
    off[17] += 2.5 * ulp(ref[17], dtype) + 1e-6
    with pytest.raises(AssertionError, match="off by more than 2 ulp"):
        assert_close(off, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_assert_close_relative_bound_and_nan(rng, dtype):
    ref = random_array(rng, (4, 100), FLOAT32).astype(np.float64)
    rel = 1e-5 if dtype == FLOAT32 else 8e-3
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(ref * (1 + 1.5 * rel), ref, dtype)
    nan = ref.copy()
    nan[2, 3] = np.nan
    with pytest.raises(AssertionError, match="relative error nan"):
        assert_close(nan, ref, dtype)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(ref[:3], ref, dtype)


def test_ulp():
    assert ulp(np.float64(1.0), BFLOAT16) == 2.0 ** -7
    assert ulp(np.float64(1.99), FLOAT16) == 2.0 ** -10
    assert ulp(np.float64(-3.0), FLOAT32) == 2.0 ** -22
    assert ulp(np.float64(0.0), FLOAT16) == 2.0 ** -24            # subnormal spacing
    assert ulp(np.float64(1e-40), BFLOAT16) == 2.0 ** -133


def test_reference_is_float64_of_rounded_inputs():
    x = np.array([[3.0, 4.0]], NUMPY[BFLOAT16])
    w = np.array([1.0, 0.5], np.float32)
    y, rstd = rms_norm_ref(x, w, eps=0.0, weight_offset=0.5)
    assert y.dtype == np.float64 and rstd.shape == (1,)
    r = 1 / np.sqrt(12.5)
    np.testing.assert_allclose(rstd, [r], rtol=1e-15)
    np.testing.assert_allclose(y, [[3 * r * 1.5, 4 * r * 1.0]], rtol=1e-15)


@pytest.mark.parametrize("offset", [0, 2, 4])
def test_aligned_empty(offset):
    a = aligned_empty((3, 5), FLOAT16, offset=offset)
    assert a.ctypes.data % 64 == offset and a.shape == (3, 5) and a.flags.c_contiguous


def test_assert_bitwise_sees_nan_payloads_and_signed_zero():
    a = np.array([0.0, np.nan], np.float32)
    b = a.copy()
    b.view(np.uint32)[1] |= 1
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise(a, b)
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise(np.array([0.0], np.float32), np.array([-0.0], np.float32))


@pytest.mark.parametrize("quant_dtype", ["int8", "float8_e4m3fn"])
def test_assert_quant_close_bounds(rng, quant_dtype):
    """One level off is allowed on < 0.1% of the decided elements, two never; ties may go
    either way; yscale is held to 1e-5."""
    from conftest import QUANT_NUMPY, assert_quant_close, quant_levels
    from rmsnorm_hip.reference import quantize_ref
    qmax = 127.0 if quant_dtype == "int8" else 448.0
    quotient = rng.uniform(-qmax, qmax, (50, 100))
    quotient[quotient == 0] = 1.0
    levels = quantize_ref(quotient, quant_dtype)
    yscale = rng.uniform(0.5, 2, 50)
    q = levels.astype(QUANT_NUMPY[quant_dtype])
    assert_quant_close(q, yscale.astype(np.float32), quotient, yscale, quant_dtype)

    def shifted(count, by):
        code = quant_levels(q, quant_dtype).reshape(-1).copy()
        picks = rng.choice(np.flatnonzero(np.abs(code) < 100), count, replace=False)
        code[picks] += by
        if quant_dtype == "int8":
            return code.astype(np.int8).reshape(q.shape)
        bits = np.where(code < 0, 0x80 | -code, code).astype(np.uint8)
        return bits.view(QUANT_NUMPY[quant_dtype]).reshape(q.shape)

    assert_quant_close(shifted(4, 1), yscale, quotient, yscale, quant_dtype)   # 4 < 5 = 0.1%
    with pytest.raises(AssertionError, match="differs from the reference in 5 of 5000"):
        assert_quant_close(shifted(5, 1), yscale, quotient, yscale, quant_dtype)
    with pytest.raises(AssertionError, match="off by 2 levels"):
        assert_quant_close(shifted(1, 2), yscale, quotient, yscale, quant_dtype)
    with pytest.raises(AssertionError, match="relative error"):
        assert_quant_close(q, yscale * (1 + 2e-5), quotient, yscale, quant_dtype)
    # exact ties (x.5 levels for int8, midpoints for fp8) round either way without counting
    tie = np.array([[2.5, -6.5] if quant_dtype == "int8" else [2.375, -13.5]])
    either = np.array([[3, -7] if quant_dtype == "int8" else [2.25, -13.0]])   # not to even
    assert_quant_close(either.astype(QUANT_NUMPY[quant_dtype]), np.ones(1), tie, np.ones(1),
                       quant_dtype)
