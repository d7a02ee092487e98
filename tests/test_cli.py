"""`rmsnorm-hip info` (docs/api.md: backend found, device, arch, versions) on the backends a machine
without a GPU has; bad arguments and missing optional libraries: one line and an exit status, no
traceback."""
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from rmsnorm_hip import cli

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("backend,arch", [("cpu", r"\S+ \(\S+\)|\S+"), ("sim", r"sim\d+")])
def test_info_names_backend_device_arch_and_versions(monkeypatch, capsys, backend, arch):
    monkeypatch.setenv("RMSNORM_HIP_BACKEND", backend)
    assert cli.main(["info"]) == 0
    fields = dict(re.split(r"\s+", line, maxsplit=1)
                  for line in capsys.readouterr().out.splitlines() if line.strip())
    assert fields["backend"] == backend and fields["device"] == "host"
    assert re.fullmatch(arch, fields["arch"]), fields["arch"]
    assert re.fullmatch(r"\d+\.\d+.*", fields["numba"]) and fields["numpy"]
    assert fields["rmsnorm-hip"]


@pytest.mark.parametrize("forced", ["cuda", "hip"])
def test_check_says_when_the_forced_gpu_backend_has_no_device(monkeypatch, capsys, forced):
    """RMSNORM_HIP_BACKEND=cuda on a machine without that GPU: a one-line reason and exit 2,
    not a traceback from the first NumPy array the check would pass to the GPU backend."""
    monkeypatch.setenv("RMSNORM_HIP_BACKEND", forced)
    monkeypatch.setattr(cli, "detect", lambda: ("cpu", "host"))
    assert cli.main(["check"]) == 2
    err = capsys.readouterr().err
    assert f"RMSNORM_HIP_BACKEND={forced}, but no {forced.upper()} device was found" in err


@pytest.mark.parametrize("command", ["info", "check"])
def test_bad_backend_variable_is_one_line_and_exit_2(monkeypatch, capsys, command):
    monkeypatch.setenv("RMSNORM_HIP_BACKEND", "bogus")
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'bogus'" in err, err
    assert err.startswith(f"rmsnorm-hip {command}: error: RMSNORM_HIP_BACKEND must be one of"), err


def test_sim_backend_switches_the_simulator_on_itself():
    """RMSNORM_HIP_BACKEND=sim alone (no NUMBA_ENABLE_CUDASIM) in a fresh process: numba, imported
    with the package, has read its environment already; the backend has it read it again rather
    than load numba.cuda for a real driver (CudaSupportError on a machine without one)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["RMSNORM_HIP_BACKEND"] = "sim"
    code = ("import numpy as np, rmsnorm_hip as R; "
            "print(float(R.rms_norm(np.full((2, 8), 2.0, np.float32))[1, 7]))")
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert abs(float(run.stdout) - 1.0) < 1e-6, run.stdout


def _stopped(argv, capsys):
    """(exit status, stderr) of ``rmsnorm-hip argv`` run in this process."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    return stopped.value.code, capsys.readouterr().err


# argv -> the bad value the error line names; each fails in argument checking, before a kernel
# compiles or a library is timed
BAD_ARGV = [
    (["frob"], "'frob'"),
    (["check", "--seed", "x"], "'x'"),
    (["cache", "frob"], "'frob'"),
    (["bench", "--shapes", "4096"], "'4096'"),
    (["bench", "--shapes", "64x256,axb"], "'axb'"),
    (["bench", "--shapes", "0x5"], "(0, 5)"),
    (["bench", "--dtypes", "int7"], "'int7'"),
    (["bench", "--op", "nope"], "'nope'"),
    (["bench", "--device", "cpu", "--compare", "frob"], "'frob'"),
    (["bench", "--iters", "0"], "got 0"),
    (["compile", "--target", "cuda", "--arch", "sm_foo"], "'sm_foo'"),
    (["compile", "--jobs", "0"], "got 0"),
]


@pytest.mark.parametrize("argv, value", BAD_ARGV, ids=" ".join)
def test_bad_arguments_exit_2_with_one_error_line(argv, value, capsys):
    """Every value check: one ``PROG: error:`` line naming the value (no usage block, no
    traceback)."""
    status, err = _stopped(argv, capsys)
    assert status == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("rmsnorm-hip") and ": error: " in err and value in err, err


@pytest.mark.parametrize("argv, missing, extra", [
    (["bench", "--device", "cpu", "--plot", "out.png"], "matplotlib", "bench"),
    (["bench", "--device", "cpu", "--compare", "torch"], "torch", "torch"),
    (["bench", "--device", "cuda"], "torch", "torch"),
    (["bench", "--decode"], "torch", "torch"),
])
def test_a_missing_extra_names_the_pip_command_and_exits_1(monkeypatch, capsys, argv, missing,
                                                           extra):
    """An option whose library is not installed stops before any work (``--plot`` does not run
    the benchmark to draw nothing), one line naming the extra of pyproject.toml."""
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ModuleNotFoundError
    status, err = _stopped(argv, capsys)
    assert status == 1
    assert err.count("\n") == 1 and f'pip install "rmsnorm-hip[{extra}]"' in err, err


