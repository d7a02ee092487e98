"""The entry points' argument errors (API.md): the exception type, a message naming the function,
the argument, what was expected and what was given, and nothing written — inputs and out= keep
their bits."""
from dataclasses import dataclass, field

import numpy as np
import pytest
from conftest import assert_bitwise, random_array

from rmsnorm_hip import fused_add_rms_norm, fused_add_rms_norm_, rms_norm, rms_norm_quant

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
    Case("x_leading_dims_not_flat", lambda r: ((f32(r, (2, 6, N))[:, :3],), {}), ValueError,
         r"rms_norm: x leading dimensions must flatten to one row stride, "
         r"got strides \(48, 8, 1\)"),
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
         r"RMSNORM_HIP_BACKEND must be one of cuda, hip, cpu, sim, got 'bogus'",
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
         r"rms_norm_quant: quant_dtype must be 'int8' or 'float8_e4m3fn', got 'int4'", fn=RQ),
    Case("quant_dtype_uint8", lambda r: ((f32(r),), dict(quant_dtype=np.uint8)), ValueError,
         r"rms_norm_quant: quant_dtype must be 'int8' or 'float8_e4m3fn', got <class", fn=RQ),
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


def snapshot(args, kwargs):
    arrays = [a for a in list(args) + list(kwargs.values()) if isinstance(a, np.ndarray)]
    return [(a, a.copy()) for a in arrays]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_error(rng, monkeypatch, case):
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    args, kwargs = case.build(rng)
    before = snapshot(args, kwargs)

    with pytest.raises(case.exc, match=case.match):
        case.fn(*args, **kwargs)

    for i, (array, copy) in enumerate(before):
        assert_bitwise(array, copy, f"array argument {i} after the error")


def test_every_case_is_valid_once_fixed(rng):
    """The error cases are one defect away from a valid call: the same x with a good weight,
    eps and out runs (so each case tests its one defect, not a broken fixture)."""
    x = f32(rng)
    y = rms_norm(x, f32(rng, (N,)), 1e-6, weight_offset=1.0, out=f32(rng))
    assert np.isfinite(y).all()


def test_new_entry_points_valid_once_fixed(rng):
    """The fused and quantised cases' good twins run."""
    x, residual, w = f32(rng), f32(rng), f32(rng, (N,))
    y, ro = fused_add_rms_norm(x, residual, w, weight_offset=1.0)
    fused_add_rms_norm_(x.copy(), residual.copy(), w)
    q, yscale, ro2 = rms_norm_quant(x, w, xscale=f32(rng, (N,)), residual=residual,
                                    quant_dtype="float8_e4m3fn")
    assert np.isfinite(y).all() and np.isfinite(yscale).all() and q.shape == x.shape


def test_xscale_and_residual_from_another_library(rng):
    torch = pytest.importorskip("torch")
    x = f32(rng)
    with pytest.raises(ValueError, match=r"rms_norm_quant: xscale must come from the same array "
                                         r"library as x \(numpy\), got torch"):
        rms_norm_quant(x, xscale=torch.ones(N))
    with pytest.raises(ValueError, match=r"fused_add_rms_norm: residual must come from the same "
                                         r"array library as x \(numpy\), got torch"):
        fused_add_rms_norm(x, torch.ones(M, N))


def test_weight_from_another_library(rng):
    torch = pytest.importorskip("torch")
    x = f32(rng)
    w = torch.ones(N)
    x0 = x.copy()
    with pytest.raises(ValueError, match=r"rms_norm: weight must come from the same array "
                                         r"library as x \(numpy\), got torch"):
        rms_norm(x, w)
    with pytest.raises(ValueError, match=r"rms_norm: weight must come from the same array "
                                         r"library as x \(torch\), got numpy"):
        rms_norm(torch.from_numpy(x), np.ones(N, np.float32))
    assert_bitwise(x, x0, "x after the error")
    assert torch.equal(w, torch.ones(N))
