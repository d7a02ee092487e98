"""The public entry points (docs/api.md) over NumPy, CuPy, torch, ``__cuda_array_interface__`` and
DLPack arrays.  Validation happens here, before any launch; kernels run on the backend chosen by
:func:`rmsnorm_hip.backends.for_array`.

Repeat calls on torch / CuPy device arrays take a fast path: everything that depends only on the
arrays' metadata (validation, backend, kernel choice) is kept in a plan under the call's signature,
so a repeat call reads pointers, allocates its outputs and launches (a few microseconds).
"""
import os as _os

from . import _arrays, _dtypes, _quant, _validate, backends

__all__ = ["rms_norm", "rms_norm_backward", "fused_add_rms_norm", "fused_add_rms_norm_",
           "rms_norm_quant"]


_fwd_runners = {}
_bwd_runners = {}
_fused_runners = {}
_qk_runners = {}        # qk.py's
_gated_runners = {}     # gated.py's
_MAX_RUNNERS = 4096
_F32_MAX = _validate._FLOAT32_MAX


_ENV_DATA = getattr(_os.environ, "_data", None)    # os.environ's own dict (CPython)
_ENV_KEY = _os.environ.encodekey(backends.ENV) if _ENV_DATA is not None else None


def _backend_env():
    """RMSNORM_HIP_BACKEND as a repeat call's key sees it: a raw dict lookup (os.environ.get
    encodes the name and decodes the value, 0.7 us of a 15 us call)."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(_ENV_KEY)
    return _os.environ.get(backends.ENV)


def forget_plans():
    """Drop every memoised launch plan and repeat-call runner (compiled kernels stay cached), so
    that the next call chooses its kernel from kernels/_config as it is now: for tuning scripts
    and tests that patch the config in a running process."""
    for runners in (_fwd_runners, _bwd_runners, _fused_runners, _qk_runners, _gated_runners):
        runners.clear()
    for backend in list(backends._backends.values()):
        forget = getattr(backend, "forget_plans", None)
        if forget is not None:
            forget()


def rms_norm(x, weight=None, eps=1e-6, *, weight_offset=0.0, out=None, return_rstd=False,
             dtype=None):
    """Root-mean-square normalisation over the last dimension.

    ``y = x * rstd * (weight + weight_offset)``, ``rstd = 1 / sqrt(mean(x**2) + eps)`` per row,
    computed in float32 with one rounding to x's dtype.

    Parameters
    ----------
    x : array (..., N) of float32, float16 or bfloat16; rows may be strided (unit last stride).
    weight : array (N,) in x's dtype, or float32 for 16-bit x; None for no scaling.
    eps : finite float >= 0.
    weight_offset : added to weight (1.0 gives Gemma's ``1 + w``); must be 0 without weight.
    out : array like x to write y into: x itself, or memory sharing no element with x or
        weight (rows may be strided, e.g. the columns beside x in one wider buffer).  It is
        returned as y.
    return_rstd : also return the float32 (M,) rstd.
    dtype : "bfloat16" / "float16" to read uint16 storage (CuPy has no bfloat16); outputs
        of x's dtype then come back as uint16 storage too.

    Returns
    -------
    y, or (y, rstd) — in x's library and on x's device.
    """
    # return_rstd=1 would find the plan kept for True (equal keys): full validation refuses it
    if out is None and dtype is None and type(return_rstd) is bool:
        key = _arrays.fast_key(x, weight, (return_rstd, _backend_env()))
        if key is not None:
            run = _runner(_fwd_runners, key, eps, weight_offset, weight)
            if run is not None:
                return run(x, weight, eps, weight_offset)
            return _rms_norm(x, weight, eps, weight_offset, None, return_rstd, None, key)
    return _rms_norm(x, weight, eps, weight_offset, out, return_rstd, dtype, None)


def _runner(runners, key, eps, weight_offset, weight):
    """The repeat-call runner kept under ``key`` (None: no key) when this call's scalars let it
    run as they are, else None (full validation then raises or converts them)."""
    run = runners.get(key) if key is not None else None
    return run if run is not None and _plain_scalars(eps, weight_offset, weight) else None


def _keep_runner(runners, key, run):
    """Keep ``run`` under ``key``; serving sees many M, so each cache is bounded."""
    if len(runners) > _MAX_RUNNERS:
        runners.clear()
    runners[key] = run


def _plain_scalars(eps, weight_offset, weight):
    """Whether a repeat-call runner may take these scalars as they are (anything else goes
    through full validation, which raises or converts)."""
    return (type(eps) is float and 0.0 <= eps <= _F32_MAX and type(weight_offset) is float
            and -_F32_MAX <= weight_offset <= _F32_MAX
            and (weight is not None or weight_offset == 0.0))


def _rms_norm(x, weight, eps, weight_offset, out, return_rstd, dtype, plan_key):
    fn = "rms_norm"
    reinterpret, xi, m, n, x_stride = _rows_of_x(x, dtype, fn, heads=True)
    _validate.flag(return_rstd, fn, "return_rstd")
    wi = _vector_arg(weight, "weight", xi, n, reinterpret, fn)
    eps = _validate.eps(eps, fn)
    weight_offset = _validate.weight_offset(weight_offset, wi is not None, fn)
    backend = backends.for_array(xi, fn)

    yi = None if out is None else _arrays.describe(out, "out", reinterpret, fn)
    # rows at two strides (head rows of x or of out): the split of their leading dims
    split = _validate.row_split([xi, yi])
    heads = None
    if split is not None:
        m, n, (x_stride, x_head_stride), h = _validate.head_rows(xi, split, fn, "x")
        heads = (h, x_head_stride, n)
        plan_key = None
    if out is None:
        _, yi = _arrays.empty(xi, xi.shape, xi.dtype)
        y_stride = n if heads is None else h * n
    else:
        y_stride = _validate.output(yi, xi, xi.shape, xi.dtype, fn, "out", split=split)[2]
        if heads is not None:
            y_stride, heads = y_stride[0], (h, x_head_stride, y_stride[1])
        _validate.no_overlap(yi, [("x", xi), ("weight", wi)], fn, "out", allow_same=xi)
    ri = _arrays.empty(xi, (m,), _dtypes.FLOAT32)[1] if return_rstd else None

    if m > 0:
        backend.rms_norm_fwd(xi, wi, yi, ri, m, n, x_stride, y_stride, eps, weight_offset,
                             heads=heads)
    if plan_key is not None and hasattr(backend, "fwd_runner"):
        _keep_runner(_fwd_runners, plan_key, backend.fwd_runner(
            _arrays.FastIO(xi), xi.shape, m, n, x_stride, xi.dtype,
            wi.dtype if wi is not None else "", return_rstd))
    if out is None:
        y = yi.result()
    else:
        y = out
        _arrays.bump_versions(out)
    return (y, ri.result()) if return_rstd else y


def _rows_of_x(x, dtype, fn, heads=False):
    """The validation every entry point starts with: (reinterpret, x ArrayInfo, M, N, x row
    stride).  ``heads``: x may be rows at two strides (the caller then takes them from
    _validate.head_rows; the stride returned is None)."""
    reinterpret = _validate.reinterpret(dtype, fn)
    xi = _arrays.describe(x, "x", reinterpret, fn)
    _validate.activation_dtype(xi, fn, "x")
    _validate.reinterpreted(xi, reinterpret, fn)
    if heads and _validate.row_split([xi]) is not None:
        return reinterpret, xi, None, xi.shape[-1], None
    m, n, x_stride = _validate.rows(xi, fn, "x")
    return reinterpret, xi, m, n, x_stride


def _vector_arg(array, name, xi, n, reinterpret, fn):
    """ArrayInfo of a (N,) parameter (weight, xscale) in x's dtype or float32, or None."""
    if array is None:
        return None
    info = _arrays.describe(array, name, reinterpret, fn)
    _validate.vector(info, xi, n, fn, name, _validate.weight_dtypes(xi.dtype))
    return info


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, *, weight_offset=0.0,
                       return_rstd=False, dtype=None):
    """Residual add fused with RMS normalisation.

    ``residual_out = round(x + residual)`` (float32 add, one rounding to x's dtype);
    ``y = rms_norm(residual_out, weight, eps, weight_offset=weight_offset)``, bitwise.  x and
    residual are not modified.

    Parameters
    ----------
    x, residual : arrays (..., N) of the same shape and dtype (float32, float16, bfloat16) on
        the same device; rows may be strided, each with its own row stride.
    weight, eps, weight_offset, dtype : as for :func:`rms_norm`.
    return_rstd : also return the float32 (M,) rstd.

    Returns
    -------
    (y, residual_out), or (y, residual_out, rstd) — in x's library and on x's device.
    """
    fn = "fused_add_rms_norm"
    key = None
    if dtype is None and type(return_rstd) is bool:
        key = _arrays.fast_key(x, weight, (fn, return_rstd, _backend_env()),
                               (residual,))
        run = _runner(_fused_runners, key, eps, weight_offset, weight)
        if run is not None:
            y, residual_out, rstd, _ = run(x, residual, weight, None, eps, weight_offset)
            return (y, residual_out, rstd) if return_rstd else (y, residual_out)
    _validate.flag(return_rstd, fn, "return_rstd")
    _validate.required(residual, fn, "residual")
    y, residual_out, rstd, _ = _fused_forward(fn, x, residual, weight, eps, weight_offset, dtype,
                                              return_rstd=return_rstd, plan_key=key)
    return (y, residual_out, rstd) if return_rstd else (y, residual_out)


