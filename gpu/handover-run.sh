#!/usr/bin/env bash
# One device call for the hand-over (issue 23) and the agent's CUDA IPC (issue 26): 16 GiB split
# with the hand-over, split with handover = false (copy first) and transparent, in the same run;
# e2e split at 16 GiB (dump + restore and -R); the IPC cases; the conformance suites. Logs packed
# into $OUT/handover-run.tar.gz beside the JSONL results.
#
# Usage: gpu/handover-run.sh [--conformance-s 150]
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
conf_s=150
[[ ${1:-} == --conformance-s ]] && conf_s=$2
t0=$(date +%s)
say() { echo "[handover-run +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/handover-run.log"; }
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
bench/run.sh --sizes 16 --paths split,split-copyfirst,transparent --no-pcie --no-floor \
    --name handover-h200 >"$OUT/bench.out" 2>&1
say "bench rc $?"
gpu/e2e.sh --gib 16 --path split >"$OUT/e2e.out" 2>&1
say "e2e rc $?"
gpu/ipc.sh >"$OUT/ipc.out" 2>&1
say "ipc rc $?"
gpu/conformance.sh --deadline-s "$conf_s" >"$OUT/conformance.out" 2>&1
say "conformance rc $?"
cp bench/results/handover-h200.jsonl bench/results/handover-h200.md "$OUT/" 2>/dev/null
(cd "$OUT" && tar czf handover-run.tar.gz --exclude=handover-run.tar.gz --exclude='*.jsonl' \
    --exclude=handover-h200.md --exclude=handover-run.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name handover-run.tar.gz \
    ! -name handover-h200.md ! -name handover-run.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