def test_compile_without_its_compiler_names_the_extra(monkeypatch, capsys):
    def version(dist):
        raise importlib.metadata.PackageNotFoundError(dist)
    monkeypatch.setattr(importlib.metadata, "version", version)
    status, err = _stopped(["compile", "--target", "hip"], capsys)
    assert status == 1 and err.count("\n") == 1
    assert 'needs numba-hip, which is not installed: pip install "rmsnorm-hip[rocm]"' in err


def test_gpu_check_without_torch_or_cupy_names_the_extra(monkeypatch, capsys):
    monkeypatch.delenv("RMSNORM_HIP_BACKEND", raising=False)
    monkeypatch.setattr(cli, "detect", lambda: ("cuda", "a GPU"))
    for module in ("torch", "cupy"):
        monkeypatch.setitem(sys.modules, module, None)
    assert cli.main(["check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "rmsnorm-hip[cuda]"' in err, err


def test_bench_without_torch_leaves_the_torch_peers_out(monkeypatch):
    """Every peer (the default ``--compare all``) means the peers installed: without torch the
    CPU run has ours and NumPy, no torch column and no ModuleNotFoundError in its report; a peer
    asked for by name is still recorded as unavailable."""
    from rmsnorm_hip._bench import ops, runner

    monkeypatch.setitem(sys.modules, "torch", None)
    assert list(runner._implementations(ops.OPS["fwd"], "cpu", "all")) == ["ours", "numpy"]
    named = runner._implementations(ops.OPS["fwd"], "cpu", "torch")
    assert isinstance(named["torch"], ModuleNotFoundError)


@pytest.mark.full
def test_check_without_torch_prints_no_traceback_or_warning(tmp_path):
    """The main job on a machine without torch (a `torch` module that fails to import, first on
    the path): the table and PASS, nothing on stderr.  Full tier: the check compiles every CPU
    kernel (about 30 s on a cold kernel cache)."""
    (tmp_path / "torch.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = dict(os.environ, RMSNORM_HIP_BACKEND="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path),
                                                        os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "rmsnorm_hip", "check"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.splitlines()[-1] == "PASS"
    assert "torch" not in done.stdout and "Error" not in done.stdout


def test_gated_references_are_the_gradient_of_the_forward():
    """The check's float64 gated backward (dx, dz, dweight) against central differences of its
    forward, both gates, with and without groups, and a weight offset."""
    import numpy as np

    from rmsnorm_hip import _check_heads

    rng = np.random.default_rng(0)
    m, n = 3, 12
    x, z, dy = (rng.standard_normal((m, n)) for _ in range(3))
    w = 1 + 0.1 * rng.standard_normal(n)
    h = 1e-6
    for g in (n, 4):
        for nbg in (False, True):
            def loss(x_, z_, w_):
                y = _check_heads.gated_ref(x_, z_, w_, 1e-6, g, nbg, weight_offset=0.5)[0]
                return float(np.sum(y * dy))

            dx, dz, dw, _, _ = _check_heads.gated_backward_ref(dy, x, z, w, 1e-6, g, nbg,
                                                                weight_offset=0.5)
            for got, arg in ((dx, 0), (dz, 1), (dw, 2)):
                num = np.zeros_like(got)
                for index in np.ndindex(got.shape):
                    args = [x.copy(), z.copy(), w.copy()]
                    args[arg][index] += h
                    up = loss(*args)
                    args[arg][index] -= 2 * h
                    num[index] = (up - loss(*args)) / (2 * h)
                assert np.allclose(got, num, rtol=1e-6, atol=1e-7), (g, nbg, arg)


def test_check_rows_for_heads_and_gates_pass_and_catch_a_wrong_result(monkeypatch, capsys):
    """``check``'s QK-norm and gated rows in float32 on the CPU pass; an entry point that gets
    one element of one head wrong fails its row, printed with its shape, and is counted."""
    import numpy as np

    from rmsnorm_hip import _check_heads, qk

    identity = (lambda a, dtype: (a, None), lambda a, dtype: np.asarray(a))
    rng = np.random.default_rng(0)
    assert _check_heads.check(rng, *identity, False, dtypes=("float32",)) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line[:10].rstrip() for line in out] == ["qk_ neox", "gated", "gated_bwd"]
    assert all(line.endswith(" ok") for line in out)

    right = qk.qk_rms_norm_

    def wrong(q, k, *args, **kwargs):
        right(q, k, *args, **kwargs)
        if q.shape[-1] == 64:
            k[-1, -1, 3] *= 1.001

    monkeypatch.setattr(qk, "qk_rms_norm_", wrong)
    assert _check_heads.check(rng, *identity, False, dtypes=("float32",)) == 2  # full, partial
    out = capsys.readouterr().out
    assert "qk_ neox   float32   float32       7x4+1x64" in out
    assert "qk_ neox   float32   all           6 shapes                      FAIL" in out
