"""The GPU tier (mark ``device``): the forward on a real NVIDIA GPU through torch, CuPy, numba
device arrays and plain DLPack objects.  Run with the simulator off:

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -m device tests/test_device.py

Skipped (with the reason) where there is no CUDA GPU or the simulator is on.
"""

import ml_dtypes
import numpy as np
import pytest

from conftest import DTYPES, assert_close, assert_quant_close, require_cuda_torch

pytestmark = pytest.mark.device

torch = require_cuda_torch()

import rmsnorm_hip  # noqa: E402
from rmsnorm_hip import reference  # noqa: E402

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# awkward N (scalar, multi-row, ragged, looped paths) and the LLM sizes (vector path)
SHAPES = [(1, 1), (7, 3), (333, 127), (7, 4096), (333, 4097), (7, 5000), (33, 8192),
          (3, 65537), (2, 262144)]


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def host(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return t.cpu().numpy()


def inputs(m, n, dtype, weight_dtype, pad=24, offset=8):
    """x as a row-strided view (16-byte aligned start) of a wider matrix, and weight."""
    wide = torch.randn(m, n + pad, device="cuda", dtype=TORCH[dtype])
    w = None if weight_dtype is None else (1 + 0.1 * torch.randn(n, device="cuda")).to(
        TORCH[weight_dtype])
    return wide, wide[:, offset:offset + n], w


@pytest.mark.parametrize("m,n", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight", ["same", None, "float32"])
def test_forward_contract_and_invariance(m, n, dtype, weight):
    if weight == "float32" and dtype == "float32":
        pytest.skip("float32 x takes a float32 weight already")
    wdtype = {"same": dtype, None: None, "float32": "float32"}[weight]
    wide, x, w = inputs(m, n, dtype, wdtype)
    y, rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)
    y_ref, rstd_ref = reference.rms_norm_ref(host(x), None if w is None else host(w), 1e-6)
    assert_close(host(y), y_ref, dtype)
    assert_close(rstd.cpu().numpy(), rstd_ref, "float32")
    # bitwise: the contiguous copy, an unaligned view (scalar path), each row alone (M=1)
    assert torch.equal(bits(y), bits(rmsnorm_hip.rms_norm(x.contiguous(), w, 1e-6)))
    xu = wide[:, 1:1 + n]
    assert torch.equal(bits(rmsnorm_hip.rms_norm(xu, w, 1e-6)),
                       bits(rmsnorm_hip.rms_norm(xu.contiguous(), w, 1e-6)))
    rows = sorted({0, m // 2, m - 1})
    alone = torch.cat([rmsnorm_hip.rms_norm(x[i:i + 1], w, 1e-6) for i in rows])
    assert torch.equal(bits(alone), bits(y[rows]))
    # out= poisoned with NaN: fully written, and guard columns around it untouched
    out_wide = torch.full((m, n + 16), float("nan"), device="cuda", dtype=TORCH[dtype])
    rmsnorm_hip.rms_norm(x, w, 1e-6, out=out_wide[:, 8:8 + n])
    assert torch.equal(bits(out_wide[:, 8:8 + n]), bits(y))
    assert torch.isnan(out_wide[:, :8]).all() and torch.isnan(out_wide[:, 8 + n:]).all()


def test_in_place_and_weight_offset():
    x = torch.randn(65, 4096, device="cuda", dtype=torch.bfloat16)
    w = 0.1 * torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    expected = rmsnorm_hip.rms_norm(x, w, 1e-6, weight_offset=1.0)
    y_ref, _ = reference.rms_norm_ref(host(x), host(w), 1e-6, weight_offset=1.0)
    assert_close(host(expected), y_ref, "bfloat16")
    result = rmsnorm_hip.rms_norm(x, w, 1e-6, weight_offset=1.0, out=x)
    assert result is x and torch.equal(bits(x), bits(expected))


def test_repeat_calls_match_first_call_and_follow_the_stream():
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    first = rmsnorm_hip.rms_norm(x, w, 1e-6)          # validated path, builds the runner
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x2 = x * 1                                     # work queued on the side stream
        again = rmsnorm_hip.rms_norm(x2, w, 1e-6)     # runner path, same stream
    stream.synchronize()
    assert torch.equal(bits(first), bits(again))


def test_empty_batch_and_leading_dims():
    x = torch.randn(0, 4096, device="cuda", dtype=torch.bfloat16)
    assert rmsnorm_hip.rms_norm(x).shape == (0, 4096)
    x3 = torch.randn(2, 3, 512, device="cuda", dtype=torch.float16)
    y3 = rmsnorm_hip.rms_norm(x3)
    assert y3.shape == x3.shape
    assert torch.equal(bits(y3.reshape(6, 512)), bits(rmsnorm_hip.rms_norm(x3.reshape(6, 512))))


def test_cupy_uint16_bfloat16_and_numba_arrays():
    cupy = pytest.importorskip("cupy")
    from numba import cuda
    xh = np.random.default_rng(0).standard_normal((5, 4096)).astype(ml_dtypes.bfloat16)
    y = rmsnorm_hip.rms_norm(cupy.asarray(xh.view(np.uint16)), None, dtype="bfloat16")
    assert isinstance(y, cupy.ndarray) and y.dtype == np.uint16
    assert_close(y.get().view(ml_dtypes.bfloat16), reference.rms_norm_ref(xh)[0], "bfloat16")
    xn = cuda.to_device(np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32))
    yn = rmsnorm_hip.rms_norm(xn)
    assert hasattr(yn, "copy_to_host")
    assert_close(yn.copy_to_host(), reference.rms_norm_ref(xn.copy_to_host())[0], "float32")


class _DLPackOnly:
    """An array known only through DLPack (as from a library we have no adapter for)."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, stream=None, **kw):
        return self._t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


def test_plain_dlpack_bfloat16_zero_copy():
    pytest.importorskip("cupy")
    x = torch.randn(9, 1024, device="cuda", dtype=torch.bfloat16)
    y = rmsnorm_hip.rms_norm(_DLPackOnly(x), None, 1e-6)
    expected = rmsnorm_hip.rms_norm(x, None, 1e-6)
    got = torch.from_dlpack(y)
    assert torch.equal(bits(got), bits(expected))


def test_backend_variable_is_honoured_on_repeat_calls(monkeypatch):
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    rmsnorm_hip.rms_norm(x)                               # builds the repeat-call runner
    monkeypatch.setenv("RMSNORM_HIP_BACKEND", "hip")
    with pytest.raises(ValueError, match="RMSNORM_HIP_BACKEND=hip cannot run cuda"):
        rmsnorm_hip.rms_norm(x)


# ---- fused residual add and quantised forward -------------------------------------------------
def raw(t):
    """The bytes of a tensor (any dtype, float8 included) for bitwise comparisons."""
    return t.contiguous().view(torch.uint8)


def misaligned_copy(x):
    """x's values in rows that start one element past a 16-byte boundary (the scalar path)."""
    m, n = x.shape
    out = torch.empty(m, n + 1, device=x.device, dtype=x.dtype)[:, 1:]
    out.copy_(x)
    return out


def host_q(q):
    if q.dtype == torch.float8_e4m3fn:
        return q.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn)
    return q.cpu().numpy()


@pytest.mark.parametrize("m,n", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_contract_in_place_and_invariance(m, n, dtype):
    _, x, w = inputs(m, n, dtype, dtype)
    r = torch.randn(m, n + 8, device="cuda", dtype=TORCH[dtype])[:, 8:]
    y, ro, rstd = rmsnorm_hip.fused_add_rms_norm(x, r, w, 1e-6, return_rstd=True)
    y_ref, h_ref, rstd_ref = reference.fused_add_rms_norm_ref(host(x), host(r), host(w), 1e-6)
    assert np.array_equal(host(ro).astype(np.float64), h_ref), "residual_out: one rounding"
    assert_close(host(y), y_ref, dtype)
    assert_close(rstd.cpu().numpy(), rstd_ref, "float32")
    assert torch.equal(raw(y), raw(rmsnorm_hip.rms_norm(ro, w, 1e-6))), "y == rms_norm(ro)"
    # in place == out of place; a misaligned view (scalar path) and rows alone give the same bits
    xi, ri = x.clone(), r.clone()
    assert rmsnorm_hip.fused_add_rms_norm_(xi, ri, w, 1e-6) is None
    assert torch.equal(raw(xi), raw(y)) and torch.equal(raw(ri), raw(ro))
    xu = misaligned_copy(x)
    yu, rou = rmsnorm_hip.fused_add_rms_norm(xu, r, w, 1e-6)
    assert torch.equal(raw(yu), raw(y)) and torch.equal(raw(rou), raw(ro))
    rows = sorted({0, m // 2, m - 1})
    alone = [rmsnorm_hip.fused_add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-6) for i in rows]
    assert torch.equal(raw(torch.cat([a[0] for a in alone])), raw(y[rows]))
    assert torch.equal(raw(torch.cat([a[1] for a in alone])), raw(ro[rows]))


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_cuda_add_pairs_round_the_exact_sum_once(fmt):
    """CUDA's add_bf16x2 / add_f16x2 (one packed instruction a word: the streamed fused add's
    h) give the float32 form's word, NaN bits included, for every pair of 16-bit patterns (each
    pair in both halves), and the exact sum rounded once on test_intrinsics' cases."""
    from numba import cuda as nb_cuda
    from numba import uint32, uint64
    from numba.core.extending import register_jitable
    from test_intrinsics import ADDERS, CODECS, add_pairs_cases, assert_add_pairs

    from rmsnorm_hip import intrinsics
    from rmsnorm_hip.intrinsics import _shared
    cuda_ns = intrinsics.load("cuda")
    packed = getattr(cuda_ns, ADDERS[fmt])
    float32_form = _shared.make_add_pairs(register_jitable, vars(cuda_ns))[ADDERS[fmt]]

    @nb_cuda.jit
    def every_pair(base, mismatches):
        i = uint64(nb_cuda.grid(1)) + uint64(base)
        x = uint32(i & uint64(0xFFFF))
        y = uint32(i >> uint64(16))
        a, b = x | (y << uint32(16)), y | (x << uint32(16))
        got, want = packed(a, b), float32_form(a, b)
        if got != want and nb_cuda.atomic.add(mismatches, 0, 1) == 0:
            mismatches[1], mismatches[2], mismatches[3], mismatches[4] = a, b, got, want

    mismatches = nb_cuda.to_device(np.zeros(5, np.int64))
    for base in range(0, 1 << 32, 1 << 30):
        every_pair[(1 << 30) // 256, 256](base, mismatches)
    count, a, b, got, want = mismatches.copy_to_host()
    assert count == 0, f"{count} words differ, first {a:#x} + {b:#x}: {got:#x} vs {want:#x}"

    @nb_cuda.jit
    def add_words(a, b, out):
        i = nb_cuda.grid(1)
        if i < out.size:
            out[i] = packed(a[i], b[i])

    dtype = CODECS[fmt][2]
    a, b = add_pairs_cases(np.random.default_rng(7), 1 << 20, dtype)
    out = nb_cuda.device_array(a.size, np.uint32)
    add_words[(a.size + 255) // 256, 256](nb_cuda.to_device(a), nb_cuda.to_device(b), out)
    assert_add_pairs(out.copy_to_host(), a, b, dtype, ADDERS[fmt])


@pytest.mark.parametrize("quant", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("m,n", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES)
def test_quant_contract_and_invariance(m, n, dtype, quant):
    _, x, w = inputs(m, n, dtype, dtype)
    r = torch.randn(m, n, device="cuda", dtype=TORCH[dtype])
    xs = 0.5 + torch.rand(n, device="cuda")
    q, yscale, ro = rmsnorm_hip.rms_norm_quant(x, w, 1e-6, xscale=xs, residual=r,
                                               quant_dtype=quant)
    assert q.dtype == getattr(torch, quant) and q.shape == x.shape
    assert yscale.dtype == torch.float32 and yscale.shape == (m,)
    ref = reference.rms_norm_quant_ref(host(x), host(w), 1e-6, xscale=xs.cpu().numpy(),
                                       residual=host(r), quant_dtype=quant)
    assert_quant_close(host_q(q), yscale.cpu().numpy(), ref[0], ref[1], quant)
    assert np.array_equal(host(ro).astype(np.float64), ref[2])
    # the residual variant quantises residual_out: bitwise the call on residual_out
    q2, yscale2 = rmsnorm_hip.rms_norm_quant(ro, w, 1e-6, xscale=xs, quant_dtype=quant)
    assert torch.equal(raw(q), raw(q2)) and torch.equal(yscale, yscale2)
    xu = misaligned_copy(x)
    qu, yscale_u, _ = rmsnorm_hip.rms_norm_quant(xu, w, 1e-6, xscale=xs, residual=r,
                                                 quant_dtype=quant)
    assert torch.equal(raw(qu), raw(q)) and torch.equal(yscale_u, yscale)
    rows = sorted({0, m // 2, m - 1})
    alone = [rmsnorm_hip.rms_norm_quant(x[i:i + 1], w, 1e-6, xscale=xs, residual=r[i:i + 1],
                                        quant_dtype=quant) for i in rows]
    assert torch.equal(raw(torch.cat([a[0] for a in alone])), raw(q[rows]))
    assert torch.equal(torch.cat([a[1] for a in alone]), yscale[rows])


def test_quant_cupy_float8_is_uint8_bits():
    cupy = pytest.importorskip("cupy")
    xh = np.random.default_rng(0).standard_normal((5, 4096)).astype(ml_dtypes.bfloat16)
    q, yscale = rmsnorm_hip.rms_norm_quant(cupy.asarray(xh.view(np.uint16)), None,
                                           quant_dtype="float8_e4m3fn", dtype="bfloat16")
    assert isinstance(q, cupy.ndarray) and q.dtype == np.uint8
    ref = reference.rms_norm_quant_ref(xh, quant_dtype="float8_e4m3fn")
    assert_quant_close(q.get().view(ml_dtypes.float8_e4m3fn), yscale.get(), ref[0], ref[1],
                       "float8_e4m3fn")


def shifted_copy(t):
    """t's values, contiguous (same strides) but starting one element past a 16-byte boundary
    (the scalar kernel)."""
    buf = torch.empty(t.numel() + 8, device=t.device, dtype=t.dtype)
    out = buf[1:1 + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def on_side_stream(call):
    """``call()`` made on a new stream, not the current one; its result once that stream is
    done."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        result = call()
    stream.synchronize()
    return result


@pytest.mark.parametrize("op", ["fused", "fused_", "quant_int8", "quant_fp8_residual"])
def test_fused_repeat_calls_take_the_runner(monkeypatch, op):
    """The fused entry points' first call validates and builds a runner; repeat calls with the
    same metadata run it: bitwise the validated call's outputs, also from misaligned copies
    (the scalar kernel, chosen per call), with a weight offset (the other kernel of the quantised
    rows, chosen per call) and on a side stream.  In place, arrays that overlap are still
    rejected by full validation."""
    from rmsnorm_hip import functional
    monkeypatch.setattr(functional, "_fused_runners", {})
    m, n = 32, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
    xs = (1 + 0.2 * torch.rand(n, device="cuda")).float()

    def call(x, r, offset=0.0):
        if op == "fused":
            return rmsnorm_hip.fused_add_rms_norm(x, r, w, 1e-6, weight_offset=offset,
                                                  return_rstd=True)
        if op == "fused_":
            xc, rc = (t.clone() if t.data_ptr() % 16 == 0 else shifted_copy(t) for t in (x, r))
            assert rmsnorm_hip.fused_add_rms_norm_(xc, rc, w, 1e-6, weight_offset=offset) is None
            return xc, rc
        if op == "quant_int8":
            return rmsnorm_hip.rms_norm_quant(x, w, 1e-6, xscale=xs, weight_offset=offset)
        return rmsnorm_hip.rms_norm_quant(x, w, 1e-6, xscale=xs, residual=r, weight_offset=offset,
                                          quant_dtype=torch.float8_e4m3fn)

    def same(got, expected, what):
        assert len(got) == len(expected), what
        for i, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(raw(a), raw(b)), f"{op} output {i}, {what}"

    first = call(x, r)
    assert len(functional._fused_runners) == 1, "the validated call builds one runner"
    same(call(x, r), first, "repeat")
    x_odd, r_odd = shifted_copy(x), shifted_copy(r)
    assert x_odd.stride() == x.stride() and x_odd.data_ptr() % 16
    same(call(x_odd, r_odd), first, "misaligned")
    same(on_side_stream(lambda: call(x, r)), first, "side stream")
    offset = call(x, r, 0.5)
    assert len(functional._fused_runners) == 1, "repeat calls add no runner"
    functional._fused_runners.clear()
    same(offset, call(x, r, 0.5), "weight offset 0.5 vs the validated call")
    if op == "fused_":
        xa = x.clone()
        with pytest.raises(ValueError, match="overlaps x"):
            rmsnorm_hip.fused_add_rms_norm_(xa, xa, w)
