"""Streamed forward sweep on a GPU: one-block-per-row launches against the persistent streamed
grid (kernels/_config.FWD_STREAM_ROWS_PER_SM).  Ops: ``fwd`` (rms_norm, bf16 and one float32
shape), ``fused`` (the residual add), ``quant`` (SmoothQuant int8), ``quant_res`` (SmoothQuant
fp8 with a residual, float32 weight), ``quant_f32`` (SmoothQuant int8 of float32 x),
``static_res`` and ``group_res`` (fp8 with a residual: a static scale, or one scale per 128
columns); bf16 unless said.  Each row of the output names the launch: streamed or not, threads
a block, the kernel's registers and blocks an SM.  Device time as the benchmark measures it
(CUPTI kernel time, 256 MB L2 flush before each call: --flush write or read).  Every
variant's outputs are compared bit for bit with the first variant's (same per-row layout, so
they must be equal; a "!" in the table marks a difference).  One JSON line per (op, shape,
variant); all of them in --out (default $OUT or .)/tune_stream.json.

    PYTHONPATH=src python3 benchmarks/tune_stream.py [--ops fwd,fused,quant] [--variants ...]
        [--shapes MxN,...] [--tag _suffix]

Variants (``name``: what _config is patched to):
  oneshot         FWD_STREAM_ROWS_PER_SM all 0 (one block per row block)
  oneshot_off1    the same with weight_offset = 1 (weight - 1: the same effective weight), i.e.
                  the kernel with the per-element offset add where there is one without
  stream          FWD_STREAM_ROWS_PER_SM all None and no one-shot wave (streamed at every M;
                  quantised rows hold their gains)
  shipped         the shipped grids and settings
  loaded          the shipped grids, streamed rows without a quantiser loading their weight with
                  each row (after its reduction) instead of holding it for the program
  chunksK         the shipped grids (one-shot or streamed by M) with K chunks a thread in 16-bit
                  rows (CHUNKS_PER_THREAD; another per-row layout, so other bits)
A trailing digit repeats a variant (``stream2``).  Earlier runs also measured, with knobs since
removed (docs/performance.md): programs capped at 2 and 4 per SM and __launch_bounds__ minimums
of 4 and 5 blocks per SM (f07515d); a 5-block minimum for streamed quantised rows and the weight
loads of a small batch's rows issued unbranched (``stream_early``; in the run of
results/tune_h200_20261130c/, before that knob was removed, ``stream_loaded`` had them up to 64
rows per SM and ``stream_loaded_late`` never); streamed quantised rows capped at 2 and 3 programs
per SM (``stream_cap2``, ``stream_cap3``); and ``scalar_red`` against ``shipped`` (a row's warp
partials read one float at a time from shared memory, against 4 at a time).
"""
import argparse
import json
import os

SHAPES = {
    "fwd": [(32768, 4096), (16384, 8192), (8192, 8192), (4096, 4096), (1024, 8192),
            (4096, 5000)],
    "fused": [(32768, 4096), (16384, 8192), (4096, 4096), (1024, 8192)],
    "quant": [(32768, 4096), (16384, 8192), (4096, 4096), (1024, 8192)],
    # SmoothQuant with a residual (fp8, float32 weight: the heaviest streamed kind) and float32 x
    "quant_res": [(32768, 4096), (4096, 4096)],
    "quant_f32": [(16384, 4096), (4096, 4096)],
    # fp8 with a residual and a bf16 weight: a static scale, and float32 scales per 128 columns
    "static_res": [(512, 4096), (512, 8192)],
    "group_res": [(512, 4096), (512, 8192)],
}
VARIANTS = "oneshot,oneshot_off1,stream"


_SHIPPED = {}


