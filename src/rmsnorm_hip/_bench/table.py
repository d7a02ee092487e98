"""Result tables (plain text for the terminal, markdown for the README) and the GB/s plot.

All of them read the result dict that runner.run returns (and writes as JSON), so
benchmarks/make_table.py can rebuild the README's tables from saved runs.  A decode run
(decode.py) has its own: `decode_text_report`, `decode_markdown`.
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


def _errors(records, with_op=False):
    """One line per (implementation, error), naming the cases it happened in."""
    grouped = {}
    for record in records:
        if not record["ok"]:
            case = " ".join(((record["op"],) if with_op else ()) + _case_label(_case_key(record)))
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


OP_TITLES = {"fwd": "rms_norm", "fused": "fused_add_rms_norm",
             "quant": "rms_norm_quant int8 (SmoothQuant)",
             "quant_fp8": "rms_norm_quant fp8 (SmoothQuant)", "bwd": "rms_norm_backward",
             "bwd_dres": "rms_norm_backward, dresidual",
             "quant_group": "rms_norm_quant fp8, 1x128 groups",
             "quant_group_ue8m0": "rms_norm_quant fp8, 1x128 groups, UE8M0 column-major",
             "quant_group_int8": "rms_norm_quant int8, 1x128 groups",
             "quant_static": "rms_norm_quant fp8, static scale",
             "mxfp8": "rms_norm_quant MXFP8", "mxfp4": "rms_norm_quant MXFP4"}


def summary_markdown(runs, shapes):
    """One row per (op, shape in ``shapes``) of the per-op runs ({op: result}): ours and the
    best peer in % of the copy bandwidth measured in their run, and best peer / ours."""
    header = ["op", "shape", "rmsnorm_hip", "best peer", "ratio"]
    rows = []
    order = list(OP_TITLES)
    for op in sorted(runs, key=lambda op: order.index(op) if op in order else len(order)):
        _, _, cells = _grid(runs[op]["records"])
        for M, N in shapes:
            group = {impl: r for (key, impl), r in cells.items()
                     if key == (M, N, "bfloat16") and r["ok"] and "pct_copy" in r}
            ours = group.get("ours")
            peers = [(r["pct_copy"], impl) for impl, r in group.items()
                     if not impl.startswith("ours")]
            if ours is None:
                continue
            best, name = max(peers) if peers else (None, None)
            rows.append([OP_TITLES.get(op, op), f"{M}x{N}", f"{ours['pct_copy']:.0f}%",
                         f"{best:.0f}% ({LABELS.get(name, name)})" if peers else "–",
                         f"{ours['pct_copy'] / best:.2f}" if peers else "–"])
    caption = ("% of the device-to-device copy bandwidth measured in the same run, bf16, "
               "device time with the L2 flushed before each call; ratio: ours / best peer "
               "(> 1: ours is faster).")
    return caption + "\n\n" + _markdown_table(header, rows, right_from=2)


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


# ---- decode mode (decode.py): ours against the best peer, per figure ----

DECODE_FIGURES = {"graph_us": "graph", "us": "flushed", "warm_us": "warm", "host_us": "host"}
MARKDOWN_DECODE_FIGURES = ("graph_us", "us", "host_us")
FUSED_INPLACE_NOTE = ("fused_inplace: ours in place (`fused_add_rms_norm_`); the peers are the "
                      "out-of-place fused calls.")


def _decode_groups(records):
    """{(op, M, N, dtype): {impl: record}} in run order."""
    groups = {}
    for record in records:
        groups.setdefault((record["op"],) + _case_key(record), {})[record["impl"]] = record
    return groups


def decode_best(group, figure):
    """(ours, best peer, the peer's name) for one figure of one case, None where not measured.
    The peers are the implementations not named ours* (ours_torch is ours through torch)."""
    ours = (group.get("ours") or {}).get(figure)
    peers = [(record[figure], impl) for impl, record in group.items()
             if not impl.startswith("ours") and record.get(figure) is not None]
    best, name = min(peers) if peers else (None, None)
    return ours, best, name


def _decode_ours_cell(record, figure):
    """The value; '–' where ours is missing or the figure was not asked for; 'fail' otherwise."""
    if record is not None and record.get(figure) is not None:
        return _num(record[figure])
    if record is None or record["status"] == "unavailable" or record["ok"]:
        return "–"
    return "fail"


def _decode_cells(group, figure, peer_cell):
    ours, best, name = decode_best(group, figure)
    ratio = f"{best / ours:.2f}" if best is not None and ours else "–"
    return [_decode_ours_cell(group.get("ours"), figure),
            peer_cell(best, name) if best is not None else "–", ratio]


def _decode_shape(M, N, dtype):
    return f"{M}x{N}" + ("" if dtype == "bfloat16" else f" {SHORT_DTYPE.get(dtype, dtype)}")


def _decode_rows(result, figures, headers, peer_cell, shapes=None, pdl=None):
    """(header, rows): one row per (op, case) (only the (M, N) in ``shapes`` where given); per
    figure ours, the best peer and the ratio; with ``pdl`` (a decode run with RMSNORM_HIP_PDL=1)
    ours' graph figure from it after the graph columns ('–' where it has no such case)."""
    header = ["op", "MxN"] + [cell for figure in figures for cell in headers(figure)]
    with_pdl = _decode_groups(pdl["records"]) if pdl else None
    at = header.index("ratio") + 1 if pdl else None
    if pdl:
        header.insert(at, "graph us ours, PDL")
    rows = []
    for key, group in _decode_groups(result["records"]).items():
        op, M, N, dtype = key
        if shapes is not None and (M, N) not in shapes:
            continue
        row = [op, _decode_shape(M, N, dtype)] + [
            cell for figure in figures for cell in _decode_cells(group, figure, peer_cell)]
        if pdl:
            row.insert(at, _decode_ours_cell((with_pdl.get(key) or {}).get("ours"), "graph_us"))
        rows.append(row)
    return header, rows


_DECODE_METHOD = {
    "graph_us": lambda c: (f"graph: {c['graph_calls']} calls captured in one CUDA graph, replay "
                           f"time / calls, median of {c['graph_replays']} replays"),
    "us": lambda c: "flushed: device time (CUPTI sum of kernels), L2 flushed before each call",
    "warm_us": lambda c: "warm: device time, no flush",
    "host_us": lambda c: f"host: {c['host_calls']} eager calls + one sync",
}


def decode_title(result, figures=tuple(DECODE_FIGURES)):
    env, method = result["environment"], result["method"]
    partial = " PARTIAL (interrupted)" if result.get("interrupted") else ""
    pdl = f", RMSNORM_HIP_PDL={method['pdl']}" if method.get("pdl") else ""
    described = "; ".join(_DECODE_METHOD[figure](method["counts"]) for figure in figures)
    return (f"rmsnorm_hip bench decode{partial} on {env.get('device')} ({result['target']}"
            f"{pdl}), {env.get('date', '')[:10]}: us per call; {described}; "
            f"ratio: best peer / ours (> 1: ours is faster)")


def decode_text_report(result):
    """The compact decode summary printed at the end of a run: every figure."""
    figures = tuple(DECODE_FIGURES)
    header, rows = _decode_rows(
        result, figures, lambda figure: [f"{DECODE_FIGURES[figure]} ours", "best peer", "x"],
        lambda best, name: f"{_num(best)} {name}")
    parts = [decode_title(result, figures), "", _text_table(header, rows)]
    errors = _errors(result["records"], with_op=True)
    if errors:
        parts += ["", "errors:"] + errors
    return "\n".join(parts)


def decode_markdown(result, shapes=None, pdl=None):
    """Markdown for the README's decode table: graph, flushed and host us per call, each as
    ours, the best peer (named) and best peer / ours; ``shapes``: only these (M, N); ``pdl``: a
    run with RMSNORM_HIP_PDL=1 whose graph figure for ours gets a column."""
    figures = MARKDOWN_DECODE_FIGURES
    header, rows = _decode_rows(
        result, figures,
        lambda figure: [f"{DECODE_FIGURES[figure]} us ours", "best peer", "ratio"],
        lambda best, name: f"{_num(best)} ({LABELS.get(name, name)})", shapes, pdl)
    parts = [decode_title(result, figures) + ".", "", _markdown_table(header, rows, right_from=2)]
    if pdl:
        parts += ["", "graph us ours, PDL: the same calls launched with programmatic dependent "
                      "launch (RMSNORM_HIP_PDL=1, which no peer does), from a run of "
                      f"{pdl['environment'].get('date', '')[:10]}."]
    if "fused_inplace" in result.get("ops", ()):
        parts += ["", FUSED_INPLACE_NOTE]
    versions = result["environment"].get("versions", {})
    if versions:
        listed = ", ".join(f"{name} {version}" for name, version in sorted(versions.items()))
        parts += ["", f"Versions: {listed}."]
    return "\n".join(parts)
