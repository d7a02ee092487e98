"""rms_norm_quant's scaled formats (docs/api.md): group scales (float32 or UE8M0, row-major or
column-major), a static scale, MXFP8 and MXFP4, on NumPy arrays (CPU backend), on the simulator
(every GPU path once: multi-row, one cached row streamed, scalar access, looped; 32- and 64-lane
warps) and through torch on the host, against the float64 reference (reference.py
rms_norm_quant_scaled_ref, written from the formulas, not from the kernels):

- scales: float32 ones within 1e-5 relative; UE8M0 and E8M0 ones exactly equal;
- q: within one level (one representable step of e4m3 / e2m1) of the reference's rounding, and
  equal for > 99.9% of the elements whose rounding is decided (conftest.assert_levels_close);
- zero groups, NaN and Inf rows, batch and layout invariance (bitwise), and every bad argument
  refused with a message naming it."""
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import pytest
from _guard import guarded_outputs
from conftest import (BFLOAT16, DTYPES, FLOAT16, FLOAT32, NUMPY, aligned_copy, assert_bitwise,
                      assert_close, assert_levels_close, full_tier_except, quant_levels,
                      random_array)
from test_sim import launched_specs

from rmsnorm_hip import backends, rms_norm_quant
from rmsnorm_hip._numerics import pow2_scales_within_contract
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import E2M1_MAGNITUDES, quantize_ref, rms_norm_quant_scaled_ref

pytestmark = pytest.mark.quick

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


@dataclass(frozen=True)
class Fmt:
    """One scaled format: the call's keyword arguments and how its outputs are read."""
    name: str
    kwargs: dict = field(hash=False)
    element: str            # how q's levels are counted: int8, float8_e4m3fn, float4_e2m1
    scales: str             # "float32" (1e-5), "exact" (UE8M0 floats), "e8m0" (bytes), "" none

    @property
    def group(self):
        if self.scales == "e8m0":
            return 32
        return self.kwargs.get("group_size", 1)

    def __str__(self):
        return self.name


FORMATS = [
    Fmt("group128_fp8", dict(quant_dtype="float8_e4m3fn", group_size=128), "float8_e4m3fn",
        "float32"),
    Fmt("group32_int8", dict(quant_dtype="int8", group_size=32), "int8", "float32"),
    Fmt("group64_int8_column", dict(quant_dtype="int8", group_size=64, scale_layout="column"),
        "int8", "float32"),
    Fmt("group16_int8_ue8m0", dict(quant_dtype="int8", group_size=16, scale_format="ue8m0"),
        "int8", "exact"),
    Fmt("group128_fp8_ue8m0_column", dict(quant_dtype="float8_e4m3fn", group_size=128,
                                          scale_format="ue8m0", scale_layout="column"),
        "float8_e4m3fn", "exact"),
    # y is about N(0, 1): these scales saturate the largest few percent of q
    Fmt("static_fp8", dict(quant_dtype="float8_e4m3fn", scale=0.0078125), "float8_e4m3fn", ""),
    Fmt("static_int8_array", dict(quant_dtype="int8", scale=np.array([0.02], np.float32)),
        "int8", ""),
    Fmt("mxfp8", dict(quant_dtype="mxfp8_e4m3"), "float8_e4m3fn", "e8m0"),
    Fmt("mxfp4", dict(quant_dtype="mxfp4_e2m1"), "float4_e2m1", "e8m0"),
]
BY_NAME = {f.name: f for f in FORMATS}


def shapes_of(fmt):
    """M in 1, 7, 333 and N from one group (or one element) to the GPU's looped rows: N = 384
    is three groups of 128 (no power of two); static rows take any N."""
    if fmt.scales:
        g = max(fmt.group, 32)
        return [(1, g), (7, 384), (333, 4096), (2, 65536)]
    return [(1, 1), (7, 127), (333, 4097), (2, 65537)]


