"""Hypothesis fuzz of every entry point against the float64 references (tests/_fuzz.py): random
M, N, dtype, row strides and unaligned starts, leading dims, eps, weight (None, x's dtype,
float32, unaligned, offset), residual, xscale dtype, quant dtype, given or recomputed rstd,
dresidual, out= (strided, in place), all-zero rows; outputs and workspaces poisoned and guarded.

- CPU backend: CPU_EXAMPLES (1050 in all), small M and N mostly, some awkward N up to 4097 and
  a few N = 16384 / 65537 rows; ~2-3 minutes on one core, most of it numba compiling the ~130
  kernel variants the draws reach.
- Simulator: SIM_EXAMPLES (58 in all, ~30 s), N small enough for one or two simulated blocks.

Both are derandomized (hypothesis's fixed per-test seed: CI sees the same cases every run).
``RMSNORM_HIP_FUZZ_SEED=<int>`` draws other cases; ``RMSNORM_HIP_FUZZ_SCALE=<float>`` multiplies
the example counts.  Each test records its count as the ``fuzz_examples`` user property, and the
run ends with a summary of them (tests/conftest.py)."""
import os

import pytest
from _fuzz import OPS, NumpyLib, Sizes, cases, check_case
from hypothesis import HealthCheck, given, seed, settings

pytestmark = pytest.mark.full

SCALE = float(os.environ.get("RMSNORM_HIP_FUZZ_SCALE", "1"))
SEED = os.environ.get("RMSNORM_HIP_FUZZ_SEED")

CPU_EXAMPLES = {"fwd": 250, "fused": 150, "fused_": 100, "quant": 300, "bwd": 250}
SIM_EXAMPLES = {"fwd": 16, "fused": 8, "fused_": 6, "quant": 16, "bwd": 12}

CPU_SIZES = Sizes(max_m=9, small_n=48, awkward=(63, 64, 65, 127, 128, 129, 255, 256, 257, 1000,
                                                 1023, 1024, 1025, 4095, 4096, 4097),
                  awkward_m=40, big=(16384, 65537), big_m=2)
# simulated blocks are 128+ threads (~0.2 s each): N up to ~260 keeps rows several to a block
SIM_SIZES = Sizes(max_m=5, small_n=40, awkward=(63, 64, 65, 127, 129, 256, 257), awkward_m=3)
# the backward's dweight reduction runs ceil(N / 32) blocks of 256 simulated threads
SIM_BWD_SIZES = Sizes(max_m=5, small_n=40, awkward=(63, 64, 65), awkward_m=3)


def run_fuzz(request, op, sizes, examples, repeat=True):
    """Runs ``examples`` hypothesis examples of ``op`` through check_case; returns the count."""
    count = 0
    examples = max(1, round(examples * SCALE))

    @settings(max_examples=examples, deadline=None, database=None, derandomize=SEED is None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(cases(op, sizes))
    def fuzz(case):
        nonlocal count
        count += 1
        check_case(case, NumpyLib(), repeat=repeat)

    if SEED is not None:
        fuzz = seed(int(SEED))(fuzz)
    fuzz()
    request.node.user_properties.append(("fuzz_examples", count))
    assert count >= examples, f"hypothesis ran {count} of {examples} examples"
    return count


@pytest.mark.parametrize("op", OPS)
def test_fuzz_cpu(request, use_backend, op):
    use_backend("cpu")
    run_fuzz(request, op, CPU_SIZES, CPU_EXAMPLES[op])


@pytest.mark.sim
@pytest.mark.parametrize("op", OPS)
def test_fuzz_sim(request, use_backend, op):
    use_backend("sim")
    # dweight run to run is the CPU fuzz's and test_backward's: not paid for again here
    run_fuzz(request, op, SIM_BWD_SIZES if op == "bwd" else SIM_SIZES, SIM_EXAMPLES[op],
             repeat=False)
