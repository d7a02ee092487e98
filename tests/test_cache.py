"""The compiled-kernel cache (src/rmsnorm_hip/_cache.py): one build per kernel key, reused across
M, separate builds per spec, and one build when threads race on a fresh key."""
import functools
import threading
import time
from collections import Counter

import pytest
from conftest import aligned_copy, assert_bitwise, random_array

from rmsnorm_hip import _cache, backends, rms_norm
from rmsnorm_hip.kernels import _config, cpu_rmsnorm

pytestmark = pytest.mark.quick


@pytest.fixture
def fresh(monkeypatch):
    """An empty kernel cache and build counter, and no backend objects (they memoise plans), for
    the test only; the process-wide ones come back afterwards."""
    monkeypatch.setattr(_cache, "_kernels", {})
    monkeypatch.setattr(_cache, "builds", Counter())
    monkeypatch.setattr(backends, "_backends", {})
    return _cache


def fwd_keys(cache):
    return {k: v for k, v in cache.builds.items() if any("rmsnorm_fwd" in str(p) for p in k)}


def test_cpu_one_build_for_every_m(fresh, rng):
    w = random_array(rng, 127, "float32")
    y_small = rms_norm(random_array(rng, (3, 127), "float32"), w)
    assert len(fwd_keys(fresh)) == 1
    y_large = rms_norm(random_array(rng, (333, 127), "float32"), w)
    rms_norm(random_array(rng, (1, 127), "float32"), w)

    builds = fwd_keys(fresh)
    assert list(builds.values()) == [1], builds
    key, = builds
    assert key[:3] == ("cpu", "host", -1) and "float32" in key, key
    assert y_small.shape == (3, 127) and y_large.shape == (333, 127)


@pytest.mark.sim
def test_sim_one_build_per_spec_for_every_m(fresh, use_backend, rng):
    use_backend("sim")
    w = aligned_copy(random_array(rng, 24, "float32"))
    # vector path: the streamed grid up to FWD_STREAM_ROWS_PER_SM rows per SM (the simulator
    # has one), the one-shot grid above; one kernel each, whatever M
    limit = _config.FWD_STREAM_ROWS_PER_SM["cuda"]["plain"]
    for m in (3, 40, 1, limit, limit + 1, 2):
        rms_norm(aligned_copy(random_array(rng, (m, 24), "float32")), w)
    builds = fwd_keys(fresh)
    assert list(builds.values()) == [1, 1], builds
    assert {k[-1].stream for k in builds} == {True, False}
    for m in (2, 5):                                           # scalar path: its own kernel
        rms_norm(aligned_copy(random_array(rng, (m, 24), "float32"), offset=4), w)
    rms_norm(aligned_copy(random_array(rng, (4, 24), "float32")), None)  # no weight: another

    builds = fwd_keys(fresh)
    assert sorted(builds.values()) == [1, 1, 1, 1], builds
    specs = [k[-1] for k in builds]
    assert {(s.vector, s.weight, s.stream) for s in specs} == {
        (True, "float32", True), (True, "float32", False), (False, "float32", False),
        (True, "", True)}
    assert all(k[:2] == ("sim", "sim32") for k in builds), builds


def race(n_threads, call):
    """Runs ``call()`` on ``n_threads`` threads released together; returns their results."""
    barrier = threading.Barrier(n_threads)
    results, errors = [None] * n_threads, []

    def work(i):
        try:
            barrier.wait()
            results[i] = call()
        except BaseException as exc:  # re-raised below on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def test_cpu_concurrent_first_calls_build_once(fresh, monkeypatch, rng):
    """8 threads call on a fresh key at once.  numba compiles lazily, so the builder returns in
    microseconds; it is slowed down to hold the race window open."""
    build = cpu_rmsnorm.make_cpu_rmsnorm_fwd

    @functools.wraps(build)
    def slow_build(*args):
        time.sleep(0.3)
        return build(*args)

    monkeypatch.setattr(cpu_rmsnorm, "make_cpu_rmsnorm_fwd", slow_build)
    x = random_array(rng, (64, 333), "bfloat16")
    w = random_array(rng, 333, "float32")

    results = race(8, lambda: rms_norm(x, w))

    assert list(fwd_keys(fresh).values()) == [1], fwd_keys(fresh)
    for y in results[1:]:
        assert_bitwise(y, results[0], "results of racing threads")


