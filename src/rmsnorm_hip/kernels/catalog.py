"""Every kernel variant the dispatcher can launch, for ahead-of-time compilation and resource
reports (``rmsnorm-hip compile``).  Built from the same spec functions the backends call, so a new
path or kernel shows up here by construction: add its enumeration next to its builder."""
from dataclasses import dataclass

from .. import _dtypes
from . import _config, gated_bwd, qk_norm, rmsnorm_bwd, rmsnorm_fwd

# one representative N per forward path (see _config.row_layout): multi-row, scalar-only (ragged),
# cached single-row at the LLM sizes, and the looped path
FWD_REPRESENTATIVE_N = (8, 127, 4096, 5000, 8192, 65536)
# backward: multi-row (ragged: scalar only), one row per block (N = 4096: 16-bit rows of 512
# threads, two blocks per SM, and float32 rows of 1024; N = 8192: 16-bit rows of 1024 threads, the
# benchmark's 8192-wide shapes; N = 16384: rows of 1024 threads x 2 chunks (16-bit: the weight
# loaded per chunk, words in the scalar form too) and x 4 (float32: aot.SM90_SPILL_ALLOWANCE)),
# looped
BWD_REPRESENTATIVE_N = (127, 4096, 8192, 16384, 65536)
# ...and the column programs' widest blocks (bwd_column_dweight): rows of 10 KB, 640 threads of one
# 16-byte chunk (16-bit N = 5120, float32 2560), whose other kernels are those of the sizes above
BWD_COLUMN_ROW_BYTES = 10240


@dataclass(frozen=True)
class Variant:
    op: str
    builder: object
    spec: object
    argtypes: tuple

    @property
    def label(self):
        s = self.spec
        if self.op == "gated_bwd":
            return (f"gated_bwd:{s.dtype}:w={s.weight or 'none'}:G={s.layout.n}:"
                    f"{'cached' if s.layout.cached else 'words' if s.held_words else 'looped'}:"
                    f"{'vec' if s.vector else 'scalar'}:gate={s.gate}:"
                    f"recompute={int(s.recompute_rstd)}"
                    + ("" if s.held_partial else ":ws_partial"))
        if self.op == "qk":
            rope = f"{s.rope}:cache={s.cache}:pos={s.positions}" if s.rope else "none"
            return (f"qk:{s.dtype}:w={s.weight}:D={s.layout.n}:"
                    f"{'vec' if s.vector else 'scalar'}:rope={rope}"
                    + (":halves" if s.halves else ""))
        if self.op == "bwd_reduce":
            return f"bwd_reduce:w={s.weight}:groups={s.groups}" + (":pairs" if s.pairs else "")
        layout = s.layout
        path = ("looped" if not layout.cached else "paired" if getattr(s, "paired", False)
                else "multirow" if s.rows > 1 else "row")
        access = "vec" if s.vector else "scalar"
        if self.op == "bwd":
            flags = (f"recompute={int(s.recompute_rstd)}:dres={int(s.dresidual)}"
                     + (":stream_loads" if s.stream_loads else "")
                     + (":atomic" if s.atomic_dweight else "")
                     + (":direct" if s.direct_dweight else "")
                     + (":columns" if s.column_dweight else ""))
        else:
            flags = f"rstd={int(s.store_rstd)}"
            if getattr(s, "fused", False):
                flags += (f":res={int(s.residual)}" + (f":q={s.quant}" if s.quant else "")
                          + (f":{s.scaling}" if s.scaling else "")
                          + (f":G={s.group}" if s.group else "")
                          + (f":xs={s.xscale}" if s.xscale else "")
                          + ("" if s.offset else ":offset=0"))
            flags += ":stream" if s.stream else ""
            flags += ":held" if s.held_weights else ""
        if getattr(s, "gate", ""):
            flags += f":gate={s.gate}"
        if getattr(s, "heads", False):
            flags += ":heads"
        return f"{self.op}:{s.dtype}:w={s.weight or 'none'}:N={layout.n}:{path}:{access}:{flags}"

    @property
    def full_width_store(self):
        """Whether the kernel stores rows of x's width (128-bit stores on the vector path); a
        quantised forward without residual stores 8-bit q only (64- / 32-bit stores)."""
        return not getattr(self.spec, "quant", "") or self.spec.residual


def _streams(vendor, residual, quant):
    """The values of FwdSpec.stream a call of this kind may ask for on ``vendor`` (both where
    _config.fwd_stream depends on M; fwd_spec drops it where the layout cannot stream)."""
    return tuple(sorted({_config.fwd_stream(vendor, residual, quant, m, 1) for m in (1, 1 << 62)}))


