"""The 16-bit float codecs of the intrinsics layer (intrinsics/_shared.py), bit for bit against
ml_dtypes (bfloat16) and NumPy (float16): every 16-bit pattern decoded, and float32 special values,
rounding ties at every exponent and 2M random bit patterns encoded (round-to-nearest-even; a NaN
stays a NaN of the same sign).  The CPU namespace runs inside numba.njit loops; a sample also runs
through the simulator namespace (plain Python on NumPy scalars) to show both agree."""
import ml_dtypes
import numba
import numpy as np
import pytest

from rmsnorm_hip import intrinsics, reference

pytestmark = pytest.mark.quick

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
ALL_16BIT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)

CODECS = {  # name: (decode, encode) attribute names, NumPy dtype of the 16-bit format
    "bfloat16": ("bf16_to_f32", "f32_to_bf16", BF16),
    "float16": ("f16_to_f32", "f32_to_f16", F16),
}

# float32 bit patterns with a known 16-bit result; negatives are added by sign_both()
SPECIAL_F32 = [
    0x00000000,                                     # +0
    0x7F800000,                                     # inf
    0x7FC00000, 0x7FC00001, 0x7FFFFFFF,             # quiet NaNs with payloads
    0x7F800001, 0x7FA00000, 0x7FBFFFFF,             # signalling NaNs
    0x00000001, 0x00000002, 0x00007FFF, 0x00008000, 0x00008001, 0x00018000, 0x007FFFFF,  # denormal
    0x00800000, 0x00800001, 0x00FFFFFF,             # smallest normals
    0x3F800000, 0x3F7FFFFF, 0x3F800001,             # 1 and its neighbours
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # bf16 ties: even down, odd up, around
    0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001,  # f16 ties (2**-11 steps) likewise
    0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F0000,  # bf16: max finite rounds to inf, tie too
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  # f16: 65504, just below 65520, 65520, 65536
    0x33000000, 0x33000001, 0x33800000, 0x33C00000, 0x33400000,  # f16 subnormal: 2**-25 ties ..
    0x38800000, 0x387FFFFF, 0x387FF000, 0x38000000,  # f16 smallest normal and just below
    0x3EAAAAAB, 0x40490FDB, 0x4B000001,             # 1/3, pi, 2**23 + 1
]


def sign_both(bits):
    bits = np.asarray(bits, np.uint32)
    return np.concatenate([bits, bits | np.uint32(0x80000000)])


def tie_patterns(rng, size, low_bits):
    """Random sign/exponent/upper mantissa with the dropped low bits set to the values around a
    rounding tie (``low_bits``: the values of the bits the 16-bit format drops)."""
    high = rng.integers(0, 1 << 32, size, dtype=np.uint64).astype(np.uint32)
    mask = np.uint32(max(low_bits))
    mask |= mask >> np.uint32(1)
    for s in (2, 4, 8, 16):
        mask |= mask >> np.uint32(s)
    low = np.asarray(low_bits, np.uint32)[rng.integers(0, len(low_bits), size)]
    return (high & ~mask) | low


def random_f32_bits(rng, size):
    return rng.integers(0, 1 << 32, size, dtype=np.uint64).astype(np.uint32)


@pytest.fixture(scope="module")
def cpu():
    """njit-compiled array maps over the CPU namespace's codecs."""
    intr = intrinsics.load("cpu")
    maps = {}
    for decode_name, encode_name, _ in CODECS.values():
        decode, encode = getattr(intr, decode_name), getattr(intr, encode_name)
        maps[decode_name] = _njit_map(decode, np.float32)
        maps[encode_name] = _njit_map(encode, np.uint16)
    return maps


def _njit_map(fn, out_dtype):
    @numba.njit
    def apply(values):
        out = np.empty(values.size, out_dtype)
        for i in range(values.size):
            out[i] = fn(values[i])
        return out
    return apply


