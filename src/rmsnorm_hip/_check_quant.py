"""``rmsnorm-hip check`` rows for rms_norm_quant's scaled formats: group scales (float32 and UE8M0,
row- and column-major), static scales (a number and a device array) and the MX formats, each
against reference.rms_norm_quant_scaled_ref from the same rounded inputs, within the numerical
contract (docs/api.md): float32 scales within 1e-5, UE8M0 and E8M0 scales exactly (a boundary
case may take the neighbouring power), levels within one step and equal for more than 99.9%.
The "rel err" column of a power-of-two row counts its scales that took the neighbour.

Rows (cli.cmd_check's format): ``q group`` (fp8, G = 128), ``q grp i8c`` (int8, G = 32,
column-major, with a residual), ``q ue8m0`` (fp8, G = 128, column-major, DeepSeek's layout),
``q static`` (fp8 by a number; int8 by a device array, with a residual), ``mxfp8`` and ``mxfp4``
(weights in x's dtype, every other shape with a residual).  Each compiles a kernel per dtype on
first use (about a second each on the CPU).
"""
import numpy as np

from . import _dtypes, _numerics, functional, reference

EPS = 1e-6
# (M, N): one row of one 128-column group, N no power of two (3 groups of 128), the
# LLM widths at decode and prefill sizes, and rows long enough for the GPU's looped path
GROUP_SHAPES = ((1, 128), (7, 384), (33, 4096), (64, 8192), (3, 65536))
STATIC_SHAPES = ((1, 1), (7, 127), (33, 4097), (64, 8192), (3, 65537))
# label: (rms_norm_quant keyword arguments, element, scales: "float32" / "exact" / "")
FORMATS = {
    "q group": (dict(quant_dtype="float8_e4m3fn", group_size=128), "float8_e4m3fn", "float32"),
    "q grp i8c": (dict(quant_dtype="int8", group_size=32, scale_layout="column"), "int8",
                  "float32"),
    "q ue8m0": (dict(quant_dtype="float8_e4m3fn", group_size=128, scale_format="ue8m0",
                     scale_layout="column"), "float8_e4m3fn", "exact"),
    "q static": (dict(quant_dtype="float8_e4m3fn", scale=0.0078125), "float8_e4m3fn", ""),
    "q stat i8a": (dict(quant_dtype="int8", scale="array"), "int8", ""),
    "mxfp8": (dict(quant_dtype="mxfp8_e4m3"), "float8_e4m3fn", "exact"),
    "mxfp4": (dict(quant_dtype="mxfp4_e2m1"), "float4_e2m1", "exact"),
}
STATIC_ARRAY = 0.02     # the device array's scale


def _values(q, element):
    """q on the host as float64 values (fp4 pairs unpacked, element 2i from the low nibble)."""
    q = np.asarray(q)
    if element == _dtypes.INT8:
        return q.astype(np.float64)
    bits = q.view(np.uint8)
    if element == _dtypes.FLOAT8_E4M3FN:
        return bits.view(_dtypes.NUMPY[element]).astype(np.float64)
    nibbles = np.stack([bits & 0xF, bits >> 4], axis=-1).reshape(bits.shape[:-1] + (-1,))
    magnitude = reference.E2M1_MAGNITUDES[nibbles & 7]
    return np.where(nibbles & 8, -magnitude, magnitude)


def _pow2(scales, mx):
    """Power-of-two scales as float64 values (E8M0 bytes: 2**(byte - 127), 0xFF NaN)."""
    s = np.asarray(scales)
    if mx:
        return np.where(s == 0xFF, np.nan, 2.0 ** (s.astype(np.float64) - 127))
    return s.astype(np.float64)


