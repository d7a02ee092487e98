"""The GPU tier for rms_norm_quant's scaled formats (mark ``device``): group scales (float32 and
UE8M0, row- and column-major), static scales and MXFP8 / MXFP4 on a real GPU against the float64
reference of tests/test_quant_scaled.py, outputs guarded (written in full where the poison can
tell, nothing outside), misaligned copies (the scalar kernels) bitwise the aligned call, a row's
q and scales bitwise whatever M (decode vs prefill batches), CuPy arrays, a static scale given
as a number inside a CUDA graph, and torch.compile.

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -m device tests/test_device_quant_scaled.py

Skipped (with the reason) where there is no CUDA GPU or the simulator is on.
"""
import ml_dtypes
import numpy as np
import pytest

from conftest import DTYPES, require_cuda_torch

pytestmark = pytest.mark.device

torch = require_cuda_torch()

import rmsnorm_hip  # noqa: E402
from _guard import guarded_outputs  # noqa: E402
from rmsnorm_hip import torch as rt  # noqa: E402
from test_device import on_side_stream, raw, shifted_copy  # noqa: E402
from test_quant_scaled import (BY_NAME, FORMATS, check, check_guards, make_x,  # noqa: E402
                               random_array)

# one element group / block; three groups of 128; decode and prefill widths; thousands of rows
# (the streamed grid's programs walk many rows); the looped row
SHAPES = [(1, 128), (7, 384), (32, 4096), (512, 5120), (4096, 4096), (3, 65536)]
STATIC_SHAPES = [(1, 1), (7, 127), (333, 4097), (4096, 4096), (3, 65537)]


def cuda(a):
    if a is None:
        return None
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def on_host(t):
    """A CUDA tensor on the host with its strides (a column-major scales view keeps its padded
    column stride; .cpu() would make it dense)."""
    storage = t.untyped_storage().cpu()
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


def numpy_result(fmt, result):
    """The result tensors as the arrays a NumPy caller gets: float8 e4m3fn q as ml_dtypes, MX
    outputs as uint8 bits, 16-bit and float32 ones as NumPy (strides kept)."""
    parts = result if isinstance(result, tuple) else (result,)
    mx = fmt.kwargs["quant_dtype"] in ("mxfp8_e4m3", "mxfp4_e2m1")
    out = []
    for t in map(on_host, parts):
        if t.dtype == torch.float8_e4m3fn and not mx:
            out.append(t.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn))
        elif t.element_size() == 1 and t.dtype != torch.int8:
            out.append(t.view(torch.uint8).cpu().numpy())
        elif t.dtype == torch.bfloat16:
            out.append(t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16))
        else:
            out.append(t.cpu().numpy())
    return tuple(out) if len(out) > 1 else out[0]


def kwargs_on_gpu(fmt):
    kwargs = dict(fmt.kwargs)
    if isinstance(kwargs.get("scale"), np.ndarray):
        kwargs["scale"] = cuda(kwargs["scale"])
    return kwargs


CASES = [(fmt, shape, dtype) for fmt in FORMATS
         for shape in (SHAPES if fmt.scales else STATIC_SHAPES) for dtype in DTYPES]


