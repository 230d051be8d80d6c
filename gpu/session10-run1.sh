#!/usr/bin/env bash
# The tenth session's device call (issue 23), CRIU 4.2.1, the whole cut at 420 s (or
# CALL_LIMIT_S): the pre-copy chain's final dump with the faster host-side chunk hash (1e6bc43; the parent's check is what
# its pause waited for); the kill matrix of the split path with the hand-over on this build;
# with time left, 16 GiB hand-over against copy-first again (data_path in every record), the
# ring probe and a hand-over dump at 64 GiB. Packed into $OUT/session10-run1.tar.gz.
#
# Usage: gpu/session10-run1.sh   (carry .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
. gpu/call.sh
call_begin session10-run1 "${CALL_LIMIT_S:-420}"
export GPUSNAP_CRIU_ROOT=$PWD/.criu-root-sid
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); criu $(scripts/criu --version 2>&1 | head -1)"
timeout 80 gpu/prepare.sh "$OUT/prepare.log" >"$OUT/prepare.out" 2>&1
say "prepare rc $?"
timeout 40 dd if=/dev/zero of=/dev/shm/gpusnap-warm bs=1M count=30720 status=none
rm -f /dev/shm/gpusnap-warm
say "warmed 30 GiB of /dev/shm"
timeout "$(cap 90)" gpu/precopy.sh --gib 16 --name precopy-handover-h200 >"$OUT/precopy.out" 2>&1
say "precopy rc $?: $(grep -o 'final {"pause_s": [0-9.]*' "$OUT/precopy.out" | tail -1)"
mv "$OUT/logs.tar" "$OUT/logs-precopy.tar" 2>/dev/null
l=$(( $(left) - 25 ))
(( $(left) > 330 )) && l=$(( $(left) - 200 ))
if (( l > 60 )); then
    timeout $(( l + 15 )) python3 gpu/faults.py --cases kill-matrix --paths split --matrix-gib 16 \
        --name faults-matrix-handover-h200 --deadline-s "$l" >"$OUT/faults.out" 2>&1
    say "kill matrix, split (deadline ${l}s) rc $?: $(grep -c '"pass": true' "$OUT"/faults-matrix-handover-h200.jsonl 2>/dev/null) passed of $(wc -l <"$OUT"/faults-matrix-handover-h200.jsonl 2>/dev/null)"
else
    say "kill matrix skipped: ${l}s left"
fi
if (( $(left) > 60 )); then
    timeout "$(cap 70)" gpu/e2e.sh --gib 16 --path splits --log-name e2e16 >"$OUT/e2e16.out" 2>&1
    say "e2e 16 GiB (split, split-copyfirst) rc $?"
fi
# What is left: the 64 GiB drain against the ring probe's rate in the same VM (the probe's
# first run also touches the tmpfs pages the dump then writes).
if (( $(left) > 110 )); then
    timeout "$(cap 60)" /tmp/gpusnap-bin/ring_probe --gib 64 --repeat 2 --dir /dev/shm/gpusnap-probe \
        --slots 16 --slot-mib 32 --streams 4 --threads 16 >"$OUT/ring64.out" 2>&1
    say "ring probe 64 GiB rc $?: $(grep -o '"write_gbps": [0-9.]*' "$OUT/ring64.out" | tr '\n' ' ')"
    rm -rf /dev/shm/gpusnap-probe
    timeout "$(cap 70)" python3 gpu/e2e.py --gib 64 --path split --no-leave-running \
        --log-name e2e64 >"$OUT/e2e64.out" 2>&1
    say "e2e 64 GiB (hand-over, dump + restore) rc $?"
else
    say "64 GiB probe and dump skipped: $(left)s left"
fi
call_end
