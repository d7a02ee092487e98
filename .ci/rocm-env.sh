#!/usr/bin/env bash
# Build, or reuse when intact, the compile-only AMD environment: numba-hip 0.2.1 compiling kernels
# to gfx942 / gfx950 code objects on a machine with no AMD GPU and no ROCm.
#
#   bash .ci/rocm-env.sh          # as root; prints the chroot's path on its last line
#
# What it is:
#   - a Debian sid chroot (debootstrap) with ROCm 7.2.4's COMGR and hipRTC builtins from Debian
#     experimental and LLVM 22's libclang from sid, at the exact versions pinned below.  Needed
#     because numba-hip loads COMGR (not on PyPI) and these need glibc >= 2.38 (bookworm: 2.36);
#   - /opt/venv: Python 3.14 with .ci/rocm/requirements.txt (numba-hip 0.2.1 and its resolved
#     dependencies, hash-pinned);
#   - librocm_sysdeps_{z,zstd}.so.1 shims (.ci/rocm/shim_*.c, built with the host's gcc) for the
#     libLLVM.so in the rocm-bindings-compiler wheel;
#   - /opt/fake-rocm: the unversioned sonames the bindings dlopen + the clang resource directory;
#   - /opt/rmsnorm-hip/run CMD...: runs CMD inside the chroot with that environment
#     (chroot ROOT /usr/bin/env -i [PYTHONPATH=...] /opt/rmsnorm-hip/run python ...).
#
# Location: $RMSNORM_HIP_ROCM_ROOT, default /var/cache/rmsnorm-hip/rocm-chroot, kept between runs.
# Reuse: when ROOT/opt/rmsnorm-hip/stamp holds the fingerprint of this recipe (this script and
# .ci/rocm/*) and .ci/rocm/smoke.py passes in it (a numba-hip compile for both arches).  Otherwise
# it is rebuilt from scratch beside the old one and swapped in only once its smoke test passes.
# Any failure exits non-zero with the reason; nothing is skipped.  Needs root, x86_64, ~3 GB free
# disk while rebuilding, and Debian's package mirror + PyPI.  Cold: ~1.5 min; warm: ~5 s.
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RECIPE=$HERE/rocm
ROOT=${RMSNORM_HIP_ROCM_ROOT:-/var/cache/rmsnorm-hip/rocm-chroot}
MIRROR=${RMSNORM_HIP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
ARCHS=(gfx942 gfx950)

# Debian packages, exact versions (installed into the chroot with their dependencies).
APT_PINS=(
    libamd-comgr3=7.2.4+dfsg-1~exp1          # COMGR of ROCm 7.2.4 (experimental): gfx942, gfx950
    libhiprtc-builtins7=7.2.4-1~exp2         # the HIP device header numba-hip parses
    libllvm22=1:22.1.8-3                     # COMGR's LLVM
    libclang1-22=1:22.1.8-3                  # libclang for numba-hip's header parse
    libclang-common-22-dev=1:22.1.8-3        # clang resource headers (stddef.h, ...)
    python3.14=3.14.10-1
    python3.14-venv=3.14.10-1
)

log() { echo "rocm-env: $*" >&2; }
die() { echo "rocm-env: ERROR: $*" >&2; exit 1; }
trap 'die "command failed (line $LINENO, exit $?): $BASH_COMMAND"' ERR

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot); run as root"
[ "$(uname -m)" = x86_64 ] || die "needs an x86_64 host (the wheels are x86_64), got $(uname -m)"
case "$ROOT" in /*) ;; *) die "RMSNORM_HIP_ROCM_ROOT must be an absolute path: $ROOT" ;; esac
[ "$ROOT" != / ] || die "RMSNORM_HIP_ROCM_ROOT must not be /"

recipe() {  # this script and every file of .ci/rocm, named
    cat "${BASH_SOURCE[0]}"
    local f
    for f in "$RECIPE"/*; do echo "== ${f##*/}"; cat "$f"; done
}
FINGERPRINT=$(recipe | sha256sum | cut -c1-32)

# the environment inside the chroot: nothing of the host's (its pip config points at host paths)
CHROOT_ENV=(PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
            DEBIAN_FRONTEND=noninteractive)
for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
    if [ -n "${!var:-}" ]; then CHROOT_ENV+=("$var=${!var}"); fi
