"""The GPU forward kernel's paths, and an N that takes each one under the current heuristics.

``kernels/_config.row_layout`` decides a row's layout from N and the dtype; its thresholds move
as they are tuned.  Tests name the path they mean (a *flavor*) and ask :func:`pick_n` for the
smallest N that takes it now, so retuning cannot silently move a test off its path; a flavor no N
takes any more fails with a message saying so.  No side effects: the compile subprocess imports
this too.
"""
from rmsnorm_hip.kernels import _config

# flavor -> predicate on (RowLayout, rows per block)
FLAVORS = {
    # several rows per block, row cached in registers
    "multirow_1thread": lambda lay, rows: lay.cached and rows > 1 and lay.threads == 1,
    "multirow_idle": lambda lay, rows: lay.cached and rows > 1 and lay.threads > lay.n_chunks,
    "multirow_warp": lambda lay, rows: lay.cached and rows > 1 and lay.threads == 32,
    "multirow_warps": lambda lay, rows: lay.cached and rows > 1 and lay.threads > 32,
    # one row per block, cached
    "row": lambda lay, rows: lay.cached and rows == 1,
    "row_odd_wavefronts": lambda lay, rows: (lay.cached and rows == 1 and lay.threads > 64
                                             and lay.threads % 128 == 64),  # 3, 5, ... x 64
    # the row is re-read for the second pass
    "looped": lambda lay, rows: not lay.cached,
}


def path_of(layout, rows):
    """"multirow" | "row" | "looped": the three code paths of the forward kernel."""
    if not layout.cached:
        return "looped"
    return "multirow" if rows > 1 else "row"


def chunk_of(dtype):
    return _config.CHUNK_BYTES // (4 if dtype == "float32" else 2)


def layout_of(n, dtype, quant=False):
    """The forward's row layout: the quantised kernels have their own (more chunks a thread)."""
    return _config.quant_row_layout(n, dtype) if quant else _config.row_layout(n, dtype)


def takes(flavor, n, dtype, quant=False):
    layout = layout_of(n, dtype, quant)
    return FLAVORS[flavor](layout, _config.rows_per_block(layout))


def pick_n(flavor, dtype, vector, quant=False):
    """The smallest N taking ``flavor`` for ``dtype`` (in the quantised forward when ``quant``):
    a whole number of 16-byte chunks when ``vector`` (so aligned calls take the vector path),
    else one short of it (ragged: scalar)."""
    chunk = chunk_of(dtype)
    for k in range(1, 1 << 17):
        n = chunk * k if vector else chunk * k - 1
        if takes(flavor, n, dtype, quant):
            return n
    raise LookupError(f"no N takes the {flavor} path for {dtype} under kernels/_config's "
                      f"current heuristics: update tests/_paths.py")
