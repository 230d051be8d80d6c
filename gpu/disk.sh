#!/usr/bin/env bash
# Durable split dumps onto the disk (see gpu/disk.py): a 16 GiB workload dumped with
# durable = true into /var/tmp/gpusnap-disk, compress off and auto, against dd's direct-write
# bandwidth in the same run, restored from a cold page cache.
#
#     gpu/disk.sh [--gib 16] [--dir DIR] [--compress off auto]
#
# About 1.5 minutes at 16 GiB. Output: $OUT/disk.log, $OUT/disk-h200.jsonl (also appended to
# bench/results/), logs in $OUT/logs.tar.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,9p' "$0"
    exit 0
fi
exec gpu/prepare.sh --run disk gpu/disk.py "$@"
