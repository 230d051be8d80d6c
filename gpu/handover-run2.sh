#!/usr/bin/env bash
# Second device call for issues 23 and 26: 16 GiB e2e with the hand-over and with handover = false
# (copy first) in the same run, dump + restore and -R each; the kill matrix of the split path
# (the hand-over) at 16 GiB; the IPC importer probe; the conformance suites with and without the
# agent. Logs packed into $OUT/handover-run2.tar.gz beside the JSONL results.
#
# Usage: gpu/handover-run2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[handover-run2 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/handover-run2.log"; }
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
gpu/e2e.sh --gib 16 --path splits >"$OUT/e2e.out" 2>&1
say "e2e rc $?"
python3 gpu/faults.py --cases kill-matrix --paths split --matrix-gib 16 >"$OUT/faults.out" 2>&1
say "faults rc $?"
timeout 90 python3 gpu/ipc_probe.py --out "$OUT/ipc-probe.jsonl" >"$OUT/ipc-probe.out" 2>&1
say "ipc-probe rc $?"
left=$(( 560 - ($(date +%s) - t0) ))
gpu/conformance.sh --deadline-s "$left" --run-timeout-s 120 >"$OUT/conformance.out" 2>&1
say "conformance rc $? (deadline ${left} s)"
(cd "$OUT" && tar czf handover-run2.tar.gz --exclude=handover-run2.tar.gz --exclude='*.jsonl' \
    --exclude=handover-run2.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name handover-run2.tar.gz \
    ! -name handover-run2.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
