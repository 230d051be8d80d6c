#!/usr/bin/env bash
# Sixth device call for issues 23 and 26: the restore hand-over at 16 GiB against handover =
# false on CRIU 4.2.1, with the keeper's load broken down (keeper started detached, not CRIU's
# child); the kill points the last matrix failed on or that the detached keeper touches; what the
# driver's checkpoint does to processes that share CUDA memory or events (gpu/ipc_probe.py);
# PyTorch's CUDA multiprocessing tests with and without the agent; CuPy's texture tests with the
# agent twice (one of them failed once, only with the agent, out of memory). Logs packed into
# $OUT/handover-run6.tar.gz beside the JSONL results.
#
# Usage: gpu/handover-run6.sh   (carry .criu-root, .criu-root-sid and .devcarry)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[handover-run6 +$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/handover-run6.log"; }
sid=$PWD/.criu-root-sid
agent=$PWD/.devcarry/libgpusnap_agent.so
say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
gpu/e2e.sh --gib 16 --path split-copyfirst --no-leave-running --log-name warmup >"$OUT/warmup.out" 2>&1
say "warm-up rc $?"
GPUSNAP_CRIU_ROOT=$sid python3 gpu/e2e.py --gib 16 --path splits --log-name e2e42 \
    >"$OUT/e2e42.out" 2>&1
say "e2e CRIU 4.2.1 (split, split-copyfirst) rc $?"
GPUSNAP_CRIU_ROOT=$sid python3 gpu/faults.py --cases kill-matrix --paths split --matrix-gib 16 \
    --points dump-drained,dump-released,restore-keeper-load --name faults-points-h200 \
    --deadline-s 120 >"$OUT/faults.out" 2>&1
say "faults rc $?"
timeout 150 python3 gpu/ipc_probe.py all --agent "$agent" --out "$OUT" --deadline-s 140 \
    >"$OUT/ipc-probe.out" 2>&1
say "ipc probe rc $?"
gpu/conformance.sh --suites torch-multiprocessing-cuda --deadline-s 200 --run-timeout-s 90 \
    >"$OUT/conformance.out" 2>&1
say "torch conformance rc $?"
for i in 1 2; do
    (cd .devcarry/conformance/cupy-v14.2.0 && LD_PRELOAD=$agent timeout 120 python3 -m pytest \
        -p no:cacheprovider -q -n 8 tests/cupy_tests/cuda_tests/test_texture.py) \
        >"$OUT/cupy-texture-agent-$i.out" 2>&1
    say "cupy test_texture.py with the agent, run $i: rc $? ($(tail -1 "$OUT/cupy-texture-agent-$i.out"))"
done
(cd "$OUT" && tar czf handover-run6.tar.gz --exclude=handover-run6.tar.gz --exclude='*.jsonl' \
    --exclude=handover-run6.log . 2>/dev/null)
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.jsonl' ! -name handover-run6.tar.gz \
    ! -name handover-run6.log -exec rm -rf {} +
say "done; $(ls "$OUT" | tr '\n' ' ')"
