#!/usr/bin/env bash
# The GPU tier on a CUDA machine: `rmsnorm-hip check` and every test marked `device`, as
# TIER_SHARDS parallel pytest processes (default 10; kernel compilation, one CPU core per
# process, is what takes the time, not the GPU).  Logs and JUnit XML go to $OUT (default
# /tmp/gpu_tier).  Arguments replace the default test files.  Uses the machine's own packages.
#   bash benchmarks/gpu_tier.sh
#   bash benchmarks/gpu_tier.sh tests/test_device_backward.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_tier}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0
shards=${TIER_SHARDS:-10}
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_device*.py)
python3 -m rmsnorm_hip check > "$OUT/check.log" 2>&1 &
for ((i = 0; i < shards; i++)); do
    RMSNORM_HIP_SHARD="$i/$shards" timeout --signal=INT "${TIER_TIMEOUT:-500}" \
        python3 -m pytest -q -m device -p no:cacheprovider -rfEs --junitxml="$OUT/shard$i.xml" \
        "${tests[@]}" > "$OUT/shard$i.log" 2>&1 &
done
wait
python3 - "$OUT" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
totals = dict(tests=0, failures=0, errors=0, skipped=0)
for path in sorted(glob.glob(f"{sys.argv[1]}/shard*.xml")):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            for bad in list(case.findall("failure")) + list(case.findall("error")):
                print("FAILED", case.get("classname"), case.get("name"), (bad.get("message") or "")[:300])
print("GPU tier:", totals)
PY
echo "check: $(tail -1 "$OUT/check.log")"
grep -h "^FAILED\|^ERROR" "$OUT"/shard*.log | head -40
