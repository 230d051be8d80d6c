#!/usr/bin/env bash
# Shared first step of the GPU scripts: builds the CUDA programs (gpu/build.sh) and, as root,
# makes /dev/shm large enough for the images (120G); with --mock (no GPU) it only reports
# /dev/shm. Everything is appended to LOG (and shown).
#
# Usage: gpu/prepare.sh LOG [--mock]
set -euo pipefail
cd "$(dirname "$0")/.."
log=${1:?usage: gpu/prepare.sh LOG [--mock]}
if [[ ${2:-} != --mock ]]; then
    gpu/build.sh 2>&1 | tee -a "$log"
    if [[ $(id -u) == 0 ]]; then
        mount -o remount,size=120G /dev/shm 2>&1 | tee -a "$log" || true
    fi
fi
df -h /dev/shm 2>&1 | tee -a "$log" || true
