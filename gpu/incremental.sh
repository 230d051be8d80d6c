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
exec gpu/prepare.sh --run incremental gpu/incremental.py "$@"
