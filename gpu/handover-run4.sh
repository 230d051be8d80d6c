#!/usr/bin/env bash
# Fourth device call for issue 23: 64 GiB, the hand-over against handover = false in the same
# run (dump + restore and -R each), after a warm-up of WARMUP_GIB (default 16; 64 makes the VM
# touch all the tmpfs pages the cases use first), in both orders with ORDERS=2. Logs packed into
# $OUT/handover-run4.tar.gz beside the JSONL results.
#
# Usage: gpu/handover-run4.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[handover-run4 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/handover-run4.log"; }
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
gpu/e2e.sh --gib "${WARMUP_GIB:-16}" --path split-copyfirst --no-leave-running --log-name warmup \
    >"$OUT/warmup.out" 2>&1
say "warm-up (${WARMUP_GIB:-16} GiB) rc $?"
python3 gpu/e2e.py --gib 64 --path splits --log-name e2e64 >"$OUT/e2e64.out" 2>&1
say "e2e 64 GiB (split, split-copyfirst) rc $?"
if [[ ${ORDERS:-1} == 2 ]]; then
    python3 gpu/e2e.py --gib 64 --path split-copyfirst --log-name e2e64-b >"$OUT/e2e64-b.out" 2>&1 &&
        python3 gpu/e2e.py --gib 64 --path split --log-name e2e64-c >"$OUT/e2e64-c.out" 2>&1
    say "e2e 64 GiB (split-copyfirst, then split) rc $?"
fi
(cd "$OUT" && tar czf handover-run4.tar.gz --exclude=handover-run4.tar.gz --exclude='*.jsonl' \
    --exclude=handover-run4.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name handover-run4.tar.gz \
    ! -name handover-run4.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
