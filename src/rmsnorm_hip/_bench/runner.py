"""Runs one op over a list of cases for every implementation, side by side in one process.

For each case (M, N, dtype): draw random inputs, compute the float64 reference, check every
implementation's error against the op's tolerance, then time those that passed (on CUDA after a
discarded warm-up timing of each). A missing or failing implementation gets a record with its
error; the run goes on. Then the host overhead at small M. See the package docstring
(rmsnorm_hip._bench) for the API and the output; decode.py has the small-batch mode (`--decode`).
"""
import json
import math
import os
import sys

from .._argparse import Parser
from . import ops, table, targets

# The H200 cases per op: large, mid and small row counts, one N that is no power of two, and
# float32.
_LLM = ((32768, 4096), (16384, 8192), (8192, 8192), (4096, 4096), (1024, 8192))
_QK = tuple((M, N, "bfloat16") for M, N in ((32768, 128), (8192, 128), (2048, 128), (8192, 64),
                                              (8192, 256))) + ((8192, 128, "float32"),)
_GATED = tuple((M, N, "bfloat16") for M, N in ((32768, 4096), (16384, 8192), (4096, 4096),
                                               (1024, 8192), (4096, 5120))) + (
    (4096, 4096, "float32"),)
CUDA_CASES = {
    "fwd": tuple((M, N, "bfloat16") for M, N in _LLM) + ((4096, 5000, "bfloat16"),
                                                         (4096, 4096, "float32")),
    "bwd": tuple((M, N, "bfloat16") for M, N in _LLM) + ((4096, 4096, "float32"),),
    "bwd_dres": tuple((M, N, "bfloat16") for M, N in _LLM),
    "fused": tuple((M, N, "bfloat16") for M, N in _LLM if (M, N) != (8192, 8192)),
    "fused_inplace": tuple((M, N, "bfloat16") for M, N in _LLM if (M, N) != (8192, 8192)),
    "quant": tuple((M, N, "bfloat16") for M, N in _LLM if (M, N) != (8192, 8192)),
    "quant_fp8": tuple((M, N, "bfloat16") for M, N in _LLM if (M, N) != (8192, 8192)),
    # M tokens x head size N (ops.QK_HEADS heads per token): prefill to decode-sized batches,
    # D = 128 (Llama 3, Qwen 3) and 64 / 256
    "qk": _QK,
    "qk_rope": _QK,
    # Mamba 2: M tokens x d_inner N (2 * d_model: 4096 for 2.7B-class models, 8192, 5120)
    "gated": _GATED,
    "gated_bwd": _GATED,
    # the scaled quantised outputs at the SmoothQuant cases (N a multiple of the 128-column group)
    **dict.fromkeys(ops.SCALED + ops.SCALED_RESIDUAL,
                    tuple((M, N, "bfloat16") for M, N in _LLM if (M, N) != (8192, 8192))),
}
# Smaller on the CPU, where a call takes milliseconds.
_CPU_FWD = ((4096, 4096, "bfloat16"), (1024, 4096, "bfloat16"), (256, 8192, "bfloat16"),
            (1000, 5000, "bfloat16"), (1024, 4096, "float32"))
_CPU_QK = ((1024, 128, "bfloat16"), (256, 256, "bfloat16"), (1024, 128, "float32"))
CPU_CASES = {"fwd": _CPU_FWD,
             **{op: ((1024, 4096, "bfloat16"), (256, 8192, "bfloat16"), (1024, 4096, "float32"))
                for op in ops.OPS if op != "fwd"},
             "qk": _CPU_QK, "qk_rope": _CPU_QK}
# Host overhead: decode-sized batches, where launch cost decides; in an `all` run for the ops
# listed only (the others share their host path).
HOST_CASES = ((1, 4096, "bfloat16"), (32, 4096, "bfloat16"))
_QK_HOST = ((1, 128, "bfloat16"), (32, 128, "bfloat16"))   # tokens x a head size of 128
HOST_CASES_BY_OP = {"qk": _QK_HOST, "qk_rope": _QK_HOST}
HOST_OPS = ("fwd", "bwd")

# Read by backends.cuda when it makes a backend (not imported here: that imports numba-cuda).
PDL_ENV = "RMSNORM_HIP_PDL"

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32", **{name: name for name in targets.DTYPE_NAMES}}