def fused_add_rms_norm_(x, residual, weight=None, eps=1e-6, *, weight_offset=0.0, dtype=None):
    """In-place :func:`fused_add_rms_norm` (vLLM's contract): ``residual <- round(x + residual)``,
    then ``x <- rms_norm(residual)``, in one pass with no temporaries; bitwise the out-of-place
    results.  x and residual must be writeable and share no element with each other or weight
    (they may be column slices of one wider buffer).
    Returns None."""
    fn = "fused_add_rms_norm_"
    key = None
    if dtype is None:
        key = _arrays.fast_key(x, weight, (fn, _backend_env()), (residual,))
        run = _runner(_fused_runners, key, eps, weight_offset, weight)
        # None: the arrays' spans meet, which full validation looks at
        if run is not None and run(x, residual, weight, None, eps, weight_offset) is not None:
            _arrays.bump_versions(x, residual)
            return
    _validate.required(residual, fn, "residual")
    _fused_forward(fn, x, residual, weight, eps, weight_offset, dtype, in_place=True,
                   plan_key=key)
    _arrays.bump_versions(x, residual)


def rms_norm_quant(x, weight=None, eps=1e-6, *, xscale=None, residual=None, quant_dtype="int8",
                   weight_offset=0.0, group_size=None, scale_format="float32",
                   scale_layout="row", scale=None, dtype=None):
    """RMS normalisation with quantisation: dynamic per token (SmoothQuant with ``xscale``), per
    group of columns, static, or the MX formats (docs/api.md has every formula).

    ``h = round(x + residual)`` when residual is given, else x;
    ``y = h * rstd * (weight + weight_offset) * xscale`` in float32, never rounded;
    ``yscale[row] = max|y[row]| / QMAX`` (1.0 for an all-zero row);
    ``q = clamp(rne(y * (1 / yscale)), -QMAX, QMAX)``, QMAX = 127 (int8) or 448 (float8_e4m3fn,
    round-to-nearest-even, saturating).  A row holding NaN/Inf gets an unspecified q and yscale;
    other rows are unaffected.

    Parameters
    ----------
    x : array (..., N) of float32, float16 or bfloat16; rows may be strided.
    weight, eps, weight_offset, dtype : as for :func:`rms_norm`.
    xscale : (N,) SmoothQuant scale, float32 or x's dtype; None for none.
    residual : array like x; when given, h = round(x + residual) is normalised and returned as
        residual_out (residual itself is not modified).
    quant_dtype : "int8" or "float8_e4m3fn" (NumPy / ml_dtypes / torch dtypes of those names
        are accepted too), or "mxfp8_e4m3" / "mxfp4_e2m1": OCP MX blocks of 32 columns sharing
        an E8M0 scale (e = floor(log2(max|y|)) - emax, clamped; elements rne(y / 2**e),
        saturated).
    group_size : one scale per group of this many columns (a power of two, 16 to 128, dividing
        N); yscale (M, N // group_size).
    scale_format : "float32" (max|y| / QMAX) or "ue8m0" (rounded up to a power of two).
    scale_layout : "row", or "column": yscale column-major, its columns padded to a multiple of
        4 rows (DeepGEMM's layout).
    scale : static quantisation, q = clamp(rne(y / scale)): a positive number or a float32
        array of one element on x's device.

    Returns
    -------
    (q, yscale), or (q, yscale, residual_out) when residual is given (static: q, or
    (q, residual_out)).  q has x's shape: int8, or float8_e4m3fn (``ml_dtypes.float8_e4m3fn``
    for NumPy, ``torch.float8_e4m3fn`` for torch, uint8 bits for CuPy and other
    ``__cuda_array_interface__`` arrays); MX: uint8 e4m3fn bits, or fp4 pairs (..., N // 2),
    with uint8 E8M0 scales (M, N // 32) (torch: float8_e4m3fn / float4_e2m1fn_x2 and
    float8_e8m0fnu).  yscale is float32 (M,), or (M, N // group_size).
    """
    fn = "rms_norm_quant"
    key = None
    if _quant.wants_scaled(quant_dtype, group_size, scale_format, scale_layout, scale):
        static_number = _quant.is_number(scale)
        if dtype is None and all(type(a).__hash__ is not None
                                 for a in (quant_dtype, scale_format, scale_layout)):
            # the argument types key too: 128.0 for group_size must meet full validation
            key = _arrays.fast_key(x, weight, (
                fn, quant_dtype, group_size, type(group_size), scale_format, type(scale_format),
                scale_layout, type(scale_layout), static_number, _backend_env()),
                (residual, xscale) + ((scale,) if not static_number else ()))
            run = _runner(_fused_runners, key, eps, weight_offset, weight)
            if run is not None:
                return run(x, residual, weight, xscale, eps, weight_offset, scale)
        quant = _validate.quant_dtype(quant_dtype, fn)
        return _quant.rms_norm_quant_scaled(fn, x, weight, eps, xscale, residual, quant,
                                            weight_offset, group_size, scale_format,
                                            scale_layout, scale, dtype, plan_key=key)
    if dtype is None and type(quant_dtype).__hash__ is not None:
        key = _arrays.fast_key(x, weight, (fn, quant_dtype, _backend_env()),
                               (residual, xscale))
        run = _runner(_fused_runners, key, eps, weight_offset, weight)
        if run is not None:
            q, residual_out, _, yscale = run(x, residual, weight, xscale, eps, weight_offset)
            return (q, yscale) if residual is None else (q, yscale, residual_out)
    quant = _validate.quant_dtype(quant_dtype, fn)
    q, residual_out, _, yscale = _fused_forward(fn, x, residual, weight, eps, weight_offset, dtype,
                                                xscale=xscale, quant=quant, plan_key=key)
    return (q, yscale) if residual is None else (q, yscale, residual_out)