def make_x(rng, shape, dtype):
    """x whose blocks of 16 columns span three decades (groups and MX blocks get different
    scales) and whose rows span six (rows must not leak into each other); four in float16,
    whose largest finite value an outlier of a six-decade spread can exceed."""
    x = random_array(rng, shape, FLOAT32)
    n = shape[-1]
    blocks = 10.0 ** rng.uniform(-1.5, 1.5, -(-n // 16))
    x *= np.repeat(blocks, 16)[:n].astype(np.float32)
    if len(shape) > 1:
        decades = 2 if dtype == FLOAT16 else 3
        x *= (10.0 ** rng.uniform(-decades, decades, shape[:-1] + (1,))).astype(np.float32)
    return x.astype(NUMPY[dtype])


def q_values(q, element):
    """The kernel's q as float64 values (fp4: pairs unpacked, element 2i from the low nibble)."""
    q = np.asarray(q)
    if element == "int8":
        return q.astype(np.float64)
    bits = q.view(np.uint8)
    if element == "float8_e4m3fn":
        return bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    nibbles = np.stack([bits & 0xF, bits >> 4], axis=-1).reshape(bits.shape[:-1] + (-1,))
    magnitude = E2M1_MAGNITUDES[nibbles & 7]
    return np.where(nibbles & 8, -magnitude, magnitude)


def split(fmt, result, has_residual):
    """(q, scales or None, residual_out or None) of a call's result."""
    parts = list(result) if isinstance(result, tuple) else [result]
    assert len(parts) == (1 if not fmt.scales else 2) + has_residual, (fmt, len(parts))
    q = parts.pop(0)
    scales = parts.pop(0) if fmt.scales else None
    return q, scales, (parts[0] if has_residual else None)


def check(fmt, x, w, result, **kwargs):
    """The contract of one NumPy call: output types, shapes and layouts, scales and q against
    the reference, residual_out bitwise round(x + residual)."""
    n = x.shape[-1]
    m = int(np.prod(x.shape[:-1]))
    has_residual = kwargs.get("residual") is not None
    q, scales, residual_out = split(fmt, result, has_residual)
    ref_kwargs = {k: v for k, v in fmt.kwargs.items() if k != "scale_layout"}
    ref_levels, ref_scales, ref_h = rms_norm_quant_scaled_ref(x, w, **ref_kwargs, **kwargs)
    q_dtype = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}.get(
        fmt.kwargs["quant_dtype"], np.uint8)
    q_shape = x.shape[:-1] + ((n // 2,) if fmt.element == "float4_e2m1" else (n,))
    assert type(q) is np.ndarray and q.dtype == q_dtype and q.shape == q_shape
    if fmt.scales:
        groups = n // fmt.group
        assert scales.shape == (m, groups)
        if fmt.kwargs.get("scale_layout") == "column":
            pad = -(-m // 4) * 4
            assert scales.strides == (4, 4 * pad), scales.strides
        if fmt.scales == "float32":
            assert scales.dtype == np.float32
            assert_close(scales, ref_scales, FLOAT32)
            # the levels over the scales returned (what dequantises q): a subnormal float32
            # scale keeps few bits of the reference's
            ref_levels = levels_over(fmt, x, w, scales.astype(np.float64), kwargs)
        else:
            ref_levels = check_pow2_scales(fmt, x, w, scales, ref_scales, kwargs)
    assert_levels_close(q_values(q, fmt.element).reshape(m, n), ref_levels, fmt.element)
    if has_residual:
        assert residual_out.dtype == x.dtype and residual_out.shape == x.shape
        assert_bitwise(residual_out, ref_h.astype(x.dtype), "residual_out vs round(x + r)")


def scale_values(fmt, scales):
    """Power-of-two scales as float64 values (E8M0 bytes: 2**(byte - 127), 0xFF NaN)."""
    s = np.asarray(scales)
    if fmt.scales == "e8m0":
        return np.where(s == 0xFF, np.nan, 2.0 ** (s.astype(np.float64) - 127))
    return s.astype(np.float64)


def check_pow2_scales(fmt, x, w, scales, ref_scales, kwargs):
    """UE8M0 / E8M0 scales equal to the reference's (the neighbouring power only where max|y|
    lies within float32 rounding of a power-of-two boundary); returns the reference levels
    y / scale over the scales the call returned."""
    assert scales.dtype == (np.uint8 if fmt.scales == "e8m0" else np.float32)
    y = reference_y(fmt, x, w, kwargs)
    m, n = y.shape
    amax = np.abs(y.reshape(m, n // fmt.group, fmt.group)).max(axis=-1)
    got = scale_values(fmt, scales)
    divisor = 1.0 if fmt.scales == "e8m0" else QMAX[fmt.kwargs["quant_dtype"]]
    ok, differ = pow2_scales_within_contract(got, scale_values(fmt, ref_scales), amax, divisor)
    assert ok, f"{fmt}: {differ} power-of-two scales differ from the reference's"
    return levels_over(fmt, x, w, got, kwargs)


def reference_y(fmt, x, w, kwargs):
    """The reference's y (M, N) in float64 (its levels at scale 1)."""
    ref_kwargs = {k: v for k, v in fmt.kwargs.items() if k not in ("scale_layout", "scale")}
    return rms_norm_quant_scaled_ref(x, w, scale=1.0, **ref_kwargs, **kwargs)[0]


def levels_over(fmt, x, w, scales64, kwargs):
    """The reference's y / scale per group over the given float64 scales (M, N // G)."""
    y = reference_y(fmt, x, w, kwargs)
    m, n = y.shape
    return (y.reshape(m, n // fmt.group, fmt.group) / scales64[..., None]).reshape(m, n)


CASES = [(fmt, shape, DTYPES[i % 3]) for fmt in FORMATS
         for i, shape in enumerate(shapes_of(fmt))]


@pytest.mark.parametrize("fmt,shape,dtype", CASES, ids=lambda v: f"{v[0]}x{v[1]}"
                         if isinstance(v, tuple) else str(v))
def test_matches_reference(rng, fmt, shape, dtype):
    x = make_x(rng, shape, dtype)
    w = random_array(rng, shape[-1], dtype, loc=1.0, scale=0.5)
    x0, w0 = x.copy(), w.copy()

    result = rms_norm_quant(x, w, **fmt.kwargs)

    check(fmt, x, w, result)
    assert_bitwise(x, x0, "x after the call")
    assert_bitwise(w, w0, "weight after the call")


# what a call adds: no weight, a float32 weight with an offset, SmoothQuant scales in float32
# and in x's dtype, a fused residual (rotating over the formats and dtypes)
KINDS = ["no_weight", "f32_weight_offset", "xscale_f32", "xscale_x", "residual",
         "residual_xscale"]


def make_kind(rng, shape, dtype, kind):
    n = shape[-1]
    w = None if kind == "no_weight" else random_array(
        rng, n, FLOAT32 if kind == "f32_weight_offset" else dtype, loc=1.0, scale=0.5)
    kwargs = {}
    if kind == "f32_weight_offset":
        kwargs["weight_offset"] = 1.0
    if "xscale" in kind:
        xs = (10.0 ** rng.uniform(-0.5, 0.5, n)).astype(np.float32)
        xs[::7] *= -1
        kwargs["xscale"] = xs.astype(NUMPY[FLOAT32 if kind.endswith("f32") else dtype])
    if "residual" in kind:
        kwargs["residual"] = make_x(rng, shape, dtype)
    return w, kwargs


@pytest.mark.parametrize("fmt,kind,dtype", [
    (fmt, KINDS[i % len(KINDS)], DTYPES[(i + 1) % 3]) for i, fmt in enumerate(FORMATS)],
    ids=str)
def test_kinds(rng, fmt, kind, dtype):
    x = make_x(rng, (7, 256), dtype)
    w, kwargs = make_kind(rng, x.shape, dtype, kind)
    before = [a.copy() for a in [x] + list(kwargs.values()) if isinstance(a, np.ndarray)]

    result = rms_norm_quant(x, w, **fmt.kwargs, **kwargs)

    check(fmt, x, w, result, **kwargs)
    after = [a for a in [x] + list(kwargs.values()) if isinstance(a, np.ndarray)]
    for a, a0 in zip(after, before):
        assert_bitwise(a, a0, "an input after the call")


def test_three_dims(rng):
    """x (B, T, N): q keeps x's leading dims, scales are (B * T, N // G)."""
    fmt = BY_NAME["mxfp4"]
    x = make_x(rng, (2, 3, 64), BFLOAT16)
    q, scales = rms_norm_quant(x, **fmt.kwargs)
    assert q.shape == (2, 3, 32) and scales.shape == (6, 2)
    flat = rms_norm_quant(x.reshape(6, 64), **fmt.kwargs)
    assert_bitwise(q.reshape(6, 32), flat[0], "q of (2, 3, N) vs (6, N)")
    assert_bitwise(scales, flat[1], "scales of (2, 3, N) vs (6, N)")


def check_guards(guards, fmt, m):
    """Nothing written outside an output; every element of one written, where the poison can
    tell (uint8 outputs, MX q and scales, hold 0xFF legitimately: their values are checked
    against the reference instead), the padding rows of column-major scales excepted."""
    pad = -(-m // 4) * 4
    for allocation in guards:
        padded = fmt.kwargs.get("scale_layout") == "column" and allocation.shape[-1] == pad
        allocation.check(written=allocation.dtype != "uint8" and not (padded and pad != m))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_outputs_guarded(rng, fmt):
    """Every output written in full and nothing around it (poisoned, guarded allocations), with
    a residual so that residual_out is checked too."""
    x = make_x(rng, (7, 256), BFLOAT16)
    r = make_x(rng, (7, 256), BFLOAT16)
    with guarded_outputs() as guards:
        result = rms_norm_quant(x, residual=r, **fmt.kwargs)
    check_guards(guards, fmt, 7)
    check(fmt, x, None, result, residual=r)


# ---- special values -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.scales], ids=str)
def test_zero_groups(rng, fmt):
    """An all-zero group gets scale 1.0 (float32, UE8M0) or the smallest E8M0 scale (byte 0),
    and zeros; the row's other groups are unaffected."""
    x = make_x(rng, (3, 256), FLOAT32)
    g = fmt.group
    x[1, g:2 * g] = 0.0
    q, scales, _ = split(fmt, rms_norm_quant(x, **fmt.kwargs), False)
    assert scales[1, 1] == (0 if fmt.scales == "e8m0" else 1.0)
    values = q_values(q, fmt.element).reshape(3, 256)
    assert np.all(values[1, g:2 * g] == 0)
    check(fmt, x, None, (q, scales))


@pytest.mark.parametrize("fmt", [BY_NAME["mxfp8"], BY_NAME["mxfp4"]], ids=str)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_mx_nan_rows(rng, fmt, bad):
    """A block holding NaN or Inf gets the NaN scale 0xFF (NaN makes the whole row's rstd NaN,
    so all its blocks); the other rows are bitwise what they are without it."""
    x = make_x(rng, (4, 128), BFLOAT16)
    clean = rms_norm_quant(x, **fmt.kwargs)
    x[2, 40] = bad
    q, scales = rms_norm_quant(x, **fmt.kwargs)
    assert scales[2, 1] == 0xFF
    if np.isnan(bad):
        assert np.all(scales[2] == 0xFF)
    for r in (0, 1, 3):
        assert_bitwise(q[r], clean[0][r], f"q row {r} beside a {bad} row")
        assert_bitwise(scales[r], clean[1][r], f"scales row {r} beside a {bad} row")


TINY_FORMATS = ["group32_int8", "group16_int8_ue8m0", "mxfp8", "mxfp4"]


def tiny_block_rows(rng):
    """float32 rows of normal values with one block of 32 subnormal ones (1e-39 to 2e-39): its
    group scale is subnormal (y taken through 2**64 first), UE8M0 and E8M0 exponents clamp at
    -127 with max|y| non-zero."""
    x = make_x(rng, (3, 128), FLOAT32)
    signs = np.where(rng.random(32) < 0.5, -1.0, 1.0)
    x[1, 32:64] = (signs * rng.uniform(1e-39, 2e-39, 32)).astype(np.float32)
    return x


def check_tiny(fmt, x, result):
    """The normal rows by the contract; the row with subnormal y (a few bits each) within one
    level of the reference over the scales returned."""
    q, scales = result[:2]
    normal = [0, 2]
    check(fmt, x[normal], None, (q[normal], scales[normal]))
    got = quant_levels(q_values(q[1:2], fmt.element), fmt.element)
    scales64 = (scale_values(fmt, scales[1:2]) if fmt.scales != "float32"
                else scales[1:2].astype(np.float64))
    want = quant_levels(quantize_ref(levels_over(fmt, x[1:2], None, scales64, {}), fmt.element),
                        fmt.element)
    assert np.abs(got.reshape(want.shape) - want).max() <= 1


@pytest.mark.parametrize("name", TINY_FORMATS)
def test_tiny_blocks(rng, name):
    fmt = BY_NAME[name]
    x = tiny_block_rows(rng)
    result = rms_norm_quant(x, **fmt.kwargs)
    check_tiny(fmt, x, result)
    scales = result[1]
    g = fmt.group
    tiny = scales[1, 32 // g]
    if fmt.scales == "e8m0":
        assert tiny == 0                           # e clamped at -127, the block not zero
    elif fmt.scales == "exact":
        assert tiny == np.float32(2.0 ** -127)
    else:
        assert 0 < tiny < np.float32(2.0 ** -126)  # subnormal: levels through 2**64


@pytest.mark.sim
def test_sim_tiny_blocks_and_nan_rows(rng, monkeypatch):
    """The GPU kernel on the clamped and subnormal scales (bitwise the CPU's where the
    formats' scales are powers of two) and on a NaN row (MX: its scales 0xFF, the other rows
    bitwise those of the clean call)."""
    cpu = {name: rms_norm_quant(tiny_block_rows(np.random.default_rng(5)),
                                **BY_NAME[name].kwargs) for name in TINY_FORMATS}
    _sim(monkeypatch)
    for name in TINY_FORMATS:
        fmt = BY_NAME[name]
        x = tiny_block_rows(np.random.default_rng(5))
        result = tuple(_host(a) for a in rms_norm_quant(x, **fmt.kwargs))
        check_tiny(fmt, x, result)
        if fmt.scales != "float32":
            assert_bitwise(result[1], cpu[name][1], f"{name}: simulator vs CPU scales")
    fmt = BY_NAME["mxfp4"]
    x = make_x(rng, (3, 64), BFLOAT16)
    clean = tuple(_host(a) for a in rms_norm_quant(x, **fmt.kwargs))
    x[1, 5] = np.nan
    q, scales = (_host(a) for a in rms_norm_quant(x, **fmt.kwargs))
    assert np.all(scales[1] == 0xFF)
    for r in (0, 2):
        assert_bitwise(q[r], clean[0][r], f"q row {r} beside a NaN row")
        assert_bitwise(scales[r], clean[1][r], f"scales row {r} beside a NaN row")


def test_e2m1_encoder_grid():
    """The shared e2m1 encoder against the reference's rounding on a dense grid of values,
    halfway points (ties to the even code), their float32 neighbours, saturation and -0
    included: compiled (CPU intrinsics) and as the simulator runs it (Python)."""
    import numba

    from rmsnorm_hip import intrinsics
    from rmsnorm_hip.reference import quantize_e2m1_ref
    encode = intrinsics.load("cpu").f32_to_e2m1

    @numba.njit
    def encode_all(values, out):
        for i in range(values.size):
            out[i] = encode(values[i])

    grid = np.linspace(-8, 8, 4097).astype(np.float32)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 9)])
    values = np.concatenate([grid, near, -near, [np.inf, -np.inf, 1e30, -1e-30]]).astype(
        np.float32)
    codes = np.empty(values.size, np.uint32)
    encode_all(values, codes)
    magnitude = E2M1_MAGNITUDES[codes & 7]
    got = np.where(codes & 8, -magnitude, magnitude)
    want = quantize_e2m1_ref(values.astype(np.float64))
    assert np.array_equal(got, want)
    assert np.array_equal(codes >> 3, np.signbit(values).astype(np.uint32))
    simulated = intrinsics.load("sim", 32).f32_to_e2m1
    assert [int(simulated(np.float32(v))) for v in values[::7]] == list(codes[::7])


# ---- invariance ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_rows_and_layout_invariant(rng, fmt):
    """A row's q and scales are bitwise the same alone, in a batch, and from strided rows."""
    x = make_x(rng, (5, 256), BFLOAT16)
    batch = split(fmt, rms_norm_quant(x, **fmt.kwargs), False)
    alone = split(fmt, rms_norm_quant(x[3:4].copy(), **fmt.kwargs), False)
    wide = np.zeros((5, 300), x.dtype)
    wide[:, 10:266] = x
    strided = split(fmt, rms_norm_quant(wide[:, 10:266], **fmt.kwargs), False)
    assert_bitwise(alone[0][0], batch[0][3], "q of a row alone vs in its batch")
    assert_bitwise(strided[0], batch[0], "q of strided rows vs contiguous")
    if fmt.scales:
        assert_bitwise(alone[1][0], batch[1][3], "scales of a row alone vs in its batch")
        assert_bitwise(strided[1], batch[1], "scales of strided rows vs contiguous")


# ---- bad arguments ------------------------------------------------------------------------------

F = "rms_norm_quant"
ERRORS = [
    (dict(quant_dtype="mxfp4_e2m1"), (3, 48), ValueError, r"rms_norm_quant: "
     r"quant_dtype='mxfp4_e2m1' quantises blocks of 32 columns: N must be a multiple of 32, "
     r"got N = 48"),
    (dict(quant_dtype="mxfp8_e4m3", group_size=64), (3, 64), ValueError,
     r"blocks of 32 columns, got group_size=64"),
    (dict(quant_dtype="mxfp8_e4m3", scale=0.5), (3, 64), ValueError,
     r"E8M0 scales per block.*scale=0\.5"),
    (dict(quant_dtype="mxfp8_e4m3", scale_format="ue8m0"), (3, 64), ValueError,
     r"scale_format='ue8m0'"),
    (dict(group_size=48), (3, 96), ValueError, r"group_size must be a power of two from 16 to "
     r"128 that divides N = 96, got 48"),
    (dict(group_size=256), (3, 512), ValueError, r"group_size must be a power of two.*got 256"),
    (dict(group_size=8), (3, 64), ValueError, r"group_size must be.*got 8"),
    (dict(group_size=64), (3, 96), ValueError, r"divides N = 96, got 64"),
    (dict(group_size=True), (3, 64), TypeError, r"group_size must be.*got True"),
    (dict(group_size=32.0), (3, 64), TypeError, r"group_size must be.*got 32\.0"),
    (dict(scale_format="e8m0", group_size=32), (3, 64), ValueError,
     r"scale_format must be 'float32' or 'ue8m0', got 'e8m0'"),
    (dict(scale_layout="col", group_size=32), (3, 64), ValueError,
     r"scale_layout must be 'row' or 'column', got 'col'"),
    (dict(scale_format="ue8m0"), (3, 64), ValueError, r"rms_norm_quant: scale_format='ue8m0' "
     r"applies to group scales: give group_size"),
    (dict(scale_layout="column"), (3, 64), ValueError, r"rms_norm_quant: "
     r"scale_layout='column' applies to group scales: give group_size"),
    (dict(scale=0.5, group_size=32), (3, 64), ValueError,
     r"a static scale quantises the whole tensor"),
    (dict(scale=0.0), (3, 64), ValueError, r"scale must be a positive finite float32, got 0\.0"),
    (dict(scale=-1.0), (3, 64), ValueError,
     r"scale must be a positive finite float32, got -1\.0"),
    (dict(scale=float("nan")), (3, 64), ValueError,
     r"scale must be a positive finite float32, got nan"),
    (dict(scale=1e300), (3, 64), ValueError,
     r"scale must be a positive finite float32, got 1e\+300"),
    (dict(scale=np.array([0.5, 0.5], np.float32)), (3, 64), ValueError,
     r"scale must be a number or a float32 array of one element, got shape \(2,\)"),
    (dict(scale=np.array([0.5])), (3, 64), TypeError,
     r"scale must be a number or a float32 array of one element, got a float64 array"),
    (dict(scale="0.5"), (3, 64), TypeError, r"scale must be a NumPy, CuPy or torch array"),
    (dict(scale=True), (3, 64), TypeError,
     r"scale must be a number or a float32 array of one element, got bool"),
    (dict(scale=np.bool_(True)), (3, 64), TypeError,
     r"scale must be a number or a float32 array of one element, got bool"),
]


@pytest.mark.parametrize("kwargs,shape,error,message", ERRORS, ids=lambda v: str(v)[:40])
def test_bad_arguments(rng, kwargs, shape, error, message):
    x = make_x(rng, shape, FLOAT32)
    with pytest.raises(error, match=message):
        rms_norm_quant(x, **kwargs)


# ---- torch on the host --------------------------------------------------------------------------

def test_torch_dtypes_and_layout(rng):
    """torch callers get float8_e4m3fn / float8_e8m0fnu / float4_e2m1fn_x2 tensors where their
    torch has those dtypes (uint8 bits otherwise), the column-major scales as a strided view, and
    the same bits as NumPy callers."""
    torch = pytest.importorskip("torch")
    x = make_x(rng, (6, 256), BFLOAT16)
    xt = torch.from_numpy(x.view(np.uint16).astype(np.int32)).to(torch.int16).view(
        torch.bfloat16)
    for fmt, q_dtype, s_dtype in [
            (BY_NAME["mxfp8"], "float8_e4m3fn", "float8_e8m0fnu"),
            (BY_NAME["mxfp4"], "float4_e2m1fn_x2", "float8_e8m0fnu"),
            (BY_NAME["group128_fp8_ue8m0_column"], "float8_e4m3fn", "float32")]:
        q, scales = rms_norm_quant(xt, **fmt.kwargs)
        want_q = getattr(torch, q_dtype, torch.uint8)
        want_s = getattr(torch, s_dtype, torch.uint8)
        assert q.dtype == want_q and scales.dtype == want_s, (fmt, q.dtype, scales.dtype)
        q_np, s_np = rms_norm_quant(x, **fmt.kwargs)
        assert_bitwise(q.view(torch.uint8).numpy(), q_np.view(np.uint8), f"{fmt} q")
        if s_dtype == "float32":
            assert scales.stride() == (1, 8)
            assert_bitwise(scales.numpy(), s_np, f"{fmt} scales")
        else:
            assert_bitwise(scales.view(torch.uint8).numpy(), s_np, f"{fmt} scales")
    scale = torch.tensor([0.0078125])
    q = rms_norm_quant(xt, quant_dtype="float8_e4m3fn", scale=scale)
    assert q.dtype == torch.float8_e4m3fn
    want = rms_norm_quant(x, **BY_NAME["static_fp8"].kwargs)
    assert_bitwise(q.view(torch.uint8).numpy(), want.view(np.uint8), "static q from torch")


# ---- the GPU kernel on the simulator ------------------------------------------------------------

def _sim(monkeypatch, warp=32):
    monkeypatch.setattr(backends, "_backends", {})
    monkeypatch.setenv("RMSNORM_HIP_BACKEND", "sim")
    monkeypatch.setenv("RMSNORM_HIP_SIM_WARP", str(warp))
    return backends.get("sim")


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


# (format, shape, dtype, what the case covers): every scaling kind on the streamed cached row
# (its scales one group a lane: 16 and 4 lanes a group, the chunks past N = 5120; two chunks a
# thread in two-row blocks at N = 272, a row past M, and on a 64-lane warp at N = 320; static
# with a residual in its own layout, a row alone bitwise the batch's), a
# multi-row block (N = 128: 16-lane rows), the scalar form (a vector call, then its rows from
# unaligned memory: bitwise the same), the looped row (full tier), a 64-lane warp
SIM_CASES = [
    ("group128_fp8", (3, 4096), BFLOAT16, "stream"),
    ("group32_int8", (3, 5120), BFLOAT16, "stream"),
    ("static_fp8", (3, 4096), BFLOAT16, "stream_residual"),
    ("group16_int8_ue8m0", (3, 272), FLOAT32, "multirow"),
    ("mxfp8", (3, 320), FLOAT32, "warp64"),
    ("group16_int8_ue8m0", (5, 128), FLOAT32, "multirow"),
    ("group128_fp8", (3, 256), FLOAT32, "multirow"),          # 32-lane groups
    ("group64_int8_column", (3, 256), FLOAT16, "scalar"),
    ("static_int8_array", (3, 256), BFLOAT16, "scalar"),
    ("static_fp8", (5, 128), FLOAT16, "multirow"),
    ("mxfp8", (3, 2048), FLOAT32, "stream"),
    ("mxfp4", (3, 256), BFLOAT16, "scalar"),
    ("mxfp4", (5, 128), FLOAT16, "warp64"),
    ("group128_fp8_ue8m0_column", (2, 65536), BFLOAT16, "looped"),
]


@pytest.mark.sim
@pytest.mark.parametrize("name,shape,dtype,path",
                         full_tier_except(SIM_CASES, quick=lambda c: c[3] != "looped"),
                         ids=lambda v: str(v))
def test_sim_paths(rng, monkeypatch, name, shape, dtype, path):
    fmt = BY_NAME[name]
    be = _sim(monkeypatch, 64 if path == "warp64" else 32)
    x = make_x(rng, shape, dtype)
    w = random_array(rng, shape[-1], FLOAT32, loc=1.0, scale=0.5)
    kwargs = dict(residual=make_x(rng, shape, dtype)) if path in ("scalar",
                                                                   "stream_residual") else {}
    with launched_specs(be) as specs, guarded_outputs() as guards:
        result = rms_norm_quant(x, w, **fmt.kwargs, **kwargs)
    check_guards(guards, fmt, shape[0])
    (spec,) = specs
    assert spec.scaling and spec.quant == fmt.kwargs["quant_dtype"]
    covered = {"stream": spec.stream and spec.rows == 1, "multirow": spec.rows > 1,
               "stream_residual": spec.stream and spec.residual
               and spec.layout == _config.quant_row_layout(shape[-1], dtype, "cuda", True),
               "scalar": spec.vector, "looped": not spec.layout.cached,
               "warp64": be.intrinsics.warp == 64}
    assert covered[path], spec
    parts = tuple(_host(a) for a in (result if isinstance(result, tuple) else (result,)))
    q_np = parts[0].view(ml_dtypes.float8_e4m3fn) if (
        fmt.kwargs["quant_dtype"] == "float8_e4m3fn") else parts[0]
    check(fmt, x, w, (q_np,) + parts[1:], **kwargs)
    if path == "stream_residual":   # a decode call's row: bitwise the same as in the batch
        alone = rms_norm_quant(x[1:2].copy(), w, **fmt.kwargs, residual=kwargs["residual"][1:2])
        for a, b in zip(alone, parts):
            assert_bitwise(_host(a)[0].view(np.uint8), b[1].view(np.uint8),
                           f"{name}: row 1 alone vs in its batch")
    if path == "scalar":    # the same rows from unaligned memory: bitwise the vector kernel's
        with launched_specs(be) as specs:
            twin = rms_norm_quant(aligned_copy(x, offset=2), w, **fmt.kwargs,
                                  residual=aligned_copy(kwargs["residual"], offset=2))
        assert not specs[0].vector
        twin = twin if isinstance(twin, tuple) else (twin,)
        for a, b in zip(twin, parts):
            a = a.array if hasattr(a, "array") else _host(a)
            assert_bitwise(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(np.uint8) if b.dtype.itemsize == 1 else b,
                           f"{name}: scalar twin")


@pytest.mark.sim
@pytest.mark.parametrize("name,offset,with_residual", [
    ("group64_int8_column", 0.5, False), ("mxfp4", 0.0, True), ("static_fp8", 0.5, True),
    ("static_int8_array", 0.0, False)])
def test_sim_runner_gives_the_validated_bits(rng, monkeypatch, name, offset, with_residual):
    """The scaled formats' repeat-call runner (_quant.runner over
    GpuBackend.quant_scaled_launcher) run by the simulator: every output bitwise the validated
    call's, column-major scales, fp4 pairs and static scales (a number, an array) included.
    Rows at a stride of N + 1 bf16 elements are no multiple of 16 bytes: the scalar kernel,
    taken without reading the pointers' alignment (the runner gets the wide buffers, as a
    device runner gets pointers)."""
    from conftest import HostIO

    from rmsnorm_hip import _arrays, _dtypes, _quant
    fmt = BY_NAME[name]
    be = _sim(monkeypatch)
    m, n = 5, 128
    wide_x = make_x(rng, (m, n + 1), BFLOAT16)
    wide_r = make_x(rng, (m, n + 1), BFLOAT16) if with_residual else None
    x, residual = wide_x[:, :n], (wide_r[:, :n] if with_residual else None)
    w = random_array(rng, n, BFLOAT16, loc=1.0, scale=0.1)
    kwargs = dict(fmt.kwargs)
    quant = kwargs.pop("quant_dtype")
    expected = rms_norm_quant(x, w, 1e-6, residual=residual, weight_offset=offset,
                              quant_dtype=quant, **kwargs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    layout, group_size = kwargs.get("scale_layout", "row"), kwargs.get("group_size")
    scaling, group = _quant.scheme("t", quant, n, group_size, kwargs.get("scale_format",
                                                                         "float32"),
                                   layout, kwargs.get("scale"))
    mx = quant in _dtypes.MX_DTYPES
    q_shape = (m, n // 2) if quant == _dtypes.MXFP4 else (m, n)
    scale_strides = ((0, 0) if scaling == "static" else
                     (1, -(-m // _quant.COLUMN_PAD) * _quant.COLUMN_PAD) if layout == "column"
                     else (n // group, 1))
    run = _quant.runner(be, HostIO(), (m, n), q_shape, _dtypes.UINT8 if mx else quant, m, n,
                        (n + 1, n + 1, q_shape[1], n), scale_strides, BFLOAT16,
                        _arrays.describe(w, "weight", None, "t"), None, with_residual, quant,
                        scaling, group, layout, "t",
                        static_array=hasattr(kwargs.get("scale"), "shape"))
    got = run(wide_x, wide_r, w, None, 1e-6, offset, kwargs.get("scale"))
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        a, b = np.asarray(_host(a)), np.asarray(_host(b))
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert_bitwise(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                       b.view(np.uint8) if b.dtype.itemsize == 1 else b, f"{name} output {i}")


@pytest.mark.sim
def test_sim_batch_invariant(rng, monkeypatch):
    """Rows alone and in a batch on the streamed kernel (a program walks several rows): bitwise
    the same q and group scales."""
    fmt = BY_NAME["group32_int8"]
    _sim(monkeypatch)
    x = make_x(rng, (6, 1024), BFLOAT16)
    q, scales = (_host(a) for a in rms_norm_quant(x, **fmt.kwargs))
    for r in (0, 5):
        q1, s1 = (_host(a) for a in rms_norm_quant(x[r:r + 1].copy(), **fmt.kwargs))
        assert_bitwise(q1[0], q[r], f"q row {r} alone vs in the batch")
        assert_bitwise(s1[0], scales[r], f"scales row {r} alone vs in the batch")


@pytest.mark.parametrize("vendor,warp", [("cuda", 32), ("hip", 64)])
def test_groups_are_runs_of_lanes_in_every_layout(vendor, warp):
    """For every group size the API takes and N it divides (up to the looped rows), every
    dtype's quantised row layout puts each group's chunks on consecutive lanes of one warp,
    the same for every chunk of a thread: what the kernel's one butterfly per chunk needs."""
    for dtype in DTYPES:
        for g in (16, 32, 64, 128):
            for n in sorted({g, 3 * g, 4096, 5120, 8192, 24576, 65536}):
                if n % g:
                    continue
                layout = _config.quant_row_layout(n, dtype, vendor)
                lanes = g // layout.chunk
                assert _config.group_fits(g, layout.chunk)
                for k in range(layout.chunks_per_thread):
                    chunks = np.arange(layout.threads) + k * layout.threads
                    group_of = chunks // lanes
                    for t0 in range(0, layout.threads, lanes):     # a group's lanes ...
                        run = group_of[t0:t0 + lanes]
                        assert np.all(run == run[0]), (dtype, g, n, k, t0)
                        assert t0 // warp == (t0 + lanes - 1) // warp   # ... in one warp


# ---- the torch custom op ------------------------------------------------------------------------

TORCH_FORMATS = ["group128_fp8", "group64_int8_column", "group128_fp8_ue8m0_column",
                 "static_fp8", "mxfp8", "mxfp4"]


def _torch_case(torch, rng, name, with_residual):
    x = torch.from_numpy(make_x(rng, (6, 256), FLOAT32)).to(torch.bfloat16)
    w = torch.from_numpy(random_array(rng, 256, FLOAT32, loc=1.0, scale=0.5))
    r = torch.from_numpy(make_x(rng, (6, 256), FLOAT32)).to(torch.bfloat16) if (
        with_residual) else None
    kwargs = dict(BY_NAME[name].kwargs)
    if name == "static_fp8":
        kwargs["scale"] = torch.tensor([kwargs["scale"]])
    return x, w, r, kwargs


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_torch_opcheck_and_meta(rng, name):
    """The op passes torch.library.opcheck (fake shapes, dtypes and strides equal the real
    ones) with and without a residual, and meta tensors take the fake implementation."""
    torch = pytest.importorskip("torch")
    from rmsnorm_hip import torch as rt
    for with_residual in (False, True):
        x, w, r, kwargs = _torch_case(torch, rng, name, with_residual)
        scale = kwargs.pop("scale", None)
        args = (x, w, 1e-6, None, r, kwargs.pop("quant_dtype"), 0.0, kwargs.get("group_size"),
                kwargs.get("scale_format", "float32"), kwargs.get("scale_layout", "row"),
                scale, None)
        torch.library.opcheck(torch.ops.rmsnorm_hip.rms_norm_quant_scaled, args)
    x, w, r, kwargs = _torch_case(torch, rng, name, False)
    if "scale" in kwargs:
        kwargs["scale"] = kwargs["scale"].to("meta")
    meta = rt.rms_norm_quant(x.to("meta"), w.to("meta"), **kwargs)
    real = rt.rms_norm_quant(x, w, **{k: (v.cpu() if hasattr(v, "cpu") else v)
                                      for k, v in _torch_case(torch, rng, name, False)[3].items()})
    meta, real = (o if isinstance(o, tuple) else (o,) for o in (meta, real))
    for a, b in zip(meta, real):
        assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), name


def test_torch_compile_fullgraph_bitwise_eager(rng):
    """One compiled graph calling every format (a number as the static scale included) gives
    the eager bits."""
    torch = pytest.importorskip("torch")
    from rmsnorm_hip import torch as rt
    x = torch.from_numpy(make_x(rng, (6, 256), FLOAT32)).to(torch.bfloat16)
    w = torch.from_numpy(random_array(rng, 256, FLOAT32, loc=1.0, scale=0.5))

    def calls(x, w):
        out = []
        for name in TORCH_FORMATS:
            result = rt.rms_norm_quant(x, w, **BY_NAME[name].kwargs)
            out += list(result) if isinstance(result, tuple) else [result]
        return out

    torch._dynamo.reset()
    compiled = torch.compile(calls, backend="aot_eager", fullgraph=True)(x, w)
    eager = calls(x, w)
    assert len(compiled) == len(eager)
    for a, b in zip(compiled, eager):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        assert_bitwise(a.view(torch.uint8).numpy() if a.element_size() == 1 else a.numpy(),
                       b.view(torch.uint8).numpy() if b.element_size() == 1 else b.numpy(),
                       "compiled vs eager")


@pytest.mark.parametrize("scaling,quant", [("ue8m0", "int8"), ("ue8m0", "float8_e4m3fn"),
                                           ("mx", "mxfp8_e4m3"), ("mx", "mxfp4_e2m1")])
def test_power_of_two_scales_at_their_boundaries(scaling, quant):
    """The kernels' scale of a group from its float32 max|y| (kernels/_rowops.make_group_scale,
    compiled for the CPU) against the formula in float64, on max|y| exactly at, one float32
    step around and between the powers of two (times QMAX for UE8M0) over the whole exponent
    range, subnormals and 0 included: the one place where a boundary is decided."""
    import numba

    from rmsnorm_hip import intrinsics
    from rmsnorm_hip.kernels._rowops import make_group_scale
    scale_of = make_group_scale(intrinsics.load("cpu"), scaling, quant)

    @numba.njit
    def scales(amax, stored, inv):
        for i in range(amax.size):
            s, v, _ = scale_of(amax[i])
            stored[i] = s
            inv[i] = v

    base = QMAX.get(quant, 1.0)
    with np.errstate(over="ignore"):
        exact = np.float32(base) * (2.0 ** np.arange(-140, 120)).astype(np.float32)
        amax = np.concatenate([exact, np.nextafter(exact, 0), np.nextafter(exact, np.inf),
                               exact * np.float32(1.3), [0.0, 1e-45, 3e38]]).astype(np.float32)
    amax = amax[np.isfinite(amax)]
    stored = np.empty(amax.size, np.float32 if scaling == "ue8m0" else np.uint8)
    inv = np.empty(amax.size, np.float32)
    scales(amax, stored, inv)
    a = amax.astype(np.float64)
    with np.errstate(divide="ignore"):
        if scaling == "ue8m0":
            k = np.clip(np.ceil(np.log2(a / base)), -127, 127)
            want = np.where(a == 0, 1.0, 2.0 ** k)
            assert np.array_equal(stored.astype(np.float64), want)
            assert np.array_equal(inv.astype(np.float64), 1.0 / want)
        else:
            emax = {"mxfp8_e4m3": 8, "mxfp4_e2m1": 2}[quant]
            e = np.clip(np.where(a == 0, -127, np.floor(np.log2(a)) - emax), -127, 127)
            assert np.array_equal(stored.astype(np.int64), (e + 127).astype(np.int64))
            assert np.array_equal(inv.astype(np.float64), 2.0 ** -e)


@pytest.mark.parametrize("scaling,group,quant", [("group", 128, "float8_e4m3fn"),
                                                 ("mx", 32, "mxfp4_e2m1"),
                                                 ("static", 0, "float8_e4m3fn")])
def test_streamed_rows_register_bound(scaling, group, quant):
    """Streamed scaled rows holding a weight declare 128 registers a thread to CUDA (as many
    blocks per SM as that allows); with a residual, an xscale or no weight, one-shot rows, and
    per-row SmoothQuant: no bound."""
    def spec(n=8192, weight=BFLOAT16, residual=False, xscale="", stream=True, scaling=scaling):
        return _config.fwd_spec(n, BFLOAT16, weight, True, False, residual, quant, xscale,
                                False, stream, vendor="cuda", scaling=scaling,
                                group=group if scaling not in ("static", "") else 0)
    assert _config.launch_bounds(spec()) == (256, 2)
    assert _config.launch_bounds(spec(n=4096)) == (128, 4)
    for other in (spec(weight=""), spec(residual=True), spec(xscale=FLOAT32),
                  spec(stream=False)):
        assert _config.launch_bounds(other) == (None, None), other
    if quant != "mxfp4_e2m1":
        assert _config.launch_bounds(spec(scaling="")) == (None, None)