def assert_same_f32(got, expected, what):
    """Bitwise equal, except that a NaN only has to be a NaN of the same sign."""
    got_bits, exp_bits = got.view(np.uint32), expected.view(np.uint32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN positions differ"
    bad = np.flatnonzero((got_bits != exp_bits) & ~nan)
    assert bad.size == 0, (f"{what}: {bad.size} mismatches, first input #{bad[0]}: "
                           f"{got_bits[bad[0]]:#010x} vs {exp_bits[bad[0]]:#010x}")
    assert np.array_equal(got_bits[nan] >> 31, exp_bits[nan] >> 31), f"{what}: NaN signs differ"


def assert_same_16(got_bits, expected, what):
    """16-bit results: bitwise equal to ``expected`` (ml_dtypes/NumPy), a NaN only has to be a
    quiet NaN of the same sign."""
    exp_bits = expected.view(np.uint16)
    nan = np.isnan(expected.astype(np.float32))
    got_nan = np.isnan(got_bits.view(expected.dtype).astype(np.float32))
    assert np.array_equal(got_nan, nan), (
        f"{what}: NaN positions differ at {np.flatnonzero(got_nan != nan)[:5]}")
    bad = np.flatnonzero((got_bits != exp_bits) & ~nan)
    assert bad.size == 0, (f"{what}: {bad.size} mismatches, first input #{bad[0]}: "
                           f"{got_bits[bad[0]]:#06x} vs {exp_bits[bad[0]]:#06x}")
    assert np.array_equal(got_bits[nan] >> 15, exp_bits[nan] >> 15), f"{what}: NaN signs differ"
    quiet_bit = np.uint16(0x0040 if expected.dtype == BF16 else 0x0200)
    assert np.all(got_bits[nan] & quiet_bit), f"{what}: a NaN came out signalling"


@pytest.mark.parametrize("fmt", list(CODECS))
def test_decode_every_pattern(cpu, fmt):
    decode_name, _, dtype = CODECS[fmt]
    got = cpu[decode_name](ALL_16BIT)
    expected = ALL_16BIT.view(dtype).astype(np.float32)
    assert_same_f32(got, expected, f"{decode_name} over all 65536 patterns")


@pytest.mark.parametrize("fmt", list(CODECS))
def test_round_trip_every_pattern(cpu, fmt):
    """Every non-NaN 16-bit value is exactly representable in float32 and encodes back."""
    decode_name, encode_name, dtype = CODECS[fmt]
    keep = ~np.isnan(ALL_16BIT.view(dtype).astype(np.float32))
    back = cpu[encode_name](cpu[decode_name](ALL_16BIT))
    assert np.array_equal(back[keep], ALL_16BIT[keep])


@pytest.mark.parametrize("fmt", list(CODECS))
def test_encode_special_values(cpu, fmt):
    _, encode_name, dtype = CODECS[fmt]
    values = sign_both(SPECIAL_F32).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)
    assert_same_16(cpu[encode_name](values), expected, f"{encode_name} on special values")


@pytest.mark.parametrize("fmt", list(CODECS))
def test_encode_ties_at_every_exponent(cpu, fmt, rng):
    _, encode_name, dtype = CODECS[fmt]
    half = 0x8000 if dtype == BF16 else 0x1000        # half an ulp in the dropped bits
    values = tie_patterns(rng, 200_000, [half - 1, half, half + 1, 0, 2 * half - 1])
    values = values.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)
    assert_same_16(cpu[encode_name](values), expected, f"{encode_name} around ties")


@pytest.mark.parametrize("fmt", list(CODECS))
def test_encode_random_bit_patterns(cpu, fmt, rng):
    _, encode_name, dtype = CODECS[fmt]
    values = random_f32_bits(rng, 2_000_000).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)
    assert_same_16(cpu[encode_name](values), expected, f"{encode_name} on 2M random patterns")


@pytest.mark.parametrize("fmt", list(CODECS))
def test_sim_namespace_agrees(cpu, fmt, rng):
    """The simulator's codecs (the same source run as Python on NumPy scalars) give the CPU
    namespace's bits on a sample: specials, ties and random patterns."""
    sim = intrinsics.load("sim")
    decode_name, encode_name, dtype = CODECS[fmt]
    decode, encode = getattr(sim, decode_name), getattr(sim, encode_name)
    half = 0x8000 if dtype == BF16 else 0x1000
    values = np.concatenate([sign_both(SPECIAL_F32), random_f32_bits(rng, 2000),
                             tie_patterns(rng, 1000, [half - 1, half, half + 1])]).view(np.float32)
    patterns = np.concatenate([ALL_16BIT[rng.integers(0, 1 << 16, 2000)],
                               np.array([0, 0x8000, 0x0001, 0x8001, 0x7C00, 0xFC00, 0x7F80,
                                         0xFF80, 0x7C01, 0x7F81, 0x7FFF, 0xFFFF], np.uint16)])

    got_enc = np.array([encode(v) for v in values], np.uint16)
    got_dec = np.array([decode(p) for p in patterns], np.float32)

    assert_bitwise_u(got_enc, cpu[encode_name](values), f"sim {encode_name} vs cpu")
    assert_bitwise_u(got_dec.view(np.uint32), cpu[decode_name](patterns).view(np.uint32),
                     f"sim {decode_name} vs cpu")


