#!/usr/bin/env bash
# Third device call for issue 23: the hand-over against handover = false at 16 GiB, dump +
# restore and -R, each path twice in alternating order after a warm-up case (the VM pays the
# first touch of /dev/shm's pages in whichever case writes first); then the split path's kill
# matrix at 16 GiB. Logs packed into $OUT/handover-run3.tar.gz beside the JSONL results.
#
# Usage: gpu/handover-run3.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[handover-run3 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/handover-run3.log"; }
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
gpu/e2e.sh --gib 16 --path split-copyfirst --no-leave-running --log-name warmup >"$OUT/warmup.out" 2>&1
say "warm-up rc $?"
gpu/e2e.sh --gib 16 --path splits --log-name e2e-a >"$OUT/e2e-a.out" 2>&1
say "e2e (split, split-copyfirst) rc $?"
python3 gpu/e2e.py --gib 16 --path split-copyfirst --log-name e2e-b >"$OUT/e2e-b.out" 2>&1 &&
    python3 gpu/e2e.py --gib 16 --path split --log-name e2e-c >"$OUT/e2e-c.out" 2>&1
say "e2e (split-copyfirst, then split) rc $?"
python3 gpu/faults.py --cases kill-matrix --paths split --matrix-gib 16 >"$OUT/faults.out" 2>&1
say "faults rc $?"
(cd "$OUT" && tar czf handover-run3.tar.gz --exclude=handover-run3.tar.gz --exclude='*.jsonl' \
    --exclude=handover-run3.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name handover-run3.tar.gz \
    ! -name handover-run3.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
