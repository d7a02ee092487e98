"""The forward kernel's fused switches (residual add, in place, int8 / float8 quantisation,
SmoothQuant scale) run by the numba-cuda simulator on every path of kernels/_config.row_layout,
against the float64 reference and bitwise against their scalar twins (the same rows one element
past a 16-byte boundary).  Like tests/test_sim.py, each case names the path it covers and asserts
the spec that ran.  Looped rows take 1024 simulated threads (~5 s a launch)."""
from dataclasses import dataclass

import numpy as np
import pytest
from _paths import layout_of, path_of, pick_n, takes
from conftest import (BFLOAT16, FLOAT16, FLOAT32, NUMPY, HostIO, aligned_copy, assert_bitwise,
                      assert_close, assert_quant_close, full_tier_except, random_array)
from test_sim import launched_specs, sim  # noqa: F401  (sim is a fixture)

from rmsnorm_hip import _cache, fused_add_rms_norm, fused_add_rms_norm_, rms_norm, rms_norm_quant
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import fused_add_rms_norm_ref, rms_norm_quant_ref

pytestmark = [pytest.mark.quick, pytest.mark.sim]


@dataclass(frozen=True)
class FusedCase:
    dtype: str
    flavor: str                 # tests/_paths.FLAVORS
    weight: str = None
    vector: bool = True         # N a whole number of chunks (aligned calls go vector), or ragged
    quant: str = None           # None: fused_add_rms_norm; "int8" / "float8_e4m3fn": quant
    residual: bool = True       # quant only (the fused add always has one)
    xscale: str = None          # quant only: SmoothQuant scale dtype
    in_place: bool = False      # fused add: also run fused_add_rms_norm_ on copies

    @property
    def id(self):
        op = f"quant_{self.quant}" if self.quant else "fused"
        return (f"{op}-{self.flavor}-{'vec' if self.vector else 'scalar'}-{self.dtype}"
                f"-w_{self.weight or 'none'}" + ("-res" if self.quant and self.residual else "")
                + (f"-xs_{self.xscale}" if self.xscale else "")
                + ("-in_place" if self.in_place else ""))

    @property
    def path(self):
        return self.flavor.split("_")[0]

    def shape(self):
        quant = bool(self.quant)
        n = pick_n(self.flavor, self.dtype, self.vector, quant)
        assert takes(self.flavor, n, self.dtype, quant), f"N={n} does not take {self.flavor}"
        rows = _config.rows_per_block(layout_of(n, self.dtype, quant))
        return min(16, rows + 1) if self.path == "multirow" else 2 if self.path == "row" else 1, n


F = FusedCase
CASES = [
    # the fused add on every path, both access forms, every dtype
    F(BFLOAT16, "multirow_1thread", BFLOAT16, in_place=True),
    F(FLOAT16, "multirow_warp", FLOAT32, vector=False, in_place=True),
    F(FLOAT32, "multirow_warps", in_place=True),
    F(BFLOAT16, "row", FLOAT32, in_place=True),
    F(FLOAT16, "row_odd_wavefronts", FLOAT16, vector=False),
    # looped rows: 1024 simulated threads; float32 (a 16-bit row is twice as long, and its
    # codecs run as Python: ~15 s a launch) but for one quantised 16-bit case
    F(FLOAT32, "looped", FLOAT32, in_place=True),
    F(FLOAT32, "looped", vector=False),
    # quantised: int8 / fp8 x residual x xscale dtype rotating over the paths
    F(FLOAT32, "multirow_1thread", FLOAT32, quant="int8", residual=False, xscale=FLOAT32),
    F(BFLOAT16, "multirow_warp", BFLOAT16, vector=False, quant="float8_e4m3fn"),
    F(BFLOAT16, "multirow_warps", FLOAT32, quant="int8", xscale=BFLOAT16),
    F(FLOAT16, "row", FLOAT16, quant="float8_e4m3fn", residual=False, xscale=FLOAT32),
    F(FLOAT32, "row", None, vector=False, quant="int8"),
    F(BFLOAT16, "row_odd_wavefronts", BFLOAT16, quant="float8_e4m3fn", xscale=FLOAT32),
    F(FLOAT32, "looped", FLOAT32, quant="int8", residual=False, xscale=FLOAT32),
    F(FLOAT16, "looped", FLOAT32, vector=False, quant="float8_e4m3fn"),
    F(FLOAT32, "looped", None, vector=False, quant="float8_e4m3fn", xscale=FLOAT32),
]


