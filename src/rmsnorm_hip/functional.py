"""The public entry points of API.md over NumPy, CuPy, torch, ``__cuda_array_interface__`` and
DLPack arrays.  Validation happens here, before any launch; kernels run on the backend chosen by
:func:`rmsnorm_hip.backends.for_array`.

Repeat calls on torch / CuPy device arrays take a fast path: everything that depends only on the
arrays' metadata (validation, backend, kernel choice) is kept in a plan under the call's signature,
so a repeat call reads pointers, allocates its outputs and launches (a few microseconds).
"""
import math
from dataclasses import dataclass

from . import _arrays, _dtypes, _validate, backends

__all__ = ["rms_norm"]


@dataclass(frozen=True)
class _FwdPlan:
    adapter: object
    backend: object
    kernels: object
    m: int
    x_stride: int
    alloc_y: object
    alloc_rstd: object
    device_index: int


_fwd_plans = {}
_MAX_PLANS = 4096


def rms_norm(x, weight=None, eps=1e-6, *, weight_offset=0.0, out=None, return_rstd=False,
             dtype=None):
    """Root-mean-square normalisation over the last dimension.

    ``y = x * rstd * (weight + weight_offset)``, ``rstd = 1 / sqrt(mean(x**2) + eps)`` per row,
    computed in float32 with one rounding to x's dtype.

    Parameters
    ----------
    x : array (..., N) of float32, float16 or bfloat16; rows may be strided (unit last stride).
    weight : array (N,) in x's dtype, or float32 for 16-bit x; None for no scaling.
    eps : float >= 0.
    weight_offset : added to weight (1.0 gives Gemma's ``1 + w``); must be 0 without weight.
    out : array like x to write y into (may be x itself; rows may be strided).
    return_rstd : also return the float32 (M,) rstd.
    dtype : "bfloat16" / "float16" to read uint16 storage (CuPy has no bfloat16).

    Returns
    -------
    y, or (y, rstd) — in x's library and on x's device.
    """
    if out is None and dtype is None:
        adapter = _arrays.fast_adapter(x)
        if adapter is not None:
            key = (adapter.signature(x),
                   None if weight is None else _arrays.signature_of(weight), return_rstd)
            plan = _fwd_plans.get(key)
            if plan is not None and _fast_scalars_ok(eps, weight_offset, weight):
                return _run_fwd_plan(plan, x, weight, eps, weight_offset, return_rstd)
            result = _rms_norm(x, weight, eps, weight_offset, None, return_rstd, None, key)
            return result
    return _rms_norm(x, weight, eps, weight_offset, out, return_rstd, dtype, None)


def _fast_scalars_ok(eps, weight_offset, weight):
    """Scalars the plan path may take as they are; anything else goes through full validation."""
    return (type(eps) is float and 0.0 <= eps < math.inf and type(weight_offset) is float
            and math.isfinite(weight_offset) and (weight is not None or weight_offset == 0.0))


def _run_fwd_plan(plan, x, weight, eps, weight_offset, return_rstd):
    ptr = plan.adapter.ptr
    y = plan.alloc_y()
    rstd = plan.alloc_rstd() if return_rstd else None
    if plan.m:
        plan.backend.launch_fwd(plan.kernels, ptr(x), 0 if weight is None else ptr(weight), ptr(y),
                                0 if rstd is None else ptr(rstd), plan.m, plan.x_stride,
                                eps, weight_offset, plan.adapter.stream(plan.device_index))
    return (y, rstd) if return_rstd else y


def _rms_norm(x, weight, eps, weight_offset, out, return_rstd, dtype, plan_key):
    fn = "rms_norm"
    reinterpret = _validate.reinterpret(dtype, fn)
    xi = _arrays.describe(x, "x", reinterpret)
    _validate.activation_dtype(xi, fn, "x")
    m, n, x_stride = _validate.rows(xi, fn, "x")
    wi = None
    if weight is not None:
        wi = _arrays.describe(weight, "weight", reinterpret)
        _validate.vector(wi, xi, n, fn, "weight", _validate.weight_dtypes(xi.dtype))
    eps = _validate.eps(eps, fn)
    weight_offset = _validate.weight_offset(weight_offset, wi is not None, fn)
    backend = backends.for_array(xi, fn)

    if out is None:
        _, yi = _arrays.empty(xi, xi.shape, xi.dtype)
        y_stride = n
    else:
        yi = _arrays.describe(out, "out", reinterpret)
        _, _, y_stride = _validate.output(yi, xi, xi.shape, xi.dtype, fn, "out")
        _validate.no_overlap(yi, [("x", xi), ("weight", wi)], fn, "out", allow_same=xi)
    ri = _arrays.empty(xi, (m,), _dtypes.FLOAT32)[1] if return_rstd else None

    if m > 0:
        backend.rms_norm_fwd(xi, wi, yi, ri, m, n, x_stride, y_stride, eps, weight_offset)
    if plan_key is not None and hasattr(backend, "launch_fwd"):
        if len(_fwd_plans) > _MAX_PLANS:  # serving sees many M: keep the cache bounded
            _fwd_plans.clear()
        adapter = _arrays.fast_adapter(x)
        _fwd_plans[plan_key] = _FwdPlan(
            adapter=adapter, backend=backend,
            kernels=backend.fwd_kernels(n, xi.dtype, wi.dtype if wi is not None else "",
                                        return_rstd, x_stride),
            m=m, x_stride=x_stride, alloc_y=adapter.allocator(xi, xi.shape, xi.dtype),
            alloc_rstd=adapter.allocator(xi, (m,), _dtypes.FLOAT32),
            device_index=xi.device_index)
    y = yi.result() if out is None else out
    return (y, ri.result()) if return_rstd else y
