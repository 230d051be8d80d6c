#!/usr/bin/env bash
# Second device call of the eighth session (issue 23): a 16 GiB pre-copy chain with the hand-over
# (the final dump's pause against the 0.8 s goal), then the whole kill matrix with the current
# build: split and transparent on CRIU 4.2.1, every point the path reaches (the hand-over's and
# the restore's included). Logs packed into $OUT/session8-run2.tar.gz.
#
# Usage: gpu/session8-run2.sh   (carry .criu-root, .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[session8-run2 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/session8-run2.log"; }
sid=$PWD/.criu-root-sid
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
GPUSNAP_CRIU_ROOT=$sid timeout 150 gpu/precopy.sh --gib 16 --name precopy-handover-h200 \
    >"$OUT/precopy.out" 2>&1
say "precopy (CRIU 4.2.1) rc $?"
left=$(( 560 - ($(date +%s) - t0) ))
GPUSNAP_CRIU_ROOT=$sid timeout $(( left + 15 )) python3 gpu/faults.py --cases kill-matrix \
    --paths split,transparent --matrix-gib 16 --name faults-matrix-h200-session8 \
    --deadline-s "$left" >"$OUT/faults.out" 2>&1
say "faults (deadline ${left}s) rc $?"
(cd "$OUT" && tar czf session8-run2.tar.gz --exclude=session8-run2.tar.gz --exclude='*.jsonl' \
    --exclude=session8-run2.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name session8-run2.tar.gz \
    ! -name session8-run2.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
