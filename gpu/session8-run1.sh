#!/usr/bin/env bash
# First device call of the eighth session (issues 23 and 26): PyTorch training on the split path
# with the hand-over against handover = false in the same run (criu dump -R, the issue's pause
# target; the caching allocator default and expandable segments, whose own VMM memory takes
# routes per allocation; CRIU 4.2.1), then the conformance suites with the current agent
# (CuPy's cuda_tests, PyTorch's CUDA multiprocessing tests; the agent's IPC event hooks never ran
# through them). Logs packed into $OUT/session8-run1.tar.gz.
#
# Usage: gpu/session8-run1.sh   (carry .criu-root, .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[session8-run1 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/session8-run1.log"; }
sid=$PWD/.criu-root-sid
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
gpu/prepare.sh "$OUT/prepare.log" >"$OUT/prepare.out" 2>&1
say "prepare rc $?"
GPUSNAP_CRIU_ROOT=$sid timeout 300 gpu/torch_cases.sh --cases train-R,train-exp-R \
    --paths split,split-copyfirst --name torch-handover-h200 --budget-s 230 \
    >"$OUT/torch.out" 2>&1
say "torch (CRIU 4.2.1) rc $?"
left=$(( 550 - ($(date +%s) - t0) ))
(( left > 200 )) && left=200
timeout $(( left + 10 )) gpu/conformance.sh --deadline-s "$left" >"$OUT/conformance.out" 2>&1
say "conformance (deadline ${left}s) rc $?"
(cd "$OUT" && tar czf session8-run1.tar.gz --exclude=session8-run1.tar.gz --exclude='*.jsonl' \
    --exclude=session8-run1.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name session8-run1.tar.gz \
    ! -name session8-run1.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
