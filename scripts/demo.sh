#!/usr/bin/env bash
# The main job in one command, on a fresh Debian 12 (x86_64) machine, as root:
#
#     scripts/demo.sh
#
# 1. installs what is missing: a Rust toolchain (rustup, if cargo is absent), the private CRIU
#    4.1.1 root (scripts/install-criu.sh);
# 2. builds gpusnap (plugin, agent, CLI) in release mode;
# 3. checkpoints and restores a process with real CRIU and gpusnap loaded:
#    - on a machine with an NVIDIA GPU (driver r570+) and nvcc: a CUDA process holding 1 GiB of
#      device data, through both paths (transparent, and split with the agent), checked bit-exact
#      after restore (gpu/e2e.sh --gib 1);
#    - otherwise: a CPU process (gpusnap loads, finds no GPU, says so in one log line, and stays
#      out of the way), then `gpusnap check` to show what this host lacks for GPU checkpoints.
set -euo pipefail
repo=$(dirname -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")")
cd -- "$repo"
say() { echo "==> $*"; }

[[ $(id -u) == 0 ]] || { echo "demo.sh: run as root (CRIU needs it)" >&2; exit 1; }
if ! command -v cargo >/dev/null; then
    [[ -f $HOME/.cargo/env ]] && . "$HOME/.cargo/env"
fi
if ! command -v cargo >/dev/null; then
    say "installing Rust with rustup"
    command -v curl >/dev/null || { apt-get update -q && apt-get install -y -q curl ca-certificates; }
    command -v cc >/dev/null || { apt-get update -q && apt-get install -y -q gcc libc6-dev; }
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
    . "$HOME/.cargo/env"
fi
say "installing the private CRIU root"
scripts/install-criu.sh
say "building gpusnap (release)"
scripts/build-device-bundle.sh >/dev/null
release=${CARGO_TARGET_DIR:-target}/release
say "built: $release/gpusnap (the command), $release/libgpusnap_plugin.so (the plugin), \
$release/libgpusnap_agent.so, $release/gpusnap-keeper; stripped copies in .devcarry/"

if [[ -d /proc/driver/nvidia/gpus ]] && { command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; }; then
    say "NVIDIA GPU found: checkpoint/restore of a CUDA process, both paths"
    exec gpu/e2e.sh --gib 1 --path both
fi

say "no NVIDIA GPU (or no nvcc) here: CRIU + gpusnap on a CPU process"
work=$(mktemp -d /tmp/gpusnap-demo.XXXXXX)
mkdir -p "$work/plugins" "$work/img"
install -m 0755 .devcarry/libgpusnap_plugin.so "$work/plugins/gpusnap.so"
cargo build -q --release -p criu-tests --bin counter
setsid "$release/counter" --log "$work/count" --seed 7 </dev/null >/dev/null 2>&1 &
pid=$!
# CRIU kills the counter after the dump, as it should. Out of bash's job table, its death is not
# announced as a "Killed" line (bash reports it as soon as it reaps the job, before any `wait`
# could hide it); a counter that fails to start still fails the dump below, and the script.
disown "$pid"
sleep 1
scripts/criu dump -t "$pid" -D "$work/img" -L "$work/plugins" -v4 -o dump.log
before=$(tail -n1 "$work/count" | awk '{print $1}')
say "dumped pid $pid at count $before; gpusnap said:"
grep 'gpusnap:' "$work/img/dump.log" | sed 's/^/    /'
# The dumped pid must be free before CRIU can restore it.
for _ in $(seq 50); do [[ -e /proc/$pid ]] || break; sleep 0.1; done
scripts/criu restore -D "$work/img" -L "$work/plugins" -v4 -o restore.log --restore-detached
sleep 1
after=$(tail -n1 "$work/count" | awk '{print $1}')
kill -9 "$pid" 2>/dev/null || true
say "restored: the counter went on from $before to $after"
[[ $after -gt $before ]] || { echo "demo: FAILED: the restored process did not continue" >&2; exit 1; }
say "what this host would need for GPU checkpoints:"
GPUSNAP_CRIU=$repo/scripts/criu CRIU_LIBS_DIR=$work/plugins .devcarry/gpusnap check || true
say "demo done (work dir $work)"