def make_inputs(rng, case, m, n, offset=0):
    """x, residual and the weight / xscale as the case has them; x and residual start ``offset``
    bytes past a 16-byte boundary (the scalar twin: offset = one element)."""
    x = aligned_copy(random_array(rng, (m, n), case.dtype), offset=offset)
    residual = aligned_copy(random_array(rng, (m, n), case.dtype), offset=offset)
    w = None if case.weight is None else aligned_copy(random_array(rng, n, case.weight, loc=1.0,
                                                                   scale=0.5))
    xscale = None
    if case.xscale:
        xscale = aligned_copy(random_array(rng, n, case.xscale, loc=1.0, scale=0.3))
    return x, residual, w, xscale


def run(be, case, x, residual, w, xscale):
    """(outputs, spec of the one kernel launched)."""
    with launched_specs(be) as specs:
        if case.quant:
            out = rms_norm_quant(x, w, xscale=xscale, residual=residual if case.residual else None,
                                 quant_dtype=case.quant)
        else:
            out = fused_add_rms_norm(x, residual, w, return_rstd=True)
    assert len(specs) == 1, specs
    return out, specs[0]


def check_case(be, rng, case):
    m, n = case.shape()
    layout = layout_of(n, case.dtype, bool(case.quant))
    x, residual, w, xscale = make_inputs(rng, case, m, n)
    before = [a.copy() for a in (x, residual)]

    out, spec = run(be, case, x, residual, w, xscale)

    assert spec.layout == layout and path_of(spec.layout, spec.rows) == case.path, spec
    assert spec.vector == case.vector and spec.dtype == case.dtype, spec
    assert spec.residual == (case.residual or not case.quant), spec
    assert spec.quant == (case.quant or "") and spec.xscale == (case.xscale or ""), spec
    assert_bitwise(x, before[0], "x after the call")
    assert_bitwise(residual, before[1], "residual after the call")
    if case.quant:
        ref = rms_norm_quant_ref(x, w, xscale=xscale, residual=residual if case.residual else None,
                                 quant_dtype=case.quant)
        assert_quant_close(out[0], out[1], ref[0], ref[1], case.quant)
        if case.residual:
            assert_bitwise(out[2], ref[2].astype(NUMPY[case.dtype]), "residual_out")
    else:
        y, residual_out, rstd = out
        y_ref, h_ref, rstd_ref = fused_add_rms_norm_ref(x, residual, w)
        assert_bitwise(residual_out, h_ref.astype(NUMPY[case.dtype]), "residual_out")
        assert_close(y, y_ref, case.dtype)
        assert_close(rstd, rstd_ref, FLOAT32)
        with launched_specs(be):
            assert_bitwise(y, rms_norm(residual_out, w), "y vs rms_norm(residual_out)")
        if case.in_place:
            xi, ri = aligned_copy(x), aligned_copy(residual)
            with launched_specs(be) as specs:
                fused_add_rms_norm_(xi, ri, w)
            assert [s.vector for s in specs] == [case.vector], specs
            assert_bitwise(xi, y, "in-place x vs y")
            assert_bitwise(ri, residual_out, "in-place residual vs residual_out")

    if case.vector:
        itemsize = NUMPY[case.dtype].itemsize
        twin, twin_spec = run(be, case, aligned_copy(x, offset=itemsize),
                              aligned_copy(residual, offset=itemsize), w, xscale)
        assert not twin_spec.vector and twin_spec.layout == layout, twin_spec
        for i, (a, b) in enumerate(zip(twin, out)):
            assert_bitwise(a, b, f"scalar twin vs vector, output {i}")


# the default tier's representatives: the fused add in place, quantised int8 with residual and
# SmoothQuant, fp8 on one cached row per block; the full tier runs every case
QUICK = {"fused-multirow_1thread-vec-bfloat16-w_bfloat16-in_place",
         "quant_int8-multirow_warps-vec-bfloat16-w_float32-res-xs_bfloat16",
         "quant_float8_e4m3fn-row-vec-float16-w_float16-xs_float32"}


@pytest.mark.parametrize("case", full_tier_except(CASES, lambda c: c.id in QUICK),
                         ids=lambda c: c.id)
def test_sim_fused_path(sim, rng, case):  # noqa: F811
    check_case(sim(32), rng, case)


