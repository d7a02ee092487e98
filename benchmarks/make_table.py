#!/usr/bin/env python3
"""Rebuilds the README's benchmark tables from saved runs.

Reads benchmarks/results/*.json (written by `rmsnorm-hip bench --json FILE`), takes for each op the
newest run, preferring GPU runs to CPU runs, prints its markdown, and rewrites README.md between
`<!-- bench:OP:begin -->` and `<!-- bench:OP:end -->` (OP: fwd, bwd, ...) where those markers exist.

    python benchmarks/make_table.py                 # print and rewrite README.md
    python benchmarks/make_table.py --print-only    # print only
    python benchmarks/make_table.py --check         # exit 1 if README.md is not up to date
    python benchmarks/make_table.py --results FILE.json ...   # use these runs
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
        for run in result["runs"] if result["op"] == "all" else [result]:
            rank = (run["target"] != "cpu", run["environment"].get("date", ""))
            op = run["op"]
            if op not in chosen or rank > chosen[op][0]:
                chosen[op] = (rank, path, run)
    return {op: (path, result) for op, (_, path, result) in sorted(chosen.items())}


def splice(text, op, block):
    """text with block between the op's markers; None when the markers are absent."""
    begin, end = f"<!-- bench:{op}:begin -->", f"<!-- bench:{op}:end -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        return None
    return f"{text[:start + len(begin)]}\n{block}\n{text[stop:]}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    saved = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))
    parser.add_argument("--results", nargs="+", metavar="FILE", default=saved)
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    parser.add_argument("--print-only", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the README is not up to date")
    args = parser.parse_args(argv)

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
    if args.check:
        return 0 if updated == readme else 1
    if not args.print_only and updated != readme:
        with open(args.readme, "w") as f:
            f.write(updated)
        print(f"rewrote {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
