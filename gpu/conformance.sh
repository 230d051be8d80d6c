#!/usr/bin/env bash
# Third-party CUDA test suites (CuPy's cuda_tests; PyTorch's CUDA multiprocessing tests) run
# without the agent, with it, and with it and GPUSNAP_AGENT_MIN_BYTES=0; what fails only with the
# agent is listed (see gpu/conformance.py).
#
# Usage: gpu/conformance.sh [--deadline-s 200] [--suites cupy-cuda_tests,torch-multiprocessing-cuda]
# Needs .devcarry/libgpusnap_agent.so and the suites' files in .devcarry/conformance/ (carried;
# gpu/fetch-conformance.md says how they get there), python3 with pytest, pytest-timeout,
# pytest-xdist, CuPy and PyTorch. Output: $OUT/conformance.jsonl, $OUT/conformance.log, the JUnit
# XML of each run. Exit status 1 if any test fails only with the agent. At most --deadline-s
# (default 200 s; each run is also cut at 110 s: CuPy's took 81 s on the H200).
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
agent=$PWD/.devcarry/libgpusnap_agent.so
[[ -f $agent ]] || { echo "gpu/conformance.sh: $agent missing (carry .devcarry)" >&2; exit 2; }
[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,12p' "$0"; exit 0; }
"$PY" -c 'import cupy, torch; print("cupy", cupy.__version__, "torch", torch.__version__)' 2>&1 |
    tee -a "$OUT/conformance.log" || true
exec "$PY" gpu/conformance.py --agent "$agent" --carry "$PWD/.devcarry/conformance" --out "$OUT" "$@"
