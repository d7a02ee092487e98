"""Array plumbing that only a GPU run would otherwise reach: outputs allocated through CuPy (and
numba device arrays: both are described by ``_arrays._from_cai``) carry the library dtype they
hold, not their storage dtype."""
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
