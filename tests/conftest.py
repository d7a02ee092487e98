"""Shared test machinery: the tolerance table of docs/api.md's numerical contract, ``assert_close``,
random data, aligned allocations and backend selection.

The numba-cuda simulator can only be switched on before ``numba.cuda`` is first imported, so this
module sets ``NUMBA_ENABLE_CUDASIM`` before anything else: in the pytest process ``numba.cuda`` *is*
the simulator.  Real PTX is compiled in a subprocess (tests/test_compile.py).
"""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import zlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from rmsnorm_hip._numerics import ulp  # noqa: E402,F401  (the one ulp; tests import it from here)

SIM_ENABLED = os.environ["NUMBA_ENABLE_CUDASIM"] == "1"

FLOAT32, FLOAT16, BFLOAT16 = "float32", "float16", "bfloat16"
DTYPES = (FLOAT32, FLOAT16, BFLOAT16)
NUMPY = {FLOAT32: np.dtype(np.float32), FLOAT16: np.dtype(np.float16),
         BFLOAT16: np.dtype(ml_dtypes.bfloat16)}
# (x dtype, weight dtype or None): weight is x's dtype, or float32 when x is 16-bit
WEIGHT_COMBOS = [(d, w) for d in DTYPES
                 for w in (None, d) + ((FLOAT32,) if d != FLOAT32 else ())]


@dataclass(frozen=True)
class Tolerance:
    rel: float              # ||out - ref|| / ||ref||
    ulps: float = None      # per element: |out - ref| <= ulps * ulp(ref) + atol (16-bit only)
    atol: float = 0.0


# docs/api.md, "Numerical contract", against a float64 reference from the same rounded inputs
TOLERANCES = {
    FLOAT32: Tolerance(rel=1e-5),
    FLOAT16: Tolerance(rel=8e-3, ulps=2, atol=1e-6),
    BFLOAT16: Tolerance(rel=8e-3, ulps=2, atol=1e-6),
}



def np_dtype(dtype):
    """The NumPy dtype of a library dtype name ("bfloat16" -> ml_dtypes.bfloat16) or dtype."""
    return NUMPY[dtype] if isinstance(dtype, str) and dtype in NUMPY else np.dtype(dtype)




def assert_close(out, ref, dtype):
    """``out`` (any float array) against the float64 ``ref`` within ``TOLERANCES[dtype]``:
    relative error ``||out - ref|| / ||ref||`` below ``rel``, and for 16-bit dtypes every element
    within ``ulps`` ulp of ``dtype`` at ``ref`` plus ``atol``.  NaN anywhere fails."""
    tol = TOLERANCES[dtype]
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"shape {out.shape} != reference shape {ref.shape}"
    if out.size == 0:
        return
    err = np.abs(out - ref)
    norm = np.linalg.norm(ref)
    rel = np.linalg.norm(out - ref) / norm if norm > 0 else np.linalg.norm(out)
    if not rel < tol.rel:  # NaN fails too
        worst = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err)), err.shape)
        raise AssertionError(f"{dtype}: relative error {rel:.3e} >= {tol.rel:.0e}; worst element "
                             f"{worst}: out {out[worst]!r} ref {ref[worst]!r}")
    if tol.ulps is not None:
        bound = tol.ulps * ulp(ref, dtype) + tol.atol
        bad = ~(err <= bound)
        if bad.any():
            first = np.unravel_index(np.argmax(bad), bad.shape)
            raise AssertionError(
                f"{dtype}: {int(bad.sum())} element(s) off by more than {tol.ulps} ulp + "
                f"{tol.atol:g}; first {first}: out {out[first]!r} ref {ref[first]!r} "
                f"({err[first] / ulp(ref[first], dtype):.2f} ulp)")


