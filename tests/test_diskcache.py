"""The on-disk kernel cache (src/rmsnorm_hip/_diskcache.py): entries keyed by everything that
changes the binary, written atomically, corrupted entries rebuilt, one build across processes
started together, the CPU backend's machine code loaded by a fresh process, ``RMSNORM_HIP_
CACHE_DIR`` to move or disable it, and ``rmsnorm-hip cache info|clear``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rmsnorm_hip import _diskcache, cli

pytestmark = pytest.mark.quick

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "kernels"
    monkeypatch.setenv(_diskcache.ENV, str(folder))
    return folder


def test_store_and_load_round_trip(cache_dir):
    assert _diskcache.load("ptx", ("k", 1)) is None
    assert _diskcache.store("ptx", ("k", 1), b"payload")
    assert _diskcache.load("ptx", ("k", 1)) == b"payload"
    assert _diskcache.load("ptx", ("k", 2)) is None          # another key
    assert _diskcache.load("cpu", ("k", 1)) is None          # another kind
    files = list(cache_dir.rglob("*"))
    assert [f.name for f in files if f.is_file()] == [_diskcache.entry_path("ptx", ("k", 1)).name]


@pytest.mark.parametrize("what", ["source", "toolchain"])
def test_key_covers_the_sources_and_the_toolchain(cache_dir, monkeypatch, what):
    _diskcache.store("ptx", "k", b"old")
    fn = "source_hash" if what == "source" else "toolchain"
    monkeypatch.setattr(_diskcache, fn, lambda: "something else")
    assert _diskcache.load("ptx", "k") is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "header"])
def test_a_damaged_entry_is_deleted_and_rebuilt(cache_dir, damage):
    _diskcache.store("hsaco", "k", b"0123456789" * 10)
    path = _diskcache.entry_path("hsaco", "k")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[:-5]
    elif damage == "empty":
        data = b""
    else:
        data[0] ^= 0x01
    path.write_bytes(bytes(data))
    assert _diskcache.load("hsaco", "k") is None and not path.exists()
    builds = []
    assert _diskcache.cached("hsaco", "k", lambda: builds.append(1) or b"new") == b"new"
    assert builds == [1] and _diskcache.load("hsaco", "k") == b"new"


def test_an_entry_that_fails_to_decode_is_rebuilt(cache_dir):
    _diskcache.store("ptx", "k", b"not json")
    got = _diskcache.cached("ptx", "k", lambda: ["built"], encode=lambda r: json.dumps(r).encode(),
                            decode=json.loads)
    assert got == ["built"] and json.loads(_diskcache.load("ptx", "k")) == ["built"]


@pytest.mark.parametrize("value", ["off", "0", "OFF", "none"])
def test_disabled(monkeypatch, value):
    monkeypatch.setenv(_diskcache.ENV, value)
    assert _diskcache.directory() is None and _diskcache.entry_path("ptx", "k") is None
    assert not _diskcache.store("ptx", "k", b"x")
    builds = []
    for _ in range(2):
        assert _diskcache.cached("ptx", "k", lambda: builds.append(1) or b"x") == b"x"
    assert builds == [1, 1]


def test_default_folder_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(_diskcache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if sys.platform.startswith("linux"):
        assert _diskcache.directory() == tmp_path / "rmsnorm_hip"


def test_unwritable_folder_costs_a_compile_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv(_diskcache.ENV, str(blocker / "kernels"))
    assert not _diskcache.store("ptx", "k", b"x")
    assert _diskcache.cached("ptx", "k", lambda: b"y") == b"y"


def test_no_partial_entry_is_ever_visible(cache_dir, monkeypatch):
    """A write that fails half way leaves no entry and no temporary file behind."""
    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(_diskcache.os, "replace", broken_replace)
    assert not _diskcache.store("ptx", "k", b"x" * 1000)
    assert not [f for f in cache_dir.rglob("*") if f.is_file()]


def test_cli_cache_info_and_clear(cache_dir, capsys):
    _diskcache.store("cpu", "a", b"1")
    _diskcache.store("ptx", "b", b"2")
    _diskcache.store("ptx", "c", b"3")
    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache_dir) in out
    counts = dict(line.split()[:2] for line in out.splitlines())
    assert counts["cpu"] == "1" and counts["ptx"] == "2" and counts["hsaco"] == "0"
    assert cli.main(["cache", "clear"]) == 0
    assert "removed 3 cached kernel(s)" in capsys.readouterr().out
    assert _diskcache.info()["entries"] == {} and _diskcache.load("ptx", "b") is None


def test_cli_cache_bad_action_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["cache", "purge"])
    assert exc.value.code == 2 and "invalid choice: 'purge'" in capsys.readouterr().err


# a fresh process: rms_norm on the CPU, then how its kernel was obtained (numba's dispatcher
# counts disk-cache hits and misses per signature)
_CPU_CALL = """
import json, numpy as np, rmsnorm_hip
from rmsnorm_hip import _cache
x = np.arange(3 * 40, dtype=np.float32).reshape(3, 40) / 7
y = rmsnorm_hip.rms_norm(x, np.full(40, 1.5, np.float32), 1e-6)
kernels = [k for key, k in _cache.entries().items() if "make_cpu_rmsnorm_fwd" in key]
print(json.dumps({"hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels),
                  "y": y.tolist()}))
