"""Every entry point over every array flavour the contract names, generated from one table so
that no flavour or dtype can be left out: {CuPy, torch, numba device array, a bare
``__cuda_array_interface__`` object, a DLPack-only object} x {float32, float16, bfloat16 (uint16
with ``dtype="bfloat16"`` where the library has no bfloat16)} x {contiguous, row-strided, out= /
in place}; and mixed libraries (CuPy x with torch weight / residual / dy, and the reverse).
Each call is checked for the library, dtype, shape and device of what it returns, its values
against the float64 reference, and its inputs left unchanged.

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -m device tests/test_device_flavours.py

Why the older device tests missed CuPy float16 coming back as uint16 and mixed libraries being
refused: they were written per library, each with the dtypes its author had in mind (torch for
bf16, CuPy for float32 and bf16 as uint16), so no test ever asked CuPy for float16, and the
mixed-library rule was only tested as an error.  tests/README.md says what else such gaps hide.
"""
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
from conftest import (assert_close, assert_dweight, assert_dx, assert_quant_close,
                      require_cuda_torch)

pytestmark = pytest.mark.device

torch = require_cuda_torch()
cupy = pytest.importorskip("cupy")
from numba import cuda as numba_cuda  # noqa: E402

import rmsnorm_hip  # noqa: E402
from rmsnorm_hip import reference  # noqa: E402

M, N, PAD = 7, 264, 24
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
      "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class CAIOnly:
    """A bare __cuda_array_interface__ object over CuPy memory (what a new GPU library offers)."""

    def __init__(self, array):
        self._array = array
        self.__cuda_array_interface__ = array.__cuda_array_interface__


