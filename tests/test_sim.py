"""The GPU forward kernel run by the numba-cuda simulator, on every path of
kernels/_config.row_layout (multi-row, cached single-row, looped) x (vector, scalar) x dtype x
weight dtype, against the float64 reference and bitwise against its twin: the same rows through
the scalar path (an unaligned copy) must give the vector path's bits.  Cases name the path they
cover (tests/_paths.py picks an N that takes it under the current heuristics) and assert the
kernel spec that ran, so retuning cannot silently drop a path.

The simulator runs one Python thread per GPU thread (~0.3-0.5 s per 256 threads), so M stays
small; a looped row needs 1024 threads (~5 s)."""
import contextlib
from dataclasses import dataclass

import numpy as np
import pytest
from _paths import path_of, pick_n, takes
from conftest import (BFLOAT16, DTYPES, FLOAT16, FLOAT32, NUMPY, WEIGHT_COMBOS, aligned_copy,
                      aligned_empty, assert_bitwise, assert_close, full_tier_except,
                      random_array)

from rmsnorm_hip import _cache, backends, rms_norm
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import rms_norm_ref

pytestmark = [pytest.mark.quick, pytest.mark.sim]


@pytest.fixture
def sim(monkeypatch):
    """``sim(warp)``: a fresh simulator backend of that warp width, selected for NumPy arrays.
    Backends are cached per process by name, so the cache is swapped for an empty one (and put
    back afterwards) and the backend is created from RMSNORM_HIP_SIM_WARP like a user's."""
    def make(warp=32):
        monkeypatch.setattr(backends, "_backends", {})
        monkeypatch.setenv("RMSNORM_HIP_BACKEND", "sim")
        monkeypatch.setenv("RMSNORM_HIP_SIM_WARP", str(warp))
        be = backends.get("sim")
        assert be.name == "sim" and be.intrinsics.warp == warp
        return be
    return make


@contextlib.contextmanager
def launched_specs(be):
    """Collects the spec of every kernel ``be`` looks up inside the block and then launches,
    once a lookup, in the order of their launches (a kernel looked up to be weighed and not
    launched is left out)."""
    specs, built, unlaunched = [], {}, {}
    kernel, launch = be.kernel, be.launch

    def building(builder, spec, argtypes):
        compiled = kernel(builder, spec, argtypes)
        built[id(compiled)] = spec
        unlaunched[id(compiled)] = unlaunched.get(id(compiled), 0) + 1
        return compiled

    def launching(compiled, grid, block, args, stream):
        specs.extend([built.get(id(compiled))] * unlaunched.pop(id(compiled), 0))
        return launch(compiled, grid, block, args, stream)

    be._plans.clear()           # plans memoise kernels per call shape; force the lookup
    patched = {name: vars(be)[name] for name in ("kernel", "launch") if name in vars(be)}
    be.kernel, be.launch = building, launching
    try:
        yield specs
    finally:
        del be.kernel, be.launch
        vars(be).update(patched)    # a test's own patches of them stay
        be._plans.clear()


def run(be, x, w=None, return_rstd=True, **kwargs):
    """(y, rstd or None, spec of the one kernel launched) of rms_norm on ``be``."""
    with launched_specs(be) as specs:
        result = rms_norm(x, w, return_rstd=return_rstd, **kwargs)
    assert len(specs) == 1, specs
    y, rstd = result if return_rstd else (result, None)
    return y, rstd, specs[0]


@dataclass(frozen=True)
class SimCase:
    dtype: str
    flavor: str                 # tests/_paths.FLAVORS
    weight: str = None
    vector: bool = True         # N a whole number of chunks (aligned calls go vector), or ragged
    rstd: bool = True
    weight_offset: float = 0.0
    n: int = None               # None: the smallest N taking the flavor

    @property
    def id(self):
        return (f"{self.flavor}-{'vec' if self.vector else 'scalar'}-{self.dtype}"
                f"-w_{self.weight or 'none'}" + (f"-N{self.n}" if self.n else "")
                + ("" if self.rstd else "-no_rstd")
                + (f"-offset{self.weight_offset}" if self.weight_offset else ""))

    @property
    def path(self):
        return self.flavor.split("_")[0]

    def shape(self):
        """(M, N): N takes the flavor; M fills one block and starts a second, at most 16 rows."""
        n = self.n or pick_n(self.flavor, self.dtype, self.vector)
        assert takes(self.flavor, n, self.dtype), f"N={n} does not take {self.flavor}"
        rows = _config.rows_per_block(_config.row_layout(n, self.dtype))
        return min(16, rows + 1) if self.path == "multirow" else 2 if self.path == "row" else 1, n