@pytest.mark.parametrize("fmt,shape,dtype", CASES, ids=str)
def test_contract_guarded(fmt, shape, dtype):
    rng = np.random.default_rng(shape[0] * 7 + shape[1])
    x = make_x(rng, shape, dtype)
    w = random_array(rng, shape[-1], dtype, loc=1.0, scale=0.5)
    r = make_x(rng, shape, dtype) if shape[0] % 2 else None
    with guarded_outputs() as guards:
        result = rmsnorm_hip.rms_norm_quant(cuda(x), cuda(w), residual=cuda(r),
                                            **kwargs_on_gpu(fmt))
        torch.cuda.synchronize()
    check_guards(guards, fmt, shape[0])
    check(fmt, x, w, numpy_result(fmt, result), **({} if r is None else {"residual": r}))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_twin_and_batch_invariance(fmt, dtype):
    """The same rows from memory one element off 16 bytes (the scalar kernel) give the vector
    kernel's bits; a row alone (decode) gives its bits in a batch of 4096 (prefill)."""
    n = 4096
    x = cuda(make_x(np.random.default_rng(1), (4096, n), dtype))
    kwargs = kwargs_on_gpu(fmt)
    batch = rmsnorm_hip.rms_norm_quant(x, **kwargs)
    twin = rmsnorm_hip.rms_norm_quant(shifted_copy(x), **kwargs)
    batch, twin = (o if isinstance(o, tuple) else (o,) for o in (batch, twin))
    for a, b in zip(batch, twin):
        assert torch.equal(raw(a), raw(b)), f"{fmt}: scalar twin differs"
    for row in (0, 1, 4095):
        alone = rmsnorm_hip.rms_norm_quant(x[row:row + 1].clone(), **kwargs)
        alone = alone if isinstance(alone, tuple) else (alone,)
        assert torch.equal(raw(alone[0][0]), raw(batch[0][row])), f"{fmt}: q of row {row}"
        if fmt.scales:
            assert torch.equal(raw(alone[1][0].contiguous()), raw(batch[1][row].contiguous()))


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    fmt = BY_NAME["mxfp4"]
    x = make_x(np.random.default_rng(2), (33, 4096), "float32")
    q, scales = rmsnorm_hip.rms_norm_quant(cupy.asarray(x), **fmt.kwargs)
    assert isinstance(q, cupy.ndarray) and q.dtype == np.uint8 and q.shape == (33, 2048)
    check(fmt, x, None, (cupy.asnumpy(q), cupy.asnumpy(scales)))
    fmt = BY_NAME["group128_fp8_ue8m0_column"]
    q, scales = rmsnorm_hip.rms_norm_quant(cupy.asarray(x), **fmt.kwargs)
    assert scales.strides == (4, 4 * 36)
    host_scales = cupy.asnumpy(scales.base)[:, :33].T     # asnumpy alone makes it dense
    check(fmt, x, None, (cupy.asnumpy(q).view(ml_dtypes.float8_e4m3fn), host_scales))


def test_static_number_in_a_cuda_graph():
    """A static scale given as a number goes to the kernel by value: a captured graph holds
    it, and replays the eager bits."""
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    eager = rt.rms_norm_quant(x, w, quant_dtype="float8_e4m3fn", scale=0.01)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rt.rms_norm_quant(x, w, quant_dtype="float8_e4m3fn", scale=0.01)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(raw(captured), raw(eager))


def test_torch_compile_on_cuda():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    per_format = [kwargs_on_gpu(fmt) for fmt in FORMATS]    # tensors made outside the graph

    def calls(x):
        out = []
        for kwargs in per_format:
            result = rt.rms_norm_quant(x, **kwargs)
            out += list(result) if isinstance(result, tuple) else [result]
        return out

    torch._dynamo.reset()
    compiled = torch.compile(calls, fullgraph=True)(x)
    for a, b in zip(compiled, calls(x)):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        assert torch.equal(raw(a), raw(b))


@pytest.mark.parametrize("name,with_residual", [("group128_fp8_ue8m0_column", False),
                                                ("mxfp4", True), ("static_fp8", True),
                                                ("static_int8_array", False)])
