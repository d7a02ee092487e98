"""The entry points' argument errors (docs/api.md): the exception type, a message naming the
function, the argument, what was expected and what was given, raised before anything is launched,
and nothing written — inputs and out= keep their bits.

One table of bad calls over the five entry points.  Arrays "on a GPU" are stand-ins that carry a
``__cuda_array_interface__`` with a pointer nothing ever reads (tests/test_errors.FakeDevice): the
device checks run, and no GPU is needed."""
from dataclasses import dataclass, field

import numpy as np
import pytest
from conftest import assert_bitwise, random_array

from rmsnorm_hip import (_arrays, backends, fused_add_rms_norm, fused_add_rms_norm_, rms_norm,
                         rms_norm_backward, rms_norm_quant)

pytestmark = pytest.mark.quick

try:
    import torch
except ImportError:
    torch = None

M, N = 3, 8


def f32(rng, shape=(M, N)):
    return random_array(rng, shape, "float32")


def bf16(rng, shape=(M, N)):
    return random_array(rng, shape, "bfloat16")


def strided(a, shape, strides):
    """A view of ``a``'s memory with element ``strides``."""
    item = a.dtype.itemsize
    return np.lib.stride_tricks.as_strided(a, shape, tuple(s * item for s in strides))


def read_only(a):
    a.setflags(write=False)
    return a


def overlapping_rows(rng):
    buf = f32(rng, (M + 1, N))
    return (buf[:M],), dict(out=buf[1:])                      # out starts one row into x


def overlapping_element(rng):
    buf = f32(rng, (M * N + 1,))
    return (buf[:-1].reshape(M, N),), dict(out=buf[1:].reshape(M, N))


def same_start_other_strides(rng):
    buf = f32(rng, (M, 2 * N))
    return (buf[:, :N],), dict(out=strided(buf, (M, N), (N, 1)))  # shares x's first row


def out_overlaps_weight(rng):
    buf = f32(rng, (M, N))
    return (f32(rng), buf[1]), dict(out=buf)


@dataclass
class Case:
    id: str
    build: object                       # rng -> (args, kwargs)
    exc: type
    match: str
    env: dict = field(default_factory=dict)
    marks: tuple = ()
    fn: object = rms_norm


