#!/usr/bin/env bash
# Run gpusnap's GPU scripts in one device call, within a deadline.
#
# Usage: gpu/run-all.sh --quick
#        gpu/run-all.sh [--deadline-s 510] [PART ...]
#
#   --quick  smoke test (~2-3 min): preflight, build, PCIe probe, e2e at 1 GiB on both paths
#            (dump+restore and dump -R).
#   PART     e2e     gpu/e2e.sh --gib 4 16 --path both                      (~3-4 min)
#            bench   bench/run.sh --sizes "4 16 64"                          (~3-5 min)
#            torch1  gpu/torch_cases.sh --cases torch1 (llama*, train*)      (~7-9 min)
#            torch2  gpu/torch_cases.sh --cases torch2 (tree*, small cases)  (~5-7 min)
#            torch   torch1 then torch2 (does not fit one 10-minute call)
#            faults  gpu/faults.sh                                            (~1.5 min)
#            faults-matrix  gpu/faults.sh --cases kill-matrix (16 GiB; CRIU killed at
#                    every GPUSNAP_TEST_KILL_CRIU_AT point, both paths)       (~6-7 min)
#            alloc   gpu/alloc_latency.sh                                     (~0.5 min)
#            cycles  gpu/cycles.sh --path both (20 cycles, 4 GiB)             (~4-5 min)
#            incr    gpu/incremental.sh (16 GiB)                              (~1 min)
#            precopy gpu/precopy.sh (16 GiB: two live rounds, then the dump)  (~1 min)
#            disk    gpu/disk.sh (16 GiB durable dumps onto the disk)         (~1.5 min)
#            bench16 bench/run.sh --sizes 16                                  (~1 min)
#            floor16 bench/run.sh --sizes 16 --name floor-h200 (the floor: ring probe at
#                    16 GiB, then both paths)                                  (~1.5 min)
#            jax     gpu/jax_case.sh (JAX default config, split; transparent recorded
#                    as skipped when 2x the reservation does not fit in RAM)  (~2 min)
#            mgpu    gpu/multi_gpu.sh (two GPUs: device kind nvidia-h200-x2)  (~1.5 min)
#   Default PARTs: e2e bench.
#   --deadline-s N   start no new case N s after run-all started (default 510, for the
#                    10-minute limit of one device call); later parts get what is left.
# Everything goes under $OUT (default ./out): run-all.log plus each part's own files.
# Exit status: 1 if any part failed.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
export OUT=${OUT:-$repo/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

quick=0
deadline=510
parts=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --quick) quick=1; shift ;;
        --deadline-s) deadline=$2; shift 2 ;;
        -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
        e2e|bench|torch1|torch2|faults|faults-matrix|alloc|cycles|incr|precopy|disk|bench16|floor16|jax|mgpu) parts+=("$1"); shift ;;
        torch) parts+=(torch1 torch2); shift ;;
        *) echo "run-all.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [[ $quick == 0 && ${#parts[@]} == 0 ]]; then
    parts=(e2e bench)
fi

log=$OUT/run-all.log
t0=$(date +%s)
say() { echo "[run-all $(date +%H:%M:%S) +$(( $(date +%s) - t0 ))s] $*" | tee -a "$log"; }
left() { echo $(( deadline - ($(date +%s) - t0) )); }

say "gpu/run-all.sh $*  (quick=$quick parts=${parts[*]:-none} deadline=${deadline}s)"
{
    echo "--- preflight"
    uname -a
    nproc
    grep -E 'MemTotal|MemAvailable' /proc/meminfo
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
    df -h /dev/shm /tmp || true
    ls -la .devcarry/ || echo "NO .devcarry/"
    ls .criu-root/usr/sbin/criu || echo "NO .criu-root"
    scripts/criu --version || true
    scripts/criu check 2>&1 | tail -n 5 || true
    command -v nvcc && nvcc --version | tail -n 1 || echo "no nvcc on PATH"
    "$PY" -c 'import sys, torch, transformers; print(sys.executable, "torch", torch.__version__, "transformers", transformers.__version__)' || true
    "$PY" -c 'import jax; print("jax", jax.__version__)' || true
    env | grep -E '^(GPUSNAP_|CUDA_|PYTORCH_|NCCL_|LD_PRELOAD)' || true
    echo "--- end preflight"
} 2>&1 | tee -a "$log" || true

# Workloads of an earlier call that died run on in their own sessions and hold GPU memory:
# kill those (by pid, only if their command line is one of ours).
gpu_pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null || true)
for pid in $gpu_pids; do
    [[ $pid =~ ^[0-9]+$ ]] || continue
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)
    if [[ $cmd == */tmp/gpusnap-bin/workload* || $cmd == */tmp/gpusnap-bin/ring_probe* || $cmd == *gpu/torch_work.py* || $cmd == *gpu/jax_work.py* ]]; then
        say "killing leftover workload $pid: $cmd"
        kill -9 "$pid" 2>/dev/null || true
    else
        say "GPU process $pid (not ours, left alone): $cmd"
    fi
done

status=0
run_part() {
    local name=$1; shift
    local budget
    budget=$(left)
    if (( budget <= 30 )); then
        say "SKIP $name: deadline reached (${budget}s left)"
        status=1
        return
    fi
    say "START $name (budget ${budget}s): $*"
    if "$@" --budget-s "$budget"; then
        say "DONE $name: ok"
    else
        say "DONE $name: FAILED (exit $?)"
        status=1
    fi
}

if [[ $quick == 1 ]]; then
    gpu/build.sh 2>&1 | tee -a "$log"
    say "pcie_bw (1 GiB)"
    /tmp/gpusnap-bin/pcie_bw --gib 1 --iters 2 2>&1 | tee -a "$log" || status=1
    run_part e2e-quick gpu/e2e.sh --gib 1 --path both
fi
for p in "${parts[@]}"; do
    case $p in
        e2e) run_part e2e gpu/e2e.sh --gib 4 16 --path both ;;
        bench) run_part bench bench/run.sh --sizes "4 16 64" ;;
        torch1) run_part torch1 gpu/torch_cases.sh --cases torch1 --paths split,transparent ;;
        torch2) run_part torch2 gpu/torch_cases.sh --cases torch2 --paths split,transparent ;;
        faults) run_part faults gpu/faults.sh ;;
        faults-matrix) run_part faults-matrix gpu/faults.sh --cases kill-matrix ;;
        alloc) run_part alloc gpu/alloc_latency.sh ;;
        cycles) run_part cycles gpu/cycles.sh --path both ;;
        incr) run_part incr gpu/incremental.sh ;;
        precopy) run_part precopy gpu/precopy.sh ;;
        disk) run_part disk gpu/disk.sh ;;
        bench16) run_part bench16 bench/run.sh --sizes 16 ;;
        floor16) run_part floor16 bench/run.sh --sizes 16 --name floor-h200 ;;
        jax) run_part jax gpu/jax_case.sh ;;
        mgpu) run_part mgpu gpu/multi_gpu.sh ;;
    esac
done
say "finished with status $status after $(( $(date +%s) - t0 ))s"
# shellcheck disable=SC2012
ls -la "$OUT" | tee -a "$log" || true
exit "$status"
