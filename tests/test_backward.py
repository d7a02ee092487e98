"""rms_norm_backward against the float64 reference (docs/api.md's dx/dweight contract), on the CPU
backend over the full matrix and on the simulator over every GPU kernel path."""
import dataclasses

import numpy as np
import pytest

from conftest import (BFLOAT16, DTYPES, FLOAT32, WEIGHT_COMBOS, HostIO, assert_bitwise,
                      assert_dweight, assert_dx, full_tier_except, random_array)
from rmsnorm_hip import _arrays, _cache, functional, rms_norm, rms_norm_backward
from rmsnorm_hip.kernels import _config
from rmsnorm_hip.reference import rms_norm_backward_ref

pytestmark = pytest.mark.quick


def run_case(rng, shape, dtype, wdtype, *, given_rstd=True, dres=False, weight_offset=0.0):
    n = shape[-1]
    x = random_array(rng, shape, dtype)
    dy = random_array(rng, shape, dtype)
    w = None if wdtype is None else random_array(rng, (n,), wdtype, loc=1.0 - weight_offset,
                                                 scale=0.1)
    rstd = rms_norm(x, w, return_rstd=True, weight_offset=weight_offset)[1] if w is not None \
        else rms_norm(x, return_rstd=True)[1]
    dr = random_array(rng, shape, dtype) if dres else None
    dx, dw = rms_norm_backward(dy, x, w, rstd if given_rstd else None,
                               weight_offset=weight_offset, dresidual=dr)
    ref_dx, ref_dw = rms_norm_backward_ref(dy, x, w, rstd if given_rstd else None,
                                           weight_offset=weight_offset, dresidual=dr)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert_dx(dx, dy, x, w, rstd, ref_dx, dtype, weight_offset)
    if w is None:
        assert dw is None
    else:
        assert dw.dtype == w.dtype
        assert_dweight(dw, ref_dw, wdtype)
    return x, dy, w, rstd, dr, dx, dw