@pytest.mark.sim
def test_gpu_backend_concurrent_first_calls_build_once(fresh, use_backend, monkeypatch, rng):
    """The GPU dispatch (plans, kernel cache) raced by 8 threads.  The simulator cannot run two
    kernels at once, so launches are recorded instead of run, and each build is slowed down."""
    be = use_backend("sim")
    launched = []
    compile_ = be.compile

    def slow_compile(*args):
        time.sleep(0.3)
        return compile_(*args)

    monkeypatch.setattr(be, "compile", slow_compile)
    monkeypatch.setattr(be, "launch", lambda kernel, grid, block, args, like:
                        launched.append((kernel, grid, block)))
    x = aligned_copy(random_array(rng, (16, 128), "bfloat16"))

    race(8, lambda: rms_norm(x))

    assert list(fwd_keys(fresh).values()) == [1], fwd_keys(fresh)
    assert len(launched) == 8, launched
    assert len({id(kernel) for kernel, _, _ in launched}) == 1, "threads got different kernels"


@pytest.mark.sim
def test_sim_fused_switches_are_in_the_key(fresh, use_backend, rng):
    """Each fused switch (residual, quant dtype, xscale dtype) is its own kernel, built once
    whatever M: a kernel is never served to a call with another switch."""
    from rmsnorm_hip import fused_add_rms_norm, rms_norm_quant
    use_backend("sim")
    w = aligned_copy(random_array(rng, 24, "float32"))
    xs = aligned_copy(random_array(rng, 24, "float32"))
    for m in (3, 1):
        x = aligned_copy(random_array(rng, (m, 24), "float32"))
        r = aligned_copy(random_array(rng, (m, 24), "float32"))
        fused_add_rms_norm(x, r, w)
        rms_norm_quant(x, w)
        rms_norm_quant(x, w, quant_dtype="float8_e4m3fn")
        rms_norm_quant(x, w, xscale=xs)
        rms_norm_quant(x, w, residual=r)

    builds = fwd_keys(fresh)
    assert sorted(builds.values()) == [1] * 5, builds
    specs = {key[-1] for key in builds}
    assert {(s.residual, s.quant, s.xscale) for s in specs} == {
        (True, "", ""), (False, "int8", ""), (False, "float8_e4m3fn", ""),
        (False, "int8", "float32"), (True, "int8", "")}


def _slow(monkeypatch, module, name, seconds=0.3):
    """Slows ``module.name`` (a kernel builder) down, to hold the race window open."""
    build = getattr(module, name)

    @functools.wraps(build)
    def slow_build(*args):
        time.sleep(seconds)
        return build(*args)

    monkeypatch.setattr(module, name, slow_build)


