#!/usr/bin/env bash
# compute-sanitizer over the GPU matrix of benchmarks/sanitize_matrix.py (every entry point x dtype
# x N in 1, 3, 127, 4096, 4097, 65537 x aligned / unaligned rows, torch and CuPy arrays, outputs
# and workspaces poisoned and guarded), on the H200:
#
#   bash benchmarks/sanitize_h200.sh            # from the repository root
#
# Runs, each in its own process:
#   control    memcheck on one deliberate one-row overrun through the package's own launch path
#              (cuModuleLoadData + ctypes cuLaunchKernel): proves the sanitizer sees our kernels;
#              it must report >= 1 error
#   memcheck   the full matrix (out-of-bounds / misaligned accesses)
#   racecheck  the quick matrix (shared-memory hazards of the row reductions; slow tool)
# TOOLS="memcheck racecheck initcheck synccheck" adds initcheck (full matrix) and synccheck
# (quick); MATRIX_FULL / MATRIX_QUICK name other matrix modes for them (bwd, bwd_quick). Writes $OUT/sanitizer_summary.json (errors per tool, exit codes, the matrix's own
# check result) and one log per run ($OUT defaults to benchmarks/results/sanitize_<date>).
# Exit status 0 when the control was detected and every tool reported 0 errors and every check
# passed. About 5-6 minutes on an H200 (most of it numba compiling ~150 kernel variants per run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" NUMBA_ENABLE_CUDASIM=0
export PYTORCH_NO_CUDA_MEMORY_CACHING=1      # one cudaMalloc per tensor: overruns stay visible
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/benchmarks/results/sanitize_$(date +%Y%m%d_%H%M)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TOOLS="${TOOLS:-memcheck racecheck}"
LIMIT="${SANITIZE_TIMEOUT:-420}"             # seconds per sanitizer run

# ---- find compute-sanitizer ----------------------------------------------------------------------
looked=()
SAN=""
for cand in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
            /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
            $(ls -d /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | sort -rV) \
            $(ls -d /opt/nvidia/*/compute-sanitizer/compute-sanitizer 2>/dev/null) \
            $("$PY" -c 'import glob, site; print(" ".join(p for d in site.getsitepackages() for p in glob.glob(d + "/nvidia/*/bin/compute-sanitizer")))' 2>/dev/null); do
    [ -z "$cand" ] && continue
    looked+=("$cand")
    if [ -x "$cand" ]; then SAN="$cand"; break; fi
done
if [ -z "$SAN" ]; then
    echo "sanitize_h200.sh: compute-sanitizer not found; looked at: \$COMPUTE_SANITIZER, PATH, ${looked[*]:-}" >&2
    printf '{"status": "compute-sanitizer not found", "looked": "%s"}\n' "${looked[*]:-}" > "$OUT/sanitizer_summary.json"
    exit 2
fi
echo "compute-sanitizer: $SAN ($("$SAN" --version 2>/dev/null | grep -i version | head -1))"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true

# ---- runs ----------------------------------------------------------------------------------------
run() {   # run NAME TOOL MODE
    local name=$1 tool=$2 mode=$3 t0=$SECONDS rc
    echo "== $name: $tool, matrix mode $mode"
    timeout "$LIMIT" "$SAN" --tool "$tool" --error-exitcode 99 --report-api-errors no \
        --print-limit 200 "$PY" benchmarks/sanitize_matrix.py --mode "$mode" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name $tool $mode $rc $((SECONDS - t0))" >> "$OUT/runs.txt"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SANITIZE_MATRIX|SANITIZE_CONTROL|Device not supported" "$OUT/$name.log" | sed 's/^/   /'
    echo "   exit $rc, $((SECONDS - t0)) s"
}

: > "$OUT/runs.txt"
run control memcheck control
for tool in $TOOLS; do
    case "$tool" in
        memcheck|initcheck) run "$tool" "$tool" "${MATRIX_FULL:-full}" ;;
        racecheck|synccheck) run "$tool" "$tool" "${MATRIX_QUICK:-quick}" ;;
        *) echo "unknown tool $tool (memcheck, racecheck, initcheck, synccheck)" >&2 ;;
    esac
done

# ---- summary -------------------------------------------------------------------------------------
"$PY" - "$OUT" "$SAN" <<'PY'
import json, re, sys
from pathlib import Path
out, san = Path(sys.argv[1]), sys.argv[2]
summary = {"sanitizer": san, "runs": {}}
ok = True
for line in (out / "runs.txt").read_text().split("\n"):
    if not line.strip():
        continue
    name, tool, mode, rc, seconds = line.split()
    log = (out / f"{name}.log").read_text(errors="replace")
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", log)]
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log)
    matrix = re.findall(r"SANITIZE_MATRIX (.*)", log)
    # racecheck ends with a RACECHECK SUMMARY instead of an ERROR SUMMARY: its errors count
    if not errors and race:
        errors = [int(race[-1][1])]
    run = {"tool": tool, "matrix": mode, "exit_code": int(rc), "seconds": int(seconds),
           "errors": sum(errors) if errors else None, "log": f"{name}.log"}
    if race:
        run["racecheck"] = {"hazards": int(race[-1][0]), "errors": int(race[-1][1]),
                            "warnings": int(race[-1][2])}
    if matrix:
        fields = dict(kv.split("=", 1) for kv in matrix[-1].split())
        run["matrix_cases"], run["matrix_failed"] = int(fields["cases"]), int(fields["failed"])
    if "Device not supported" in log:
        run["status"] = "device not supported by this compute-sanitizer (gVisor?)"
    elif int(rc) == 124:
        run["status"] = "timed out"
    elif name == "control":
        run["status"] = "detected" if run["errors"] else "NOT DETECTED: the sanitizer did not see the package's launches"
    elif run["errors"] is None:
        run["status"] = "no ERROR SUMMARY in the log"
    else:
        run["status"] = "clean" if run["errors"] == 0 and run.get("matrix_failed") == 0 else "errors"
    ok &= run["status"] in ("clean", "detected")
    summary["runs"][name] = run
summary["all_clean"] = ok
(out / "sanitizer_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
sys.exit(0 if ok else 1)
PY