"""


def _cpu_call(cache_dir):
    env = dict(os.environ, RMSNORM_HIP_CACHE_DIR=str(cache_dir), NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    env.pop("RMSNORM_HIP_BACKEND", None)
    return subprocess.Popen([sys.executable, "-c", _CPU_CALL], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_cpu_kernels_are_built_once_across_processes(cache_dir):
    """Two processes started together build the kernel once (the other waits for the entry and
    loads it); a third loads it too; a damaged entry is rebuilt, with the same results."""
    first = [_result(p) for p in [_cpu_call(cache_dir), _cpu_call(cache_dir)]]
    assert sorted((r["hits"], r["misses"]) for r in first) == [(0, 1), (1, 0)], first
    again = _result(_cpu_call(cache_dir))
    assert (again["hits"], again["misses"]) == (1, 0)
    assert first[0]["y"] == first[1]["y"] == again["y"]
    entries = list((cache_dir / "cpu").glob("*.bin"))
    assert len(entries) == 1
    data = bytearray(entries[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    entries[0].write_bytes(bytes(data))
    rebuilt = _result(_cpu_call(cache_dir))
    assert (rebuilt["hits"], rebuilt["misses"]) == (0, 1) and rebuilt["y"] == again["y"]


_BWD_AFTER_FWD = """
import sys, numpy as np, rmsnorm_hip
from rmsnorm_hip.reference import rms_norm_backward_ref
rng = np.random.default_rng(0)
x, dy = (rng.standard_normal((3, 1000)).astype(np.float32) for _ in range(2))
w = (1 + 0.1 * rng.standard_normal(1000)).astype(np.float32)
if sys.argv[1] == "fwd_first":        # compiles its own helpers before loading the backward
    rmsnorm_hip.rms_norm(x, w)
dx = rmsnorm_hip.rms_norm_backward(dy, x, w)[0]
ref = rms_norm_backward_ref(dy, x, w)[0]
print(float(np.linalg.norm(dx - ref) / np.linalg.norm(ref)))
"""


def test_a_loaded_kernel_calls_its_own_helpers(cache_dir):
    """A kernel loaded from disk keeps calling the helpers it was compiled with, not a helper of
    the same name this process compiled itself (numba names functions by a per-process counter,
    and the JIT links calls by name): the backward compiled by one process and loaded by another
    that compiled the forward first gives the float64 reference's dx."""
    env = dict(os.environ, RMSNORM_HIP_CACHE_DIR=str(cache_dir), NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    env.pop("RMSNORM_HIP_BACKEND", None)
    errors = []
    for order in ("bwd_only", "fwd_first", "fwd_first"):
        done = subprocess.run([sys.executable, "-c", _BWD_AFTER_FWD, order], env=env, text=True,
                              capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        errors.append(float(done.stdout.split()[-1]))
    assert max(errors) < 1e-5, errors


def test_each_process_names_its_functions_apart(cache_dir):
    """The mechanism behind the test above: numba's function counter starts at a random offset
    of its own in every process that loads the CPU backend (two processes that start at 1 give
    the same name to different closures; a pytest-xdist run once loaded a backward whose row sum
    called another process's sum of squares)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    script = ("import rmsnorm_hip.backends.cpu; from numba.core import bytecode; "
              "print(next(bytecode.FunctionIdentity._unique_ids))")
    starts = [int(subprocess.run([sys.executable, "-c", script], env=env, text=True,
                                 capture_output=True, timeout=300).stdout) for _ in range(2)]
    assert min(starts) >= 1 << 62 and starts[0] != starts[1], starts