def _patch(config, variant):
    """Patches _config for ``variant`` (a trailing digit repeats a variant: ``stream2``)."""
    for name in ("FWD_STREAM_ROWS_PER_SM", "FWD_ONE_SHOT_WAVE", "CHUNKS_PER_THREAD", "fwd_spec"):
        _SHIPPED.setdefault(name, getattr(config, name))
        setattr(config, name, _SHIPPED[name])
    if variant.startswith("shipped"):
        return
    if variant.startswith("loaded"):
        from dataclasses import replace

        def loaded(*args, **kwargs):
            spec = _SHIPPED["fwd_spec"](*args, **kwargs)
            return (replace(spec, held_weights=False) if spec.held_weights and not spec.quant
                    else spec)
        config.fwd_spec = loaded
        return
    if variant.startswith("chunks"):        # chunksK: K chunks a thread for 16-bit rows
        config.CHUNKS_PER_THREAD = {**_SHIPPED["CHUNKS_PER_THREAD"], 2: int(variant[6])}
        return
    limit = None if variant.startswith("stream") else 0
    kinds = dict.fromkeys(config.FWD_STREAM_ROWS_PER_SM["cuda"], limit)
    config.FWD_STREAM_ROWS_PER_SM = {"cuda": kinds, "hip": kinds}
    config.FWD_ONE_SHOT_WAVE = {"cuda": (), "hip": ()}


def _recording(backend):
    """``backend`` with its launches recorded: the set of the ids of the kernels it launched."""
    launched, launch = set(), backend.launch

    def recorded(kernel, grid, block, args, stream):
        launched.add(id(kernel))
        return launch(kernel, grid, block, args, stream)
    backend.launch = recorded
    return launched


