#!/usr/bin/env bash
# First device call of the ninth session (issues 26 and 23), CRIU 4.2.1, every step cut by its
# own timeout and the whole by 560 s: the SCM_RIGHTS shareable pair's dump + restore with the
# fix of 5046c84 (and the pidfd pair again); the 16 GiB hand-over against copy-first after a
# warm-up (the keeper now makes its contexts at its start, off the job's pause: the lend's time
# is what changed); then CuPy's cuda_tests without the agent, with it, and with every allocation
# converted. Everything packed into $OUT/session9-run1.tar.gz.
#
# Usage: gpu/session9-run1.sh   (carry .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
. gpu/call.sh
call_begin session9-run1 560
export GPUSNAP_CRIU_ROOT=$PWD/.criu-root-sid
agent=$PWD/.devcarry/libgpusnap_agent.so
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); criu $(scripts/criu --version 2>&1 | head -1)"
timeout 80 gpu/prepare.sh "$OUT/prepare.log" >"$OUT/prepare.out" 2>&1
say "prepare rc $?"
timeout "$(cap 100)" python3 gpu/shareable_ckpt.py --agent "$agent" --out "$OUT" \
    --modes scm,pidfd --deadline-s "$(( $(cap 100) - 8 ))" >"$OUT/shareable-ckpt.out" 2>&1
say "shareable pair rc $?: $(grep -c '"pass": true' "$OUT/shareable-ckpt.jsonl" 2>/dev/null) passed of $(wc -l <"$OUT/shareable-ckpt.jsonl" 2>/dev/null)"
timeout "$(cap 40)" gpu/e2e.sh --gib 16 --path split-copyfirst --no-leave-running \
    --log-name warmup >"$OUT/warmup.out" 2>&1
say "warm-up rc $?"
timeout "$(cap 70)" gpu/e2e.sh --gib 16 --path splits --log-name e2e16 >"$OUT/e2e16.out" 2>&1
say "e2e 16 GiB (split, split-copyfirst) rc $?: $(grep -h 'lend ' "$OUT"/e2e16.log 2>/dev/null | grep -o 'lend [0-9.]* s' | tr '\n' ' ')"
l=$(( $(left) - 20 ))
if (( l > 60 )); then
    timeout $(( l + 10 )) gpu/conformance.sh --deadline-s "$l" \
        --suites cupy-cuda_tests >"$OUT/conformance.out" 2>&1
    say "conformance (deadline ${l}s) rc $?"
else
    say "conformance skipped: ${l}s left"
fi
call_end