def run(op=None, shapes=None, dtypes=None, json_path=None, plot_path=None, compare=True,
        progress=True, *, device="auto", iters=None, flush="write", host_overhead=True, seed=0,
        print_table=True, decode=False, pdl=False, graph_calls=50, graph_replays=10,
        host_calls=300, host_repeats=5):
    """Benchmarks `op` (None: "fwd"; "all": every op in turn, one result holding each op's);
    returns the result dict (see the package docstring).  decode=True: the small-batch mode of
    decode.py, where `op` is None or "all" (its default ops), a name, "a,b" or a list."""
    if pdl:  # before our library's first call in this process: a backend reads it when made
        os.environ[PDL_ENV] = "1"
    if decode:
        from . import decode as decode_mode

        if plot_path:
            raise ValueError("run: the decode mode draws no plot")
        iters = decode_mode.Counts.iters if iters is None else iters
        counts = decode_mode.Counts(iters=iters, graph_calls=graph_calls,
                                    graph_replays=graph_replays, host_calls=host_calls,
                                    host_repeats=host_repeats)
        return decode_mode.run(op, shapes, dtypes, json_path, compare, progress, device=device,
                               flush=flush, counts=counts, host=host_overhead, seed=seed,
                               print_table=print_table)
    op = "fwd" if op is None else op
    iters = 20 if iters is None else iters
    if op != "all" and op not in ops.OPS:
        raise ValueError(f"run: op must be 'all' or one of {sorted(ops.OPS)}, got {op!r}")
    target = targets.make_target(device, flush_mode=flush, iters=iters)
    if target.name == "cpu" and device == "auto" and progress:
        try:
            import torch  # noqa: F401
            why = "torch sees no CUDA GPU"
        except ImportError:
            why = "torch is not installed (the GPU timing runs through it: pip install torch)"
        print(f"rmsnorm-hip bench: {why}: timing the CPU backend against NumPy, wall-clock",
              file=sys.stderr, flush=True)
    if op == "all":
        return _run_all(target, shapes, dtypes, json_path, plot_path, compare, progress, iters,
                        flush, host_overhead, seed, print_table)
    return _run_op(target, op, shapes, dtypes, json_path, plot_path, compare, progress, iters,
                   flush, host_overhead, seed, print_table)


def _run_all(target, shapes, dtypes, json_path, plot_path, compare, progress, iters, flush,
             host_overhead, seed, print_table):
    combined = {"schema": 1, "op": "all", "target": target.name,
                "environment": target.environment(), "runs": []}
    for name in ops.ALL:
        result = _run_op(target, name, shapes, dtypes, None, None, compare, progress, iters,
                         flush, host_overhead and name in HOST_OPS, seed, print_table)
        combined["runs"].append(result)
        combined["copy"] = result["copy"]
        if json_path:
            _write_json(combined, json_path)
        if result.get("interrupted"):
            combined["interrupted"] = True
            break
    if plot_path:
        try:
            table.plot(combined, plot_path)
        except ImportError as error:
            print(f"no plot: {error}", file=sys.stderr)
    return combined


def _run_op(target, op, shapes, dtypes, json_path, plot_path, compare, progress, iters, flush,
            host_overhead, seed, print_table):
    spec = ops.OPS[op]
    cases = _cases(target.name, op, shapes, dtypes)
    host_cases = HOST_CASES_BY_OP.get(op, HOST_CASES) if host_overhead else ()
    impls = _implementations(spec, target.name, compare)
    result = {
        "schema": 1,
        "op": op,
        "target": target.name,
        "environment": target.environment(),
        "method": {
            "summary": spec.summary,
            "bytes_formula": spec.bytes_formula,
            "timer": target.timer,
            "iters": iters if target.name == "cuda" else None,
            "l2_flush": f"{flush}, 256 MB" if target.name == "cuda" else None,
            "warm_up_pass": target.warm_up_pass,   # device timings; not the host cases
            "tolerance": dict(spec.tolerance),
            "seed": seed,
            "pdl": os.environ.get(PDL_ENV),  # RMSNORM_HIP_PDL as the run saw it
        },
        "copy": target.copy_bandwidth(),
        "records": [],
        "host_overhead": [],
    }
    copy_gbps = result["copy"]["gbps"]
    bar = _Progress(len(cases) + len(host_cases), progress)
    try:
        for index, case in enumerate(cases + host_cases):
            is_host_case = index >= len(cases)
            records = _run_case(spec, target, impls, case, seed + 100 * index, is_host_case,
                                copy_gbps)
            result["host_overhead" if is_host_case else "records"].extend(records)
            if json_path:
                _write_json(result, json_path)
            bar.step(_summary(op, case, records, is_host_case))
    except KeyboardInterrupt:  # also `timeout --signal=INT`: keep and report what was measured
        result["interrupted"] = True
        print("interrupted: the results below are partial", file=sys.stderr, flush=True)
    finally:
        bar.close()
    if json_path:
        _write_json(result, json_path)
    if print_table:
        print(table.text_report(result), flush=True)
    if plot_path:
        try:
            table.plot(result, plot_path)
        except ImportError as error:
            print(f"no plot: {error}", file=sys.stderr)
    return result