class DLPackOnly:
    """A bare DLPack object over a torch tensor (what JAX and other libraries offer)."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, stream=None, **kwargs):
        return self._tensor.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


@dataclass(frozen=True)
class Flavour:
    """How a library holds an array: ``make(host)`` -> (array, dtype keyword) and what comes
    back: ``out_type`` and the NumPy-level dtype of 16-bit float outputs."""
    name: str

    def make(self, host):
        """(array of this flavour holding ``host``, the dtype= keyword it needs)."""
        name = _name(host.dtype)
        if self.name in ("torch", "dlpack"):
            t = torch.from_numpy(host.view(np.int16) if name == "bfloat16" else host)
            t = (t.view(torch.bfloat16) if name == "bfloat16" else t).cuda()
            return (t if self.name == "torch" else DLPackOnly(t)), None
        bits = name == "bfloat16"
        dev = host.view(np.uint16) if bits else host
        kw = "bfloat16" if bits else None
        if self.name == "numba":
            return numba_cuda.to_device(np.ascontiguousarray(dev)), kw
        arr = cupy.asarray(dev)
        return (arr if self.name == "cupy" else CAIOnly(arr)), kw

    def strided(self, host):
        """A row-strided view (a column slice of a wider buffer) holding ``host``."""
        wide = np.zeros((host.shape[0], host.shape[1] + PAD), host.dtype)
        wide[:, 8:8 + host.shape[1]] = host
        made, kw = self.make(wide)
        if isinstance(made, (CAIOnly, DLPackOnly)):
            inner = made._array if isinstance(made, CAIOnly) else made._tensor
            view = inner[:, 8:8 + host.shape[-1]]
            return (CAIOnly(view) if isinstance(made, CAIOnly) else DLPackOnly(view)), kw
        return made[:, 8:8 + host.shape[-1]], kw

    def out_type(self):
        return {"torch": torch.Tensor, "cupy": cupy.ndarray, "cai": cupy.ndarray,
                "dlpack": cupy.ndarray,
                "numba": numba_cuda.cudadrv.devicearray.DeviceNDArray}[self.name]

    def half_dtype(self, name):
        """What a 16-bit output of library dtype ``name`` comes back as."""
        if self.name == "torch":
            return {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]
        if self.name == "dlpack" and name == "bfloat16":
            return np.dtype(np.uint16)          # through CuPy, which has no bfloat16
        return np.dtype(np.float16) if name == "float16" else np.dtype(np.uint16)


FLAVOURS = [Flavour(n) for n in ("cupy", "torch", "numba", "cai", "dlpack")]
DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("contiguous", "strided", "out")


def _name(dtype):
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(ml_dtypes.bfloat16): "bfloat16"}[np.dtype(dtype)]


def unwrap(a):
    return a._array if isinstance(a, CAIOnly) else a._tensor if isinstance(a, DLPackOnly) else a


def to_host(a, name):
    """An array of any flavour as a NumPy array of library dtype ``name`` (bits reinterpreted)."""
    a = unwrap(a)
    if isinstance(a, torch.Tensor):
        a = (a.view(torch.int16) if a.dtype == torch.bfloat16 else
             a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a)
        h = a.cpu().numpy()
    else:                               # CuPy, and numba device arrays through CuPy
        h = cupy.asnumpy(cupy.asarray(a))
    if name in ("bfloat16", "float16") and h.dtype.itemsize == 2 and h.dtype != NP[name]:
        h = h.view(NP[name])
    if name == "float8_e4m3fn" and h.dtype != ml_dtypes.float8_e4m3fn:
        h = h.view(ml_dtypes.float8_e4m3fn)
    return h


def check_output(flavour, out, name, shape):
    assert isinstance(out, flavour.out_type()), (flavour.name, type(out))
    assert tuple(out.shape) == tuple(shape)
    dt = out.dtype
    if name == "float32":
        assert dt in (torch.float32, np.float32), dt
    elif name in ("float16", "bfloat16"):
        assert dt == flavour.half_dtype(name), (flavour.name, name, dt)
    if isinstance(out, torch.Tensor):
        assert out.is_cuda and out.device.index == torch.cuda.current_device()


def inputs(rng, dtype):
    x = rng.standard_normal((M, N)).astype(NP[dtype])
    other = rng.standard_normal((M, N)).astype(NP[dtype])
    w = (1 + 0.1 * rng.standard_normal(N)).astype(NP[dtype])
    return x, other, w


def made(flavour, host, layout):
    return flavour.strided(host) if layout == "strided" else flavour.make(host)


def unchanged(flavour_arrays):
    """Host copies of input arrays, to check after the call."""
    return [(a, to_host(a, n).copy(), n) for a, n in flavour_arrays]


def assert_unchanged(snapshots):
    for a, before, n in snapshots:
        np.testing.assert_array_equal(to_host(a, n).view(np.uint8), before.view(np.uint8))


def two_rows_and_weight(rng, flavour, dtype, layout):
    """Host (x, other, weight), this flavour's arrays of them, the dtype keyword, and snapshots
    of those inputs."""
    hosts = inputs(rng, dtype)
    (x, kw), (o, _), (w, _) = (made(flavour, hosts[0], layout), made(flavour, hosts[1], layout),
                               flavour.make(hosts[2]))
    return hosts, (x, o, w), kw, unchanged([(a, dtype) for a in (x, o, w)])


def assert_same_bits(a, b, name):
    np.testing.assert_array_equal(to_host(a, name).view(np.uint8), to_host(b, name).view(np.uint8))


CASES = [(f, d, lay) for f in FLAVOURS for d in DTYPES for lay in LAYOUTS]


def case_id(case):
    f, d, lay = case
    return f"{f.name}-{d}-{lay}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rms_norm(rng, case):
    flavour, dtype, layout = case
    x_h, _, w_h = inputs(rng, dtype)
    x, kw = made(flavour, x_h, "strided" if layout == "strided" else "contiguous")
    w, _ = flavour.make(w_h)
    snap = unchanged([(x, dtype), (w, dtype)])
    y_ref, rstd_ref = reference.rms_norm_ref(x_h, w_h, 1e-6)
    if layout == "out":
        out, _ = flavour.make(np.full_like(x_h, np.nan))
        result = rmsnorm_hip.rms_norm(x, w, 1e-6, out=out, dtype=kw)
        assert result is out
        assert_close(to_host(out, dtype), y_ref, dtype)
        assert_unchanged(snap)
        # in place: out=x
        xi, _ = flavour.make(x_h.copy())
        assert rmsnorm_hip.rms_norm(xi, w, 1e-6, out=xi, dtype=kw) is xi
        assert_close(to_host(xi, dtype), y_ref, dtype)
        return
    y, rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True, dtype=kw)
    check_output(flavour, y, dtype, (M, N))
    check_output(flavour, rstd, "float32", (M,))
    assert_close(to_host(y, dtype), y_ref, dtype)
    assert_close(to_host(rstd, "float32"), rstd_ref, "float32")
    assert_unchanged(snap)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] != "out"], ids=case_id)
def test_fused_add_rms_norm(rng, case):
    flavour, dtype, layout = case
    (x_h, r_h, w_h), (x, r, w), kw, snap = two_rows_and_weight(rng, flavour, dtype, layout)
    y, residual_out = rmsnorm_hip.fused_add_rms_norm(x, r, w, 1e-6, dtype=kw)
    y_ref, h_ref, _ = reference.fused_add_rms_norm_ref(x_h, r_h, w_h, 1e-6)
    for out in (y, residual_out):
        check_output(flavour, out, dtype, (M, N))
    assert_close(to_host(y, dtype), y_ref, dtype)
    np.testing.assert_array_equal(to_host(residual_out, dtype).astype(np.float64), h_ref)
    assert_unchanged(snap)
    # in place, vLLM's form: residual <- h, x <- y, bitwise the out-of-place results
    xi, _ = made(flavour, x_h, layout)
    ri, _ = made(flavour, r_h, layout)
    assert rmsnorm_hip.fused_add_rms_norm_(xi, ri, w, 1e-6, dtype=kw) is None
    assert_same_bits(xi, y, dtype)
    assert_same_bits(ri, residual_out, dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] != "out"], ids=case_id)
def test_rms_norm_backward(rng, case):
    flavour, dtype, layout = case
    (x_h, dy_h, w_h), (x, dy, w), kw, snap = two_rows_and_weight(rng, flavour, dtype, layout)
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w, dtype=kw)
    check_output(flavour, dx, dtype, (M, N))
    check_output(flavour, dw, dtype, (N,))
    dx_ref, dw_ref = reference.rms_norm_backward_ref(dy_h, x_h, w_h, None)
    rstd = reference.rms_norm_ref(x_h, w_h, 1e-6)[1]
    assert_dx(to_host(dx, dtype), dy_h, x_h, w_h, rstd, dx_ref, dtype)
    assert_dweight(to_host(dw, dtype), dw_ref, dtype)
    assert_unchanged(snap)


@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("case", [c for c in CASES if c[2] != "out"], ids=case_id)
def test_rms_norm_quant(rng, case, quant):
    flavour, dtype, layout = case
    (x_h, r_h, w_h), (x, r, w), kw, snap = two_rows_and_weight(rng, flavour, dtype, layout)
    q, yscale, residual_out = rmsnorm_hip.rms_norm_quant(x, w, 1e-6, residual=r,
                                                         quant_dtype=quant, dtype=kw)
    assert isinstance(q, flavour.out_type()) and tuple(q.shape) == (M, N)
    check_output(flavour, yscale, "float32", (M,))
    check_output(flavour, residual_out, dtype, (M, N))
    q_ref, yscale_ref, h_ref = reference.rms_norm_quant_ref(x_h, w_h, 1e-6, residual=r_h,
                                                            quant_dtype=quant)
    assert_quant_close(to_host(q, quant), to_host(yscale, "float32"), q_ref, yscale_ref, quant)
    np.testing.assert_array_equal(to_host(residual_out, dtype).astype(np.float64), h_ref)
    assert_unchanged(snap)


MIXED = [("cupy", "torch"), ("torch", "cupy")]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("x_lib,other_lib", MIXED)
def test_mixed_libraries(rng, x_lib, other_lib, dtype):
    """x from one library, weight / residual / dy / rstd from the other, on one device: outputs
    in x's library, the bits of the one-library call."""
    fx, fo = Flavour(x_lib), Flavour(other_lib)
    x_h, o_h, w_h = inputs(rng, dtype)
    x, w_same, o_same = fx.make(x_h)[0], fx.make(w_h)[0], fx.make(o_h)[0]
    w_mix, o_mix = fo.make(w_h)[0], fo.make(o_h)[0]
    calls = {
        "rms_norm": lambda w, o: (rmsnorm_hip.rms_norm(x, w, 1e-6),),
        "fused": lambda w, o: rmsnorm_hip.fused_add_rms_norm(x, o, w, 1e-6),
        "quant": lambda w, o: rmsnorm_hip.rms_norm_quant(x, w, residual=o),
        "backward": lambda w, o: rmsnorm_hip.rms_norm_backward(o, x, w),
    }
    for name, call in calls.items():
        same, mixed = call(w_same, o_same), call(w_mix, o_mix)
        for a, b in zip(same, mixed):
            assert isinstance(b, fx.out_type()), (name, type(b))
            kind = "float32" if a.dtype in (np.float32, torch.float32) else dtype
            if a.dtype in (np.int8, torch.int8):
                kind = "int8"
            ha, hb = to_host(a, kind), to_host(b, kind)
            np.testing.assert_array_equal(ha.view(np.uint8), hb.view(np.uint8), name)
