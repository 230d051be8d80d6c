#!/usr/bin/env bash
# GPU end to end on the H200 (issue "GPU end to end on the H200").
#
# Usage: gpu/e2e.sh [--gib N ...] [--path transparent|split|both] [--images DIR]
#                   [--alloc driver|runtime] [--chunk-mib M] [--interval-ms MS]
#                   [--no-leave-running] [--no-restore] [--keep-images] [--budget-s S] [--mock]
#
# Builds gpu/workload.cu (gpu/build.sh, into /tmp/gpusnap-bin), installs .devcarry/libgpusnap_plugin.so
# as /tmp/gpusnap-plugins/gpusnap.so, remounts /dev/shm at 120G, then runs gpu/e2e.py: for each
# size (default 4 16) and path (default both):
#   a) start the workload (setsid, stdin /dev/null; split: LD_PRELOAD the agent), wait for ready
#      and 3 ticks;
#   b) criu dump -t PID -D IMG -L PLUGDIR -v4 -o dump.log (timed), reap the workload, wait until
#      no task uses its PIDs as pid/pgid/sid;
#   c) gpusnap verify IMG (must pass on the split path), criu restore --restore-detached (timed),
#      5 more ticks, checker (every tick ok, device counter +1 per tick from before the dump, state
#      recomputed on the host, checksum == reference), kill the restored process;
#   d) the same with criu dump -R: 5 more ticks, checker, pause = largest tick gap around the dump.
# Output: $OUT/e2e.log (also on stdout), $OUT/e2e.jsonl, per-case logs in $OUT/logs.tar
# (OUT defaults to ./out). Exit status 1 if any case FAILs.
# --mock runs gpu/mock_workload.py (CPU only) instead, to test the harness without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,22p' "$0"
    exit 0
fi

export OUT=${OUT:-$repo/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

mock=0
for arg in "$@"; do [[ $arg == --mock ]] && mock=1; done

gpu/prepare.sh "$OUT/e2e.log" "$([[ $mock == 1 ]] && echo --mock)"

exec "$PY" gpu/e2e.py --workload /tmp/gpusnap-bin/workload "$@"