CASES = (
    # one thread per row, a block of rows: every dtype x weight dtype, vector
    [SimCase(d, "multirow_1thread", w) for d, w in WEIGHT_COMBOS]
    # a full warp per row, ragged last chunk (scalar): every dtype x weight dtype
    + [SimCase(d, "multirow_warp", w, vector=False) for d, w in WEIGHT_COMBOS]
    + [
        SimCase(FLOAT16, "multirow_idle", FLOAT32, rstd=False),   # threads that own no chunk
        SimCase(BFLOAT16, "multirow_warps", BFLOAT16, weight_offset=1.0),  # warps sum via shared
        SimCase(FLOAT32, "multirow_warps"),
        SimCase(FLOAT16, "multirow_warps", FLOAT16, vector=False),
        SimCase(FLOAT32, "multirow_1thread", vector=False),       # ragged single chunk
        SimCase(BFLOAT16, "multirow_1thread", FLOAT32, vector=False, n=1),
        # one row per block, cached in registers
        SimCase(BFLOAT16, "row", FLOAT32),
        SimCase(FLOAT32, "row", FLOAT32, rstd=False),
        SimCase(FLOAT16, "row", FLOAT16, vector=False, weight_offset=1.0),
        SimCase(BFLOAT16, "row_odd_wavefronts", vector=False),
        # looped: 1024 threads, each re-reads its chunks for the second pass
        SimCase(BFLOAT16, "looped", BFLOAT16),
        SimCase(FLOAT32, "looped"),
        SimCase(FLOAT16, "looped", FLOAT32, vector=False),
    ]
)


def make_inputs(rng, case, m, n):
    x = aligned_copy(random_array(rng, (m, n), case.dtype))
    w = None
    if case.weight is not None:
        loc = 0.0 if case.weight_offset else 1.0
        w = aligned_copy(random_array(rng, n, case.weight, loc=loc, scale=0.5))
    return x, w


def check_case(be, rng, case):
    m, n = case.shape()
    layout = _config.row_layout(n, case.dtype)
    x, w = make_inputs(rng, case, m, n)
    x0 = x.copy()
    kw = dict(return_rstd=case.rstd, weight_offset=case.weight_offset)

    y, rstd, spec = run(be, x, w, **kw)

    assert spec.layout == layout and path_of(spec.layout, spec.rows) == case.path, spec
    assert spec.vector == case.vector and spec.store_rstd == case.rstd, spec
    assert spec.dtype == case.dtype and spec.weight == (case.weight or ""), spec
    y_ref, rstd_ref = rms_norm_ref(x, w, weight_offset=case.weight_offset)
    assert_close(y, y_ref, case.dtype)
    if case.rstd:
        assert rstd.shape == (m,) and rstd.dtype == np.float32
        assert_close(rstd, rstd_ref, FLOAT32)
    assert_bitwise(x, x0, "x after the call")

    if case.vector:
        # the twin: the same rows one element past a 16-byte boundary take the scalar path
        itemsize = NUMPY[case.dtype].itemsize
        y_s, rstd_s, spec_s = run(be, aligned_copy(x, offset=itemsize), w, **kw)
        assert not spec_s.vector and spec_s.layout == layout, spec_s
        assert_bitwise(y_s, y, "scalar twin vs vector y")
        if case.rstd:
            assert_bitwise(rstd_s, rstd, "scalar twin vs vector rstd")


