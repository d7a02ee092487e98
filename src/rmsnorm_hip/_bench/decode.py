"""Decode mode (``--decode``): small batches, where a call takes microseconds and the launch path
and the cache, not bandwidth, decide.  For each op, case (M, N, dtype) and implementation, four
figures in us per call:

- ``graph_us``: `Counts.graph_calls` calls captured in one CUDA graph, the replay's CUDA-event
  time / calls, median over `Counts.graph_replays` replays: what a serving engine's decode step
  sees (timing.cuda_graph_time).
- ``us``: device time with the L2 flushed before each call, as in the main mode.
- ``warm_us``: device time without the flush: the L2 holds what the previous call left, as
  between the layers of a decode step (a marker kernel, timing.CallMarker, separates the calls).
- ``host_us``: wall time of `Counts.host_calls` eager calls and one sync, median of
  `Counts.host_repeats` rounds that take the implementations of a case in turn.

Every implementation is first checked against the float64 reference (runner._check); a failing
one is recorded with its error and not timed.  The checks, host and graph figures of every case
come first, the device times (the profiler) after them: see `_sweep`.  A figure that cannot be
measured (a peer that cannot be captured in a graph) is None and its error recorded; the other
figures are kept.  The ratios best peer / ours are computed by the tables
(table.decode_text_report, decode_markdown), not stored.
"""
import gc
import os
import statistics
import sys
from dataclasses import asdict, dataclass

from . import ops, runner, table, targets, timing

DEFAULT_OPS = ("fwd", "fused", "fused_inplace", "quant", "bwd")
MS = (1, 8, 32, 128, 512)
NS = (2048, 4096, 5120, 8192)
# The QK-norm ops' N is the head size (ops.QK_HEADS heads per token): these instead of NS.
HEAD_SIZES = (64, 128, 256)
OP_NS = {"qk": HEAD_SIZES, "qk_rope": HEAD_SIZES}
FIGURES = ("graph_us", "us", "warm_us", "host_us")
SPIN_UP_CALLS = 2000  # ~0.25 s of 256 MB kernels on an H200


@dataclass(frozen=True)
class Counts:
    iters: int = 10           # profiled calls per device-time figure
    graph_calls: int = 50     # calls captured in one graph
    graph_replays: int = 10   # timed replays (median)
    host_calls: int = 300     # eager calls per host timing
    host_repeats: int = 5     # host timing rounds (median)

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"decode: {name} must be a positive int, got {value!r}")


def cases(shapes=None, dtypes=None, op=None):
    """(M, N, dtype) in run order: N by N, M rising within each (a model's hidden size, batch
    sizes; `op`'s head sizes for the QK-norm ops, OP_NS); the given shapes in their order."""
    if shapes is None:
        shapes = [(M, N) for N in OP_NS.get(op, NS) for M in MS]
    dtypes = [runner._dtype_name(d) for d in (dtypes or ["bfloat16"])]
    return tuple((M, N, dtype) for M, N in map(runner._shape, shapes) for dtype in dtypes)


def op_names(op=None):
    """The ops to run from run()'s `op`: None or "all" (DEFAULT_OPS), a name, "a,b" or a list."""
    if op is None or op == "all":
        return DEFAULT_OPS
    names = [n.strip() for n in (op.split(",") if isinstance(op, str) else op) if n.strip()]
    unknown = [n for n in names if n not in ops.OPS]
    if unknown or not names:
        raise ValueError(f"decode: ops must be names of {sorted(ops.OPS)}, got {op!r}")
    return tuple(dict.fromkeys(names))


def cuda_available(device="auto"):
    """Whether the decode mode can run: a CUDA GPU through torch, and not --device cpu."""
    if device == "cpu":
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run(op=None, shapes=None, dtypes=None, json_path=None, compare=True, progress=True, *,
        device="auto", flush="write", counts=Counts(), host=True, seed=0, print_table=True):
    """The decode sweep; returns the result dict (see the package docstring).  Raises
    RuntimeError without a CUDA GPU."""
    names = op_names(op)
    case_lists = {name: cases(shapes, dtypes, name) for name in names}
    specs = {name: ops.OPS[name] for name in names}
    compare = _per_op_compare(specs, compare)
    if flush not in ("write", "read"):
        raise ValueError(f"decode: flush must be 'write' or 'read', got {flush!r}")
    if not cuda_available(device):
        raise RuntimeError("decode mode needs a CUDA GPU through torch (CUDA graphs, device time)")
    target = targets.make_target("cuda", flush_mode=None, iters=counts.iters)
    impls = {name: runner._implementations(spec, "cuda", compare[name])
             for name, spec in specs.items()}
    plan = [(specs[name], case, seed + 100 * index)
            for name in names for index, case in enumerate(case_lists[name])]
    result = _new_result(target, specs, flush, counts, host, seed)
    bar = runner._Progress(2 * len(plan), progress)
    try:
        _spin_up(target.torch)
        _sweep(plan, impls, target, result, json_path, bar, counts, host, flush)
    except KeyboardInterrupt:  # also `timeout --signal=INT`: keep and report what was measured
        result["interrupted"] = True
        print("interrupted: the results below are partial", file=sys.stderr, flush=True)
    finally:
        bar.close()
    if json_path:
        runner._write_json(result, json_path)
    if print_table:
        print(table.decode_text_report(result), flush=True)
    return result


