#!/usr/bin/env python3
"""Rebuilds the README's benchmark tables from saved runs.

Reads benchmarks/results/*.json (written by `rmsnorm-hip bench --json FILE`), takes for each op the
newest run, preferring GPU runs to CPU runs, prints its markdown, and rewrites README.md between
`<!-- bench:OP:begin -->` and `<!-- bench:OP:end -->` (OP: fwd, bwd, ...) where those markers exist.

    python benchmarks/make_table.py                 # print and rewrite README.md
    python benchmarks/make_table.py --print-only    # print only
    python benchmarks/make_table.py --check         # exit 1 if README.md is not up to date
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


# the README's decode rows; benchmarks/results holds every case
README_DECODE_SHAPES = {(1, 4096), (32, 4096), (512, 4096), (1, 8192), (512, 8192)}


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
    readme = None
    if os.path.exists(args.readme):
        with open(args.readme) as f:
            readme = f.read()
    updated = readme
    for op, (path, result) in runs.items():
        block = table.markdown(result)
        print(f"<!-- {op}: {os.path.relpath(path, ROOT)} -->\n{block}\n")
        spliced = splice(updated, op, block) if updated is not None else None
        if spliced is None:
            print(f"note: {args.readme} has no <!-- bench:{op}:begin/end --> markers",
                  file=sys.stderr)
        else:
            updated = spliced
    plain, pdl = newest_decode(args.results)
    if plain is not None:
        block = table.decode_markdown(plain[1], README_DECODE_SHAPES,
                                      pdl[1] if pdl is not None else None)
        print(f"<!-- decode: {os.path.relpath(plain[0], ROOT)} -->\n{block}\n")
        spliced = splice(updated, "decode", block) if updated is not None else None
        if spliced is not None:
            updated = spliced
    if args.check:
        return 0 if updated == readme else 1
    if not args.print_only and updated != readme:
        with open(args.readme, "w") as f:
            f.write(updated)
        print(f"rewrote {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
