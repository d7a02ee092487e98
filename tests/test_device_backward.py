"""The GPU tier for rms_norm_backward (mark ``device``): dx and dweight against the float64
reference on every kernel path (multi-row, one row per block, looped), NaN-poisoned outputs and
workspaces, dweight bitwise from run to run, dx rows bitwise whatever M, stride or alignment.

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -m device tests/test_device_backward.py
"""

import numpy as np
import pytest

from conftest import DTYPES, assert_dweight, assert_dx, require_cuda_torch

pytestmark = pytest.mark.device

torch = require_cuda_torch()

import rmsnorm_hip  # noqa: E402
from _guard import _NoRunners  # noqa: E402
from rmsnorm_hip import _arrays, functional, reference  # noqa: E402
from test_device import (SHAPES, TORCH, host, inputs, misaligned_copy, raw,  # noqa: E402
                         shifted_copy)


@pytest.fixture
def poisoned(monkeypatch):
    """Every output and workspace the library allocates starts as NaN bytes (0xFF); repeat-call
    runners (which allocate on their own) are neither used nor kept."""
    real = _arrays.empty
    monkeypatch.setattr(functional, "_bwd_runners", _NoRunners())

    def empty(like, shape, dtype):
        out, info = real(like, shape, dtype)
        t = out if isinstance(out, torch.Tensor) else torch.from_dlpack(out)
        if t.numel():
            t.view(torch.uint8).fill_(0xFF)
        return out, info
    monkeypatch.setattr(_arrays, "empty", empty)


# plus several rows of at most a warp per block on the packed path (a row reduction without a
# barrier), as a training step's N=128 activations take it, and dweight from the column
# programs of 640-thread rows (16-bit N = 5120, float32 2560; given rstd)
@pytest.mark.parametrize("m,n", SHAPES + [(2048, 128), (333, 1024), (33, 5120), (33, 2560)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight", ["same", None, "float32"])
@pytest.mark.parametrize("given_rstd", [True, False], ids=["rstd", "recompute"])
def test_backward_contract_and_invariance(poisoned, m, n, dtype, weight, given_rstd):
    if weight == "float32" and dtype == "float32":
        pytest.skip("float32 x takes a float32 weight already")
    wdtype = {"same": dtype, None: None, "float32": "float32"}[weight]
    _, x, w = inputs(m, n, dtype, wdtype)
    dy = torch.randn(m, n + 40, device="cuda", dtype=TORCH[dtype])[:, 32:32 + n]
    rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1]
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w, rstd if given_rstd else None)
    ref_dx, ref_dw = reference.rms_norm_backward_ref(host(dy), host(x), None if w is None else
                                                     host(w), rstd.cpu().numpy())
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert_dx(host(dx), host(dy), host(x), None if w is None else host(w), rstd.cpu().numpy(),
              ref_dx, dtype)
    if w is None:
        assert dw is None
        return
    assert dw.dtype == w.dtype and dw.shape == (n,)
    assert_dweight(host(dw), ref_dw, wdtype)
    for _ in range(2):   # deterministic: bitwise from run to run
        dx2, dw2 = rmsnorm_hip.rms_norm_backward(dy, x, w, rstd if given_rstd else None)
        assert torch.equal(raw(dx2), raw(dx)) and torch.equal(raw(dw2), raw(dw))
    # dx rows: bitwise the same on the scalar path (misaligned copy) and for rows alone
    xu = misaligned_copy(x)
    dxu = rmsnorm_hip.rms_norm_backward(dy, xu, w, rstd if given_rstd else None)[0]
    assert torch.equal(raw(dxu), raw(dx))
    rows = sorted({0, m // 2, m - 1})
    alone = [rmsnorm_hip.rms_norm_backward(dy[i:i + 1], x[i:i + 1], w,
                                           rstd[i:i + 1] if given_rstd else None)[0] for i in rows]
    assert torch.equal(raw(torch.cat(alone)), raw(dx[rows]))


@pytest.mark.parametrize("m,n", [(7, 4096), (33, 8192), (333, 127), (3, 65537)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_dresidual_and_offset(poisoned, m, n, dtype):
    _, x, w = inputs(m, n, dtype, dtype)
    w = w - 1.0            # Gemma: (1 + w) with weight_offset=1
    dy = torch.randn(m, n, device="cuda", dtype=TORCH[dtype])
    dres = torch.randn(m, n + 8, device="cuda", dtype=TORCH[dtype])[:, 8:]
    rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, weight_offset=1.0, return_rstd=True)[1]
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w, rstd, weight_offset=1.0, dresidual=dres)
    ref_dx, ref_dw = reference.rms_norm_backward_ref(host(dy), host(x), host(w),
                                                     rstd.cpu().numpy(), weight_offset=1.0,
                                                     dresidual=host(dres))
    assert_dx(host(dx), host(dy), host(x), host(w), rstd.cpu().numpy(), ref_dx, dtype, 1.0)
    assert_dweight(host(dw), ref_dw, dtype)


# the rows of two chunks a thread on CUDA (16-bit N = 8192, float32 N = 4096: the next row and
# dresidual loaded ahead, the weight held), one element short of them (a partial last chunk),
# and the 512-thread rows of one chunk (16-bit N = 4096) whose scalar kernel fits fewer blocks
@pytest.mark.parametrize("n", [4096, 4095, 8192, 8190])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("given_rstd", [True, False], ids=["rstd", "recompute"])
def test_row_strided_backward_is_its_contiguous_copys(dtype, n, given_rstd):
    """Rows one element off 16 bytes (the scalar kernels) give bitwise the contiguous copy's dx
    and dweight (docs/api.md), at an M past two programs an SM: the programs' partial rows are
    dweight's summation order, and the scalar and vector kernels once ran different numbers of
    them (264 and 132 at 16-bit N = 4096 on an H200).  Both within float64's tolerances."""
    m = 333
    _, x, w = inputs(m, n, dtype, dtype)
    dy = torch.randn(m, n, device="cuda", dtype=TORCH[dtype])
    dres = torch.randn(m, n, device="cuda", dtype=TORCH[dtype])
    rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1]
    given = rstd if given_rstd else None
    for dresidual in (None, dres):
        dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w, given, dresidual=dresidual)
        dxu, dwu = rmsnorm_hip.rms_norm_backward(
            misaligned_copy(dy), misaligned_copy(x), w, given,
            dresidual=None if dresidual is None else misaligned_copy(dresidual))
        assert torch.equal(raw(dxu), raw(dx)) and torch.equal(raw(dwu), raw(dw))
        ref_dx, ref_dw = reference.rms_norm_backward_ref(
            host(dy), host(x), host(w), rstd.cpu().numpy(),
            dresidual=None if dresidual is None else host(dresidual))
        assert_dx(host(dx), host(dy), host(x), host(w), rstd.cpu().numpy(), ref_dx, dtype)
        assert_dweight(host(dw), ref_dw, dtype)


