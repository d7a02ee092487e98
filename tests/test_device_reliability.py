"""Issue 8 on a real NVIDIA GPU (mark ``device``): guard bands and poisoned outputs for every entry
point and workspace, a tensor of more than 2**31 elements, rows of N = 1,048,576, >= 500
hypothesis examples through torch and CuPy arrays, and 8 host threads on 8 streams.

    NUMBA_ENABLE_CUDASIM=0 PYTHONPATH=src python -m pytest -m device -p no:xdist \\
        tests/test_device_reliability.py

Skipped (with the reason) where there is no CUDA GPU or the simulator is on.  The H200 run takes
a few minutes, most of it compiling kernel variants (each N is its own kernel; the fuzz draws N
from a fixed list so that variants are shared).  ``-k "not huge"`` leaves out the 2**31-element
test (~30 GB of device memory).
"""
import threading

import numpy as np
import pytest
from conftest import require_cuda_torch

pytestmark = pytest.mark.device

torch = require_cuda_torch()

from _fuzz import (CONTIGUOUS, OPS, Case, CupyLib, Layout, Sizes, TorchLib,  # noqa: E402
                   cases, check_case)
from hypothesis import HealthCheck, given, settings  # noqa: E402

import rmsnorm_hip  # noqa: E402
from rmsnorm_hip import _cache, backends  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cupy_or_skip():
    return pytest.importorskip("cupy")


# ---- guard bands: every entry point, dtype, awkward N, aligned and unaligned rows --------------
# N: one element; three (one ragged chunk); 4096 (vector path); 4097 (ragged, several warps);
# 65537 (looped rows: re-read between passes)
GUARD_N = (1, 3, 4096, 4097, 65537)
UNALIGNED = Layout(1, 7)            # row starts one element past a 16-byte boundary, odd stride
ALIGNED_STRIDED = Layout(8, 8)      # 16-byte aligned starts, strided rows


@pytest.mark.parametrize("n", GUARD_N)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_guard_bands_and_poisoned_outputs(op, dtype, n):
    """tests/_fuzz.check_case with fixed cases: inputs in poisoned buffers with guard rows and
    columns, outputs and workspaces allocated poisoned and guarded (tests/_guard.py), ``out=``
    in a poisoned strided buffer; nothing written outside, every output element written, the
    contract, bitwise equal to contiguous copies.  M = 5 (the backward: M = 300, several
    programs of its persistent grid)."""
    m = 300 if op == "bwd" else 5
    for x_layout, other in ((UNALIGNED, ALIGNED_STRIDED), (ALIGNED_STRIDED, CONTIGUOUS)):
        case = Case(op=op, dtype=dtype, lead=(m,), n=n, eps=1e-6, seed=n, weight="same",
                    weight_offset=0.0, vec_offset=int(x_layout is UNALIGNED),
                    x_layout=x_layout, other_layout=other,
                    out=other if op == "fwd" else None, return_rstd=True,
                    residual=op == "quant", xscale="float32" if op == "quant" else None,
                    quant="float8_e4m3fn" if dtype == "bfloat16" else "int8",
                    given_rstd=dtype == "float16", dresidual=dtype == "float32")
        check_case(case, TorchLib())


@pytest.mark.parametrize("op", OPS)
def test_guard_bands_cupy(op):
    """The same through CuPy (uint16 storage with dtype=, float8 as uint8 bits)."""
    cupy_or_skip()
    for dtype in DTYPES:
        case = Case(op=op, dtype=dtype, lead=(7,), n=4097, eps=1e-6, seed=7, weight="float32",
                    vec_offset=1, x_layout=UNALIGNED, other_layout=ALIGNED_STRIDED,
                    out=UNALIGNED if op == "fwd" else None, return_rstd=True,
                    residual=op == "quant", xscale="same" if op == "quant" else None,
                    quant="float8_e4m3fn", given_rstd=True, dresidual=True)
        check_case(case, CupyLib())


# ---- N = 1,048,576 -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op", OPS)
def test_rows_of_a_million(op, dtype):
    """M = 3 rows of N = 2**20 (1024 threads a row, looped), strided, against float64."""
    case = Case(op=op, dtype=dtype, lead=(3,), n=1 << 20, eps=1e-6, seed=20, weight="float32",
                x_layout=Layout(0, 8), other_layout=Layout(1, 0), return_rstd=True,
                residual=op == "quant", quant="int8", dresidual=True)
    check_case(case, TorchLib())


