#!/usr/bin/env bash
# `pip install .` and `pip install ".[torch]"` into a fresh virtual environment, then the installed
# copy (not src/) imported and run.  This checks what the tests in .venv cannot, as those run an
# editable install of src/: that the package builds from the repository's files alone (setuptools
# as pyproject.toml's build-system asks, in pip's isolated build environment), that its metadata
# parses and declares the extras, and that the built wheel holds every module.
#
# --no-deps, and the dependencies from the test environment (.venv, on PYTHONPATH): installing
# numba, numba-cuda and torch again would take minutes and gigabytes of the CI budget to repeat
# what scripts/test.sh has just done; instead each requirement of the package and of [torch] is
# checked against the versions installed there.  About 15 s.  Run after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "install-check: no .venv: run scripts/test.sh first" >&2
    exit 1
fi
test_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# the interpreter .venv was made from: the test environment's packages must fit the fresh one
base_python=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
"$base_python" -m venv "$fresh/venv"
# a copy of the repository's files (tracked, and untracked ones git does not ignore) to build
# from: setuptools writes build/ and an .egg-info into the tree it builds, and a stale build/lib
# in the checkout would put deleted modules into the next wheel
mkdir "$fresh/repo"
git ls-files -z --cached --others --exclude-standard \
    | tar --null -T - --ignore-failed-read -cf - | tar -xf - -C "$fresh/repo"
for spec in . ".[torch]"; do
    (cd "$fresh/repo" && "$fresh/venv/bin/python" -m pip install -q --disable-pip-version-check \
        --no-deps --force-reinstall "$spec")
done
cd "$fresh"   # away from the checkout: `import rmsnorm_hip` must find the installed copy
PYTHONPATH=$test_site REPO=$fresh/repo "$fresh/venv/bin/python" - <<'EOF'
import importlib.metadata as metadata
import os
import pathlib
import sysconfig

import numpy as np
from packaging.requirements import Requirement

import rmsnorm_hip

site = sysconfig.get_paths()["purelib"]
assert rmsnorm_hip.__file__.startswith(site), f"imported {rmsnorm_hip.__file__}, not from {site}"
# this environment's rmsnorm-hip, not the test environment's editable one on PYTHONPATH
(dist,) = [d for d in metadata.distributions(path=[site]) if d.metadata["Name"] == "rmsnorm-hip"]
assert dist.metadata["License-Expression"] == "Apache-2.0", dist.metadata["License-Expression"]
assert any(f.name == "LICENSE" for f in dist.files), "LICENSE is not in the wheel"
assert "torch" in dist.metadata.get_all("Provides-Extra"), "no [torch] extra"
src = pathlib.Path(os.environ["REPO"], "src")
missing = ({p.relative_to(src).as_posix() for p in src.rglob("*.py")}
           - {f.as_posix() for f in dist.files})
assert not missing, f"modules not in the wheel: {sorted(missing)}"
for extra in ("", "torch"):
    for line in dist.requires:
        req = Requirement(line)
        if not (req.marker.evaluate({"extra": extra}) if req.marker else extra == ""):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            if extra:  # scripts/test.sh goes on without torch; so does this check
                print(f"install-check: {req.name} is not in the test environment, not checked")
                continue
            raise SystemExit(f"install-check: {req} is not in the test environment") from None
        assert req.specifier.contains(version, prereleases=True), f"{req} but {version} installed"
x = np.arange(12, dtype=np.float32).reshape(3, 4)
y = rmsnorm_hip.rms_norm(x, None)
assert np.allclose(y, x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6))
print(f"install-check: pip install . and .[torch] from the repository's files: "
      f"rmsnorm-hip {dist.version} imports and runs")
EOF
PYTHONPATH=$test_site "$fresh/venv/bin/rmsnorm-hip" info >/dev/null