def assert_bitwise_u(got, expected, what):
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, f"{what}: {bad.size} mismatches, first #{bad[0]}: {got[bad[0]]:#x} " \
                          f"vs {expected[bad[0]]:#x}"


# ---- the fused add's packed 16-bit sums -------------------------------------------------------
ADDERS = {"bfloat16": "add_bf16x2", "float16": "add_f16x2"}


def _njit_map2(fn):
    @numba.njit
    def apply(a, b):
        out = np.empty(a.size, np.uint32)
        for i in range(a.size):
            out[i] = fn(a[i], b[i])
        return out
    return apply


def sum_pairs_expected(a, b, dtype):
    """Each 16-bit half of words ``a`` and ``b`` summed exactly (float64 holds any float16 sum;
    a bfloat16 one rounded to 53 bits first rounds to the same bfloat16) and rounded once to
    ``dtype``: the uint16 halves, low then high."""
    out = []
    for shift in (0, 16):
        x = ((a >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16).view(dtype)
        y = ((b >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16).view(dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            out.append((x.astype(np.float64) + y.astype(np.float64)).astype(dtype))
    return out


def near_pairs(rng, size, dtype):
    """Words whose halves are (x, y) with y's exponent 0-13 below x's, either sign: sums that
    carry, cancel and round, ties included, across every exponent."""
    mant, expo = (7, 8) if dtype == BF16 else (10, 5)
    x = rng.integers(0, 1 << 16, size).astype(np.int64)
    e = (x >> mant) & ((1 << expo) - 1)
    e_y = np.clip(e - rng.integers(0, 14, size), 0, (1 << expo) - 2)
    y = (rng.integers(0, 2, size) << 15) | (e_y << mant) | rng.integers(0, 1 << mant, size)
    halves = x.astype(np.uint32), y.astype(np.uint32)
    return (halves[0] | (halves[1] << np.uint32(16)), halves[1] | (halves[0] << np.uint32(16)))


# +-0, the smallest and largest subnormal, the smallest normal, 1, the largest finite, inf, a
# quiet and a signalling NaN
SPECIAL_16 = {BF16: [0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x7F7F, 0x7F80, 0x7FC0, 0x7F81],
              F16: [0x0000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x7C00, 0x7E00, 0x7C01]}


def add_pairs_cases(rng, size, dtype):
    """Word pairs (a, b) for the packed adds: ``size`` random words, ``size`` near pairs, every
    pair of the 1024 smallest magnitudes with either sign (subnormal sums, x + -x, carries
    into the normal range) and every pair of SPECIAL_16 with either sign; each grid pair sits
    in the low halves and, swapped, in the high ones."""
    near_a, near_b = near_pairs(rng, size, dtype)
    grids = []
    for values in (np.arange(1 << 10), np.array(SPECIAL_16[dtype])):
        signed = np.concatenate([values, values | 0x8000]).astype(np.uint32)
        x, y = (v.ravel() for v in np.meshgrid(signed, signed))
        grids.append((x | (y << np.uint32(16)), y | (x << np.uint32(16))))
    return (np.concatenate([random_f32_bits(rng, size), near_a] + [g[0] for g in grids]),
            np.concatenate([random_f32_bits(rng, size), near_b] + [g[1] for g in grids]))


def assert_add_pairs(got, a, b, dtype, what):
    """Words ``got`` hold the exact sums of ``a`` and ``b``'s halves rounded once: bitwise where
    the sum is a number, a quiet NaN where it is NaN (NaN signs are the machine's: x86 makes
    inf - inf negative)."""
    quiet_bit = np.uint16(0x0040 if dtype == BF16 else 0x0200)
    for shift, expected in zip((0, 16), sum_pairs_expected(a, b, dtype)):
        half = ((got >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16)
        nan = np.isnan(expected.astype(np.float32))
        assert np.array_equal(np.isnan(half.view(dtype).astype(np.float32)), nan), \
            f"{what}: NaN positions differ"
        assert np.all(half[nan] & quiet_bit), f"{what}: a NaN came out signalling"
        assert_bitwise_u(half[~nan], expected.view(np.uint16)[~nan], what)


@pytest.mark.parametrize("fmt", list(ADDERS))
def test_add_pairs_round_the_exact_sum_once(fmt, rng):
    """add_bf16x2 / add_f16x2 (the streamed fused add's h, a word at a time) against the exact
    sum rounded once (add_pairs_cases): the CPU's namespace, and the simulator's on a sample."""
    dtype = CODECS[fmt][2]
    a, b = add_pairs_cases(rng, 500_000, dtype)
    got = _njit_map2(getattr(intrinsics.load("cpu"), ADDERS[fmt]))(a, b)
    assert_add_pairs(got, a, b, dtype, ADDERS[fmt])
    sim_add = getattr(intrinsics.load("sim"), ADDERS[fmt])
    pick = rng.integers(0, a.size, 3000)
    with np.errstate(over="ignore", invalid="ignore"):     # inf - inf: NaN, as on a GPU
        sim_got = np.array([sim_add(a[i], b[i]) for i in pick], np.uint32)
    assert_add_pairs(sim_got, a[pick], b[pick], dtype, f"sim {ADDERS[fmt]}")


# ---- the 8-bit quantised encoders ---------------------------------------------------------------
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.fixture(scope="module")
def cpu8():
    intr = intrinsics.load("cpu")
    return {"f32_to_e4m3": _njit_map(intr.f32_to_e4m3, np.uint32),
            "f32_to_i8": _njit_map(intr.f32_to_i8, np.int32),
            "f32_to_e2m1": _njit_map(intr.f32_to_e2m1, np.uint32)}


def e4m3_expected(values):
    """ml_dtypes' float8_e4m3fn rounding (ties to even) of float32 ``values`` saturated to
    +-448 (ml_dtypes turns out-of-range values into NaN; ours saturate, infinities too)."""
    with np.errstate(invalid="ignore"):
        return np.clip(values, -448.0, 448.0).astype(E4M3)


def assert_same_e4m3(got_bits, values, what):
    """uint32 results whose low byte is the e4m3fn encoding: bitwise ml_dtypes' (a NaN only has to
    be a NaN of the same sign), nothing above the low byte."""
    assert not np.any(got_bits >> np.uint32(8)), f"{what}: bits above the low byte"
    got = got_bits.astype(np.uint8)
    expected = e4m3_expected(values).view(np.uint8)
    nan = np.isnan(values)
    assert np.array_equal((got & 0x7F) == 0x7F, nan), f"{what}: NaN positions differ"
    bad = np.flatnonzero((got != expected) & ~nan)
    assert bad.size == 0, (f"{what}: {bad.size} mismatches, first {values[bad[0]]!r}: "
                           f"{got[bad[0]]:#04x} vs {expected[bad[0]]:#04x}")
    assert np.array_equal(got[nan] >> 7, (values[nan].view(np.uint32) >> 31).astype(np.uint8)), \
        f"{what}: NaN signs differ"


def test_e4m3_encode_every_rounding_case(cpu8):
    """Exhaustive over what decides an e4m3fn encoding: every pattern of a float32's upper 16 bits
    (sign, exponent, 7 mantissa bits: the kept bits, the rounding bit and the next bits at every
    exponent, subnormal results included) with the lower 16 bits zero, one, a half-way pattern
    and all ones (lower bits only ever act as a sticky bit)."""
    upper = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    values = np.concatenate([upper | np.uint32(low) for low in (0, 1, 0x8000, 0xFFFF)])
    values = values.view(np.float32)
    assert_same_e4m3(cpu8["f32_to_e4m3"](values), values, "f32_to_e4m3, every rounding case")


def test_e4m3_encode_random_and_every_value(cpu8, rng):
    """2M random float32 patterns; every finite e4m3fn value and the midpoints between
    neighbours (ties to even) encode like ml_dtypes."""
    values = random_f32_bits(rng, 2_000_000).view(np.float32)
    assert_same_e4m3(cpu8["f32_to_e4m3"](values), values, "f32_to_e4m3 on random patterns")
    finite = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    finite = np.sort(finite[np.isfinite(finite)])
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    values = np.concatenate([finite, mids, np.float32([448.0, 464.0, 465.0, 1e9, np.inf])])
    values = np.concatenate([values, -values])
    assert_same_e4m3(cpu8["f32_to_e4m3"](values), values, "f32_to_e4m3 on values and midpoints")
    assert np.all(cpu8["f32_to_e4m3"](np.float32([np.inf, 1e30, 464.0])) == 0x7E), "saturates"


def test_e2m1_encode_random_and_every_midpoint(cpu8, rng):
    """float4 e2m1 codes against the float64 reference's rounding: 2M random float32 patterns,
    and every value, midpoint (ties to the even code) and their float32 neighbours; NaN -> +-6
    and -0 kept (the encoder's own rules); the simulator agrees on a sample."""
    mags = reference.E2M1_MAGNITUDES.astype(np.float32)
    edges = np.concatenate([mags, (mags[1:] + mags[:-1]) / 2, np.float32([7.0, 8.0, 1e30])])
    near = np.concatenate([edges, np.nextafter(edges, np.float32(np.inf)),
                           np.nextafter(edges, np.float32(0.0))])
    values = np.concatenate([random_f32_bits(rng, 2_000_000).view(np.float32), near, -near,
                             rng.uniform(-8, 8, 100_000).astype(np.float32),
                             np.float32([np.inf, -np.inf, 2.0 ** -140, -(2.0 ** -140)])])
    values = values[~np.isnan(values)]
    got = cpu8["f32_to_e2m1"](values)
    assert not np.any(got >> np.uint32(4)), "bits above the nibble"
    want = reference.quantize_e2m1_ref(values.astype(np.float64))
    code = np.searchsorted(reference.E2M1_MAGNITUDES, np.abs(want)).astype(np.uint32)
    expected = code | ((values.view(np.uint32) >> np.uint32(28)) & np.uint32(8))
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, (f"{bad.size} mismatches, first {values[bad[0]]!r}: "
                           f"{got[bad[0]]:#x} vs {expected[bad[0]]:#x}")
    assert cpu8["f32_to_e2m1"](np.float32([np.nan, -np.nan])).tolist() == [0x7, 0xF]
    sim = intrinsics.load("sim")
    sample = np.concatenate([near, -near, values[:2000]])
    assert_bitwise_u(np.array([sim.f32_to_e2m1(v) for v in sample], np.uint32),
                     cpu8["f32_to_e2m1"](sample), "sim f32_to_e2m1 vs cpu")


def test_i8_encode(cpu8, rng):
    """int8 levels: round half to even, saturate at +-127, NaN -> 0."""
    ties = np.arange(-140, 140, dtype=np.float32) + np.float32(0.5)
    near = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)),
                           np.nextafter(ties, -np.float32(np.inf))])
    values = np.concatenate([near, rng.uniform(-300, 300, 100_000).astype(np.float32),
                             np.float32([0.0, -0.0, 127.0, -127.0, 1e30, -1e30, np.inf,
                                         -np.inf])])
    got = cpu8["f32_to_i8"](values)
    expected = np.clip(np.rint(values.astype(np.float64)), -127, 127).astype(np.int32)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, f"{bad.size} mismatches, first {values[bad[0]]!r}: {got[bad[0]]}"
    assert cpu8["f32_to_i8"](np.float32([np.nan, -np.nan])).tolist() == [0, 0]


