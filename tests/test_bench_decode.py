"""The decode mode of the benchmark harness where no GPU is needed: its arguments (on a machine
without CUDA `--decode` stops with exit status 2 and one line), its cases, and the tables built
from a result, best peer / ours per figure."""
import copy
import json
import os
import sys

import pytest

from rmsnorm_hip._bench import decode, ops, runner, table, timing

pytestmark = pytest.mark.quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _exit_status(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        runner.main(argv)
    return stopped.value.code, capsys.readouterr().err


def test_decode_without_cuda_exits_2_with_one_line(capsys, monkeypatch):
    status, err = _exit_status(["--decode", "--device", "cpu"], capsys)
    assert status == 2
    assert err == ("rmsnorm-hip bench: error: --decode needs a CUDA GPU (CUDA graphs and device "
                   "time): --device cpu\n")
    monkeypatch.setattr(decode, "cuda_available", lambda device="auto": False)
    status, err = _exit_status(["--decode", "--ops", "fwd,bwd"], capsys)
    assert status == 2 and err.count("\n") == 1 and "torch sees no CUDA GPU" in err


@pytest.mark.parametrize("argv, message", [
    (["--ops", "fwd"], "--ops goes with --decode"),
    (["--decode", "--ops", "fwd,nope"], "decode: ops must be names of"),
    (["--decode", "--op", "fwd", "--ops", "bwd"], "give --ops or --op, not both"),
    (["--decode", "--plot", "x.png"], "--decode draws no plot"),
    (["--decode", "--graph-replays", "0"], "--graph-replays must be at least 1, got 0"),
])
def test_bad_decode_arguments_exit_2(argv, message, capsys):
    status, err = _exit_status(argv, capsys)
    assert status == 2 and message in err


def test_run_decode_on_the_cpu_raises():
    with pytest.raises(RuntimeError, match="decode mode needs a CUDA GPU"):
        runner.run(decode=True, device="cpu", progress=False, print_table=False)
    with pytest.raises(ValueError, match="graph_replays must be a positive int"):
        runner.run(decode=True, device="cpu", graph_replays=0)


def test_default_cases_and_ops():
    cases = decode.cases()
    assert len(cases) == 20 and len(set(cases)) == 20
    assert cases[:5] == tuple((M, 2048, "bfloat16") for M in (1, 8, 32, 128, 512))
    assert {(M, N) for M, N, _ in cases} == {(M, N) for M in (1, 8, 32, 128, 512)
                                             for N in (2048, 4096, 5120, 8192)}
    assert decode.cases(["4x4096", (2, 8)], ["fp16", "bf16"]) == (
        (4, 4096, "float16"), (4, 4096, "bfloat16"), (2, 8, "float16"), (2, 8, "bfloat16"))
    assert decode.op_names() == decode.op_names("all") == (
        "fwd", "fused", "fused_inplace", "quant", "bwd")
    assert decode.op_names("quant, fwd,quant") == ("quant", "fwd")
    assert decode.op_names(["bwd_dres"]) == ("bwd_dres",)
    with pytest.raises(ValueError):
        decode.op_names("fwd,fast")


def test_named_peers_apply_to_the_ops_that_have_them():
    specs = {name: ops.OPS[name] for name in ("fwd", "quant")}
    assert decode._per_op_compare(specs, "quack,torch") == {
        "fwd": ["quack", "torch"], "quant": ["torch"]}
    assert decode._per_op_compare(specs, False) == {"fwd": False, "quant": False}
    with pytest.raises(ValueError, match="liger"):
        decode._per_op_compare({"quant": ops.OPS["quant"]}, "liger")


def test_fused_inplace_is_checked_on_copies():
    import numpy as np

    spec = ops.OPS["fused_inplace"]
    assert spec.in_place and spec.peers["cuda"].keys() == ops.OPS["fused"].peers["cuda"].keys()
    args = (np.ones((2, 4), np.float32), np.zeros((2, 4), np.float32), np.ones(4), 1e-6)
    fresh = spec.fresh_inputs(args)
    assert fresh[0] is not args[0] and fresh[1] is not args[1] and fresh[3] == 1e-6
    fresh[0][:] = 5
    assert (args[0] == 1).all()
    assert ops.OPS["fused"].fresh_inputs(args) is args


def test_marker_separates_calls_like_the_flush():
    trace = [("k0", 0, 9.0), ("mark", 1, 1.0), ("k1", 2, 2.0), ("k2", 3, 1.0), ("mark", 4, 1.0),
             ("mark", 5, 1.0), ("k1", 6, 2.5)]
    assert timing._split_calls(trace, {"mark"}) == [[("k1", 2.0), ("k2", 1.0)], [("k1", 2.5)]]


def _record(op, M, N, impl, graph=None, us=None, warm=None, host=None, status="ok",
            dtype="bfloat16", error=None):
    return {"op": op, "M": M, "N": N, "dtype": dtype, "impl": impl, "ok": status == "ok",
            "status": status, "error": error, "rel_err": 1e-3 if status == "ok" else None,
            "graph_us": graph, "us": us, "warm_us": warm, "host_us": host}


RESULT = {
    "schema": 1, "mode": "decode", "op": "decode", "ops": ["fwd", "fused_inplace"],
    "target": "cuda",
    "environment": {"device": "NVIDIA H200", "date": "2026-12-04T10:00:00+00:00",
                    "versions": {"torch": "2.9.0"}},
    "method": {"counts": {"iters": 10, "graph_calls": 50, "graph_replays": 10,
                          "host_calls": 300, "host_repeats": 3}, "pdl": "1"},
    "records": [
        _record("fwd", 1, 4096, "ours", 2.0, 1.5, 1.2, 5.0),
        _record("fwd", 1, 4096, "ours_torch", 1.0, 1.0, 1.0, 1.0),  # ours: never the best peer
        _record("fwd", 1, 4096, "torch", 3.0, 2.0, 1.5, 10.0),
        _record("fwd", 1, 4096, "quack", 2.5, 3.0, 1.1, 8.0),
        _record("fwd", 1, 4096, "liger", status="unavailable", error="ImportError: liger"),
        _record("fused_inplace", 8, 2048, "ours", status="failed", dtype="float16",
                error="check failed: rel err 0.5, tolerance 0.01"),
        _record("fused_inplace", 8, 2048, "torch_compile", 12.5, 4.25, 3.0, None,
                dtype="float16"),
    ],
}


def test_decode_markdown_gives_best_peer_and_ratio_per_figure():
    lines = table.decode_markdown(RESULT).split("\n")
    assert lines[0].startswith("rmsnorm_hip bench decode on NVIDIA H200 (cuda, RMSNORM_HIP_PDL=1)"
                               ", 2026-12-04: us per call; graph: 50 calls captured in one CUDA "
                               "graph, replay time / calls, median of 10 replays;")
    assert "warm" not in lines[0] and "ratio: best peer / ours (> 1: ours is faster)." in lines[0]
    assert lines[2:6] == [
        ("| op | MxN | graph us ours | best peer | ratio | flushed us ours | best peer | ratio "
         "| host us ours | best peer | ratio |"),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ("| fwd | 1x4096 | 2 | 2.5 (QuACK) | 1.25 | 1.5 | 2 (torch eager) | 1.33 | 5 "
         "| 8 (QuACK) | 1.60 |"),
        ("| fused_inplace | 8x2048 fp16 | fail | 12.5 (torch.compile) | – | fail "
         "| 4.25 (torch.compile) | – | fail | – | – |"),
    ]
    assert lines[6:] == [
        "", ("fused_inplace: ours in place (`fused_add_rms_norm_`); the peers are the "
             "out-of-place fused calls."),
        "", "Versions: torch 2.9.0."]


def test_decode_text_report_has_every_figure_and_the_errors():
    text = table.decode_text_report(RESULT)
    header, row = text.split("\n")[2:4]
    assert header.split() == ["op", "MxN", "graph", "ours", "best", "peer", "x", "flushed", "ours",
                              "best", "peer", "x", "warm", "ours", "best", "peer", "x", "host",
                              "ours", "best", "peer", "x"]
    assert row.split() == ["fwd", "1x4096", "2", "2.5", "quack", "1.25", "1.5", "2", "torch",
                           "1.33", "1.2", "1.1", "quack", "0.92", "5", "8", "quack", "1.60"]
    assert "  ours: check failed: rel err 0.5, tolerance 0.01  [fused_inplace 8x2048 fp16]" in text
    assert "liger: ImportError: liger  [fwd 1x4096 bf16]" in text


def test_make_table_prints_a_decode_run(tmp_path, capsys):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(RESULT))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import make_table
    finally:
        sys.path.pop(0)
    assert make_table.main(["--decode", str(path)]) == 0
    assert capsys.readouterr().out == table.decode_markdown(RESULT) + "\n"
    assert make_table.newest_per_op([str(path)]) == {}  # not one of the per-op tables
    other = copy.deepcopy(RESULT)
    del other["mode"]
    path.write_text(json.dumps(other))
    assert make_table.main(["--decode", str(path)]) == 1
