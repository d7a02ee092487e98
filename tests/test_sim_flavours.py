"""The CPU-side half of tests/test_device_flavours.py: a bare ``__cuda_array_interface__``
object, every entry point x float32 / float16 / bfloat16 (uint16 with ``dtype=``) x contiguous /
row-strided / ``out=`` and in place, run by the GPU kernels in the simulator (which has no
device memory: the interface points at host memory).  Checked: what comes back (a CAI object of
the library dtype: float16 stays float16, bfloat16 comes back as uint16), its values against
the float64 reference, and the inputs left unchanged.  numba's own simulated device arrays have
no ``__cuda_array_interface__`` (numba-cuda 0.30), so the numba flavour runs on the GPU only."""
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, assert_dweight, assert_dx, assert_quant_close, random_array

import rmsnorm_hip
from rmsnorm_hip import reference

pytestmark = [pytest.mark.quick, pytest.mark.sim]

M, N, PAD = 3, 40, 8
DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("contiguous", "strided")
STORED = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(np.uint16)}


class CAIOnly:
    """A bare __cuda_array_interface__ object over (simulated device, i.e. host) memory."""

    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = dict(
            shape=array.shape, typestr=array.dtype.str, version=3,
            strides=None if array.flags.c_contiguous else array.strides,
            data=(array.__array_interface__["data"][0], False))


def make(host, layout):
    """(CAI object holding ``host`` (library dtype), dtype keyword)."""
    name = {np.dtype(ml_dtypes.bfloat16): "bfloat16"}.get(host.dtype, host.dtype.name)
    stored = host.view(np.uint16) if name == "bfloat16" else host
    if layout == "strided":
        wide = np.zeros((stored.shape[0], stored.shape[1] + PAD), stored.dtype)
        wide[:, 4:4 + stored.shape[1]] = stored
        stored = wide[:, 4:4 + host.shape[1]]
    else:
        stored = stored.copy()
    return CAIOnly(stored), ("bfloat16" if name == "bfloat16" else None)


def values(out, name):
    """A returned CAI array as NumPy values of library dtype ``name``."""
    assert hasattr(out, "__cuda_array_interface__"), type(out)
    a = out.copy_to_host() if hasattr(out, "copy_to_host") else out.array
    return a.view(ml_dtypes.bfloat16) if name == "bfloat16" else a


def check(out, name, shape):
    cai = out.__cuda_array_interface__
    assert tuple(cai["shape"]) == shape
    assert np.dtype(cai["typestr"]) == STORED.get(name, np.dtype(name)), (name, cai["typestr"])


def two_rows_and_weight(rng, dtype, layout):
    """Host (x, other, weight), CAI arrays of them, and the dtype keyword."""
    hosts = [random_array(rng, (M, N), dtype) for _ in range(2)]
    hosts.append(random_array(rng, N, dtype, loc=1.0, scale=0.1))
    (x, kw), (o, _), (w, _) = make(hosts[0], layout), make(hosts[1], layout), make(hosts[2],
                                                                                   "contiguous")
    return hosts, (x, o, w), kw


def assert_same_bits(a, b, name):
    np.testing.assert_array_equal(values(a, name).view(np.uint8), values(b, name).view(np.uint8))


@pytest.fixture(autouse=True)
def _on_the_simulator(use_backend):
    use_backend("sim")


CASES = [(d, lay) for d in DTYPES for lay in LAYOUTS]


@pytest.mark.parametrize("dtype,layout", CASES)
def test_rms_norm(rng, dtype, layout):
    (x_h, _, w_h), (x, _, w), kw = two_rows_and_weight(rng, dtype, layout)
    y, rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True, dtype=kw)
    check(y, dtype, (M, N))
    check(rstd, "float32", (M,))
    y_ref, rstd_ref = reference.rms_norm_ref(x_h, w_h, 1e-6)
    assert_close(values(y, dtype), y_ref, dtype)
    assert_close(values(rstd, "float32"), rstd_ref, "float32")
    np.testing.assert_array_equal(values(x, dtype), x_h)
    out, _ = make(np.zeros_like(x_h), layout)
    assert rmsnorm_hip.rms_norm(x, w, 1e-6, out=out, dtype=kw) is out
    assert_same_bits(out, y, dtype)
    assert rmsnorm_hip.rms_norm(x, w, 1e-6, out=x, dtype=kw) is x      # in place
    assert_same_bits(x, y, dtype)


@pytest.mark.parametrize("dtype,layout", CASES)
def test_fused_add_rms_norm(rng, dtype, layout):
    (x_h, r_h, w_h), (x, r, w), kw = two_rows_and_weight(rng, dtype, layout)
    y, residual_out = rmsnorm_hip.fused_add_rms_norm(x, r, w, 1e-6, dtype=kw)
    check(y, dtype, (M, N))
    check(residual_out, dtype, (M, N))
    y_ref, h_ref, _ = reference.fused_add_rms_norm_ref(x_h, r_h, w_h, 1e-6)
    assert_close(values(y, dtype), y_ref, dtype)
    np.testing.assert_array_equal(values(residual_out, dtype).astype(np.float64), h_ref)
    np.testing.assert_array_equal(values(x, dtype), x_h)
    np.testing.assert_array_equal(values(r, dtype), r_h)
    assert rmsnorm_hip.fused_add_rms_norm_(x, r, w, 1e-6, dtype=kw) is None
    assert_same_bits(x, y, dtype)
    assert_same_bits(r, residual_out, dtype)


@pytest.mark.parametrize("dtype,layout", CASES)
def test_rms_norm_backward(rng, dtype, layout):
    (x_h, dy_h, w_h), (x, dy, w), kw = two_rows_and_weight(rng, dtype, layout)
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w, dtype=kw)
    check(dx, dtype, (M, N))
    check(dw, dtype, (N,))
    dx_ref, dw_ref = reference.rms_norm_backward_ref(dy_h, x_h, w_h, None)
    rstd = reference.rms_norm_ref(x_h, w_h, 1e-6)[1]
    assert_dx(values(dx, dtype), dy_h, x_h, w_h, rstd, dx_ref, dtype)
    assert_dweight(values(dw, dtype), dw_ref, dtype)


@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("dtype,layout", CASES)
def test_rms_norm_quant(rng, dtype, layout, quant):
    (x_h, r_h, w_h), (x, r, w), kw = two_rows_and_weight(rng, dtype, layout)
    q, yscale, residual_out = rmsnorm_hip.rms_norm_quant(x, w, 1e-6, residual=r,
                                                         quant_dtype=quant, dtype=kw)
    assert np.dtype(q.__cuda_array_interface__["typestr"]) == (
        np.int8 if quant == "int8" else np.uint8)
    check(yscale, "float32", (M,))
    check(residual_out, dtype, (M, N))
    q_ref, yscale_ref, h_ref = reference.rms_norm_quant_ref(x_h, w_h, 1e-6, residual=r_h,
                                                            quant_dtype=quant)
    q_h = q.copy_to_host()
    q_h = q_h if quant == "int8" else q_h.view(ml_dtypes.float8_e4m3fn)
    assert_quant_close(q_h, values(yscale, "float32"), q_ref, yscale_ref, quant)
    np.testing.assert_array_equal(values(residual_out, dtype).astype(np.float64), h_ref)