def test_sim_namespace_agrees_on_8bit_encoders(cpu8, rng):
    sim = intrinsics.load("sim")
    values = np.concatenate([random_f32_bits(rng, 3000).view(np.float32),
                             rng.uniform(-500, 500, 2000).astype(np.float32),
                             np.float32([0.0, -0.0, np.nan, np.inf, -np.inf, 0.5, 1.5, 2.5,
                                         448.0, 464.0, 2.0 ** -10, 2.0 ** -9 * 1.5])])
    got_e4m3 = np.array([sim.f32_to_e4m3(v) for v in values], np.uint32)
    got_i8 = np.array([sim.f32_to_i8(v) for v in values], np.int32)
    assert_bitwise_u(got_e4m3, cpu8["f32_to_e4m3"](values), "sim f32_to_e4m3 vs cpu")
    # the simulator's int8 is CUDA's cvt.rni.sat.s8: the portable levels, but -128 from -127.5 down
    want_i8 = np.where(values <= -127.5, np.int32(-128), cpu8["f32_to_i8"](values))
    assert (values < -127.5).sum() > 100
    assert_bitwise_u(got_i8.view(np.uint32), want_i8.view(np.uint32), "sim f32_to_i8 vs cpu")


def test_mx_pairs_pack_the_element_encoders(rng):
    """mx_pack_e2m1x2 / mx_pack_e4m3x2 outside gfx950 are the element encoders of (lo, hi), lo in
    the low nibble / byte, nothing above the pair: compiled (CPU) and in the simulator."""
    values = np.concatenate([rng.uniform(-600, 600, 2000), rng.uniform(-8, 8, 2000),
                             [0.0, -0.0, 0.25, 0.75, 5.0, 6.0, 464.0, np.inf, -np.inf, np.nan]])
    lo = values.astype(np.float32)
    hi = rng.permutation(lo)
    cpu, sim = intrinsics.load("cpu"), intrinsics.load("sim")

    def pack_all(pack, encode, width):
        @numba.njit
        def run(lo, hi):
            got = np.empty(lo.size, np.uint32)
            expected = np.empty(lo.size, np.uint32)
            for i in range(lo.size):
                got[i] = pack(lo[i], hi[i])
                expected[i] = encode(lo[i]) | (encode(hi[i]) << np.uint32(width))
            return got, expected
        return run(lo, hi)

    for name, element, width in (("mx_pack_e2m1x2", "f32_to_e2m1", 4),
                                 ("mx_pack_e4m3x2", "f32_to_e4m3", 8)):
        got, expected = pack_all(getattr(cpu, name), getattr(cpu, element), width)
        assert_bitwise_u(got, expected, f"cpu {name}")
        assert not np.any(got >> np.uint32(2 * width)), f"{name}: bits above the pair"
        got_sim = np.array([getattr(sim, name)(a, b) for a, b in zip(lo[:500], hi[:500])],
                           np.uint32)
        assert_bitwise_u(got_sim, got[:500], f"sim vs cpu {name}")


