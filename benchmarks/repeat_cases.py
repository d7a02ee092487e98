"""The benchmark's cases timed several times over, to see how far one `rmsnorm-hip bench` sample
moves: for each case, every implementation the benchmark compares (ours and the installed peers,
the same factories, inputs and float64 check) is timed once per round, in an order that rotates
from round to round, each timing as the benchmark takes it (CUPTI device time, 256 MB write
flush before each call, median of 20 calls, after one discarded timing of every implementation).
The copy bandwidth is measured before and after.  One JSON line per (case, round, impl) and a
summary per (case, impl): median, min and max of the rounds, in us and % of the first copy.

    PYTHONPATH=src python3 benchmarks/repeat_cases.py [--rounds 7]
        [--cases fused:4096x4096,bwd:8192x8192,...] [--chunks 3,4] [--same-bytes-copy]
        [--no-work] [--tag _x] [--out DIR]

``--chunks 3,4`` times ours once per 16-bit chunk count a thread (kernels/_config.
CHUNKS_PER_THREAD, patched and the kernels re-planned when it changes: ``ours_c3``,
``ours_c4``) instead of beside the peers.  ``--same-bytes-copy`` times, in the same rounds, a
torch device-to-device copy moving the case's bytes (half read, half written: copy_ceiling.py's
ceiling), so each round shows ours against a plain copy under the same flush.  ``--no-work``
times, for the quantising ops (and their _res forms), no_work.py's kernels with the op's own
access pattern and no row work (``no_work_flat``, ``no_work_stride``) in the same rounds.
Writes DIR (default $OUT or .)/repeat_cases{tag}.json.
"""
import argparse
import json
import os
import statistics


CASES = "fused:4096x4096,quant:4096x4096,bwd:8192x8192,bwd:4096x4096,bwd:1024x8192"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cases", default=CASES, help="op:MxN,... (bfloat16)")
    ap.add_argument("--chunks", default="", help="16-bit chunk counts to time ours at")
    ap.add_argument("--same-bytes-copy", action="store_true",
                    help="time a torch copy of each case's bytes in the same rounds")
    ap.add_argument("--no-work", action="store_true",
                    help="time kernels with a quantising op's access pattern and no row work")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    args = ap.parse_args()

    import no_work      # benchmarks/, beside this script
    from rmsnorm_hip import functional
    from rmsnorm_hip._bench import ops, runner, targets, timing
    from rmsnorm_hip.kernels import _config

    shipped = dict(_config.CHUNKS_PER_THREAD)

    def use_chunks(count):
        """Set 16-bit rows to ``count`` chunks a thread and re-plan, unless already set."""
        if _config.CHUNKS_PER_THREAD[2] != count:
            _config.CHUNKS_PER_THREAD = {**shipped, 2: count}
            functional.forget_plans()

    def with_chunks(impl, count):
        """impl run with ``count`` chunks a thread in 16-bit rows."""
        def call(*inputs):
            use_chunks(count)
            return impl(*inputs)
        return call

    target = targets.make_target("cuda")
    copy_before = target.copy_bandwidth()["gbps"]
    lines, summary = [], []
    for index, case in enumerate(args.cases.split(",")):
        op, shape = case.split(":")
        m, n = runner._shape(shape)
        spec = ops.OPS[op]
        impls = runner._implementations(spec, "cuda", not args.chunks)
        if args.chunks:
            ours = impls.pop(next(iter(impls)))
            impls = {f"ours_c{c}": with_chunks(ours, int(c)) for c in args.chunks.split(",")}
        inputs = spec.make_inputs(target, m, n, "bfloat16", 1000 + index)
        reference = spec.reference(target, *inputs)
        nbytes = spec.bytes_moved(m, n, target.itemsize("bfloat16"))
        checked = {}
        for name, impl in impls.items():
            status = runner._check(spec, target, impl, inputs, reference, "bfloat16")
            print(json.dumps(dict(op=op, m=m, n=n, impl=name, check=status)), flush=True)
            if status["ok"]:
                checked[name] = impl
        if args.same_bytes_copy:
            checked["copy_same_bytes"] = timing.same_bytes_copy(nbytes)
        if args.no_work and op.removesuffix("_res") in no_work.PATTERNS:
            residual = inputs[1] if op.endswith("_res") else None
            for grid in ("flat", "stride"):
                checked[f"no_work_{grid}"] = no_work.no_work_kernel(op, inputs[0], grid,
                                                                    residual)
        runner._warm_up(target, checked, inputs)
        names = list(checked)
        times = {name: [] for name in names}
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                impl = checked[name]
                us = target.time(lambda: impl(*inputs))["us"]  # noqa: B023
                times[name].append(us)
                line = dict(op=op, m=m, n=n, impl=name, round=round_, us=us,
                            pct_copy=100 * nbytes / us / 1e3 / copy_before)
                lines.append(line)
                print(json.dumps(line), flush=True)
        for name in names:
            us = times[name]
            pct = [100 * nbytes / u / 1e3 / copy_before for u in us]
            summary.append(dict(op=op, m=m, n=n, impl=name, rounds=len(us),
                                us_median=statistics.median(us), us_min=min(us), us_max=max(us),
                                pct_median=statistics.median(pct), pct_min=min(pct),
                                pct_max=max(pct)))
        inputs = reference = None       # free the case before the next one
        checked.clear()     # the same-bytes copy's buffers go with it
        target.free_memory()
    use_chunks(shipped[2])
    copy_after = target.copy_bandwidth()["gbps"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"repeat_cases{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps_before=copy_before, copy_gbps_after=copy_after,
                       rounds=args.rounds, environment=target.environment(), summary=summary,
                       timings=lines), f, indent=1)
    print(f"copy {copy_before:.0f} GB/s before, {copy_after:.0f} after; "
          f"% of the first, median [min, max] of {args.rounds} rounds")
    for row in summary:
        print(f"{row['op']:6s} {row['m']}x{row['n']:<6d} {row['impl']:14s} "
              f"{row['us_median']:8.2f} us  {row['pct_median']:5.1f} "
              f"[{row['pct_min']:5.1f}, {row['pct_max']:5.1f}]")


if __name__ == "__main__":
    main()
