"""qk_rms_norm_ and qk_rms_norm (QK-norm: the head rows of q and k normalised in one launch, then
optionally rotated by RoPE) on NumPy arrays (CPU backend; a path-complete few cases on the
simulator) and on torch CPU tensors, against a float64 reference written here from docs/api.md:

    r = 1 / sqrt(mean(v**2) + eps) per head row,   y = v * r * (weight + weight_offset)
    RoPE on y[:rot] with c = cos_sin_cache[pos, :rot/2], s = cos_sin_cache[pos, rot/2:]:
      neox  halves (y1, y2)        -> (y1 c - y2 s, y2 c + y1 s)
      gptj  pairs (y[2i], y[2i+1]) -> (y_e c - y_o s, y_o c + y_e s)

q and k are views into one QKV buffer, as a model has them: the v part and row padding keep
their bits, in place == out of place bitwise, without RoPE each head row is bitwise rms_norm's
of that row, and a token's bits do not depend on the batch around it.  The simulator follows
the GPU's semantics (a position outside the cache: NaN over the token's rotated elements)."""
import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
from conftest import (BFLOAT16, DTYPES, FLOAT16, FLOAT32, NUMPY, aligned_empty, assert_bitwise,
                      assert_close, full_tier_except, random_array)
from test_sim import launched_specs, sim  # noqa: F401  (sim is a fixture)

from rmsnorm_hip import qk_rms_norm, qk_rms_norm_, rms_norm
from rmsnorm_hip.backends import cpu as cpu_backend
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import to_float64

pytestmark = pytest.mark.quick

EPS = 1e-6
MAX_POSITION = 40           # rows of the cos / sin cache
HEAD_SIZES = (64, 80, 96, 128, 256)
ROPES = (None, "neox", "gptj")


def partial_rot(d):
    """A partial rotary_dim: half the head, rounded down to even."""
    return d // 2 - (d // 2) % 2


# ---- the float64 reference --------------------------------------------------------------------

