"""Issue 9, two GPUs (mark ``device``; the module is skipped, with the reason, where fewer than two
CUDA GPUs are visible or the simulator is on):

- every entry point (rms_norm, rms_norm_backward, fused_add_rms_norm, fused_add_rms_norm_,
  rms_norm_quant) and the torch adapter forward and backward (RMSNorm, fused_add_rms_norm, the
  custom ops through the dispatcher, rms_norm_quant) on tensors of cuda:1 while cuda:0 is
  current, and the reverse: outputs on the tensors' device, bitwise those of the same call with
  that device current; torch's current device, the driver's current context and both devices'
  current streams unchanged afterwards.  The same from a new thread (no context bound yet).
- cuda:0 and cuda:1 give bitwise the same outputs (same arch), and rms_norm matches float64.
- the kernel cache holds one kernel per device (rmsnorm_hip._cache keys carry the device
  index): a call on cuda:1 builds its own kernels, every launch for cuda:1 tensors runs a cuda:1
  kernel (recorded at CudaBackend.launch) also after cuda:0's are cached, each built once.
- non-default streams (torch.cuda.Stream(device=...)) on either device, the other current:
  every launch on that stream, correct results after stream.synchronize().
- DDP and FSDP2 through NCCL, one process per GPU, a bf16 TinyLM with our RMSNorm against
  torch.nn.RMSNorm over 20 steps (tests/_ddp.py; NCCL_NVLS_ENABLE=0).

On a machine with two GPUs:

    bash benchmarks/multi_gpu.sh        # log and JUnit XML under $OUT
"""
import threading

import pytest

pytestmark = pytest.mark.device

from conftest import require_cuda_torch  # noqa: E402

torch = require_cuda_torch(min_devices=2)

import _ddp  # noqa: E402
import rmsnorm_hip  # noqa: E402
from conftest import assert_close  # noqa: E402
from rmsnorm_hip import _cache, functional, reference  # noqa: E402
from rmsnorm_hip import torch as rt  # noqa: E402
from rmsnorm_hip.backends.cuda import CudaBackend  # noqa: E402

M, N = 67, 4096
BF16 = torch.bfloat16
PAIRS = [pytest.param(1, 0, id="cuda1-while-cuda0-current"),
         pytest.param(0, 1, id="cuda0-while-cuda1-current")]


@pytest.fixture(autouse=True)
def _restore_device_and_streams():
    device = torch.cuda.current_device()
    yield
    for index in range(2):
        with torch.cuda.device(index):
            torch.cuda.set_stream(torch.cuda.default_stream(index))
    torch.cuda.set_device(device)


# ---- helpers -------------------------------------------------------------------------------------

def bits(t):
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (
        f"{what}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}")
    a, b = bits(a).cpu(), bits(b).cpu()
    diff = (a != b).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ bitwise"


