#!/usr/bin/env bash
# Sets up .venv and runs the test suite: the CPU backend, the simulator running the GPU kernel
# source, the sm_90 PTX compile of every kernel variant, and (where .ci/rocm-compile.sh is present)
# the gfx942/gfx950 compile of every variant.  Works on a fresh machine with no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
.venv/bin/python -m pip install -q -e '.[test]'
# torch for the torch-tensor tests: 2.13.0 is a CPU build on these machines (an unpinned torch
# pulls a multi-GB CUDA build)
.venv/bin/python -m pip install -q 'torch==2.13.0' || echo "test.sh: torch not installed; torch tests will be skipped"
NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -n 2 -q "$@"
if [ -f .ci/rocm-compile.sh ] && [ -z "${RMSNORM_HIP_SKIP_ROCM:-}" ]; then
    bash .ci/rocm-compile.sh
fi
