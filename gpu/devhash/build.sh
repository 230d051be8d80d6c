#!/usr/bin/env bash
# Builds the agent's device hash kernel to PTX (run on the GPU machine, which has nvcc):
#     gpu/devhash/build.sh [OUT.ptx]     (default: agent/src/devhash/sum64.ptx)
# compute_75 PTX: the driver JIT-compiles it for any GPU from Turing on. The PTX is committed,
# so building gpusnap needs no CUDA toolkit.
set -euo pipefail
here=$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")
out=${1:-$here/../../agent/src/devhash/sum64.ptx}
nvcc --version | tail -2
nvcc -ptx -arch=compute_75 -O3 -o "$out" "$here/sum64.cu"
echo "wrote $out ($(wc -c <"$out") bytes)"
