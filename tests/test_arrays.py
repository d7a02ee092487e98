"""Array plumbing that only a GPU run would otherwise reach: outputs allocated through CuPy (and
numba device arrays: both are described by ``_arrays._from_cai``) carry the library dtype they
hold, not their storage dtype."""
import numpy as np
import pytest

from rmsnorm_hip import _arrays


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
