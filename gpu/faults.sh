#!/usr/bin/env bash
# GPU-side faults on the H200 (issue "failures that never cost a job"). Everything in one device
# call (carry .criu-root and .devcarry; .devcarry must be fresh: scripts/build-device-bundle.sh):
#
#     gpu/faults.sh
#
# (device run: command "gpu/faults.sh", carry [".criu-root", ".devcarry"], timeout 600 s.)
# Estimated 3-4 min: build ~30 s (skipped when /tmp/gpusnap-bin/workload is up to date);
#   damaged-image, split, 1 GiB                 ~15 s (dump, refused restore, restore, 5 ticks)
#   no-gpu-memory, split, 8 GiB                 ~45 s (fill 8 GiB, dump, torch blocker start ~10 s,
#                                                       refused restore, restore 8 GiB, 5 ticks)
#   lock-timeout, transparent + split           ~35 s each (torch start ~10 s, dump fails after
#                                                       the 1 s lock timeout, 2 more ~10 s kernels)
#   criu-killed-then-recover, split, 1 GiB      ~15 s (dump to post-dump, criu killed, 3 s watch,
#                                                       gpusnap recover, 5 ticks)
#   recover-nothing, split + transparent        ~8 s each
# kill-matrix is not in the default set; it is a call of its own (gpu/run-all.sh faults-matrix):
#     gpu/faults.sh --cases kill-matrix [--matrix-gib 16] [--points LIST] [--paths LIST] [--watch-s 2]
#   CRIU SIGKILLed by the plugin (GPUSNAP_TEST_KILL_CRIU_AT) at each of its 10 points, on both
#   paths: ~340 s at 16 GiB (split ~100 s; transparent ~240 s: 6 dumps of 16 GiB, 5 restores);
#   the plan and its estimate are printed at the start.
# A case that hangs is bounded by its timeouts (criu 120 s + 10 s/GiB); no new case starts after
# --deadline-s (default 500 s), so a 10-minute call returns what was done.
#
# Usage: gpu/faults.sh [--cases all|damaged-image,no-gpu-memory,lock-timeout,
#                       criu-killed-then-recover,recover-nothing,kill-matrix] [--gib 1] [--nomem-gib 8]
#                      [--paths split,transparent] [--sleep-cycles 2e10] [--lock-timeout-ms 1000]
#                      [--deadline-s 500] [--keep-images] [--mock]
# Builds gpu/workload.cu (gpu/build.sh), remounts /dev/shm at 120G, runs gpu/faults.py (which
# installs .devcarry/libgpusnap_plugin.so as /tmp/gpusnap-plugins/gpusnap.so). Helpers run with python3
# (torch); PYTHON=... picks another. Output: $OUT/faults.log (also on stdout), $OUT/faults-h200.jsonl
# and bench/results/faults-h200.jsonl (one record per case and path: run, date, gpu, driver,
# case, path, pass, detail, info), per-case logs in $OUT/logs.tar (OUT defaults to ./out).
# Exit status 1 if any case failed or was skipped.
# --mock (CPU only, harness test): gpu/mock_workload.py and torch-free helpers; without a GPU
# and the plugin's driver the fault expectations fail, but every step of the harness runs
# (kill-matrix: an action script kills criu instead of the plugin; its GPU-only checks are notes).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,37p' "$0"
    exit 0
fi

export OUT=${OUT:-$repo/out}
mkdir -p "$OUT" bench/results
PY=${PYTHON:-python3}
log=$OUT/faults.log

mock=0
for arg in "$@"; do [[ $arg == --mock ]] && mock=1; done

{
    echo "--- faults.sh preflight $(date -Is)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
    nvidia-smi --query-compute-apps=pid,used_memory,process_name --format=csv,noheader || true
    cat .devcarry/COMMIT 2>/dev/null || echo "no .devcarry/COMMIT"
    scripts/criu --version 2>&1 | head -n 1 || true
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || true
} 2>&1 | tee -a "$log" || true

gpu/prepare.sh "$log" "$([[ $mock == 1 ]] && echo --mock)"

exec "$PY" gpu/faults.py --python "$(command -v "$PY")" --workload /tmp/gpusnap-bin/workload "$@"