def _run_case(spec, target, impls, case, seed, is_host_case, copy_gbps):
    """One record per implementation for one (M, N, dtype), all on the same inputs: every
    implementation is checked first, then those that passed are timed (after a warm-up pass on
    targets that take one, ``_warm_up``)."""
    args, records = checked_records(spec, target, impls, case, seed)
    passed = {name: impls[name] for name, record in records.items() if record["ok"]}
    if target.warm_up_pass and not is_host_case:
        _warm_up(target, passed, args)
    for name, impl in passed.items():
        record = records[name]
        record.update(_time(target, impl, args, is_host_case))
        if record["ok"] and not is_host_case:
            record["gbps"] = record["bytes"] / record["us"] / 1e3  # bytes per us -> GB/s
            record["pct_copy"] = 100 * record["gbps"] / copy_gbps
    del args
    target.free_memory()
    return list(records.values())


def checked_records(spec, target, impls, case, seed):
    """(the case's inputs, {impl: record}): every implementation checked against the float64
    reference on the same inputs (fresh copies where the op writes its inputs)."""
    M, N, dtype = case
    args = spec.make_inputs(target, M, N, dtype, seed)
    reference = spec.reference(target, *args)
    nbytes = spec.bytes_moved(M, N, target.itemsize(dtype))
    records = {}
    for name, impl in impls.items():
        record = {"op": spec.name, "M": M, "N": N, "dtype": dtype, "impl": name, "bytes": nbytes}
        record.update(_check(spec, target, impl, spec.fresh_inputs(args), reference, dtype))
        records[name] = record
    return args, records


def _warm_up(target, impls, args):
    """Times every implementation once on the case's inputs and discards the numbers.  On the
    H200 the first implementation timed after a large case ran slow for about a second (the
    fused add at 4096x4096: 38.6 us right after 32768x4096, 34.4-35.9 us in the next five
    timings of the same call; docs/performance.md), so without this pass the order of the
    implementations, not the implementations, decided part of the table.  An implementation
    that fails here fails again in its recorded timing, which records the error."""
    for impl in impls.values():
        try:
            target.time(lambda: impl(*args))  # noqa: B023 (called before the loop moves on)
        except Exception:  # noqa: S110
            pass


def _cases(target_name, op, shapes, dtypes):
    """The (M, N, dtype) cases: the target's defaults for the op, or shapes x dtypes."""
    defaults = (CUDA_CASES if target_name == "cuda" else CPU_CASES)[op]
    if shapes is None and dtypes is None:
        return tuple(defaults)
    if shapes is None:
        shapes = list(dict.fromkeys((M, N) for M, N, _ in defaults))
    dtypes = [_dtype_name(d) for d in (dtypes or ["bfloat16"])]
    return tuple((M, N, dtype) for M, N in map(_shape, shapes) for dtype in dtypes)


def _shape(shape):
    if isinstance(shape, str):
        parts = shape.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"run: a shape is 'MxN' (as 4096x4096), got {shape!r}")
        shape = tuple(int(p) for p in parts)
    M, N = shape
    if M < 1 or N < 1:
        raise ValueError(f"run: shape dimensions must be positive, got {shape!r}")
    return int(M), int(N)


