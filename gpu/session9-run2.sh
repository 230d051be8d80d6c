#!/usr/bin/env bash
# Second device call prepared in the ninth session (issue 23), CRIU 4.2.1, the whole cut at
# 560 s: PyTorch training with expandable segments, whose RDMA-capable memory is now lent, with
# the hand-over against copy-first (`-R` and dump + restore; the routes line should say
# "N of the lent are RDMA-capable" and the restore "the keeper's load ran"), after warming 30 GiB
# of /dev/shm; JAX in its default configuration with the hand-over; 20 dump + restore cycles
# with the hand-over (gpu/cycles.py records each cycle's data path). Packed into
# $OUT/session9-run2.tar.gz.
#
# Usage: gpu/session9-run2.sh   (carry .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
. gpu/call.sh
call_begin session9-run2 560
export GPUSNAP_CRIU_ROOT=$PWD/.criu-root-sid
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); criu $(scripts/criu --version 2>&1 | head -1)"
timeout 80 gpu/prepare.sh "$OUT/prepare.log" >"$OUT/prepare.out" 2>&1
say "prepare rc $?"
# The VM's first touch of tmpfs pages would otherwise land on whichever case writes first.
timeout 40 dd if=/dev/zero of=/dev/shm/gpusnap-warm bs=1M count=30720 status=none
rm -f /dev/shm/gpusnap-warm
say "warmed 30 GiB of /dev/shm"
timeout "$(cap 250)" gpu/torch_cases.sh --cases train-exp-R,train-exp --paths split,split-copyfirst \
    --name torch-rdma-lend-h200 --budget-s "$(( $(cap 250) - 60 ))" >"$OUT/torch.out" 2>&1
say "torch train-exp(-R) rc $?: $(grep -ho 'of the lent are RDMA-capable' "$OUT"/*.log 2>/dev/null | wc -l) RDMA lines"
timeout "$(cap 100)" gpu/jax_case.sh --paths split --budget-s 60 >"$OUT/jax.out" 2>&1
say "jax default rc $?"
timeout "$(cap 140)" gpu/cycles.sh --cycles 20 --gib 4 --path split --budget-s "$(( $(cap 140) - 30 ))" \
    >"$OUT/cycles.out" 2>&1
say "cycles rc $?"
call_end