def _launches(backend, launched):
    """The forward kernels launched since ``launched`` was cleared: streamed or not, block
    threads, registers and blocks an SM of each."""
    found = []
    for spec, kernel, block, _ in backend._plans.values():
        if id(kernel) in launched:
            threads = block[0] * block[1]
            found.append(dict(stream=spec.stream, threads=threads,
                              registers=kernel.attributes()["registers"],
                              per_sm=backend.resident_per_sm(kernel, threads)))
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ops", default="fwd,fused,quant")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--shapes", default="", help="MxN,... for every op (default: SHAPES)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--graph", action="store_true",
                    help="also us per call of 50 calls replayed in one CUDA graph")
    ap.add_argument("--flush", default="write", choices=("write", "read"),
                    help="the L2 flush before each timed call (docs/performance.md, Method)")
    args = ap.parse_args()

    import torch

    import rmsnorm_hip
    from rmsnorm_hip import backends, functional
    from rmsnorm_hip._bench import timing
    from rmsnorm_hip._bench.runner import _shape   # 'MxN' -> (M, N), checked
    from rmsnorm_hip.kernels import _config

    backend = backends.get("cuda")
    launched = _recording(backend)
    copy = timing.cuda_copy_bandwidth()["gbps"]
    flush = timing.L2Flush(args.flush)
    rows = []
    shapes = {op: SHAPES[op] for op in args.ops.split(",")}
    if args.shapes:
        sweep = [_shape(s) for s in args.shapes.split(",")]
        shapes = dict.fromkeys(shapes, sweep)
    cases = [(op, m, n, torch.bfloat16) for op in shapes for m, n in shapes[op]]
    if "fwd" in shapes and not args.shapes:
        cases.append(("fwd", 4096, 4096, torch.float32))
    cases = [(op, m, n, torch.float32 if op == "quant_f32" else dtype)
             for op, m, n, dtype in cases]
    for op, m, n, dtype in cases:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
        w1 = (w.float() - 1).to(dtype)
        e = x.element_size()
        if op == "fwd":
            nbytes = 2 * m * n * e + n * e
            extra = ()
        elif op == "fused":
            nbytes = 4 * m * n * e + n * e
            extra = (torch.randn(m, n, device="cuda", dtype=dtype),)
        elif op == "quant_res":     # x, residual read; q, residual_out written
            nbytes = 3 * m * n * e + m * n + m * 4 + n * 4 + n * e
            w = (1 + 0.1 * torch.randn(n, device="cuda")).float()
            w1 = w - 1
            extra = ((1 + 0.2 * torch.rand(n, device="cuda")).to(dtype),
                     torch.randn(m, n, device="cuda", dtype=dtype))
        elif op in ("static_res", "group_res"):     # x, residual read; q, residual_out written
            scales = 4 * m * (n // 128) if op == "group_res" else 0
            nbytes = 3 * m * n * e + m * n + scales + n * e
            extra = (torch.randn(m, n, device="cuda", dtype=dtype),)
        else:
            nbytes = m * n * e + m * n + m * 4 + n * e + n * 4
            extra = ((1 + 0.2 * torch.rand(n, device="cuda")).float(),)

        def call(weight, offset):
            if op == "fwd":
                return (rmsnorm_hip.rms_norm(x, weight, 1e-6, weight_offset=offset),)
            if op == "fused":
                return rmsnorm_hip.fused_add_rms_norm(x, extra[0], weight, 1e-6,
                                                      weight_offset=offset)
            if op == "quant_res":
                return rmsnorm_hip.rms_norm_quant(x, weight, 1e-6, xscale=extra[0],
                                                  residual=extra[1], weight_offset=offset,
                                                  quant_dtype="float8_e4m3fn")
            if op == "static_res":
                return rmsnorm_hip.rms_norm_quant(x, weight, 1e-6, residual=extra[0],
                                                  weight_offset=offset, scale=0.05,
                                                  quant_dtype="float8_e4m3fn")
            if op == "group_res":
                return rmsnorm_hip.rms_norm_quant(x, weight, 1e-6, residual=extra[0],
                                                  weight_offset=offset, group_size=128,
                                                  quant_dtype="float8_e4m3fn")
            return rmsnorm_hip.rms_norm_quant(x, weight, 1e-6, xscale=extra[0],
                                              weight_offset=offset)

        reference = None
        for variant in args.variants.split(","):
            _patch(_config, variant)
            functional.forget_plans()
            launched.clear()
            weight, offset = (w1, 1.0) if variant.endswith("_off1") else (w, 0.0)
            fn = lambda: call(weight, offset)  # noqa: E731
            outs = [o.view(torch.uint8) if o.dtype.itemsize == 1 else o for o in fn()]
            same = None
            if reference is None and not variant.endswith("_off1"):
                reference = outs
            elif not variant.endswith("_off1"):
                same = all(torch.equal(a, b) for a, b in zip(outs, reference))
            timing.cuda_device_time(fn, flush)     # discarded, as the benchmark's warm-up
            t = timing.cuda_device_time(fn, flush)
            row = dict(op=op, m=m, n=n, dtype=str(dtype)[6:], variant=variant, us=t["us"],
                       GBps=nbytes / t["us"] / 1e3, bitwise_equal_to_first=same,
                       launches=_launches(backend, launched))
            if args.graph:
                row["graph_us"] = timing.cuda_graph_time(fn, replays=20)["graph_us"]
            row["pct_copy"] = 100 * row["GBps"] / copy
            rows.append(row)
            print(json.dumps(row), flush=True)
        x = extra = None        # free the case before the next one
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"tune_stream{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps=copy, rows=rows), f, indent=1)
    names = args.variants.split(",")
    print(f"copy {copy:.0f} GB/s; device us (flushed) / graph us per call")
    print(f"{'op':6s} {'shape':16s} " + " ".join(f"{v:>13s}" for v in names))
    for op, m, n, dtype in cases:
        cells = []
        for v in names:
            r = [r for r in rows if (r["op"], r["m"], r["n"], r["dtype"], r["variant"])
                 == (op, m, n, str(dtype)[6:], v)]
            flag = "" if not r or r[0]["bitwise_equal_to_first"] in (None, True) else "!"
            graph = f"/{r[0]['graph_us']:.2f}" if r and "graph_us" in r[0] else ""
            cells.append(f"{r[0]['us']:.2f}{graph}{flag}" if r else "-")
        print(f"{op:6s} {f'{m}x{n} {str(dtype)[6:]}':16s} " + " ".join(f"{c:>13s}" for c in cells))


if __name__ == "__main__":
    main()
