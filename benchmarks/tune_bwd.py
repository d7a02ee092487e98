"""Backward tuning sweep on a GPU: device time per call of rms_norm_backward (CUPTI, 256 MB write
flush before each call, a discarded warm-up timing first, as the benchmark measures it) under
candidate settings of kernels/_config.py, patched here; a setting may be repeated with a digit
suffix (``hold_w,load_w,hold_w2``; ``_r2`` after a name ending in a digit) to see the run-to-run
spread.  Prints one JSON line per (shape, setting) and writes them to --out (default $OUT or
.)/tune_bwd.json.

    PYTHONPATH=src python3 benchmarks/tune_bwd.py [--settings hold_w,load_w] [--dres]
        [--shapes 4096x4096,...] [--flush write|read] [--no-weight] [--tag _suffix]

Earlier runs also took settings whose knobs have since been removed or stayed on their branch
(docs/performance.md has what they measured).  In results/tune_h200_20261130d/: ``tail`` /
``two_kernel`` (branch exp/tail-reduce) and ``p_fit`` / ``p_balanced`` / ``p_128max`` (the
grid's programs: as many as fit, the fewest that keep the most row blocks a program takes, at
most 128).  In tune_h200_20261130e/: ``paired`` / ``unpaired`` and the timing-only ablations
``full`` / ``no_ws_store`` / ``no_weight_load`` / ``rows_first`` (branch exp/paired-rows);
``--no-weight`` times dx alone (what the dweight costs a call).  In tune_h200_20261130f/:
``shallow`` / ``deep`` (one or two rows of words ahead, branch exp/deep-prefetch), ``vector_red``
/ ``scalar_red`` (a row's warp partials read 4 at a time or one at a time, with the kernel cache
cleared per setting), and ``before_fix`` / ``cache_wide`` / ``cache_narrow`` on 1024-thread rows
of 2 chunks (float32 N = 8192, 16-bit N = 16384: loads ahead of the reduction or not, cached or
looped).  In tune_h200_20261130g/: ``narrow`` / ``wide`` (branch exp/wide2), ``hold_w`` /
``load_w`` and ``fp32_cached`` / ``fp32_looped``.  In tune_h200_20261130h/: ``narrow`` /
``one_block`` (1024-thread rows as 512 x 2 in one block per SM; the first run with an earlier
form of the knob), ``two_chunk`` and ``mid``.  In tune_h200_20261201b/: ``cluster_eight`` /
``_four`` / ``_two`` / ``_one`` / ``no_cluster`` (the partial rows summed across a thread-block
cluster first: the knobs, and benchmarks/check_cluster.py, are on branch exp/cluster-combine)
and ``p_fit`` / ``p_balanced`` / ``p_round``.  In tune_h200_20261201c/: ``reduce_g*_b*`` (the
reduction's loads in one round or not) and ``paired`` / ``unpaired`` (BWD_PAIRED_ROWS; checked
on the GPU by a script since removed).  In tune_h200_20261202a/: ``stream_off`` /
``stream_cs`` and ``stream_ef`` / ``stream_cs_st`` / ``stream_ef_st`` / ``stream_st_only`` (an
L2 evict-first policy instead of ld.global.cs, and the dx stores hinted).  In
tune_h200_20261202c/: ``det`` / ``atomic`` (dweight by float32 atomics at every M, called
with deterministic=False; the first runs before the thresholds existed) and ``nondet``
(deterministic=False as shipped); ``--wdtype float32`` gives 16-bit rows a float32 weight.  In
tune_h200_20261203a/: ``early_dw`` / ``late_dw`` / ``early_fit`` (BWD_EARLY_DWEIGHT).
"""
import argparse
import json
import os
import re

