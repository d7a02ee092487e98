"""The GPU tier of QK-norm (mark ``device``): qk_rms_norm_ / qk_rms_norm on a real NVIDIA GPU over
tests/test_qk.py's matrix (dtype x head size x RoPE style, the other settings rotating) with its
float64 reference, for CuPy and torch q / k views into one QKV buffer, and for the other flavours
of tests/test_device_flavours.py's table (numba device arrays, bare __cuda_array_interface__ and
DLPack objects) on the default tier's cases.  Per case: outputs of the caller's library, within
the numerical contract; in place bitwise out of place, with the v part of the buffer untouched;
the unrotated elements (all without RoPE) bitwise rms_norm's of each head row; the same buffer
one element off its alignment (the scalar kernel) gives the same bits.  Then batch invariance,
CUDA-graph capture and replay through the torch adapter, and positions outside the cache (NaN
over the token's rotated elements, nothing written outside the outputs).  Run with the simulator
off:

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -m device tests/test_device_qk.py

Skipped (with the reason) where there is no CUDA GPU, CuPy is missing or the simulator is on.
"""
from dataclasses import replace

import numpy as np
import pytest

from conftest import BFLOAT16, NUMPY, assert_bitwise, assert_close, require_cuda_torch

pytestmark = pytest.mark.device

torch = require_cuda_torch()

# (skips this module without CuPy, as it does its own)
from test_device_flavours import (FLAVOURS, CAIOnly, DLPackOnly, check_output,  # noqa: E402
                                  cupy, numba_cuda, to_host, unwrap)
from test_qk import (EPS, MATRIX, MAX_POSITION, QUICK, SIM_CASES, Call,  # noqa: E402
                     qkv_views)

import rmsnorm_hip  # noqa: E402
from rmsnorm_hip import torch as rt  # noqa: E402

DEVICE = "cuda"


# ---- device copies of a test_qk.Call --------------------------------------------------------

def device_ints(flavour, host):
    """Integer positions in this flavour's library."""
    if flavour.name in ("torch", "dlpack"):
        t = torch.from_numpy(np.ascontiguousarray(host)).to(DEVICE)
        return t if flavour.name == "torch" else DLPackOnly(t)
    if flavour.name == "numba":
        return numba_cuda.to_device(np.ascontiguousarray(host))
    arr = cupy.asarray(host)
    return arr if flavour.name == "cupy" else CAIOnly(arr)


def _view(made, cols, shape):
    """Columns ``cols`` (a slice) of a flavour's 2-D or 3-D buffer as ``shape`` (..., H, D),
    a view (never a copy), wrapped like the buffer."""
    inner = unwrap(made)
    part = inner[..., cols]
    if isinstance(inner, torch.Tensor):
        view = part.unflatten(-1, shape[-2:])
        assert view.data_ptr() == part.data_ptr() and view._base is not None
    else:
        view = part.reshape(shape)
        assert view.data.ptr == part.data.ptr and view.base is not None, "reshape copied"
    return CAIOnly(view) if isinstance(made, CAIOnly) else (
        DLPackOnly(view) if isinstance(made, DLPackOnly) else view)


class DeviceCall:
    """A test_qk.Call's arrays in one flavour: the QKV buffer (with ``shift`` leading guard
    elements per token, so q starts that many elements past the allocation) and its q and k
    views, weights, positions and cache.  numba device arrays cannot view a QKV buffer's heads
    (their reshape needs contiguous memory): there q and k are arrays of their own."""

    def __init__(self, flavour, call, buf=None, shift=0):
        c = call.case
        hq, hk = c.heads
        self.flavour, self.call = flavour, call
        host = call.buf if buf is None else buf
        self.shift = shift
        if shift:
            wide = np.zeros(host.shape[:-1] + (host.shape[-1] + shift,), host.dtype)
            wide[..., shift:] = host
            host = wide
        if flavour.name == "numba":
            self.buf = None
            q_host, k_host = (np.ascontiguousarray(a) for a in qkv_views(host[..., shift:], hq,
                                                                         hk, c.d))
            self.q, self.kw = flavour.make(q_host)
            self.k = flavour.make(k_host)[0]
        else:
            self.buf, self.kw = flavour.make(host)
            q_cols = slice(shift, shift + hq * c.d)
            k_cols = slice(shift + hq * c.d, shift + (hq + hk) * c.d)
            self.q = _view(self.buf, q_cols, call.q.shape)
            self.k = _view(self.buf, k_cols, call.k.shape)
        self.q_weight = flavour.make(call.q_weight)[0]
        self.k_weight = flavour.make(call.k_weight)[0]
        self.rope = dict(call.rope)
        if c.rope:
            self.rope["positions"] = device_ints(flavour, call.rope["positions"])
            self.rope["cos_sin_cache"] = flavour.make(call.rope["cos_sin_cache"])[0]

    def kwargs(self):
        return dict(weight_offset=self.call.case.offset, dtype=self.kw, **self.rope)

    def out_of_place(self):
        return rmsnorm_hip.qk_rms_norm(self.q, self.k, self.q_weight, self.k_weight, EPS,
                                       **self.kwargs())

    def in_place(self):
        return rmsnorm_hip.qk_rms_norm_(self.q, self.k, self.q_weight, self.k_weight, EPS,
                                        **self.kwargs())

    def host_buf(self):
        """The QKV buffer's bits now (without the guard elements)."""
        return to_host(self.buf, self.call.case.dtype)[..., self.shift:]

    def host_q_k(self):
        dtype = self.call.case.dtype
        return to_host(self.q, dtype), to_host(self.k, dtype)


