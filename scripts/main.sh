#!/usr/bin/env bash
# Sets up .venv and runs the main job on the best backend found: CUDA when an NVIDIA GPU is
# present, else the CPU.  `rmsnorm-hip info`, `rmsnorm-hip check`, then `rmsnorm-hip bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # the GPU bench times kernels through torch's profiler (CUPTI)
    .venv/bin/python -m pip install -q -e '.[cuda,bench,torch]'
else
    .venv/bin/python -m pip install -q -e '.[bench]'
fi
.venv/bin/rmsnorm-hip info
.venv/bin/rmsnorm-hip check
.venv/bin/rmsnorm-hip bench "$@"