SHAPES = [(32768, 4096), (16384, 8192), (8192, 8192), (4096, 4096), (1024, 8192)]
# name -> {_config attribute: value}
SETTINGS = {
    # packed 16-bit rows of 2 chunks a thread (N = 16384): the weight held for the program
    # (spills 36-56 B) or loaded with each chunk; branch exp/wide2 also ran ``narrow`` /
    # ``wide`` (N = 8192 as 1024 x 1 or 512 x 2 chunks, knob not merged)
    "hold_w": {"BWD_HOLD_WEIGHT_MAX_CHUNKS": 2},
    "load_w": {"BWD_HOLD_WEIGHT_MAX_CHUNKS": 1},
    # float32 N = 16384 (--dtype float32): 1024 threads x 4 chunks cached (spilling 76-240 B) or
    # looped at 512 threads (x and dy re-read in pass 2)
    "fp32_cached": {"BWD_MAX_CACHED_FLOATS": 16},
    "fp32_looped": {"BWD_MAX_CACHED_FLOATS": 8},
    # rows cached in registers up to 16 / 8 floats per array and thread (16-bit N = 16384: 2
    # chunks of 8 a thread at 16, looped at 8), the prefetch by threads of 1 chunk only; and the
    # form before 5cc526d (cached at 16, the prefetch by threads of 2 chunks as well)
    "cache_wide": {"BWD_MAX_CACHED_FLOATS": 16, "BWD_PREFETCH_MAX_CHUNKS": 1},
    "cache_narrow": {"BWD_MAX_CACHED_FLOATS": 8, "BWD_PREFETCH_MAX_CHUNKS": 1},
    "before_fix": {"BWD_MAX_CACHED_FLOATS": 16, "BWD_PREFETCH_MAX_CHUNKS": 2},
    # 16-bit N = 8192 (and float32 N = 4096) rows: 1024 threads x 1 chunk, one block per SM
    # (64 registers), or 512 threads x 2 chunks, one block per SM (128 registers: the weight
    # held and the next row ahead, as the 1-chunk rows)
    "narrow": {"BWD_TWO_CHUNK_MIN_THREADS": {"cuda": None, "hip": None}},
    "one_block": {"BWD_TWO_CHUNK_MIN_THREADS": {"cuda": 1024, "hip": None}},
    # and 16-bit N = 4096 rows as 256 threads x 2 chunks, two blocks per SM (512 x 1 before)
    "two_chunk": {"BWD_TWO_CHUNK_MIN_THREADS": {"cuda": 512, "hip": None}},
    # rows of 576-1024 threads (16-bit N = 4097-8192) as two chunks, N = 4096 as before
    "mid": {"BWD_TWO_CHUNK_MIN_THREADS": {"cuda": 576, "hip": None}},
    # the backward grid's programs per SM (kernels/_config.BWD_BLOCKS_PER_SM caps them): 2 as
    # shipped, or 1 (with --unaligned: the scalar 16-bit N = 4096 kernels, which fit one block
    # per SM, ran 132 programs before 4a70b0a and run 264 since)
    "blocks_two": {"BWD_BLOCKS_PER_SM": 2},
    "blocks_one": {"BWD_BLOCKS_PER_SM": 1},
    # 16-bit scalar (unaligned) rows of one chunk a thread kept as words (packed; two 512-thread
    # blocks per SM fit) or as floats (one fits); with --unaligned
    "scalar_words": {"BWD_PACK_SCALAR_MIN_CHUNKS": {"cuda": 1, "hip": 2}},
    "scalar_floats": {"BWD_PACK_SCALAR_MIN_CHUNKS": {"cuda": 2, "hip": 2}},
    # the grid's programs: as many as fit (bwd_blocks_per_sm x SMs), or the fewest that keep the
    # most row blocks a program takes where that is at most 16 (an earlier run also took
    # ``p_round``: as many as fit rounded down to a multiple of 16, with a knob since removed)
    "p_fit": {"BWD_BALANCE_MAX_STEPS": {"cuda": 0, "hip": 0}},
    "p_balanced": {"BWD_BALANCE_MAX_STEPS": {"cuda": 16, "hip": 0}},
    # the dweight reduction: row groups per block x loads batched per thread
    "reduce_g8_b4": {"BWD_REDUCE_GROUPS": 8, "BWD_REDUCE_BATCH": 4},
    "reduce_g8_b8": {"BWD_REDUCE_GROUPS": 8, "BWD_REDUCE_BATCH": 8},
    "reduce_g16_b8": {"BWD_REDUCE_GROUPS": 16, "BWD_REDUCE_BATCH": 8},
    "reduce_g32_b8": {"BWD_REDUCE_GROUPS": 32, "BWD_REDUCE_BATCH": 8},
    "reduce_g8_b16": {"BWD_REDUCE_GROUPS": 8, "BWD_REDUCE_BATCH": 16},
    "reduce_g8_b32": {"BWD_REDUCE_GROUPS": 8, "BWD_REDUCE_BATCH": 32},
    "reduce_g16_b16": {"BWD_REDUCE_GROUPS": 16, "BWD_REDUCE_BATCH": 16},
    "reduce_g4_b32": {"BWD_REDUCE_GROUPS": 4, "BWD_REDUCE_BATCH": 32},
    # packed 16-bit rows of up to 512 threads two to a block at their own named barriers, one
    # partial row per block (43a3399), or one row a block as before
    "paired": {"BWD_PAIRED_ROWS": {"cuda": True, "hip": False}},
    "unpaired": {"BWD_PAIRED_ROWS": {"cuda": False, "hip": False}},
    # x, dy and dresidual loaded evict-first (ld.global.cs) at every M, or at none (an earlier run
    # also tried an L2 evict-first policy and hinted dx stores, knobs since removed)
    "stream_off": {"BWD_STREAM_MAX_BYTES": 0},
    "stream_cs": {"BWD_STREAM_LOADS": {"cuda": True, "hip": False},
                  "BWD_STREAM_MAX_BYTES": 1 << 60},
    # dweight by float32 atomics into one zeroed row, called with deterministic=False, or the
    # deterministic partial rows and reduction (``_deterministic``: the call's argument)
    "det": {"_deterministic": True},
    "atomic": {"BWD_ATOMIC_DWEIGHT": {"cuda": True, "hip": False}, "_deterministic": False,
               "BWD_ATOMIC_MAX_FLOATS": 1 << 62, "BWD_ATOMIC_MIN_ROWS_PER_PROGRAM": 0},
    # deterministic=False as shipped (atomics where _config.bwd_atomic_dweight takes them)
    "nondet": {"_deterministic": False},
    # unpaired rows with the next row's rstd: the dweight partial's fma in pass 1 and its stores
    # with the last row's pass 1 (early), or in pass 2 and after the last row (late)
    "early_dw": {"BWD_EARLY_DWEIGHT": {"cuda": True, "hip": False}},
    "late_dw": {"BWD_EARLY_DWEIGHT": {"cuda": False, "hip": False}},
    # early, with as many programs as fit (programs of a row block fewer store theirs sooner)
    "early_fit": {"BWD_EARLY_DWEIGHT": {"cuda": True, "hip": False},
                  "BWD_BALANCE_MAX_STEPS": {"cuda": 0, "hip": 0}},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--settings", default="hold_w,load_w")
    ap.add_argument("--dres", action="store_true", help="time the dresidual form")
    ap.add_argument("--no-weight", action="store_true",
                    help="weight=None: dx only (no weight loads, partial rows or reduction)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    ap.add_argument("--wdtype", default="", help="the weight's dtype (default: --dtype)")
    ap.add_argument("--shapes", default="", help="MxN,... (default: SHAPES)")
    ap.add_argument("--flush", default="write", help="L2 flush: write (the benchmark's) or read")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--unaligned", action="store_true",
                    help="rows one element off 16 bytes: the scalar kernels")
    args = ap.parse_args()

    import torch

    import rmsnorm_hip
    from rmsnorm_hip._bench import timing
    from rmsnorm_hip._bench.runner import _shape   # 'MxN' -> (M, N), checked
    from rmsnorm_hip.kernels import _config

    shipped = {}     # _config attribute -> its shipped value, for each one a setting patches
    copy = timing.cuda_copy_bandwidth()["gbps"]
    flush = timing.L2Flush(args.flush)
    rows = []
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    shapes = SHAPES if dtype == torch.bfloat16 else [(4096, 4096), (8192, 4096)]
    if args.shapes:
        shapes = [_shape(s) for s in args.shapes.split(",")]
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        dres = torch.randn_like(x) if args.dres else None
        if args.unaligned:
            x, dy, dres = (None if a is None else
                           torch.empty(m, n + 1, device="cuda", dtype=dtype)[:, 1:].copy_(a)
                           for a in (x, dy, dres))
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(
            getattr(torch, args.wdtype) if args.wdtype else dtype)
        rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1]
        w = None if args.no_weight else w
        nbytes = (4 if args.dres else 3) * m * n * size + 2 * n * size
        reference = None
        for label in args.settings.split(","):
            # a repeated setting: plain_reduce2, reduce_g8_b8_r2 (names may end in digits)
            name = label if label in SETTINGS else re.sub(r"(_r\d+|\d+)$", "", label)
            # each setting starts from the shipped _config: what an earlier one patched is
            # restored first
            for attr, value in shipped.items():
                setattr(_config, attr, value)
            deterministic = True
            for attr, value in SETTINGS[name].items():
                if attr == "_deterministic":
                    deterministic = value
                else:
                    shipped.setdefault(attr, getattr(_config, attr))
                    setattr(_config, attr, value)
            rmsnorm_hip.functional.forget_plans()     # runners hold their plans too
            call = lambda: rmsnorm_hip.rms_norm_backward(  # noqa
                dy, x, w, rstd, dresidual=dres, deterministic=deterministic)
            out = call()
            if reference is None:
                reference = out
            same = all(a is b or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(out, reference))
            # dweight against the first setting's in float64 (an atomic sum is another order)
            dw_err = (None if out[1] is None else float(
                ((out[1].double() - reference[1].double()).abs().max()
                 / reference[1].double().abs().max().clamp_min(1e-30))))
            timing.cuda_device_time(call, flush)     # discarded, as the benchmark's warm-up
            timing_ = timing.cuda_device_time(call, flush)
            row = dict(m=m, n=n, setting=label, us=timing_["us"], kernels=timing_.get("kernels"),
                       GBps=nbytes / timing_["us"] / 1e3, same_bits_as_first=bool(same),
                       dx_same_bits_as_first=bool(torch.equal(out[0].view(torch.uint8),
                                                              reference[0].view(torch.uint8))),
                       dweight_rel_err_vs_first=dw_err)
            row["pct_copy"] = 100 * row["GBps"] / copy
            rows.append(row)
            print(json.dumps(row), flush=True)
        x = dy = dres = None    # free the case before the next one
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    name = (f"tune_bwd{'_dres' if args.dres else ''}{'_noweight' if args.no_weight else ''}"
            f"{'_unaligned' if args.unaligned else ''}"
            f"{'' if args.dtype == 'bfloat16' else '_' + args.dtype}"
            f"{'_w' + args.wdtype if args.wdtype else ''}{args.tag}.json")
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(dict(copy_gbps=copy, dres=args.dres, dtype=args.dtype, flush=args.flush,
                       wdtype=args.wdtype or args.dtype,
                       unaligned=args.unaligned,
                       weight=not args.no_weight,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
