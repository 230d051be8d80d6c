#!/usr/bin/env bash
# The agent on a real GPU, without CRIU: a CUDA C program and PyTorch, each preloaded with the
# agent, go through hello/list, an aborted dump, dump + release, the driver's own checkpoint and
# restore of the (now data-less) process, restore of the data at the same addresses, and a
# second in-memory cycle; the programs verify their checksums after each step.
#   agent/tests/gpu/run.sh <dir with libgpusnap_agent.so and agent_client> <out dir>
set -u
BIN=$(realpath "$1")
OUT=$(realpath "$2")
HERE=$(cd "$(dirname "$0")" && pwd)
SO=$BIN/libgpusnap_agent.so
CLIENT=$BIN/agent_client
FAILS=0
fail() { echo "!! FAIL: $*"; FAILS=$((FAILS + 1)); }

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
nvcc --version | tail -2
nvcc -O2 -o /tmp/gpusnap-app "$HERE/app.cu" -lcuda || { echo "nvcc failed"; exit 1; }

start() { # name, command...
    local name=$1
    shift
    coproc APP { env GPUSNAP_AGENT_DEBUG=1 LD_PRELOAD="$SO" "$@" 2>"$OUT/$name.err"; }
    PID=
    while read -r -t 300 line <&"${APP[0]}"; do
        echo "app: $line"
        case $line in READY*) PID=${line#READY }; break ;; esac
    done
    [ -n "$PID" ] || { fail "$name did not start"; tail -20 "$OUT/$name.err"; return 1; }
}
cmd() { # one command to the app; its one-line answer in ANSWER
    echo "$1" >&"${APP[1]}"
    ANSWER=
    read -r -t 300 ANSWER <&"${APP[0]}" || ANSWER="(no answer)"
    echo "app $1: $ANSWER"
}
client() { echo "\$ agent_client $PID $*"; "$CLIENT" "$PID" "$@" || { fail "agent_client $*"; return 1; }; }
expect_ok() { case $ANSWER in *OK*) ;; *) fail "$1: $ANSWER" ;; esac; }

scenario() { # name
    local name=$1
    cmd mem
    client hello
    client list
    client abort
    cmd check; expect_ok "$name: check after abort"
    client dump 64 16 4
    cmd mem
    if client driver-ckpt; then
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv
        client driver-restore
    fi
    client restore 64 16 4
    cmd check; expect_ok "$name: check after dump, release, driver checkpoint+restore, restore"
    cmd touch
    cmd check; expect_ok "$name: check after touch"
    client cycle 32 8 2
    cmd check; expect_ok "$name: check after in-memory cycle"
    client bench 64 16 4
    client bench 256 8 8
    cmd touch
    cmd check; expect_ok "$name: check after bench and touch"
    cmd mem
    cmd exit; expect_ok "$name: exit"
    wait "$APP_PID" 2>/dev/null
    echo "agent log lines: $(wc -l <"$OUT/$name.err"); conversions: $(grep -c 'converted #' "$OUT/$name.err"); hooks handed out: $(grep -c 'handing out' "$OUT/$name.err")"
    grep -v -e 'converted #' -e 'freed #' -e 'request ' "$OUT/$name.err" | head -40
}

echo "=== CUDA C program (static cudart + driver API)"
start capp /tmp/gpusnap-app 8192 && scenario capp
echo "=== PyTorch (dynamic cudart, caching allocator)"
start torch python3 "$HERE/torch_app.py" 2048 && scenario torch
echo "=== PyTorch with expandable segments (the application's own VMM: recorded, left to the driver)"
start torch_exp env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$HERE/torch_app.py" 1024 && scenario torch_exp
echo "=== pass-through with GPUSNAP_AGENT_DISABLE=1, and non-CUDA programs"
GPUSNAP_AGENT_DISABLE=1 LD_PRELOAD="$SO" python3 -c 'import torch; x = torch.ones(1 << 22, device="cuda"); print("disabled sum", x.sum().item())' || fail "disabled torch"
LD_PRELOAD="$SO" nvidia-smi -L || fail "nvidia-smi preloaded"
rm -f /dev/shm/gpusnap-client.bin
echo "=== FAILS: $FAILS"
exit "$FAILS"
