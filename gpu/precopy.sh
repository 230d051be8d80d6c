#!/usr/bin/env bash
# Pre-copy rounds on the GPU (see gpu/precopy.py): a 16 GiB workload copied out by two
# `gpusnap precopy` rounds while it runs, dumped against the last round, restored, checked.
# A full `criu dump -R` of the same job first is the baseline.
#
#     gpu/precopy.sh [--gib 16]
#
# About 1 minute at 16 GiB. Output: $OUT/precopy.log, $OUT/precopy-h200.jsonl (also appended
# to bench/results/), logs in $OUT/logs.tar.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,9p' "$0"
    exit 0
fi
exec gpu/prepare.sh --run precopy gpu/precopy.py "$@"
