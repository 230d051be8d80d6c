#!/usr/bin/env bash
# Allocation latency of plain cuMemAlloc against the same call under the gpusnap agent
# (issue: "measure allocation latency against plain cuMemAlloc"). On the GPU machine, with
# .devcarry/libgpusnap_agent.so carried: gpu/alloc_latency.sh [--name NAME]
# Appends one JSON line per size and label to bench/results/NAME.jsonl (and $OUT/NAME.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
name=alloc-latency-h200
[[ ${1:-} == --name ]] && name=$2
out=${OUT:-$PWD/out}
mkdir -p "$out" bench/results /tmp/gpusnap-bin
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
nvcc -O2 -o /tmp/gpusnap-bin/alloc_latency gpu/alloc_latency.cu -lcuda
meta=$(printf '"date": "%s", "gpu": "%s", "driver": "%s"' "$(date -Is)" \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    "$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)")
{
    /tmp/gpusnap-bin/alloc_latency plain
    LD_PRELOAD=$PWD/.devcarry/libgpusnap_agent.so /tmp/gpusnap-bin/alloc_latency agent
} | sed "s/^{/{$meta, /" | tee -a "$out/$name.jsonl" >>"bench/results/$name.jsonl"
cat "$out/$name.jsonl"
