#!/usr/bin/env bash
# Builds the agent's device hash kernel to PTX (run on the GPU machine, which has nvcc):
#     gpu/devhash/build.sh [OUT.ptx]     (default: cuda-backend/agent/src/devhash/sum64.ptx)
# compute_75 PTX, declared ISA 7.0: the driver JIT-compiles it for any GPU from Turing on. The PTX is committed,
# so building gpusnap needs no CUDA toolkit.
set -euo pipefail
here=$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")
out=${1:-$here/../../cuda-backend/agent/src/devhash/sum64.ptx}
nvcc --version | tail -2
nvcc -ptx -arch=compute_75 -O3 -o "$out" "$here/sum64.cu"
# nvcc 13 declares PTX ISA 9.0, which only CUDA 13 drivers (r580) load. The kernel uses only
# instructions of PTX 6.x (shfl.sync, 64-bit atom.add/atom.or, ld.global.nc); ISA 7.0 with
# target sm_75 is valid and loads on drivers from CUDA 11.0 on, including r570.
sed -i 's/^\.version [0-9.]*$/.version 7.0/' "$out"
grep -q '^\.version 7\.0$' "$out" || { echo "build.sh: no .version line rewritten in $out" >&2; exit 1; }
echo "wrote $out ($(wc -c <"$out") bytes)"
