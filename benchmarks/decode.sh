#!/usr/bin/env bash
# The decode benchmark on a GPU machine: small batches (M 1..512 x N 2048..8192, bf16) of
# fwd, fused, fused_inplace, quant and bwd against the peers installed, per call in a CUDA
# graph, flushed and warm device time, and host time (src/rmsnorm_hip/_bench/decode.py).
#
#   bash benchmarks/decode.sh [RESULT.json] [runner options: --ops fwd,quant --pdl ...]
#   python benchmarks/make_table.py --decode RESULT.json     # the README's markdown
#
# RESULT.json defaults to benchmarks/results/decode_h200.json; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
json=benchmarks/results/decode_h200.json
if [ $# -gt 0 ] && [[ $1 != -* ]]; then
    json=$1
    shift
fi
python=${PYTHON:-$(command -v python || command -v python3)}
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} \
    "$python" -m rmsnorm_hip._bench --decode --json "$json" "$@"
