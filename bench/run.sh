#!/usr/bin/env bash
# Split path vs transparent path benchmark (issue "split path benchmark").
#
# Usage: bench/run.sh [--sizes "4 16 64"] [--paths transparent,split] [--name NAME]
#                     [--images DIR] [--alloc driver|runtime] [--ram-gib 128] [--pcie-gib 4]
#                     [--no-pcie] [--no-floor] [--tmpfs-probe] [--probe-slots 16]
#                     [--probe-slot-mib 32] [--probe-streams 4] [--probe-threads 16]
#                     [--verify] [--budget-s S] [--mock]
#
# In one run on the H200: builds gpu/workload.cu, gpu/pcie_bw.cu and gpu/ring_probe.cu
# (gpu/build.sh, into /tmp/gpusnap-bin, where bench.py looks: --bin), installs the plugin
# (/tmp/gpusnap-plugins/gpusnap.so), remounts /dev/shm at 120G, measures pinned PCIe D2H/H2D,
# runs the floor's ring probe at each size (two runs in the image dir, the second counts; not
# with --mock or --no-floor), then for each size and path: starts the workload (split: LD_PRELOAD the agent),
# times `criu dump` and `criu restore` (images on /dev/shm), checks that the restored
# computation goes on bit-exact. Cases that do not fit in RAM (transparent 64 GiB needs ~134 GiB)
# are recorded as skipped. NAME defaults to split-vs-transparent-h200.
# Output: bench/results/NAME.jsonl (appended) and NAME.md, copies in $OUT (default ./out),
# $OUT/bench.log, per-case logs in $OUT/logs.tar. Exit status 1 if any case failed.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,21p' "$0"
    exit 0
fi

export OUT=${OUT:-$repo/out}
mkdir -p "$OUT" bench/results
PY=${PYTHON:-python3}

args=()
mock=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --sizes)
            # one quoted list ("4 16 64") or several words up to the next option
            shift
            sizes=()
            while [[ $# -gt 0 && $1 != --* ]]; do
                read -r -a words <<<"$1"
                sizes+=("${words[@]}")
                shift
            done
            args+=(--sizes "${sizes[@]}")
            ;;
        --mock) mock=1; args+=("$1"); shift ;;
        *) args+=("$1"); shift ;;
    esac
done

gpu/prepare.sh "$OUT/bench.log" "$([[ $mock == 1 ]] && echo --mock)"

exec "$PY" bench/bench.py --cmdline "bench/run.sh ${args[*]}" "${args[@]}"
