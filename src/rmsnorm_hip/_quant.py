"""rms_norm_quant's scaled formats (docs/api.md): one scale per group of columns (float32 or
UE8M0 powers of two, rows or DeepGEMM's column-major layout), a static scale, and the OCP MX
formats MXFP8 / MXFP4.  Validation and allocation happen here, before any launch; the kernels are
the quantised forward's row body (kernels/rmsnorm_fwd.py, FwdSpec.scaling)."""
import math
import sys

import numpy as np

from . import _arrays, _dtypes, _validate, backends
from .kernels import _config

MX_FORMATS = _dtypes.MX_DTYPES
SCALE_FORMATS = ("float32", "ue8m0")
SCALE_LAYOUTS = ("row", "column")
COLUMN_PAD = 4      # the column-major scales' column stride: M rounded up to this (DeepGEMM)
# torch dtypes of the MX outputs, where the caller's torch has them (else uint8 bits)
_TORCH_VIEWS = {"q" + _dtypes.MXFP8: "float8_e4m3fn", "q" + _dtypes.MXFP4: "float4_e2m1fn_x2",
                "scales": "float8_e8m0fnu"}


def wants_scaled(quant, group_size, scale_format, scale_layout, scale):
    """Whether an rms_norm_quant call asks for anything but the per-row dynamic scale."""
    return (quant in _dtypes.MX_DTYPES or group_size is not None or scale is not None
            or not (isinstance(scale_format, str) and scale_format == "float32")
            or not (isinstance(scale_layout, str) and scale_layout == "row"))