def _fused_forward(fn, x, residual, weight, eps, weight_offset, dtype, *, return_rstd=False,
                   in_place=False, xscale=None, quant="", plan_key=None):
    """Validate, allocate and launch the forward's fused variants; (y or q, residual_out, rstd,
    yscale) in the caller's library, each None where absent (in place: x and residual).  With
    a ``plan_key`` (torch / CuPy device arrays), the call's repeat-call runner is kept under
    it."""
    reinterpret, xi, m, n, x_stride = _rows_of_x(x, dtype, fn)
    ri, r_stride = None, n
    if residual is not None:
        ri = _arrays.describe(residual, "residual", reinterpret, fn)
        _, _, r_stride = _validate.output(ri, xi, xi.shape, xi.dtype, fn, "residual",
                                          writeable=in_place)
    wi = _vector_arg(weight, "weight", xi, n, reinterpret, fn)
    si = _vector_arg(xscale, "xscale", xi, n, reinterpret, fn)
    eps = _validate.eps(eps, fn)
    weight_offset = _validate.weight_offset(weight_offset, wi is not None, fn)
    if in_place:
        if xi.readonly:
            raise ValueError(f"{fn}: x must be writeable, got a read-only array")
        note = "the arrays written in place must not share memory with another argument"
        _validate.no_overlap(ri, [("x", xi), ("weight", wi)], fn, "residual", note=note)
        _validate.no_overlap(xi, [("weight", wi)], fn, "x", note=note)
    backend = backends.for_array(xi, fn)

    if in_place:
        yi, y_stride, roi, ro_stride = xi, x_stride, ri, r_stride
    else:
        yi, y_stride = _arrays.empty(xi, xi.shape, quant or xi.dtype)[1], n
        roi, ro_stride = (_arrays.empty(xi, xi.shape, xi.dtype)[1] if ri is not None else None), n
    rstd_i = _arrays.empty(xi, (m,), _dtypes.FLOAT32)[1] if return_rstd else None
    yscale_i = _arrays.empty(xi, (m,), _dtypes.FLOAT32)[1] if quant else None

    strides = (x_stride, r_stride, y_stride, ro_stride)
    if m > 0:
        backend.rms_norm_fused_fwd(xi, ri, wi, si, yi, roi, rstd_i, yscale_i, m, n, strides, eps,
                                   weight_offset, quant)
    if plan_key is not None and hasattr(backend, "fused_runner"):
        _keep_runner(_fused_runners, plan_key, backend.fused_runner(
            _arrays.FastIO(xi), xi.shape, m, n, strides, xi.dtype,
            wi.dtype if wi is not None else "", si.dtype if si is not None else "",
            ri is not None, quant, return_rstd, in_place))
    if in_place:
        return None, None, None, None
    return tuple(None if info is None else info.result() for info in (yi, roi, rstd_i, yscale_i))


