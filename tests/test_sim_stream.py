"""The streamed forward (kernels/_config.FWD_STREAM_ROWS_PER_SM: a persistent grid whose
programs walk rows, loading the next row's words during this one) run by the numba-cuda
simulator.  The simulator
backend holds two programs, so these M give each program several rows: both word buffers, both
halves of the reduction buffer, an odd and an even number of rows per program, and rows past M
in a block of rows.  Every output must be the one-shot kernel's bits (not streamed: one block
per row block) and close to the float64 reference; in place, the arrays are the outputs."""
import dataclasses

import numpy as np
import pytest
from _paths import layout_of, pick_n
from conftest import (BFLOAT16, FLOAT16, FLOAT32, aligned_copy, assert_bitwise, assert_close,
                      assert_levels_close, assert_quant_close, full_tier_except,
                      random_array)
from test_sim import launched_specs, sim  # noqa: F401  (sim is a fixture)

from rmsnorm_hip import fused_add_rms_norm, fused_add_rms_norm_, rms_norm, rms_norm_quant
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import (fused_add_rms_norm_ref, rms_norm_quant_ref,
                                   rms_norm_quant_scaled_ref, rms_norm_ref)

pytestmark = [pytest.mark.quick, pytest.mark.sim]

OPS = ("rms_norm", "fused_add", "fused_add_", "quant_int8", "quant_int8_xscale_only",
       "quant_fp8_residual")


def _call(op, x, res, w, xs, offset):
    """The op's outputs as a tuple of arrays (in place: copies of x and residual, updated)."""
    if op == "rms_norm":
        return rms_norm(x, w, 1e-6, weight_offset=offset, return_rstd=True)
    if op == "fused_add":
        return fused_add_rms_norm(x, res, w, 1e-6, weight_offset=offset, return_rstd=True)
    if op == "fused_add_":
        x, res = aligned_copy(x), aligned_copy(res)
        fused_add_rms_norm_(x, res, w, 1e-6, weight_offset=offset)
        return x, res
    if op == "quant_int8":
        return rms_norm_quant(x, w, 1e-6, xscale=xs, weight_offset=offset)
    if op == "quant_int8_xscale_only":     # no weight: the gains are xscale's
        return rms_norm_quant(x, None, 1e-6, xscale=xs)
    if op == "static_fp8_residual":         # a static scale: (q, residual_out)
        return rms_norm_quant(x, w, 1e-6, residual=res, scale=0.05,
                              quant_dtype="float8_e4m3fn", weight_offset=offset)
    return rms_norm_quant(x, w, 1e-6, xscale=xs, residual=res, quant_dtype="float8_e4m3fn",
                          weight_offset=offset)


def _run(be, op, inputs, stream, monkeypatch):
    every_m = dict.fromkeys(_config.FWD_STREAM_ROWS_PER_SM["cuda"], None if stream else 0)
    monkeypatch.setattr(_config, "FWD_STREAM_ROWS_PER_SM", {"cuda": every_m, "hip": every_m})
    with launched_specs(be) as specs:
        out = _call(op, *inputs)
    assert len(specs) == 1 and specs[0].stream == stream, specs
    # streamed rows hold their gains (FwdSpec.held_weights; quantised rows past M weighed too)
    assert specs[0].held_weights == stream, specs
    return out, specs[0]


def _assert_same_outputs(got, want, what, rows=None):
    """Each output of ``got`` bitwise ``want``'s (its first ``rows`` rows when given); 8-bit
    outputs compared as bytes."""
    for i, (a, b) in enumerate(zip(got, want)):
        a = a.view(np.uint8) if a.dtype.itemsize == 1 else a
        b = b.view(np.uint8) if b.dtype.itemsize == 1 else b
        assert_bitwise(a, b if rows is None else b[:rows], f"output {i}: {what}")


def _specs_by_kernel(be, monkeypatch):
    """{id(kernel): spec} of every kernel ``be`` builds from now on."""
    specs, build = {}, be.kernel

    def tagging(builder, spec, argtypes):
        kernel = build(builder, spec, argtypes)
        specs[id(kernel)] = spec
        return kernel
    monkeypatch.setattr(be, "kernel", tagging)
    return specs


FLAVORS = [("row", 3), ("row", 4), ("multirow_warps", 3)]
CASES = [(op, flavor, rows) for op in OPS for flavor, rows in FLAVORS]


# the default tier's representatives; the full tier runs every op on every flavor
QUICK = {("rms_norm", "row", 3), ("quant_int8", "multirow_warps", 3),
         ("fused_add_", "multirow_warps", 3)}


@pytest.mark.parametrize("op,flavor,rows_per_program", full_tier_except(CASES, QUICK.__contains__),
                         ids=lambda v: str(v))