def fwd_variants(ns=FWD_REPRESENTATIVE_N, vendor="cuda"):
    for dtype in _dtypes.ACTIVATION_DTYPES:
        weights = _weights(dtype)
        for n in ns:
            layout = _config.row_layout(n, dtype)
            vector_ok = n % layout.chunk == 0
            for weight in weights:
                for vector in ([True, False] if vector_ok else [False]):
                    for store_rstd in (True, False):
                        specs = dict.fromkeys(
                            _config.fwd_spec(n, dtype, weight, vector, store_rstd, stream=stream,
                                             vendor=vendor)
                            for stream in _streams(vendor, False, ""))
                        for spec in specs:
                            yield Variant("fwd", rmsnorm_fwd.make_rmsnorm_fwd, spec,
                                          rmsnorm_fwd.argtypes(spec))


# the fused forward switches (residual add, quantisation, SmoothQuant scale) per path: multi-row
# ragged (scalar only), multi-row with two warps per row, cached single-row, looped
FUSED_REPRESENTATIVE_N = (127, 1024, 4096, 65536)


def fused_variants(ns=FUSED_REPRESENTATIVE_N, vendor="cuda"):
    """Per dtype, path and access form: one fused add and two of the four quantised kinds (int8 /
    fp8 x with / without residual), alternating between the vector and scalar forms of a path,
    with weight, rstd and xscale dtypes rotating over them: every switch appears on every path
    and dtype without their full product (each variant costs ~1 s of CPU per compiler)."""
    wide = _dtypes.FLOAT32
    for dtype in _dtypes.ACTIVATION_DTYPES:
        for n in ns:
            layout = _config.row_layout(n, dtype)
            for vector in ([True, False] if n % layout.chunk == 0 else [False]):
                def specs_of(weight, store_rstd, residual, quant="", xscale="", offset=True):
                    # one-shot and streamed where that kind takes either at some M (fwd_spec
                    # streams if it can)
                    return list(dict.fromkeys(
                        _config.fwd_spec(n, dtype, weight, vector, store_rstd, residual, quant,
                                         xscale, offset, stream, vendor)
                        for stream in _streams(vendor, residual, quant)))
                if vector or n % layout.chunk:      # the vector form, or a ragged N's only form
                    kinds = [("fused_add", (dtype, True, True)),
                             ("quant", (dtype, False, False, _dtypes.INT8, wide)),
                             ("quant", (dtype, False, False, _dtypes.INT8, wide, False)),
                             ("quant", (wide, False, True, _dtypes.FLOAT8_E4M3FN, dtype))]
                else:
                    kinds = [("fused_add", ("", False, True)),
                             ("quant", ("", False, True, _dtypes.INT8)),
                             ("quant", (dtype, False, False, _dtypes.FLOAT8_E4M3FN, wide))]
                specs = [(op, s) for op, args in kinds for s in specs_of(*args)]
                for op, s in specs:
                    yield Variant(op, rmsnorm_fwd.make_rmsnorm_fwd, s, rmsnorm_fwd.argtypes(s))


def _weights(dtype):
    return ["", dtype] + ([_dtypes.FLOAT32] if dtype != _dtypes.FLOAT32 else [])


def bwd_variants(ns=BWD_REPRESENTATIVE_N, vendor="cuda"):
    for dtype in _dtypes.ACTIVATION_DTYPES:
        column_n = BWD_COLUMN_ROW_BYTES // _dtypes.ITEMSIZE[dtype]
        for n in ns + (column_n,):
            columns_only = n == column_n
            layout = _config.bwd_row_layout(n, dtype, vendor)
            for weight in _weights(dtype):
                for vector in ([True, False] if n % layout.chunk == 0 else [False]):
                    for recompute in (False, True):
                        for dres in (False, True):
                            # calls of few rows do not pair (bwd_pair_rows), calls of few bytes
                            # load evict-first (bwd_stream_rows), deterministic=False calls may
                            # sum a float32 weight's dweight by atomics (bwd_atomic_dweight):
                            # every kernel of the eight (a pair twin launches the unpaired
                            # scalar kernel: bwd_kernel_spec); and calls of one row write
                            # dweight from the kernel (bwd_direct_dweight)
                            atomics = ((False, True) if _config.BWD_ATOMIC_DWEIGHT[vendor]
                                       else (False,))
                            specs = set()
                            if not columns_only:
                                specs = {_config.bwd_kernel_spec(_config.bwd_spec(
                                             n, dtype, weight, vector, recompute, dres, vendor,
                                             pair, stream, atomic))
                                         for pair in (True, False) for stream in (True, False)
                                         for atomic in atomics}
                                specs.add(_config.bwd_spec(
                                    n, dtype, weight, vector, recompute, dres, vendor,
                                    pair=False, stream=_config.bwd_stream_rows(1, n, dtype, vendor),
                                    direct=True))
                            # calls of few rows with the forward's rstd: dweight from column
                            # programs (bwd_column_dweight), rows at one or two strides
                            if _config.bwd_column_dweight(n, dtype, weight, recompute, 2, vendor):
                                for heads in (False, True):
                                    specs.add(_config.bwd_spec(
                                        n, dtype, weight, vector, recompute, dres, vendor,
                                        stream=not heads and _config.bwd_stream_rows(
                                            2, n, dtype, vendor), heads=heads, columns=True))
                            for spec in sorted(specs, key=lambda s: (s.paired, s.stream_loads,
                                                                     s.atomic_dweight,
                                                                     s.direct_dweight,
                                                                     s.column_dweight, s.heads)):
                                yield Variant("bwd", rmsnorm_bwd.make_rmsnorm_bwd, spec,
                                              rmsnorm_bwd.argtypes(spec))
    for weight in _dtypes.ACTIVATION_DTYPES:
        for pairs in ((False, True) if _config.BWD_PAIRED_ROWS[vendor] else (False,)):
            spec = _config.reduce_spec(weight, pairs)
            yield Variant("bwd_reduce", rmsnorm_bwd.make_dweight_reduce, spec,
                          rmsnorm_bwd.reduce_argtypes(spec))