CASES = [
    # x dtype and type
    Case("x_float64", lambda r: ((f32(r).astype(np.float64),), {}), TypeError,
         r"rms_norm: x must have dtype float32, float16 or bfloat16, got float64"),
    Case("x_int32", lambda r: ((np.ones((M, N), np.int32),), {}), TypeError,
         r"rms_norm: x must have dtype .*, got int32"),
    Case("x_bool", lambda r: ((np.ones((M, N), bool),), {}), TypeError,
         r"rms_norm: x must have dtype .*, got bool"),
    Case("x_complex64", lambda r: ((f32(r).astype(np.complex64),), {}), TypeError,
         r"rms_norm: x must have dtype .*, got complex64"),
    Case("x_uint16_without_dtype", lambda r: ((bf16(r).view(np.uint16),), {}), TypeError,
         r"rms_norm: x must have dtype .*, got uint16"),
    Case("x_list", lambda r: (([[1.0, 2.0]],), {}), TypeError,
         r"rms_norm: x must be a NumPy, CuPy or torch array.*got builtins\.list"),
    # x shape and strides
    Case("x_0d", lambda r: ((np.array(1.5, np.float32),), {}), ValueError,
         r"rms_norm: x must have at least 1 dimension, got a 0-d array"),
    Case("x_N0", lambda r: ((np.ones((M, 0), np.float32),), {}), ValueError,
         r"rms_norm: x must have a non-empty last dimension, got shape \(3, 0\)"),
    Case("x_last_stride_2", lambda r: ((f32(r, (M, 2 * N))[:, ::2],), {}), ValueError,
         r"rms_norm: x must have unit stride in its last dimension, got stride 2"),
    Case("x_negative_row_stride", lambda r: ((f32(r)[::-1],), {}), ValueError,
         r"rms_norm: x row stride must be >= its last dimension 8.*got strides \(-8, 1\)"),
    Case("x_zero_row_stride", lambda r: ((strided(f32(r), (M, N), (0, 1)),), {}), ValueError,
         r"rms_norm: x row stride must be >= its last dimension 8.*got strides \(0, 1\)"),
    Case("x_overlapping_rows", lambda r: ((strided(f32(r), (M, N), (4, 1)),), {}), ValueError,
         r"rms_norm: x row stride must be >= its last dimension 8.*got strides \(4, 1\)"),
    # rms_norm takes rows at two strides (head rows), not three; the other entry points one
    Case("x_leading_dims_three_strides", lambda r: ((f32(r, (2, 4, 3, N))[:, :2, :2],), {}),
         ValueError, r"rms_norm: x leading dimensions must flatten to at most two strides "
         r"\(tokens, then heads\), got strides \(96, 24, 8, 1\)"),
    Case("x_head_rows_overlap",
         lambda r: ((strided(f32(r, (5 * N,)), (2, 2, N), (3 * N, 4, 1)),), {}), ValueError,
         r"rms_norm: x rows must not overlap .*got strides \(24, 4, 1\)"),
    Case("fused_x_leading_dims_not_flat",
         lambda r: ((f32(r, (2, 6, N))[:, :3], f32(r, (2, 3, N))), {}), ValueError,
         r"fused_add_rms_norm: x leading dimensions must flatten to one row stride, "
         r"got strides \(48, 8, 1\)", fn=fused_add_rms_norm),
    # weight
    Case("weight_shape_N_plus_1", lambda r: ((f32(r), f32(r, (N + 1,))), {}), ValueError,
         r"rms_norm: weight must have shape \(8,\), got \(9,\)"),
    Case("weight_2d", lambda r: ((f32(r), f32(r, (1, N))), {}), ValueError,
         r"rms_norm: weight must have shape \(8,\), got \(1, 8\)"),
    Case("weight_float16_for_bf16", lambda r: ((bf16(r), f32(r, (N,)).astype(np.float16)), {}),
         TypeError, r"rms_norm: weight must have dtype bfloat16 or float32 for x of dtype "
                    r"bfloat16, got float16"),
    Case("weight_bf16_for_float32", lambda r: ((f32(r), bf16(r, (N,))), {}), TypeError,
         r"rms_norm: weight must have dtype float32 for x of dtype float32, got bfloat16"),
    Case("weight_float64", lambda r: ((f32(r), f32(r, (N,)).astype(np.float64)), {}), TypeError,
         r"rms_norm: weight must have dtype float32 .*got float64"),
    Case("weight_stride_2", lambda r: ((f32(r), f32(r, (2 * N,))[::2]), {}), ValueError,
         r"rms_norm: weight must be contiguous, got stride 2"),
    Case("weight_list", lambda r: ((f32(r), [1.0] * N), {}), TypeError,
         r"rms_norm: weight must be a NumPy, CuPy or torch array.*got builtins\.list"),
    # eps and weight_offset
    Case("eps_negative", lambda r: ((f32(r), None, -1e-6), {}), ValueError,
         r"rms_norm: eps must be a finite number >= 0, got -1e-06"),
    Case("eps_nan", lambda r: ((f32(r), None, float("nan")), {}), ValueError,
         r"rms_norm: eps must be a finite number >= 0, got nan"),
    Case("eps_inf", lambda r: ((f32(r), None, float("inf")), {}), ValueError,
         r"rms_norm: eps must be a finite number >= 0, got inf"),
    Case("eps_str", lambda r: ((f32(r), None, "1e-6"), {}), TypeError,
         r"rms_norm: eps must be a float, got str"),
    Case("eps_none", lambda r: ((f32(r), None, None), {}), TypeError,
         r"rms_norm: eps must be a float, got NoneType"),
    Case("weight_offset_without_weight", lambda r: ((f32(r),), dict(weight_offset=1.0)),
         ValueError, r"rms_norm: weight_offset must be 0.0 when weight is None, got 1.0"),
    Case("weight_offset_nan", lambda r: ((f32(r), f32(r, (N,))), dict(weight_offset=np.nan)),
         ValueError, r"rms_norm: weight_offset must be finite, got nan"),
    # out=
    Case("out_shape", lambda r: ((f32(r),), dict(out=f32(r, (M, N + 1)))), ValueError,
         r"rms_norm: out must have shape \(3, 8\), got \(3, 9\)"),
    Case("out_flat", lambda r: ((f32(r),), dict(out=f32(r, (M * N,)))), ValueError,
         r"rms_norm: out must have shape \(3, 8\), got \(24,\)"),
    Case("out_dtype", lambda r: ((bf16(r),), dict(out=f32(r))), TypeError,
         r"rms_norm: out must have dtype bfloat16, got float32"),
    Case("out_negative_row_stride", lambda r: ((f32(r),), dict(out=f32(r)[::-1])), ValueError,
         r"rms_norm: out row stride must be >= .*got strides \(-8, 1\)"),
    Case("out_overlaps_x_by_rows", overlapping_rows, ValueError, r"rms_norm: out overlaps x"),
    Case("out_overlaps_x_by_one", overlapping_element, ValueError, r"rms_norm: out overlaps x"),
    Case("out_same_start_as_x", same_start_other_strides, ValueError,
         r"rms_norm: out overlaps x"),
    Case("out_overlaps_weight", out_overlaps_weight, ValueError,
         r"rms_norm: out overlaps weight"),
    Case("out_read_only", lambda r: ((f32(r),), dict(out=read_only(f32(r)))), ValueError,
         r"rms_norm: out must be writeable, got a read-only array"),
    # dtype= and the backend variable
    Case("dtype_float32", lambda r: ((f32(r),), dict(dtype="float32")), ValueError,
         r"rms_norm: dtype must be None, 'bfloat16' or 'float16', got 'float32'"),
    Case("dtype_on_float32_x", lambda r: ((f32(r),), dict(dtype="bfloat16")), ValueError,
         r"rms_norm: dtype='bfloat16' reads uint16 storage, but x has dtype float32"),
    Case("dtype_bf16_spelling", lambda r: ((bf16(r).view(np.uint16),), dict(dtype="bf16")),
         ValueError, r"rms_norm: dtype must be None, 'bfloat16' or 'float16', got 'bf16'"),
    Case("dtype_bf16_weight_float16", lambda r: ((bf16(r).view(np.uint16),
                                                   f32(r, (N,)).astype(np.float16)),
                                                  dict(dtype="bfloat16")), TypeError,
         r"rms_norm: weight must have dtype bfloat16 or float32 .*got float16"),
    Case("backend_unknown", lambda r: ((f32(r),), {}), ValueError,
         r"rms_norm: RMSNORM_HIP_BACKEND must be one of cuda, hip, cpu, sim, got 'bogus'",
         env={"RMSNORM_HIP_BACKEND": "bogus"}),
    Case("backend_cuda_numpy", lambda r: ((f32(r),), {}), ValueError,
         r"rms_norm: RMSNORM_HIP_BACKEND=cuda needs device arrays, got host \(NumPy\) memory",
         env={"RMSNORM_HIP_BACKEND": "cuda"}),
    Case("backend_hip_numpy", lambda r: ((f32(r),), {}), ValueError,
         r"rms_norm: RMSNORM_HIP_BACKEND=hip needs device arrays, got host \(NumPy\) memory",
         env={"RMSNORM_HIP_BACKEND": "hip"}),
]


# ---- fused_add_rms_norm, fused_add_rms_norm_, rms_norm_quant ----------------------------------
FA, FI, RQ = fused_add_rms_norm, fused_add_rms_norm_, rms_norm_quant


def overlapping_pair(rng):
    buf = f32(rng, (M + 1, N))
    return (buf[:M], buf[1:]), {}                             # residual starts one row into x


def same_buffer_pair(rng):
    x = f32(rng)
    return (x, x), {}


def weight_inside_x(rng):
    x = f32(rng)
    return (x, f32(rng), x[1]), {}