def check_device_case(flavour, call):
    """test_qk.check_call's contract on the GPU, plus the scalar twin."""
    c = call.case
    hq, hk = c.heads
    original = call.buf.copy()
    dev = DeviceCall(flavour, call)

    q_out, k_out = dev.out_of_place()

    for out, x in ((q_out, call.q), (k_out, call.k)):
        check_output(flavour, out, c.dtype, x.shape)
    q_host, k_host = to_host(q_out, c.dtype), to_host(k_out, c.dtype)
    assert_close(q_host, call.ref(call.q, call.q_weight), c.dtype)
    assert_close(k_host, call.ref(call.k, call.k_weight), c.dtype)
    if dev.buf is not None:
        assert_bitwise(dev.host_buf(), original, "the QKV buffer after the out-of-place call")

    assert dev.in_place() is None
    q_in, k_in = dev.host_q_k()
    assert_bitwise(q_in, q_host, "q in place vs q_out")
    assert_bitwise(k_in, k_host, "k in place vs k_out")
    if dev.buf is not None:
        cols = (hq + hk) * c.d
        assert_bitwise(dev.host_buf()[..., cols:], original[..., cols:], "the v part and pad")

    for out, x, w, name in ((q_host, call.q, call.q_weight, "q"),
                            (k_host, call.k, call.k_weight, "k")):
        rows, kw = flavour.make(np.ascontiguousarray(x).reshape(-1, c.d))
        weight = flavour.make(w)[0]
        y = to_host(rmsnorm_hip.rms_norm(rows, weight, EPS, weight_offset=c.offset, dtype=kw),
                    c.dtype)
        assert_bitwise(out.reshape(-1, c.d)[:, c.rot:], y[:, c.rot:],
                       f"{name}'s unrotated elements vs rms_norm of its head rows")

    # the same buffer one element past its alignment: the scalar kernel, the same bits
    twin = DeviceCall(flavour, call, buf=original, shift=1)
    q_twin, k_twin = twin.out_of_place()
    assert_bitwise(to_host(q_twin, c.dtype), q_host, "q_out from a misaligned buffer")
    assert_bitwise(to_host(k_twin, c.dtype), k_host, "k_out from a misaligned buffer")


BY_NAME = {f.name: f for f in FLAVOURS}
CASES = ([(BY_NAME[lib], c) for lib in ("torch", "cupy") for c in MATRIX]
         + [(BY_NAME[lib], c) for lib in ("numba", "cai", "dlpack") for c in MATRIX
            if c.id in QUICK])


@pytest.mark.parametrize("flavour,case", [pytest.param(f, c, id=f"{f.name}-{c.id}")
                                          for f, c in CASES])
def test_matches_reference(rng, flavour, case):
    check_device_case(flavour, Call.make(rng, case))


# ---- batch invariance -----------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in MATRIX if c.id in QUICK and c.rope],
                         ids=lambda c: c.id)
