#!/usr/bin/env bash
# Compile every kernel variant the dispatcher can launch for AMD gfx942 (MI300X) and gfx950
# (MI355X) with numba-hip, without a GPU, and write the resource reports amd-isa-gfx942.json and
# amd-isa-gfx950.json into $AMD_ISA_DIR (default build/amd-isa, untracked: a test run leaves the
# checkout as it was; AMD_ISA_DIR=benchmarks/results refreshes the committed reports).
#
#   bash .ci/rocm-compile.sh [extra rmsnorm_hip.aot arguments, e.g. --only bfloat16]
#
# Runs .ci/rocm-env.sh (builds or reuses the compile-only chroot), copies the repo's src/ into the
# chroot as ROOT/work/rmsnorm-hip-PID/src (on PYTHONPATH there, removed afterwards; nothing is
# installed into the chroot, nothing is bind-mounted), and runs
#   python -m rmsnorm_hip.aot --target hip --arch gfx942 --arch gfx950 --report ...
# in it, which prints one table line per kernel.  Exits non-zero on any compile error, any scratch
# bytes or VGPR/SGPR spills, a vector-path kernel without global_load_dwordx4 /
# global_store_dwordx4, a main kernel (vector path, one cached row per block) over 64 VGPRs, a
# kernel whose block cannot be resident with its VGPRs (src/rmsnorm_hip/aot.py), or when the
# environment cannot be built.  The reports are written either way.  Needs root.
# Measured on this 2-core machine: environment 56-99 s cold / 2-3 s warm; compiles 582 s for 841
# variants x 2 arches alone (two worker processes), longer beside the full pytest tier in CI.
set -Eeuo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RESULTS=${AMD_ISA_DIR:-$REPO/build/amd-isa}
case $RESULTS in /*) ;; *) RESULTS=$REPO/$RESULTS ;; esac
die() { echo "rocm-compile: ERROR: $*" >&2; exit 1; }
trap 'die "command failed (line $LINENO, exit $?): $BASH_COMMAND"' ERR

start=$SECONDS
ROOT=$(bash "$REPO/.ci/rocm-env.sh") || die "the compile-only environment could not be built"
[ -x "$ROOT/opt/rmsnorm-hip/run" ] || die "rocm-env.sh returned '$ROOT', not an environment"
env_s=$((SECONDS - start))

# a shared lock: rocm-env.sh (exclusive) cannot swap the environment out under this compile
exec 9< "$ROOT.lock"
flock -s -w 1200 9 || die "$ROOT is being rebuilt by another run for 20 minutes"
[ -x "$ROOT/opt/rmsnorm-hip/run" ] || die "$ROOT went away while waiting for its lock"

# this run's copy of src/ (runs on one machine may overlap: one folder each)
name=rmsnorm-hip-$$
WORK=$ROOT/work/$name
trap 'rm -rf --one-file-system "$WORK"' EXIT
rm -rf --one-file-system "$WORK"
mkdir -p "$WORK/out"
tar -C "$REPO" --exclude=__pycache__ -cf - src | tar -C "$WORK" -xf -

status=0
# a kernel cache of this run's own: every variant is compiled, none is read from an earlier run
chroot "$ROOT" /usr/bin/env -i "PYTHONPATH=/work/$name/src" \
    "RMSNORM_HIP_CACHE_DIR=/work/$name/cache" /opt/rmsnorm-hip/run \
    python -m rmsnorm_hip.aot --target hip --arch gfx942 --arch gfx950 \
    --report "/work/$name/out/amd-isa-{arch}.json" "$@" || status=$?

mkdir -p "$RESULTS"
copied=0
for arch in gfx942 gfx950; do
    if [ -f "$WORK/out/amd-isa-$arch.json" ]; then
        cp "$WORK/out/amd-isa-$arch.json" "$RESULTS/amd-isa-$arch.json"
        copied=$((copied + 1))
    fi
done
echo "rocm-compile: environment ${env_s} s, compiles $((SECONDS - start - env_s)) s;" \
     "$copied report(s) in ${RESULTS#"$REPO"/}" >&2
[ "$status" = 0 ] \
    || die "kernel compilation failed or broke a resource gate (exit $status; see above)"
[ "$copied" = 2 ] || die "the compile wrote $copied of 2 reports"
echo "rocm-compile: every kernel compiled for gfx942 and gfx950 within the gates" >&2