def test_repeat_calls_take_the_runner(monkeypatch, name, with_residual):
    """The first call of a scaled format validates and builds a repeat-call runner; repeat calls
    with the same metadata run it: every output bitwise the validated call's, also from
    misaligned copies (the scalar kernel, chosen per call), with a weight offset, on a side
    stream, and (static) with another scale: a number, checked as every call checks it, or
    another tensor, read by the kernel."""
    from rmsnorm_hip import functional
    monkeypatch.setattr(functional, "_fused_runners", {})
    fmt = BY_NAME[name]
    m, n = 32, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x) if with_residual else None
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)

    def call(x, r, offset=0.0, **kwargs):
        return rmsnorm_hip.rms_norm_quant(x, w, 1e-6, residual=r, weight_offset=offset,
                                          **{**kwargs_on_gpu(fmt), **kwargs})

    def same(got, expected, what):
        got, expected = (t if isinstance(t, tuple) else (t,) for t in (got, expected))
        assert len(got) == len(expected), what
        for i, (a, b) in enumerate(zip(got, expected)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
            assert torch.equal(raw(a), raw(b)), f"{name} output {i}, {what}"

    first = call(x, r)
    assert len(functional._fused_runners) == 1, "the validated call builds one runner"
    same(call(x, r), first, "repeat")
    odd = [None if t is None else shifted_copy(t) for t in (x, r)]
    same(call(*odd), first, "misaligned")
    same(on_side_stream(lambda: call(x, r)), first, "side stream")
    offset = call(x, r, 0.5)
    number = "scale" in fmt.kwargs and not hasattr(fmt.kwargs["scale"], "shape")
    other = 0.03125 if number else torch.tensor([0.03125], device="cuda")
    other_scale = call(x, r, scale=other) if "scale" in fmt.kwargs else None
    assert len(functional._fused_runners) == 1, "repeat calls add no runner"
    if number:
        with pytest.raises(ValueError, match="scale must be a positive finite"):
            call(x, r, scale=-1.0)
    functional._fused_runners.clear()
    same(offset, call(x, r, 0.5), "weight offset 0.5 vs the validated call")
    if other_scale is not None:
        functional._fused_runners.clear()
        same(other_scale, call(x, r, scale=other), "another scale vs the validated call")


def test_e2m1_pairs_match_the_float32_encoder():
    """CUDA's e2m1 pairs in 16-bit halves (intrinsics mx_pack_e2m1x2 / mx_pack_e2m1x8) give the
    float32 encoder's codes for every float32 magnitude in [2**-30, 16) (signs alternating) and
    for random bit patterns; NaN gives 6 of either sign."""
    import numba
    from numba import cuda as nb_cuda

    from rmsnorm_hip import intrinsics
    intr, cpu = intrinsics.load("cuda"), intrinsics.load("cpu")
    x2, x8, encode = intr.mx_pack_e2m1x2, intr.mx_pack_e2m1x8, cpu.f32_to_e2m1

    @nb_cuda.jit
    def pack(v, out8, out2):
        i = nb_cuda.grid(1)
        if i < out8.size:
            b = i * 8
            out8[i] = x8(v[b], v[b + 1], v[b + 2], v[b + 3], v[b + 4], v[b + 5], v[b + 6],
                         v[b + 7])
            out2[i] = x2(v[b], v[b + 1])

    @numba.njit
    def expected(v):
        out8 = np.zeros(v.size // 8, np.uint32)
        out2 = np.zeros(v.size // 8, np.uint32)
        for i in range(out8.size):
            for k in range(8):
                out8[i] |= encode(v[8 * i + k]) << np.uint32(4 * k)
            out2[i] = encode(v[8 * i]) | (encode(v[8 * i + 1]) << np.uint32(4))
        return out8, out2

    def nibbles(words, count):
        return (words[:, None] >> np.arange(0, 4 * count, 4, dtype=np.uint32)) & np.uint32(0xF)

    def compare(bits):
        v = bits[:bits.size // 8 * 8].view(np.float32)
        got8 = nb_cuda.device_array(v.size // 8, np.uint32)
        got2 = nb_cuda.device_array(v.size // 8, np.uint32)
        pack[(got8.size + 255) // 256, 256](nb_cuda.to_device(v), got8, got2)
        want8, want2 = expected(v)
        got = (nibbles(got8.copy_to_host(), 8), nibbles(got2.copy_to_host(), 2))
        want = (nibbles(want8, 8), nibbles(want2, 2))
        nan = np.isnan(v).reshape(-1, 8)
        for g, w, n in zip(got, want, (nan, nan[:, :2])):
            assert np.all(g[n] & 7 == 7), "NaN: a level of magnitude 6"
            bad = (g != w) & ~n
            where = v.reshape(-1, 8)[:, :g.shape[1]][bad]
            assert not bad.any(), f"{bad.sum()} levels differ, e.g. at {where[:5]}"

    low, high = np.float32(2.0 ** -30).view(np.uint32), np.float32(16.0).view(np.uint32)
    step = 1 << 25
    for start in range(int(low), int(high), step):
        bits = np.arange(start, min(start + step, int(high)), dtype=np.uint32)
        compare(bits | ((bits & np.uint32(1)) << np.uint32(31)))
    rng = np.random.default_rng(5)
    compare(rng.integers(0, 2 ** 32, 1 << 24, dtype=np.uint64).astype(np.uint32))
    special = np.float32([0.0, -0.0, 0.25, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0,
                          7.99, 8.0, 1e30, -1e30, 65504.0, 65520.0, np.inf, -np.inf, 1e-45,
                          -1e-45, 0.2500001, -0.7499999])
    compare(np.resize(special, 32).view(np.uint32))
