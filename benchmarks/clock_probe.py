"""Does what ran just before decide a call's time?  repeat_cases (session 24) timed SmoothQuant
int8 at 4096x4096 at 14.6-14.8 us right after torch.compile's composite was timed and at
16.1-16.4 us after anything else.  This times ours after each of several preceding workloads
(the same-bytes copy's timing, torch.compile's, an idle second, a matmul burn), with the SM and
memory clocks and power nvidia-smi reports just before and after our timing.  One JSON line per
(trial, preceding workload); then 60 calls' device times in order after some of them and with a
gap between the flush and our call.  All in DIR/clock_probe{tag}.json.  (In the session-24 file
clock_probe_seq.json the ``gpu_sleep_gap`` sequence still counts the ~10 us sleep kernel in each
call; the sequences now leave it out, _probe.per_call_us.)

    PYTHONPATH=src python3 benchmarks/clock_probe.py [--case quant:4096x4096] [--trials 3]
"""
import json
import subprocess
import time

import _probe


def smi():
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,"
                          "temperature.gpu,clocks_event_reasons.active", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return out


def main():
    ap = _probe.parser()
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()

    import torch

    from rmsnorm_hip._bench import targets

    target = targets.make_target("cuda")
    case = _probe.load_case(target, args.case, peers=True)
    copy = _probe.same_bytes_copy(case.nbytes)
    copy_gbps = target.copy_bandwidth()["gbps"]
    before = {
        "copy_timed": lambda: target.time(copy),
        "compile_timed": lambda: target.time(lambda: case.run("torch_compile")),
        "idle_1s": lambda: (torch.cuda.synchronize(), time.sleep(1.0)),
        "matmul_burn": _probe.matmul_burn(100),
        "ours_timed": lambda: target.time(case.run),
    }
    for fn in before.values():     # compiles, warms
        fn()
    rows = []
    for trial in range(args.trials):
        for name, fn in before.items():
            fn()
            s0 = smi()
            t = target.time(case.run)
            s1 = smi()
            row = dict(case=args.case, trial=trial, before=name, us=t["us"], us_min=t["us_min"],
                       kernels=t["kernels"], kernels_per_call=t["kernels_per_call"],
                       us_max=t["us_max"], pct_copy=case.pct_of(t["us"], copy_gbps),
                       smi_before=s0, smi_after=s1)
            rows.append(row)
            print(json.dumps(row), flush=True)

    # the per-call sequence after an idle second and after torch.compile's timing (where a fast
    # start turns slow, if it does); and with a gap between the flush and our call, host-side
    # (synchronize after the flush) or GPU-side (a ~10 us sleep kernel, not counted)
    def synced():
        torch.cuda.synchronize()
        return case.run()

    def slept():
        torch.cuda._sleep(20000)
        return case.run()

    for label, prep, fn in (("after_idle", before["idle_1s"], case.run),
                            ("after_compile", before["compile_timed"], case.run),
                            ("sync_gap", None, synced), ("gpu_sleep_gap", None, slept),
                            ("after_ours", before["ours_timed"], case.run)):
        if prep:
            prep()
        seq = [round(us, 2) for us in _probe.per_call_us(fn, target.flush, 60)]
        rows.append(dict(case=args.case, sequence=label, us_per_call=seq))
        print(json.dumps(rows[-1]), flush=True)
    _probe.write(args.out, "clock_probe", args.tag, copy_gbps=copy_gbps, rows=rows)


if __name__ == "__main__":
    main()
