"""The dtypes the library speaks, one spelling each.

Kernels see 16-bit floats as ``uint16`` bit patterns (numba-hip has no half types, and CuPy has no
bfloat16), so every dtype has a *name* (what the user sees) and a *storage* NumPy dtype (what the
kernel is compiled for).
"""
import ml_dtypes
import numpy as np

FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
INT8 = "int8"
FLOAT8_E4M3FN = "float8_e4m3fn"
UINT8 = "uint8"                 # bytes: MX scales (E8M0) and element bits
MXFP8 = "mxfp8_e4m3"            # OCP MX formats (quant_dtype names, not array dtypes)
MXFP4 = "mxfp4_e2m1"

ACTIVATION_DTYPES = (FLOAT32, FLOAT16, BFLOAT16)
HALF_DTYPES = (FLOAT16, BFLOAT16)
QUANT_DTYPES = (INT8, FLOAT8_E4M3FN)
QMAX = {INT8: 127.0, FLOAT8_E4M3FN: 448.0}   # largest level of each quantised dtype
MX_DTYPES = (MXFP8, MXFP4)
MX_BLOCK = 32                   # elements sharing one E8M0 scale
# the largest power of two of each MX element format (emax_elem: e4m3 448 = 1.75 * 2**8, e2m1 6 =
# 1.5 * 2**2), and the element format that holds its bits
MX_EMAX = {MXFP8: 8, MXFP4: 2}
MX_ELEMENT = {MXFP8: FLOAT8_E4M3FN, MXFP4: MXFP4}

ITEMSIZE = {FLOAT32: 4, FLOAT16: 2, BFLOAT16: 2, INT8: 1, FLOAT8_E4M3FN: 1, UINT8: 1,
            "int32": 4, "int64": 8}     # the last two: RoPE positions

# what the kernels are compiled for
STORAGE = {
    FLOAT32: np.dtype(np.float32),
    FLOAT16: np.dtype(np.uint16),
    BFLOAT16: np.dtype(np.uint16),
    INT8: np.dtype(np.int8),
    FLOAT8_E4M3FN: np.dtype(np.uint8),
    UINT8: np.dtype(np.uint8),
    "int32": np.dtype(np.int32),     # RoPE positions
    "int64": np.dtype(np.int64),
}

# what NumPy callers get back
NUMPY = {
    FLOAT32: np.dtype(np.float32),
    FLOAT16: np.dtype(np.float16),
    BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    INT8: np.dtype(np.int8),
    FLOAT8_E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    UINT8: np.dtype(np.uint8),
}

# what CuPy and numba device-array callers get back: their native float16, and bits for the
# dtypes they lack (bfloat16 as uint16, float8 as uint8)
DEVICE = {
    FLOAT32: np.dtype(np.float32),
    FLOAT16: np.dtype(np.float16),
    BFLOAT16: np.dtype(np.uint16),
    INT8: np.dtype(np.int8),
    FLOAT8_E4M3FN: np.dtype(np.uint8),
    UINT8: np.dtype(np.uint8),
}

_FROM_NUMPY = {v: k for k, v in NUMPY.items()}


def name_of_numpy(dtype, reinterpret=None):
    """The library name of a NumPy dtype; ``reinterpret`` ("bfloat16"/"float16") reads uint16
    storage."""
    dtype = np.dtype(dtype)
    if dtype == np.uint16 and reinterpret in HALF_DTYPES:
        return reinterpret
    return _FROM_NUMPY.get(dtype, str(dtype))