def rms_norm_backward(dy, x, weight=None, rstd=None, *, weight_offset=0.0, dresidual=None,
                      deterministic=True, eps=1e-6, dtype=None):
    """Gradients of :func:`rms_norm`: ``(dx, dweight)``.

    ``x_hat = x * rstd``, ``wdy = dy * (weight + weight_offset)``,
    ``dx = (wdy - x_hat * mean(x_hat * wdy)) * rstd [+ dresidual]`` (one rounding to x's dtype),
    ``dweight = sum over rows of dy * x_hat`` (float32 accumulation, weight's dtype).

    Parameters
    ----------
    dy, x : arrays (..., N) of one dtype (float32, float16, bfloat16); rows may be strided.
    weight : (N,) in x's dtype or float32; None: no scaling and no dweight.
    rstd : float32 (M,) from the forward; None recomputes it from x with ``eps``.
    dresidual : like x; the gradient reaching a fused add's ``residual_out``, added into dx.
    deterministic : True (default): dweight is bitwise identical from run to run on the same
        device (per-program float32 partials and a fixed-order column reduction).  False lets a
        float32 weight's dweight be summed by float32 atomics where that measured faster (CUDA,
        aligned rows: few rows, or many rows a program; _config.bwd_atomic_dweight): the same
        float32 sums in an unspecified order, so dweight may differ by roundings from run to
        run.  dx is the same bits either way.
    dtype : "bfloat16" / "float16" to read uint16 storage (CuPy).

    Returns
    -------
    (dx, dweight) — dx shaped like x in x's library; dweight (N,) in weight's dtype (zeros
    when M == 0), or None without weight.
    """
    if dtype is None:
        key = _arrays.fast_key(x, weight, (_backend_env(), deterministic is False),
                               (dy, rstd, dresidual))
        if key is not None:
            run = _runner(_bwd_runners, key, eps, weight_offset, weight)
            if run is not None and type(deterministic) is bool:
                return run(dy, x, weight, rstd, dresidual, eps, weight_offset)
            return _rms_norm_backward(dy, x, weight, rstd, weight_offset, dresidual,
                                      deterministic, eps, None, key)
    return _rms_norm_backward(dy, x, weight, rstd, weight_offset, dresidual, deterministic, eps,
                              dtype, None)


