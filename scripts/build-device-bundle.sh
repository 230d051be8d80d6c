#!/usr/bin/env bash
# Builds what the GPU machine needs (it has no network and no Rust toolchain) into .devcarry/:
# the plugin (libgpusnap_plugin.so), the agent (libgpusnap_agent.so) and the CLI (gpusnap), release
# builds. Together with .criu-root/ (scripts/install-criu.sh) this is what `device run` carries.
set -euo pipefail
repo=$(dirname -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")")
cd -- "$repo"
cargo build --release -p gpusnap-plugin -p gpusnap-agent -p gpusnap -p gpusnap-keeper
mkdir -p .devcarry
t=${CARGO_TARGET_DIR:-target}/release
cp "$t"/libgpusnap_plugin.so "$t"/libgpusnap_agent.so "$t"/gpusnap \
    "$t"/gpusnap-keeper .devcarry/
strip --strip-debug .devcarry/*.so .devcarry/gpusnap .devcarry/gpusnap-keeper 2>/dev/null || true
git rev-parse HEAD >.devcarry/COMMIT
du -sh .devcarry .criu-root
