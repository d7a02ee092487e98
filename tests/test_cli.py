"""`rmsnorm-hip info` (API.md: backend found, device, arch, versions) on the backends a machine
without a GPU has."""
import re

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
