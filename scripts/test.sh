#!/usr/bin/env bash
# Sets up .venv and runs the tests on a machine with no GPU (a GPU's own tests skip themselves).
#   bash scripts/test.sh            the default tier: every entry point on the CPU backend, the
#                                   simulator on a representative set of each kernel family, one
#                                   sm_90 compile per family
#   bash scripts/test.sh --full     the full tier (what CI runs): every kernel variant compiled for
#                                   sm_90 and, with root, for gfx942 / gfx950, the simulator
#                                   matrix, fuzzing
# Other arguments go to pytest.  RMSNORM_HIP_SKIP_ROCM=1 leaves the AMD compile out of --full.
set -euo pipefail
cd "$(dirname "$0")/.."
FULL=
if [ "${1:-}" = "--full" ]; then FULL=1; shift; fi
. scripts/_venv.sh
.venv/bin/python -m pip install -q -e '.[test]'
# torch for the torch-tensor tests: 2.13.0 is a CPU build on these machines (an unpinned torch
# pulls a multi-GB CUDA build)
.venv/bin/python -m pip install -q 'torch==2.13.0' || echo "test.sh: torch not installed; torch tests will be skipped"

rocm_pid=
if [ -n "$FULL" ] && [ -f .ci/rocm-compile.sh ] && [ -z "${RMSNORM_HIP_SKIP_ROCM:-}" ]; then
    # the AMD compile runs beside pytest at a lower priority: it fills the cores pytest-xdist
    # leaves idle at the end of its run; its output follows pytest's
    rocm_log=$(mktemp)
    nice -n 10 bash .ci/rocm-compile.sh >"$rocm_log" 2>&1 &
    rocm_pid=$!
fi
status=0
NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -n 2 -q ${FULL:+--full} "$@" || status=$?
if [ -n "$rocm_pid" ]; then
    rocm_status=0
    wait "$rocm_pid" || rocm_status=$?
    cat "$rocm_log"
    rm -f "$rocm_log"
    [ "$rocm_status" = 0 ] || status=$rocm_status
fi
exit "$status"
