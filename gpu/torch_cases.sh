#!/usr/bin/env bash
# PyTorch jobs, process trees, async allocators through gpusnap (real-workload cases).
#
# Usage: gpu/torch_cases.sh [--cases LIST] [--paths split,transparent] [--size full|small|tiny]
#                           [--name NAME] [--budget-s S] [--run-timeout S] [--repeat N]
#                           [--criu-timeout S] [--device cpu]
#
# LIST: comma list of case ids or groups (default all):
#   llama llama-exp llama-R train train-exp train-R llama-exp-R train-exp-R tree tree-R malloc-async pinned
#   streams-events cuda-graph managed ipc mps;  groups: all, torch1 (llama*, train*), torch2 (the rest), quick.
# Each case: an uninterrupted reference run and a checkpointed run (criu dump in the middle +
# criu restore, or criu dump -R for the -R cases) of gpu/torch_work.py, outputs compared line by
# line. Installs the plugin (/tmp/gpusnap-plugins/gpusnap.so), remounts /dev/shm at 120G.
# Output: $OUT/torch.log, $OUT/NAME.jsonl (NAME default torch-cases-h200; also appended to
# bench/results/NAME.jsonl), per-case logs in $OUT/logs.tar. Exit status 1 if any case failed.
# --size tiny --device cpu runs everything on the CPU (harness test; no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,17p' "$0"
    exit 0
fi

export OUT=${OUT:-$repo/out}
mkdir -p "$OUT" bench/results
PY=${PYTHON:-python3}

cpu=0
for arg in "$@"; do [[ $arg == cpu ]] && cpu=1; done
if [[ $(id -u) == 0 && $cpu == 0 ]]; then
    mount -o remount,size=120G /dev/shm 2>&1 | tee -a "$OUT/torch.log" || true
fi
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tee -a "$OUT/torch.log" || true

exec "$PY" gpu/torch_cases.py --python "$(command -v "$PY")" "$@"
