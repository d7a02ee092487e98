"""Array plumbing that only a GPU run would otherwise reach: outputs allocated through CuPy (and
numba device arrays: both are described by ``_arrays._from_cai``) carry the library dtype they
hold, not their storage dtype."""
import numpy as np
import pytest

import rmsnorm_hip as R_
from rmsnorm_hip import _arrays, _dtypes

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("dtype,typestr", [("float8_e4m3fn", "|u1"), ("bfloat16", "<u2"),
                                           ("float16", "<u2"), ("int8", "|i1"),
                                           ("float32", "<f4")])
def test_cupy_output_is_described_by_its_library_dtype(dtype, typestr):
    """_arrays.empty allocates a CuPy float8 q as uint8 storage; the kernel choice reads
    ``info.dtype`` ("float8_e4m3fn" selects the quantised store), so "uint8" there launched the
    unquantised kernel on a one-byte buffer."""
    cai = dict(shape=(2, 3), typestr=typestr, data=(0x1000, False), strides=None, version=3)
    info = _arrays._from_cai(object(), "cai", cai, 0, dtype)
    assert info.dtype == dtype and info.itemsize == int(typestr[2:])


def test_uint16_storage_stays_uint16_without_dtype():
    cai = dict(shape=(4,), typestr="<u2", data=(0x1000, False), strides=None, version=3)
    assert _arrays._from_cai(object(), "cai", cai, 0, None).dtype == "uint16"


class HostDLPack:
    """A host array that speaks DLPack and nothing else (no dtype, shape or array interface), as
    a library the package does not know would pass it; its module's ``from_dlpack`` is how its
    outputs come back (JAX on the CPU works this way)."""
    __module__ = "hostdlpacklib"

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


@pytest.fixture
def hostdlpacklib(monkeypatch):
    import sys
    import types
    lib = types.ModuleType("hostdlpacklib")
    lib.from_dlpack = lambda obj: HostDLPack(np.from_dlpack(obj))
    monkeypatch.setitem(sys.modules, "hostdlpacklib", lib)
    return lib


@pytest.mark.parametrize("m", [0, 5])
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_backward", "fused_add_rms_norm",
                                "rms_norm_quant"])
def test_host_dlpack_objects_get_their_library_back(hostdlpacklib, rng, use_backend, op, m):
    """A host DLPack object with no ``dtype`` runs on the CPU backend (it raised AttributeError
    when the outputs were allocated) and gets every output back through its library's
    ``from_dlpack``, bitwise what the same NumPy call returns."""
    import rmsnorm_hip as R
    use_backend("cpu")
    x = rng.standard_normal((m, 40)).astype(np.float32)
    other = rng.standard_normal((m, 40)).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    call = {"rms_norm": lambda a, b, c: R.rms_norm(a, c, return_rstd=True),
            "rms_norm_backward": lambda a, b, c: R.rms_norm_backward(b, a, c),
            "fused_add_rms_norm": lambda a, b, c: R.fused_add_rms_norm(a, b, c),
            "rms_norm_quant": lambda a, b, c: R.rms_norm_quant(a, c)}[op]
    expected = call(x, other, w)
    got = call(HostDLPack(x), HostDLPack(other), HostDLPack(w))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert isinstance(g, HostDLPack)
        assert g.array.dtype == e.dtype and g.array.shape == e.shape
        np.testing.assert_array_equal(g.array, e)