def test_sim_streamed_rows_give_the_one_shot_bits(sim, rng, monkeypatch, op, flavor,  # noqa: F811
                                                  rows_per_program):
    be = sim()
    quant = op.startswith("quant")
    dtype = FLOAT16 if op == "fused_add_" else BFLOAT16
    n = pick_n(flavor, dtype, vector=True, quant=quant)
    rows = _config.rows_per_block(layout_of(n, dtype, quant))
    # two programs; the last row block of the last program is part empty when rows > 1
    m = 2 * rows * rows_per_program - (1 if rows > 1 else 0)
    x = aligned_copy(random_array(rng, (m, n), dtype))
    res = aligned_copy(random_array(rng, (m, n), dtype))
    w = aligned_copy(random_array(rng, n, FLOAT32 if quant else dtype, loc=1.0, scale=0.2))
    xs = aligned_copy(random_array(rng, n, FLOAT32, loc=1.0, scale=0.2)) if quant else None
    # an offset where the kernel takes its offset add (quantised rows drop it at offset 0)
    offset = 0.5 if op in ("fused_add", "quant_fp8_residual") else 0.0
    inputs = (x, res, w, xs, offset)
    x0, res0 = x.copy(), res.copy()

    streamed, spec = _run(be, op, inputs, True, monkeypatch)
    one_shot, spec1 = _run(be, op, inputs, False, monkeypatch)

    assert spec.vector and spec.layout == spec1.layout and spec.rows == rows, spec
    # the offset switch: quantised rows with a weight only
    assert spec.offset == (offset != 0.0 or not quant or op == "quant_int8_xscale_only")
    _assert_same_outputs(streamed, one_shot, f"{op} streamed vs one-shot")
    assert_bitwise(x, x0, "x after the call")
    assert_bitwise(res, res0, "residual after the call")

    if op == "rms_norm":
        y_ref, rstd_ref = rms_norm_ref(x, w, weight_offset=offset)
        assert_close(streamed[0], y_ref, dtype)
        assert_close(streamed[1], rstd_ref, FLOAT32)
    elif op.startswith("fused_add"):
        y_ref, ro_ref = fused_add_rms_norm_ref(x, res, w, weight_offset=offset)[:2]
        assert_close(streamed[0], y_ref, dtype)
        assert_close(streamed[1], ro_ref, dtype)
    else:
        fmt = "int8" if op.startswith("quant_int8") else "float8_e4m3fn"
        ref = rms_norm_quant_ref(x, None if op == "quant_int8_xscale_only" else w, xscale=xs,
                                 residual=None if fmt == "int8" else res, quant_dtype=fmt,
                                 weight_offset=offset)
        assert_quant_close(streamed[0], streamed[1], ref[0], ref[1], fmt)


def test_stream_is_chosen_for_cached_vector_rows_only():
    """The streamed grid takes cached rows on the vector path (per kind, up to a number of rows
    per SM); looped rows and the scalar (unaligned) path keep one block per row block, and give
    the same bits (tests above and test_sim's scalar twins)."""
    cached = _config.fwd_spec(4096, BFLOAT16, BFLOAT16, True, False, stream=True)
    assert cached.layout.cached and cached.stream
    assert not _config.fwd_spec(4096, BFLOAT16, BFLOAT16, False, False, stream=True).stream
    looped = _config.fwd_spec(65536, BFLOAT16, BFLOAT16, True, False, stream=True)
    assert not looped.layout.cached and not looped.stream
    assert _config.fwd_programs(cached, 10_000, 132, 6) == 132 * 6
    assert _config.fwd_programs(cached, 100, 132, 6) == 100
    assert _config.fwd_programs(looped, 10_000, 132, 6) == 10_000
    # held gains: streamed rows with a weight or an xscale to hold, only
    def held(vector=True, quant="int8", weight=BFLOAT16, xscale=FLOAT32):
        return _config.fwd_spec(4096, BFLOAT16, weight, vector, False, quant=quant,
                                xscale=xscale if quant else "", stream=True).held_weights
    assert held() and held(weight="") and held(xscale="") and held(quant="")
    assert not held(vector=False) and not held(weight="", xscale="")
    assert not held(quant="", weight="")
    with pytest.raises(ValueError, match="held_weights needs a streamed spec"):
        dataclasses.replace(looped, held_weights=True)
    limits = _config.FWD_STREAM_ROWS_PER_SM
    for vendor, kinds in limits.items():
        for kind, limit in kinds.items():
            residual, quant = kind.endswith("residual"), "int8" if "quant" in kind else ""
            assert _config.fwd_kind(residual, quant) == kind
            small = _config.fwd_stream(vendor, residual, quant, 1, 132)
            large = _config.fwd_stream(vendor, residual, quant, 10**7, 132)
            assert small == (limit != 0) and large == (limit is None), (vendor, kind)


