#!/usr/bin/env bash
# Seventh device call (issues 26 and 23): a PyTorch producer/consumer pair sharing a CUDA
# tensor through the agent's CUDA IPC, checkpointed on the split path (dump + restore, and -R;
# gpu/ipc_ckpt.py); the IPC probe's configurations that never ran (the tensor with the agent,
# an interprocess event alone); the 16 GiB hand-over against handover = false on CRIU 4.2.1
# (the keeper preparing its GPU contexts at start). Logs packed into $OUT/handover-run7.tar.gz.
#
# Usage: gpu/handover-run7.sh   (carry .criu-root, .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[handover-run7 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/handover-run7.log"; }
sid=$PWD/.criu-root-sid
agent=$PWD/.devcarry/libgpusnap_agent.so
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
gpu/prepare.sh "$OUT/prepare.log" >"$OUT/prepare.out" 2>&1
say "prepare rc $?"
GPUSNAP_CRIU_ROOT=$sid timeout 240 python3 gpu/ipc_ckpt.py run --agent "$agent" --out "$OUT" \
    >"$OUT/ipc-ckpt.out" 2>&1
say "ipc-ckpt (CRIU 4.2.1) rc $?"
timeout 100 python3 gpu/ipc_probe.py all --agent "$agent" --out "$OUT" --deadline-s 95 \
    --configs tensor-agent,event-no-agent >"$OUT/ipc-probe.out" 2>&1
say "ipc probe rc $?"
GPUSNAP_CRIU_ROOT=$sid python3 gpu/e2e.py --gib 16 --path split-copyfirst --no-leave-running \
    --log-name warmup >"$OUT/warmup.out" 2>&1
say "warm-up rc $?"
GPUSNAP_CRIU_ROOT=$sid python3 gpu/e2e.py --gib 16 --path splits --no-leave-running \
    --log-name e2e42 >"$OUT/e2e42.out" 2>&1
say "e2e CRIU 4.2.1 (split, split-copyfirst) rc $?"
(cd "$OUT" && tar czf handover-run7.tar.gz --exclude=handover-run7.tar.gz --exclude='*.jsonl' \
    --exclude=handover-run7.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name handover-run7.tar.gz \
    ! -name handover-run7.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