@pytest.mark.parametrize("op", ["fwd", "fused", "fused_", "quant", "bwd"])
def test_cpu_concurrent_first_calls_every_entry_point(fresh, monkeypatch, rng, op):
    """8 threads make the first calls of one entry point at once, each on its own rows (3 to 10
    of them) with one shared weight: every kernel key is built exactly once, and every thread's
    result is within the contract of the float64 reference."""
    from rmsnorm_hip import (_numerics, fused_add_rms_norm, fused_add_rms_norm_,
                             rms_norm_backward, rms_norm_quant)
    from rmsnorm_hip.reference import (fused_add_rms_norm_ref, rms_norm_backward_ref,
                                       rms_norm_quant_ref, rms_norm_ref)
    for name in ("make_cpu_rmsnorm_fwd", "make_cpu_fused_fwd", "make_cpu_rmsnorm_bwd"):
        _slow(monkeypatch, cpu_rmsnorm, name)
    n = 301
    w = random_array(rng, n, "float32", loc=1.0, scale=0.1)
    data = [tuple(random_array(rng, (3 + i, n), "bfloat16") for _ in range(3)) for i in range(8)]
    slot = iter(range(8))
    lock = threading.Lock()

    def call():
        with lock:
            x, r, dy = data[next(slot)]
        if op == "fwd":
            return x, rms_norm(x, w)
        if op == "fused":
            return x, fused_add_rms_norm(x, r, w)[0]
        if op == "fused_":
            xc, rc = x.copy(), r.copy()
            fused_add_rms_norm_(xc, rc, w)
            return x, xc
        if op == "quant":
            return x, rms_norm_quant(x, w, residual=r, quant_dtype="float8_e4m3fn")
        return x, rms_norm_backward(dy, x, w)

    results = race(8, call)

    # one kernel per entry point (the backward's dweight sum its second)
    assert len(fresh.builds) == (2 if op == "bwd" else 1), fresh.builds
    assert set(fresh.builds.values()) == {1}, fresh.builds
    for x, out in results:
        i = next(k for k, d in enumerate(data) if d[0] is x)
        _, r, dy = data[i]
        if op == "fwd":
            ok = _numerics.within_contract(out, rms_norm_ref(x, w)[0], "bfloat16")[0]
        elif op in ("fused", "fused_"):
            ok = _numerics.within_contract(out, fused_add_rms_norm_ref(x, r, w)[0], "bfloat16")[0]
        elif op == "quant":
            q_ref, yscale_ref, _ = rms_norm_quant_ref(x, w, residual=r,
                                                      quant_dtype="float8_e4m3fn")
            ok = _numerics.quant_within_contract(out[0], out[1], q_ref, yscale_ref,
                                                 "float8_e4m3fn")[0]
        else:
            dx_ref, dw_ref = rms_norm_backward_ref(dy, x, w)
            s = abs(dy.astype(float) * w * rms_norm_ref(x)[1][:, None])
            ok = (_numerics.dx_within_contract(out[0], dx_ref, s, "bfloat16")[0]
                  and _numerics.dweight_within_contract(out[1], dw_ref, "float32"))
        assert ok, f"thread on rows {x.shape[0]}: result outside the contract"


def _kernel_over(scale, offset, late=False):
    """A builder's shape: helpers closing over spec values, a kernel closing over the helpers
    (``late``: a helper whose cell is bound only after it is defined)."""
    def inner(v):
        return v * scale

    def outer(v):
        return inner(v) + offset

    def kernel(v):
        return outer(v) + (after(v) if late else 0.0)

    if late:
        def after(v):
            return v
    return kernel, outer, inner


def test_helpers_equal_in_code_and_values_are_shared():
    """kernels._sharing.share_helpers: a second kernel whose helpers close over equal values
    calls the first kernel's helpers (so numba compiles them once); a helper over other values
    (-0.0 against 0.0 included) stays its own, as does a kernel's own closure; the kernels
    compute what they did."""
    from rmsnorm_hip.kernels._sharing import share_helpers

    def helpers(kernel):    # name -> value of the closure's bound cells
        bound = {}
        for name, cell in zip(kernel.__code__.co_freevars, kernel.__closure__):
            try:
                bound[name] = cell.cell_contents
            except ValueError:
                pass
        return bound

    first, second, other, signed = (_kernel_over(*args) for args in
                                    ((2.0, 1.0), (2.0, 1.0), (3.0, 1.0), (2.0, -0.0)))
    zero = _kernel_over(2.0, 0.0)
    for kernel, _, _ in (first, second, other, signed, zero):
        share_helpers(kernel)
    assert helpers(second[0])["outer"] is first[1]
    assert helpers(other[0])["outer"] is other[1] and other[1] is not first[1]
    assert helpers(zero[0])["outer"] is zero[1]
    assert helpers(signed[0])["outer"] is signed[1]
    # outer's own inner (over 2.0) is the first kernel's inner, whatever offset outer has
    assert signed[1].__closure__[0].cell_contents is first[2]
    assert [k[0](1.5) for k in (first, second, other, signed, zero)] == [4.0, 4.0, 5.5, 3.0, 3.0]
    late = _kernel_over(2.0, 1.0, late=True)
    share_helpers(late[0])
    assert late[0](1.5) == 5.5 and helpers(late[0])["outer"] is first[1]
