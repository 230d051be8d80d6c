#!/usr/bin/env bash
# Several GPUs (issue "Several GPUs") on the two-H200 machine (device kind nvidia-h200-x2), in one
# device call (carry .criu-root and a fresh .devcarry):
#
#     gpu/multi_gpu.sh [--cases two-gpu,remap,swap,tree] [--paths split,transparent] [--gib 4]
#                      [--budget-s S] [--mock]
#
# Builds gpu/workload.cu (gpu/build.sh), remounts /dev/shm at 120G, runs gpu/multi_gpu.py (see
# its docstring for the cases). --gib is per GPU. Estimated 4-5 min at 4 GiB per GPU.
# Output: $OUT/multi-gpu.log, $OUT/multi-gpu-h200x2.jsonl (also appended to bench/results/),
# per-case logs in $OUT/logs.tar. --mock runs the harness on the CPU with gpu/mock_workload.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,11p' "$0"
    exit 0
fi
nvidia-smi -L 2>/dev/null || true
exec gpu/prepare.sh --run multi-gpu gpu/multi_gpu.py "$@"
