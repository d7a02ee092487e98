"""The CPU backend's row pool (backends/cpu.RowPool): small calls on the caller's thread, large
ones split over at most the usable cores, the same bits whatever the split, no thread spinning
while idle, and forked children that can call the library after the parent ran the pool."""
import multiprocessing
import resource
import time

import numpy as np
import pytest
from conftest import assert_bitwise, random_array

import rmsnorm_hip
from rmsnorm_hip import backends
from rmsnorm_hip.backends import cpu as cpu_backend

pytestmark = pytest.mark.quick

BIG = (257, 4096)            # past PARALLEL_MIN_ELEMENTS


def test_small_calls_stay_on_the_callers_thread():
    pool = cpu_backend.RowPool(threads=8)
    assert pool.ranges(1, 4096) == [(0, 1)]
    assert pool.ranges(64, 64 * 4096) == [(0, 64)]
    assert pool.ranges(3, cpu_backend.PARALLEL_MIN_ELEMENTS) == [(0, 1), (1, 2), (2, 3)]
    ranges = pool.ranges(*BIG[:1], BIG[0] * BIG[1])
    assert len(ranges) == 8 and ranges[0][0] == 0 and ranges[-1][1] == BIG[0]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert cpu_backend.RowPool().threads == cpu_backend._cores()


@pytest.mark.parametrize("op", ["rms_norm", "fused", "quant", "backward"])
def test_any_split_gives_the_same_bits(rng, monkeypatch, op):
    x, r = (random_array(rng, BIG, "bfloat16") for _ in range(2))
    w = random_array(rng, BIG[1:], "float32", loc=1.0, scale=0.1)
    call = {"rms_norm": lambda: rmsnorm_hip.rms_norm(x, w, return_rstd=True),
            "fused": lambda: rmsnorm_hip.fused_add_rms_norm(x, r, w, return_rstd=True),
            "quant": lambda: rmsnorm_hip.rms_norm_quant(x, w, residual=r, xscale=w),
            "backward": lambda: rmsnorm_hip.rms_norm_backward(r, x, w)}[op]
    be = backends.get("cpu")
    results = []
    for threads in (1, 3, 7):
        monkeypatch.setattr(be, "pool", cpu_backend.RowPool(threads))
        results.append(call())
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise(a, b, f"{op}: 1 thread vs several")


def test_idle_pool_does_not_spin(rng):
    """After a large call, the pool's threads sleep: the process burns (almost) no CPU time
    while the caller waits."""
    x = random_array(rng, BIG, "float32")
    rmsnorm_hip.rms_norm(x)
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)
    after = resource.getrusage(resource.RUSAGE_SELF)
    busy = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert busy < 0.05, f"{busy:.3f} s of CPU in 0.5 s of idling"


def _child_call(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(BIG).astype(np.float32)
    return rmsnorm_hip.rms_norm(x), x


def test_forked_children_can_call(rng):
    """A fork-start Pool's children call the library (small and large calls) after the parent
    ran a large one: same results as the parent's."""
    rmsnorm_hip.rms_norm(random_array(rng, BIG, "float32"))
    with multiprocessing.get_context("fork").Pool(2) as pool:
        done = pool.map_async(_child_call, [1, 2, 3])
        results = done.get(timeout=300)
    for y, x in results:
        assert_bitwise(y, rmsnorm_hip.rms_norm(x), "child vs parent")
