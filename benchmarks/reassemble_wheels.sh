#!/usr/bin/env bash
# Puts wheels too big for one device call back together on the device machine (benchmarks/WHEELS.md).
#
# Each call carries some parts under .whl_parts/<a|b>/. This copies the parts it finds to
# /tmp/whl_cache/parts, which outlives the call while the machine stays warm, and once every part
# that benchmarks/WHEELS.sha256 lists for a wheel is there, concatenates them into
# /tmp/whl_cache/<wheel> and checks the wheel's sha256. Run it from any directory.
# Exit status: 0 (all wheels whole, or still waiting for parts), 2 on a checksum mismatch.
set -uo pipefail
cd "$(dirname "$0")/.."
sums=benchmarks/WHEELS.sha256
cache=/tmp/whl_cache
mkdir -p "$cache/parts"
shopt -s nullglob
for part in .whl_parts/*/*.part*; do
    wheel=$(basename "$part")
    [ -f "$cache/${wheel%.part*}" ] || cp -f "$part" "$cache/parts/"
done

status=0
for wheel in $(awk '{print $2}' "$sums" | grep '\.whl\.part' | sed 's/\.part[a-z]*$//' | sort -u); do
    if [ -f "$cache/$wheel" ]; then
        echo "reassemble: $wheel already whole"
        continue
    fi
    parts=$(awk '{print $2}' "$sums" | grep -F "$wheel.part" | sort)
    missing=""
    for part in $parts; do
        [ -f "$cache/parts/$part" ] || missing="$missing $part"
    done
    if [ -n "$missing" ]; then
        echo "reassemble: $wheel: have $(ls "$cache/parts" | grep -cF "$wheel.part") part(s), missing:$missing"
        continue
    fi
    (cd "$cache/parts" && cat $parts) > "$cache/$wheel.tmp"
    expected=$(awk -v w="$wheel" '$2 == w {print $1}' "$sums")
    actual=$(sha256sum "$cache/$wheel.tmp" | cut -d' ' -f1)
    if [ "$expected" = "$actual" ]; then
        mv "$cache/$wheel.tmp" "$cache/$wheel"
        rm -f "$cache/parts/$wheel".part*
        echo "reassemble: $wheel whole, sha256 ok ($(du -m "$cache/$wheel" | cut -f1) MiB)"
    else
        rm -f "$cache/$wheel.tmp"
        echo "reassemble: $wheel: sha256 mismatch (got $actual)" >&2
        status=2
    fi
done
exit $status