def _rms_norm_backward(dy, x, weight, rstd, weight_offset, dresidual, deterministic, eps, dtype,
                       plan_key):
    fn = "rms_norm_backward"
    reinterpret, xi, m, n, x_stride = _rows_of_x(x, dtype, fn, heads=True)
    dyi = _arrays.describe(dy, "dy", reinterpret, fn)
    dri = None
    if dresidual is not None:
        dri = _arrays.describe(dresidual, "dresidual", reinterpret, fn)
    # rows at two strides (head rows of x, dy or dresidual): the split of their leading dims
    split = _validate.row_split([xi, dyi, dri])
    if split is not None:
        m, n, (x_stride, x_head_stride), h = _validate.head_rows(xi, split, fn, "x")
        plan_key = None
    dy_stride = _validate.like_x(dyi, xi, fn, "dy", split)
    wi = _vector_arg(weight, "weight", xi, n, reinterpret, fn)
    ri = None
    if rstd is not None:
        ri = _arrays.describe(rstd, "rstd", None, fn)
        _validate.vector(ri, xi, m, fn, "rstd", (_dtypes.FLOAT32,))
    dres_stride = n if split is None else (h * n, n)
    if dri is not None:
        dres_stride = _validate.like_x(dri, xi, fn, "dresidual", split)
    heads = None
    if split is not None:   # (H, head strides of dy, x, dresidual, dx); dx is contiguous
        heads = (h, dy_stride[1], x_head_stride, dres_stride[1], n)
        dy_stride, dres_stride = dy_stride[0], dres_stride[0]
    weight_offset = _validate.weight_offset(weight_offset, wi is not None, fn)
    eps = _validate.eps(eps, fn)
    _validate.flag(deterministic, fn, "deterministic")
    backend = backends.for_array(xi, fn)

    _, dxi = _arrays.empty(xi, xi.shape, xi.dtype)
    dwi = None
    if wi is not None:
        dwi = (_arrays.zeros if m == 0 else _arrays.empty)(xi, (n,), wi.dtype)[1]
    strides = (dy_stride, x_stride, dres_stride, n if heads is None else h * n)
    if m > 0:
        backend.rms_norm_bwd(
            dyi, xi, wi, ri, dri, dxi, dwi, m, n, strides, eps, weight_offset,
            lambda shape: _arrays.empty(xi, shape, _dtypes.FLOAT32)[1],
            deterministic, _arrays.zero_fill, heads=heads)
        if plan_key is not None and hasattr(backend, "bwd_runner"):
            _keep_runner(_bwd_runners, plan_key, backend.bwd_runner(
                _arrays.FastIO(xi), xi.shape, m, n, strides, xi.dtype,
                wi.dtype if wi is not None else "", ri is not None, dri is not None,
                deterministic))
    return dxi.result(), (dwi.result() if dwi is not None else None)
