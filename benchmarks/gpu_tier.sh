#!/usr/bin/env bash
# The GPU tier on a CUDA machine: `rmsnorm-hip check` and every test marked `device`, with logs
# and a JUnit summary under $OUT (default /tmp/gpu_tier).  Arguments go to pytest (e.g. a file
# list or -k).  Uses the machine's own Python packages (PYTHONPATH=src, nothing installed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_tier}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -m rmsnorm_hip info 2>&1 | tee "$OUT/info.log"
python3 -m rmsnorm_hip check 2>&1 | tee "$OUT/check.log" | tail -25
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_device.py tests/test_device_backward.py)
timeout --signal=INT "${TIER_TIMEOUT:-420}" python3 -m pytest -q -m device -p no:cacheprovider \
    --junitxml="$OUT/gpu_tier.xml" -rfEs "${tests[@]}" 2>&1 | tee "$OUT/pytest.log" | tail -40
