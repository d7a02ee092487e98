"""Does where the arrays lie decide a call's time?  One benchmark case (bf16, the benchmark's
inputs: SmoothQuant int8 with a float32 xscale by default), timed as the benchmark times it (CUPTI
device time, 256 MB write flush before each call, median of 20), after the allocator's cache is
emptied and a pad of P MiB is allocated first, so that the inputs and the outputs land at other
addresses for each P.  A same-bytes torch copy is timed after each for reference.  One JSON line
per P; all of them in DIR/placement_probe{tag}.json.

    PYTHONPATH=src python3 benchmarks/placement_probe.py [--case quant:4096x4096]
        [--pads 0,2,4,...] [--tag _x] [--out DIR]
"""
import json

import _probe


def main():
    ap = _probe.parser()
    ap.add_argument("--pads", default=",".join(str(p) for p in range(0, 34, 2)))
    args = ap.parse_args()

    import torch

    from rmsnorm_hip._bench import targets, timing

    target = targets.make_target("cuda")
    copy_gbps = target.copy_bandwidth()["gbps"]
    rows = []
    for pad_mib in (int(p) for p in args.pads.split(",")):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        pad = torch.empty(pad_mib << 20, dtype=torch.uint8, device="cuda") if pad_mib else None
        case = _probe.load_case(target, args.case)
        out = case.run()
        timing.cuda_device_time(case.run, target.flush)
        t = timing.cuda_device_time(case.run, target.flush)
        copy = _probe.same_bytes_copy(case.nbytes)
        timing.cuda_device_time(copy, target.flush)
        c = timing.cuda_device_time(copy, target.flush)
        first = out[0] if isinstance(out, tuple) else out
        row = dict(case=args.case, pad_mib=pad_mib, x_ptr=hex(case.inputs[0].data_ptr()),
                   out_ptr=hex(first.data_ptr()), us=t["us"], us_min=t["us_min"],
                   us_max=t["us_max"], pct_copy=case.pct_of(t["us"], copy_gbps),
                   copy_us=c["us"], copy_pct=case.pct_of(c["us"], copy_gbps))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del pad, case, out, first, copy
    _probe.write(args.out, "placement_probe", args.tag, copy_gbps=copy_gbps, rows=rows)


if __name__ == "__main__":
    main()
