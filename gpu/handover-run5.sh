#!/usr/bin/env bash
# Fifth device call for issue 23, the first with the restore's hand-over: 16 GiB, the hand-over
# (dump and restore) against handover = false in the same run, on CRIU 4.1.1 and 4.2.1 (where the
# keeper's load runs beside CRIU's own restore, from POST_FORKING), after a warm-up case; PyTorch
# sharing CUDA tensors between processes with and without the agent (gpu/ipc.sh); then the split
# path's kill matrix at 16 GiB on CRIU 4.2.1 (the three restore hand-over points included).
# Logs packed into $OUT/handover-run5.tar.gz beside the JSONL results.
#
# Usage: gpu/handover-run5.sh   (carry .criu-root, .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[handover-run5 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/handover-run5.log"; }
sid=$PWD/.criu-root-sid
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
gpu/e2e.sh --gib 16 --path split-copyfirst --no-leave-running --log-name warmup >"$OUT/warmup.out" 2>&1
say "warm-up rc $?"
python3 gpu/e2e.py --gib 16 --path splits --log-name e2e41 >"$OUT/e2e41.out" 2>&1
say "e2e CRIU 4.1.1 (split, split-copyfirst) rc $?"
GPUSNAP_CRIU_ROOT=$sid python3 gpu/e2e.py --gib 16 --path splits --log-name e2e42 \
    >"$OUT/e2e42.out" 2>&1
say "e2e CRIU 4.2.1 (split, split-copyfirst) rc $?"
GPUSNAP_CRIU_ROOT=$sid python3 gpu/e2e.py --gib 16 --path split-copyfirst --log-name e2e42-b \
    >"$OUT/e2e42-b.out" 2>&1 &&
    GPUSNAP_CRIU_ROOT=$sid python3 gpu/e2e.py --gib 16 --path split --log-name e2e42-c \
        >"$OUT/e2e42-c.out" 2>&1
say "e2e CRIU 4.2.1 (split-copyfirst, then split) rc $?"
gpu/ipc.sh --deadline-s 90 >"$OUT/ipc.out" 2>&1
say "ipc rc $?"
left=$(( 560 - ($(date +%s) - t0) ))
GPUSNAP_CRIU_ROOT=$sid python3 gpu/faults.py --cases kill-matrix --paths split --matrix-gib 16 \
    --name faults-matrix-restore-handover-h200 --deadline-s "$left" >"$OUT/faults.out" 2>&1
say "faults (deadline ${left}s) rc $?"
(cd "$OUT" && tar czf handover-run5.tar.gz --exclude=handover-run5.tar.gz --exclude='*.jsonl' \
    --exclude=handover-run5.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name handover-run5.tar.gz \
    ! -name handover-run5.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