CASES += [
    Case("fused_x_float64", lambda r: ((f32(r).astype(np.float64), f32(r)), {}), TypeError,
         r"fused_add_rms_norm: x must have dtype float32, float16 or bfloat16, got float64",
         fn=FA),
    Case("fused_residual_dtype", lambda r: ((bf16(r), f32(r)), {}), TypeError,
         r"fused_add_rms_norm: residual must have dtype bfloat16, got float32", fn=FA),
    Case("fused_residual_shape", lambda r: ((f32(r), f32(r, (M, N + 1))), {}), ValueError,
         r"fused_add_rms_norm: residual must have shape \(3, 8\), got \(3, 9\)", fn=FA),
    Case("fused_residual_list", lambda r: ((f32(r), [[1.0] * N] * M), {}), TypeError,
         r"fused_add_rms_norm: residual must be a NumPy, CuPy or torch array.*builtins\.list",
         fn=FA),
    Case("fused_residual_negative_stride", lambda r: ((f32(r), f32(r)[::-1]), {}), ValueError,
         r"fused_add_rms_norm: residual row stride must be >= .*got strides \(-8, 1\)", fn=FA),
    Case("fused_weight_shape", lambda r: ((f32(r), f32(r), f32(r, (N - 1,))), {}), ValueError,
         r"fused_add_rms_norm: weight must have shape \(8,\), got \(7,\)", fn=FA),
    Case("fused_eps_negative", lambda r: ((f32(r), f32(r), None, -1.0), {}), ValueError,
         r"fused_add_rms_norm: eps must be a finite number >= 0, got -1.0", fn=FA),
    Case("fused_offset_without_weight", lambda r: ((f32(r), f32(r)), dict(weight_offset=1.0)),
         ValueError, r"fused_add_rms_norm: weight_offset must be 0.0 when weight is None, got 1.0",
         fn=FA),
    Case("fused_dtype_keyword", lambda r: ((bf16(r).view(np.uint16), f32(r)),
                                           dict(dtype="bfloat16")), TypeError,
         r"fused_add_rms_norm: residual must have dtype bfloat16, got float32", fn=FA),
    # in place
    Case("in_place_residual_dtype", lambda r: ((f32(r), bf16(r)), {}), TypeError,
         r"fused_add_rms_norm_: residual must have dtype float32, got bfloat16", fn=FI),
    Case("in_place_x_read_only", lambda r: ((read_only(f32(r)), f32(r)), {}), ValueError,
         r"fused_add_rms_norm_: x must be writeable, got a read-only array", fn=FI),
    Case("in_place_residual_read_only", lambda r: ((f32(r), read_only(f32(r))), {}), ValueError,
         r"fused_add_rms_norm_: residual must be writeable, got a read-only array", fn=FI),
    Case("in_place_overlapping_rows", overlapping_pair, ValueError,
         r"fused_add_rms_norm_: residual overlaps x; the arrays written in place must not share "
         r"memory", fn=FI),
    Case("in_place_same_array", same_buffer_pair, ValueError,
         r"fused_add_rms_norm_: residual overlaps x", fn=FI),
    Case("in_place_weight_inside_x", weight_inside_x, ValueError,
         r"fused_add_rms_norm_: x overlaps weight", fn=FI),
    Case("in_place_shape", lambda r: ((f32(r), f32(r, (M + 1, N))), {}), ValueError,
         r"fused_add_rms_norm_: residual must have shape \(3, 8\), got \(4, 8\)", fn=FI),
    # quantised
    Case("quant_dtype_unknown", lambda r: ((f32(r),), dict(quant_dtype="int4")), ValueError,
         r"rms_norm_quant: quant_dtype must be 'int8', 'float8_e4m3fn', 'mxfp8_e4m3' or "
         r"'mxfp4_e2m1', got 'int4'", fn=RQ),
    Case("quant_dtype_uint8", lambda r: ((f32(r),), dict(quant_dtype=np.uint8)), ValueError,
         r"rms_norm_quant: quant_dtype must be 'int8', 'float8_e4m3fn', 'mxfp8_e4m3' or "
         r"'mxfp4_e2m1', got <class", fn=RQ),
    Case("quant_dtype_fnuz", lambda r: ((f32(r),), dict(quant_dtype="float8_e4m3fnuz")),
         ValueError, r"rms_norm_quant: quant_dtype must be .*got 'float8_e4m3fnuz'", fn=RQ),
    Case("quant_dtype_none", lambda r: ((f32(r),), dict(quant_dtype=None)), ValueError,
         r"rms_norm_quant: quant_dtype must be .*got None", fn=RQ),
    Case("quant_x_int8", lambda r: ((np.ones((M, N), np.int8),), {}), TypeError,
         r"rms_norm_quant: x must have dtype float32, float16 or bfloat16, got int8", fn=RQ),
    Case("xscale_shape", lambda r: ((f32(r),), dict(xscale=f32(r, (N + 1,)))), ValueError,
         r"rms_norm_quant: xscale must have shape \(8,\), got \(9,\)", fn=RQ),
    Case("xscale_float16_for_bf16", lambda r: ((bf16(r),),
                                               dict(xscale=f32(r, (N,)).astype(np.float16))),
         TypeError, r"rms_norm_quant: xscale must have dtype bfloat16 or float32 for x of dtype "
                    r"bfloat16, got float16", fn=RQ),
    Case("xscale_float64", lambda r: ((f32(r),), dict(xscale=f32(r, (N,)).astype(np.float64))),
         TypeError, r"rms_norm_quant: xscale must have dtype float32 for x of dtype float32, "
                    r"got float64", fn=RQ),
    Case("xscale_stride_2", lambda r: ((f32(r),), dict(xscale=f32(r, (2 * N,))[::2])),
         ValueError, r"rms_norm_quant: xscale must be contiguous, got stride 2", fn=RQ),
    Case("quant_residual_dtype", lambda r: ((f32(r),), dict(residual=bf16(r))), TypeError,
         r"rms_norm_quant: residual must have dtype float32, got bfloat16", fn=RQ),
    Case("quant_residual_shape", lambda r: ((f32(r),), dict(residual=f32(r, (M, 1)))), ValueError,
         r"rms_norm_quant: residual must have shape \(3, 8\), got \(3, 1\)", fn=RQ),
    Case("quant_weight_dtype", lambda r: ((f32(r), bf16(r, (N,))), {}), TypeError,
         r"rms_norm_quant: weight must have dtype float32 for x of dtype float32, got bfloat16",
         fn=RQ),
    Case("quant_backend_cuda_numpy", lambda r: ((f32(r),), {}), ValueError,
         r"rms_norm_quant: RMSNORM_HIP_BACKEND=cuda needs device arrays",
         env={"RMSNORM_HIP_BACKEND": "cuda"}, fn=RQ),
]