def _sweep(plan, impls, target, result, json_path, bar, counts, host, flush):
    """Checks, host and graph figures of every case first, then the device times: the profiler
    behind the device times may leave CUPTI attached to the process (whether Kineto tears it
    down depends on the torch version and TEARDOWN_CUPTI), and its callbacks would then add to
    the host cost of every later launch."""
    checked = []
    for spec, case, case_seed in plan:
        records, passed = _check_case(spec, target, impls[spec.name], case, case_seed)
        result["records"].extend(records.values())
        passed = _time_case(spec, target, impls[spec.name], case, case_seed, records, passed,
                            _launch_timers(counts), counts if host else None)
        checked.append((records, passed))
        _progress(bar, json_path, result, spec.name, case, records, "graph_us")
    target.flush = timing.L2Flush(flush)
    marker = timing.CallMarker()
    for (spec, case, case_seed), (records, passed) in zip(plan, checked):
        _time_case(spec, target, impls[spec.name], case, case_seed, records, passed,
                   _device_timers(target, marker, counts))
        _progress(bar, json_path, result, spec.name, case, records, "us")


def _progress(bar, json_path, result, op, case, records, figure):
    if json_path:
        runner._write_json(result, json_path)
    bar.step(_summary(op, case, records.values(), figure))


def _per_op_compare(specs, compare):
    """{op: compare} where named peers are kept for the ops that have them (`--compare quack`
    runs quant, which QuACK lacks, with ours alone); a name no op has is an error."""
    if compare in (True, False, None, "all", "none"):
        return dict.fromkeys(specs, compare)
    wanted = [w for w in (compare.split(",") if isinstance(compare, str) else compare) if w]
    chosen = {}
    for name, spec in specs.items():
        available = spec.peers.get("cuda", {})
        chosen[name] = [w for w in wanted
                        if any(p == w or p.startswith(w + "_") for p in available)]
    missing = [w for w in wanted if not any(w in names for names in chosen.values())]
    if missing:
        raise ValueError(f"decode: compare: no op here has a peer named {missing}")
    return chosen


def _new_result(target, specs, flush, counts, host, seed):
    return {
        "schema": 1,
        "mode": "decode",
        "op": "decode",
        "ops": list(specs),
        "target": target.name,
        "environment": target.environment(),
        "method": {
            "summary": {name: spec.summary for name, spec in specs.items()},
            "figures": {
                "graph_us": f"{counts.graph_calls} calls in one CUDA graph, replay time / calls "
                            f"(CUDA events), median of {counts.graph_replays} replays",
                "us": f"device time (CUPTI sum of kernels), L2 flushed ({flush}, 256 MB) before "
                      f"each call, median of {counts.iters} calls",
                "warm_us": f"device time, no flush (a marker kernel between calls), median of "
                           f"{counts.iters} calls",
                "host_us": (f"wall time of {counts.host_calls} eager calls + one sync, median of "
                            f"{counts.host_repeats} rounds over the implementations in turn")
                           if host else None,
            },
            "counts": asdict(counts),
            "order": "checks, host and graph figures of every case first, then the device times "
                     "(the profiler may leave CUPTI attached, adding to the host cost of launches)",
            "fused_inplace_peers": "the out-of-place fused peers, timed in the fused_inplace "
                                   "cases (none has an in-place form)",
            "tolerance": {name: dict(spec.tolerance) for name, spec in specs.items()},
            "seed": seed,
            "pdl": os.environ.get(runner.PDL_ENV),  # RMSNORM_HIP_PDL as the run saw it
        },
        "records": [],
    }


