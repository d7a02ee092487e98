"""Summarises Nsight Compute's per-instruction stall sampling: reads the text of
``ncu --page source --print-source sass --section SourceCounters ...`` (one kernel) and prints the
sample total, the stall reasons summed over the kernel and the ``top`` instructions by samples
with their three largest reasons.  No GPU needed (the ncu text comes from the device).

    python3 benchmarks/ncu_stalls.py ncu_src.txt [top]
"""
import re
import sys


def parse(path):
    """(column names, rows of cells) of the SASS table in an ncu source-page text."""
    lines = [line.rstrip("\n") for line in open(path) if not line.startswith("==")]
    dashes = [i for i, line in enumerate(lines) if line.startswith("------------------ ")]
    bounds = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[dashes[1]])]
    first = next(i for i, line in enumerate(lines) if line.startswith("0x"))
    header = lines[dashes[1] + 1:first]
    names = ["".join(h[a:b + 1].strip() for h in header if len(h) > a) for a, b in bounds]
    rows = [[line[a:b + 1].strip() for a, b in bounds] for line in lines[first:]
            if line.startswith("0x")]
    return names, rows


def _int(cell):
    try:
        return int(cell)
    except ValueError:
        return 0


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    names, rows = parse(path)
    stalls = [i for i, name in enumerate(names) if name.startswith("stall_")]
    print("instructions", len(rows), "samples", sum(_int(r[2]) for r in rows))
    totals = {names[i]: sum(_int(r[i]) for r in rows) for i in stalls}
    print(sorted(totals.items(), key=lambda kv: -kv[1])[:10])
    ranked = sorted(range(len(rows)), key=lambda k: -_int(rows[k][2]))[:top]
    for k in sorted(ranked):
        row = rows[k]
        reasons = {names[i][6:]: _int(row[i]) for i in stalls if _int(row[i])}
        largest = dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
        print(k, row[1][:60].ljust(60), row[2], row[3], largest)


if __name__ == "__main__":
    main()