@pytest.mark.parametrize("m", [1, 7, 333])
@pytest.mark.parametrize("n", [1, 3, 127, 4097, 5000])
@pytest.mark.parametrize("dtype,wdtype", WEIGHT_COMBOS, ids=lambda v: str(v))
@pytest.mark.parametrize("given_rstd", [True, False], ids=["rstd", "recompute"])
def test_cpu_matrix(rng, m, n, dtype, wdtype, given_rstd):
    run_case(rng, (m, n), dtype, wdtype, given_rstd=given_rstd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dresidual_offset_and_leading_dims(rng, dtype):
    run_case(rng, (3, 5, 256), dtype, dtype, dres=True, weight_offset=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_equal_contiguous(rng, dtype):
    wide_x, wide_dy = random_array(rng, (33, 300), dtype), random_array(rng, (33, 300), dtype)
    x, dy = wide_x[:, 5:261], wide_dy[:, 40:296]
    w = random_array(rng, (256,), dtype, loc=1.0, scale=0.1)
    dx, dw = rms_norm_backward(dy, x, w)
    dx_c, dw_c = rms_norm_backward(np.ascontiguousarray(dy), np.ascontiguousarray(x), w)
    assert_bitwise(dx, dx_c, "strided dx")
    assert_bitwise(dw, dw_c, "strided dweight")


def test_dweight_accuracy_at_65536_rows(rng):
    x = random_array(rng, (65536, 64), FLOAT32)
    dy = random_array(rng, (65536, 64), FLOAT32)
    w = random_array(rng, (64,), FLOAT32, loc=1.0, scale=0.1)
    _, dw = rms_norm_backward(dy, x, w)
    assert_dweight(dw, rms_norm_backward_ref(dy, x, w)[1], FLOAT32)


def test_empty_batch_gives_zero_dweight(rng):
    x = np.empty((0, 64), np.float32)
    dx, dw = rms_norm_backward(x, x, np.ones(64, np.float32))
    assert dx.shape == (0, 64) and dw.shape == (64,) and not dw.any()


def _nan_outputs(monkeypatch):
    """Every output and workspace the library allocates starts as NaN (all-ones bytes are NaN in
    float32, float16 and bfloat16), so an element a kernel does not write shows up."""
    real = _arrays.empty

    def poisoned(like, shape, dtype):
        out, info = real(like, shape, dtype)
        info.host.view(np.uint8)[...] = 0xFF
        return out, info
    monkeypatch.setattr(_arrays, "empty", poisoned)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Launch plans are memoised per call shape in the (process-wide) backend objects: a test
    that patches _config must not leave its kernels to the next test, nor find another's."""
    functional.forget_plans()
    yield
    functional.forget_plans()


def _patch(monkeypatch, name, value):
    """Patch a _config setting and drop the memoised plans, so that the next call builds its
    kernel from the patched setting."""
    monkeypatch.setattr(_config, name, value)
    functional.forget_plans()


def _ran(be):
    """The BwdSpec of the only backward plan the backend holds (the last call's)."""
    specs = {plan[0] for plan in be._bwd_plans.values()}
    assert len(specs) == 1, specs
    return specs.pop()


# simulator: every GPU path, deterministic, batch invariant
# (M, N, dtype, weight dtype, looped): multi-row (ragged), one row per block, the looped layout.
# The looped layout is reached by lowering the register budget, so that a simulated block stays
# small (the real threshold needs rows of more than 16384 elements: 1024-thread blocks).
SIM_CASES = [(5, 127, "bfloat16", "bfloat16", False), (9, 128, "bfloat16", "bfloat16", False),
             (3, 1000, FLOAT32, FLOAT32, False), (3, 1024, "float16", FLOAT32, False),
             (3, 1000, "bfloat16", FLOAT32, True), (3, 999, FLOAT32, FLOAT32, True)]


@pytest.mark.sim
@pytest.mark.parametrize("m,n,dtype,wdtype,looped",
                         full_tier_except(SIM_CASES, lambda case: case[1] <= 128), ids=str)
def test_sim_paths(rng, use_backend, monkeypatch, m, n, dtype, wdtype, looped):
    """Every backward layout; the first call sums dweight with the reduction kernel, the others
    with the simulator's host form of its order (SimBackend.reduce_on_host): the same bits."""
    be = use_backend("sim")
    if looped:
        monkeypatch.setattr(_config, "BWD_MAX_CACHED_FLOATS", 2)
    layout = _config.bwd_row_layout(n, dtype)
    assert layout.cached != looped and (layout.threads > 32) == (n > 256)
    _nan_outputs(monkeypatch)
    monkeypatch.setattr(be, "reduce_on_host", False)
    x, dy, w, rstd, dr, dx, dw = run_case(rng, (m, n), dtype, wdtype, dres=True)
    monkeypatch.setattr(be, "reduce_on_host", True)
    dx2, dw2 = rms_norm_backward(dy, x, w, None, dresidual=dr)   # recompute rstd
    assert_dweight(dw2, rms_norm_backward_ref(dy, x, w, None, dresidual=dr)[1], wdtype)
    again = rms_norm_backward(dy, x, w, rstd, dresidual=dr)
    assert_bitwise(again[0], dx, "dx run to run")
    assert_bitwise(again[1], dw, "dweight run to run")
    alone = rms_norm_backward(dy[m - 1:], x[m - 1:], w, rstd[m - 1:], dresidual=dr[m - 1:])[0]
    assert_bitwise(alone, dx[m - 1:], "dx of a row alone vs in its batch")


# (M, N, dtype, weight dtype): calls whose dweight the kernel's column programs sum
# (_config.bwd_column_dweight): fewer rows than row groups (16-bit); row groups walking up to 3
# rows (a pair of loads, then one alone) with columns past N in the last column program
COLUMN_CASES = [(6, 1024, BFLOAT16, FLOAT32), (70, 520, FLOAT32, FLOAT32)]


@pytest.mark.sim
@pytest.mark.parametrize("m,n,dtype,wdtype", full_tier_except(
    COLUMN_CASES, lambda case: case[0] == 6), ids=str)
def test_sim_column_dweight(rng, use_backend, monkeypatch, m, n, dtype, wdtype):
    """dweight from the kernel's column programs: every element written, within float64's
    tolerance, and the same bits run to run, in the scalar (unaligned) form and over head rows
    (a (T, H, N) view of a wider buffer) as in the vector form; dx as the workspace path's."""
    be = use_backend("sim")
    _nan_outputs(monkeypatch)
    x, dy = random_array(rng, (m, n), dtype), random_array(rng, (m, n), dtype)
    w = random_array(rng, (n,), wdtype, loc=1.0, scale=0.1)
    rstd = rms_norm(x, w, return_rstd=True)[1]

    def unaligned(a):
        return np.concatenate([a[:, :1], a], axis=1)[:, 1:]

    def head_rows(a):     # row r = 2t + h: (T, 2, N) heads of a wider buffer, two strides
        pairs = a.reshape(m // 2, 2 * n)
        return np.concatenate([pairs, pairs[:, :8]], axis=1)[:, :2 * n].reshape(m // 2, 2, n)

    outs = {}
    for form, (dyf, xf) in {"vector": (dy, x), "scalar": (unaligned(dy), unaligned(x)),
                            "heads": (head_rows(dy), head_rows(x))}.items():
        functional.forget_plans()
        outs[form] = rms_norm_backward(dyf, xf, w, rstd.reshape(-1))
        spec = _ran(be)
        assert spec.column_dweight and spec.heads == (form == "heads"), (form, spec)
        assert spec.vector == (form != "scalar"), (form, spec)
    dx, dw = outs["vector"]
    ref = rms_norm_backward_ref(dy, x, w, rstd)
    assert_dx(dx, dy, x, w, rstd, ref[0], dtype)
    assert_dweight(dw, ref[1], wdtype)
    for form, (dxf, dwf) in outs.items():
        assert_bitwise(dxf.reshape(m, n), dx, f"dx, {form} vs vector")
        assert_bitwise(dwf, dw, f"dweight, {form} vs vector")
    assert_bitwise(rms_norm_backward(dy, x, w, rstd)[1], dw, "dweight run to run")
    monkeypatch.setitem(_config.BWD_COLUMN_DWEIGHT_MAX_ROWS, "cuda", 0)
    functional.forget_plans()
    dx_ws, dw_ws = rms_norm_backward(dy, x, w, rstd)
    assert not _ran(be).column_dweight
    assert_bitwise(dx_ws, dx, "dx, workspace path vs column programs")
    assert_dweight(dw_ws, ref[1], wdtype)


@pytest.mark.parametrize("backend_name", ["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def test_deterministic_dweight(rng, use_backend, backend_name):
    use_backend(backend_name)
    m = 300 if backend_name == "cpu" else 9
    x, dy = random_array(rng, (m, 64), "bfloat16"), random_array(rng, (m, 64), "bfloat16")
    w = random_array(rng, (64,), FLOAT32, loc=1.0, scale=0.1)
    runs = [rms_norm_backward(dy, x, w) for _ in range(3)]
    for dx, dw in runs[1:]:
        assert_bitwise(dx, runs[0][0], "dx")
        assert_bitwise(dw, runs[0][1], "dweight")


BAD = [
    (lambda x, w, r: dict(dy=x[:, :-1], x=x), ValueError,
     r"rms_norm_backward: dy must have x's shape"),
    (lambda x, w, r: dict(dy=x.astype(np.float16), x=x), TypeError,
     r"rms_norm_backward: dy must have x's dtype float32, got float16"),
    (lambda x, w, r: dict(dy=x, x=x, rstd=r[:-1]), ValueError,
     r"rms_norm_backward: rstd must have shape \(4,\), got \(3,\)"),
    (lambda x, w, r: dict(dy=x, x=x, rstd=r.astype(np.float16)), TypeError,
     r"rms_norm_backward: rstd must have dtype float32"),
    (lambda x, w, r: dict(dy=x, x=x, dresidual=x[:2]), ValueError,
     r"rms_norm_backward: dresidual must have x's shape"),
    (lambda x, w, r: dict(dy=x, x=x, weight_offset=1.0), ValueError,
     r"rms_norm_backward: weight_offset must be 0.0 when weight is None, got 1.0"),
    (lambda x, w, r: dict(dy=x, x=x, weight=w, deterministic="yes"), TypeError,
     r"rms_norm_backward: deterministic must be a bool, got str"),
    (lambda x, w, r: dict(dy=x, x=x.astype(np.float64)), TypeError,
     r"rms_norm_backward: x must have dtype float32, float16 or bfloat16, got float64"),
]


@pytest.mark.parametrize("make,error,match", BAD, ids=range(len(BAD)))
def test_errors(rng, make, error, match):
    x = random_array(rng, (4, 16), FLOAT32)
    w = random_array(rng, (16,), FLOAT32)
    r = np.ones(4, np.float32)
    kwargs = make(x, w, r)
    before = x.copy()
    with pytest.raises(error, match=match):
        rms_norm_backward(**kwargs)
    assert_bitwise(x, before, "x after a rejected call")


@pytest.mark.sim
@pytest.mark.full
@pytest.mark.parametrize("dtype,weight", [
    ("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float32")])
def test_sim_weight_loaded_per_chunk_gives_the_held_bits(rng, use_backend, monkeypatch, dtype,
                                                         weight):
    """Cached rows that load their weight with each chunk (BwdSpec.hold_weight False: the
    unpacked 1024-thread dresidual rows) run the same float32 operations as rows holding it;
    with and without dresidual, through several rows a program (7 rows, 2 programs).  (Packed
    rows of two chunks: test_sim_two_chunk_rows_keep_words_in_both_forms.)"""
    be = use_backend("sim")
    # rows one element off 16 bytes: the scalar (unpacked) kernel of one chunk a thread
    x, dy, dres = (np.concatenate([a, a[:, :1]], axis=1)[:, 1:]
                   for a in (random_array(rng, (7, 1024), dtype) for _ in range(3)))
    w = random_array(rng, (1024,), weight, loc=1.0, scale=0.1)
    rstd = rms_norm(x, w, return_rstd=True)[1]
    for dresidual in (dres, None):
        held = rms_norm_backward(dy, x, w, rstd, dresidual=dresidual)
        assert _ran(be).hold_weight and not _ran(be).vector
        real = _config.bwd_spec
        monkeypatch.setattr(_config, "bwd_spec", lambda *a, **k: dataclasses.replace(
            real(*a, **k), hold_weight=False))
        functional.forget_plans()
        loaded = rms_norm_backward(dy, x, w, rstd, dresidual=dresidual)
        assert not _ran(be).hold_weight
        assert_bitwise(held[0], loaded[0], "dx, weight held vs loaded per chunk")
        assert_bitwise(held[1], loaded[1], "dweight, weight held vs loaded per chunk")
        ref = rms_norm_backward_ref(dy, x, w, rstd, dresidual=dresidual)
        assert_dweight(loaded[1], ref[1], weight)
        monkeypatch.setattr(_config, "bwd_spec", real)
        functional.forget_plans()


# (dtype, N, vendor, threads, chunks a thread, loads ahead): rows of one chunk a thread, of two
# in 512-thread blocks of 128 registers (CUDA's N = 8192 16-bit and N = 4096 float32: the next
# row and dresidual loaded ahead, the weight held), and of two in 1024-thread blocks of 64
# registers (neither; 16-bit rows load their weight per chunk)
LAYOUT_FORMS = [("bfloat16", 4096, "cuda", 512, 1, True),
                ("bfloat16", 6144, "cuda", 768, 1, True),
                ("bfloat16", 8192, "cuda", 512, 2, True), ("float32", 4096, "cuda", 512, 2, True),
                ("bfloat16", 8192, "hip", 1024, 1, True), ("float32", 4096, "hip", 1024, 1, True),
                ("float32", 8192, "cuda", 1024, 2, False),
                ("bfloat16", 16384, "cuda", 1024, 2, False),
                ("float16", 12000, "cuda", 1024, 2, False),
                ("float16", 12000, "hip", 1024, 2, False)]


@pytest.mark.parametrize("dtype,n,vendor,threads,chunks,ahead", LAYOUT_FORMS, ids=str)
def test_loads_ahead_and_held_weight_only_where_they_fit(dtype, n, vendor, threads, chunks,
                                                         ahead):
    """The next row's words and dresidual's are loaded ahead of a row's reduction, and a 16-bit
    weight is held for the program, only where ptxas fits them (a thread's 64 registers per
    1024 threads of rows an SM holds); 16-bit rows of two chunks keep words in the scalar form
    too, and unpacked 1024-thread dresidual rows load their weight per chunk."""
    sixteen = dtype != FLOAT32
    layout = _config.bwd_row_layout(n, dtype, vendor)
    assert (layout.threads, layout.chunks_per_thread, layout.cached) == (threads, chunks, True)
    blocks = _config.bwd_blocks_per_sm(layout)
    assert blocks == (2 if threads * chunks <= 512 else 1)
    # AMD keeps its backend's estimate: the blocks a CU's 2048 threads hold, at most two
    programs = 132 * (blocks if vendor == "cuda" else 2)
    # 16-bit rows of one chunk, two blocks an SM, run two to a block on CUDA (BWD_PAIRED_ROWS)
    paired = vendor == "cuda" and sixteen and chunks == 1 and blocks == 2
    assert _config.bwd_partial_order(
        _config.bwd_spec(n, dtype, dtype, True, False, False, vendor), 1 << 20, 132,
        vendor) == (programs, 2 if paired else 1)
    for dres in (False, True):
        packed = _config.bwd_spec(n, dtype, dtype, True, False, dres, vendor)
        assert packed.layout == layout and packed.packed and packed.paired == paired
        assert _config.launch_bounds(packed) == ((2 * threads, None) if paired else
                                                 (threads, blocks if blocks > 1 else None))
        assert packed.prefetch == ahead and packed.early_dres == (dres and ahead)
        assert packed.hold_weight == (ahead or not sixteen)
        both = _config.bwd_spec(n, dtype, dtype, True, True, dres, vendor)
        assert both.prefetch == (ahead and not dres)
        scalar = _config.bwd_spec(n, dtype, dtype, False, False, dres, vendor)
        assert scalar.layout == layout and not scalar.paired and scalar.pair_twin == paired
        # the twin's grid and reduction are the pair's; its kernel is the unpaired scalar one
        unpaired = _config.bwd_spec(n, dtype, dtype, False, False, dres, vendor, pair=False)
        assert not unpaired.pair_twin
        assert _config.bwd_kernel_spec(scalar) == unpaired
        assert scalar.packed == (sixteen and chunks == 2)
        assert scalar.prefetch == (scalar.packed and ahead)
        if scalar.packed:
            assert scalar.hold_weight == ahead
        else:
            assert scalar.hold_weight == (not dres or threads < 1024)


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_programs_do_not_depend_on_the_variant(vendor):
    """dweight sums one partial row per program (or per pair of rows, paired), so every variant
    of a call shape (vector or scalar, rstd given or not, with or without dresidual) walks its
    rows in as many partial rows, summed alike: a row-strided call then gives bitwise its
    contiguous copy's dweight (docs/api.md)."""
    from rmsnorm_hip.kernels import catalog
    programs = {}
    for variant in catalog.bwd_variants(vendor=vendor):
        if variant.op != "bwd":
            continue
        spec = variant.spec
        for m in (1, 7, 131, 133, 263, 264, 333, 4096, 1 << 20):
            # the kernel a call of m rows takes (GpuBackend._bwd_key): paired, hinted or not by M
            call = _config.bwd_spec(spec.layout.n, spec.dtype, spec.weight, spec.vector,
                                    spec.recompute_rstd, spec.dresidual, vendor,
                                    _config.bwd_pair_rows(m, 132, vendor),
                                    _config.bwd_stream_rows(m, spec.layout.n, spec.dtype, vendor))
            got = _config.bwd_partial_order(call, m, 132, vendor)
            key = (spec.layout.n, spec.dtype, bool(spec.weight), m)
            assert programs.setdefault(key, got) == got, call
    cuda = vendor == "cuda"
    assert programs[8192, "bfloat16", True, 4096] == ((132, 1) if cuda else (264, 1))
    # CUDA balances grids of at most 16 row blocks a program (bwd_programs), and pairs 16-bit
    # rows of 512 threads (BWD_PAIRED_ROWS): 128 programs of two rows
    assert programs[4096, "bfloat16", True, 4096] == ((256, 2) if cuda else (264, 1))
    assert programs[4096, "bfloat16", True, 263] == (263, 1)   # under 2 rows per SM
    assert programs[4096, "bfloat16", True, 264] == ((264, 2) if cuda else (264, 1))
    assert programs[4096, "bfloat16", True, 7] == (7, 1)     # few rows: not paired
    assert programs[4096, "bfloat16", False, 4096] == ((256, 1) if cuda else (264, 1))


@pytest.mark.parametrize("m", [1, 7, 100, 263, 264, 265, 333, 1024, 2048, 4095, 4096, 4097,
                               4224, 4225, 8192, 1 << 20])
@pytest.mark.parametrize("n,dtype", [(4096, "bfloat16"), (8192, "bfloat16"), (127, FLOAT32)])
def test_balanced_grid_keeps_the_busiest_program(monkeypatch, m, n, dtype):
    """Where the busiest program walks at most BWD_BALANCE_MAX_STEPS row blocks, the grid is the
    fewest programs that walk no more; elsewhere as many as fit."""
    spec = _config.bwd_spec(n, dtype, dtype, True, False, False)
    balanced = _config.bwd_programs(spec, m, 132)
    limit = _config.BWD_BALANCE_MAX_STEPS["cuda"]
    monkeypatch.setitem(_config.BWD_BALANCE_MAX_STEPS, "cuda", 0)
    fit = _config.bwd_programs(spec, m, 132)
    blocks = -(-m // spec.rows)
    steps = -(-blocks // fit)
    assert 1 <= balanced <= fit <= blocks
    assert -(-blocks // balanced) == steps                      # the same critical path
    if steps <= limit:
        assert balanced == 1 or -(-blocks // (balanced - 1)) > steps     # and no fewer fit
    else:
        assert balanced == fit


@pytest.mark.sim
def test_sim_grid_ignores_the_kernels_occupancy(use_backend, monkeypatch):
    """The backend sizes the backward grid without asking how many blocks of the variant fit: a
    scalar kernel that fits fewer than its vector twin (more registers) still runs as many
    programs, so a row-strided call sums dweight's partial rows as its contiguous copy does (a
    paired vector kernel's scalar twin: twice the programs, partial rows reduced by pairs)."""
    be = use_backend("sim")
    fits = iter(range(1, 1000))
    monkeypatch.setattr(be, "resident_per_sm", lambda kernel, threads: next(fits))
    functional.forget_plans()
    for n, dtype in ((1000, FLOAT32), (4096, "bfloat16")):
        orders = set()
        for vector in (True, False):
            key = (n, dtype, dtype, vector, False, False)
            _, grid, block, _, _, _, ws_rows, _ = be._bwd_launch_shape(key, 333)
            walkers = grid[0] * block[1]          # programs x rows a block
            # the reduction sums partial rows by pairs
            pairs = be._bwd_plans[be._bwd_key(key, 333)][3].pairs
            orders.add((walkers, walkers // ws_rows * (2 if pairs else 1)))
        assert len(orders) == 1, orders
    functional.forget_plans()


@pytest.mark.sim
@pytest.mark.full
@pytest.mark.parametrize("dtype,weight,n", [("bfloat16", "bfloat16", 1000),
                                            ("float16", FLOAT32, 1000),
                                            ("bfloat16", FLOAT32, 1021)], ids=str)
def test_sim_two_chunk_rows_keep_words_in_both_forms(rng, use_backend, monkeypatch, dtype,
                                                     weight, n):
    """16-bit rows of two chunks a thread keep x and dy as words in the vector form and in the
    scalar (unaligned) one, which reads them an element at a time.  Two forms of such rows ship:
    N = 8192 on CUDA (512 threads with 128 registers: the next row's words and dresidual's loaded
    ahead, the weight held) and N = 16384 (1024 threads with 64: none of these, the weight loaded
    with each chunk).  Here both run shrunk to 64 threads at N = 1000: aligned and unaligned
    rows and the two forms give the same bits, which match float64; with dresidual and with
    rstd recomputed.  N = 1021 ends in a partial chunk: both of its forms are scalar."""
    be = use_backend("sim")
    monkeypatch.setattr(_config, "bwd_row_layout", lambda n, dt, vendor="cuda": _config._layout(
        n, dt, 2, _config.BWD_MAX_CACHED_FLOATS, 64))
    real = _config.bwd_spec

    def lean(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), prefetch=False, early_dres=False,
                                   prefetch_rstd=False, hold_weight=False, early_dweight=False)

    m = 7
    # each array twice: rows at 16-byte offsets (vector) and one element off them (scalar)
    pairs = []
    for _ in range(3):
        a = random_array(rng, (m, n), dtype)
        wide = np.concatenate([a[:, :1], a], axis=1)
        pairs.append((a, wide[:, 1:]))
    (x, xs), (dy, dys), (dres, dress) = pairs
    w = random_array(rng, (n,), weight, loc=1.0, scale=0.1)
    rstd = rms_norm(x, w, return_rstd=True)[1]
    for dresidual, dresidual_s in ((None, None), (dres, dress)):
        for r in (rstd, None):
            outs = {}
            for form in ("ahead", "lean"):
                monkeypatch.setattr(_config, "bwd_spec", real if form == "ahead" else lean)
                for vector, args in ((True, (dy, x, dresidual)), (False, (dys, xs, dresidual_s))):
                    functional.forget_plans()
                    outs[form, vector] = rms_norm_backward(args[0], args[1], w, r,
                                                           dresidual=args[2])
                    spec = _ran(be)
                    assert spec.vector == (vector and n % 8 == 0) and spec.packed
                    assert spec.layout.threads == 64 and spec.layout.chunks_per_thread == 2
                    ahead = form == "ahead"
                    assert spec.hold_weight == ahead
                    assert spec.prefetch == (ahead and not (r is None and dresidual is not None))
                    assert spec.early_dres == (ahead and dresidual is not None)
                    assert spec.early_dweight == (ahead and r is not None and dresidual is None)
            first = outs["ahead", True]
            for key, out in outs.items():
                assert_bitwise(out[0], first[0], f"dx, {key} vs ('ahead', True)")
                assert_bitwise(out[1], first[1], f"dweight, {key} vs ('ahead', True)")
            ref = rms_norm_backward_ref(dy, x, w, r, dresidual=dresidual)
            assert_dx(first[0], dy, x, w, rstd, ref[0], dtype)
            assert_dweight(first[1], ref[1], weight)
    monkeypatch.setattr(_config, "bwd_spec", real)
    functional.forget_plans()


@pytest.mark.sim
@pytest.mark.parametrize("m,n,dtype,wdtype,sms", full_tier_except(
    [(21, 128, BFLOAT16, BFLOAT16, 2), (9, 1000, FLOAT32, FLOAT32, 3),
     (3, 8192, "float16", FLOAT32, 2), (1, 1000, BFLOAT16, FLOAT32, 2)],
    lambda case: case[1] <= 128), ids=str)
def test_sim_early_dweight_gives_the_late_bits(rng, use_backend, monkeypatch, m, n, dtype, wdtype,
                                               sms):
    """Rows with the next row's rstd take the dweight partial's fma in pass 1 and store the
    partial row with the last row's pass 1 (BwdSpec.early_dweight) or in pass 2 and after the
    last row: the same bits, the float64 contract, every output and workspace row written
    (poisoned).  Multi-row blocks of several row blocks a program (ragged: rows past M), two-chunk
    rows (N = 8192), one row; deterministic=False's atomic adds too."""
    be = use_backend("sim")
    # the workspace path (the column programs take such calls by default)
    monkeypatch.setitem(_config.BWD_COLUMN_DWEIGHT_MAX_ROWS, "cuda", 0)
    monkeypatch.setattr(be, "sm_count", sms)
    _nan_outputs(monkeypatch)
    x, dy = random_array(rng, (m, n), dtype), random_array(rng, (m, n), dtype)
    w = random_array(rng, (n,), wdtype, loc=1.0, scale=0.1)
    rstd = rms_norm(x, w, return_rstd=True)[1]
    _patch(monkeypatch, "BWD_EARLY_DWEIGHT", {"cuda": True, "hip": False})
    early = rms_norm_backward(dy, x, w, rstd)
    assert _ran(be).early_dweight
    ref = rms_norm_backward_ref(dy, x, w, rstd)
    assert_dx(early[0], dy, x, w, rstd, ref[0], dtype)
    assert_dweight(early[1], ref[1], wdtype)
    early_nd = rms_norm_backward(dy, x, w, rstd, deterministic=False)
    # rstd recomputed, dresidual: no rstd before the reduction (none, or not loaded ahead)
    assert not _config.bwd_spec(n, dtype, wdtype, True, True, False).early_dweight
    assert not _config.bwd_spec(n, dtype, wdtype, True, False, True).early_dweight
    assert not _config.bwd_spec(n, dtype, wdtype, True, False, False, "hip").early_dweight
    _patch(monkeypatch, "BWD_EARLY_DWEIGHT", {"cuda": False, "hip": False})
    late = rms_norm_backward(dy, x, w, rstd)
    assert not _ran(be).early_dweight
    late_nd = rms_norm_backward(dy, x, w, rstd, deterministic=False)
    assert_bitwise(early[0], late[0], "dx, early vs late dweight partial")
    assert_bitwise(early[1], late[1], "dweight, early vs late dweight partial")
    assert_bitwise(early_nd[0], late_nd[0], "dx, deterministic=False")
    if wdtype == FLOAT32 and n % 4 == 0:    # atomics: another order, the contract
        assert_dweight(early_nd[1], ref[1], wdtype)
    else:
        assert_bitwise(early_nd[1], late_nd[1], "dweight, deterministic=False")


@pytest.mark.sim
@pytest.mark.parametrize("dtype,dres", full_tier_except([("bfloat16", True), ("float16", False)],
                                                        lambda case: case[1]))
def test_sim_stream_loads_give_the_plain_bits(rng, use_backend, monkeypatch, dtype, dres):
    """Calls of few bytes load x, dy and dresidual evict-first (BwdSpec.stream_loads,
    _config.bwd_stream_rows; 16-bit packed rows): where the lines go changes, not what is read,
    so the same bits as the plain kernel, and the float64 contract.  (The workspace path: the
    column programs would count their loads too.)"""
    be = use_backend("sim")
    monkeypatch.setitem(_config.BWD_COLUMN_DWEIGHT_MAX_ROWS, "cuda", 0)
    x, dy, dr = (random_array(rng, (5, 1024), dtype) for _ in range(3))
    dr = dr if dres else None
    w = random_array(rng, (1024,), dtype, loc=1.0, scale=0.1)
    rstd = rms_norm(x, w, return_rstd=True)[1]
    assert _config.bwd_stream_rows(5, 1024, dtype)       # the simulator takes CUDA's choices
    # the simulator's hinted load is the plain one: count its calls to see the kernel take it
    intr, calls = be.intrinsics, []
    plain_load = intr.load_b128

    def counted(ptr, idx):
        calls.append(idx)
        return plain_load(ptr, idx)

    monkeypatch.setattr(intr, "load_b128_stream", counted)
    monkeypatch.setattr(_cache, "_kernels", {})     # kernels built now, with the counted load
    hinted = rms_norm_backward(dy, x, w, rstd, dresidual=dr)
    assert _ran(be).stream_loads
    # x and dy (and dresidual) of each of the 5 rows, one 128-bit load per thread's chunk
    assert len(calls) == (3 if dres else 2) * 5 * 1024 // 8, len(calls)
    ref = rms_norm_backward_ref(dy, x, w, rstd, dresidual=dr)
    assert_dx(hinted[0], dy, x, w, rstd, ref[0], dtype)
    assert_dweight(hinted[1], ref[1], dtype)
    # one byte over the limit: the plain kernel
    _patch(monkeypatch, "BWD_STREAM_MAX_BYTES", x.nbytes - 1)
    calls.clear()
    plain = rms_norm_backward(dy, x, w, rstd, dresidual=dr)
    assert not _ran(be).stream_loads and not calls
    assert_bitwise(plain[0], hinted[0], "dx, evict-first loads vs plain")
    assert_bitwise(plain[1], hinted[1], "dweight, evict-first loads vs plain")
    # scalar (row-strided) calls, float32 and looped rows never take it
    assert not _config.bwd_spec(1024, dtype, dtype, False, False, dres, stream=True).stream_loads
    assert not _config.bwd_spec(1024, FLOAT32, FLOAT32, True, False, dres,
                                stream=True).stream_loads
    assert not _config.bwd_spec(65536, dtype, dtype, True, False, dres, stream=True).stream_loads
    assert not _config.bwd_spec(1024, dtype, dtype, True, False, dres, "hip",
                                stream=True).stream_loads


@pytest.mark.sim
@pytest.mark.parametrize("weight,given_rstd,dres", [(BFLOAT16, True, True), (None, False, False)])
def test_sim_backward_runner_gives_the_validated_bits(rng, use_backend, weight, given_rstd, dres):
    """The backward's repeat-call runner (GpuBackend.bwd_runner) run by the simulator: the bits
    of the validated call.  N = 127 is ragged, so the runner takes the scalar kernel without
    reading pointer alignment."""
    be = use_backend("sim")
    m, n = 5, 127
    x, dy = random_array(rng, (m, n), BFLOAT16), random_array(rng, (m, n), BFLOAT16)
    w = None if weight is None else random_array(rng, (n,), weight, loc=1.0, scale=0.1)
    rstd = rms_norm(x, None, 1e-6, return_rstd=True)[1] if given_rstd else None
    dr = random_array(rng, (m, n), BFLOAT16) if dres else None
    expected = rms_norm_backward(dy, x, w, rstd, dresidual=dr)
    run = be.bwd_runner(HostIO(), (m, n), m, n, (n, n, n, n), BFLOAT16, weight or "",
                        given_rstd, dres)
    got = run(dy, x, w, rstd, dr, 1e-6, 0.0)
    assert_bitwise(got[0], expected[0], "dx")
    if w is None:
        assert got[1] is None
    else:
        assert_bitwise(got[1], expected[1], "dweight")


def _reduce_in_order(ws, groups):
    """dweight_reduce's documented order in float32: rows g, g + groups, ... one after the other
    within each group, then the group sums in group order."""
    total = np.zeros(ws.shape[1], np.float32)
    for g in range(groups):
        part = np.zeros(ws.shape[1], np.float32)
        for row in ws[g::groups]:
            part = (part + row).astype(np.float32)
        total = (total + part).astype(np.float32)
    return total


@pytest.mark.sim
@pytest.mark.parametrize("wdtype", [FLOAT32, BFLOAT16])
@pytest.mark.parametrize("ws_rows", [1, 2, 5, 11, 14])
@pytest.mark.parametrize("pairs", [False, True])
def test_sim_dweight_reduce_keeps_its_order(rng, use_backend, wdtype, ws_rows, pairs):
    """The reduction's batched loads (the last batch short, its missing rows +0.0) add in the
    documented order: its bits equal a one-at-a-time float32 sum, every column of dweight
    written; with ``pairs`` over the sums of workspace rows 2q and 2q + 1."""
    import ml_dtypes

    from rmsnorm_hip import _dtypes
    from rmsnorm_hip.kernels import rmsnorm_bwd
    be = use_backend("sim")
    spec = _config.ReduceSpec(weight=wdtype, columns=4, groups=3, batch=2, pairs=pairs)
    kernel = be.kernel(rmsnorm_bwd.make_dweight_reduce, spec, rmsnorm_bwd.reduce_argtypes(spec))
    n = 10                                   # three blocks of 4 columns, the last one partial
    rows = ws_rows * (2 if pairs else 1)
    ws = rng.standard_normal((rows, n)).astype(np.float32) * np.float32(1e3)
    dweight = np.full(n, 0xFFFF if wdtype == BFLOAT16 else np.nan, _dtypes.STORAGE[wdtype])
    kernel[(3, 1, 1), (4, 3, 1)](ws.reshape(-1), dweight, rows, n)
    expect = _reduce_in_order(ws[0::2] + ws[1::2] if pairs else ws, spec.groups)
    if wdtype == BFLOAT16:
        expect = expect.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert_bitwise(dweight, expect, f"dweight of {ws_rows} workspace rows")


@pytest.mark.sim
@pytest.mark.full
@pytest.mark.parametrize("n,wdtype,given_rstd,dres", [(4096, BFLOAT16, True, False),
                                                      (4000, FLOAT32, False, False),
                                                      (4000, FLOAT32, True, True)],
                         ids=["rstd", "recompute", "dresidual"])
def test_sim_paired_rows(rng, use_backend, monkeypatch, n, wdtype, given_rstd, dres):
    """Two 512-thread rows a block at their own barriers, their dweight partials summed into one
    workspace row (BWD_PAIRED_ROWS): dx bitwise the unpaired kernel's, dweight against float64,
    every workspace and output element written, and a row-strided call (the scalar twin: twice
    the programs, partial rows reduced pairwise) bitwise the contiguous one.  On a simulated GPU
    of 2 SMs, 13 rows are 7 row blocks of 2 on 2 programs (4 and 3 blocks, the last one half past
    M), and the twin runs 4 programs.  A float32 weight keeps dweight's summation order visible
    (a bf16 dweight's rounding can hide it)."""
    be = use_backend("sim")
    # the workspace path (the column programs take such calls by default)
    monkeypatch.setitem(_config.BWD_COLUMN_DWEIGHT_MAX_ROWS, "cuda", 0)
    monkeypatch.setattr(be, "sm_count", 2)
    _nan_outputs(monkeypatch)
    _patch(monkeypatch, "BWD_PAIRED_ROWS", {"cuda": True, "hip": False})
    x, dy, w, rstd, dr, dx, dw = run_case(rng, (13, n), BFLOAT16, wdtype,
                                          given_rstd=given_rstd, dres=dres)
    spec = _ran(be)
    assert spec.paired and spec.rows == 2
    assert be._bwd_launch_shape((n, BFLOAT16, wdtype, True, not given_rstd, dres), 13)[1] \
        == (2, 1, 1)
    # a row-strided copy one element off 16 bytes takes the scalar kernel, one row a block,
    # standing in for the pair: the same bits
    functional.forget_plans()
    wide = [np.empty((13, n + 1), a.dtype) for a in (x, dy)]
    for out, a in zip(wide, (x, dy)):
        out[:, 1:] = a
    dr_wide = None
    if dr is not None:
        dr_wide = np.empty((13, n + 1), dr.dtype)
        dr_wide[:, 1:] = dr
        dr_wide = dr_wide[:, 1:]
    strided = rms_norm_backward(wide[1][:, 1:], wide[0][:, 1:], w, rstd if given_rstd else None,
                                dresidual=dr_wide)
    twin = _ran(be)
    assert twin.pair_twin and not twin.vector and twin.rows == 1
    assert be._bwd_launch_shape((n, BFLOAT16, wdtype, False, not given_rstd, dres), 13)[1] \
        == (4, 1, 1)
    assert_bitwise(strided[0], dx, "dx, row-strided vs contiguous")
    assert_bitwise(strided[1], dw, "dweight, row-strided vs contiguous")
    _patch(monkeypatch, "BWD_PAIRED_ROWS", {"cuda": False, "hip": False})
    plain = rms_norm_backward(dy, x, w, rstd if given_rstd else None, dresidual=dr)
    assert not _ran(be).paired
    assert_bitwise(dx, plain[0], "dx, paired vs not")


@pytest.mark.sim
@pytest.mark.parametrize("m,n,dtype,wdtype,sms", full_tier_except(
    [(9, 128, BFLOAT16, FLOAT32, 4), (13, 4096, BFLOAT16, FLOAT32, 2),
     (5, 1000, FLOAT32, FLOAT32, 4), (7, 1000, "float16", "float16", 4)],
    lambda case: case[1] <= 128), ids=str)
def test_sim_atomic_dweight(rng, use_backend, monkeypatch, m, n, dtype, wdtype, sms):
    """deterministic=False: a float32 weight's dweight summed by atomics into a zeroed dweight,
    no reduction kernel (_config.bwd_atomic_dweight), on multi-row, one-row and paired (N = 4096)
    blocks; dx bitwise the deterministic call's, dweight against float64, every output written
    (poisoned).  A 16-bit weight, and unaligned rows, keep the deterministic kernels."""
    be = use_backend("sim")
    monkeypatch.setattr(be, "sm_count", sms)
    _nan_outputs(monkeypatch)
    _patch(monkeypatch, "BWD_PAIRED_ROWS", {"cuda": True, "hip": False})
    x = random_array(rng, (m, n), dtype)
    dy = random_array(rng, (m, n), dtype)
    w = random_array(rng, (n,), wdtype, loc=1.0, scale=0.1)
    rstd = rms_norm(x, w, return_rstd=True)[1]
    dx, dw = rms_norm_backward(dy, x, w, rstd)
    assert not _ran(be).atomic_dweight
    functional.forget_plans()
    adx, adw = rms_norm_backward(dy, x, w, rstd, deterministic=False)
    atomic = wdtype == FLOAT32
    spec = _ran(be)
    assert spec.atomic_dweight == atomic and spec.paired == (n == 4096)
    plan = next(iter(be._bwd_plans.values()))
    assert (plan[2] is None) == atomic                  # no reduction kernel
    assert_bitwise(adx, dx, "dx, deterministic=False vs True")
    assert adw.dtype == dw.dtype
    assert_dweight(adw, rms_norm_backward_ref(dy, x, w, rstd)[1], wdtype)
    if not atomic:
        assert_bitwise(adw, dw, "a 16-bit dweight, deterministic=False")
    # unaligned rows (the scalar kernel) stay deterministic
    functional.forget_plans()
    wide = [np.empty((m, n + 1), a.dtype) for a in (x, dy)]
    for out, a in zip(wide, (x, dy)):
        out[:, 1:] = a
    sdx, sdw = rms_norm_backward(wide[1][:, 1:], wide[0][:, 1:], w, rstd, deterministic=False)
    assert not _ran(be).atomic_dweight
    assert_bitwise(sdx, dx, "dx, unaligned rows")


def test_atomic_dweight_where_measured():
    """_config.bwd_atomic_dweight on an H200 (132 SMs): float32 weights on CUDA, few partial
    floats or many rows a program; not 16-bit weights, unaligned rows or AMD."""
    def takes(m, n, dtype=BFLOAT16, weight=FLOAT32, vendor="cuda", vector=True):
        spec = _config.bwd_spec(n, dtype, weight, vector, False, False, vendor,
                                _config.bwd_pair_rows(m, 132, vendor),
                                _config.bwd_stream_rows(m, n, dtype, vendor))
        return _config.bwd_atomic_dweight(spec, m, _config.bwd_programs(spec, m, 132, vendor),
                                          vendor)
    assert takes(1, 4096) and takes(8, 4096) and takes(16, 4096) and takes(1, 8192)
    assert takes(8192, 4096) and takes(32768, 4096) and takes(16384, 8192)
    assert takes(8, 4096, FLOAT32) and takes(16384, 4096, FLOAT32)
    assert not (takes(32, 4096) or takes(132, 4096) or takes(264, 4096) or takes(1024, 8192)
                or takes(4096, 4096) or takes(32, 8192))
    assert not (takes(8, 4096, weight=BFLOAT16) or takes(32768, 4096, weight=BFLOAT16))
    assert not (takes(8, 4096, vendor="hip") or takes(8, 4096, vector=False))


@pytest.mark.sim
@pytest.mark.parametrize("n,dtype,wdtype,aligned,given_rstd,dres",
                         [(1000, BFLOAT16, BFLOAT16, True, True, False),
                          (1000, BFLOAT16, FLOAT32, False, False, True)], ids=str)
def test_sim_direct_dweight(rng, use_backend, monkeypatch, n, dtype, wdtype, aligned, given_rstd,
                            dres):
    """One row (M = 1): the backward kernel writes dweight itself and no reduction kernel runs
    (_config.bwd_direct_dweight; a 16-bit weight's encoded in the kernel, BwdSpec.direct_dweight),
    on aligned and unaligned rows; dx and dweight bitwise the workspace path's, against float64,
    every output written (poisoned); deterministic=False takes it too, not atomics."""
    be = use_backend("sim")
    _nan_outputs(monkeypatch)
    skip = 0 if aligned else 1        # one element in: rows off 16-byte alignment (scalar kernel)
    x, dy, dr = (random_array(rng, (1, n + skip), dtype)[:, skip:] for _ in range(3))
    dr = dr if dres else None
    w = random_array(rng, (n,), wdtype, loc=1.0, scale=0.1)
    rstd = rms_norm(x, w, return_rstd=True)[1]
    given = rstd if given_rstd else None
    functional.forget_plans()
    dx, dw = rms_norm_backward(dy, x, w, given, dresidual=dr)
    spec, plan = _ran(be), next(iter(be._bwd_plans.values()))
    assert plan[2] is None and spec.vector == aligned
    assert spec.direct_dweight == (wdtype != FLOAT32)
    ref_dx, ref_dw = rms_norm_backward_ref(dy, x, w, given, dresidual=dr)
    assert_dx(dx, dy, x, w, rstd, ref_dx, dtype, 0.0)
    assert_dweight(dw, ref_dw, wdtype)
    functional.forget_plans()
    ndx, ndw = rms_norm_backward(dy, x, w, given, dresidual=dr, deterministic=False)
    assert not _ran(be).atomic_dweight and next(iter(be._bwd_plans.values()))[2] is None
    assert_bitwise(ndw, dw, "dweight, deterministic=False")
    # the workspace and the reduction kernel: the same bits
    monkeypatch.setattr(_config, "bwd_direct_dweight", lambda spec, m: False)
    functional.forget_plans()
    wdx, wdw = rms_norm_backward(dy, x, w, given, dresidual=dr)
    assert next(iter(be._bwd_plans.values()))[2] is not None
    assert_bitwise(wdx, dx, "dx, direct vs workspace")
    assert_bitwise(wdw, dw, "dweight, direct vs workspace")