done
in_root() { local root=$1; shift; chroot "$root" /usr/bin/env -i "${CHROOT_ENV[@]}" "$@"; }

mounted_under() {  # any mount point at or below $1?
    awk -v d="$1" '$2 == d || index($2, d "/") == 1 {found=1} END {exit !found}' /proc/self/mounts
}

remove_tree() {  # rm -rf a chroot directory, refusing if anything is mounted inside it
    local dir=$1
    [ -e "$dir" ] || return 0
    case "$dir" in "$ROOT".*|"$ROOT") ;; *) die "refusing to remove $dir" ;; esac
    mounted_under "$dir" && die "$dir has mount points inside; unmount them, then rerun"
    rm -rf --one-file-system "$dir"
}

smoke() {  # the chroot at $1 imports numba.hip and compiles for every arch
    in_root "$1" /opt/rmsnorm-hip/run python /opt/rmsnorm-hip/smoke.py "${ARCHS[@]}" >&2
}

intact() {
    [ -x "$ROOT/opt/rmsnorm-hip/run" ] && [ -f "$ROOT/opt/rmsnorm-hip/stamp" ] || return 1
    if [ "$(cat "$ROOT/opt/rmsnorm-hip/stamp")" != "$FINGERPRINT" ]; then
        log "recipe changed since $ROOT was built: rebuilding"
        return 1
    fi
    smoke "$ROOT" || { log "smoke test failed in $ROOT: rebuilding"; return 1; }
}