# docs/api.md, quantised outputs: |q - q_ref| <= 1 level everywhere, equal for > 99.9% of elements;
# yscale like rstd (relative error < 1e-5)
QUANT_DTYPES = ("int8", "float8_e4m3fn")
QUANT_NUMPY = {"int8": np.dtype(np.int8), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
QUANT_MAX_LEVELS = 1
QUANT_EQUAL_PER_MILLE = 999
QUANT_TIE = 1e-5


def require_cuda_torch(min_devices=1):
    """torch, for a GPU-tier module (call at import): skips the whole module, with the reason,
    when the simulator is on in this process, torch is missing or fewer than ``min_devices``
    CUDA GPUs are visible."""
    if SIM_ENABLED:
        pytest.skip("the simulator is on in this process (set NUMBA_ENABLE_CUDASIM=0 for the GPU "
                    "tier)", allow_module_level=True)
    torch = pytest.importorskip("torch")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < min_devices:
        pytest.skip("no CUDA GPU" if min_devices == 1 else
                    f"needs {min_devices} CUDA GPUs, torch.cuda.device_count() is {visible}",
                    allow_module_level=True)
    return torch


def _f64(a):
    from rmsnorm_hip.reference import to_float64
    return to_float64(a)


def assert_dx(dx, dy, x, weight, rstd, ref, dtype, weight_offset=0.0):
    """docs/api.md: dx against s = |dy * (weight + weight_offset) * rstd| per element."""
    scale = 1.0 if weight is None else _f64(weight) + weight_offset
    s = np.abs(_f64(dy) * scale * _f64(rstd).reshape(-1, 1).reshape(
        _f64(dy).shape[:-1] + (1,)))
    err = np.abs(_f64(dx) - ref)
    if dtype == FLOAT32:
        assert np.linalg.norm(err) < 1e-5 * np.linalg.norm(s) + 1e-30, (
            f"float32 dx: ||dx - ref|| {np.linalg.norm(err):.3e} >= 1e-5 ||s||")
    else:
        bound = 2 * ulp(ref, dtype) + 1e-5 * s
        bad = ~(err <= bound)
        assert not bad.any(), (f"{dtype} dx: {bad.sum()} elements beyond 2 ulp + 1e-5 s; worst "
                               f"{err[bad].max():.3e}")


def assert_dweight(dw, ref, dtype):
    got = _f64(dw)
    assert got.shape == ref.shape and np.all(np.isfinite(got))
    if dtype == FLOAT32:
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel < 1e-4, f"float32 dweight relative error {rel:.3e}"
    else:
        bound = 2 * ulp(ref, dtype) + 1e-5 * np.abs(ref).max()
        assert np.all(np.abs(got - ref) <= bound), f"{dtype} dweight beyond 2 ulp + 1e-5 max|ref|"


def quant_levels(q, quant_dtype):
    """Signed level index of each element of q (int8 values, float8 e4m3fn values / bits as
    sign and magnitude code, float4 e2m1 values: adjacent representable values differ by 1; -0
    and +0 are 0)."""
    q = np.asarray(q)
    if quant_dtype == "int8":
        return q.astype(np.int64)
    if quant_dtype == "float4_e2m1":     # values: the index of the magnitude, signed
        from rmsnorm_hip.reference import E2M1_MAGNITUDES
        a = np.asarray(q, np.float64)
        code = np.argmin(np.abs(np.abs(a)[..., None] - E2M1_MAGNITUDES), axis=-1)
        return np.where(a < 0, -code, code).astype(np.int64)
    if q.dtype != np.uint8:
        q = np.asarray(q, np.float64).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    code = (q & 0x7F).astype(np.int64)
    return np.where(q & 0x80, -code, code)


def assert_quant_close(q, yscale, q_ref, yscale_ref, quant_dtype):
    """q (the kernel's int8 / float8 output) against the reference quotient ``q_ref`` = y / yscale
    (assert_levels_close), and yscale within TOLERANCES[float32] of its reference."""
    assert_levels_close(q, q_ref, quant_dtype)
    assert_close(yscale, yscale_ref, FLOAT32)


def assert_levels_close(q, q_ref, quant_dtype):
    """q (int8 / float8 e4m3fn output, or float4 e2m1 values) against the reference quotient
    ``q_ref`` = y / scale (float64, unrounded; reference.rms_norm_quant_ref and _scaled_ref):
    within one level of its rounding everywhere, and equal to it for more than 99.9%
    (QUANT_EQUAL_PER_MILLE) of the elements whose rounding is decided.  A quotient within
    QUANT_TIE relative of a midpoint between two levels may round either way (float32 against
    float64 arithmetic; bf16 data makes exact ties common), so those are left out of the
    count."""
    from rmsnorm_hip.reference import quantize_ref
    q_ref = np.asarray(q_ref, np.float64)
    got, ref = quant_levels(q, quant_dtype), quant_levels(quantize_ref(q_ref, quant_dtype),
                                                         quant_dtype)
    assert got.shape == ref.shape, f"q shape {got.shape} != reference shape {ref.shape}"
    diff = np.abs(got - ref)
    worst = int(diff.max(initial=0))
    where = np.unravel_index(np.argmax(diff), diff.shape)
    assert worst <= QUANT_MAX_LEVELS, f"{quant_dtype}: q off by {worst} levels at {where}"
    decided = (quantize_ref(q_ref * (1 + QUANT_TIE), quant_dtype)
               == quantize_ref(q_ref * (1 - QUANT_TIE), quant_dtype))
    unequal = int(np.count_nonzero(diff[decided]))
    # more than 99.9% equal, in integers: (size - unequal) / size > 999 / 1000
    assert 1000 * (diff.size - unequal) > QUANT_EQUAL_PER_MILLE * diff.size, (
        f"{quant_dtype}: q differs from the reference in {unequal} of {diff.size} elements")


def assert_bitwise(a, b, what="arrays"):
    """Same shape, dtype and bits (NaN payloads included)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    bits_a = np.ascontiguousarray(a).reshape(-1).view(f"u{a.itemsize}")
    bits_b = np.ascontiguousarray(b).reshape(-1).view(f"u{b.itemsize}")
    diff = np.flatnonzero(bits_a != bits_b)
    if diff.size:
        i = diff[0]
        raise AssertionError(f"{what} differ bitwise at {diff.size} of {a.size} element(s), "
                             f"first at flat index {i}: {a.reshape(-1)[i]!r} vs "
                             f"{b.reshape(-1)[i]!r}")


def random_array(rng, shape, dtype, loc=0.0, scale=1.0):
    """Normal samples rounded to ``dtype`` (a name or NumPy dtype), with no exact zeros."""
    dt = np_dtype(dtype)
    a = (loc + scale * rng.standard_normal(shape, dtype=np.float32)).astype(dt)
    a[a == 0] = 1
    return a


def aligned_empty(shape, dtype, *, offset=0, align=64):
    """Uninitialised C-contiguous array whose first element sits ``offset`` bytes past an
    ``align``-byte boundary (``offset=itemsize`` gives a row start that is not 16-byte aligned)."""
    dt = np_dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    buf = np.empty(nbytes + align + offset, np.uint8)
    start = (-buf.ctypes.data) % align + offset
    return buf[start:start + nbytes].view(dt).reshape(shape)


def aligned_copy(a, *, offset=0):
    out = aligned_empty(a.shape, a.dtype, offset=offset)
    out[...] = a
    return out


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: fresh data per test, reproducible per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    """Every test starts on the default backend (NumPy arrays -> cpu), whatever the shell says."""
    monkeypatch.delenv("RMSNORM_HIP_BACKEND", raising=False)
    monkeypatch.delenv("RMSNORM_HIP_SIM_WARP", raising=False)


@pytest.fixture
def use_backend(monkeypatch):
    """``use_backend(name)`` selects the backend for NumPy arrays and returns its object."""
    from rmsnorm_hip import backends

    def use(name):
        monkeypatch.setenv("RMSNORM_HIP_BACKEND", name)
        return backends.get(name)
    return use


BACKENDS = ["cpu", pytest.param("sim", marks=pytest.mark.sim)]


@pytest.fixture(params=BACKENDS)
def backend(request, use_backend):
    """Runs the test once per backend that can run NumPy arrays; returns the backend name."""
    use_backend(request.param)
    return request.param


# Tiers (README, "Tests"): every test module declares one in its ``pytestmark``; a test of a
# ``quick`` module may move itself to ``full``.  Plain ``pytest`` runs the default tier (every
# test not marked ``full``); ``pytest --full`` (CI) runs everything.  tests/test_tiers.py fails
# when a module declares none.
TIERS = ("quick", "full", "device")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the full tier too: every kernel variant compiled, the simulator "
                          "matrix, fuzzing (what CI runs)")


def full_tier_except(values, quick):
    """``values`` as pytest params of which only those ``quick(value)`` is true for run in the
    default tier; the others are marked ``full``.  A parametrised test keeps its whole matrix in
    CI and a representative few in the default run.  A tuple is one case of several arguments."""
    def full(value):
        args = value if isinstance(value, tuple) else (value,)
        return pytest.param(*args, marks=pytest.mark.full)
    return [value if quick(value) else full(value) for value in values]


def in_full_tier_only(item):
    return item.get_closest_marker("full") is not None


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--full"):
        deselected = [item for item in items if in_full_tier_only(item)]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not in_full_tier_only(item)]
    # RMSNORM_HIP_SHARD=i/n keeps every n-th test from the i-th (benchmarks/gpu_tier.sh runs n
    # pytest processes side by side: the GPU tier's time is kernel compilation, one core each)
    shard = os.environ.get("RMSNORM_HIP_SHARD")
    if shard:
        index, count = (int(v) for v in shard.split("/"))
        items[:] = [item for k, item in enumerate(items) if k % count == index]
    # the ahead-of-time compiles (minutes each, in subprocesses; the whole backward catalog's
    # the longest) first: pytest-xdist hands tests out in this order, so they run beside the
    # rest instead of one after another at the end
    items.sort(key=lambda item: ("compile" not in item.keywords, "catalog" not in item.name))
    if SIM_ENABLED:
        return
    skip = pytest.mark.skip(reason="NUMBA_ENABLE_CUDASIM is not 1 in this process: numba.cuda "
                                   "was not started as the simulator")
    for item in items:
        if "sim" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """The example counts of the hypothesis fuzz tests (user property ``fuzz_examples``; with
    pytest-xdist the workers send them along with their reports)."""
    rows = [(report.nodeid, value) for report in terminalreporter.stats.get("passed", [])
            for key, value in getattr(report, "user_properties", ()) if key == "fuzz_examples"]
    if not rows:
        return
    terminalreporter.write_sep("-", "fuzz examples run")
    tiers = {}
    for nodeid, count in sorted(rows):
        terminalreporter.write_line(f"{count:6d}  {nodeid}")
        tier = nodeid.split("::")[-1].split("[")[0]
        tiers[tier] = tiers.get(tier, 0) + count
    for tier, count in sorted(tiers.items()):
        terminalreporter.write_line(f"{count:6d}  total {tier}")


class HostIO:
    """What GpuBackend's repeat-call runners read through (functional builds them with
    ``_arrays.FastIO`` for torch / CuPy device arrays), over NumPy arrays for the simulator: a
    "pointer" is the array's flat storage, which the simulated kernel indexes."""

    stream = staticmethod(lambda: 0)

    @staticmethod
    def ptr(a):
        from rmsnorm_hip import _dtypes
        return a.reshape(-1).view(_dtypes.STORAGE[_dtypes.name_of_numpy(a.dtype, None)])

    @staticmethod
    def allocator(shape, dtype):
        from rmsnorm_hip import _dtypes
        return lambda: np.empty(shape, _dtypes.NUMPY[dtype])

    @staticmethod
    def like_allocator(shape, dtype, like_x):
        plain = HostIO.allocator(shape, dtype)
        return (lambda x: np.empty_like(x)) if like_x else (lambda x: plain())