def rope_ref(y, positions, cache, rot, style):
    """``y`` (T, H, D) float64 with the first ``rot`` columns of each token's rows rotated by
    its position (``cache``: (max_position, rot), cos then sin)."""
    y = y.copy()
    table = to_float64(cache)[np.asarray(positions).reshape(-1)]            # (T, rot)
    c, s = table[:, None, :rot // 2], table[:, None, rot // 2:rot]
    if style == "neox":
        a, b = y[..., :rot // 2].copy(), y[..., rot // 2:rot].copy()
        y[..., :rot // 2], y[..., rot // 2:rot] = a * c - b * s, b * c + a * s
    else:
        a, b = y[..., 0:rot:2].copy(), y[..., 1:rot:2].copy()
        y[..., 0:rot:2], y[..., 1:rot:2] = a * c - b * s, b * c + a * s
    return y


def qk_ref(x, weight, eps=EPS, weight_offset=0.0, positions=None, cache=None, rot=None,
           style="neox"):
    """float64 QK-norm of ``x`` (..., H, D) from its rounded values: every head row normalised
    and weighted, then (with ``positions``) rotated over its first ``rot`` (default D)
    elements."""
    x64 = to_float64(x)
    shape = x64.shape
    x64 = x64.reshape((-1,) + shape[-2:])
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    y = x64 * r * (to_float64(weight) + weight_offset)
    if positions is not None:
        y = rope_ref(y, positions, cache, rot or shape[-1], style)
    return y.reshape(shape)


def test_reference_rotates_as_documented():
    """The reference itself on hand-made numbers: a quarter turn per pair, neox halves against
    gptj pairs, and elements past rotary_dim left alone."""
    y = np.array([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]])
    quarter = np.array([[0.0, 0.0, 1.0, 1.0]])             # cos 0, sin 1: (a, b) -> (-b, a)
    neox = rope_ref(y, [0], quarter, 4, "neox")
    gptj = rope_ref(y, [0], quarter, 4, "gptj")
    np.testing.assert_array_equal(neox, [[[-3.0, -4.0, 1.0, 2.0, 5.0, 6.0]]])
    np.testing.assert_array_equal(gptj, [[[-2.0, 1.0, -4.0, 3.0, 5.0, 6.0]]])
    x = np.array([[[3.0, 4.0]]])                            # rms 5 / sqrt(2)
    np.testing.assert_allclose(qk_ref(x, np.array([1.0, 2.0]), eps=0.0),
                               [[[0.6 * math.sqrt(2), 1.6 * math.sqrt(2)]]])


# ---- inputs -------------------------------------------------------------------------------------

def qkv_views(buf, hq, hk, d):
    """q (..., hq, d) and k (..., hk, d): views into the QKV buffer ``buf`` (..., width)."""
    lead = buf.shape[:-1]
    q = buf[..., :hq * d].reshape(lead + (hq, d))
    k = buf[..., hq * d:(hq + hk) * d].reshape(lead + (hk, d))
    assert np.shares_memory(q, buf) and np.shares_memory(k, buf), "reshape copied"
    return q, k


def make_qkv(rng, dtype, lead, hq, hk, d, pad=0, offset=0):
    """(buffer, q, k): a QKV buffer of rows q | k | v | pad per token (v has hk heads), 64-byte
    aligned plus ``offset`` bytes.  Each head row has its own magnitude (10**[-2, 2]), so rows
    leaking into each other show; the v part and pad hold other values that must keep their
    bits.  ``pad`` odd: token strides are not a multiple of 16 bytes (the scalar kernel)."""
    t, heads = math.prod(lead), hq + 2 * hk
    x = random_array(rng, (t, heads, d), FLOAT32)
    x *= (10.0 ** rng.uniform(-2, 2, (t, heads, 1))).astype(np.float32)
    buf = aligned_empty(lead + (heads * d + pad,), dtype, offset=offset)
    buf[..., :heads * d] = x.reshape(lead + (heads * d,)).astype(NUMPY[dtype])
    buf[..., heads * d:] = random_array(rng, lead + (pad,), dtype, loc=-7.0)
    return (buf,) + qkv_views(buf, hq, hk, d)


def make_weights(rng, d, dtype, offset):
    """(q_weight, k_weight): around 1, or around 0 with a weight offset (Gemma's 1 + w)."""
    loc, scale = (0.0, 0.1) if offset else (1.0, 0.5)
    return tuple(random_array(rng, d, dtype, loc=loc, scale=scale) for _ in range(2))


def make_cache(rng, rot, dtype, max_position=MAX_POSITION):
    """(max_position, rot): cos of random angles, then their sin, rounded to ``dtype``.  Random
    angles rather than a model's frequencies: every (position, pair) rotates by its own angle,
    so a cache entry read from the wrong place shows."""
    angles = rng.uniform(0.0, 2 * np.pi, (max_position, rot // 2))
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(NUMPY[dtype])


@dataclass(frozen=True)
class QkCase:
    dtype: str
    d: int
    rope: str = None            # None | "neox" | "gptj"
    weight: str = None          # q_weight / k_weight dtype; None: q's
    partial: bool = False       # rotary_dim = partial_rot(d), else None (all of D)
    cache: str = FLOAT32        # cos_sin_cache dtype
    positions: str = "int64"
    offset: float = 0.0         # weight_offset
    heads: tuple = (4, 2)       # (Hq, Hk)
    lead: tuple = (7,)          # leading shape (T tokens)
    pad: int = 0                # elements after each token's q | k | v

    @property
    def wdtype(self):
        return self.weight or self.dtype

    @property
    def rotary_dim(self):
        return partial_rot(self.d) if self.rope and self.partial else None

    @property
    def rot(self):
        """Elements rotated per head row (0 without RoPE)."""
        return (self.rotary_dim or self.d) if self.rope else 0

    @property
    def halves(self):
        """Whether the GPU kernel takes the layout in halves (neox over the whole head)."""
        return _config.qk_halves(self.d, self.dtype, self.rope, self.rot)

    @property
    def id(self):
        rope = "none"
        if self.rope:
            rope = (f"{self.rope}{self.rotary_dim or ''}-cache_{self.cache}-{self.positions}")
        return (f"{self.dtype}-w_{self.wdtype}-D{self.d}-{rope}-H{self.heads[0]}_"
                f"{self.heads[1]}-T{'x'.join(map(str, self.lead))}"
                + (f"-pad{self.pad}" if self.pad else "")
                + (f"-offset{self.offset:g}" if self.offset else ""))


@dataclass
class Call:
    """One case's arrays: the QKV buffer with its q and k views, weights, RoPE keywords."""
    case: QkCase
    buf: np.ndarray
    q: np.ndarray
    k: np.ndarray
    q_weight: np.ndarray
    k_weight: np.ndarray
    rope: dict

    @classmethod
    def make(cls, rng, case, positions=None):
        hq, hk = case.heads
        buf, q, k = make_qkv(rng, case.dtype, case.lead, hq, hk, case.d, case.pad)
        q_weight, k_weight = make_weights(rng, case.d, case.wdtype, case.offset)
        rope = {}
        if case.rope:
            if positions is None:
                positions = rng.integers(0, MAX_POSITION, case.lead)
            rope = dict(positions=np.asarray(positions).astype(case.positions),
                        cos_sin_cache=make_cache(rng, case.rot, case.cache),
                        rope_style=case.rope, rotary_dim=case.rotary_dim)
        return cls(case, buf, q, k, q_weight, k_weight, rope)

    @property
    def kwargs(self):
        return dict(weight_offset=self.case.offset, **self.rope)

    def arrays(self):
        """Every array the calls read: they must keep their bits (but q and k in place)."""
        return [self.buf, self.q_weight, self.k_weight] + [
            a for a in self.rope.values() if isinstance(a, np.ndarray)]

    def out_of_place(self, q=None, k=None):
        return qk_rms_norm(self.q if q is None else q, self.k if k is None else k,
                           self.q_weight, self.k_weight, EPS, **self.kwargs)

    def in_place(self, q=None, k=None):
        return qk_rms_norm_(self.q if q is None else q, self.k if k is None else k,
                            self.q_weight, self.k_weight, EPS, **self.kwargs)

    def ref(self, x, weight):
        c = self.case
        return qk_ref(x, weight, EPS, c.offset, self.rope.get("positions"),
                      self.rope.get("cos_sin_cache"), c.rotary_dim, c.rope)


def check_call(call):
    """The contract of one case on the current backend: q_out and k_out new, contiguous, within
    the numerical contract of the float64 reference, the inputs untouched; in place the same
    bits written into the QKV buffer and nothing else; the unrotated elements (all of them
    without RoPE) bitwise rms_norm's of each head row.  Returns (q_out, k_out)."""
    c = call.case
    hq, hk = c.heads
    before = [a.copy() for a in call.arrays()]
    q0, k0 = qkv_views(before[0], hq, hk, c.d)

    q_out, k_out = call.out_of_place()

    for out, x in ((q_out, call.q), (k_out, call.k)):
        assert type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape
        assert out.flags.c_contiguous and not np.shares_memory(out, call.buf)
    for a, b in zip(call.arrays(), before):
        assert_bitwise(a, b, "an input after the out-of-place call")
    assert_close(q_out, call.ref(q0, call.q_weight), c.dtype)
    assert_close(k_out, call.ref(k0, call.k_weight), c.dtype)

    assert call.in_place() is None
    assert_bitwise(call.q, q_out, "q in place vs q_out")
    assert_bitwise(call.k, k_out, "k in place vs k_out")
    cols = (hq + hk) * c.d
    assert_bitwise(call.buf[..., cols:], before[0][..., cols:], "the v part and padding")
    for a, b in zip(call.arrays()[1:], before[1:]):
        assert_bitwise(a, b, "a weight, positions or the cache after the in-place call")

    for out, x, w, name in ((q_out, q0, call.q_weight, "q"), (k_out, k0, call.k_weight, "k")):
        rows = rms_norm(np.ascontiguousarray(x).reshape(-1, c.d), w, EPS, weight_offset=c.offset)
        assert_bitwise(out.reshape(-1, c.d)[:, c.rot:], rows[:, c.rot:],
                       f"{name}'s unrotated elements vs rms_norm of its head rows")
    return q_out, k_out


# ---- the CPU matrix -----------------------------------------------------------------------------
# dtype x head size x RoPE style; each other setting walks its column of ROTATION over the five
# head sizes at its own pace (and shifted per dtype and style), so that each (dtype, style) meets
# each setting both ways, in changing company
ROTATION = {
    "partial": (False, True, False, True, True),
    "same_cache": (False, True, True, False, True),      # cos_sin_cache in q's dtype
    "int32": (False, True, False, True, False),          # positions int32 (else int64)
    "offset": (0.0, 1.0, 1.0, 0.0, 0.0),
    "f32_weight": (False, True, False, True, False),     # float32 weights for 16-bit q
    "heads": ((4, 2), (3, 1), (4, 2), (3, 1), (4, 2)),
    "lead": ((7,), (1,), (2, 3), (7,), (7,)),
    "pad": (0, 3, 1, 0, 3),
}


def matrix():
    cases = []
    for a, dtype in enumerate(DTYPES):
        for b, rope in enumerate(ROPES):
            for j, d in enumerate(HEAD_SIZES):
                v = {name: column[(j * (1 + p % 4) + a + 2 * b + p) % 5]
                     for p, (name, column) in enumerate(ROTATION.items())}
                cases.append(QkCase(
                    dtype, d, rope, weight=FLOAT32 if v["f32_weight"] else None,
                    partial=v["partial"], cache=dtype if v["same_cache"] else FLOAT32,
                    positions="int32" if v["int32"] else "int64", offset=v["offset"],
                    heads=v["heads"], lead=v["lead"], pad=v["pad"]))
    return cases


MATRIX = matrix()
# the default tier's representatives (their kernels serve the other default-tier tests too)
QUICK = {
    "float32-w_float32-D96-none-H4_2-T2x3-offset1",
    "float16-w_float16-D128-neox64-cache_float32-int64-H4_2-T7-pad1",
    "bfloat16-w_float32-D80-gptj-cache_bfloat16-int32-H3_1-T7-pad1",
}

def matrix_params(cases, quick):
    params = []
    for c in cases:
        marks = [] if quick(c) else [pytest.mark.full]
        params.append(pytest.param(c, marks=marks, id=c.id))
    return params


def test_quick_cases_cover_each_setting():
    """The default tier's few cases still take every style and each setting both ways (a lone
    token: test_batch_invariance)."""
    quick = [c for c in MATRIX if c.id in QUICK]
    assert len(quick) == len(QUICK), QUICK - {c.id for c in MATRIX}
    roped = [c for c in quick if c.rope]
    assert {c.dtype for c in quick} == set(DTYPES) and {c.rope for c in quick} == set(ROPES)
    for values in ({c.partial for c in roped}, {c.cache == FLOAT32 for c in roped},
                   {c.positions for c in roped}, {c.offset for c in quick},
                   {c.pad > 0 for c in quick}, {c.heads for c in quick},
                   {len(c.lead) for c in quick}, {c.weight for c in quick if c.dtype != FLOAT32}):
        assert len(values) == 2, values


def test_matrix_covers_the_contract():
    """Every dtype x head size x style, and each other setting both ways for each dtype and
    style."""
    assert {(c.dtype, c.d, c.rope) for c in MATRIX} == {
        (a, d, r) for a in DTYPES for d in HEAD_SIZES for r in ROPES}
    for dtype in DTYPES:
        for rope in ROPES:
            cases = [c for c in MATRIX if c.dtype == dtype and c.rope == rope]
            settings = {"offset": {c.offset for c in cases}, "T": {c.lead for c in cases},
                        "pad": {c.pad > 0 for c in cases},
                        "heads": {c.heads for c in cases}}
            if rope:
                settings.update(partial={c.partial for c in cases},
                                positions={c.positions for c in cases})
            if dtype != FLOAT32:
                settings["weight"] = {c.wdtype for c in cases}
                if rope:
                    settings["cache"] = {c.cache for c in cases}
            for name, values in settings.items():
                assert len(values) >= 2, (dtype, rope, name, values)
            assert {(7,), (1,), (2, 3)} <= settings["T"], (dtype, rope)
            assert any(c.heads[0] != c.heads[1] for c in cases)


@pytest.mark.parametrize("case", matrix_params(MATRIX, lambda c: c.id in QUICK))
def test_matches_reference(rng, case):
    check_call(Call.make(rng, case))


# ---- the same on the simulator: path-complete, small ---------------------------------------------

# (case, what it covers); rows per block: float32 D=256 2 (64 threads: two warps; halves: 32
# threads), float32 D=80 4 (32 threads, 20 chunks: idle threads), 16-bit D=80 8, D=128 8, D=64
# 16 (halves: 4 threads)
SIM_CASES = [
    (QkCase(FLOAT32, 256, "neox", heads=(2, 1), lead=(1,)),
     "vector, halves over a warp's 32 threads, a dead row in the last block"),
    (QkCase(BFLOAT16, 80, "gptj", weight=FLOAT32, partial=True, cache=BFLOAT16,
            positions="int32", offset=1.0, heads=(4, 2), lead=(2,), pad=3),
     "scalar, 16-bit cache, int32 positions, partial, 6 of 8 rows live"),
    (QkCase(FLOAT16, 128, None, heads=(3, 1), lead=(1,)),
     "vector, no RoPE: rms_norm's bits"),
    (QkCase(FLOAT32, 80, "neox", partial=True, positions="int32", heads=(3, 2), lead=(2,),
            pad=1),
     "scalar, idle threads, neox partners past a partial rotary_dim, 5 rows over 2 blocks"),
    (QkCase(FLOAT16, 96, "gptj", cache=FLOAT16, heads=(3, 1), lead=(1,)),
     "vector gptj, 16-bit cache"),
    (QkCase(BFLOAT16, 64, "neox", weight=FLOAT32, heads=(4, 2), lead=(2, 3), offset=1.0),
     "vector, positions of a 2-D leading shape"),
    (QkCase(FLOAT32, 128, None, heads=(4, 2), lead=(2,), pad=1, offset=1.0),
     "scalar, no RoPE"),
    (QkCase(BFLOAT16, 80, "neox", partial=True, heads=(4, 2), lead=(1,)),
     "aligned, but a neox rotary_dim (40) of two and a half chunk pairs: scalar"),
    (QkCase(FLOAT16, 128, "neox", partial=True, heads=(3, 2), lead=(2,)),
     "vector, partners by shuffles (a rotary_dim of a power of two of chunk pairs, not all D)"),
]
SIM_QUICK = {SIM_CASES[0][0].id, SIM_CASES[1][0].id, SIM_CASES[2][0].id}


def vector_form(case):
    """Whether the GPU kernel takes 128-bit accesses: 16-byte token strides (a lone token's
    stride does not matter; the buffers start aligned), and for neox a rotary_dim of a power of
    two pairs of chunks (its cos / sin come by 128-bit loads, partners a power of two lanes
    away)."""
    chunk = 16 // NUMPY[case.dtype].itemsize
    lanes, ragged = divmod(case.rot, 2 * chunk)
    return ((case.pad == 0 or math.prod(case.lead) == 1)
            and not (case.rope == "neox" and (ragged or lanes & (lanes - 1))))


def test_sim_cases_cover_every_form():
    cases = [c for c, _ in SIM_CASES]
    assert {(c.rope, vector_form(c)) for c in cases} >= {
        ("neox", True), ("neox", False), ("gptj", True), ("gptj", False), (None, True),
        (None, False)}
    # halves, scalar: the vector halves cases' misaligned twins
    assert {(vector_form(c), c.halves) for c in cases if c.rope == "neox"} == {
        (True, True), (True, False), (False, False)}
    assert {(c.dtype, c.d) for c in cases} >= {(FLOAT32, 256), (FLOAT32, 80), (BFLOAT16, 80)}
    quick = [c for c in cases if c.id in SIM_QUICK]
    assert {c.rope for c in quick} == set(ROPES)
    assert {vector_form(c) for c in quick} == {True, False}
    for c in cases:     # some block holds rows past the last head
        rows = _config.qk_rows(_config.qk_layout(c.d, c.dtype, c.halves), c.halves)
        assert sum(c.heads) % rows, c.id


@pytest.mark.sim
@pytest.mark.parametrize("case", matrix_params([c for c, _ in SIM_CASES],
                                               lambda c: c.id in SIM_QUICK))
def test_sim_matches_reference(sim, rng, case):  # noqa: F811
    """The kernel (kernels/qk_norm.py) that ran: rms_norm's row layout for N = D (or the layout
    in halves), its rows per block, the access form the buffer allows; then check_call's contract;
    a vector case's buffer one element off its alignment (the scalar kernel) gives the same
    bits."""
    be = sim(32)
    call = Call.make(rng, case)
    original = call.buf.copy()
    layout = _config.qk_layout(case.d, case.dtype, case.halves)
    assert case.halves or layout == _config.row_layout(case.d, case.dtype)
    with launched_specs(be) as specs:
        q_out, k_out = check_call(call)
    qk_specs = [s for s in specs if isinstance(s, _config.QkSpec)]
    assert len(qk_specs) == 2, specs                    # out of place, in place
    for spec in qk_specs:
        assert spec.layout == layout and spec.halves == case.halves, spec
        assert spec.rows == _config.qk_rows(layout, case.halves), spec
        assert spec.vector == vector_form(case), spec
        assert (spec.dtype, spec.weight, spec.rope) == (case.dtype, case.wdtype,
                                                         case.rope or ""), spec
        assert (spec.cache, spec.positions) == ((case.cache, case.positions) if case.rope
                                                else ("", "")), spec
    if vector_form(case):
        twin = aligned_empty(original.shape, case.dtype, offset=NUMPY[case.dtype].itemsize)
        twin[...] = original
        with launched_specs(be) as specs:
            q_twin, k_twin = call.out_of_place(*qkv_views(twin, *case.heads, case.d))
        assert [s.vector for s in specs] == [False], specs
        assert_bitwise(q_twin, q_out, "q_out from the misaligned buffer (scalar) vs vector")
        assert_bitwise(k_twin, k_out, "k_out from the misaligned buffer (scalar) vs vector")
    if vector_form(case) and case.rope == "neox":   # a cache one element off its alignment
        cache = call.rope["cos_sin_cache"]
        shifted = aligned_empty(cache.shape, case.cache, offset=NUMPY[case.cache].itemsize)
        shifted[...] = cache
        buf = aligned_empty(original.shape, case.dtype)
        buf[...] = original
        q, k = qkv_views(buf, *case.heads, case.d)
        with launched_specs(be) as specs:
            q_twin, k_twin = qk_rms_norm(q, k, call.q_weight, call.k_weight, EPS,
                                         **dict(call.kwargs, cos_sin_cache=shifted))
        assert [s.vector for s in specs] == [False], specs
        assert_bitwise(q_twin, q_out, "q_out with a misaligned cache (scalar) vs vector")
        assert_bitwise(k_twin, k_out, "k_out with a misaligned cache (scalar) vs vector")


@pytest.mark.sim
@pytest.mark.parametrize("case", [
    pytest.param(SIM_CASES[2][0], id="no_rope", marks=pytest.mark.full),
    pytest.param(SIM_CASES[0][0], id="neox")])
def test_sim_bare_cuda_array_interface(sim, rng, case):  # noqa: F811
    """Every array a bare __cuda_array_interface__ object (tests/test_sim_flavours.py's; under
    the simulator it points at host memory), q and k views of the QKV buffer: the NumPy call's
    bits, out of place (arrays of the interface back) and in place."""
    from test_sim_flavours import CAIOnly, values
    sim(32)
    call = Call.make(rng, case)
    q_out, k_out = call.out_of_place()

    def cai(a):
        return CAIOnly(a.view(np.uint16) if a.dtype == NUMPY[BFLOAT16] else a)

    kwargs = dict(call.kwargs, dtype=BFLOAT16 if case.dtype == BFLOAT16 else None,
                  **{name: cai(a) for name, a in call.rope.items() if isinstance(a, np.ndarray)})
    weights = cai(call.q_weight), cai(call.k_weight)
    q_cai, k_cai = qk_rms_norm(cai(call.q), cai(call.k), *weights, EPS, **kwargs)
    assert_bitwise(values(q_cai, case.dtype), q_out, "q_out of interface arrays")
    assert_bitwise(values(k_cai, case.dtype), k_out, "k_out of interface arrays")
    assert qk_rms_norm_(cai(call.q), cai(call.k), *weights, EPS, **kwargs) is None
    assert_bitwise(call.q, q_out, "q in place through the interface")
    assert_bitwise(call.k, k_out, "k in place through the interface")


# ---- batch invariance, rows that hold NaN, positions' shapes ------------------------------------
# the quick bf16 gptj case's kernels (CPU) and the scalar bf16 simulator case's (sim)
INVARIANCE_CASE = SIM_CASES[1][0]


@pytest.mark.parametrize("backend_name", [
    "cpu", pytest.param("sim", marks=[pytest.mark.sim, pytest.mark.full])])
def test_batch_invariance(rng, use_backend, backend_name):
    """A token's outputs are the bits of that token alone (T=1) wherever it sits among 33
    tokens; on the CPU also in a batch large enough for the threaded kernel."""
    use_backend(backend_name)
    case = INVARIANCE_CASE
    hq, hk = case.heads
    # on the CPU, a batch past PARALLEL_MIN_ELEMENTS: split over threads
    threaded = -(-cpu_backend.PARALLEL_MIN_ELEMENTS // ((hq + hk) * case.d)) + 1
    for t in [33] + ([threaded] if backend_name == "cpu" else []):
        batch = Call.make(rng, replace(case, lead=(t,)))
        q_out, k_out = batch.out_of_place()
        for i in sorted({0, 16, t - 1}):
            buf, q, k = make_qkv(rng, case.dtype, (1,), hq, hk, case.d, case.pad)
            q[...], k[...] = batch.q[i:i + 1], batch.k[i:i + 1]
            rope = dict(batch.rope, positions=batch.rope["positions"][i:i + 1])
            alone = qk_rms_norm(q, k, batch.q_weight, batch.k_weight, EPS,
                                weight_offset=case.offset, **rope)
            assert_bitwise(alone[0][0], q_out[i], f"q of token {i} alone vs in {t} tokens")
            assert_bitwise(alone[1][0], k_out[i], f"k of token {i} alone vs in {t} tokens")
        assert_close(q_out, batch.ref(batch.q, batch.q_weight), case.dtype)
        assert_close(k_out, batch.ref(batch.k, batch.k_weight), case.dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_stay_in_their_head_row(rng, bad):
    """A NaN or Inf in one head row of q reaches that row's outputs (a NaN: all of them) and no
    other row: the token's other q heads, its k heads and the other tokens keep their bits."""
    call = Call.make(rng, replace(INVARIANCE_CASE, lead=(5,)))
    q_clean, k_clean = call.out_of_place()
    dirty = call.buf.copy()
    q, k = qkv_views(dirty, *call.case.heads, call.case.d)
    q[2, 1, 7] = bad

    q_out, k_out = call.out_of_place(q, k)

    row = q_out[2, 1].astype(np.float32)
    assert np.isnan(row).all() if np.isnan(bad) else np.isnan(row[7])
    others = np.ones(q_out.shape[:2], bool)
    others[2, 1] = False
    assert_bitwise(q_out[others], q_clean[others], "q's other head rows")
    assert_bitwise(k_out, k_clean, "k")


@pytest.mark.parametrize("backend_name", [
    pytest.param("cpu"),
    pytest.param("sim", marks=[pytest.mark.sim, pytest.mark.full])])
def test_positions_of_the_leading_shape(rng, use_backend, backend_name):
    """q (2, 3, H, D) with positions (2, 3), the documented shape: the bits of the same tokens
    flattened to (6, H, D) with positions (6,)."""
    use_backend(backend_name)
    case = replace(INVARIANCE_CASE, lead=(2, 3))
    call = Call.make(rng, case)
    assert call.rope["positions"].shape == (2, 3)

    q_out, k_out = call.out_of_place()

    flat = dict(call.rope, positions=call.rope["positions"].reshape(-1))
    q_flat, k_flat = qk_rms_norm(call.q.reshape(6, *call.q.shape[2:]),
                                 call.k.reshape(6, *call.k.shape[2:]), call.q_weight,
                                 call.k_weight, EPS, weight_offset=case.offset, **flat)
    assert q_out.shape == call.q.shape and k_out.shape == call.k.shape
    assert_bitwise(q_out.reshape(q_flat.shape), q_flat, "q with positions (2, 3) vs (6,)")
    assert_bitwise(k_out.reshape(k_flat.shape), k_flat, "k with positions (2, 3) vs (6,)")
    assert_close(q_out, call.ref(call.q, call.q_weight), case.dtype)


def _separate_buffers(call, rng):
    """q a contiguous array of its own; k in another buffer at another token stride, one
    element past its alignment."""
    d, hk = call.case.d, call.case.heads[1]
    kb = aligned_empty(call.k.shape[:-2] + (hk * d + 5,), call.case.dtype, offset=2)
    kb[...] = random_array(rng, kb.shape, call.case.dtype, loc=-7.0)
    k = kb[..., 1:1 + hk * d].reshape(call.k.shape)
    k[...] = call.k
    return np.ascontiguousarray(call.q), k, {}


def _padded_heads(call, rng):
    """q's heads D + 3 elements apart within a token."""
    qb = random_array(rng, call.q.shape[:-1] + (call.case.d + 3,), call.case.dtype, loc=-7.0)
    q = qb[..., :call.case.d]
    q[...] = call.q
    return q, call.k, {}


def _heads_major(call, rng):
    """q's memory ordered (heads, tokens, D): the token stride is smaller than the head
    stride."""
    return np.ascontiguousarray(call.q.swapaxes(0, 1)).swapaxes(0, 1), call.k, {}


def _strided_cache_rows(call, rng):
    """cos_sin_cache rows a slice of a wider table."""
    cache = call.rope["cos_sin_cache"]
    wide = random_array(rng, (cache.shape[0], cache.shape[1] + 6), cache.dtype)
    wide[:, 3:3 + cache.shape[1]] = cache
    return call.q, call.k, dict(cos_sin_cache=wide[:, 3:3 + cache.shape[1]])


def _one_row_cache(call, rng):
    """Every token at position 0 of a one-row cache holding row p: the bits of position p."""
    p = int(call.rope["positions"][1])
    call.rope["positions"][:] = p
    return call.q, call.k, dict(cos_sin_cache=call.rope["cos_sin_cache"][p:p + 1].copy(),
                                positions=np.zeros_like(call.rope["positions"]))


LAYOUTS = {"separate_buffers": _separate_buffers, "padded_heads": _padded_heads,
           "heads_major": _heads_major, "strided_cache_rows": _strided_cache_rows,
           "one_row_cache": _one_row_cache}


@pytest.mark.parametrize("backend_name", [
    "cpu", pytest.param("sim", marks=[pytest.mark.sim, pytest.mark.full])])
@pytest.mark.parametrize("layout", full_tier_except(
    list(LAYOUTS), lambda name: name in ("padded_heads", "one_row_cache")))
def test_layouts_give_the_bits_of_the_qkv_views(rng, use_backend, backend_name, layout):
    """Layout invariance: q and k from other buffers and strides, and other cache layouts, give
    bitwise the QKV views' results, in place and out of place."""
    use_backend(backend_name)
    call = Call.make(rng, replace(INVARIANCE_CASE, lead=(3,)))
    q, k, rope = LAYOUTS[layout](call, rng)
    q_expected, k_expected = call.out_of_place()
    kwargs = dict(call.kwargs, **rope)
    cache_before = kwargs["cos_sin_cache"].copy()

    q_out, k_out = qk_rms_norm(q, k, call.q_weight, call.k_weight, EPS, **kwargs)
    assert_bitwise(q_out, q_expected, f"{layout}: q_out")
    assert_bitwise(k_out, k_expected, f"{layout}: k_out")
    assert qk_rms_norm_(q, k, call.q_weight, call.k_weight, EPS, **kwargs) is None
    assert_bitwise(q, q_expected, f"{layout}: q in place")
    assert_bitwise(k, k_expected, f"{layout}: k in place")
    assert_bitwise(kwargs["cos_sin_cache"], cache_before, f"{layout}: the cache")


@pytest.mark.full
@pytest.mark.parametrize("positions", [
    pytest.param(np.array(5), id="0d"), pytest.param([5], id="1")])
def test_q_without_leading_dims(rng, positions):
    """q (Hq, D) and k (Hk, D): one token; positions of its leading shape () or (1,)."""
    call = Call.make(rng, replace(INVARIANCE_CASE, lead=(1,)), positions=[5])
    q_out, k_out = call.out_of_place()
    rope = dict(call.rope, positions=np.asarray(positions, call.case.positions))
    q1, k1 = qk_rms_norm(call.q[0], call.k[0], call.q_weight, call.k_weight, EPS,
                         weight_offset=call.case.offset, **rope)
    assert q1.shape == call.q.shape[1:] and k1.shape == call.k.shape[1:]
    assert_bitwise(q1, q_out[0], "q (Hq, D) vs (1, Hq, D)")
    assert_bitwise(k1, k_out[0], "k (Hk, D) vs (1, Hk, D)")


def test_empty_batch():
    """T = 0: nothing to launch; empty outputs of q's and k's shapes."""
    q = np.empty((0, 4, 64), np.float32)
    k = np.empty((0, 2, 64), np.float32)
    w = np.ones(64, np.float32)
    q_out, k_out = qk_rms_norm(q, k, w, w, positions=np.empty(0, np.int64),
                               cos_sin_cache=np.ones((4, 64), np.float32))
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == np.float32
    assert qk_rms_norm_(q, k, w, w) is None


@pytest.mark.parametrize("case", full_tier_except(
    [c for c in MATRIX if c.id in QUICK and c.dtype != FLOAT32], lambda c: c.dtype == BFLOAT16),
    ids=lambda c: c.dtype)
def test_uint16_storage_with_dtype_keyword(rng, case):
    """16-bit q, k, weights and cache passed as uint16 storage with dtype=: uint16 outputs with
    the bits of the call on the float dtype (a float32 weight or cache stays float32)."""
    call = Call.make(rng, case)
    q_out, k_out = call.out_of_place()

    def storage(a):
        return a.view(np.uint16) if a.dtype == NUMPY[case.dtype] else a

    rope = dict(call.rope, cos_sin_cache=storage(call.rope["cos_sin_cache"]))
    q16, k16 = qk_rms_norm(storage(call.q), storage(call.k), storage(call.q_weight),
                           storage(call.k_weight), EPS, weight_offset=case.offset,
                           dtype=case.dtype, **rope)
    assert q16.dtype == np.uint16 and k16.dtype == np.uint16
    assert_bitwise(q16, q_out.view(np.uint16), "q from uint16 storage")
    assert_bitwise(k16, k_out.view(np.uint16), "k from uint16 storage")
    buf16 = call.buf.view(np.uint16)
    assert qk_rms_norm_(*qkv_views(buf16, *case.heads, case.d), storage(call.q_weight),
                        storage(call.k_weight), EPS, weight_offset=case.offset,
                        dtype=case.dtype, **rope) is None
    assert_bitwise(call.q, q_out, "q in place from uint16 storage")


# ---- a position outside the cache ------------------------------------------------------------

def test_cpu_position_outside_the_cache_raises(rng):
    """On the CPU a position outside [0, max_position) is a ValueError naming positions, raised
    before anything is written (either call)."""
    case = INVARIANCE_CASE
    call = Call.make(rng, case, positions=[3, MAX_POSITION])
    before = [a.copy() for a in call.arrays()]
    for run in (call.out_of_place, call.in_place):
        with pytest.raises(ValueError, match=rf"qk_rms_norm_?: positions must lie in \[0, "
                                             rf"{MAX_POSITION}\).* from 3 to {MAX_POSITION}"):
            run()
        for a, b in zip(call.arrays(), before):
            assert_bitwise(a, b, "an argument after the refused call")


@pytest.mark.sim
@pytest.mark.parametrize("case,bad", full_tier_except(
    [(SIM_CASES[1][0], MAX_POSITION), (SIM_CASES[1][0], -1), (SIM_CASES[3][0], 2**31 - 1),
     (SIM_CASES[5][0], MAX_POSITION)],
    lambda case: case[1] == MAX_POSITION), ids=lambda v: str(v) if isinstance(v, int) else v.id)
def test_sim_position_outside_the_cache(sim, rng, monkeypatch, case, bad):  # noqa: F811
    """GPU semantics: the token whose position lies outside the cache gets NaN over the rotated
    elements of every head (q's and k's), its other elements are rms_norm's; the other tokens
    keep the bits of an in-range call; nothing outside q and k (in place) or the outputs is
    written."""
    sim(32)
    good = [5, 11, 7]
    call = Call.make(rng, replace(case, lead=(3,)), positions=good)
    original = call.buf.copy()
    q_good, k_good = call.out_of_place()
    call.rope["positions"][1] = bad
    before = [a.copy() for a in call.arrays()]

    q_out, k_out = call.out_of_place()
    assert call.in_place() is None

    rot = case.rot
    for name, out, expected in (("q", q_out, q_good), ("k", k_out, k_good)):
        assert np.isnan(out[1, :, :rot].astype(np.float32)).all(), f"{name}: rotated part"
        assert_bitwise(out[1, :, rot:], expected[1, :, rot:], f"{name}: unrotated part")
        assert_bitwise(out[0::2], expected[0::2], f"{name}: the other tokens")
    assert_bitwise(call.q, q_out, "q in place")
    assert_bitwise(call.k, k_out, "k in place")
    cols = sum(case.heads) * case.d
    assert_bitwise(call.buf[..., cols:], original[..., cols:], "the v part and padding")
    for a, b in zip(call.arrays()[1:], before[1:]):
        assert_bitwise(a, b, "a weight, positions or the cache")


# ---- validation: errors name the argument, and come before anything is written ---------------

def _set(**values):
    return lambda args: args.update(values)


def _with(name, make):
    """Replace argument ``name`` by ``make(args)``."""
    return lambda args: args.update({name: make(args)})


def _read_only(a):
    view = a.view()
    view.flags.writeable = False
    return view


def _strided_positions(args):
    wide = np.zeros(2 * len(args["positions"]), args["positions"].dtype)
    wide[::2] = args["positions"]
    return wide[::2]


BF = NUMPY[BFLOAT16]
# (id, change to a valid bf16 call (q (3, 2, 64), k (3, 1, 64), neox, 16-bit cache), exception,
#  message after "<fn>: ", in place only)
ERRORS = [
    ("q_int", _with("q", lambda a: a["q"].astype(np.int16)), TypeError,
     r"q must have dtype float32, float16 or bfloat16, got int16", False),
    ("q_1d", _with("q", lambda a: a["q"][0, 0]), ValueError,
     r"q must have shape \(\.\.\., heads, head_size\), got shape \(64,\)", False),
    ("q_head_size", _with("q", lambda a: np.ones((3, 1, 8200), BF)), ValueError,
     r"q head size \(last dimension\) must be 1 to 8192", False),
    ("q_column_stride", _with("q", lambda a: np.ones((3, 2, 128), BF)[..., ::2]), ValueError,
     r"q must have unit stride in its last dimension", False),
    ("q_head_rows_overlap", _with("q", lambda a: np.lib.stride_tricks.as_strided(
        a["q"], (3, 2, 64), (a["q"].strides[0], 32 * 2, 2))), ValueError,
     r"q head rows must not overlap", False),
    ("k_missing", _set(k=None), TypeError, r"k must be an array like x, got None", False),
    ("k_dtype", _with("k", lambda a: a["k"].astype(np.float32)), TypeError,
     r"k must have q's dtype bfloat16, got float32", False),
    ("k_head_size", _with("k", lambda a: np.ones((3, 1, 32), BF)), ValueError,
     r"q and k must be .* got q \(3, 2, 64\) and k \(3, 1, 32\)", False),
    ("k_tokens", _with("k", lambda a: a["k"][:2]), ValueError,
     r"q and k must be .* got q \(3, 2, 64\) and k \(2, 1, 64\)", False),
    ("k_leading_dims", _with("k", lambda a: np.ones((1, 3, 1, 64), BF)), ValueError,
     r"q and k must be .* got q \(3, 2, 64\) and k \(1, 3, 1, 64\)", False),
    ("q_weight_shape", _with("q_weight", lambda a: np.ones(65, BF)), ValueError,
     r"q_weight must have shape \(64,\), got \(65,\)", False),
    ("k_weight_shape", _with("k_weight", lambda a: np.ones((1, 64), BF)), ValueError,
     r"k_weight must have shape \(64,\), got \(1, 64\)", False),
    ("q_weight_missing", _set(q_weight=None), TypeError, r"q_weight must be an array", False),
    ("q_weight_dtype", _with("q_weight", lambda a: a["q_weight"].astype(np.float16)), TypeError,
     r"q_weight must have dtype bfloat16 or float32 for q of dtype bfloat16, got float16",
     False),
    ("weight_dtypes_differ", _with("q_weight", lambda a: a["q_weight"].astype(np.float32)),
     TypeError, r"k_weight must have q_weight's dtype float32, got bfloat16", False),
    ("k_weight_strided", _with("k_weight", lambda a: np.ones(128, BF)[::2]), ValueError,
     r"k_weight must be contiguous", False),
    ("positions_without_cache", _set(cos_sin_cache=None), ValueError,
     r"RoPE needs both positions and cos_sin_cache, got cos_sin_cache=None", False),
    ("cache_without_positions", _set(positions=None), ValueError,
     r"RoPE needs both positions and cos_sin_cache, got positions=None", False),
    ("rotary_dim_without_rope", _set(positions=None, cos_sin_cache=None, rotary_dim=32),
     ValueError, r"rotary_dim needs positions and cos_sin_cache", False),
    ("rotary_dim_odd", _set(rotary_dim=31), ValueError,
     r"rotary_dim must be an even int from 2 to the head size 64, got 31", False),
    ("rotary_dim_past_head", _set(rotary_dim=66), ValueError,
     r"rotary_dim must be an even int from 2 to the head size 64, got 66", False),
    ("rotary_dim_zero", _set(rotary_dim=0), ValueError, r"rotary_dim must be an even int", False),
    ("rotary_dim_float", _set(rotary_dim=32.0), ValueError, r"rotary_dim must be an even int",
     False),
    ("cache_width", _set(rotary_dim=32), ValueError,
     rf"cos_sin_cache must have shape \(max_position, 32\) for rotary_dim 32, got "
     rf"\({MAX_POSITION}, 64\)", False),
    ("cache_1d", _with("cos_sin_cache", lambda a: a["cos_sin_cache"][0]), ValueError,
     r"cos_sin_cache must have shape \(max_position, 64\)", False),
    ("cache_empty", _with("cos_sin_cache", lambda a: a["cos_sin_cache"][:0]), ValueError,
     r"cos_sin_cache must have shape \(max_position, 64\) for rotary_dim 64, got \(0, 64\)",
     False),
    ("cache_dtype", _with("cos_sin_cache", lambda a: a["cos_sin_cache"].astype(np.float16)),
     TypeError, r"cos_sin_cache must have dtype bfloat16 or float32, got float16", False),
    ("cache_column_stride", _with("cos_sin_cache", lambda a: np.ones((MAX_POSITION, 128),
                                                                       BF)[:, ::2]),
     ValueError, r"cos_sin_cache rows must be unit-stride", False),
    ("rope_style", _set(rope_style="llama"), ValueError,
     r"rope_style must be 'neox' or 'gptj', got 'llama'", False),
    ("rope_style_without_rope", _set(positions=None, cos_sin_cache=None, rope_style="llama"),
     ValueError, r"rope_style must be 'neox' or 'gptj', got 'llama'", False),
    ("positions_past_cache", _with("positions", lambda a: np.array([0, MAX_POSITION, 1])),
     ValueError, rf"positions must lie in \[0, {MAX_POSITION}\) \(cos_sin_cache's rows\), got "
                 rf"values from 0 to {MAX_POSITION}", False),
    ("positions_negative", _with("positions", lambda a: np.array([0, -1, 1])), ValueError,
     rf"positions must lie in \[0, {MAX_POSITION}\)", False),
    ("positions_float", _with("positions", lambda a: a["positions"].astype(np.float32)),
     TypeError, r"positions must have dtype int32 or int64, got float32", False),
    ("positions_uint", _with("positions", lambda a: a["positions"].astype(np.uint32)),
     TypeError, r"positions must have dtype int32 or int64", False),
    ("positions_shape", _with("positions", lambda a: a["positions"][:2]), ValueError,
     r"positions must have q's leading shape \(3,\), got \(2,\)", False),
    ("positions_strided", _with("positions", _strided_positions), ValueError,
     r"positions must be contiguous", False),
    ("eps_negative", _set(eps=-1e-6), ValueError, r"eps must be a finite number >= 0", False),
    ("weight_offset_nan", _set(weight_offset=float("nan")), ValueError, r"weight_offset", False),
    ("dtype_keyword", _set(dtype="float32"), ValueError,
     r"dtype must be None, 'bfloat16' or 'float16', got 'float32'", False),
    # in place: q and k are written, so they share no element with each other or an input
    ("k_is_q", _with("k", lambda a: a["q"][:, :1]), ValueError, r"q overlaps k", True),
    ("q_weight_in_q", _with("q_weight", lambda a: a["q"][1, 1]), ValueError,
     r"q overlaps q_weight", True),
    ("cache_in_k", lambda a: a.update(cos_sin_cache=a["k"][:, 0], positions=np.arange(3)),
     ValueError, r"k overlaps cos_sin_cache", True),
    ("q_read_only", _with("q", lambda a: _read_only(a["q"])), ValueError,
     r"q must be writeable, got a read-only array", True),
    ("k_read_only", _with("k", lambda a: _read_only(a["k"])), ValueError,
     r"k must be writeable, got a read-only array", True),
]


def test_rotary_dim_takes_numpy_integers(rng):
    """rotary_dim=np.int64(32) is rotary_dim=32 (the bits of the out-of-place call)."""
    import rmsnorm_hip as R
    call = Call.make(rng, QkCase(BFLOAT16, 64, "neox", cache=BFLOAT16, heads=(2, 1), lead=(3,)),
                     positions=[0, 5, 9])
    args = (call.q, call.k, call.q_weight, call.k_weight, EPS)
    rope = dict(call.rope, cos_sin_cache=np.ascontiguousarray(call.rope["cos_sin_cache"][:, :32]))
    one = R.qk_rms_norm(*args, **dict(rope, rotary_dim=32))
    two = R.qk_rms_norm(*args, **dict(rope, rotary_dim=np.int64(32)))
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("fn,change,exc,message", [
    pytest.param(fn, *e[1:4], id=f"{e[0]}-{fn}") for e in ERRORS
    for fn in ("qk_rms_norm_",) + (() if e[4] else ("qk_rms_norm",))])
def test_errors_name_the_argument_and_write_nothing(rng, fn, change, exc, message):
    """Each refused call raises the documented exception with a message that starts with the
    entry point and names the argument; no argument (the QKV buffer above all) has changed."""
    call = Call.make(rng, QkCase(BFLOAT16, 64, "neox", cache=BFLOAT16, heads=(2, 1),
                                 lead=(3,)), positions=[0, 5, 9])
    args = dict(q=call.q, k=call.k, q_weight=call.q_weight, k_weight=call.k_weight, eps=EPS,
                **call.rope)
    change(args)
    arrays = [call.buf] + [a for a in args.values() if isinstance(a, np.ndarray)]
    before = [a.copy() for a in arrays]

    with pytest.raises(exc, match=rf"^{fn}: {message}"):
        {"qk_rms_norm_": qk_rms_norm_, "qk_rms_norm": qk_rms_norm}[fn](**args)

    for a, b in zip(arrays, before):
        assert_bitwise(a, b, "an argument after the refused call")


@pytest.mark.full
def test_out_of_place_reads_what_in_place_may_not(rng):
    """qk_rms_norm writes new arrays: read-only inputs are fine, and give the bits of writeable
    ones."""
    case = [c for c in MATRIX if c.id in QUICK][0]
    call = Call.make(rng, case)
    q_out, k_out = call.out_of_place()
    rope = {name: _read_only(a) if isinstance(a, np.ndarray) else a
            for name, a in call.rope.items()}
    q_ro, k_ro = qk_rms_norm(_read_only(call.q), _read_only(call.k), _read_only(call.q_weight),
                             _read_only(call.k_weight), EPS, weight_offset=case.offset, **rope)
    assert_bitwise(q_ro, q_out, "q_out from read-only arrays")
    assert_bitwise(k_ro, k_out, "k_out from read-only arrays")


# ---- torch CPU tensors ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    import rmsnorm_hip.torch  # noqa: F401  (registers the torch.ops.rmsnorm_hip ops)
    return torch


def to_torch(torch, a):
    """A CPU tensor over the NumPy array ``a``'s memory (bfloat16 through its bits)."""
    if a.dtype == NUMPY[BFLOAT16]:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def torch_bits(torch, t):
    """A tensor's values as NumPy bits, for assert_bitwise against NumPy results."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(NUMPY[BFLOAT16])
    return t.numpy()


def torch_call(torch, call, buf):
    """(qkv tensor over a copy of ``buf``, q and k views of it, the call's other arguments as
    tensors, keywords)."""
    c = call.case
    hq, hk = c.heads
    qkv = to_torch(torch, buf.copy())
    q = qkv[..., :hq * c.d].unflatten(-1, (hq, c.d))
    k = qkv[..., hq * c.d:(hq + hk) * c.d].unflatten(-1, (hk, c.d))
    assert q._base is qkv and k._base is qkv
    kw = dict(weight_offset=c.offset, **{
        name: to_torch(torch, a) if isinstance(a, np.ndarray) else a
        for name, a in call.rope.items()})
    return qkv, q, k, (to_torch(torch, call.q_weight), to_torch(torch, call.k_weight)), kw


TORCH_CASE = "bfloat16-w_float32-D80-gptj-cache_bfloat16-int32-H3_1-T7-pad1"   # in QUICK


def test_torch_in_place_on_views_of_one_qkv_tensor(rng, torch):
    """rmsnorm_hip.torch.qk_rms_norm_ on views of one QKV tensor, eager and through the custom
    op: the NumPy call's bits in q and k, the rest of the tensor untouched, the version counter
    stepped; qk_rms_norm gives the same bits in new contiguous tensors."""
    from rmsnorm_hip import torch as rt
    call = Call.make(rng, next(c for c in MATRIX if c.id == TORCH_CASE))
    original = call.buf.copy()
    q_out, k_out = call.out_of_place()
    call.in_place()
    for how in ("eager", "op"):
        qkv, q, k, weights, kw = torch_call(torch, call, original)
        version = qkv._version
        if how == "eager":
            assert rt.qk_rms_norm_(q, k, *weights, EPS, **kw) is None
        else:
            torch.ops.rmsnorm_hip.qk_rms_norm_.default(
                q, k, *weights, EPS, kw["weight_offset"], kw["positions"],
                kw["cos_sin_cache"], kw["rope_style"], kw["rotary_dim"])
        assert qkv._version > version, f"{how}: the QKV tensor's version counter"
        assert_bitwise(torch_bits(torch, qkv), call.buf, f"{how}: the QKV tensor vs NumPy's")

    qkv, q, k, weights, kw = torch_call(torch, call, original)
    version = qkv._version
    qo, ko = rt.qk_rms_norm(q, k, *weights, EPS, **kw)
    assert qo.is_contiguous() and ko.is_contiguous() and qo.dtype == torch.bfloat16
    assert_bitwise(torch_bits(torch, qo), q_out, "torch qk_rms_norm q vs NumPy's")
    assert_bitwise(torch_bits(torch, ko), k_out, "torch qk_rms_norm k vs NumPy's")
    assert qkv._version == version
    assert_bitwise(torch_bits(torch, qkv), original, "q and k after qk_rms_norm")


def test_torch_in_place_is_seen_by_autograd(torch):
    """A QKV tensor saved for a backward, then normalised in place: autograd refuses the
    backward instead of computing a wrong gradient."""
    from rmsnorm_hip import torch as rt
    a = torch.randn(6, 4 * 96, requires_grad=True)
    qkv = a * 2
    loss = qkv.sin().sum()                       # saves qkv for its backward
    views = qkv.detach().unflatten(-1, (4, 96))
    w = torch.ones(96)
    rt.qk_rms_norm_(views[:, :2], views[:, 2:3], w, w)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_torch_position_outside_the_cache_raises(rng, torch):
    from rmsnorm_hip import torch as rt
    call = Call.make(rng, next(c for c in MATRIX if c.id == TORCH_CASE))
    qkv, q, k, weights, kw = torch_call(torch, call, call.buf)
    kw["positions"][3] = MAX_POSITION
    before = qkv.clone()
    with pytest.raises(ValueError, match=r"qk_rms_norm_: positions must lie in \[0, "):
        rt.qk_rms_norm_(q, k, *weights, EPS, **kw)
    assert torch.equal(qkv.view(torch.int16), before.view(torch.int16))


def opcheck_cases(torch):
    rng = np.random.default_rng(5)
    case = next(c for c in MATRIX if c.id == TORCH_CASE)
    call = Call.make(rng, case)
    qkv, q, k, weights, kw = torch_call(torch, call, call.buf)
    rope = [kw["positions"], kw["cos_sin_cache"], kw["rope_style"], kw["rotary_dim"]]
    plain = [None, None, "neox", None]
    ops = torch.ops.rmsnorm_hip
    qc, kc = q.contiguous(), k.contiguous()
    return [
        ("qk_rms_norm_-rope-views", ops.qk_rms_norm_.default, (q, k, *weights, EPS, 1.0, *rope)),
        ("qk_rms_norm_-plain", ops.qk_rms_norm_.default, (qc, kc, *weights, EPS, 0.0, *plain)),
        ("qk_rms_norm-rope", ops.qk_rms_norm.default, (q, k, *weights, EPS, 1.0, *rope)),
        ("qk_rms_norm-plain", ops.qk_rms_norm.default, (qc, kc, *weights, EPS, 0.0, *plain)),
    ]


@pytest.mark.parametrize("index", full_tier_except(range(4), lambda i: i in (0, 2)),
                         ids=["qk_rms_norm_-rope-views", "qk_rms_norm_-plain", "qk_rms_norm-rope",
                              "qk_rms_norm-plain"])
def test_opcheck(torch, index):
    name, op, args = opcheck_cases(torch)[index]
    torch.library.opcheck(op, args)


def test_compile_fullgraph_bitwise_eager(rng, torch):
    """A QKV projection whose q and k views are normalised and rotated in place, then again out
    of place, under torch.compile(fullgraph=True): one graph, the eager bits."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from rmsnorm_hip import torch as rt
    case = next(c for c in MATRIX if c.id == TORCH_CASE)
    call = Call.make(rng, case)
    hq, hk = case.heads
    _, _, _, weights, kw = torch_call(torch, call, call.buf)
    x = torch.randn(7, 64).to(torch.bfloat16)
    proj = torch.randn(64, (hq + 2 * hk) * case.d).to(torch.bfloat16)

    def attention_inputs(x, proj, q_weight, k_weight, positions, cache):
        qkv = x @ proj
        q = qkv[:, :hq * case.d].unflatten(-1, (hq, case.d))
        k = qkv[:, hq * case.d:(hq + hk) * case.d].unflatten(-1, (hk, case.d))
        rope = dict(positions=positions, cos_sin_cache=cache, rope_style=case.rope,
                    rotary_dim=case.rotary_dim)
        rt.qk_rms_norm_(q, k, q_weight, k_weight, EPS, weight_offset=case.offset, **rope)
        q2, k2 = rt.qk_rms_norm(q, k, q_weight, k_weight, EPS, **rope)
        return qkv, q2, k2

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attention_inputs, backend=counter, fullgraph=True)
    args = (x, proj, *weights, kw["positions"], kw["cos_sin_cache"])
    got, expected = compiled(*args), attention_inputs(*args)
    assert counter.frame_count == 1
    for a, b, what in zip(got, expected, ("qkv", "q2", "k2")):
        assert_bitwise(torch_bits(torch, a), torch_bits(torch, b), f"compiled {what} vs eager")
    expected_q = call.ref(torch_bits(torch, (x @ proj)[:, :hq * case.d]).reshape(7, hq, case.d),
                          call.q_weight)
    assert_close(torch_bits(torch, got[0])[:, :hq * case.d].reshape(7, hq, case.d), expected_q,
                 case.dtype)
