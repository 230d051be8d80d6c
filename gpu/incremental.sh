#!/usr/bin/env bash
# Incremental split-path dumps on the GPU (see gpu/incremental.py): three dumps of one 16 GiB
# workload, each against the one before, then a restore from the last.
#
#     gpu/incremental.sh [--gib 16] [--mock]
#
# About 1 minute at 16 GiB. Output: $OUT/incremental.log, $OUT/incremental-h200.jsonl (also
# appended to bench/results/), logs in $OUT/logs.tar.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,8p' "$0"
    exit 0
fi
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" bench/results
mock=0
for arg in "$@"; do [[ $arg == --mock ]] && mock=1; done
gpu/prepare.sh "$OUT/incremental.log" "$([[ $mock == 1 ]] && echo --mock)"
exec "${PYTHON:-python3}" gpu/incremental.py "$@"