def _dtype_name(dtype):
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ALIASES:
        raise ValueError(f"run: dtype must be one of {sorted(DTYPE_ALIASES)}, got {dtype!r}")
    return DTYPE_ALIASES[name]


def _implementations(spec, target_name, compare):
    """{name: callable, or the exception its factory raised}: ours first, then the chosen peers."""
    factories = dict(spec.ours.get(target_name, {}))
    chosen = _chosen_peers(spec.peers.get(target_name, {}), compare)
    factories.update(chosen)
    impls = {}
    for name, factory in factories.items():
        try:
            impls[name] = factory()
        except Exception as error:  # a peer that does not import is recorded, not fatal
            if name in chosen and (compare is True or compare == "all") \
                    and _not_installed(name, error):
                continue  # every peer means those installed; one named is recorded unavailable
            impls[name] = error
    return impls


# The library each peer family imports first: a peer whose own library is absent is not part of
# an "every peer" run (a missing dependency of an installed peer still gets its record).
_PEER_LIBRARY = {"torch": "torch", "liger": "liger_kernel", "quack": "quack"}


def _not_installed(peer, error):
    library = _PEER_LIBRARY.get(peer.split("_")[0])
    return (isinstance(error, ModuleNotFoundError) and library is not None
            and (error.name or "").split(".")[0] == library)


def _chosen_peers(available, compare):
    if compare is True or compare == "all":
        return dict(available)
    if compare is False or compare is None or compare == "none":
        return {}
    wanted = compare.split(",") if isinstance(compare, str) else list(compare)
    chosen = set()
    for want in wanted:
        # "torch" selects torch and torch_compile: the API's `--compare torch`.
        matches = {name for name in available if name == want or name.startswith(want + "_")}
        if not matches:
            raise ValueError(f"run: compare: no peer named {want!r}; available: {list(available)}")
        chosen |= matches
    return {name: factory for name, factory in available.items() if name in chosen}


def _check(spec, target, impl, args, reference, dtype):
    """impl's output against the reference: the record's status fields (ok: may be timed)."""
    if isinstance(impl, Exception):
        return _status("unavailable", _describe(impl))
    try:
        rel_err = spec.max_rel_err(target, impl(*args), reference)
    except Exception as error:  # a peer that breaks on one case must not stop the run
        return _status("failed", _describe(error))
    measured = {"rel_err": rel_err if math.isfinite(rel_err) else None}
    if not spec.passes(dtype, rel_err):
        error = f"check failed: rel err {rel_err:.3g}, tolerance {spec.tolerance[dtype]:g}"
        return {**_status("failed", error), **measured}
    return {**_status("ok"), **measured}


def _time(target, impl, args, is_host_case):
    """Times a checked impl: its timings, and the status fields again if timing failed."""
    measured = {}
    try:
        call = lambda: impl(*args)  # noqa: E731
        measured.update(target.host_time(call) if is_host_case else target.time(call))
        if not measured.get("us", 1.0) > 0:  # host records on the CPU have no device time
            return {**_status("failed", "no GPU activity recorded"), **measured}
        return measured
    except Exception as error:  # a peer that breaks on one case must not stop the run
        return {**_status("failed", _describe(error)), **measured}


def _status(status, error=None):
    return {"ok": status == "ok", "status": status, "error": error}


def _describe(error, limit=300):
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _summary(op, case, records, is_host_case):
    M, N, dtype = case
    field, unit = ("host_us", "host us") if is_host_case else ("gbps", "GB/s")
    cells = [f"{r['impl']} {r[field]:.0f}" if r["ok"] else f"{r['impl']} {r['status']}"
             for r in records]
    return f"{op} {M}x{N} {targets.SHORT_DTYPE[dtype]}: {', '.join(cells)} {unit}"