# ---- more than 2**31 elements ------------------------------------------------------------------
HUGE_M, HUGE_N = 1 << 20, (1 << 11) + 1       # 2,148,532,224 elements of bfloat16 (4.3 GB)
CHUNK = 1 << 15                                 # rows per float64 check chunk (0.5 GB)


def ulp_bf16(ref):
    _, exp = torch.frexp(ref.abs())
    exp = torch.where(ref == 0, torch.full_like(exp, -126), torch.clamp(exp - 1, min=-126))
    return torch.pow(2.0, (exp - 7).double())


def assert_bf16_close(out, ref, what, s=None):
    """docs/api.md's 16-bit rule: every element within 2 ulp + 1e-6 (dx: + 1e-5 * s) of the float64
    reference, relative error < 8e-3."""
    err = (out.double() - ref).abs()
    bound = 2 * ulp_bf16(ref) + (1e-6 if s is None else 1e-5 * s)
    bad = int((~(err <= bound)).sum())
    assert bad == 0, f"{what}: {bad} element(s) beyond the bound; worst {float(err.max()):.3e}"
    if s is None:
        rel = float(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref))
        assert rel < 8e-3, f"{what}: relative error {rel:.3e}"


def row_ref(x64, w64, eps):
    rstd = torch.rsqrt((x64 * x64).mean(-1) + eps)
    return x64 * rstd[:, None] * w64, rstd


def chunks():
    for start in range(0, HUGE_M, CHUNK):
        yield slice(start, min(start + CHUNK, HUGE_M))


# rows around element 2**31 (row 1048063 straddles it), the first and the last
EDGE_ROWS = [0, 1, (1 << 31) // HUGE_N - 1, (1 << 31) // HUGE_N, (1 << 31) // HUGE_N + 1,
             HUGE_M - 2, HUGE_M - 1]


@pytest.fixture(scope="module")
def huge():
    torch.manual_seed(0)
    free = torch.cuda.mem_get_info()[0]
    if free < 40 << 30:
        pytest.skip(f"needs ~40 GB of free device memory, {free >> 30} GB free")
    x = torch.randn(HUGE_M, HUGE_N, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(HUGE_N, device="cuda")).to(torch.bfloat16)
    assert x.numel() > 1 << 31
    yield x, w
    del x
    torch.cuda.empty_cache()


def assert_edge_rows_alone(fn, outputs):
    """Each edge row computed alone (``fn(row)``: the call on rows row:row+1) gives the bits of
    the big call (64-bit row offsets: a 32-bit index would wrap past element 2**31)."""
    for row in EDGE_ROWS:
        for got, want in zip(fn(row), outputs):
            assert same_bits(got.reshape(-1), want[row:row + 1].reshape(-1)), f"row {row}"


def test_huge_rms_norm(huge):
    x, w = huge
    y, rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)
    torch.cuda.synchronize()
    w64 = w.double()
    for rows in chunks():
        y_ref, rstd_ref = row_ref(x[rows].double(), w64, 1e-6)
        assert_bf16_close(y[rows], y_ref, f"y rows {rows.start}..")
        assert float(((rstd[rows].double() - rstd_ref).abs() / rstd_ref).max()) < 1e-5
    assert_edge_rows_alone(lambda i: rmsnorm_hip.rms_norm(x[i:i + 1], w, 1e-6, return_rstd=True),
                           (y, rstd))


def test_huge_fused_add(huge):
    x, w = huge
    residual = torch.randn_like(x)
    y, residual_out = rmsnorm_hip.fused_add_rms_norm(x, residual, w, 1e-6)
    w64 = w.double()
    for rows in chunks():
        h = (x[rows].float() + residual[rows].float()).to(torch.bfloat16)   # one RNE rounding
        assert torch.equal(residual_out[rows].view(torch.int16), h.view(torch.int16))
        assert_bf16_close(y[rows], row_ref(h.double(), w64, 1e-6)[0], f"y rows {rows.start}..")
    assert_edge_rows_alone(lambda i: rmsnorm_hip.fused_add_rms_norm(
        x[i:i + 1], residual[i:i + 1], w, 1e-6), (y, residual_out))
    residual = y = residual_out = None     # free the 4 GB arrays before the next entry point