def test_max_nan():
    """The NaN-winning max of warp_max and the row max, in both namespaces."""
    for intr in (intrinsics.load("sim"), intrinsics.load("cpu")):
        max_nan = intr.max_nan if intr.name == "sim" else numba.njit(
            lambda a, b, f=intr.max_nan: f(a, b))
        one, two, nan = np.float32(1), np.float32(2), np.float32(np.nan)
        assert max_nan(one, two) == 2 and max_nan(two, one) == 2
        assert np.isnan(max_nan(nan, one)) and np.isnan(max_nan(one, nan))


# ---- the declared interface (intrinsics.COMMON / GPU / FEATURES) ----------------------------

@pytest.mark.parametrize("name,warp,features", [("cpu", None, set()),
                                                ("sim", 32, {"gpu", "max_abs_nan"}),
                                                ("sim", 64, {"gpu", "max_abs_nan"})])
def test_namespaces_provide_exactly_the_declared_names(name, warp, features):
    namespace = intrinsics.load(name, warp)     # load checks the declaration
    assert set(namespace.features) == features
    assert intrinsics.COMMON <= set(vars(namespace))


def test_cuda_namespace_provides_the_declared_names():
    """numba-cuda's namespace, built in a subprocess with the simulator off (no GPU needed)."""
    import os
    import subprocess
    import sys
    code = ("from rmsnorm_hip import intrinsics; n = intrinsics.load('cuda'); "
            "print(sorted(n.features), n.warp)")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode and "libnvvm" in done.stderr.lower():
        pytest.skip("numba-cuda's NVVM is not installed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["['gpu',", "'max_abs_nan']", "32"]


def test_check_refuses_missing_and_undeclared_names():
    from types import SimpleNamespace
    good = vars(intrinsics.load("cpu"))
    missing = SimpleNamespace(**{k: v for k, v in good.items() if k != "warp_sum"})
    with pytest.raises(TypeError, match=r"missing \['warp_sum'\]"):
        intrinsics.check(missing)
    extra = SimpleNamespace(**good, load_b128=None)
    with pytest.raises(TypeError, match=r"undeclared \['load_b128'\]"):
        intrinsics.check(extra)
    unknown = SimpleNamespace(**{**good, "features": frozenset({"tensor_cores"})})
    with pytest.raises(TypeError, match=r"unknown features \['tensor_cores'\]"):
        intrinsics.check(unknown)
