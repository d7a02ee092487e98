"""Why the fused add at 4096x4096 timed slower right after a 32768x4096 case (benchmarks/NOTES.md,
sessions 7-8): times fused_add_rms_norm at 4096x4096 (CUPTI, write flush, as the benchmark) six
times in a row on the same inputs right after a 32768x4096 case, then again after a 32768x4096
case and a 3 s pause, with the SM / memory clocks, power and temperature nvidia-smi reports
after each timing (the session-8 run, order2.json, read them before each: ``smi``).  One JSON line per timing, all of them in OUT.json.

    PYTHONPATH=src python3 benchmarks/order_probe.py OUT.json
"""
import json
import subprocess
import sys
import time


def _smi():
    query = "clocks.sm,clocks.mem,power.draw,temperature.gpu"
    try:
        text = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        text = repr(error)
    return text


def main():
    import torch

    import rmsnorm_hip
    from rmsnorm_hip._bench import timing

    flush = timing.L2Flush("write")
    out = []
    start = time.perf_counter()

    def inputs(m, n):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
        r = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        return x, r, w

    def timed(label, m, n, args, times=1):
        call = lambda: rmsnorm_hip.fused_add_rms_norm(*args, 1e-6)  # noqa: E731
        call()
        for i in range(times):
            t_s = round(time.perf_counter() - start, 3)
            us = timing.cuda_device_time(call, flush)["us"]
            # nvidia-smi after the timing: before it, its ~0.1 s would sit in the very window
            # after the large case that this probe looks at
            row = dict(label=label, m=m, n=n, i=i, t_s=t_s, us=us, smi_after=_smi())
            out.append(row)
            print(json.dumps(row), flush=True)

    small = inputs(4096, 4096)
    timed("fresh", 4096, 4096, small, 2)
    big = inputs(32768, 4096)
    timed("big", 32768, 4096, big)
    timed("after_big", 4096, 4096, small, 6)
    timed("big", 32768, 4096, big)
    time.sleep(3)
    timed("after_big_and_3s", 4096, 4096, small, 3)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
