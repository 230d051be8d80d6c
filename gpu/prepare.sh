#!/usr/bin/env bash
# Shared first step of the GPU scripts: builds the CUDA programs (gpu/build.sh) and, as root,
# makes /dev/shm large enough for the images (120G); with --mock (no GPU) it only reports
# /dev/shm. GPUSNAP_SHM_HUGE=always|within_size|never also sets tmpfs's huge= option (huge pages
# for the image files; unset leaves it as it is). Everything is appended to LOG (and shown).
#
# Usage: gpu/prepare.sh LOG [--mock]
#        gpu/prepare.sh --run NAME SCRIPT.py [ARGS...]
#            the whole of a simple GPU script: OUT (default ./out) created, the step above with
#            $OUT/NAME.log (--mock when ARGS has it), then exec python3 SCRIPT.py ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --run ]]; then
    name=${2:?usage: gpu/prepare.sh --run NAME SCRIPT.py [ARGS...]}
    script=${3:?usage: gpu/prepare.sh --run NAME SCRIPT.py [ARGS...]}
    shift 3
    export OUT=${OUT:-$PWD/out}
    mkdir -p "$OUT" bench/results
    mock=
    for arg in "$@"; do [[ $arg == --mock ]] && mock=--mock; done
    gpu/prepare.sh "$OUT/$name.log" $mock
    exec "${PYTHON:-python3}" "$script" "$@"
fi
log=${1:?usage: gpu/prepare.sh LOG [--mock]}
if [[ ${2:-} != --mock ]]; then
    gpu/build.sh 2>&1 | tee -a "$log"
    if [[ $(id -u) == 0 ]]; then
        opts=size=120G
        case ${GPUSNAP_SHM_HUGE:-} in
            '') ;;
            always|within_size|never|advise) opts+=",huge=$GPUSNAP_SHM_HUGE" ;;
            *) echo "GPUSNAP_SHM_HUGE=$GPUSNAP_SHM_HUGE: expected always|within_size|advise|never" >&2; exit 2 ;;
        esac
        mount -o "remount,$opts" /dev/shm 2>&1 | tee -a "$log" || true
    fi
fi
df -h /dev/shm 2>&1 | tee -a "$log" || true
grep ' /dev/shm ' /proc/mounts 2>&1 | tee -a "$log" || true
