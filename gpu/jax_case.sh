#!/usr/bin/env bash
# JAX in its default configuration (75% of the GPU preallocated) through gpusnap.
#
# Usage: gpu/jax_case.sh [--paths split,transparent] [--gib 4] [--steps 300] [--trigger 100]
#                        [--name NAME] [--transparent-anyway] [--keep-images] [--budget-s S]
#                        [--mock]
#
# Per path: a reference run of gpu/jax_work.py, then a run dumped (criu dump) after --trigger
# step lines and restored (criu restore --restore-detached); the outputs compared line by line.
# The transparent path is recorded as skipped when the reservation does not fit twice in host
# RAM (--transparent-anyway runs it). Installs the plugin (/tmp/gpusnap-plugins/gpusnap.so),
# remounts /dev/shm at 120G (as root). Output: $OUT/jax.log, $OUT/NAME.jsonl (NAME default
# jax-default-h200; also appended to bench/results/NAME.jsonl unless --mock), per-case logs in
# $OUT/logs.tar. Exit status 1 if a path failed. --mock: the job on the CPU (JAX_PLATFORMS=cpu).
# PYTHON (default python3) must import jax; it runs the harness and the job.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,16p' "$0"
    exit 0
fi

export OUT=${OUT:-$repo/out}
mkdir -p "$OUT" bench/results
PY=${PYTHON:-python3}

mock=0
for arg in "$@"; do [[ $arg == --mock ]] && mock=1; done
if [[ $(id -u) == 0 && $mock == 0 ]]; then
    mount -o remount,size=120G /dev/shm 2>&1 | tee -a "$OUT/jax.log" || true
fi
env | grep -E '^(XLA_|JAX_|TF_GPU_ALLOCATOR)' | sed 's/^/caller environment: /' | tee -a "$OUT/jax.log" || true
"$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)' 2>&1 | tee -a "$OUT/jax.log" || true

exec "$PY" gpu/jax_case.py --python "$(command -v "$PY")" "$@"