def _write_json(result, path):
    """Atomic rewrite, so a run cut short leaves the last complete case on disk."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(partial, path)


class _Progress:
    """tqdm bar on a terminal; one printed line per case otherwise (logs, the device's output tail),
    since a redrawn bar turns into noise in a file."""

    def __init__(self, total, enabled):
        self._total, self._done, self._enabled, self._bar = total, 0, enabled, None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="case", leave=False)
            except ImportError:
                pass

    def step(self, message):
        self._done += 1
        if self._bar is not None:
            self._bar.write(message)
            self._bar.update()
        elif self._enabled:
            print(f"[{self._done}/{self._total}] {message}", flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()


def main(argv=None):
    """Command line: `rmsnorm-hip bench ...` or `python -m rmsnorm_hip._bench ...`.

    Exit status 1 when our array API ("ours") is missing or fails a check, or when a library the
    options need is not installed (one line naming the extra); 2 on bad arguments (also --decode
    or --device cuda without a CUDA GPU), else 0.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)

    result = run(op=args.ops or args.op, shapes=_split(args.shapes), dtypes=_split(args.dtypes),
                 json_path=args.json_path, plot_path=args.plot_path, compare=args.compare,
                 progress=args.progress, device=args.device, iters=args.iters, flush=args.flush,
                 host_overhead=args.host_overhead, seed=args.seed, decode=args.decode,
                 pdl=args.pdl, graph_calls=args.graph_calls, graph_replays=args.graph_replays,
                 host_calls=args.host_calls, host_repeats=args.host_repeats)
    runs = result["runs"] if result["op"] == "all" else [result]
    ours = [r for run_ in runs for r in run_["records"] + run_.get("host_overhead", [])
            if r["impl"] == "ours"]
    return 0 if ours and all(r["ok"] for r in ours) else 1


def _parser():
    parser = Parser(
        prog="rmsnorm-hip bench",
        description="Device time per call, GB/s and % of the measured copy bandwidth, "
                    "side by side with the peers found installed; --decode: small batches, "
                    "in a CUDA graph, flushed, warm and host time per call.")
    parser.add_argument("--op", default=None, choices=sorted(ops.OPS) + ["all"],
                        help="fwd (default), bwd, bwd_dres (fused-add backward), fused, "
                             "fused_inplace, quant (SmoothQuant int8), quant_fp8, qk (QK-norm "
                             "in place: MxN = tokens x head size), qk_rope (QK-norm + neox "
                             "RoPE), gated (Mamba 2 gated RMSNorm), gated_bwd, quant_group "
                             "(fp8, a float32 scale per 128 columns), quant_group_ue8m0 (power-"
                             "of-two scales, column-major: DeepGEMM), quant_group_int8, "
                             "quant_static (fp8, static scale), mxfp8, mxfp4 (OCP MX), each "
                             "of these six also as NAME_res (with residual=), or all (fwd, "
                             "bwd, bwd_dres, fused, quant, quant_fp8)")
    parser.add_argument("--shapes", nargs="+", metavar="MxN",
                        help="MxN, space or comma separated (default: the target's cases)")
    parser.add_argument("--dtypes", nargs="+", metavar="DTYPE",
                        help="bf16, fp16, fp32 (default: bf16, or the default cases)")
    parser.add_argument("--compare", default="all", metavar="PEERS",
                        help="'all' (default), 'none', or peer names, comma separated "
                             "('torch' selects torch and torch_compile)")
    parser.add_argument("--json", dest="json_path", metavar="FILE", help="write the results here")
    parser.add_argument("--plot", dest="plot_path", metavar="FILE", help="write a GB/s plot (PNG)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--iters", type=int, default=None,
                        help="profiled calls per timing (CUDA; default 20, --decode 10)")
    parser.add_argument("--flush", default="write", choices=("write", "read"),
                        help="L2 flush kernel: 'write' (buf.add_(1), as published peer figures are "
                             "measured) or 'read' (buf.sum(): clean lines)")
    parser.add_argument("--no-host", dest="host_overhead", action="store_false",
                        help="skip the small-M host-overhead cases (--decode: the host figure)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--pdl", action="store_true",
                        help=f"set {PDL_ENV}=1 (programmatic dependent launch, sm_90 and later) "
                             "before our library's first call; recorded in the JSON")
    group = parser.add_argument_group(
        "decode mode", "M in 1..512 x N in 2048..8192 (bf16 unless --shapes / --dtypes), "
                       "needs a CUDA GPU")
    group.add_argument("--decode", action="store_true",
                       help="per call: graph_us (CUDA graph), us (device, L2 flushed), warm_us "
                            "(device, no flush), host_us (eager calls + one sync)")
    group.add_argument("--ops", metavar="OPS",
                       help="comma separated (default: " + ",".join(_decode_ops()) + ")")
    group.add_argument("--graph-calls", type=int, default=50, metavar="N",
                       help="calls captured in one CUDA graph (default 50)")
    group.add_argument("--graph-replays", type=int, default=10, metavar="R",
                       help="timed replays of the graph, median kept (default 10)")
    group.add_argument("--host-calls", type=int, default=300, metavar="N",
                       help="eager calls per host timing (default 300)")
    group.add_argument("--host-repeats", type=int, default=5, metavar="R",
                       help="host timing rounds over the implementations, median kept "
                            "(default 5)")
    return parser


