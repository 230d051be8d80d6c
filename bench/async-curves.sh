#!/usr/bin/env bash
# Curves on the stand-in drivers for the asynchronous `criu dump -R` (issue 36, items 1 and 4): the
# `-R` pause without the route, with it, and with it but too little free device memory, at stand-in
# sizes 64 MiB to 1 GiB, in the same run on the same job, through real CRIU; and how long until
# `gpusnap wait` says the image is complete. The stand-in's device memory is host memory: the
# figures show structure (what the pause grows with), not a GPU's speed.
#
# Usage: bench/async-curves.sh [NAME]   (root and CRIU needed, as for criu-tests)
# Output: bench/results/NAME.jsonl (default async-curves-<git describe>): one header record
# (command, build, machine, date), then one record per case; the raw output in NAME.log.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(git describe --always --dirty)
name=${1:-async-curves-$build}
out=bench/results/$name
cmd="cargo test -p criu-tests --test curves_async -- --ignored --nocapture --test-threads 1"
machine="$(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GB", $2/1e6}' /proc/meminfo)"
$cmd 2>&1 | tee "$out.log"
{
    printf '{"kind":"header","command":"%s","build":"%s","machine":"%s","date":"%s","profile":"test (debug)"}\n' \
        "$cmd" "$build" "$machine" "$(date -u +%FT%TZ)"
    sed -n 's/^.*CURVE //p' "$out.log"
} >"$out.jsonl"
echo "wrote $out.jsonl"