def driver_context():
    """This thread's current CUDA context (driver API) as an int, or None where cuda.bindings is
    not installed (the check is then skipped)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    err, context = driver.cuCtxGetCurrent()
    assert int(err) == 0, f"cuCtxGetCurrent: {err}"
    return int(context)


def caller_state():
    """What a call must leave as it found it: torch's current device, the driver's current
    context, and the current stream of each device."""
    return dict(device=torch.cuda.current_device(), context=driver_context(),
                streams=tuple(torch.cuda.current_stream(i).cuda_stream for i in range(2)))


def inputs(index, n=N, seed=0):
    """bf16 x, residual, dy and weight, float32 xscale, made on the host and copied to
    cuda:index (the same values for either device)."""
    g = torch.Generator().manual_seed(seed)
    device = torch.device("cuda", index)

    def rand(*shape, loc=0.0, scale=1.0):
        return (loc + scale * torch.randn(*shape, generator=g)).to(BF16).to(device)

    return dict(x=rand(M, n), r=rand(M, n), dy=rand(M, n), w=rand(n, loc=1.0, scale=0.1),
                s=(0.5 + torch.rand(n, generator=g)).to(device))


def _leaf(t):
    return t.detach().clone().requires_grad_()


# Every entry point, called on the tensors of ``t``; each returns its output tensors.

def call_rms_norm(t):
    return rmsnorm_hip.rms_norm(t["x"], t["w"], 1e-6, return_rstd=True)


def call_rms_norm_backward(t):
    _, rstd = rmsnorm_hip.rms_norm(t["x"], t["w"], 1e-6, return_rstd=True)
    dx_recomputed, _ = rmsnorm_hip.rms_norm_backward(t["dy"], t["x"], t["w"])
    dx, dweight = rmsnorm_hip.rms_norm_backward(t["dy"], t["x"], t["w"], rstd,
                                                dresidual=t["r"])
    return dx, dweight, dx_recomputed


def call_fused_add_rms_norm(t):
    return rmsnorm_hip.fused_add_rms_norm(t["x"], t["r"], t["w"], 1e-6, return_rstd=True)


def call_fused_add_rms_norm_(t):
    x, r = t["x"].clone(), t["r"].clone()
    assert rmsnorm_hip.fused_add_rms_norm_(x, r, t["w"], 1e-6) is None
    return x, r


def call_rms_norm_quant(t):
    int8 = rmsnorm_hip.rms_norm_quant(t["x"], t["w"], xscale=t["s"])
    fp8 = rmsnorm_hip.rms_norm_quant(t["x"], t["w"], residual=t["r"],
                                     quant_dtype="float8_e4m3fn")
    return (*int8, *fp8)


def torch_module(t):
    x = _leaf(t["x"])
    norm = rt.RMSNorm(x.shape[-1], eps=1e-6, device=x.device, dtype=BF16)
    with torch.no_grad():
        norm.weight.copy_(t["w"])
    y = norm(x)
    y.backward(t["dy"])
    return y, x.grad, norm.weight.grad


def torch_fused(t):
    x, r, w = _leaf(t["x"]), _leaf(t["r"]), _leaf(t["w"])
    y, residual_out = rt.fused_add_rms_norm(x, r, w, 1e-6)
    torch.autograd.backward((y, residual_out), (t["dy"], t["r"]))
    return y, residual_out, x.grad, r.grad, w.grad


def torch_ops(t):
    """Through the dispatcher: the custom op and its registered autograd (torch.compile's path)."""
    x, w = _leaf(t["x"]), _leaf(t["w"])
    y = torch.ops.rmsnorm_hip.rms_norm_fwd(x, w, 1e-6, 0.0)[0]
    y.backward(t["dy"])
    return y, x.grad, w.grad


def torch_quant(t):
    return rt.rms_norm_quant(t["x"], t["w"], xscale=t["s"], residual=t["r"],
                             quant_dtype="float8_e4m3fn")


CALLS = {
    "rms_norm": call_rms_norm,
    "rms_norm_backward": call_rms_norm_backward,
    "fused_add_rms_norm": call_fused_add_rms_norm,
    "fused_add_rms_norm_": call_fused_add_rms_norm_,
    "rms_norm_quant": call_rms_norm_quant,
    "torch.RMSNorm": torch_module,
    "torch.fused_add_rms_norm": torch_fused,
    "torch.ops": torch_ops,
    "torch.rms_norm_quant": torch_quant,
}


def at_home(fn, t):
    """``fn(t)`` with the tensors' device current (the reference)."""
    index = t["x"].device.index
    torch.cuda.set_device(index)
    out = fn(t)
    torch.cuda.synchronize(index)
    return out


def elsewhere(fn, t, current):
    """``fn(t)`` with cuda:``current`` current; asserts the caller's state is unchanged."""
    torch.cuda.set_device(current)
    before = caller_state()
    out = fn(t)
    after = caller_state()
    assert after == before, f"the call changed the caller's state: {before} -> {after}"
    torch.cuda.synchronize(t["x"].device)
    return out


def assert_outputs(got, expected, device, what):
    assert len(got) == len(expected), f"{what}: {len(got)} outputs, expected {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.device == device, f"{what} output {i} is on {a.device}, expected {device}"
        assert_same_bits(a, b, f"{what} output {i}")


def record_launches(monkeypatch):
    """(device index, kernel, stream) of every CudaBackend launch from now on.  The forward's
    repeat-call runners keep the launch method they were built with: emptied first."""
    monkeypatch.setattr(functional, "_fwd_runners", {})
    monkeypatch.setattr(functional, "_bwd_runners", {})
    monkeypatch.setattr(functional, "_fused_runners", {})
    launches = []
    original = CudaBackend.launch

    def recording(self, kernel, grid, block, args, stream):
        launches.append((self.device_index, kernel, int(stream)))
        return original(self, kernel, grid, block, args, stream)

    monkeypatch.setattr(CudaBackend, "launch", recording)
    return launches


# ---- every entry point on the device that is not current -----------------------------------------

@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("target,current", PAIRS)
def test_entry_point_on_the_other_device(name, target, current):
    t = inputs(target)
    expected = at_home(CALLS[name], t)
    got = elsewhere(CALLS[name], t, current)
    assert_outputs(got, expected, t["x"].device, f"{name} on cuda:{target}, cuda:{current} current")


@pytest.mark.parametrize("target", [0, 1])
def test_entry_points_from_a_new_thread(target):
    """A thread that has made no CUDA call yet has no context bound when the first launch comes."""
    t = inputs(target)
    expected = {name: at_home(fn, t) for name, fn in CALLS.items()}
    result = {}

    def body():
        try:
            result["got"] = {name: fn(t) for name, fn in CALLS.items()}
            torch.cuda.synchronize(target)
        except BaseException as exc:     # re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    for name in CALLS:
        assert_outputs(result["got"][name], expected[name], t["x"].device,
                       f"{name} on cuda:{target} from a new thread")


def test_both_devices_give_the_same_bits_and_match_float64():
    outs = {index: {name: at_home(fn, inputs(index)) for name, fn in CALLS.items()}
            for index in (0, 1)}
    cc = [torch.cuda.get_device_capability(i) for i in (0, 1)]
    if cc[0] == cc[1]:              # the same kernels on the same arch: the same bits
        for name in CALLS:
            for i, (a, b) in enumerate(zip(outs[0][name], outs[1][name])):
                assert_same_bits(a, b, f"{name} output {i}: cuda:0 vs cuda:1")
    t = inputs(0)
    y_ref, rstd_ref = reference.rms_norm_ref(t["x"].cpu(), t["w"].cpu(), 1e-6)
    for index in (0, 1):
        y, rstd = outs[index]["rms_norm"]
        assert_close(y.double().cpu().numpy(), y_ref, "bfloat16")
        assert_close(rstd.double().cpu().numpy(), rstd_ref, "float32")


# ---- the kernel cache, per device ----------------------------------------------------------------

def _kernels(index):
    return {key: kernel for key, kernel in _cache.entries().items()
            if key[0] == "cuda" and key[2] == index}


def _assert_launched(launches, index, what):
    assert launches, f"{what}: nothing was launched"
    own = {id(k) for k in _kernels(index).values()}
    other = {id(k) for k in _kernels(1 - index).values()}
    for device, kernel, _ in launches:
        assert device == index, f"{what}: launched by the cuda:{device} backend"
        assert id(kernel) not in other, f"{what}: {kernel.name} of cuda:{1 - index} launched"
        assert id(kernel) in own, f"{what}: {kernel.name} is not a cached cuda:{index} kernel"


FUNCTIONAL = [CALLS[name] for name in ("rms_norm", "rms_norm_backward", "fused_add_rms_norm",
                                        "fused_add_rms_norm_", "rms_norm_quant")]


def test_kernel_cache_is_per_device(monkeypatch):
    """n = 2560 is used by no other test: its kernels are built here, first for cuda:0, then
    for cuda:1 with cuda:0's cached.  The five entry points build every kind of kernel (forward,
    fused, quantised, backward, dweight reduction); the adapter runs the same ones."""
    launches = record_launches(monkeypatch)
    t0, t1 = inputs(0, n=2560), inputs(1, n=2560)

    def run_all(t, current):
        launches.clear()
        torch.cuda.set_device(current)
        for fn in FUNCTIONAL:
            fn(t)
        torch.cuda.synchronize(t["x"].device)
        assert torch.cuda.current_device() == current
        return {id(kernel): kernel for _, kernel, _ in launches}

    keys1 = set(_kernels(1))
    launched0 = run_all(t0, current=0)
    assert set(_kernels(1)) == keys1, "calls on cuda:0 tensors built kernels for cuda:1"
    _assert_launched(launches, 0, "cuda:0 tensors, cuda:0 current")

    # cuda:0's kernels are cached now: cuda:1 tensors must get kernels of their own
    launched1 = run_all(t1, current=0)
    _assert_launched(launches, 1, "cuda:1 tensors, cuda:0 current")
    key_of = {id(kernel): key for key, kernel in _cache.entries().items()}
    twins = {key[3:]: kernel for key, kernel in _kernels(0).items()}     # (builder, spec)
    assert len(launched1) == len(launched0), (
        f"cuda:1 launched {len(launched1)} distinct kernels, cuda:0 {len(launched0)}")
    for kernel in launched1.values():
        key = key_of[id(kernel)]
        twin = twins.get(key[3:])
        assert twin is not None, f"{key[3]} {key[4]}: launched on cuda:1, never built for cuda:0"
        assert kernel is not twin and kernel.handle != twin.handle, f"{key[3]}: one kernel"
        assert int(kernel.module) != int(twin.module), f"{key[3]}: one module for two devices"

    # both cached: every call still launches its own device's kernels, nothing is rebuilt
    run_all(t0, current=1)
    _assert_launched(launches, 0, "cuda:0 tensors, cuda:1 current (cache hit)")
    run_all(t1, current=1)
    _assert_launched(launches, 1, "cuda:1 tensors, cuda:1 current (cache hit)")
    run_all(t1, current=0)
    _assert_launched(launches, 1, "cuda:1 tensors, cuda:0 current (cache hit)")
    for kernel in list(launched0.values()) + list(launched1.values()):
        key = key_of[id(kernel)]
        assert _cache.builds[key] == 1, f"{key[:4]} built {_cache.builds[key]} times"


# ---- non-default streams -------------------------------------------------------------------------

@pytest.mark.parametrize("target,current", PAIRS)
def test_non_default_stream_of_the_other_device(target, current, monkeypatch):
    """The tensors' device has a side stream current while the other device is current: every
    launch goes to that stream (behind a busy kernel), results are right after it syncs."""
    t = inputs(target)
    expected = {name: at_home(fn, t) for name, fn in CALLS.items()}
    launches = record_launches(monkeypatch)
    stream = torch.cuda.Stream(device=target)
    torch.cuda.set_stream(stream)       # makes cuda:target current too
    torch.cuda.set_device(current)
    assert torch.cuda.current_stream(target) == stream
    assert torch.cuda.current_device() == current
    stream.wait_stream(torch.cuda.default_stream(target))  # the inputs were written there
    with torch.cuda.device(target):
        torch.cuda._sleep(20_000_000)   # ~10 ms of work queued ahead on the side stream
    before = caller_state()
    got = {name: fn(t) for name, fn in CALLS.items()}
    after = caller_state()
    assert after == before, f"the calls changed the caller's state: {before} -> {after}"
    streams = {s for _, _, s in launches}
    assert launches and streams == {stream.cuda_stream}, (
        f"launched on streams {sorted(streams)}, expected only {stream.cuda_stream}")
    assert {d for d, _, _ in launches} == {target}
    stream.synchronize()
    for name in CALLS:
        assert_outputs(got[name], expected[name], t["x"].device,
                       f"{name} on a side stream of cuda:{target}, cuda:{current} current")


# ---- data parallel through NCCL, one process per GPU ---------------------------------------------

needs_nccl = pytest.mark.skipif(not (torch.distributed.is_available()
                                     and torch.distributed.is_nccl_available()),
                                reason="this torch build has no NCCL")


@needs_nccl
def test_ddp_nccl_bf16_matches_torch_rmsnorm(tmp_path):
    cfg = _ddp.Config("nccl", "ddp", steps=20, dtype="bfloat16", noise=True)
    _ddp.check(_ddp.run(cfg, tmp_path, timeout=240), cfg)


@needs_nccl
def test_fsdp_nccl_bf16_matches_torch_rmsnorm(tmp_path):
    import torch.distributed.fsdp as fsdp
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    cfg = _ddp.Config("nccl", "fsdp", steps=20, dtype="bfloat16", noise=True)
    try:
        records = _ddp.run(cfg, tmp_path, timeout=240)
    except torch.multiprocessing.ProcessRaisedException as exc:
        if _ddp.raised_outside(exc):
            pytest.xfail(f"FSDP2 over NCCL failed in torch's own model: {_ddp.last_line(exc)}")
        raise
    _ddp.check(records, cfg)