def test_huge_quant(huge):
    x, w = huge
    q, yscale = rmsnorm_hip.rms_norm_quant(x, w, 1e-6, quant_dtype="int8")
    w64 = w.double()
    unequal = total = 0
    for rows in chunks():
        y_ref = row_ref(x[rows].double(), w64, 1e-6)[0]
        amax = y_ref.abs().amax(-1)
        yscale_ref = torch.where(amax == 0, torch.ones_like(amax), amax / 127)
        assert float(((yscale[rows].double() - yscale_ref).abs() / yscale_ref).max()) < 1e-5
        q_ref = y_ref / yscale_ref[:, None]
        level = torch.round(q_ref).clamp(-127, 127)
        diff = (q[rows].double() - level).abs()
        assert float(diff.max()) <= 1, f"q off by {float(diff.max())} levels"
        decided = (torch.round(q_ref * (1 + 1e-5)) == torch.round(q_ref * (1 - 1e-5)))
        unequal += int(((diff > 0) & decided).sum())
        total += diff.numel()
    assert 1000 * (total - unequal) > 999 * total, f"q differs in {unequal} of {total}"
    assert_edge_rows_alone(lambda i: rmsnorm_hip.rms_norm_quant(x[i:i + 1], w, 1e-6), (q, yscale))


def test_huge_backward(huge):
    x, w = huge
    dy = torch.randn_like(x)
    w32 = w.float()
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w32, None, eps=1e-6)
    dw_ref = torch.zeros(HUGE_N, dtype=torch.float64, device="cuda")
    w64 = w32.double()
    for rows in chunks():
        x64, dy64 = x[rows].double(), dy[rows].double()
        rstd = torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)
        x_hat, wdy = x64 * rstd, dy64 * w64
        dx_ref = (wdy - x_hat * (x_hat * wdy).mean(-1, keepdim=True)) * rstd
        assert_bf16_close(dx[rows], dx_ref, f"dx rows {rows.start}..", s=(wdy * rstd).abs())
        dw_ref += (dy64 * x_hat).sum(0)
    rel = float(torch.linalg.norm(dw.double() - dw_ref) / torch.linalg.norm(dw_ref))
    assert rel < 1e-4, f"dweight relative error {rel:.3e}"
    dw_again = rmsnorm_hip.rms_norm_backward(dy, x, w32, None, eps=1e-6)[1]
    assert same_bits(dw, dw_again), "deterministic dweight"
    assert_edge_rows_alone(lambda i: rmsnorm_hip.rms_norm_backward(
        dy[i:i + 1], x[i:i + 1], w32, None, eps=1e-6)[:1], (dx,))


# ---- hypothesis fuzz on the GPU ----------------------------------------------------------------
# N from a fixed list (every N, dtype and switch is a kernel to compile, ~0.5-1 s each), M up to
# 200, a few rows of 2**18 / 2**20
GPU_SIZES = Sizes(max_m=64, small_n=(1, 3, 8, 64, 127, 256, 1000, 4096), awkward=(4097, 8192,
                                                                                    65537),
                  awkward_m=200, big=(1 << 18, 1 << 20), big_m=3, max_elements=1 << 24)
TORCH_EXAMPLES = {"fwd": 70, "fused": 50, "fused_": 40, "quant": 80, "bwd": 60}     # 300
CUPY_EXAMPLES = {"fwd": 50, "fused": 30, "fused_": 30, "quant": 50, "bwd": 40}      # 200


def run_fuzz(request, op, examples, lib):
    count = 0

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(cases(op, GPU_SIZES))
    def fuzz(case):
        nonlocal count
        count += 1
        check_case(case, lib)

    fuzz()
    request.node.user_properties.append(("fuzz_examples", count))
    assert count >= examples, f"hypothesis ran {count} of {examples} examples"


@pytest.mark.parametrize("op", OPS)
def test_fuzz_torch(request, op):
    run_fuzz(request, op, TORCH_EXAMPLES[op], TorchLib())


@pytest.mark.parametrize("op", OPS)
def test_fuzz_cupy(request, op):
    cupy_or_skip()
    run_fuzz(request, op, CUPY_EXAMPLES[op], CupyLib())


# ---- 8 host threads, 8 streams, shared weights -------------------------------------------------
THREADS, ITERATIONS = 8, 20


def calls(op, w):
    """(fn(x, r, dy) -> tuple of output tensors) for an entry point, weight ``w`` shared."""
    if op == "fwd":
        return lambda x, r, dy: rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)
    if op == "fused":
        return lambda x, r, dy: rmsnorm_hip.fused_add_rms_norm(x, r, w, 1e-6)
    if op == "fused_":
        def in_place(x, r, dy):
            xc, rc = x.clone(), r.clone()
            rmsnorm_hip.fused_add_rms_norm_(xc, rc, w, 1e-6)
            return xc, rc
        return in_place
    if op == "quant":
        return lambda x, r, dy: rmsnorm_hip.rms_norm_quant(x, w, 1e-6, residual=r,
                                                           quant_dtype="float8_e4m3fn")
    return lambda x, r, dy: rmsnorm_hip.rms_norm_backward(dy, x, w, None, eps=1e-6)