def test_cases_cover_every_path():
    """Each switch on each path: the fused add and both quantised dtypes, residual and xscale
    on and off, vector and scalar, every dtype."""
    for path in ("multirow", "row", "looped"):
        ops = {(c.quant, c.vector) for c in CASES if c.path == path}
        assert {q for q, _ in ops} >= {None, "int8", "float8_e4m3fn"}, path
        assert {v for _, v in ops} == {True, False}, path
        quant = [c for c in CASES if c.path == path and c.quant]
        assert {c.residual for c in quant} == {True, False}, path
        assert {bool(c.xscale) for c in quant} == {True, False}, path
        dtypes = {c.dtype for c in CASES if c.path == path}
        assert FLOAT32 in dtypes and dtypes & {FLOAT16, BFLOAT16}, path
    for dtype in (FLOAT32, FLOAT16, BFLOAT16):
        assert {c.quant is None for c in CASES if c.dtype == dtype} == {True, False}, dtype
    assert {c.xscale for c in CASES if c.xscale} >= {FLOAT32, BFLOAT16}


WARP64_CASES = [
    F(BFLOAT16, "multirow_warps", BFLOAT16, quant="float8_e4m3fn", xscale=FLOAT32),
    F(FLOAT16, "row_odd_wavefronts", FLOAT32),
]


@pytest.mark.full
@pytest.mark.parametrize("case", WARP64_CASES, ids=lambda c: c.id)
def test_sim_fused_warp64(sim, rng, case):  # noqa: F811
    """The AMD wavefront width: both row reductions (sum, max) over 64 lanes and wavefronts."""
    be = sim(64)
    check_case(be, rng, case)
    assert any("sim64" in key for key in _cache.entries())


@pytest.mark.parametrize("quant,offset", full_tier_except(
    [(None, 1.0), ("int8", 0.0), ("float8_e4m3fn", 0.5)], lambda case: case[0] == "int8"))
def test_sim_fused_runner_gives_the_validated_bits(sim, rng, quant, offset):  # noqa: F811
    """The fused forward's repeat-call runner (GpuBackend.fused_runner) run by the simulator:
    the validated call's bits for the fused add (with rstd) and SmoothQuant with a residual,
    with the weight offset switch either way.  N = 127 is ragged: the runner takes the scalar
    kernel without reading pointer alignment."""
    be = sim()
    m, n = 5, 127
    x, res = random_array(rng, (m, n), BFLOAT16), random_array(rng, (m, n), BFLOAT16)
    w = random_array(rng, (n,), BFLOAT16, loc=1.0, scale=0.1)
    xs = random_array(rng, (n,), FLOAT32, loc=1.0, scale=0.2) if quant else None
    if quant:
        q, ys, ro = rms_norm_quant(x, w, 1e-6, xscale=xs, residual=res, quant_dtype=quant,
                                   weight_offset=offset)
        expected = (q, ro, None, ys)
    else:
        y, ro, r = fused_add_rms_norm(x, res, w, 1e-6, weight_offset=offset, return_rstd=True)
        expected = (y, ro, r, None)
    run = be.fused_runner(HostIO(), (m, n), m, n, (n, n, n, n), BFLOAT16, BFLOAT16,
                          FLOAT32 if quant else "", True, quant or "", not quant, False)
    got = run(x, res, w, xs, 1e-6, offset)
    for name, a, b in zip(("y / q", "residual_out", "rstd", "yscale"), got, expected):
        if b is None:
            assert a is None, name
        else:
            assert_bitwise(a.view(np.uint8) if quant and name == "y / q" else a,
                           b.view(np.uint8) if quant and name == "y / q" else b, name)


@pytest.mark.parametrize("weight,return_rstd", [(BFLOAT16, True), (None, False)])
def test_sim_forward_runner_gives_the_validated_bits(sim, rng, weight, return_rstd):  # noqa: F811
    """rms_norm's repeat-call runner (GpuBackend.fwd_runner) run by the simulator: the validated
    call's bits, with and without a weight and rstd (N = 127: the scalar kernel)."""
    be = sim()
    m, n = 5, 127
    x = random_array(rng, (m, n), BFLOAT16)
    w = None if weight is None else random_array(rng, (n,), weight, loc=1.0, scale=0.1)
    expected = rms_norm(x, w, 1e-6, return_rstd=return_rstd)
    run = be.fwd_runner(HostIO(), (m, n), m, n, n, BFLOAT16, weight or "", return_rstd)
    got = run(x, w, 1e-6, 0.0)
    if return_rstd:
        assert_bitwise(got[0], expected[0], "y")
        assert_bitwise(got[1], expected[1], "rstd")
    else:
        assert_bitwise(got, expected, "y")
