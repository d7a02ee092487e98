"""Result tables (plain text for the terminal, markdown for the README) and the GB/s plot.

All of them read the result dict that runner.run returns (and writes as JSON), so
benchmarks/make_table.py can rebuild the README's tables from saved runs.
"""
from .targets import SHORT_DTYPE

LABELS = {
    "ours": "rmsnorm_hip",
    "ours_torch": "rmsnorm_hip.torch",
    "torch": "torch eager",
    "torch_compile": "torch.compile",
    "liger": "Liger",
    "quack": "QuACK",
    "numpy": "NumPy",
}


def _case_key(record):
    return record["M"], record["N"], record["dtype"]


def _case_label(key):
    M, N, dtype = key
    return f"{M}x{N}", SHORT_DTYPE.get(dtype, dtype)


def _grid(records):
    """(case keys in run order, implementation names in run order, {(case, impl): record})."""
    cases, impls, cells = {}, {}, {}
    for record in records:
        key = _case_key(record)
        cases.setdefault(key, None)
        impls.setdefault(record["impl"], None)
        cells[key, record["impl"]] = record
    return list(cases), list(impls), cells


def _cell(record, format_ok):
    """'–' for a missing implementation, 'fail' for a failed check or call, else format_ok."""
    if record is None or record["status"] == "unavailable":
        return "–"
    return format_ok(record) if record["ok"] else "fail"


def _num(value):
    """Three significant digits, without an exponent for the GB/s and us of a GPU (4072, 29.6)."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _bandwidth_cell(record):
    return _cell(record, lambda r: f"{_num(r['gbps'])} ({r['pct_copy']:.0f})")


def _time_cell(record):
    def format_ok(r):
        return _num(r["us"]) + (f"/{_num(r['event_us'])}" if "event_us" in r else "")

    return _cell(record, format_ok)


def _host_cell(record):
    def format_ok(r):  # CPU host records have no separate device time
        return _num(r["host_us"]) + (f" / {_num(r['us'])}" if "us" in r else "")

    return _cell(record, format_ok)


def _case_rows(records, format_cell, label=lambda impl: impl):
    """(header, rows) with one row per case and one column per implementation."""
    cases, impls, cells = _grid(records)
    header = ["shape", "dtype"] + [label(impl) for impl in impls]
    rows = [[*_case_label(case)] + [format_cell(cells.get((case, impl))) for impl in impls]
            for case in cases]
    return header, rows


def _host_rows(host_records, label=lambda impl: impl):
    """(header, rows) with one row per implementation and one column per case."""
    cases, impls, cells = _grid(host_records)
    header = ["impl"] + [f"M={M} N={N} {SHORT_DTYPE.get(d, d)}" for M, N, d in cases]
    rows = [[label(impl)] + [_host_cell(cells.get((case, impl))) for case in cases]
            for impl in impls]
    return header, rows


def _text_table(header, rows):
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in [header] + rows]
    return "\n".join(lines)


def _markdown_table(header, rows, right_from=1):
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in [header, align] + rows)


def _errors(records):
    """One line per (implementation, error), naming the cases it happened in."""
    grouped = {}
    for record in records:
        if not record["ok"]:
            case = " ".join(_case_label(_case_key(record)))
            grouped.setdefault((record["impl"], record["error"]), []).append(case)
    return [f"  {impl}: {error}  [{', '.join(cases)}]" for (impl, error), cases in grouped.items()]


def title(result):
    env, method, on_gpu = result["environment"], result["method"], result["target"] == "cuda"
    timer = (f"device time (CUPTI sum of kernels), L2 flushed before each call "
             f"({method.get('l2_flush')})" if on_gpu else "median wall-clock time")
    partial = " PARTIAL (interrupted)" if result.get("interrupted") else ""
    return (f"rmsnorm_hip bench {result['op']}{partial} on {env.get('device')} "
            f"({result['target']}), {env.get('date', '')[:10]}: {timer}; "
            f"GB/s over {method['bytes_formula']}; (%) of the measured copy bandwidth, "
            f"{result['copy']['gbps']:.0f} GB/s")


def _host_caption(result, text):
    return text + (" / device time per call, us" if result["target"] == "cuda" else "")


def text_report(result):
    """The compact summary printed at the end of a run (the device tool returns only the tail)."""
    on_gpu = result["target"] == "cuda"
    parts = [title(result), "", _text_table(*_case_rows(result["records"], _bandwidth_cell)),
             "", "us per call" + (" (device / CUDA events)" if on_gpu else ""),
             _text_table(*_case_rows(result["records"], _time_cell))]
    if result["host_overhead"]:
        caption = _host_caption(result, "host us per call, 1000 calls + 1 sync (median of 3)")
        parts += ["", caption, _text_table(*_host_rows(result["host_overhead"]))]
    errors = _errors(result["records"] + result["host_overhead"])
    if errors:
        parts += ["", "errors:"] + errors
    return "\n".join(parts)


def markdown(result):
    """Markdown for the README: the GB/s table, then the host-overhead table."""
    label = lambda impl: LABELS.get(impl, impl)  # noqa: E731
    header, rows = _case_rows(result["records"], _bandwidth_cell, label)
    parts = [title(result) + ".", "", _markdown_table(header, rows, right_from=2)]
    if result["host_overhead"]:
        caption = _host_caption(
            result, "Host wall time per call, us (1000 calls + one sync, median of 3 runs)")
        parts += ["", caption + ":", "",
                  _markdown_table(*_host_rows(result["host_overhead"], label))]
    versions = result["environment"].get("versions", {})
    if versions:
        listed = ", ".join(f"{name} {version}" for name, version in sorted(versions.items()))
        parts += ["", f"Versions: {listed}."]
    return "\n".join(parts)


def plot(result, path):
    """Grouped bars of GB/s per case and implementation, the copy bandwidth as a dashed line; one
    panel per op for an ``all`` result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"] if result["op"] == "all" else [result]
    widths = [max(4, 1.3 * len(_grid(run["records"])[0])) for run in runs]
    cols = 1 if len(runs) == 1 else 2
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * max(widths), 4.2 * rows), squeeze=False)
    for ax, run in zip(axes.flat, runs):
        _plot_run(ax, run)
    for ax in list(axes.flat)[len(runs):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_run(ax, result):
    cases, impls, cells = _grid(result["records"])
    impls = [impl for impl in impls if any(cells[case, impl]["ok"] for case in cases
                                           if (case, impl) in cells)]
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        values = [cells[case, impl]["gbps"] if cells.get((case, impl), {}).get("ok") else 0.0
                  for case in cases]  # a failed or missing case is an empty slot
        ax.bar([c + (i - (len(impls) - 1) / 2) * width for c in range(len(cases))], values,
               width, label=LABELS.get(impl, impl))
    ax.axhline(result["copy"]["gbps"], color="black", linestyle="--", linewidth=1,
               label=f"copy {result['copy']['gbps']:.0f} GB/s")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(["\n".join(_case_label(case)) for case in cases], fontsize=8)
    ax.set_ylabel("GB/s (minimal bytes)")
    ax.set_title(f"rms_norm {result['op']}, {result['environment'].get('device')}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
