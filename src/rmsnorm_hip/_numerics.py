"""API.md's numerical contract as a function: used by ``rmsnorm-hip check`` (tests keep their own)."""
import numpy as np

from . import _dtypes

_MANTISSA = {_dtypes.FLOAT32: 23, _dtypes.FLOAT16: 10, _dtypes.BFLOAT16: 7}
_MIN_EXP = {_dtypes.FLOAT32: -126, _dtypes.FLOAT16: -14, _dtypes.BFLOAT16: -126}


def ulp(ref, dtype):
    """Spacing of ``dtype`` at each |ref| (float64)."""
    _, exp = np.frexp(np.abs(ref))
    return np.ldexp(1.0, np.maximum(exp - 1, _MIN_EXP[dtype]) - _MANTISSA[dtype])


def within_contract(out, ref, dtype):
    """(ok, relative error, worst element error in ulp) of ``out`` against float64 ``ref``."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return False, float("inf"), float("inf")
    norm = np.linalg.norm(ref)
    rel = float(np.linalg.norm(out - ref) / norm) if norm > 0 else float(np.abs(out).max(initial=0))
    if not np.all(np.isfinite(out)):
        return False, rel, float("inf")
    err_ulp = float(np.max(np.abs(out - ref) / ulp(ref, dtype), initial=0.0))
    if dtype == _dtypes.FLOAT32:
        return rel < 1e-5, rel, err_ulp
    ok = rel < 8e-3 and bool(np.all(np.abs(out - ref) <= 2 * ulp(ref, dtype) + 1e-6))
    return ok, rel, err_ulp


def dx_within_contract(dx, ref, s, dtype):
    """API.md's dx rule: errors measured against s = |dy (weight + offset) rstd| per element."""
    dx = np.asarray(dx, dtype=np.float64)
    err = np.abs(dx - ref)
    norm_s = np.linalg.norm(s)
    rel = float(np.linalg.norm(err) / norm_s) if norm_s > 0 else 0.0
    worst = float(np.max(err / (ulp(ref, dtype) + 1e-5 * s + 1e-30), initial=0.0))
    if not np.all(np.isfinite(dx)):
        return False, rel, float("inf")
    if dtype == _dtypes.FLOAT32:
        return rel < 1e-5, rel, worst
    return bool(np.all(err <= 2 * ulp(ref, dtype) + 1e-5 * s)), rel, worst


def dweight_within_contract(dw, ref, dtype):
    dw = np.asarray(dw, dtype=np.float64)
    if not np.all(np.isfinite(dw)):
        return False
    if dtype == _dtypes.FLOAT32:
        return bool(np.linalg.norm(dw - ref) < 1e-4 * np.linalg.norm(ref))
    return bool(np.all(np.abs(dw - ref) <= 2 * ulp(ref, dtype) + 1e-5 * np.abs(ref).max()))