host_tools() {
    local need=()
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v gcc >/dev/null || need+=(gcc libc6-dev)
    [ -r /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
    if [ ${#need[@]} = 0 ]; then return 0; fi
    log "installing on the host: ${need[*]}"
    local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}")
    "${install[@]}" >&2 || { apt-get update -q >&2 || true; "${install[@]}" >&2; } \
        || die "cannot install ${need[*]} on the host"
}

build() {
    local new=$1 start=$SECONDS
    remove_tree "$new"
    mkdir -p "$new"
    log "debootstrap sid into $new ($MIRROR)"
    debootstrap --variant=minbase --include=ca-certificates,python3.14,python3.14-venv \
        sid "$new" "$MIRROR" > "$new.debootstrap.log" 2>&1 \
        || { tail -n 30 "$new.debootstrap.log" >&2
             die "debootstrap failed (log: $new.debootstrap.log)"; }
    rm -f "$new.debootstrap.log"
    cp /etc/resolv.conf "$new/etc/resolv.conf"
    echo "deb $MIRROR experimental main" > "$new/etc/apt/sources.list.d/experimental.list"
    # the mirror's Release files may be older than their Valid-Until on this machine's clock
    echo 'Acquire::Check-Valid-Until "false";' > "$new/etc/apt/apt.conf.d/99rmsnorm-hip"
    in_root "$new" apt-get update -q > "$new.apt.log" 2>&1 \
        || { tail -n 30 "$new.apt.log" >&2; die "apt-get update in the chroot failed"; }
    log "installing ${APT_PINS[*]}"
    in_root "$new" apt-get install -y -q --no-install-recommends --allow-downgrades \
        "${APT_PINS[@]}" >> "$new.apt.log" 2>&1 \
        || { tail -n 30 "$new.apt.log" >&2; die "cannot install the pinned Debian packages (a pinned
    version may have left the mirror: 'apt-cache policy PACKAGE' in the chroot shows what it has;
    update APT_PINS)"; }
    rm -f "$new.apt.log"
    local pin name want got
    for pin in "${APT_PINS[@]}"; do
        name=${pin%%=*} want=${pin#*=}
        got=$(in_root "$new" dpkg-query -W -f='${Version}' "$name") || die "$name not installed"
        [ "$got" = "$want" ] || die "$name is $got, pinned $want"
    done
    in_root "$new" apt-get clean

    mkdir -p "$new/opt/rmsnorm-hip"
    cp "$RECIPE/requirements.txt" "$RECIPE/smoke.py" "$new/opt/rmsnorm-hip/"
    # the host's CA bundle: pip must trust whatever the host trusts (a TLS-intercepting proxy too)
    cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$new/opt/rmsnorm-hip/ca.crt"
    log "creating /opt/venv (pip, hash-pinned wheels)"
    in_root "$new" python3.14 -m venv /opt/venv
    in_root "$new" PIP_CERT=/opt/rmsnorm-hip/ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_DEFAULT_TIMEOUT=120 /opt/venv/bin/pip install -q --no-cache-dir --no-deps \
        --require-hashes --only-binary=:all: -r /opt/rmsnorm-hip/requirements.txt >&2 \
        || die "pip install of .ci/rocm/requirements.txt failed"
    in_root "$new" /opt/venv/bin/pip check >&2 || die "pip check: the pinned set is inconsistent"

    local site
    site=$(echo "$new"/opt/venv/lib/python3.14/site-packages)
    [ -d "$site/rocm/bindings/llvm" ] || die "no rocm/bindings/llvm in $site"
    local lib
    for lib in z zstd; do
        gcc -O2 -Wall -shared -fPIC -Wl,--version-script="$RECIPE/ver.map" \
            -Wl,-soname,"librocm_sysdeps_$lib.so.1" \
            -o "$site/rocm/bindings/llvm/librocm_sysdeps_$lib.so.1" "$RECIPE/shim_$lib.c" -ldl \
            || die "building the librocm_sysdeps_$lib shim failed"
    done

    local multiarch=/usr/lib/x86_64-linux-gnu
    mkdir -p "$new/opt/fake-rocm/lib" "$new/opt/fake-rocm/llvm/lib/clang"
    ln -sfn "$multiarch/libamd_comgr.so.3" "$new/opt/fake-rocm/lib/libamd_comgr.so"
    ln -sfn "$multiarch/libhiprtc-builtins.so.7" "$new/opt/fake-rocm/lib/libhiprtc-builtins.so"
    ln -sfn /usr/lib/llvm-22/lib/clang/22 "$new/opt/fake-rocm/llvm/lib/clang/22"
    for lib in "$multiarch/libamd_comgr.so.3" "$multiarch/libhiprtc-builtins.so.7" \
               /usr/lib/llvm-22/lib/libclang-22.so.1 /usr/lib/llvm-22/lib/clang/22/include; do
        [ -e "$new$lib" ] || die "$lib missing in the chroot"
    done

    local comgr
    comgr=$(in_root "$new" dpkg-query -W -f='${Version}' libamd-comgr3)
    cat > "$new/opt/rmsnorm-hip/run" <<EOF
#!/bin/sh
# run a command in the compile-only numba-hip environment (written by .ci/rocm-env.sh)
export PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
export ROCM_PATH=/opt/fake-rocm LD_LIBRARY_PATH=/opt/fake-rocm/lib
export NUMBA_HIP_LIBCLANG_FILE=/usr/lib/llvm-22/lib/libclang-22.so.1
export TMPDIR=/var/tmp   # numba-hip caches the HIP device library per arch under \$TMPDIR/numba/hip
export RMSNORM_HIP_COMGR_VERSION=$comgr
exec "\$@"
EOF
    chmod 755 "$new/opt/rmsnorm-hip/run"
    {
        echo "# built $(date -u +%Y-%m-%dT%H:%M:%SZ) by .ci/rocm-env.sh, recipe $FINGERPRINT"
        in_root "$new" dpkg-query -W -f='${Package}=${Version}\n'
        in_root "$new" /opt/venv/bin/pip freeze
    } > "$new/opt/rmsnorm-hip/versions.txt"

    smoke "$new" || die "the new environment fails its smoke test (see above)"
    echo "$FINGERPRINT" > "$new/opt/rmsnorm-hip/stamp"
    log "built in $((SECONDS - start)) s"
}

mkdir -p "$(dirname "$ROOT")"
exec 9> "$ROOT.lock"
flock -w 1200 9 || die "another rocm-env.sh holds $ROOT.lock for 20 minutes"

if intact; then
    log "reusing $ROOT"
else
    host_tools
    avail_kb=$(df -Pk "$(dirname "$ROOT")" | awk 'NR == 2 {print $4}')
    [ "$avail_kb" -ge 3000000 ] \
        || die "need 3 GB free under $(dirname "$ROOT"), have $((avail_kb / 1024)) MB"
    build "$ROOT.new"
    remove_tree "$ROOT.old"
    if [ -e "$ROOT" ]; then mv "$ROOT" "$ROOT.old"; fi
    mv "$ROOT.new" "$ROOT"
    remove_tree "$ROOT.old"
fi
echo "$ROOT"