def test_host_dlpack_bfloat16_is_read_in_place(hostdlpacklib, rng, use_backend):
    """A host DLPack tensor of bfloat16 (JAX or torch on the CPU; NumPy's from_dlpack refuses
    it) is read through the DLPack struct, strided rows in place: bitwise the torch call.
    Outputs NumPy cannot export (bfloat16, float8) come back as ml_dtypes NumPy arrays; a dtype
    nobody reads is a TypeError naming the argument."""
    torch = pytest.importorskip("torch")
    import rmsnorm_hip as R
    use_backend("cpu")
    x = torch.from_numpy(rng.standard_normal((7, 3, 64)).astype(np.float32))
    x = x.to(torch.bfloat16)[:, 1]                      # rows 3 * 64 apart
    w = torch.from_numpy(rng.standard_normal(64).astype(np.float32)).to(torch.bfloat16)
    y, rstd = R.rms_norm(HostDLPack(x), HostDLPack(w), return_rstd=True)
    y_ref, rstd_ref = R.rms_norm(x, w, return_rstd=True)
    assert isinstance(y, np.ndarray) and y.dtype == _dtypes.NUMPY["bfloat16"]
    np.testing.assert_array_equal(y.view(np.uint16),
                                  y_ref.view(torch.int16).numpy().view(np.uint16))
    assert isinstance(rstd, HostDLPack)
    np.testing.assert_array_equal(rstd.array, rstd_ref.numpy())
    q, scales = R.rms_norm_quant(HostDLPack(x), HostDLPack(w), quant_dtype="float8_e4m3fn",
                                 group_size=32)
    q_ref, scales_ref = R.rms_norm_quant(x, w, quant_dtype="float8_e4m3fn", group_size=32)
    assert q.dtype == _dtypes.NUMPY["float8_e4m3fn"]
    np.testing.assert_array_equal(q.view(np.uint8), q_ref.view(torch.uint8).numpy())
    np.testing.assert_array_equal(scales.array, scales_ref.numpy())
    # in place: the view is x's memory; read-only, as NumPy makes an unversioned import
    info = _arrays.describe(HostDLPack(x), "x")
    assert info.ptr == x.data_ptr() and info.strides == (3 * 64, 1) and info.readonly
    with pytest.raises(ValueError, match="must be writeable"):
        R.fused_add_rms_norm_(HostDLPack(x), HostDLPack(x.clone()), HostDLPack(w))
    empty = R.rms_norm(HostDLPack(torch.empty(0, 64, dtype=torch.bfloat16)), HostDLPack(w))
    assert empty.shape == (0, 64) and empty.dtype == _dtypes.NUMPY["bfloat16"]
    fp8 = HostDLPack(torch.zeros(2, 8, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="rms_norm: x must be a float32, float16 or bfloat16 "
                                        "array, got a host DLPack tensor of DLPack type code"):
        R.rms_norm(fp8)


def _byte_set(a):
    """Every byte address of a's elements."""
    first = np.indices(a.shape).reshape(a.ndim, -1).T @ np.array(a.strides)
    start = a.__array_interface__["data"][0]
    return {start + int(f) + k for f in first for k in range(a.itemsize)}


def test_overlap_rule_is_the_byte_sets(rng):
    """_validate._share_elements against the byte sets themselves: exact for arrays of rows (at
    one row stride or two different ones), never False for arrays that share a byte otherwise.
    Row slices of one buffer that interleave without sharing a byte were refused before as
    overlapping spans, at the same row stride and then at different ones."""
    from rmsnorm_hip import _validate
    buf = np.zeros(4096, np.uint8)
    cases = strides_differ = 0
    for _ in range(3000):
        period = 4 * int(rng.integers(1, 6))      # a row stride in bytes both arrays share
        views = []
        for _ in range(2):
            itemsize = int(rng.choice([1, 2, 4]))
            ndim = int(rng.integers(1, 4))
            shape = tuple(int(d) for d in rng.integers(1, 5, ndim))
            row = period // itemsize
            if rng.random() < 0.3:                   # a row stride of its own
                row += int(rng.integers(0, 6))
            shape = shape[:-1] + (min(shape[-1] + int(rng.integers(0, 4)), row),)
            strides, step = [], row
            for d in reversed(shape[:-1]):
                strides.append(step)
                step *= d
            strides = tuple(reversed(strides)) + (1,)
            if rng.random() < 0.1 and ndim > 1:      # leading dims that do not flatten
                strides = (strides[0] + 1,) + strides[1:]
            offset = int(rng.integers(0, 64)) * itemsize
            dtype = {1: np.uint8, 2: np.float16, 4: np.float32}[itemsize]
            view = np.lib.stride_tricks.as_strided(buf[offset:].view(dtype)[:1], shape,
                                                   tuple(s * itemsize for s in strides))
            views.append(view)
        a, b = views
        info_a = _arrays.describe(a, "a")
        info_b = _arrays.describe(b, "b")
        shared = bool(_byte_set(a) & _byte_set(b))
        said = _validate._share_elements(info_a, info_b)
        assert said or not shared, (a.shape, a.strides, b.shape, b.strides)
        assert said == _validate._share_elements(info_b, info_a)
        rows = None not in (_validate._row_bands(info_a), _validate._row_bands(info_b))
        assert said == shared or not rows, (a.shape, a.strides, b.shape, b.strides)
        cases += not shared and said is False
        strides_differ += not shared and rows and a.strides[:-1] != b.strides[:-1] and a.ndim > 1
    assert cases > 100 and strides_differ > 20


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interleaved_outputs_are_not_overlaps(rng, backend, dtype):
    """Column slices of one wider matrix are separate arrays (docs/api.md: only overlap with an
    input is an error): y written beside x, and the in-place fused add over x and residual side by
    side, give bitwise the results of contiguous arrays; a slice one column over is refused.
    On the simulator too, whose launches once copied each array's span in and back out (the
    residual's copy-back then overwrote the x written beside it)."""
    import rmsnorm_hip as R
    from conftest import random_array
    m, n = 7, 40
    buf = random_array(rng, (m, 2 * n), dtype)
    w = random_array(rng, (n,), dtype)
    x = buf[:, :n].copy()
    R.rms_norm(buf[:, :n], w, out=buf[:, n:])
    np.testing.assert_array_equal(buf[:, n:].view(np.uint8), R.rms_norm(x, w).view(np.uint8))
    np.testing.assert_array_equal(buf[:, :n].view(np.uint8), x.view(np.uint8))

    buf = random_array(rng, (m, 2 * n), dtype)
    y, r = R.fused_add_rms_norm(buf[:, :n].copy(), buf[:, n:].copy(), w)
    R.fused_add_rms_norm_(buf[:, :n], buf[:, n:], w)
    np.testing.assert_array_equal(buf[:, :n].view(np.uint8), y.view(np.uint8))
    np.testing.assert_array_equal(buf[:, n:].view(np.uint8), r.view(np.uint8))
    with pytest.raises(ValueError, match="residual overlaps x"):
        R.fused_add_rms_norm_(buf[:, :n], buf[:, n - 1:-1], w)

    # rows of two different strides in one buffer that share no element
    buf = random_array(rng, (16, 256), dtype)
    x, out = buf[:4, :64], buf.reshape(8, 512)[:4, 128:192]
    expected = R.rms_norm(x.copy())
    assert R.rms_norm(x, None, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("module,kind,numba_gpu", [
    ("numba.hip.hipdrv.devicearray", _arrays.ROCM, "numba.hip"),
    ("numba.cuda.cudadrv.devicearray", _arrays.CUDA, "numba.cuda"),
    ("numba.hipster", _arrays.CUDA, None), ("somelib", _arrays.CUDA, None)])
def test_numba_device_arrays_are_on_their_own_vendor(module, kind, numba_gpu):
    """A numba-hip device array is a ROCm array even in a process that imported numba.cuda
    (this one has: the simulator), and its outputs come from numba-hip, not numba.cuda."""
    fake = type("DeviceNDArray", (), {"__module__": module})()
    cai = dict(shape=(2, 3), typestr="<f4", data=(0x1000, False), strides=None, version=3)
    assert _arrays._from_cai(fake, "cai", cai, 0, None).device == kind
    assert _arrays._numba_gpu_module(fake) == numba_gpu


MIXED_CALLS = {
    "rms_norm": lambda x, o, w, r: R_.rms_norm(x, w, return_rstd=True),
    "rms_norm_out": lambda x, o, w, r: (R_.rms_norm(x, w, out=o),),
    "fused_add_rms_norm": lambda x, o, w, r: R_.fused_add_rms_norm(x, o, w),
    "rms_norm_quant": lambda x, o, w, r: R_.rms_norm_quant(x, w, xscale=w, residual=o),
    "rms_norm_backward": lambda x, o, w, r: R_.rms_norm_backward(o, x, w, r, dresidual=o),
}


@pytest.mark.parametrize("op", list(MIXED_CALLS))
@pytest.mark.parametrize("x_lib", ["numpy", "torch"])
def test_arrays_of_several_libraries_in_one_call(rng, op, x_lib):
    """Every array argument but x from another library on the same device (NumPy with torch CPU
    tensors here; CuPy with torch on a GPU): the bits of the one-library call, and outputs in x's
    library (out= is the array given)."""
    torch = pytest.importorskip("torch")
    from conftest import random_array
    x, other = (random_array(rng, (5, 24), "float32") for _ in range(2))
    w = random_array(rng, (24,), "float32", loc=1.0, scale=0.1)
    rstd = R_.rms_norm(x, w, return_rstd=True)[1]
    libs = {"numpy": lambda a: a.copy(), "torch": lambda a: torch.from_numpy(a.copy())}
    to_x, to_other = libs[x_lib], libs["numpy" if x_lib == "torch" else "torch"]
    same = MIXED_CALLS[op](to_x(x), to_x(other), to_x(w), to_x(rstd))
    mixed = MIXED_CALLS[op](to_x(x), to_other(other), to_other(w), to_other(rstd))
    kind = torch.Tensor if x_lib == "torch" else np.ndarray
    assert len(mixed) == len(same)
    for got, want in zip(mixed, same):
        if op != "rms_norm_out":
            assert isinstance(got, kind) and isinstance(want, kind), (type(got), type(want))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
