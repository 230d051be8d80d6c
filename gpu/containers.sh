#!/usr/bin/env bash
# GPU containers on the GPU machine: gpu/containers.py with the carried packages.
#
# Usage (from the repository root; CARRY holds the .debs, see docs/containers.md):
#     gpu/containers.sh CARRY [--gib 4] [--paths transparent,split] [--deadline-s 360]
#
# CARRY: gpusnap_*.deb and gpusnap-criu_*.deb (scripts/build-deb.sh --with-criu), runc_*.deb,
# libseccomp2_*.deb and busybox-static_*.deb (Debian 12's, `apt-get download runc libseccomp2
# busybox-static`), and BUILD (the commit the packages were built from). Writes to $OUT (default
# ./out): containers.log, containers-h200.jsonl, stack.json, containers-logs.tar.gz.
# Installs the two gpusnap packages on the host (dpkg -i); runc and busybox are only unpacked.
set -euo pipefail
repo=$(dirname -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")")
carry=$(readlink -f -- "${1:?usage: gpu/containers.sh CARRY [options]}")
shift
export OUT=${OUT:-$repo/out}
mkdir -p "$OUT"
exec python3 -u "$repo/gpu/containers.py" --repo "$repo" --carry "$carry" --out "$OUT" "$@"
