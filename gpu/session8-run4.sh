#!/usr/bin/env bash
# Last device call of the eighth session (issues 26 and 23), CRIU 4.2.1 only, every step cut by
# its own timeout and the whole by 540 s: the shareable-handle pair (gpu/shareable_ckpt.py, both
# modes) and PyTorch's expandable-segments sharing (gpu/ipc_ckpt.py --alloc expandable), which
# the split path now carries; PyTorch training with expandable segments, -R, with the hand-over
# against copy-first (the program's own memory now lent); the two IPC kill points whose harness
# was fixed; the pre-copy chain with the parent check from the dump's start; then PyTorch's
# CUDA multiprocessing tests (and CuPy's, if time is left). Everything, the jsonl files
# included, packed into $OUT/session8-run4.tar.gz.
#
# Usage: gpu/session8-run4.sh   (carry .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[session8-run4 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/session8-run4.log"; }
left() { echo $(( 540 - ($(date +%s) - t0) )); }
cap() { local l; l=$(left); (( l < $1 )) && echo "$l" || echo "$1"; }
export GPUSNAP_CRIU_ROOT=$PWD/.criu-root-sid
agent=$PWD/.devcarry/libgpusnap_agent.so
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); criu $(scripts/criu --version 2>&1 | head -1)"
timeout 80 gpu/prepare.sh "$OUT/prepare.log" >"$OUT/prepare.out" 2>&1
say "prepare rc $?"
timeout "$(cap 90)" python3 gpu/shareable_ckpt.py --agent "$agent" --out "$OUT" \
    --modes scm,pidfd --deadline-s "$(( $(cap 90) - 8 ))" >"$OUT/shareable-ckpt.out" 2>&1
say "shareable pair rc $?: $(grep -c '"pass": true' "$OUT/shareable-ckpt.jsonl" 2>/dev/null) passed of $(wc -l <"$OUT/shareable-ckpt.jsonl" 2>/dev/null), $(grep -c '"refused": true' "$OUT/shareable-ckpt.jsonl" 2>/dev/null) refused"
timeout "$(cap 110)" python3 gpu/ipc_ckpt.py run --agent "$agent" --out "$OUT" \
    --alloc expandable --cases share-check,dump-restore,leave-running \
    --deadline-s "$(( $(cap 110) - 10 ))" --name ipc-torch-expandable >"$OUT/ipc-torch-expandable.out" 2>&1
say "torch expandable rc $?: $(grep -c '"pass": true' "$OUT/ipc-torch-expandable.jsonl" 2>/dev/null) passed of $(wc -l <"$OUT/ipc-torch-expandable.jsonl" 2>/dev/null), $(grep -c '"refused": true' "$OUT/ipc-torch-expandable.jsonl" 2>/dev/null) refused"
timeout "$(cap 150)" gpu/torch_cases.sh --cases train-exp-R --paths split,split-copyfirst \
    --name torch-handover-h200 --budget-s "$(( $(cap 150) - 60 ))" >"$OUT/torch.out" 2>&1
say "torch train-exp-R rc $?"
timeout "$(cap 75)" python3 gpu/ipc_ckpt.py run --agent "$agent" --out "$OUT" \
    --cases kill-matrix --points dump-released,restore-reimport \
    --deadline-s "$(( $(cap 75) - 10 ))" --name ipc-kill-matrix >"$OUT/ipc-kill-matrix.out" 2>&1
say "ipc kill points rc $?: $(grep -c '"pass": true' "$OUT/ipc-kill-matrix.jsonl" 2>/dev/null) passed of $(wc -l <"$OUT/ipc-kill-matrix.jsonl" 2>/dev/null)"
timeout "$(cap 45)" gpu/precopy.sh --gib 16 --name precopy-handover-h200 >"$OUT/precopy.out" 2>&1
say "precopy rc $?"
l=$(( $(left) - 15 ))
if (( l > 40 )); then
    timeout $(( l + 10 )) gpu/conformance.sh --deadline-s "$l" \
        --suites torch-multiprocessing-cuda,cupy-cuda_tests >"$OUT/conformance.out" 2>&1
    say "conformance (deadline ${l}s) rc $?"
else
    say "conformance skipped: ${l}s left"
fi
(cd "$OUT" && tar czf session8-run4.tar.gz --exclude=session8-run4.tar.gz \
    --exclude=session8-run4.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name session8-run4.tar.gz ! -name session8-run4.log \
    -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