def test_batch_invariance(rng, case):
    """A token's outputs are the bits of that token alone, wherever it sits among 33 tokens
    (torch views of one QKV buffer)."""
    torch_flavour = BY_NAME["torch"]
    batch = Call.make(rng, replace(case, lead=(33,)))
    q_out, k_out = (to_host(a, case.dtype)
                    for a in DeviceCall(torch_flavour, batch).out_of_place())
    for i in (0, 16, 32):
        alone = Call.make(rng, replace(case, lead=(1,)))
        alone.q[...], alone.k[...] = batch.q[i:i + 1], batch.k[i:i + 1]
        alone.q_weight, alone.k_weight = batch.q_weight, batch.k_weight
        alone.rope = dict(batch.rope, positions=batch.rope["positions"][i:i + 1])
        q1, k1 = (to_host(a, case.dtype)
                  for a in DeviceCall(torch_flavour, alone).out_of_place())
        assert_bitwise(q1[0], q_out[i], f"q of token {i} alone vs among 33")
        assert_bitwise(k1[0], k_out[i], f"k of token {i} alone vs among 33")


# ---- CUDA graphs ----------------------------------------------------------------------------

def torch_bits(t):
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def to_torch(host):
    if host.dtype == NUMPY[BFLOAT16]:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(np.ascontiguousarray(host)).to(DEVICE)


@pytest.mark.parametrize("case", [c for c in MATRIX if c.id in QUICK], ids=lambda c: c.id)
def test_cuda_graph_replay_is_bitwise_eager(rng, case):
    """rmsnorm_hip.torch.qk_rms_norm_ on views of a static QKV tensor and qk_rms_norm on another,
    captured in one CUDA graph: each replay, on new data and positions, gives the bits of the
    eager calls (no host sync in the call: the capture would fail)."""
    hq, hk = case.heads
    call = Call.make(rng, case)
    static = {"qkv": to_torch(call.buf), "src": to_torch(call.buf),
              "q_weight": to_torch(call.q_weight), "k_weight": to_torch(call.k_weight)}
    rope = {}
    if case.rope:
        static["positions"] = to_torch(call.rope["positions"])
        static["cache"] = to_torch(call.rope["cos_sin_cache"])
        rope = dict(positions=static["positions"], cos_sin_cache=static["cache"],
                    rope_style=case.rope, rotary_dim=case.rotary_dim)

    def views(qkv):
        q = qkv[..., :hq * case.d].unflatten(-1, (hq, case.d))
        k = qkv[..., hq * case.d:(hq + hk) * case.d].unflatten(-1, (hk, case.d))
        return q, k

    def run(qkv, src):
        rt.qk_rms_norm_(*views(qkv), static["q_weight"], static["k_weight"], EPS,
                        weight_offset=case.offset, **rope)
        return rt.qk_rms_norm(*views(src), static["q_weight"], static["k_weight"], EPS,
                              weight_offset=case.offset, **rope)

    side = torch.cuda.Stream()           # warm-up off the capture: kernel builds, allocator
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run(static["qkv"].clone(), static["src"])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_q, graph_k = run(static["qkv"], static["src"])

    for replay in range(2):
        fresh = Call.make(rng, case)
        with torch.no_grad():
            static["qkv"].copy_(to_torch(fresh.buf))
            static["src"].copy_(to_torch(fresh.buf))
            if case.rope:
                static["positions"].copy_(to_torch(fresh.rope["positions"]))
        expected_qkv = static["qkv"].clone()
        expected_q, expected_k = run(expected_qkv, static["src"].clone())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(torch_bits(static["qkv"]), torch_bits(expected_qkv)), (
            f"replay {replay}: the QKV tensor written in place")
        assert torch.equal(torch_bits(graph_q), torch_bits(expected_q)), f"replay {replay}: q"
        assert torch.equal(torch_bits(graph_k), torch_bits(expected_k)), f"replay {replay}: k"


# ---- repeat calls -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", [replace(c, pad=0) for c in MATRIX if c.id in QUICK and c.rope],
                         ids=lambda c: c.id)