# ---- stand-ins for arrays of other libraries and devices --------------------------------------
class FakeDevice:
    """A C-contiguous array "on CUDA device ``device``" known only by its
    ``__cuda_array_interface__``; the pointer is never dereferenced (validation fails first)."""
    _next = 0x7F0000000000
    devices = {}

    def __init__(self, shape, typestr="<f4", device=0):
        self.ptr = FakeDevice._next
        FakeDevice._next += 1 << 24
        FakeDevice.devices[self.ptr] = device
        self.__cuda_array_interface__ = dict(shape=tuple(shape), typestr=typestr,
                                             data=(self.ptr, False), strides=None, version=3)


class DLPackOnly:
    """A DLPack object on a device the library does not run on (type 14: kDLOneAPI)."""

    def __dlpack__(self, stream=None):
        raise AssertionError("the capsule must not be asked for: the device is checked first")

    def __dlpack_device__(self):
        return (14, 0)


def dev(shape=(M, N), device=0, typestr="<f4"):
    return FakeDevice(shape, typestr, device)


def t32(rng, shape=(M, N)):
    return torch.from_numpy(f32(rng, shape))


needs_torch = (pytest.mark.skipif(torch is None, reason="torch is not installed"),)
BW = rms_norm_backward
# the tail every "wrong device" message shares
OTHER_DEVICE = r"must be on the same device as x \(cuda:0\), got cuda:1"

