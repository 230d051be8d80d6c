#!/usr/bin/env bash
# N consecutive dump + restore cycles of one CUDA process, with leak checks (see gpu/cycles.py):
#
#     gpu/cycles.sh [--cycles 20] [--gib 4] [--path split|transparent|both] [--budget-s S] [--mock]
#
# Builds gpu/workload.cu (gpu/build.sh), remounts /dev/shm at 120G, runs gpu/cycles.py. Estimated
# 2 min for 20 split cycles at 4 GiB (dump ~1.3 s, restore ~1.7 s, 3 ticks each). Output:
# $OUT/cycles.log, $OUT/cycles-h200.jsonl (also appended to bench/results/), logs in $OUT/logs.tar.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,8p' "$0"
    exit 0
fi
exec gpu/prepare.sh --run cycles gpu/cycles.py "$@"