@pytest.mark.parametrize("m,n", [(1024, 8192), (333, 4096), (4096, 4096)], ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_evict_first_loads_give_the_plain_bits(monkeypatch, dtype, m, n):
    """Calls of few bytes load their rows evict-first (ld.global.cs; _config.bwd_stream_rows),
    larger ones plainly: the same dx and dweight bits either way (paired rows at 333 / 4096
    rows of 4096, the 512 x 2 rows of 8192), and within float64's tolerances."""
    from rmsnorm_hip.kernels import _config
    _, x, w = inputs(m, n, dtype, dtype)
    dy, dres = (torch.randn(m, n, device="cuda", dtype=TORCH[dtype]) for _ in range(2))
    rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1]
    assert _config.bwd_stream_rows(m, n, dtype)
    for given, dresidual in ((rstd, None), (None, dres)):
        functional.forget_plans()
        hinted = rmsnorm_hip.rms_norm_backward(dy, x, w, given, dresidual=dresidual)
        monkeypatch.setattr(_config, "BWD_STREAM_MAX_BYTES", 0)
        functional.forget_plans()
        plain = rmsnorm_hip.rms_norm_backward(dy, x, w, given, dresidual=dresidual)
        monkeypatch.undo()
        functional.forget_plans()
        assert torch.equal(raw(hinted[0]), raw(plain[0])), "dx"
        assert torch.equal(raw(hinted[1]), raw(plain[1])), "dweight"
        ref_dx, ref_dw = reference.rms_norm_backward_ref(
            host(dy), host(x), host(w), None if given is None else rstd.cpu().numpy(),
            dresidual=None if dresidual is None else host(dresidual))
        assert_dx(host(hinted[0]), host(dy), host(x), host(w), rstd.cpu().numpy(), ref_dx, dtype)
        assert_dweight(host(hinted[1]), ref_dw, dtype)