def test_repeat_calls(rng, monkeypatch, case):
    """A call repeating an earlier one's metadata launches without full validation (qk._qk
    not called), with the first call's bits, in place and out of place, on other data; one
    element off its alignment (same metadata) it takes the scalar kernel, same bits.  Full
    validation still refuses, with the same metadata, a k moved onto q and a weight inside q."""
    from rmsnorm_hip import functional
    from rmsnorm_hip import qk as qk_module
    from rmsnorm_hip.kernels import _config
    functional.forget_plans()
    forms = []
    qk_spec = _config.qk_spec
    monkeypatch.setattr(_config, "qk_spec",
                        lambda *a, **kw: forms.append(a[3]) or qk_spec(*a, **kw))
    hq, hk = case.heads
    call = Call.make(rng, case)
    rope = {name: to_torch(a) if isinstance(a, np.ndarray) else a
            for name, a in call.rope.items()}
    weights = to_torch(call.q_weight), to_torch(call.k_weight)

    def views(qkv, at=hq):
        q = qkv[..., :hq * case.d].unflatten(-1, (hq, case.d))
        k = qkv[..., at * case.d:(at + hk) * case.d].unflatten(-1, (hk, case.d))
        return q, k

    def shifted(t):     # the same shape and strides one element past t's alignment
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE)[1:].view(t.shape)
        return flat.copy_(t)

    full = []
    shipped = qk_module._qk
    monkeypatch.setattr(qk_module, "_qk", lambda *a, **kw: full.append(a[0]) or shipped(*a, **kw))
    first = to_torch(call.buf)
    expected = first.clone()
    rmsnorm_hip.qk_rms_norm_(*views(expected), *weights, EPS, weight_offset=case.offset, **rope)
    expected_out = rmsnorm_hip.qk_rms_norm(*views(first), *weights, EPS,
                                           weight_offset=case.offset, **rope)
    assert full == ["qk_rms_norm_", "qk_rms_norm"]
    for qkv in (first.clone(), shifted(first)):
        out = rmsnorm_hip.qk_rms_norm(*views(qkv), *weights, EPS, weight_offset=case.offset,
                                      **rope)
        rmsnorm_hip.qk_rms_norm_(*views(qkv), *weights, EPS, weight_offset=case.offset, **rope)
        assert torch.equal(torch_bits(qkv), torch_bits(expected)), "in place, repeated"
        for got, want, what in zip(out, expected_out, ("q_out", "k_out")):
            assert torch.equal(torch_bits(got), torch_bits(want)), f"{what}, repeated"
    assert full == ["qk_rms_norm_", "qk_rms_norm"], full
    assert True in forms and forms[-1] is False, f"kernel forms built (vector?): {forms}"

    qkv = first.clone()
    with pytest.raises(ValueError, match="overlaps"):    # k's columns now inside q's
        rmsnorm_hip.qk_rms_norm_(*views(qkv, at=hq - 1), *weights, EPS,
                                 weight_offset=case.offset, **rope)
    if weights[0].dtype == qkv.dtype:       # q_weight: q's first head row, a (D,) view
        inside = qkv.reshape(-1, qkv.shape[-1])[0, :case.d]
        with pytest.raises(ValueError, match="overlaps"):
            rmsnorm_hip.qk_rms_norm_(*views(qkv), inside, weights[1], EPS,
                                     weight_offset=case.offset, **rope)
    assert torch.equal(torch_bits(qkv), torch_bits(first)), "refused calls wrote nothing"


# ---- positions outside the cache ------------------------------------------------------------

@pytest.mark.parametrize("bad", [MAX_POSITION, -1, 2**31 - 1])
@pytest.mark.parametrize("case", [SIM_CASES[1][0], SIM_CASES[3][0]], ids=lambda c: c.id)
@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_position_outside_the_cache(rng, lib, case, bad):
    """The GPU does not check positions: the token whose position lies outside the cache gets
    NaN over the rotated elements of all its heads, its other elements are rms_norm's; the other
    tokens keep the bits of an in-range call; nothing outside q and k (in place) is written,
    and no cache row is read (a huge position does not fault)."""
    flavour = BY_NAME[lib]
    call = Call.make(rng, replace(case, lead=(3,)), positions=[5, 11, 7])
    original = call.buf.copy()
    good = [to_host(a, case.dtype) for a in DeviceCall(flavour, call).out_of_place()]
    call.rope["positions"][1] = bad
    dev = DeviceCall(flavour, call)

    outs = [to_host(a, case.dtype) for a in dev.out_of_place()]
    assert dev.in_place() is None
    in_place = dev.host_q_k()

    rot = case.rot
    for name, out, expected, written in zip("qk", outs, good, in_place):
        assert np.isnan(out[1, :, :rot].astype(np.float32)).all(), f"{name}: rotated part"
        assert_bitwise(out[1, :, rot:], expected[1, :, rot:], f"{name}: unrotated part")
        assert_bitwise(out[0::2], expected[0::2], f"{name}: the other tokens")
        assert_bitwise(written, out, f"{name} in place vs out of place")
    cols = sum(case.heads) * case.d
    assert_bitwise(dev.host_buf()[..., cols:], original[..., cols:], "the v part and pad")
    assert_bitwise(to_host(dev.rope["cos_sin_cache"], case.cache), call.rope["cos_sin_cache"],
                   "the cache")