def _spin_up(torch):
    """Runs a 256 MB kernel for a moment, so that the first case does not meet a GPU just out
    of idle."""
    buf = torch.empty(timing.FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(SPIN_UP_CALLS):
        buf.add_(1)
    torch.cuda.synchronize()


def _check_case(spec, target, impls, case, seed):
    """({impl: record}, names of the implementations that passed the check) for one case
    (runner.checked_records); the records hold every figure as None until measured."""
    _, records = runner.checked_records(spec, target, impls, case, seed)
    for record in records.values():
        record.update(dict.fromkeys(FIGURES))
    return records, [name for name, record in records.items() if record["ok"]]


def _time_case(spec, target, impls, case, seed, records, passed, timers, host_counts=None):
    """Measures `timers` ({figure: timer(call)}) for the implementations in `passed`, then with
    `host_counts` their host times (`_host_times`), on the case's inputs made again from its
    seed (fresh copies for each where the op writes them, so that none times another's drifted
    values); returns those that got through warm-up."""
    M, N, dtype = case
    args = spec.make_inputs(target, M, N, dtype, seed)
    calls = {}
    for name in passed:
        call = _bound(impls[name], spec.fresh_inputs(args))
        measured, errors = _time(call, timers)
        if measured is not None:
            calls[name] = call
            records[name].update(measured)
        _add_errors(records[name], errors)
    if host_counts is not None and calls:
        for name, (measured, errors) in _host_times(calls, target, host_counts).items():
            records[name].update(measured)
            _add_errors(records[name], errors)
    warmed = list(calls)
    del args, calls
    target.free_memory()
    return warmed


def _bound(impl, args):
    def call():  # holds args: a captured graph replays their addresses
        return impl(*args)

    return call


def _add_errors(record, errors):
    """Marks the record failed with `errors` added to any it has."""
    if errors:
        errors = [record["error"]] + errors if record["error"] else errors
        record.update(runner._status("failed", "; ".join(errors)))


def _launch_timers(counts):
    return {"graph_us": lambda call: timing.cuda_graph_time(call, counts.graph_calls,
                                                            counts.graph_replays)}


def _device_timers(target, marker, counts):
    return {"us": lambda call: _device_time(call, target.flush, counts.iters),
            "warm_us": lambda call: {"warm_us": _device_time(call, marker, counts.iters)["us"]}}


def _time(call, timers):
    """(figures, errors) of one checked implementation; a figure that fails stays None and its
    error is kept, the others are still measured; figures None when even the warm-up fails."""
    try:
        for _ in range(3):  # kernel loads, compilation and allocator pools before any timing
            call()
    except Exception as error:  # a peer that breaks on one case must not stop the run
        return None, [f"warm-up: {runner._describe(error, 200)}"]
    measured, errors = {}, []
    for figure, timer in timers.items():
        try:
            measured.update(timer(call))
        except Exception as error:  # a peer that breaks in one figure must not stop the others
            measured[figure] = None
            errors.append(f"{figure}: {runner._describe(error, 200)}")
    return measured, errors


def _device_time(call, separator, iters):
    measured = timing.cuda_device_time(call, separator, iters)
    if not measured["us"] > 0:
        raise RuntimeError("no GPU activity recorded")
    return {"us": measured["us"], "kernels_per_call": measured["kernels_per_call"]}


def _host_times(calls, target, counts):
    """{name: (figures, errors)}: `counts.host_repeats` rounds, each one timing.host_time run of
    every implementation in turn, median over the rounds.  The host's speed moves in spells
    (on the H200 machine one call ran at 20 and at 36 us in one process, seconds apart), so the
    implementations share each spell instead of one of them taking it alone."""
    runs = {name: [] for name in calls}
    errors = {}
    # No garbage collection while timing, as timeit: a full collection of the objects that
    # torch.compile keeps, inside one short run, would pass for launch cost.
    gc.collect()
    gc.disable()
    try:
        for _ in range(counts.host_repeats):
            for name, call in calls.items():
                if name in errors:
                    continue
                try:
                    runs[name] += timing.host_time(call, target.sync, counts.host_calls,
                                                   1)["host_us_runs"]
                except Exception as error:  # a peer that breaks must not stop the others
                    errors[name] = f"host_us: {runner._describe(error, 200)}"
    finally:
        gc.enable()
    return {name: ({"host_us": None}, [errors[name]]) if name in errors else
            ({"host_us": statistics.median(runs[name]), "host_us_runs": runs[name]}, [])
            for name in calls}


def _summary(op, case, records, figure):
    M, N, dtype = case
    cells = [f"{r['impl']} {r[figure]:.2f}" if r[figure] is not None
             else f"{r['impl']} {r['status']}" for r in records]
    unit = {"graph_us": "graph us", "us": "flushed us"}[figure]
    return f"{op} {M}x{N} {targets.SHORT_DTYPE[dtype]}: {', '.join(cells)} {unit}"