def test_dweight_accuracy_many_rows():
    """float32 accumulation over 65536 rows: relative error < 1e-4 (issue 4)."""
    x = torch.randn(65536, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(1024, device="cuda")).float()
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w)
    xh = x.double()
    rstd = torch.rsqrt((xh * xh).mean(-1, keepdim=True) + 1e-6)
    ref = (dy.double() * xh * rstd).sum(0)
    rel = (torch.linalg.vector_norm(dw.double() - ref) / torch.linalg.vector_norm(ref)).item()
    assert rel < 1e-4, rel


def test_backward_on_a_side_stream_and_leading_dims():
    x = torch.randn(4, 6, 2048, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    expected = rmsnorm_hip.rms_norm_backward(dy, x, w)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = rmsnorm_hip.rms_norm_backward(dy, x, w)
    stream.synchronize()
    assert got[0].shape == x.shape
    assert torch.equal(raw(got[0]), raw(expected[0])) and torch.equal(raw(got[1]), raw(expected[1]))


@pytest.mark.parametrize("weight,given_rstd,dres", [("same", True, False), (None, True, False),
                                                    ("float32", False, True)])
def test_backward_repeat_calls_take_the_runner(monkeypatch, weight, given_rstd, dres):
    """The first call validates and builds a runner; repeat calls with the same metadata run it:
    bitwise the validated call's results, also from a misaligned copy (the scalar kernel, chosen
    per call) and on a side stream."""
    monkeypatch.setattr(functional, "_bwd_runners", {})
    m, n = 32, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = None if weight is None else (1 + 0.1 * torch.randn(n, device="cuda")).to(
        torch.bfloat16 if weight == "same" else torch.float32)
    rstd = rmsnorm_hip.rms_norm(x, None, 1e-6, return_rstd=True)[1] if given_rstd else None
    dr = torch.randn_like(x) if dres else None
    first = rmsnorm_hip.rms_norm_backward(dy, x, w, rstd, dresidual=dr)
    assert len(functional._bwd_runners) == 1, "the validated call builds one runner"
    again = rmsnorm_hip.rms_norm_backward(dy, x, w, rstd, dresidual=dr)
    x_odd, dy_odd = shifted_copy(x), shifted_copy(dy)
    assert x_odd.stride() == x.stride() and x_odd.data_ptr() % 16
    odd = rmsnorm_hip.rms_norm_backward(dy_odd, x_odd, w, rstd, dresidual=dr)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        side = rmsnorm_hip.rms_norm_backward(dy, x, w, rstd, dresidual=dr)
    stream.synchronize()
    assert len(functional._bwd_runners) == 1, "repeat calls add no runner"
    for what, got in (("repeat", again), ("misaligned", odd), ("side stream", side)):
        assert torch.equal(raw(got[0]), raw(first[0])), f"dx, {what}"
        if w is None:
            assert got[1] is None
        else:
            assert torch.equal(raw(got[1]), raw(first[1])), f"dweight, {what}"
    ref_dx, ref_dw = reference.rms_norm_backward_ref(
        host(dy), host(x), None if w is None else host(w),
        None if rstd is None else host(rstd), dresidual=None if dr is None else host(dr))
    r64 = reference.rms_norm_ref(host(x), None, 1e-6)[1]
    assert_dx(host(again[0]), host(dy), host(x), None if w is None else host(w), r64, ref_dx,
              "bfloat16")


def test_backward_cupy_bfloat16_as_uint16():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(1)
    import ml_dtypes
    x = rng.standard_normal((9, 4096)).astype(ml_dtypes.bfloat16)
    dy = rng.standard_normal((9, 4096)).astype(ml_dtypes.bfloat16)
    w = (1 + 0.1 * rng.standard_normal(4096)).astype(np.float32)
    dx, dw = rmsnorm_hip.rms_norm_backward(cupy.asarray(dy.view(np.uint16)),
                                           cupy.asarray(x.view(np.uint16)), cupy.asarray(w),
                                           dtype="bfloat16")
    assert isinstance(dx, cupy.ndarray) and dx.dtype == np.uint16
    ref_dx, ref_dw = reference.rms_norm_backward_ref(dy, x, w, None)
    rstd = reference.rms_norm_ref(x, None, 1e-6)[1]
    assert_dx(dx.get().view(ml_dtypes.bfloat16), dy, x, w, rstd, ref_dx, "bfloat16")
    assert_dweight(dw.get(), ref_dw, "float32")


# deterministic=False: atomics at few rows / many rows a program (_config.bwd_atomic_dweight),
# partial rows and the reduction at 264 x 4096 (H200), dweight from the kernel at one row
# (_config.bwd_direct_dweight); a float32 weight
@pytest.mark.parametrize("m,n", [(1, 8192), (8, 4096), (264, 4096), (8192, 4096)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("given_rstd,dres", [(True, False), (False, True)],
                         ids=["rstd", "recompute-dres"])
def test_nondeterministic_dweight(poisoned, m, n, dtype, given_rstd, dres):
    """deterministic=False: dx bitwise the deterministic call's, dweight (by float32 atomics
    where bwd_atomic_dweight takes them, into a zeroed dweight) against float64, every output
    written; the kernel taken is the one the rule names."""
    from rmsnorm_hip import backends
    from rmsnorm_hip.kernels import _config
    _, x, w = inputs(m, n, dtype, "float32")
    dy = torch.randn_like(x)
    dr = torch.randn_like(x) if dres else None
    rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1]
    r = rstd if given_rstd else None
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w, r, dresidual=dr)
    be = backends.get("cuda")
    be.forget_plans()
    ndx, ndw = rmsnorm_hip.rms_norm_backward(dy, x, w, r, dresidual=dr, deterministic=False)
    (spec, _, reduce, _), = be._bwd_plans.values()
    deterministic_spec = _config.bwd_spec(n, dtype, "float32", True, not given_rstd, dres, "cuda",
                                          _config.bwd_pair_rows(m, be.sm_count),
                                          _config.bwd_stream_rows(m, n, dtype))
    direct = _config.bwd_direct_dweight(deterministic_spec, m)
    expected = not direct and _config.bwd_atomic_dweight(
        deterministic_spec, m, _config.bwd_programs(spec, m, be.sm_count), "cuda")
    assert spec.atomic_dweight == expected and direct == (m == 1)
    assert (reduce is None) == (expected or direct)
    assert torch.equal(raw(ndx), raw(dx))
    ref_dw = reference.rms_norm_backward_ref(host(dy), host(x), host(w), rstd.cpu().numpy(),
                                             dresidual=None if dr is None else host(dr))[1]
    assert ndw.dtype == torch.float32 and ndw.shape == (n,)
    assert_dweight(host(ndw), ref_dw, "float32")
    assert_dweight(host(dw), ref_dw, "float32")


@pytest.mark.parametrize("n", [2048, 4096, 8192])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_direct_dweight_bits(poisoned, monkeypatch, n, dtype):
    """One row: the kernel writes a 16-bit dweight itself (no reduction kernel); dx and dweight
    bitwise the workspace path's (the partial row and dweight_reduce), against float64."""
    from rmsnorm_hip import backends
    from rmsnorm_hip.kernels import _config
    _, x, w = inputs(1, n, dtype, dtype)
    dy = torch.randn_like(x)
    be = backends.get("cuda")
    be.forget_plans()
    dx, dw = rmsnorm_hip.rms_norm_backward(dy, x, w)
    (spec, _, reduce, _), = be._bwd_plans.values()
    assert spec.direct_dweight and reduce is None
    monkeypatch.setattr(_config, "bwd_direct_dweight", lambda spec, m: False)
    be.forget_plans()
    wdx, wdw = rmsnorm_hip.rms_norm_backward(dy, x, w)
    (spec, _, reduce, _), = be._bwd_plans.values()
    assert not spec.direct_dweight and reduce is not None
    assert torch.equal(raw(wdx), raw(dx)) and torch.equal(raw(wdw), raw(dw))
    ref_dw = reference.rms_norm_backward_ref(host(dy), host(x), host(w), None)[1]
    assert_dweight(host(dw), ref_dw, dtype)
