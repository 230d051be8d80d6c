#!/usr/bin/env bash
# Build gpu/workload.cu, gpu/pcie_bw.cu, gpu/ring_probe.cu and gpu/shareable_pair.cu into a bin dir (default
# /tmp/gpusnap-bin), only when missing or older than the source. Prints the paths it built or found.
#
# Usage: gpu/build.sh [--bin DIR] [--force]
# Needs nvcc (CUDA 13) on PATH or in /usr/local/cuda/bin. Targets sm_90 (H100/H200); falls
# back to nvcc's default target. Links libcuda with -lcuda, falling back to the toolkit's
# stub library or to libcuda.so.1 by path if the linker finds no libcuda.so.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

bin=/tmp/gpusnap-bin
force=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --bin) bin=$2; shift 2 ;;
        --force) force=1; shift ;;
        -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$bin"

if ! command -v nvcc >/dev/null 2>&1; then
    for d in /usr/local/cuda/bin /usr/local/cuda-13/bin /usr/local/cuda-13.0/bin; do
        if [[ -x $d/nvcc ]]; then export PATH=$d:$PATH; break; fi
    done
fi
command -v nvcc >/dev/null 2>&1 || { echo "build.sh: nvcc not found" >&2; exit 1; }
nvcc_dir=$(dirname "$(readlink -f "$(command -v nvcc)")")

link_variants() {
    # One line per way to link libcuda: extra nvcc arguments.
    echo "-lcuda"
    local d
    for d in "$nvcc_dir/../lib64/stubs" "$nvcc_dir/../targets/x86_64-linux/lib/stubs" \
             /usr/local/cuda/lib64/stubs; do
        [[ -f $d/libcuda.so ]] && echo "-L$d -lcuda"
    done
    local so
    so=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}') || true
    [[ -n ${so:-} ]] && echo "$so"
    for so in /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1; do
        [[ -f $so ]] && echo "$so"
    done
    return 0
}

build_one() {
    local src=$1 out=$2
    shift 2
    local extra=("$@")  # more nvcc arguments (libraries)
    if [[ $force == 0 && -x $out && $out -nt $src ]]; then
        echo "build.sh: $out is up to date"
        return 0
    fi
    local arch link
    for arch in "-arch=sm_90" ""; do
        while IFS= read -r link; do
            # shellcheck disable=SC2086  # word splitting of the flag strings is intended
            if nvcc -O2 $arch -o "$out.tmp" "$src" $link ${extra[@]+"${extra[@]}"} 2>"$out.err"; then
                mv -f "$out.tmp" "$out"; rm -f "$out.err"
                echo "build.sh: built $out (nvcc -O2 $arch $src $link ${extra[*]:-})"
                return 0
            fi
            echo "build.sh: nvcc -O2 $arch $src $link ${extra[*]:-} failed:" >&2
            sed 's/^/    /' "$out.err" | tail -n 15 >&2
        done < <(link_variants)
    done
    echo "build.sh: could not build $src" >&2
    return 1
}

nvcc --version | tail -n 2
build_one "$repo/gpu/workload.cu" "$bin/workload"
build_one "$repo/gpu/pcie_bw.cu" "$bin/pcie_bw"
# runtime API only (libcuda linked as above anyway); std::thread needs pthreads on older glibc
build_one "$repo/gpu/ring_probe.cu" "$bin/ring_probe" -lpthread
# driver VMM API and fd passing (gpu/shareable_ckpt.py); kernels through the runtime
build_one "$repo/gpu/shareable_pair.cu" "$bin/shareable_pair"
