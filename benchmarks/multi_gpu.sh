#!/usr/bin/env bash
# Issue 9 on a machine with two GPUs (the nvidia-h200-x2 device kind), in one call:
#
#   command: bash benchmarks/multi_gpu.sh          (kind nvidia-h200-x2, nothing to carry)
#
# Runs every test of tests/test_multi_gpu.py (mark `device`): each entry point and the torch
# adapter on cuda:1 while cuda:0 is current and the reverse, the per-device kernel cache,
# non-default streams, and DDP / FSDP2 training over NCCL with one process per GPU.  Uses the
# machine's own torch, numba-cuda and cuda-python (nothing is installed).  Writes to $OUT
# (default /tmp/multi_gpu): env.txt (GPUs, topology, versions), multi_gpu.log (pytest -v with
# the training reports) and multi_gpu.xml (JUnit).  MULTI_GPU_TIMEOUT (default 540 s) stops
# pytest with SIGINT in time to write its summary inside the device machine's 600 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/multi_gpu}
mkdir -p "$OUT"
# NVLink SHARP (multicast) stays off on these machines; the DDP workers set it again themselves
export NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0

{
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
    nvidia-smi topo -m || true
    python3 - <<'PY' || true
import importlib.metadata as m
import torch
names = ["torch", "numpy", "numba", "numba-cuda", "cuda-python", "cuda-bindings"]
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "-"
print("versions:", ", ".join(f"{n} {version(n)}" for n in names))
print("torch.cuda.device_count():", torch.cuda.device_count(),
      "| NCCL:", torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "-")
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout --signal=INT "${MULTI_GPU_TIMEOUT:-540}" \
    python3 -m pytest -m device tests/test_multi_gpu.py -v -p no:cacheprovider -rfEsxXP \
    --durations=10 --junitxml="$OUT/multi_gpu.xml" "$@" 2>&1 | tee "$OUT/multi_gpu.log"
status=${PIPESTATUS[0]}
echo "multi_gpu: pytest exit status $status (log: $OUT/multi_gpu.log)"
exit "$status"
