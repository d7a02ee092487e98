#!/usr/bin/env bash
# The benchmark on the H200 device machine (benchmarks/WHEELS.md has the two-call plan):
#
#   call 1  carry [".whl_parts/a"]          command: bash benchmarks/reassemble_wheels.sh
#   call 2  carry [".whl", ".whl_parts/b"]  command: bash benchmarks/run_h200.sh
#
# Installs the carried peer wheels into /tmp/site (nothing can be fetched there), then runs
# `python3 -m rmsnorm_hip._bench --op $BENCH_OP` (default all) and writes
# $OUT/<op>_h200_<date>.json, .log and .png.
# Extra arguments go to the runner (`--shapes 4096x4096`, `--no-host`, `--flush read`, ...).
# BENCH_TIMEOUT (default 540 s) stops the run with SIGINT in time to print what it has measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
op=${BENCH_OP:-all}
name="${op}_h200_$(date -u +%Y%m%d_%H%M)"

bash benchmarks/reassemble_wheels.sh \
    || echo "run_h200: the split wheel did not check out: QuACK will be recorded as unavailable"
shopt -s nullglob
wheels=(.whl/*.whl /tmp/whl_cache/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" || echo "run_h200: pip install failed; peers may be missing"
fi
# --target does not process .pth files: add the path nvidia_cutlass_dsl_packages.pth would add.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv,noheader || true
python3 - <<'PY' || true
import importlib.metadata as m
names = ["torch", "triton", "numpy", "numba", "numba-cuda", "cupy-cuda13x", "liger-kernel",
         "quack-kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi"]
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "-"
print("versions:", ", ".join(f"{n} {version(n)}" for n in names))
PY

timeout --signal=INT --kill-after=30 "${BENCH_TIMEOUT:-540}" \
    python3 -m rmsnorm_hip._bench --op "$op" --json "$OUT/$name.json" --plot "$OUT/$name.png" "$@" \
    2>&1 | tee "$OUT/$name.log"
status=$?
echo "run_h200: exit $status; copy $OUT/$name.json to benchmarks/results/ and run benchmarks/make_table.py"
exit $status