def _decode_ops():
    from . import decode as decode_mode

    return decode_mode.DEFAULT_OPS


def _check_args(parser, args):
    """parser.error (exit 2, one error line) for what argparse cannot check itself, before
    anything is imported or timed; exit 1 with the pip command when an optional library the
    arguments need is missing (_need)."""
    for name in ("iters", "graph_calls", "graph_replays", "host_calls", "host_repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for option, values, check in (("--shapes", args.shapes, _shape),
                                  ("--dtypes", args.dtypes, _dtype_name)):
        for value in _split(values) or ():
            try:
                check(value)
            except ValueError as error:
                parser.error(f"{option}: {str(error).removeprefix('run: ')}")
    if not args.decode:
        if args.ops:
            parser.error("--ops goes with --decode (one op without it: --op)")
        if args.plot_path:
            _need(parser, "matplotlib", "--plot")
        if args.device == "cuda":
            _need(parser, "torch", "--device cuda")
        target = _target_name(args.device)
        if target is None:
            parser.exit(2, f"{parser.prog}: error: --device cuda: torch sees no CUDA GPU\n")
        chosen = set()
        for op in ops.ALL if args.op == "all" else [args.op or "fwd"]:
            try:
                chosen |= set(_chosen_peers(ops.OPS[op].peers.get(target, {}), args.compare))
            except ValueError as error:
                parser.error(f"--compare: {str(error).removeprefix('run: compare: ')} "
                             f"(op {op}, {target})")
        if args.compare not in ("all", "none") and any(p.split("_")[0] == "torch" for p in chosen):
            _need(parser, "torch", f"--compare {args.compare}")
        return
    from . import decode as decode_mode

    if args.plot_path:
        parser.error("--decode draws no plot")
    if args.ops and args.op:
        parser.error("--decode: give --ops or --op, not both")
    try:
        names = decode_mode.op_names(args.ops or args.op)
    except ValueError as error:
        parser.error(str(error))
    if args.device == "cpu":
        _no_gpu(parser, "--device cpu")
    _need(parser, "torch", "--decode")
    if not decode_mode.cuda_available(args.device):
        _no_gpu(parser, "torch sees no CUDA GPU")
    try:
        decode_mode._per_op_compare({name: ops.OPS[name] for name in names}, args.compare)
    except ValueError as error:
        parser.error(str(error))


def _no_gpu(parser, where):
    # The arguments are fine, the machine is not: the error line without the usage.
    parser.exit(2, f"{parser.prog}: error: --decode needs a CUDA GPU (CUDA graphs and device "
                   f"time): {where}\n")


def _split(values):
    """--shapes / --dtypes as given (space or comma separated) -> a flat list, or None."""
    return None if values is None else [v for value in values for v in value.split(",") if v]


def _target_name(device):
    """The target make_target(device) makes: "cuda", "cpu", or None for --device cuda without a
    GPU torch sees."""
    if device == "cpu":
        return "cpu"
    try:
        import torch
    except ImportError:
        return "cpu"  # auto; --device cuda has been refused by _need already
    if torch.cuda.is_available():
        return "cuda"
    return None if device == "cuda" else "cpu"


# The extra of pyproject.toml that installs each optional library the command line may need.
_EXTRAS = {"torch": "torch", "matplotlib": "bench"}


def _need(parser, module, what):
    """Exit 1 with one line naming the extra to install when ``module`` does not import."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as error:
        parser.exit(1, f"{parser.prog}: {what} needs {module} ({error}): "
                       f"pip install \"rmsnorm-hip[{_EXTRAS[module]}]\"\n")