# rows at two strides (head rows: FwdSpec.heads / BwdSpec.heads) per path: multi-row at a head
# size, multi-row ragged (scalar only), one cached row per block, looped
HEADS_REPRESENTATIVE_N = (128, 127, 4096, 65536)


def heads_variants(ns=HEADS_REPRESENTATIVE_N, vendor="cuda"):
    """rms_norm and its backward over head rows: per dtype and path, the vector and scalar forms
    (a ragged N: scalar only), with the weight dtype, rstd and the backward's switches rotating
    over them (each variant costs ~1 s of CPU per compiler)."""
    for dtype in _dtypes.ACTIVATION_DTYPES:
        weights = _weights(dtype)
        for i, n in enumerate(ns):
            layout = _config.row_layout(n, dtype)
            for j, vector in enumerate([True, False] if n % layout.chunk == 0 else [False]):
                k = i + j
                spec = _config.fwd_spec(n, dtype, weights[k % len(weights)], vector, k % 2 == 0,
                                        vendor=vendor, heads=True)
                yield Variant("fwd", rmsnorm_fwd.make_rmsnorm_fwd, spec,
                              rmsnorm_fwd.argtypes(spec))
                spec = _config.bwd_kernel_spec(_config.bwd_spec(
                    n, dtype, weights[(k + 1) % len(weights)], vector, k % 2 == 1, k % 3 == 0,
                    vendor, heads=True))
                yield Variant("bwd", rmsnorm_bwd.make_rmsnorm_bwd, spec,
                              rmsnorm_bwd.argtypes(spec))


# gated rows (and groups): a Mamba 2 group, multi-row ragged, one cached row, looped; the
# backward's looped rows at 8192 (the dweight partial in registers) and 16384 (in the workspace)
GATED_REPRESENTATIVE_N = (128, 127, 4096, 65536)
GATED_BWD_N = (128, 127, 4096, 8192, 16384)
GATED_STREAM_N = (4096,)


def gated_variants(ns=GATED_REPRESENTATIVE_N, vendor="cuda"):
    """Gated forward and backward kernels per dtype and path: both gates, grouped and not,
    the vector and scalar forms, with the weight dtype and rstd rotating over them."""
    streams = _config.FWD_STREAM_ROWS_PER_SM[vendor]["residual"] != 0
    for dtype in _dtypes.ACTIVATION_DTYPES:
        weights = _weights(dtype)
        for i, n in enumerate(dict.fromkeys(ns + GATED_BWD_N)):
            layout = _config.row_layout(n, dtype)
            for j, vector in enumerate([True, False] if n % layout.chunk == 0 else [False]):
                for gate in ("input", "output"):
                    k = i + j + (gate == "output")
                    if n in ns:
                        spec = _config.fwd_spec(n, dtype, weights[k % len(weights)], vector,
                                                k % 2 == 0, vendor=vendor, heads=k % 2 == 1,
                                                gate=gate)
                        yield Variant("gated", rmsnorm_fwd.make_rmsnorm_fwd, spec,
                                      rmsnorm_fwd.argtypes(spec))
                    if n in GATED_STREAM_N and vector and streams:  # decode batches' rows
                        spec = _config.fwd_spec(n, dtype, weights[(k + 1) % len(weights)], True,
                                                k % 2 == 1, stream=True, vendor=vendor,
                                                gate=gate)
                        yield Variant("gated", rmsnorm_fwd.make_rmsnorm_fwd, spec,
                                      rmsnorm_fwd.argtypes(spec))
                    if n in GATED_BWD_N:
                        spec = _config.gated_bwd_spec(n, dtype, weights[(k + 1) % len(weights)],
                                                      vector, k % 2 == 1, gate, vendor)
                        yield Variant("gated_bwd", gated_bwd.make_gated_bwd, spec,
                                      gated_bwd.argtypes(spec))


