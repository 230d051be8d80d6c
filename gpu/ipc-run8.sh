#!/usr/bin/env bash
# Eighth device call (issue 26, the plan's item 2): process trees that share device memory,
# on the split path, all on CRIU 4.2.1:
#  1. gpu/prepare.sh (builds gpu/shareable_pair.cu with the others, /dev/shm at 120G);
#  2. the kill matrix with the PyTorch producer/consumer pair sharing a CUDA tensor through the
#     agent's CUDA IPC (gpu/ipc_ckpt.py --cases kill-matrix): CRIU killed at dump-released,
#     dump-drained, rollback-reclaimed, rollback-reimport, restore-reimport;
#  3. the shareable-handle pair (gpu/shareable_ckpt.py, both modes: SCM_RIGHTS and pidfd_getfd):
#     without the agent, under it, dump + restore, dump -R (refused or checkpointed: recorded);
#  4. PyTorch with expandable segments sharing a tensor (gpu/ipc_ckpt.py --alloc expandable):
#     the torch version and whether the share worked, with and without the agent, dump + restore
#     and dump -R (refused or checkpointed: recorded).
# Estimate: prepare ~40 s (nvcc of four programs), kill matrix ~150-200 s (5 points, a fresh
# pair each: ~12 s of torch start-up + the case), shareable pair ~55 s, expandable ~75 s: about
# 5-6 minutes. Hard limits (timeout) 80 + 250 + 90 + 130 = 550 s.
# Output in $OUT (5 files): ipc-run8.log, ipc-run8.tar.gz (every log: the scripts' own logs and
# stdout, logs.tar with each case's pair logs, criu logs, recover/verify output),
# ipc-kill-matrix.jsonl, shareable-ckpt.jsonl, ipc-torch-expandable.jsonl.
#
# Usage: gpu/ipc-run8.sh   (carry .criu-root, .criu-root-sid and .devcarry)
#        gpu/ipc-run8.sh --mock   (no GPU: every step's --mock, a harness test of this script)
set -uo pipefail
cd "$(dirname "$0")/.."
mock=
[[ ${1:-} == --mock ]] && mock=--mock
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[ipc-run8 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/ipc-run8.log"; }
sid=$PWD/.criu-root-sid
if [[ ! -x $sid/usr/sbin/criu && ! -f $sid/usr/sbin/criu ]]; then
    say "WARNING: $sid has no criu: CRIU 4.1.1 (.criu-root) is used instead"
    sid=$PWD/.criu-root
fi
agent=$PWD/.devcarry/libgpusnap_agent.so
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
say "criu $(GPUSNAP_CRIU_ROOT=$sid scripts/criu --version 2>&1 | head -1); torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1 | tail -1)"
say "estimate: prepare ~40 s, kill matrix ~150-200 s, shareable pair ~55 s, torch expandable ~75 s"
timeout 80 gpu/prepare.sh "$OUT/prepare.log" $mock >"$OUT/prepare.out" 2>&1
say "prepare rc $?; $(ls -l /tmp/gpusnap-bin/shareable_pair 2>&1)"
GPUSNAP_CRIU_ROOT=$sid timeout 250 python3 gpu/ipc_ckpt.py run --agent "$agent" --out "$OUT" \
    --cases kill-matrix \
    --points dump-released,dump-drained,rollback-reclaimed,rollback-reimport,restore-reimport \
    --deadline-s 235 --name ipc-kill-matrix $mock >"$OUT/ipc-kill-matrix.out" 2>&1
say "kill matrix rc $?: $(grep -c '"pass": true' "$OUT/ipc-kill-matrix.jsonl" 2>/dev/null) passed of $(wc -l <"$OUT/ipc-kill-matrix.jsonl" 2>/dev/null)"
GPUSNAP_CRIU_ROOT=$sid timeout 90 python3 gpu/shareable_ckpt.py --agent "$agent" --out "$OUT" \
    --modes scm,pidfd --deadline-s 82 $mock >"$OUT/shareable-ckpt.out" 2>&1
say "shareable pair rc $?: $(grep -c '"pass": true' "$OUT/shareable-ckpt.jsonl" 2>/dev/null) passed of $(wc -l <"$OUT/shareable-ckpt.jsonl" 2>/dev/null), $(grep -c '"refused": true' "$OUT/shareable-ckpt.jsonl" 2>/dev/null) refused"
GPUSNAP_CRIU_ROOT=$sid timeout 130 python3 gpu/ipc_ckpt.py run --agent "$agent" --out "$OUT" \
    --alloc expandable --cases share-check-no-agent,share-check,dump-restore,leave-running \
    --deadline-s 120 --name ipc-torch-expandable $mock >"$OUT/ipc-torch-expandable.out" 2>&1
say "torch expandable rc $?: $(grep -c '"pass": true' "$OUT/ipc-torch-expandable.jsonl" 2>/dev/null) passed of $(wc -l <"$OUT/ipc-torch-expandable.jsonl" 2>/dev/null), $(grep -c '"refused": true' "$OUT/ipc-torch-expandable.jsonl" 2>/dev/null) refused"
(cd "$OUT" && tar czf ipc-run8.tar.gz --exclude=ipc-run8.tar.gz --exclude='*.jsonl' \
    --exclude=ipc-run8.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name ipc-run8.tar.gz \
    ! -name ipc-run8.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
