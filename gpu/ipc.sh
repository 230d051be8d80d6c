#!/usr/bin/env bash
# CUDA tensors shared with a torch.multiprocessing child (256 MiB, 4 KiB, a view at an offset),
# without the agent, with it, and with it and GPUSNAP_AGENT_MIN_BYTES=0; outputs compared.
#
# Usage: gpu/ipc.sh [--deadline-s 150]
# Needs .devcarry/libgpusnap_agent.so (carried) and PyTorch (python3). No checkpoint is taken.
# Output: $OUT/ipc.jsonl (one {"case":"ipc-torch","path":...,"identical":...,"checkpointed":false}
# per configuration), $OUT/ipc.log (each run's stdout and the tail of its stderr, agent debug
# lines included). Exit status 1 if any configuration's output differs from the run without the
# agent, or any run failed. About 30-60 s (three Python start-ups with CUDA, 320 MiB shared).
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
agent=$PWD/.devcarry/libgpusnap_agent.so
[[ -f $agent ]] || { echo "gpu/ipc.sh: $agent missing (carry .devcarry)" >&2; exit 2; }
deadline=150
while [[ $# -gt 0 ]]; do
    case $1 in
        --deadline-s) deadline=$2; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "gpu/ipc.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
exec "$PY" gpu/ipc_torch.py compare --agent "$agent" --out "$OUT" --deadline-s "$deadline"