def _case(rng, device, label, dtype, m, n, with_residual):
    """(ok, scale error, worst level difference) of one call."""
    kwargs, element, scales_kind = FORMATS[label]
    kwargs = dict(kwargs)
    x = rng.standard_normal((m, n)).astype(np.float32)
    x *= np.repeat(10.0 ** rng.uniform(-1.5, 1.5, -(-n // 16)), 16)[:n].astype(np.float32)
    x = x.astype(_dtypes.NUMPY[dtype])
    w = (1 + 0.1 * rng.standard_normal(n)).astype(_dtypes.NUMPY[dtype])
    r = rng.standard_normal((m, n)).astype(_dtypes.NUMPY[dtype]) if with_residual else None
    xd, kw = device.to_device(x, dtype)
    wd = device.to_device(w, dtype)[0]
    rd = None if r is None else device.to_device(r, dtype)[0]
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "scale_layout"}
    if kwargs.get("scale") == "array":
        kwargs["scale"] = device.to_device(np.array([STATIC_ARRAY], np.float32),
                                           _dtypes.FLOAT32)[0]
        ref_kwargs["scale"] = np.float32(STATIC_ARRAY)
    out = functional.rms_norm_quant(xd, wd, EPS, residual=rd, dtype=kw, **kwargs)
    out = out if isinstance(out, tuple) else (out,)
    levels, ref_scales, h = reference.rms_norm_quant_scaled_ref(x, w, EPS, residual=r,
                                                                **ref_kwargs)
    q_dtype = element if element == _dtypes.INT8 else _dtypes.UINT8
    got = _values(device.to_host(out[0], q_dtype), element).reshape(m, n)
    ok, rel = True, 0.0
    if scales_kind:
        mx = kwargs["quant_dtype"] in _dtypes.MX_DTYPES
        scales = device.to_host(out[1], _dtypes.UINT8 if mx else _dtypes.FLOAT32)
        if scales_kind == "exact":
            # powers of two: the reference's, or its neighbour where max|y| lies within float32
            # rounding of the boundary; the levels are then taken over the scales returned
            values, ref_values = (_pow2(a, mx) for a in (scales, ref_scales))
            y, _, _ = reference.rms_norm_quant_scaled_ref(x, w, EPS, residual=r, scale=1.0)
            g = n // values.shape[1]
            amax = np.abs(y.reshape(m, -1, g)).max(axis=-1)
            divisor = 1.0 if mx else _dtypes.QMAX[kwargs["quant_dtype"]]
            ok, differ = _numerics.pow2_scales_within_contract(values, ref_values, amax, divisor)
            rel = float(differ)
            levels = (y.reshape(m, -1, g) / values[..., None]).reshape(m, n)
        else:
            ok, rel, _ = _numerics.within_contract(scales, ref_scales, _dtypes.FLOAT32)
    ok_levels, worst = _numerics.levels_within_contract(got, levels, element)
    ok = ok and ok_levels
    if r is not None:
        residual_out = device.to_host(out[-1], dtype)
        ok = ok and np.array_equal(np.asarray(residual_out, np.float64), h)
    return ok, rel, worst


def check(rng, to_device, to_host, verbose):
    """Run every row; returns the number of failing cases."""
    from types import SimpleNamespace
    device = SimpleNamespace(to_device=to_device, to_host=to_host)
    failures = 0
    for label, (kwargs, _, scales_kind) in FORMATS.items():
        shapes = GROUP_SHAPES if scales_kind else STATIC_SHAPES
        for dtype in _dtypes.ACTIVATION_DTYPES:
            bad = 0
            for i, (m, n) in enumerate(shapes):
                with_residual = i % 2 == 1 or "i8" in label
                try:
                    ok, rel, worst = _case(rng, device, label, dtype, m, n, with_residual)
                except Exception as error:      # a case that raises fails, its error shown
                    print(f"{label:10s} {dtype:9s} {dtype:9s} {f'{m}x{n}':>12s}  {error}")
                    bad += 1
                    continue
                bad += not ok
                if not ok or verbose:
                    print(f"{label:10s} {dtype:9s} {dtype:9s} {f'{m}x{n}':>12s}  {rel:9.2e} "
                          f"{worst:8.2f}  {'ok' if ok else 'FAIL'}")
            print(f"{label:10s} {dtype:9s} {'all':9s} {len(shapes):>5d} shapes  "
                  f"{'':9s} {'':8s}  {'ok' if not bad else 'FAIL'}")
            failures += bad
    return failures