def run_threads(work):
    barrier = threading.Barrier(THREADS)
    errors = []

    def body(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise errors[0]


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("op", OPS)
def test_threads_on_their_own_torch_streams(op):
    """Each thread has its own stream and inputs (M = 100 + 37 i rows, N = 4096 bf16) and calls
    the entry point 20 times on it (the repeat-call fast path for rms_norm); the weight is shared.
    Every result is bitwise the serial result of the same inputs."""
    torch.manual_seed(1)
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    fn = calls(op, w)
    data = [tuple(torch.randn(100 + 37 * i, 4096, device="cuda", dtype=torch.bfloat16)
                  for _ in range(3)) for i in range(THREADS)]
    expected = [fn(*d) for d in data]
    torch.cuda.synchronize()
    got = [[None] * ITERATIONS for _ in range(THREADS)]

    def work(i):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for k in range(ITERATIONS):
                got[i][k] = fn(*data[i])
        stream.synchronize()

    run_threads(work)
    for i in range(THREADS):
        for k in range(ITERATIONS):
            for a, b in zip(got[i][k], expected[i]):
                assert same_bits(a, b), f"thread {i}, call {k}: differs from the serial result"


@pytest.mark.parametrize("op", ["fwd", "quant", "bwd"])
def test_threads_on_their_own_cupy_streams(op):
    """The same with CuPy arrays (bf16 as uint16 + dtype=), each thread in its own non-blocking
    CuPy stream."""
    cupy = cupy_or_skip()
    rng = np.random.default_rng(2)
    w = cupy.asarray((1 + 0.1 * rng.standard_normal(4096)).astype(np.float32))

    def fn(x, r, dy):
        if op == "fwd":
            return rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True, dtype="bfloat16")
        if op == "quant":
            return rmsnorm_hip.rms_norm_quant(x, w, 1e-6, residual=r, dtype="bfloat16")
        return rmsnorm_hip.rms_norm_backward(dy, x, w, None, eps=1e-6, dtype="bfloat16")

    def bf16_bits(m):
        return cupy.asarray((rng.standard_normal((m, 4096)).astype(np.float32)
                             .view(np.uint32) >> 16).astype(np.uint16))

    data = [tuple(bf16_bits(100 + 37 * i) for _ in range(3)) for i in range(THREADS)]
    expected = [fn(*d) for d in data]
    cupy.cuda.Device().synchronize()
    got = [[None] * ITERATIONS for _ in range(THREADS)]

    def work(i):
        with cupy.cuda.Stream(non_blocking=True) as stream:
            for k in range(ITERATIONS):
                got[i][k] = fn(*data[i])
            stream.synchronize()

    run_threads(work)
    for i in range(THREADS):
        for k in range(ITERATIONS):
            for a, b in zip(got[i][k], expected[i]):
                assert cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8)), \
                    f"thread {i}, call {k}: differs from the serial result"


def test_concurrent_first_calls_build_each_kernel_once(monkeypatch):
    """8 threads make the first call on a fresh kernel cache at once (forward and backward, an N
    no other test uses): one build per kernel key, the same compiled kernel for every thread."""
    from collections import Counter
    monkeypatch.setattr(_cache, "_kernels", {})
    monkeypatch.setattr(_cache, "builds", Counter())
    monkeypatch.setattr(backends, "_backends", {})
    n = 777
    w = torch.ones(n, device="cuda", dtype=torch.float16)
    xs = [torch.randn(16 + i, n, device="cuda", dtype=torch.float16) for i in range(THREADS)]
    out = [None] * THREADS

    def work(i):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            out[i] = (rmsnorm_hip.rms_norm(xs[i], w, 1e-6),
                      rmsnorm_hip.rms_norm_backward(xs[i], xs[i], w)[0])
        stream.synchronize()

    run_threads(work)
    assert _cache.builds and set(_cache.builds.values()) == {1}, _cache.builds
    for i in range(THREADS):
        assert same_bits(out[i][0], rmsnorm_hip.rms_norm(xs[i], w, 1e-6))