# quantised rows with scales per group, MX or static: a multi-row block of 16-lane rows, one
# cached row per block (the LLM widths; streamed where the vendor streams quantised rows), the
# looped row
QUANT_SCALED_REPRESENTATIVE_N = (128, 4096, 65536)
# (quant, scaling, group) of each scaled format
QUANT_SCALED_FORMATS = (
    (_dtypes.FLOAT8_E4M3FN, "group", 128), (_dtypes.INT8, "group", 32),
    (_dtypes.FLOAT8_E4M3FN, "ue8m0", 128), (_dtypes.INT8, "ue8m0", 16),
    (_dtypes.FLOAT8_E4M3FN, "static", 0), (_dtypes.INT8, "static", 0),
    (_dtypes.MXFP8, "mx", 32), (_dtypes.MXFP4, "mx", 32))


def quant_scaled_variants(ns=QUANT_SCALED_REPRESENTATIVE_N, vendor="cuda"):
    """Per dtype and path, every scaled format once, in the vector or the scalar form
    alternately, with the residual, xscale, weight dtype and offset switches rotating over them
    (and each kind streamed or not as its calls may be: _streams)."""
    for d, dtype in enumerate(_dtypes.ACTIVATION_DTYPES):
        weights = _weights(dtype)
        for i, n in enumerate(ns):
            for j, (quant, scaling, group) in enumerate(QUANT_SCALED_FORMATS):
                k = d + i + j
                residual = (i + j) % 2 == 1
                xscale = (_dtypes.FLOAT32, "", dtype)[k % 3]
                specs = dict.fromkeys(
                    _config.fwd_spec(n, dtype, weights[k % len(weights)], k % 2 == 0, False,
                                     residual, quant, xscale, k % 4 != 0, stream, vendor,
                                     scaling=scaling, group=group)
                    for stream in _streams(vendor, residual, quant))
                for spec in specs:
                    yield Variant("quant", rmsnorm_fwd.make_rmsnorm_fwd, spec,
                                  rmsnorm_fwd.argtypes(spec))


# QK-norm heads: the common head size, a two-warp float32 row (D = 256: 64 threads), and a
# head of 80 (ragged against a power of two of threads)
QK_REPRESENTATIVE_D = (80, 128, 256)


def qk_variants(ds=QK_REPRESENTATIVE_D, vendor="cuda"):
    """Per dtype and head size: no RoPE, neox and gptj, the vector form for the first two and the
    scalar form for the third, with the weight, cache and positions dtypes rotating over them;
    then neox over the whole head in halves (_config.qk_halves) at the first two head sizes that
    allow it, vector and scalar."""
    for dtype in _dtypes.ACTIVATION_DTYPES:
        weights = _weights(dtype)[1:]
        for i, d in enumerate(ds):
            for j, rope in enumerate(("", "neox", "gptj")):
                weight = weights[(i + j) % len(weights)]
                cache = weights[(i + j + 1) % len(weights)]
                positions = ("int32", "int64")[(i + j) % 2]
                spec = _config.qk_spec(d, dtype, weight, j < 2, rope, cache, positions)
                yield Variant("qk", qk_norm.make_qk_norm, spec, qk_norm.argtypes(spec))
        halves = [d for d in ds if _config.qk_halves(d, dtype, "neox", d)][:2]
        for i, d in enumerate(halves):
            spec = _config.qk_spec(d, dtype, weights[i % len(weights)], i == 0, "neox",
                                   weights[(i + 1) % len(weights)], ("int32", "int64")[i % 2],
                                   halves=True)
            yield Variant("qk", qk_norm.make_qk_norm, spec, qk_norm.argtypes(spec))


def variants(vendor="cuda"):
    """Every variant a ``vendor`` ("cuda" or "hip") GPU may launch."""
    yield from fwd_variants(vendor=vendor)
    yield from fused_variants(vendor=vendor)
    yield from bwd_variants(vendor=vendor)
    yield from heads_variants(vendor=vendor)
    yield from gated_variants(vendor=vendor)
    yield from qk_variants(vendor=vendor)
    yield from quant_scaled_variants(vendor=vendor)
