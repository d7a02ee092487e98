#!/usr/bin/env python3
"""Rebuilds the README's benchmark tables from saved runs.

Reads benchmarks/results/*.json (written by `rmsnorm-hip bench --json FILE`), takes for each op the
newest run, preferring GPU runs to CPU runs, prints its markdown, and rewrites README.md and
docs/performance.md between `<!-- bench:NAME:begin -->` and `<!-- bench:NAME:end -->` where those
markers exist.  NAME: an op (fwd, bwd, ...), `summary` (every op at a few shapes, ours against
the best peer), `decode` (a sample of the newest decode run) and `decode_all` (all of it).

    python benchmarks/make_table.py                 # print and rewrite README.md
    python benchmarks/make_table.py --print-only    # print only
    python benchmarks/make_table.py --check         # exit 1 if a document is not up to date
    python benchmarks/make_table.py --results FILE.json ...   # use these runs
    python benchmarks/make_table.py --decode FILE.json        # print a decode run's table

Decode runs (`rmsnorm-hip bench --decode --json FILE`) are left out of the per-op tables.
"""
import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    from rmsnorm_hip._bench import table
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from rmsnorm_hip._bench import table


def newest_per_op(paths):
    """{op: (path, result)} with the newest run of each op; a GPU run beats any CPU run."""
    chosen = {}
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        if not isinstance(result, dict) or "environment" not in result or "op" not in result:
            continue  # tuning sweeps, ISA reports: not bench runs
        if result.get("mode") == "decode":
            continue  # its own table: --decode
        for run in result["runs"] if result["op"] == "all" else [result]:
            rank = (run["target"] != "cpu", run["environment"].get("date", ""))
            op = run["op"]
            if op not in chosen or rank > chosen[op][0]:
                chosen[op] = (rank, path, run)
    return {op: (path, result) for op, (_, path, result) in sorted(chosen.items())}


# the README's decode rows and summary shapes; docs/performance.md has every case
README_DECODE_SHAPES = {(1, 4096), (32, 4096), (512, 4096), (1, 8192), (512, 8192)}
SUMMARY_SHAPES = ((32768, 4096), (4096, 4096), (1024, 8192))
DOCS = ("README.md", os.path.join("docs", "performance.md"))


def newest_decode(paths):
    """(path, result) of the newest decode run without PDL and of the newest with it (or None)."""
    newest = {False: None, True: None}
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        if not isinstance(result, dict) or result.get("mode") != "decode":
            continue
        pdl = bool(result["method"].get("pdl"))
        date = result["environment"].get("date", "")
        if newest[pdl] is None or date > newest[pdl][1]["environment"].get("date", ""):
            newest[pdl] = (path, result)
    return newest[False], newest[True]


def splice(text, op, block):
    """text with block between the op's markers; None when the markers are absent."""
    begin, end = f"<!-- bench:{op}:begin -->", f"<!-- bench:{op}:end -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        return None
    return f"{text[:start + len(begin)]}\n{block}\n{text[stop:]}"


def print_decode(path):
    """Prints the decode table of the run in `path`; 1 when it is no decode run."""
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result, dict) or result.get("mode") != "decode":
        print(f"{path}: not a decode run (rmsnorm-hip bench --decode --json FILE)",
              file=sys.stderr)
        return 1
    print(table.decode_markdown(result))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    saved = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))
    parser.add_argument("--results", nargs="+", metavar="FILE", default=saved)
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    parser.add_argument("--print-only", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the README is not up to date")
    parser.add_argument("--plot", metavar="PNG", default=os.path.join(
        ROOT, "benchmarks", "results", "all_h200.png"),
        help="redraw the README's GB/s plot from the same runs ('' to skip)")
    parser.add_argument("--decode", metavar="FILE",
                        help="print the markdown of this decode run (bench --decode --json FILE)")
    args = parser.parse_args(argv)
    if args.decode:
        return print_decode(args.decode)

    runs = newest_per_op(args.results)
    if not runs:
        print("no results: run `rmsnorm-hip bench --json benchmarks/results/NAME.json` first",
              file=sys.stderr)
        return 1
    blocks = {}
    for op, (path, result) in runs.items():
        blocks[op] = (path, table.markdown(result))
    blocks["summary"] = ("per-op runs", table.summary_markdown(
        {op: result for op, (_, result) in runs.items()}, SUMMARY_SHAPES))
    plain, pdl = newest_decode(args.results)
    if plain is not None:
        with_pdl = pdl[1] if pdl is not None else None
        blocks["decode"] = (plain[0], table.decode_markdown(plain[1], README_DECODE_SHAPES,
                                                            with_pdl))
        blocks["decode_all"] = (plain[0], table.decode_markdown(plain[1], None, with_pdl))
    for name, (path, block) in blocks.items():
        print(f"<!-- {name}: {os.path.relpath(path, ROOT) if os.path.exists(path) else path} "
              f"-->\n{block}\n")
    if args.plot and not (args.check or args.print_only):
        combined = {"op": "all", "runs": [result for _, (_, result) in runs.items()]}
        try:
            table.plot(combined, args.plot)
        except ImportError:
            print("make_table: matplotlib is missing (pip install 'rmsnorm-hip[bench]'): "
                  "the plot was not redrawn", file=sys.stderr)
    stale = []
    for doc in ([args.readme] if args.readme else []) + [os.path.join(ROOT, d) for d in DOCS[1:]]:
        if not os.path.exists(doc):
            continue
        with open(doc) as f:
            text = f.read()
        updated = text
        for name, (_, block) in blocks.items():
            updated = splice(updated, name, block) or updated
        if updated != text:
            stale.append(doc)
            if not args.check and not args.print_only:
                with open(doc, "w") as f:
                    f.write(updated)
                print(f"rewrote {doc}", file=sys.stderr)
    if args.check:
        return 1 if stale else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