@pytest.mark.parametrize("op", ["quant_fp8_residual", "static_fp8_residual"])
def test_sim_one_shot_wave_between_the_streamed_rows_and_a_wave(sim, rng,  # noqa: F811
                                                                monkeypatch, op):
    """Quantised rows with a residual (_config.FWD_ONE_SHOT_WAVE) run one-shot where more rows
    than the streamed grid takes at once fit one wave of one-shot blocks, streamed outside that
    window; a row's outputs are the same bits whatever M, so whichever grid ran them."""
    from rmsnorm_hip import functional
    be = sim()
    specs = _specs_by_kernel(be, monkeypatch)
    # one streamed program an SM against three one-shot blocks (the simulator has one SM)
    monkeypatch.setattr(be, "resident_per_sm", lambda kernel, threads:
                        1 if specs[id(kernel)].stream else 3)
    launched = []
    launch = be.launch

    def recording(kernel, grid, block, args, stream):
        launched.append((specs[id(kernel)].stream, grid[0]))
        return launch(kernel, grid, block, args, stream)
    monkeypatch.setattr(be, "launch", recording)
    n = pick_n("row", BFLOAT16, vector=True, quant=True)
    assert _config.rows_per_block(layout_of(n, BFLOAT16, True)) == 1
    x = aligned_copy(random_array(rng, (4, n), BFLOAT16))
    res = aligned_copy(random_array(rng, (4, n), BFLOAT16))
    w = aligned_copy(random_array(rng, n, FLOAT32, loc=1.0, scale=0.2))
    xs = aligned_copy(random_array(rng, n, FLOAT32, loc=1.0, scale=0.2))
    try:
        outs = {}
        # (M, streamed, blocks): the streamed grid takes one row at once, a wave three
        for m, stream, blocks in ((1, True, 1), (2, False, 2), (3, False, 3), (4, True, 1)):
            launched.clear()
            outs[m] = _call(op, aligned_copy(x[:m]), aligned_copy(res[:m]), w, xs, 0.5)
            assert launched == [(stream, blocks)], (m, launched)
        if op == "quant_fp8_residual":
            ref = rms_norm_quant_ref(x, w, xscale=xs, residual=res,
                                     quant_dtype="float8_e4m3fn", weight_offset=0.5)
            assert_quant_close(outs[4][0], outs[4][1], ref[0], ref[1], "float8_e4m3fn")
        else:
            levels, _, ro_ref = rms_norm_quant_scaled_ref(
                x, w, residual=res, quant_dtype="float8_e4m3fn", weight_offset=0.5, scale=0.05)
            assert_levels_close(outs[4][0], levels, "float8_e4m3fn")
            assert_close(outs[4][1], ro_ref, BFLOAT16)
        for m in (1, 2, 3):
            _assert_same_outputs(outs[m], outs[4], f"M = {m} against M = 4's rows", rows=m)
    finally:
        functional.forget_plans()


@pytest.mark.parametrize("op,too_big,launched", [
    # a streamed program of too many registers; any block built without bounds
    ("rms_norm", "streamed", dict(stream=False, bounded=False)),
    ("quant_fp8_residual", "free", dict(stream=False, bounded=True)),
])
def test_sim_kernels_that_fit_no_sm_fall_back(sim, rng, monkeypatch, op, too_big,  # noqa: F811
                                              launched):
    """A forward kernel the driver can hold no block of on an SM (ptxas gave it the registers
    it asked for) is not launched: a streamed program runs one-shot, a one-shot block is built
    to its launch bounds; the same bits as the streamed call."""
    from rmsnorm_hip import functional
    be = sim()
    quant = op.startswith("quant")
    n = pick_n("row", BFLOAT16, vector=True, quant=quant)
    x = aligned_copy(random_array(rng, (3, n), BFLOAT16))
    res = aligned_copy(random_array(rng, (3, n), BFLOAT16))
    w = aligned_copy(random_array(rng, n, FLOAT32 if quant else BFLOAT16, loc=1.0, scale=0.2))
    xs = aligned_copy(random_array(rng, n, FLOAT32, loc=1.0, scale=0.2)) if quant else None
    inputs = (x, res, w, xs, 0.5)
    want, spec = _run(be, op, inputs, True, monkeypatch)
    assert spec.stream
    specs = _specs_by_kernel(be, monkeypatch)

    def fits(kernel, threads):
        spec = specs[id(kernel)]
        return 0 if (spec.stream if too_big == "streamed" else not spec.bounded) else 2
    monkeypatch.setattr(be, "resident_per_sm", fits)
    try:
        functional.forget_plans()
        with launched_specs(be) as ran:
            got = _call(op, *inputs)
        (spec,) = ran
        assert (spec.stream, spec.bounded) == (launched["stream"], launched["bounded"]), spec
        assert _config.launch_bounds(spec)[0] == (spec.layout.threads * spec.rows
                                                  if spec.bounded else None)
        _assert_same_outputs(got, want, f"{op} fallback vs streamed")
    finally:
        functional.forget_plans()
