"""The benchmark harness on the CPU target: every op checks ours, the NumPy peer and (where torch
is installed) torch's CPU operators against its float64 reference before timing, records GB/s
from the op's byte formula, writes the JSON the README table is built from, and a wrong
implementation is recorded as failed, not timed."""
import json
import math
import os
import sys

import pytest

from rmsnorm_hip._bench import ops, peers, runner, table

pytestmark = pytest.mark.quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import torch  # noqa: F401  (the CPU mode's torch peer: docs/api.md's `--compare torch`)
    IMPLS = ("ours", "numpy", "torch")
except ImportError:
    IMPLS = ("ours", "numpy")


@pytest.fixture(scope="module")
def all_result(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "all.json"
    result = runner.run(op="all", device="cpu", shapes=["33x256"], dtypes=["bf16", "fp32"],
                        json_path=str(path), progress=False, host_overhead=False,
                        print_table=False)
    return result, path


def test_every_op_runs_and_passes_its_check(all_result):
    result, path = all_result
    assert [run["op"] for run in result["runs"]] == list(ops.ALL)
    for run in result["runs"]:
        spec = ops.OPS[run["op"]]
        assert {(r["impl"], r["dtype"]) for r in run["records"]} == {
            (impl, dtype) for impl in IMPLS for dtype in ("bfloat16", "float32")}
        for record in run["records"]:
            assert record["ok"], (run["op"], record)
            assert 0 <= record["rel_err"] < spec.tolerance[record["dtype"]]
            e = 2 if record["dtype"] == "bfloat16" else 4
            assert record["bytes"] == spec.bytes_moved(33, 256, e)
            assert record["gbps"] == pytest.approx(record["bytes"] / record["us"] / 1e3)
    saved = json.loads(path.read_text())
    assert saved["op"] == "all" and len(saved["runs"]) == len(ops.ALL)


def test_make_table_reads_an_all_run(all_result):
    _, path = all_result
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import make_table
    finally:
        sys.path.pop(0)
    runs = make_table.newest_per_op([str(path)])
    assert sorted(runs) == sorted(ops.ALL)
    text = table.markdown(runs["bwd"][1])
    assert "33x256" in text and "3*M*N*e + 2*N*e" in text


@pytest.mark.parametrize("op", ops.ALL)
def test_a_wrong_output_fails_the_check(op):
    """Each op's reference tells a correct output from a slightly wrong one."""
    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    spec = ops.OPS[op]
    args = spec.make_inputs(target, 17, 128, "float32", 0)
    reference = spec.reference(target, *args)
    impl = spec.peers["cpu"]["numpy"]()
    good = impl(*args)
    assert spec.passes("float32", spec.max_rel_err(target, good, reference))
    outputs = good if isinstance(good, tuple) else (good,)
    wrong = tuple(o.astype("float32") * 1.1 if i == 0 else o for i, o in enumerate(outputs))
    wrong = wrong if isinstance(good, tuple) else wrong[0]
    assert not spec.passes("float32", spec.max_rel_err(target, wrong, reference))


@pytest.mark.parametrize("op", ["qk", "qk_rope"])
def test_qk_timed_in_place_keeps_its_values(op):
    """The in-place QK-norm, called again and again on the case's inputs as the timings do,
    leaves q and k where its first call put them: no drift to subnormals, which the CPU runs
    far slower (the host figure of ours was 15x its cost against out-of-place peers)."""
    import numpy as np

    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    spec = ops.OPS[op]
    args = spec.make_inputs(target, 4, 128, "float32", 0)
    call = spec.ours["cpu"]["ours"]()
    for _ in range(200):
        call(*args)
    for a in args[:2]:      # (T, heads, D): every head's rms the weights' magnitude, 1
        a = np.asarray(a, np.float64)
        np.testing.assert_allclose(np.sqrt((a * a).mean(-1)), 1.0, rtol=1e-3)
        assert not (np.abs(a) < np.finfo(np.float32).tiny).any()


def test_a_warm_up_pass_times_every_checked_implementation_first_and_is_discarded():
    """A target with ``warm_up_pass`` checks every implementation, times each that passed once
    (in order) and discards it, then records a second timing; one that fails its check is never
    timed, one that breaks when timed is recorded as failed; host cases take no warm-up."""
    from rmsnorm_hip._bench import targets
    cpu = targets.make_target("cpu")
    spec = ops.OPS["fwd"]
    numpy_fwd = spec.peers["cpu"]["numpy"]()
    calls, timings = [], []

    class Stub:
        warm_up_pass = True

        def __getattr__(self, name):
            return getattr(cpu, name)

        def time(self, fn):
            fn()
            timings.append(calls[-1])
            return {"us": 100.0 * len(timings)}

        host_time = time

    def impl(name, wrong=False, breaks_when_timed=False):
        def run(*args):
            calls.append(name)
            if breaks_when_timed and calls.count(name) > 1:
                raise RuntimeError("broke")
            out = numpy_fwd(*args)
            return out * 2 if wrong else out
        return run

    impls = {"a": impl("a"), "wrong": impl("wrong", wrong=True), "b": impl("b"),
             "flaky": impl("flaky", breaks_when_timed=True)}
    records = runner._run_case(spec, Stub(), impls, (5, 64, "float32"), 0, False, 1.0)
    # checks a, wrong, b, flaky; warm-up a, b (flaky breaks); recorded a, b (flaky breaks)
    assert calls == ["a", "wrong", "b", "flaky", "a", "b", "flaky", "a", "b", "flaky"]
    assert timings == ["a", "b", "a", "b"]
    by_impl = {r["impl"]: r for r in records}
    assert list(by_impl) == ["a", "wrong", "b", "flaky"]
    assert (by_impl["a"]["us"], by_impl["b"]["us"]) == (300.0, 400.0)
    assert by_impl["a"]["ok"] and by_impl["b"]["ok"]
    assert by_impl["wrong"]["status"] == "failed" and "check failed" in by_impl["wrong"]["error"]
    assert by_impl["flaky"]["status"] == "failed" and "broke" in by_impl["flaky"]["error"]

    calls.clear(), timings.clear()
    records = runner._run_case(spec, Stub(), {"a": impl("a")}, (5, 64, "float32"), 0, True, 1.0)
    assert calls == ["a", "a"] and timings == ["a"] and records[0]["ok"]


# ---- the QK-norm and gated ops (not in `all`: run by name) ----

HEAD_AND_GATED_OPS = ("qk", "qk_rope", "gated", "gated_bwd")


def _documented_bytes(op, M, N, e):
    """The byte formulas as the op summaries state them (Hq = 32, Hk = 8 heads of size N)."""
    qk = 2 * M * (32 + 8) * N * e + 2 * N * e
    return {"qk": qk, "qk_rope": qk + M * N * 4 + M * 8, "gated": 3 * M * N * e + N * e,
            "gated_bwd": 5 * M * N * e + 2 * N * e}[op]


@pytest.mark.parametrize("op", HEAD_AND_GATED_OPS)
def test_head_and_gated_ops_pass_their_checks_on_the_cpu(op):
    """ours, NumPy and (where installed) torch on a tiny float32 case: every output within the
    tolerance of the float64 reference, and the bytes as documented."""
    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    spec = ops.OPS[op]
    impls = runner._implementations(spec, "cpu", "all")
    assert list(impls) == list(IMPLS)
    _, records = runner.checked_records(spec, target, impls, (3, 64, "float32"), 0)
    for record in records.values():
        assert record["ok"], record
        assert 0 <= record["rel_err"] < 1e-5
        assert record["bytes"] == _documented_bytes(op, 3, 64, 4)
    assert spec.bytes_moved(5, 128, 2) == _documented_bytes(op, 5, 128, 2)


@pytest.mark.parametrize("op", ["qk", "qk_rope"])
def test_qk_ops_run_in_place_on_views_of_one_qkv_buffer(op):
    """q and k are (T, 32, D) and (T, 8, D) views into a (T, 48 D) buffer; each check gets
    views of the same shape and strides into a copy of it, so the case's inputs, which the
    timings use, stay as made."""
    import numpy as np

    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    spec = ops.OPS[op]
    args = spec.make_inputs(target, 3, 16, "float32", 0)
    q, k = args[:2]
    assert q.shape == (3, 32, 16) and k.shape == (3, 8, 16) and q.base is k.base
    assert q.base.shape == (3, 48 * 16) and np.shares_memory(k, q.base)
    assert k.ctypes.data - q.ctypes.data == 32 * 16 * 4
    if op == "qk_rope":
        positions, cache = args[5:]
        assert positions.dtype == np.int64 and list(positions) == [0, 1, 2]
        assert cache.dtype == np.float32 and cache.shape == (ops.ROPE_MAX_POSITION, 16)
    before = q.base.copy()
    fresh = spec.fresh_inputs(args)
    assert fresh[0].base is fresh[1].base and fresh[0].base is not q.base
    assert (fresh[0].strides, fresh[1].strides) == (q.strides, k.strides)
    spec.ours["cpu"]["ours"]()(*fresh)
    assert np.array_equal(q.base.view(np.uint32), before.view(np.uint32))
    assert not np.array_equal(fresh[0].base.view(np.uint32), before.view(np.uint32))
    v = slice(40 * 16, None)  # the v part of the buffer is never written
    assert np.array_equal(fresh[0].base[:, v].view(np.uint32), before[:, v].view(np.uint32))


@pytest.mark.parametrize("op", HEAD_AND_GATED_OPS)
def test_a_wrong_head_or_gated_output_fails_the_check(op):
    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    spec = ops.OPS[op]
    args = spec.make_inputs(target, 5, 32, "float32", 0)
    reference = spec.reference(target, *args)
    good = spec.peers["cpu"]["numpy"]()(*spec.fresh_inputs(args))
    assert spec.passes("float32", spec.max_rel_err(target, good, reference))
    outputs = good if isinstance(good, tuple) else (good,)
    for i in range(len(outputs)):  # each output counts
        wrong = tuple(o * 1.001 if j == i else o for j, o in enumerate(outputs))
        wrong = wrong if isinstance(good, tuple) else wrong[0]
        assert not spec.passes("float32", spec.max_rel_err(target, wrong, reference))


def test_head_and_gated_ops_run_from_the_command_line_and_in_decode_mode(monkeypatch):
    """``bench --op NAME`` on the CPU, ours only, exits 0 (the copy bandwidth stubbed: its
    256 MB copies are not what is tested); ``--decode --ops`` accepts them, and the QK-norm
    ops' decode cases are head sizes."""
    from rmsnorm_hip._bench import decode, targets
    monkeypatch.setattr(targets.CpuTarget, "copy_bandwidth", lambda self: {"gbps": 10.0})
    for op in HEAD_AND_GATED_OPS:
        assert runner.main(["--device", "cpu", "--op", op, "--shapes", "2x32", "--dtypes",
                            "fp32", "--compare", "none", "--no-host", "--no-progress"]) == 0
    assert decode.op_names("qk,qk_rope,gated,gated_bwd") == HEAD_AND_GATED_OPS
    assert {N for _, N, _ in decode.cases(op="qk")} == {64, 128, 256}
    assert decode.cases(op="gated") == decode.cases()
    assert len(decode.cases(op="qk_rope")) == 15


# ---- rms_norm_quant's scaled outputs (not in `all`: run by name) ----

SCALED_OPS = ("quant_group", "quant_group_ue8m0", "quant_group_int8", "quant_static", "mxfp8",
              "mxfp4")
assert ops.SCALED == SCALED_OPS


def _scaled_bytes(op, M, N, e):
    """The byte formulas as the op summaries state them: x and weight read, q written, and a
    float32 scale per 128 columns, a scale byte per 32 (MX) or the static scale's 4 bytes read."""
    read = M * N * e + N * e
    return {"quant_group": read + M * N + M * N // 128 * 4,
            "quant_group_ue8m0": read + M * N + M * N // 128 * 4,
            "quant_group_int8": read + M * N + M * N // 128 * 4,
            "quant_static": read + M * N + 4,
            "mxfp8": read + M * N + M * N // 32,
            "mxfp4": read + M * N // 2 + M * N // 32}[op]


def test_scaled_quant_ops_run_only_when_named():
    assert not set(SCALED_OPS) & set(ops.ALL)
    assert ops.ALL == ("fwd", "bwd", "bwd_dres", "fused", "quant", "quant_fp8")
    assert not set(ops.SCALED_RESIDUAL) & set(ops.ALL)
    assert all(op in runner.CUDA_CASES and op in runner.CPU_CASES
               for op in SCALED_OPS + ops.SCALED_RESIDUAL)


@pytest.mark.parametrize("op", SCALED_OPS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_scaled_quant_ops_pass_their_checks_on_the_cpu(op, dtype):
    """ours, NumPy and (where installed) torch within the op's tolerance of the float64 levels
    before rounding, and the bytes as documented."""
    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    spec = ops.OPS[op]
    impls = runner._implementations(spec, "cpu", "all")
    assert list(impls) == list(IMPLS)
    _, records = runner.checked_records(spec, target, impls, (3, 512, dtype), 0)
    for record in records.values():
        assert record["ok"], record
        # the rounding error of the format is most of the tolerance
        assert 0.5 * spec.tolerance[dtype] < record["rel_err"] < spec.tolerance[dtype]
        assert record["bytes"] == _scaled_bytes(op, 3, 512, 4 if dtype == "float32" else 2)
    assert spec.bytes_moved(5, 256, 2) == _scaled_bytes(op, 5, 256, 2)


@pytest.mark.parametrize("op", ops.SCALED_RESIDUAL)
def test_scaled_quant_ops_with_a_residual_check_residual_out(op):
    """NAME_res: ours, NumPy and torch pass on (x, residual, weight, ...), the bytes add the
    residual read and residual_out written, and a residual_out that is x fails the check."""
    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    spec, plain = ops.OPS[op], ops.OPS[op[:-len("_res")]]
    impls = runner._implementations(spec, "cpu", "all")
    assert list(impls) == list(IMPLS)
    args, records = runner.checked_records(spec, target, impls, (3, 512, "bfloat16"), 0)
    for record in records.values():
        assert record["ok"], record
        assert record["bytes"] == plain.bytes_moved(3, 512, 2) + 2 * 3 * 512 * 2
    x, residual = args[:2]
    assert not (x == residual).all()
    outputs = impls["ours"](*args)
    wrong = (*outputs[:-1], x)
    status = runner._check(spec, target, lambda *a: wrong, args, spec.reference(target, *args),
                           "bfloat16")
    assert not status["ok"] and status["status"] == "failed", status


def _truncated(op, levels):
    """``levels`` rounded toward zero onto the op's grid, in the numpy peer's q encoding."""
    import ml_dtypes
    import numpy as np

    if op == "quant_group_int8":
        return np.trunc(levels).astype(np.int8)
    if op == "mxfp4":
        grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
        code = np.searchsorted(grid, np.abs(levels), "right") - 1
        code = code.astype(np.uint8) + 8 * (levels < 0).astype(np.uint8)
        return code[:, 0::2] | (code[:, 1::2] << 4)
    # e4m3: three mantissa bits kept of float32 (the levels here are normal: >= 2**-6)
    bits = levels.astype(np.float32).view(np.int32) & ~0xFFFFF
    return bits.view(np.float32).astype(ml_dtypes.float8_e4m3fn)


def _wrong_outputs(op, good, levels):
    """{what: outputs} of a wrong implementation, each a mistake that must fail the check."""
    import numpy as np

    if op == "quant_static":
        return {"truncated": _truncated(op, levels), "q * 1.1": good.astype(np.float32) * 1.1}
    q, scales = good
    wrong = {"truncated": (_truncated(op, levels), scales),
             "q rows swapped": (q[::-1].copy(), scales)}
    if op in ("mxfp8", "mxfp4"):
        wrong["scale exponent + 1"] = (q, scales + np.uint8(1))
    elif op == "quant_group_ue8m0":
        wrong["scales * 2"] = (q, peers._numpy_column_major(scales * np.float32(2)))
        wrong["scales row-major"] = (q, np.ascontiguousarray(scales))
    else:
        wrong["scales * 1.01"] = (q, scales * np.float32(1.01))
    if op == "mxfp4":
        wrong["nibbles swapped"] = ((q >> 4) | (q << 4), scales)
    return wrong


@pytest.mark.parametrize("op", SCALED_OPS)
def test_a_wrong_scaled_quant_output_fails_the_check(op):
    """Rounding toward zero (about twice the error of round-to-nearest-even), a wrong scale,
    rows out of place, fp4 nibbles swapped and a row-major DeepGEMM scale layout each fail."""
    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    spec = ops.OPS[op]
    args = spec.make_inputs(target, 5, 256, "float32", 0)
    reference = spec.reference(target, *args)
    good = spec.peers["cpu"]["numpy"]()(*args)
    check = lambda out: runner._check(spec, target, lambda *a: out, args, reference,  # noqa: E731
                                      "float32")
    assert check(good)["ok"]
    levels = reference[0] if isinstance(reference, tuple) else reference
    for what, outputs in _wrong_outputs(op, good, levels).items():
        status = check(outputs)
        assert not status["ok"] and status["status"] == "failed", (what, status)
        if what.startswith("scale"):
            reason = "yscale strides" if what.endswith("row-major") else "scales: rel err"
            assert reason in status["error"], (what, status)


def test_mx_outputs_are_compared_as_values_of_their_bits():
    """q and the E8M0 scales are decoded bytes (torch's float8 / float4 / e8m0 dtypes or uint8):
    fp4 pairs low nibble first, and the byte 255 (NaN) fails."""
    import numpy as np

    from rmsnorm_hip._bench import targets
    target = targets.make_target("cpu")
    q = np.array([[0x21, 0xF7]], np.uint8)
    values, scales = ops.OPS["mxfp4"].unpack((q, np.array([[127]], np.uint8)))
    assert values.tolist() == [[0.5, 1.0, 6.0, -6.0]] and scales.tolist() == [[1.0]]
    values, scales = ops.OPS["mxfp8"].unpack((np.array([[0x38, 0xB8]], np.uint8),
                                              np.array([[130, 0]], np.uint8)))
    assert values.tolist() == [[1.0, -1.0]] and scales.tolist() == [[8.0, 2.0 ** -127]]
    spec = ops.OPS["mxfp8"]
    args = spec.make_inputs(target, 2, 64, "float32", 0)
    reference = spec.reference(target, *args)
    q, s = spec.peers["cpu"]["numpy"]()(*args)
    s = s.copy()
    s[0, 0] = 255
    assert math.isnan(spec.max_rel_err(target, (q, s), reference))


def test_scaled_quant_ops_run_from_the_command_line_and_in_decode_mode(monkeypatch):
    """``bench --op NAME`` on the CPU, ours only, exits 0; ``--decode --ops`` accepts them, at
    the default decode shapes (every N a multiple of 128)."""
    from rmsnorm_hip._bench import decode, targets
    monkeypatch.setattr(targets.CpuTarget, "copy_bandwidth", lambda self: {"gbps": 10.0})
    for op in SCALED_OPS:
        assert runner.main(["--device", "cpu", "--op", op, "--shapes", "2x256", "--dtypes",
                            "fp32", "--compare", "none", "--no-host", "--no-progress"]) == 0
    assert decode.op_names(",".join(SCALED_OPS)) == SCALED_OPS
    assert all(N % 128 == 0 for op in SCALED_OPS for _, N, _ in decode.cases(op=op))
    assert decode.cases(op="mxfp4") == decode.cases()
