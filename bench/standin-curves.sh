#!/usr/bin/env bash
# Curves on the stand-in drivers (issue 36, item 4): the lend time against the allocation
# count, and the pre-copy final `-R` pause against a full `-R` dump's (with the drain beside
# each), at stand-in sizes 64 MiB to 1 GiB, and the drain's write rate with the images on
# /dev/shm (256 MiB and 1 GiB), through real CRIU. The stand-in's device memory is
# host memory and its driver calls are function calls: the figures show structure (what grows
# with what), not a GPU's speed.
#
# Usage: bench/standin-curves.sh [NAME]   (root and CRIU needed, as for criu-tests)
# Output: bench/results/NAME.jsonl (default standin-curves-<git describe>): one header record
# (command, build, machine, date), then one record per case; the raw output in NAME.log.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(git describe --always --dirty)
name=${1:-standin-curves-$build}
out=bench/results/$name
cmd="cargo test -p criu-tests --test curves -- --ignored --nocapture --test-threads 1"
machine="$(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GB", $2/1e6}' /proc/meminfo)"
$cmd 2>&1 | tee "$out.log"
{
    printf '{"kind":"header","command":"%s","build":"%s","machine":"%s","date":"%s","profile":"test (debug)"}\n' \
        "$cmd" "$build" "$machine" "$(date -u +%FT%TZ)"
    sed -n 's/^.*CURVE //p' "$out.log"
} >"$out.jsonl"
echo "wrote $out.jsonl"
