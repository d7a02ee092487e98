#!/usr/bin/env bash
# The GPU tier on a CUDA machine: `rmsnorm-hip check` and every test marked `device`, as
# TIER_SHARDS parallel pytest processes (default 10; kernel compilation, one CPU core per
# process, is what takes the time, not the GPU).  Arguments replace the default test files.
# Uses the machine's own packages (PYTHONPATH=src).
#   bash benchmarks/gpu_tier.sh
#   bash benchmarks/gpu_tier.sh tests/test_device_backward.py
# Output in $OUT (default /tmp/gpu_tier), kept to three files so that a device call returns
# them all: summary.txt (appended as each shard ends, so a run cut short still reports what
# finished), failures.txt (each failing test with its message) and logs.tar.gz (every log).
# TIER_TIMEOUT (default 500 s) bounds each shard and the check.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_tier}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0
shards=${TIER_SHARDS:-10}
# on a machine with several GPUs the shards take them in turn (TIER_GPUS=1 keeps one)
gpus=${TIER_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c ^GPU || echo 1)}
[ "$gpus" -ge 1 ] 2>/dev/null || gpus=1
limit=${TIER_TIMEOUT:-500}
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_device*.py)
(CUDA_VISIBLE_DEVICES=0 timeout --signal=INT "$limit" python3 -m rmsnorm_hip check > "$LOGS/check.log" 2>&1
 echo "check: $(tail -n 1 "$LOGS/check.log")" >> "$OUT/summary.txt") &
for ((i = 0; i < shards; i++)); do
    (CUDA_VISIBLE_DEVICES=$((i % gpus)) RMSNORM_HIP_SHARD="$i/$shards" timeout --signal=INT "$limit" \
        python3 -m pytest -q -m device -p no:cacheprovider -rfE --junitxml="$LOGS/shard$i.xml" \
        "${tests[@]}" > "$LOGS/shard$i.log" 2>&1
     echo "shard $i/$shards: $(tail -n 1 "$LOGS/shard$i.log")" >> "$OUT/summary.txt"
     grep -h "^FAILED\|^ERROR" "$LOGS/shard$i.log" >> "$OUT/failures.txt") &
done
wait
python3 - "$LOGS" >> "$OUT/summary.txt" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
totals = dict(tests=0, failures=0, errors=0, skipped=0)
for path in sorted(glob.glob(f"{sys.argv[1]}/shard*.xml")):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
print("GPU tier:", totals)
PY
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
cat "$OUT/summary.txt"
head -n 40 "$OUT/failures.txt" 2>/dev/null