CASES += [
    # ---- rms_norm: more dtypes, shapes, scalars, flags -------------------------------------
    Case("x_complex128", lambda r: ((f32(r).astype(np.complex128),), {}), TypeError,
         r"rms_norm: x must have dtype float32, float16 or bfloat16, got complex128"),
    Case("x_int64_1d", lambda r: ((np.arange(N),), {}), TypeError,
         r"rms_norm: x must have dtype .*, got int64"),
    Case("x_float64_0d", lambda r: ((np.array(1.0),), {}), TypeError,
         r"rms_norm: x must have dtype .*, got float64"),
    Case("x_1d_N0", lambda r: ((np.ones(0, np.float32),), {}), ValueError,
         r"rms_norm: x must have a non-empty last dimension, got shape \(0,\)"),
    Case("x_3d_N0", lambda r: ((np.ones((2, 3, 0), np.float32),), {}), ValueError,
         r"rms_norm: x must have a non-empty last dimension, got shape \(2, 3, 0\)"),
    Case("x_python_float", lambda r: ((1.5,), {}), TypeError,
         r"rms_norm: x must be a NumPy, CuPy or torch array.*got builtins\.float"),
    Case("weight_int32", lambda r: ((f32(r), np.ones(N, np.int32)), {}), TypeError,
         r"rms_norm: weight must have dtype float32 for x of dtype float32, got int32"),
    Case("weight_bool", lambda r: ((bf16(r), np.ones(N, bool)), {}), TypeError,
         r"rms_norm: weight must have dtype bfloat16 or float32 for x of dtype bfloat16, "
         r"got bool"),
    Case("weight_0d", lambda r: ((f32(r), np.array(1.0, np.float32)), {}), ValueError,
         r"rms_norm: weight must have shape \(8,\), got \(\)"),
    Case("weight_numpy_scalar", lambda r: ((f32(r), np.float32(1.0)), {}), TypeError,
         r"rms_norm: weight must be a NumPy, CuPy or torch array.*got numpy\.float32"),
    Case("eps_array", lambda r: ((f32(r), None, np.full(2, 1e-6)), {}), TypeError,
         r"rms_norm: eps must be a float, got ndarray of shape \(2,\)"),
    Case("eps_complex", lambda r: ((f32(r), None, 1e-6j), {}), TypeError,
         r"rms_norm: eps must be a float, got complex"),
    Case("eps_bool", lambda r: ((f32(r), None, True), {}), TypeError,
         r"rms_norm: eps must be a float, got bool"),
    Case("eps_numpy_nan", lambda r: ((f32(r), None, np.float32("nan")), {}), ValueError,
         r"rms_norm: eps must be a finite number >= 0, got nan"),
    # float32 is where the kernels compute: a scalar it cannot hold is refused, not rounded to
    # infinity (which gave all-zero outputs)
    Case("eps_past_float32", lambda r: ((f32(r), None, 1e39), {}), ValueError,
         r"rms_norm: eps must be a finite number >= 0, got 1e\+39 \(float32.*3\.4e38\)"),
    Case("eps_huge_int", lambda r: ((f32(r), None, 10**400), {}), ValueError,
         r"rms_norm: eps must be a finite number >= 0, got 1000.*\(401 digits\)"),
    Case("eps_numpy_bool", lambda r: ((f32(r), None, np.bool_(True)), {}), TypeError,
         r"rms_norm: eps must be a float, got bool"),
    Case("eps_numpy_complex", lambda r: ((f32(r), None, np.complex128(1e-6)), {}), TypeError,
         r"rms_norm: eps must be a float, got complex128"),
    Case("weight_offset_past_float32", lambda r: ((f32(r), f32(r, (N,))),
                                                  dict(weight_offset=-1e39)),
         ValueError, r"rms_norm: weight_offset must be finite, got -1e\+39 \(float32"),
    Case("weight_offset_bool", lambda r: ((f32(r), f32(r, (N,))), dict(weight_offset=True)),
         TypeError, r"rms_norm: weight_offset must be a float, got bool"),
    Case("weight_offset_str", lambda r: ((f32(r), f32(r, (N,))), dict(weight_offset="1")),
         TypeError, r"rms_norm: weight_offset must be a float, got str"),
    Case("weight_offset_inf", lambda r: ((f32(r), f32(r, (N,))), dict(weight_offset=-np.inf)),
         ValueError, r"rms_norm: weight_offset must be finite, got -inf"),
    Case("return_rstd_str", lambda r: ((f32(r),), dict(return_rstd="yes")), TypeError,
         r"rms_norm: return_rstd must be a bool, got str"),
    Case("return_rstd_none", lambda r: ((f32(r),), dict(return_rstd=None)), TypeError,
         r"rms_norm: return_rstd must be a bool, got NoneType"),
    Case("out_list", lambda r: ((f32(r),), dict(out=[[0.0] * N] * M)), TypeError,
         r"rms_norm: out must be a NumPy, CuPy or torch array.*got builtins\.list"),
    Case("out_float16_for_float32", lambda r: ((f32(r),), dict(out=f32(r).astype(np.float16))),
         TypeError, r"rms_norm: out must have dtype float32, got float16"),
    Case("out_int8", lambda r: ((f32(r),), dict(out=np.zeros((M, N), np.int8))), TypeError,
         r"rms_norm: out must have dtype float32, got int8"),
    Case("out_last_stride_2", lambda r: ((f32(r),), dict(out=f32(r, (M, 2 * N))[:, ::2])),
         ValueError, r"rms_norm: out must have unit stride in its last dimension, got stride 2"),
    Case("out_shares_one_column_with_x", lambda r: (lambda x: ((x[:, :N // 2],),
                                                                dict(out=x[:, N // 2 - 1:-1])))(
        f32(r)), ValueError, r"rms_norm: out overlaps x"),
    Case("out_float16_for_bf16_storage", lambda r: ((bf16(r).view(np.uint16),),
                                                    dict(dtype="bfloat16",
                                                         out=f32(r).astype(np.float16))),
         TypeError, r"rms_norm: out must have dtype bfloat16, got float16"),
    # other libraries and devices
    Case("x_torch_float64", lambda r: ((t32(r).double(),), {}), TypeError,
         r"rms_norm: x must have dtype float32, float16 or bfloat16, got float64",
         marks=needs_torch),
    Case("x_torch_meta_device", lambda r: ((torch.empty(M, N, device="meta"),), {}), ValueError,
         r"rms_norm: x must be on a CPU, CUDA or ROCm device, got torch device meta",
         marks=needs_torch),
    Case("weight_torch_meta_device", lambda r: ((t32(r), torch.empty(N, device="meta")), {}),
         ValueError, r"rms_norm: weight must be on a CPU, CUDA or ROCm device, got torch "
                     r"device meta", marks=needs_torch),
    Case("x_dlpack_unknown_device", lambda r: ((DLPackOnly(),), {}), ValueError,
         r"rms_norm: x must be on a CPU, CUDA or ROCm device .*got DLPack device type 14"),
    Case("weight_device_for_numpy_x", lambda r: ((f32(r), dev((N,))), {}), ValueError,
         r"rms_norm: weight must be on the same device as x \(cpu\), got cuda:0"),
    Case("weight_on_other_gpu", lambda r: ((dev(), dev((N,), 1)), {}), ValueError,
         r"rms_norm: weight " + OTHER_DEVICE),
    Case("out_on_other_gpu", lambda r: ((dev(),), dict(out=dev(device=1))), ValueError,
         r"rms_norm: out " + OTHER_DEVICE),
    Case("x_device_float64", lambda r: ((dev(typestr="<f8"),), {}), TypeError,
         r"rms_norm: x must have dtype float32, float16 or bfloat16, got float64"),
    Case("x_device_backend_cpu", lambda r: ((dev(),), {}), ValueError,
         r"rms_norm: RMSNORM_HIP_BACKEND=cpu cannot run cuda device arrays \(use cuda\)",
         env={"RMSNORM_HIP_BACKEND": "cpu"}),
    Case("x_device_backend_hip", lambda r: ((dev(),), {}), ValueError,
         r"rms_norm: RMSNORM_HIP_BACKEND=hip cannot run cuda device arrays \(use cuda\)",
         env={"RMSNORM_HIP_BACKEND": "hip"}),

    # ---- fused_add_rms_norm / fused_add_rms_norm_ ------------------------------------------
    Case("fused_residual_none", lambda r: ((f32(r), None), {}), TypeError,
         r"fused_add_rms_norm: residual must be an array like x, got None", fn=FA),
    Case("fused_x_bool", lambda r: ((np.ones((M, N), bool), f32(r)), {}), TypeError,
         r"fused_add_rms_norm: x must have dtype .*, got bool", fn=FA),
    Case("fused_residual_complex", lambda r: ((f32(r), f32(r).astype(np.complex64)), {}),
         TypeError, r"fused_add_rms_norm: residual must have dtype float32, got complex64", fn=FA),
    Case("fused_residual_last_stride_2", lambda r: ((f32(r), f32(r, (M, 2 * N))[:, ::2]), {}),
         ValueError, r"fused_add_rms_norm: residual must have unit stride in its last "
                     r"dimension, got stride 2", fn=FA),
    Case("fused_x_N0", lambda r: ((np.ones((M, 0), np.float32), np.ones((M, 0), np.float32)), {}),
         ValueError, r"fused_add_rms_norm: x must have a non-empty last dimension, got shape "
                     r"\(3, 0\)", fn=FA),
    Case("fused_x_0d", lambda r: ((np.array(1.0, np.float32), np.array(1.0, np.float32)), {}),
         ValueError, r"fused_add_rms_norm: x must have at least 1 dimension, got a 0-d array",
         fn=FA),
    Case("fused_weight_float16_for_bf16", lambda r: ((bf16(r), bf16(r),
                                                      f32(r, (N,)).astype(np.float16)), {}),
         TypeError, r"fused_add_rms_norm: weight must have dtype bfloat16 or float32 for x of "
                    r"dtype bfloat16, got float16", fn=FA),
    Case("fused_eps_nan", lambda r: ((f32(r), f32(r), None, float("nan")), {}), ValueError,
         r"fused_add_rms_norm: eps must be a finite number >= 0, got nan", fn=FA),
    Case("fused_return_rstd_int", lambda r: ((f32(r), f32(r)), dict(return_rstd=1)), TypeError,
         r"fused_add_rms_norm: return_rstd must be a bool, got int", fn=FA),
    Case("fused_residual_on_other_gpu", lambda r: ((dev(), dev(device=1)), {}), ValueError,
         r"fused_add_rms_norm: residual " + OTHER_DEVICE, fn=FA),
    Case("in_place_residual_none", lambda r: ((f32(r), None), {}), TypeError,
         r"fused_add_rms_norm_: residual must be an array like x, got None", fn=FI),
    Case("in_place_x_float64", lambda r: ((f32(r).astype(np.float64), f32(r)), {}), TypeError,
         r"fused_add_rms_norm_: x must have dtype .*, got float64", fn=FI),
    Case("in_place_x_last_stride_2", lambda r: ((f32(r, (M, 2 * N))[:, ::2], f32(r)), {}),
         ValueError, r"fused_add_rms_norm_: x must have unit stride in its last dimension, "
                     r"got stride 2", fn=FI),
    Case("in_place_weight_offset_nan", lambda r: ((f32(r), f32(r), f32(r, (N,))),
                                                  dict(weight_offset=float("nan"))),
         ValueError, r"fused_add_rms_norm_: weight_offset must be finite, got nan", fn=FI),
    Case("in_place_backend_cuda_numpy", lambda r: ((f32(r), f32(r)), {}), ValueError,
         r"fused_add_rms_norm_: RMSNORM_HIP_BACKEND=cuda needs device arrays",
         env={"RMSNORM_HIP_BACKEND": "cuda"}, fn=FI),

    # ---- rms_norm_quant ---------------------------------------------------------------------
    Case("quant_dtype_uppercase", lambda r: ((f32(r),), dict(quant_dtype="INT8")), ValueError,
         r"rms_norm_quant: quant_dtype must be 'int8', 'float8_e4m3fn', 'mxfp8_e4m3' or "
         r"'mxfp4_e2m1', got 'INT8'", fn=RQ),
    Case("quant_dtype_int", lambda r: ((f32(r),), dict(quant_dtype=8)), ValueError,
         r"rms_norm_quant: quant_dtype must be .*got 8", fn=RQ),
    Case("quant_dtype_float8_e5m2", lambda r: ((f32(r),), dict(quant_dtype="float8_e5m2")),
         ValueError, r"rms_norm_quant: quant_dtype must be .*got 'float8_e5m2'", fn=RQ),
    Case("quant_dtype_torch_uint8", lambda r: ((f32(r),), dict(quant_dtype=torch.uint8)),
         ValueError, r"rms_norm_quant: quant_dtype must be .*got torch\.uint8", fn=RQ,
         marks=needs_torch),
    Case("quant_x_float64", lambda r: ((f32(r).astype(np.float64),), {}), TypeError,
         r"rms_norm_quant: x must have dtype .*, got float64", fn=RQ),
    Case("quant_x_N0", lambda r: ((np.ones((M, 0), np.float32),), {}), ValueError,
         r"rms_norm_quant: x must have a non-empty last dimension", fn=RQ),
    Case("quant_x_last_stride_2", lambda r: ((f32(r, (M, 2 * N))[:, ::2],), {}), ValueError,
         r"rms_norm_quant: x must have unit stride in its last dimension, got stride 2", fn=RQ),
    Case("xscale_int8", lambda r: ((f32(r),), dict(xscale=np.ones(N, np.int8))), TypeError,
         r"rms_norm_quant: xscale must have dtype float32 for x of dtype float32, got int8",
         fn=RQ),
    Case("xscale_2d", lambda r: ((f32(r),), dict(xscale=f32(r, (1, N)))), ValueError,
         r"rms_norm_quant: xscale must have shape \(8,\), got \(1, 8\)", fn=RQ),
    Case("xscale_on_other_gpu", lambda r: ((dev(),), dict(xscale=dev((N,), 1))), ValueError,
         r"rms_norm_quant: xscale " + OTHER_DEVICE, fn=RQ),
    Case("quant_residual_negative_stride", lambda r: ((f32(r),), dict(residual=f32(r)[::-1])),
         ValueError, r"rms_norm_quant: residual row stride must be >= .*got strides \(-8, 1\)",
         fn=RQ),
    Case("quant_eps_negative", lambda r: ((f32(r), None, -1e-3), {}), ValueError,
         r"rms_norm_quant: eps must be a finite number >= 0, got -0.001", fn=RQ),
    Case("quant_offset_without_weight", lambda r: ((f32(r),), dict(weight_offset=0.5)),
         ValueError, r"rms_norm_quant: weight_offset must be 0.0 when weight is None, got 0.5",
         fn=RQ),
    Case("quant_dtype_keyword_on_float32", lambda r: ((f32(r),), dict(dtype="float16")),
         ValueError, r"rms_norm_quant: dtype='float16' reads uint16 storage, but x has dtype "
                     r"float32", fn=RQ),

    # ---- rms_norm_backward ------------------------------------------------------------------
    Case("bwd_x_float64", lambda r: ((f32(r), f32(r).astype(np.float64)), {}), TypeError,
         r"rms_norm_backward: x must have dtype float32, float16 or bfloat16, got float64", fn=BW),
    Case("bwd_x_int32", lambda r: ((f32(r), np.ones((M, N), np.int32)), {}), TypeError,
         r"rms_norm_backward: x must have dtype .*, got int32", fn=BW),
    Case("bwd_x_0d", lambda r: ((np.array(1.0, np.float32), np.array(1.0, np.float32)), {}),
         ValueError, r"rms_norm_backward: x must have at least 1 dimension, got a 0-d array",
         fn=BW),
    Case("bwd_x_N0", lambda r: ((np.ones((M, 0), np.float32), np.ones((M, 0), np.float32)), {}),
         ValueError, r"rms_norm_backward: x must have a non-empty last dimension, got shape "
                     r"\(3, 0\)", fn=BW),
    Case("bwd_x_last_stride_2", lambda r: ((f32(r), f32(r, (M, 2 * N))[:, ::2]), {}),
         ValueError, r"rms_norm_backward: x must have unit stride in its last dimension", fn=BW),
    Case("bwd_dy_float64", lambda r: ((f32(r).astype(np.float64), f32(r)), {}), TypeError,
         r"rms_norm_backward: dy must have x's dtype float32, got float64", fn=BW),
    Case("bwd_dy_bf16_for_float32", lambda r: ((bf16(r), f32(r)), {}), TypeError,
         r"rms_norm_backward: dy must have x's dtype float32, got bfloat16", fn=BW),
    Case("bwd_dy_shape", lambda r: ((f32(r, (M, N + 1)), f32(r)), {}), ValueError,
         r"rms_norm_backward: dy must have x's shape \(3, 8\), got \(3, 9\)", fn=BW),
    Case("bwd_dy_flat", lambda r: ((f32(r, (M * N,)), f32(r)), {}), ValueError,
         r"rms_norm_backward: dy must have x's shape \(3, 8\), got \(24,\)", fn=BW),
    Case("bwd_dy_list", lambda r: (([[0.0] * N] * M, f32(r)), {}), TypeError,
         r"rms_norm_backward: dy must be a NumPy, CuPy or torch array.*got builtins\.list", fn=BW),
    Case("bwd_dy_last_stride_2", lambda r: ((f32(r, (M, 2 * N))[:, ::2], f32(r)), {}),
         ValueError, r"rms_norm_backward: dy must have unit stride in its last dimension, "
                     r"got stride 2", fn=BW),
    Case("bwd_dy_negative_row_stride", lambda r: ((f32(r)[::-1], f32(r)), {}), ValueError,
         r"rms_norm_backward: dy row stride must be >= its last dimension 8.*got strides "
         r"\(-8, 1\)", fn=BW),
    Case("bwd_dy_on_other_gpu", lambda r: ((dev(device=1), dev()), {}), ValueError,
         r"rms_norm_backward: dy " + OTHER_DEVICE, fn=BW),
    Case("bwd_weight_shape", lambda r: ((f32(r), f32(r), f32(r, (N + 1,))), {}), ValueError,
         r"rms_norm_backward: weight must have shape \(8,\), got \(9,\)", fn=BW),
    Case("bwd_weight_float16_for_float32", lambda r: ((f32(r), f32(r),
                                                       f32(r, (N,)).astype(np.float16)), {}),
         TypeError, r"rms_norm_backward: weight must have dtype float32 for x of dtype float32, "
                    r"got float16", fn=BW),
    Case("bwd_rstd_shape", lambda r: ((f32(r), f32(r), None, f32(r, (M + 1,))), {}), ValueError,
         r"rms_norm_backward: rstd must have shape \(3,\), got \(4,\)", fn=BW),
    Case("bwd_rstd_2d", lambda r: ((f32(r), f32(r), None, f32(r, (M, 1))), {}), ValueError,
         r"rms_norm_backward: rstd must have shape \(3,\), got \(3, 1\)", fn=BW),
    Case("bwd_rstd_float16", lambda r: ((bf16(r), bf16(r), None,
                                         f32(r, (M,)).astype(np.float16)), {}), TypeError,
         r"rms_norm_backward: rstd must have dtype float32 for x of dtype bfloat16, got float16",
         fn=BW),
    Case("bwd_rstd_float64", lambda r: ((f32(r), f32(r), None, np.ones(M)), {}), TypeError,
         r"rms_norm_backward: rstd must have dtype float32 .*got float64", fn=BW),
    Case("bwd_rstd_stride_2", lambda r: ((f32(r), f32(r), None, f32(r, (2 * M,))[::2]), {}),
         ValueError, r"rms_norm_backward: rstd must be contiguous, got stride 2", fn=BW),
    Case("bwd_rstd_list", lambda r: ((f32(r), f32(r), None, [1.0] * M), {}), TypeError,
         r"rms_norm_backward: rstd must be a NumPy, CuPy or torch array.*got builtins\.list",
         fn=BW),
    Case("bwd_rstd_on_other_gpu", lambda r: ((dev(), dev(), None, dev((M,), 1)), {}),
         ValueError, r"rms_norm_backward: rstd " + OTHER_DEVICE, fn=BW),
    Case("bwd_dresidual_dtype", lambda r: ((f32(r), f32(r)), dict(dresidual=bf16(r))), TypeError,
         r"rms_norm_backward: dresidual must have x's dtype float32, got bfloat16", fn=BW),
    Case("bwd_dresidual_shape", lambda r: ((f32(r), f32(r)), dict(dresidual=f32(r, (M, 1)))),
         ValueError, r"rms_norm_backward: dresidual must have x's shape \(3, 8\), got \(3, 1\)",
         fn=BW),
    Case("bwd_dresidual_zero_row_stride", lambda r: ((f32(r), f32(r)),
                                                     dict(dresidual=strided(f32(r), (M, N),
                                                                            (0, 1)))),
         ValueError, r"rms_norm_backward: dresidual row stride must be >= .*got strides \(0, 1\)",
         fn=BW),
    Case("bwd_deterministic_int", lambda r: ((f32(r), f32(r)), dict(deterministic=1)),
         TypeError, r"rms_norm_backward: deterministic must be a bool, got int", fn=BW),
    Case("bwd_deterministic_none", lambda r: ((f32(r), f32(r)), dict(deterministic=None)),
         TypeError, r"rms_norm_backward: deterministic must be a bool, got NoneType", fn=BW),
    Case("bwd_eps_nan", lambda r: ((f32(r), f32(r)), dict(eps=float("nan"))), ValueError,
         r"rms_norm_backward: eps must be a finite number >= 0, got nan", fn=BW),
    Case("bwd_eps_negative", lambda r: ((f32(r), f32(r)), dict(eps=-1e-6)), ValueError,
         r"rms_norm_backward: eps must be a finite number >= 0, got -1e-06", fn=BW),
    Case("bwd_offset_without_weight", lambda r: ((f32(r), f32(r)), dict(weight_offset=1.0)),
         ValueError, r"rms_norm_backward: weight_offset must be 0.0 when weight is None, got 1.0",
         fn=BW),
    Case("bwd_dtype_keyword_on_float32", lambda r: ((f32(r), f32(r)), dict(dtype="bfloat16")),
         ValueError, r"rms_norm_backward: dtype='bfloat16' reads uint16 storage, but x has "
                     r"dtype float32", fn=BW),
    Case("bwd_dtype_keyword_unknown", lambda r: ((f32(r), f32(r)), dict(dtype="half")),
         ValueError, r"rms_norm_backward: dtype must be None, 'bfloat16' or 'float16', "
                     r"got 'half'", fn=BW),
    Case("bwd_backend_cuda_numpy", lambda r: ((f32(r), f32(r)), {}), ValueError,
         r"rms_norm_backward: RMSNORM_HIP_BACKEND=cuda needs device arrays",
         env={"RMSNORM_HIP_BACKEND": "cuda"}, fn=BW),
    Case("bwd_backend_unknown", lambda r: ((f32(r), f32(r)), {}), ValueError,
         r"rms_norm_backward: RMSNORM_HIP_BACKEND must be one of cuda, hip, cpu, sim, "
                     r"got 'rocm'",
         env={"RMSNORM_HIP_BACKEND": "rocm"}, fn=BW),
]


def snapshot(args, kwargs):
    """(array, copy) of every NumPy and torch array argument."""
    values = list(args) + list(kwargs.values())
    saved = [(a, a.copy()) for a in values if isinstance(a, np.ndarray)]
    if torch is not None:
        saved += [(a, a.clone()) for a in values
                  if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
    return saved


class NoLaunch:
    """What backends.for_array hands out in these tests: any call on it is a launch that should
    not have happened."""

    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        raise AssertionError(f"{attr} was called on the {self.name} backend: a bad call got past "
                             f"validation")


@pytest.fixture
def no_launch(monkeypatch):
    """Validation errors come before any launch: the backend a call chose is a NoLaunch, and
    the device stand-ins report the device they were made for."""
    monkeypatch.setattr(backends, "get", lambda name, device_index=0: NoLaunch(name))
    monkeypatch.setattr(_arrays, "_pointer_device", lambda ptr: FakeDevice.devices.get(ptr, 0))


def test_the_table_is_large(request):
    """Issue 8 asks for >= 40 distinct bad calls over the five entry points; every one of them
    is covered."""
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    per_fn = {fn.__name__: sum(c.fn is fn for c in CASES) for fn in (rms_norm, FA, FI, RQ, BW)}
    assert len(CASES) >= 40 and all(count >= 8 for count in per_fn.values()), per_fn
    request.node.user_properties.append(("bad_calls", len(CASES)))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_error(rng, monkeypatch, no_launch, case):
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    args, kwargs = case.build(rng)
    before = snapshot(args, kwargs)

    with pytest.raises(case.exc, match=case.match):
        case.fn(*args, **kwargs)

    for i, (array, copy) in enumerate(before):
        if isinstance(array, np.ndarray):   # as bytes: complex128 has no unsigned twin
            assert_bitwise(np.ascontiguousarray(array).reshape(-1).view(np.uint8),
                           np.ascontiguousarray(copy).reshape(-1).view(np.uint8),
                           f"array argument {i} after the error")
        else:
            assert torch.equal(array, copy), f"tensor argument {i} changed after the error"


def test_every_case_is_valid_once_fixed(rng):
    """The error cases are one defect away from a valid call: the same x with a good weight,
    eps and out runs (so each case tests its one defect, not a broken fixture)."""
    x = f32(rng)
    y = rms_norm(x, f32(rng, (N,)), 1e-6, weight_offset=1.0, out=f32(rng))
    assert np.isfinite(y).all()


def test_new_entry_points_valid_once_fixed(rng):
    """The fused, quantised and backward cases' good twins run (a read-only residual is fine
    where it is only read)."""
    x, residual, w = f32(rng), read_only(f32(rng)), f32(rng, (N,))
    y, ro = fused_add_rms_norm(x, residual, w, weight_offset=1.0, return_rstd=False)
    fused_add_rms_norm_(x.copy(), residual.copy(), w)
    q, yscale, ro2 = rms_norm_quant(x, w, xscale=f32(rng, (N,)), residual=residual,
                                    quant_dtype="float8_e4m3fn")
    assert np.isfinite(y).all() and np.isfinite(yscale).all() and q.shape == x.shape
    dx, dw = rms_norm_backward(f32(rng), x, w, np.ones(M, np.float32), dresidual=f32(rng),
                               deterministic=False, eps=0.0)
    assert np.isfinite(dx).all() and np.isfinite(dw).all()
    assert rms_norm(x, None, np.float32(1e-6), return_rstd=True)[1].shape == (M,)


def test_device_stand_ins_pass_validation(monkeypatch):
    """FakeDevice arrays on one device validate (the cases above fail for their one defect):
    with the backend picked, the call gets as far as the launch."""
    monkeypatch.setattr(_arrays, "_pointer_device", lambda ptr: FakeDevice.devices.get(ptr, 0))
    monkeypatch.setattr(backends, "get", lambda name, device_index=0: NoLaunch(name))
    monkeypatch.setattr(_arrays, "empty", lambda like, shape, dtype: (
        lambda a: (a, _arrays.describe(a, "out")))(dev(shape)))
    with pytest.raises(AssertionError, match="rms_norm_fwd was called on the cuda backend"):
        rms_norm(dev(), dev((N,)), out=dev())
    with pytest.raises(AssertionError, match="rms_norm_bwd was called on the cuda backend"):
        rms_norm_backward(dev(), dev(), None, dev((M,)))


def test_repeat_call_path_refuses_what_full_validation_refuses(rng, monkeypatch):
    """A GPU array's repeat call finds its runner by a key of the call's metadata; return_rstd=1
    (== True, same hash) would find the runner a return_rstd=True call left and return (y, rstd)
    where full validation raises.  The key is faked here (it is None for NumPy arrays)."""
    from rmsnorm_hip import functional
    x = f32(rng)
    monkeypatch.setattr(_arrays, "fast_key", lambda x, weight, flags, others=(): flags)
    monkeypatch.setitem(functional._fwd_runners, (True, None),
                        lambda *args: pytest.fail("the repeat-call runner ran"))
    monkeypatch.delenv("RMSNORM_HIP_BACKEND", raising=False)
    with pytest.raises(TypeError, match=r"rms_norm: return_rstd must be a bool, got int"):
        rms_norm(x, return_rstd=1)
