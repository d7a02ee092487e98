"""The benchmark harness on the CPU target: every op checks ours, the NumPy peer and (where torch
is installed) torch's CPU operators against its float64 reference before timing, records GB/s
from the op's byte formula, writes the JSON the README table is built from, and a wrong
implementation is recorded as failed, not timed."""
import json
import os
import sys

import pytest

from rmsnorm_hip._bench import ops, runner, table

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
