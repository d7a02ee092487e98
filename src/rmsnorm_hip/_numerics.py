"""The numerical contract (docs/api.md) as functions: used by ``rmsnorm-hip check``; the tests'
``ulp`` is this one."""
import numpy as np

from . import _dtypes, reference

_MANTISSA = {_dtypes.FLOAT32: 23, _dtypes.FLOAT16: 10, _dtypes.BFLOAT16: 7}
_MIN_EXP = {_dtypes.FLOAT32: -126, _dtypes.FLOAT16: -14, _dtypes.BFLOAT16: -126}


def ulp(ref, dtype):
    """Spacing of ``dtype`` at each |ref| (float64): the subnormal spacing below the normal range
    and at zero.  The one definition: the tests use it too."""
    _, exp = np.frexp(np.abs(ref))
    exp = np.where(np.asarray(ref) == 0, _MIN_EXP[dtype], np.maximum(exp - 1, _MIN_EXP[dtype]))
    return np.ldexp(1.0, exp - _MANTISSA[dtype])


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


def _levels(q, quant_dtype):
    """Signed level index of int8 / float8 e4m3fn values (adjacent representable values: 1
    apart; float8 through its sign-magnitude code)."""
    q = np.asarray(q)
    if quant_dtype == _dtypes.INT8:
        return q.astype(np.int64)
    bits = np.asarray(q, np.float64).astype(_dtypes.NUMPY[quant_dtype]).view(np.uint8)
    code = (bits & 0x7F).astype(np.int64)
    return np.where(bits & 0x80, -code, code)


def levels_within_contract(values, levels_ref, element, tie=1e-5):
    """(ok, largest level difference) of quantised values (float64: int8 levels, float8 e4m3fn
    or float4 e2m1 values) against the reference's unrounded ``levels_ref``: every one within
    one representable step of its rounding, equal for more than 99.9% of those whose rounding
    is decided (see quant_within_contract)."""
    def steps(v):
        v = np.asarray(v, np.float64)
        if element == "float4_e2m1":
            code = np.argmin(np.abs(np.abs(v)[..., None] - reference.E2M1_MAGNITUDES), axis=-1)
            return np.where(v < 0, -code, code).astype(np.int64)
        return _levels(v, element)
    got = steps(values)
    ref = steps(reference.quantize_ref(levels_ref, element))
    if got.shape != ref.shape:
        return False, float("inf")
    diff = np.abs(got - ref)
    decided = (reference.quantize_ref(levels_ref * (1 + tie), element)
               == reference.quantize_ref(levels_ref * (1 - tie), element))
    unequal = int(np.count_nonzero(diff[decided]))
    ok = int(diff.max(initial=0)) <= 1 and 1000 * (diff.size - unequal) > 999 * diff.size
    return ok, float(diff.max(initial=0))


def pow2_scales_within_contract(got, ref, amax, divisor=1.0, rel=2.0 ** -20):
    """(ok, how many differ) of power-of-two scales (UE8M0 values, or MX's 2**e: float64)
    against the reference's: equal, except that where the reference's max|y| / ``divisor``
    lies within ``rel`` of a power of two, the kernel's float32 max|y| may round across it and
    the neighbouring power is taken too (its levels are then checked against that scale)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    a = np.asarray(amax, np.float64) / divisor
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.round(np.log2(a))
        near = np.abs(a / 2.0 ** k - 1) < rel
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    ok = same | (near & ((got == 2 * ref) | (got == ref / 2)))
    return bool(np.all(ok)), int(np.count_nonzero(~same))


def quant_within_contract(q, yscale, q_ref, yscale_ref, quant_dtype, tie=1e-5):
    """(ok, yscale relative error, largest level difference) of a quantised output against the
    reference quotient ``q_ref`` (reference.rms_norm_quant_ref): every level within 1 of its
    rounding, equal for more than 99.9% of the elements whose rounding is decided (a quotient
    within ``tie`` relative of a midpoint may round either way), yscale relative error < 1e-5."""
    got = _levels(q, quant_dtype)
    ref = _levels(reference.quantize_ref(q_ref, quant_dtype), quant_dtype)
    if got.shape != ref.shape:
        return False, float("inf"), float("inf")
    diff = np.abs(got - ref)
    decided = (reference.quantize_ref(q_ref * (1 + tie), quant_dtype)
               == reference.quantize_ref(q_ref * (1 - tie), quant_dtype))
    unequal = int(np.count_nonzero(diff[decided]))
    ok_levels = int(diff.max(initial=0)) <= 1 and 1000 * (diff.size - unequal) > 999 * diff.size
    ok_scale, rel, _ = within_contract(yscale, yscale_ref, _dtypes.FLOAT32)
    return ok_levels and ok_scale, rel, float(diff.max(initial=0))

def dx_within_contract(dx, ref, s, dtype):
    """The contract's dx rule (docs/api.md): errors measured against s = |dy (weight + offset)
    rstd| per element."""
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