# the default tier's representatives: a row per thread, several warps per row, one cached row per
# block, a looped row; the full tier runs every case
QUICK = {"multirow_1thread-vec-bfloat16-w_bfloat16",
         "multirow_warps-vec-bfloat16-w_bfloat16-offset1.0", "row-vec-bfloat16-w_float32",
         "looped-vec-float32-w_none"}


@pytest.mark.parametrize("case", full_tier_except(CASES, lambda c: c.id in QUICK),
                         ids=lambda c: c.id)
def test_sim_path(sim, rng, case):
    check_case(sim(32), rng, case)


def test_cases_cover_every_path_and_dtype():
    """The table above keeps covering each (path, access) for each dtype."""
    covered = {(c.path, c.vector, c.dtype) for c in CASES}
    for path in ("multirow", "row", "looped"):
        for dtype in DTYPES:
            assert (path, True, dtype) in covered or (path, False, dtype) in covered
    for path in ("multirow", "row", "looped"):
        assert {v for p, v, _ in covered if p == path} == {True, False}, path
    assert {(c.dtype, c.weight) for c in CASES} >= set(WEIGHT_COMBOS)


# What takes a call off the vector path: each must give the vector path's bits.
DISALIGN = {
    "x_start": dict(x_offset=2),
    "out_start": dict(out_offset=2),
    "weight_start": dict(w_offset=2),
    "x_row_stride": dict(x_pad=3),
    "out_row_stride": dict(out_pad=3),
}


@pytest.mark.parametrize("what", full_tier_except(list(DISALIGN), lambda w: w == "x_start"))
def test_sim_alignment_and_strides(sim, rng, what):
    """bf16, several warps per row, rows over two blocks: row-strided x and out (pads of 8
    elements keep 16-byte alignment, 3 break it) and unaligned row starts give bitwise the
    contiguous aligned result; out's guard columns stay untouched."""
    be = sim(32)
    n = pick_n("multirow_warps", BFLOAT16, vector=True)
    m = _config.rows_per_block(_config.row_layout(n, BFLOAT16)) + 1
    opts = dict(x_offset=0, out_offset=0, w_offset=0, x_pad=8, out_pad=8) | DISALIGN[what]
    x = random_array(rng, (m, n), BFLOAT16)
    w = aligned_copy(random_array(rng, n, BFLOAT16, loc=1.0), offset=opts["w_offset"])
    y, rstd, spec = run(be, aligned_copy(x), aligned_copy(w))
    assert spec.vector

    x_wide = aligned_empty((m, n + opts["x_pad"]), BFLOAT16, offset=opts["x_offset"])
    x_wide[:, :n] = x
    guard = random_array(rng, (m, n + opts["out_pad"]), BFLOAT16, loc=-7.0)
    out_wide = aligned_copy(guard, offset=opts["out_offset"])
    out = out_wide[:, :n]
    result, rstd_s, spec_s = run(be, x_wide[:, :n], w, out=out)

    assert result is out and not spec_s.vector, spec_s
    assert_bitwise(out, y, f"{what}: scalar y vs vector y")
    assert_bitwise(rstd_s, rstd, f"{what}: scalar rstd vs vector rstd")
    assert_bitwise(out_wide[:, n:], guard[:, n:], "out's guard columns")
    assert_close(out, rms_norm_ref(x, w)[0], BFLOAT16)


WARP64_CASES = [
    SimCase(BFLOAT16, "multirow_warps", BFLOAT16),        # a wavefront (or more) per row
    SimCase(FLOAT32, "multirow_warp", FLOAT32, vector=False),  # 32 threads: 2 rows/wavefront
    SimCase(FLOAT16, "row_odd_wavefronts", FLOAT32),      # 3, 5, ... wavefronts per row
]


@pytest.mark.parametrize("case", full_tier_except(WARP64_CASES, lambda c: c is WARP64_CASES[0]),
                         ids=lambda c: c.id)
def test_sim_warp64(sim, rng, case):
    """The AMD wavefront width: butterflies over 64 lanes and cross-wavefront row sums."""
    be = sim(64)
    assert be.arch == "sim64"
    check_case(be, rng, case)
    assert any("sim64" in key for key in _cache.entries()), "no kernel built for warp 64"