def rms_norm_quant_scaled(fn, x, weight, eps, xscale, residual, quant, weight_offset, group_size,
                          scale_format, scale_layout, scale, dtype, plan_key=None):
    """rms_norm_quant with group scales, a static scale or an MX format: (q, scales) or
    (q, scales, residual_out); static: q or (q, residual_out).  With a ``plan_key`` (torch /
    CuPy device arrays), the call's repeat-call runner is kept under it (:func:`runner`)."""
    from .functional import _rows_of_x, _vector_arg
    reinterpret, xi, m, n, x_stride = _rows_of_x(x, dtype, fn)
    scaling, group = scheme(fn, quant, n, group_size, scale_format, scale_layout, scale)
    ri, r_stride = None, n
    if residual is not None:
        ri = _arrays.describe(residual, "residual", reinterpret, fn)
        r_stride = _validate.output(ri, xi, xi.shape, xi.dtype, fn, "residual",
                                    writeable=False)[2]
    wi = _vector_arg(weight, "weight", xi, n, reinterpret, fn)
    si = _vector_arg(xscale, "xscale", xi, n, reinterpret, fn)
    eps = _validate.eps(eps, fn)
    weight_offset = _validate.weight_offset(weight_offset, wi is not None, fn)
    static = scaling == "static"
    scales_i, scale_value = _static_scale(scale, xi, fn) if static else (None, 0.0)
    backend = backends.for_array(xi, fn)

    fp4 = quant == _dtypes.MXFP4
    q_shape = xi.shape[:-1] + ((n // 2,) if fp4 else (n,))
    q_dtype = _dtypes.UINT8 if quant in _dtypes.MX_DTYPES else quant
    q, qi = _arrays.empty(xi, q_shape, q_dtype)
    roi = _arrays.empty(xi, xi.shape, xi.dtype)[1] if ri is not None else None
    scales = None
    scale_strides = (0, 0)
    if not static:
        groups = n // group
        scale_dtype = _dtypes.UINT8 if scaling == "mx" else _dtypes.FLOAT32
        if scale_layout == "column":
            scales, scales_i, scale_strides = _column_major(xi, m, groups, scale_dtype, fn)
        else:
            scales, scales_i = _arrays.empty(xi, (m, groups), scale_dtype)
            scale_strides = (groups, 1)
    if m > 0:
        strides = (x_stride, r_stride, q_shape[-1], n)
        backend.rms_norm_quant_fwd(xi, ri, wi, si, qi, roi, scales_i, m, n, strides,
                                   scale_strides, eps, weight_offset, quant, scaling, group,
                                   scale_value)
    if plan_key is not None and hasattr(backend, "quant_scaled_launcher"):
        from .functional import _fused_runners, _keep_runner
        _keep_runner(_fused_runners, plan_key, runner(
            backend, _arrays.FastIO(xi), xi.shape, q_shape, q_dtype, m, n, strides,
            scale_strides, xi.dtype, wi, si, ri is not None, quant, scaling, group,
            scale_layout, fn, static_array=static and scales_i is not None))
    return _outputs(qi.result(), None if static else (
        scales if scale_layout == "column" else scales_i.result()),
        roi.result() if roi is not None else None, quant, scaling)


def _outputs(q, scales, residual_out, quant, scaling):
    """The call's return value: q, its scales unless static, residual_out when given; torch
    callers' MX outputs in torch's own dtypes."""
    out = (_torch_view(q, "q" + quant),)
    if scales is not None:
        out += (_torch_view(scales, "scales" if scaling == "mx" else ""),)
    if residual_out is not None:
        out += (residual_out,)
    return out[0] if len(out) == 1 else out


def runner(backend, io, shape, q_shape, q_dtype, m, n, strides, scale_strides, dtype, wi, si,
           has_residual, quant, scaling, group, scale_layout, fn, static_array=False):
    """``run(x, residual, weight, xscale, eps, weight_offset, scale)`` for repeat calls of a
    scaled format with this metadata: the kernels, output shapes and strides are decided here,
    once.  A static scale given as a number is still checked every call; one given as an array
    (``static_array``: its metadata is in the runner's key) is read by the kernel."""
    launch = backend.quant_scaled_launcher(
        io, m, n, strides, scale_strides, dtype, wi.dtype if wi is not None else "",
        si.dtype if si is not None else "", has_residual, quant, scaling, group)
    static = scaling == "static"
    alloc_q = io.allocator(q_shape, q_dtype)
    alloc_ro = io.like_allocator(shape, dtype, strides[0] == n) if has_residual else None
    alloc_scales = None
    column = scale_layout == "column"
    if not static:
        scale_dtype = _dtypes.UINT8 if scaling == "mx" else _dtypes.FLOAT32
        alloc_scales = io.allocator((n // group, scale_strides[1]) if column else (m, n // group),
                                    scale_dtype)

    def run(x, residual, weight, xscale, eps, weight_offset, scale):
        value = scale_number(scale, fn) if static and not static_array else 0.0
        q = alloc_q()
        residual_out = alloc_ro(x) if alloc_ro is not None else None
        buffer = alloc_scales() if alloc_scales is not None else None
        if m:
            launch(x, residual, weight, xscale, q, residual_out,
                   scale if static_array else buffer, eps, weight_offset, value)
        scales = None if buffer is None else (buffer[:, :m].T if column else buffer)
        return _outputs(q, scales, residual_out, quant, scaling)

    return run


def scheme(fn, quant, n, group_size, scale_format, scale_layout, scale):
    """(FwdSpec.scaling, group) of a call, after checking its arguments agree."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"{fn}: scale_format must be 'float32' or 'ue8m0', got "
                         f"{scale_format!r}")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{fn}: scale_layout must be 'row' or 'column', got {scale_layout!r}")
    group = None if group_size is None else _group(group_size, n, fn)
    if quant in _dtypes.MX_DTYPES:
        block = _dtypes.MX_BLOCK
        if n % block:
            raise ValueError(f"{fn}: quant_dtype={quant!r} quantises blocks of {block} "
                             f"columns: N must be a multiple of {block}, got N = {n}")
        if group not in (None, block):
            raise ValueError(f"{fn}: quant_dtype={quant!r} has blocks of {block} columns, "
                             f"got group_size={group_size!r}")
        if scale is not None or scale_format != "float32" or scale_layout != "row":
            raise ValueError(f"{fn}: quant_dtype={quant!r} has its own E8M0 scales per block: "
                             f"scale, scale_format and scale_layout do not apply, got "
                             f"scale={_short(scale)}, scale_format={scale_format!r}, "
                             f"scale_layout={scale_layout!r}")
        return "mx", block
    if scale is not None:
        if group is not None or scale_format != "float32" or scale_layout != "row":
            raise ValueError(f"{fn}: a static scale quantises the whole tensor: group_size, "
                             f"scale_format and scale_layout do not apply, got group_size="
                             f"{group_size!r}, scale_format={scale_format!r}, scale_layout="
                             f"{scale_layout!r}")
        return "static", 0
    if group is None:
        given = [f"{name}={value!r}" for name, value, default in (
            ("scale_format", scale_format, "float32"), ("scale_layout", scale_layout, "row"))
            if value != default]
        raise ValueError(f"{fn}: {' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} "
                         f"to group scales: give group_size")
    return ("ue8m0" if scale_format == "ue8m0" else "group"), group


def _group(value, n, fn):
    lo, hi = _config.QUANT_GROUP_MIN, _config.QUANT_GROUP_MAX
    message = (f"{fn}: group_size must be a power of two from {lo} to {hi} that divides N = "
               f"{n}, got {value!r}")
    size = _validate.integer(value)
    if size is None:
        raise TypeError(message)
    if not lo <= size <= hi or size & (size - 1) or n % size:
        raise ValueError(message)
    return size


def _short(value):
    return type(value).__name__ if hasattr(value, "shape") else repr(value)


_F32_MAX, _F32_TINY = 3.4028234663852886e38, 2.0 ** -149


def is_number(value):
    return (isinstance(value, (int, float, np.floating, np.integer))
            and not isinstance(value, bool))


def scale_number(scale, fn):
    """A static scale given as a number, as the float the kernel takes by value (positive and
    finite in float32)."""
    if not is_number(scale):
        raise TypeError(f"{fn}: scale must be a number or a float32 array of one element, got "
                        f"{type(scale).__name__}")
    try:
        value = float(scale)    # plain Python (torch.compile traces this): no NumPy casts
    except OverflowError:
        value = math.inf
    if not (math.isfinite(value) and _F32_TINY <= value <= _F32_MAX):
        raise ValueError(f"{fn}: scale must be a positive finite float32, got {scale!r}")
    return value


def _static_scale(scale, xi, fn):
    """(ArrayInfo or None, value) of a static scale: a positive finite number goes to the
    kernel by value (nothing on the device, so nothing a CUDA graph holds can go away), a
    float32 array of one element on x's device is read by the kernel (its value is the
    caller's to keep positive and finite: reading it would wait for the device)."""
    if is_number(scale) or isinstance(scale, (bool, np.bool_)):    # a bool: refused as one
        return None, scale_number(scale, fn)
    info = _arrays.describe(scale, "scale", None, fn)
    _validate.same_place(info, xi, fn, "scale")
    if info.dtype != _dtypes.FLOAT32:
        raise TypeError(f"{fn}: scale must be a number or a float32 array of one element, "
                        f"got a {info.dtype} array")
    if math.prod(info.shape) != 1:
        raise ValueError(f"{fn}: scale must be a number or a float32 array of one element, "
                         f"got shape {tuple(info.shape)}")
    return info, 0.0


def _column_major(xi, m, groups, dtype, fn):
    """(scales, ArrayInfo of its buffer, (row, group) strides): (M, groups) scales stored
    column-major, each column M rounded up to COLUMN_PAD elements."""
    pad = -(-m // COLUMN_PAD) * COLUMN_PAD
    if xi.lib not in ("numpy", "torch", "cupy") and not _arrays.simulated():
        raise ValueError(f"{fn}: scale_layout='column' returns a strided view of a padded "
                         f"buffer, which NumPy, CuPy and torch arrays can be; x is a {xi.lib} "
                         f"array")
    buf, info = _arrays.empty(xi, (groups, pad), dtype)
    if isinstance(buf, _arrays.SimulatedDeviceArray):
        view = _arrays.SimulatedDeviceArray(buf.array[:, :m].T)
    else:
        view = buf[:, :m].T
    return view, info, (1, pad)


def torch_dtype(torch, what):
    """The torch dtype of an MX output ("q" + format, "scales"): torch's own where it has it,
    else uint8 (its bits); None for other outputs."""
    name = _TORCH_VIEWS.get(what)
    return None if name is None else getattr(torch, name, torch.uint8)


def _torch_view(array, what):
    """A torch caller's MX outputs in torch's own dtypes, where its torch has them."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(array, torch.Tensor):
        return array
    dtype = torch_dtype(torch, what)
    return array if dtype is None else array.view(dtype)
