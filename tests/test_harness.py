"""The test harness itself: assert_close enforces API.md's tolerances (and no looser), the
reference is float64 from the rounded inputs, and the aligned allocator aligns."""
import numpy as np
import pytest
from conftest import (BFLOAT16, DTYPES, FLOAT16, FLOAT32, NUMPY, aligned_empty, assert_bitwise,
                      assert_close, random_array, ulp)

from rmsnorm_hip.reference import rms_norm_ref


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
