"""Gated RMSNorm entry points (docs/api.md): Mamba 2's ``RMSNormGated``, a norm gated by
``silu(z)`` before or after it, optionally over groups of columns.  Validation happens here,
before any launch; the forward is the shared row kernel (kernels/rmsnorm_fwd.py, FwdSpec.gate),
the backward kernels/gated_bwd.py."""

from . import _arrays, _dtypes, _validate, backends
from .functional import (_backend_env, _gated_runners, _keep_runner, _rows_of_x, _runner,
                         _vector_arg)

__all__ = ["rms_norm_gated", "rms_norm_gated_backward"]


def rms_norm_gated(x, z, weight=None, eps=1e-6, *, group_size=None, norm_before_gate=False,
                   weight_offset=0.0, out=None, return_rstd=False, dtype=None):
    """Gated RMS normalisation over the last dimension (Mamba 2's ``RMSNormGated``), in float32
    with one rounding to x's dtype:

    - ``norm_before_gate=False``: ``y = rms_norm(x * silu(z)) * (weight + weight_offset)``
      (``x * silu(z)`` is not rounded before the norm);
    - ``norm_before_gate=True``: ``y = rms_norm(x) * (weight + weight_offset) * silu(z)``.

    ``group_size`` (dividing N): each group of that many columns is normalised on its own, with
    its slice of the weight.  ``z`` is like x (rows may be strided); ``out=`` as in
    :func:`rmsnorm_hip.rms_norm` (it may be x); ``dtype``: "bfloat16" / "float16" to read uint16
    storage, as everywhere.  Returns y, or ``(y, rstd)`` with rstd float32 (M,), or (M, N //
    group_size) with groups."""
    fn = "rms_norm_gated"
    key = None
    if out is None and dtype is None and type(return_rstd) is bool and type(
            norm_before_gate) is bool and (group_size is None or type(group_size) is int):
        key = _arrays.fast_key(x, weight, (group_size, norm_before_gate, return_rstd,
                                           _backend_env()), (z,))
        run = _runner(_gated_runners, key, eps, weight_offset, weight)
        if run is not None:
            y, rstd = run(x, z, weight, eps, weight_offset)
            return (y, rstd) if return_rstd else y
    reinterpret, xi, m, n, x_stride = _rows_of_x(x, dtype, fn)
    _validate.required(z, fn, "z")
    zi = _arrays.describe(z, "z", reinterpret, fn)
    z_stride = _validate.like_x(zi, xi, fn, "z")
    _validate.flag(return_rstd, fn, "return_rstd")
    _validate.flag(norm_before_gate, fn, "norm_before_gate")
    g = _group_size(group_size, n, fn)
    wi = _vector_arg(weight, "weight", xi, n, reinterpret, fn)
    eps = _validate.eps(eps, fn)
    weight_offset = _validate.weight_offset(weight_offset, wi is not None, fn)
    backend = backends.for_array(xi, fn)
    if out is None:
        yi, y_stride = _arrays.empty(xi, xi.shape, xi.dtype)[1], n
    else:
        yi = _arrays.describe(out, "out", reinterpret, fn)
        y_stride = _validate.output(yi, xi, xi.shape, xi.dtype, fn, "out")[2]
        _validate.no_overlap(yi, [("x", xi), ("z", zi), ("weight", wi)], fn, "out",
                             allow_same=xi)
    groups = n // g
    stat_shape = (m,) if group_size is None else (m, groups)
    ri = _arrays.empty(xi, stat_shape, _dtypes.FLOAT32)[1] if return_rstd else None
    gate = "output" if norm_before_gate else "input"
    if m > 0:
        backend.rms_norm_gated_fwd(xi, zi, wi, yi, ri, m * groups, g,
                                   (x_stride, z_stride, y_stride), (groups, g, g, g), eps,
                                   weight_offset, gate)
    if key is not None and hasattr(backend, "gated_runner"):
        _keep_runner(_gated_runners, key, backend.gated_runner(
            _arrays.FastIO(xi), xi.shape, m * groups, g, (x_stride, z_stride, y_stride),
            (groups, g, g, g), xi.dtype, wi.dtype if wi is not None else "", return_rstd,
            stat_shape, gate))
    if out is None:
        y = yi.result()
    else:
        y = out
        _arrays.bump_versions(out)
    return (y, ri.result()) if return_rstd else y


def _group_size(value, n, fn):
    """The columns normalised together: N for None, else a divisor of N (any integer type)."""
    if value is None:
        return n
    message = f"{fn}: group_size must be None or an integer dividing N = {n}, got {value!r}"
    size = _validate.integer(value)
    if size is None:
        raise TypeError(message)
    if size < 1 or n % size:
        raise ValueError(message)
    return size



def rms_norm_gated_backward(dy, x, z, weight=None, rstd=None, *, group_size=None,
                            norm_before_gate=False, weight_offset=0.0, deterministic=True,
                            eps=1e-6, dtype=None):
    """Gradients of :func:`rms_norm_gated`: ``(dx, dz, dweight)`` (dweight None without weight),
    dx and dz shaped like x in x's library, dweight (N,) in weight's dtype.  ``rstd``: the
    forward's float32 statistics ((M,), or (M, N // group_size)); None recomputes them from x
    and z with ``eps``.  dweight is a float32 sum over fixed partial rows in a fixed order
    (bitwise the same from run to run; ``deterministic=False`` changes nothing)."""
    fn = "rms_norm_gated_backward"
    reinterpret, xi, m, n, x_stride = _rows_of_x(x, dtype, fn)
    strides = []
    infos = []
    for name, a in (("dy", dy), ("z", z)):
        _validate.required(a, fn, name)
        info = _arrays.describe(a, name, reinterpret, fn)
        strides.append(_validate.like_x(info, xi, fn, name))
        infos.append(info)
    dyi, zi = infos
    _validate.flag(norm_before_gate, fn, "norm_before_gate")
    _validate.flag(deterministic, fn, "deterministic")
    g = _group_size(group_size, n, fn)
    groups = n // g
    wi = _vector_arg(weight, "weight", xi, n, reinterpret, fn)
    ri = None
    if rstd is not None:
        ri = _arrays.describe(rstd, "rstd", None, fn)
        want = (m,) if group_size is None else (m, groups)
        _validate.same_place(ri, xi, fn, "rstd")
        if ri.dtype != _dtypes.FLOAT32:
            raise TypeError(f"{fn}: rstd must have dtype float32, got {ri.dtype}")
        if tuple(ri.shape) != want or not _validate.dense(ri):
            raise ValueError(f"{fn}: rstd must be a contiguous array of shape {want}, "
                             f"got shape {tuple(ri.shape)} strides {ri.strides}")
    weight_offset = _validate.weight_offset(weight_offset, wi is not None, fn)
    eps = _validate.eps(eps, fn)
    backend = backends.for_array(xi, fn)
    dxi = _arrays.empty(xi, xi.shape, xi.dtype)[1]
    dzi = _arrays.empty(xi, xi.shape, xi.dtype)[1]
    dwi = None
    if wi is not None:
        dwi = (_arrays.zeros if m == 0 else _arrays.empty)(xi, (n,), wi.dtype)[1]
    if m > 0:
        backend.rms_norm_gated_bwd(
            dyi, xi, zi, wi, ri, dxi, dzi, dwi, m, groups, g,
            (strides[0], x_stride, strides[1], n, n), eps, weight_offset,
            "output" if norm_before_gate else "input",
            lambda shape: _arrays.empty(xi, shape, _dtypes.FLOAT32)[1])
    return dxi.result(), dzi.result(), (dwi.result() if dwi is not None else None)

