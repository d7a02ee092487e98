"""Rows that are not 16-byte aligned (the scalar kernels) against aligned ones, every op, on a GPU:
device time per call as the benchmark takes it (CUPTI, 256 MB write flush, a discarded warm-up
timing first).  Each case runs under every --settings entry (kernels/_config attributes patched,
plans dropped) and checks its outputs bitwise against the aligned call's.

    PYTHONPATH=src python3 benchmarks/unaligned.py [--ops fwd,fused,quant,bwd]
        [--shapes 4096x4096,...] [--settings shipped,scalar_packed] [--out DIR] [--tag _x]

Layouts: ``aligned`` (contiguous rows of N, N % 8 == 0), ``offset`` (rows of N starting one
element past 16 bytes: a view ``buf[:, 1:]`` of an (M, N + 1) buffer, so every row has its own
misalignment) and, with ``--odd``, ``odd`` (contiguous rows of N - 1 elements).
"""
import argparse
import json
import os

SHAPES = ["4096x4096", "32768x4096", "1024x8192"]
# name -> {_config attribute: value}
SETTINGS = {
    "shipped": {},
    # 16-bit scalar backward rows of one chunk a thread kept as words with the next row's words
    # loaded ahead (one 512-thread block per SM, 128 registers), or as floats without
    "scalar_packed": {"BWD_PACK_SCALAR_MIN_CHUNKS": {"cuda": 1, "hip": 2}},
    "scalar_floats": {"BWD_PACK_SCALAR_MIN_CHUNKS": {"cuda": 2, "hip": 2}},
}


def _inputs(torch, op, m, n, dtype, layout):
    """Contiguous inputs of the ``aligned`` or ``odd`` layout (``offset`` rows are copies of the
    aligned call's, made in main)."""
    def rows(cols):
        return torch.randn(m, cols, device="cuda", dtype=dtype)

    cols = n - 1 if layout == "odd" else n
    x = rows(cols)
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(dtype)
    if op == "fwd":
        return (x, w), cols
    if op == "fused":
        return (x, rows(cols), w), cols
    if op == "quant":
        return (x, w, (0.5 + torch.rand(cols, device="cuda"))), cols
    dy = rows(cols)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    return (dy, x, w, rstd), cols


def _call(rmsnorm_hip, op, args):
    if op == "fwd":
        return lambda: rmsnorm_hip.rms_norm(args[0], args[1], 1e-6)
    if op == "fused":
        return lambda: rmsnorm_hip.fused_add_rms_norm(args[0], args[1], args[2], 1e-6)
    if op == "quant":
        return lambda: rmsnorm_hip.rms_norm_quant(args[0], args[1], 1e-6, xscale=args[2])
    return lambda: rmsnorm_hip.rms_norm_backward(*args)


def _bytes(op, m, n, size):
    return {"fwd": 2 * m * n * size, "fused": 4 * m * n * size,
            "quant": m * n * (size + 1) + n * (size + 4), "bwd": 3 * m * n * size}[op] + n * size


def _flat(out):
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ops", default="fwd,fused,quant,bwd")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--settings", default="shipped")
    ap.add_argument("--odd", action="store_true", help="also rows of N - 1 (contiguous)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import torch

    import rmsnorm_hip
    from rmsnorm_hip import _cache
    from rmsnorm_hip._bench import timing
    from rmsnorm_hip._bench.runner import _shape
    from rmsnorm_hip.kernels import _config

    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    copy = timing.cuda_copy_bandwidth()["gbps"]
    flush = timing.L2Flush("write")
    layouts = ["aligned", "offset"] + (["odd"] if args.odd else [])
    labels = args.settings.split(",")
    names = {label: label.rstrip("0123456789") for label in labels}     # shifted2: a repeat
    shipped = {attr: getattr(_config, attr) for label in labels for attr in SETTINGS[names[label]]}
    kernel_sets = {}
    records = []
    for op in args.ops.split(","):
        for shape in args.shapes.split(","):
            m, n = _shape(shape)
            torch.manual_seed(0)
            base, _ = _inputs(torch, op, m, n, dtype, "aligned")
            reference = None
            for layout in layouts:
                if layout == "offset":      # the aligned call's values in offset rows
                    data = tuple(a if a.dim() < 2 else
                                 torch.empty(m, n + 1, device="cuda", dtype=a.dtype)[:, 1:]
                                 .copy_(a) for a in base)
                    cols = n
                elif layout == "aligned":
                    data, cols = base, n
                else:
                    data, cols = _inputs(torch, op, m, n, dtype, layout)
                for label in labels:
                    for attr, value in shipped.items():
                        setattr(_config, attr, value)
                    for attr, value in SETTINGS[names[label]].items():
                        setattr(_config, attr, value)
                    # kernels are built under the knobs as they are: one compiled set per setting
                    _cache._kernels = kernel_sets.setdefault(names[label], {})
                    rmsnorm_hip.functional.forget_plans()
                    call = _call(rmsnorm_hip, op, data)
                    out = _flat(call())
                    same = None
                    if layout != "odd":
                        if reference is None:
                            reference = [o.clone() for o in out]
                        same = all(torch.equal(a.contiguous().view(torch.uint8),
                                               b.contiguous().view(torch.uint8))
                                   for a, b in zip(out, reference))
                    timing.cuda_device_time(call, flush)      # discarded warm-up
                    t = timing.cuda_device_time(call, flush)
                    gbps = _bytes(op, m, cols, size) / t["us"] / 1e3
                    row = dict(op=op, m=m, n=cols, layout=layout, setting=label, us=t["us"],
                               gbps=gbps, pct_copy=100 * gbps / copy, same_bits_as_aligned=same)
                    records.append(row)
                    print(json.dumps(row), flush=True)
            del base, data
            torch.cuda.empty_cache()
    for attr, value in shipped.items():
        setattr(_config, attr, value)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"unaligned{args.tag}.json"), "w") as f:
        json.dump(dict(copy_gbps=copy, dtype=args.dtype, records=records), f, indent=1)
    print(f"{'op':6} {'shape':>11} {'layout':8} {'setting':12} {'us':>8} {'%copy':>6} same")
    for r in records:
        print(f"{r['op']:6} {r['m']:>5}x{r['n']:<5} {r['layout']:8} {r['setting']:12} "
              f"{r['us']:8.1f} {r['pct_copy']:6.1f} {r['same_bits_as_aligned']}")


if __name__ == "__main__":
    main()
