#!/usr/bin/env bash
# One device call of GPU work, as a list of steps: what the dated one-off scripts of the GPU
# sessions of 2026-12-01 and 02 did (gpu/handover-run*.sh, gpu/ipc-run8.sh, gpu/session*-run*.sh;
# docs/bench-history.md says which ran when and where git keeps them).
#
#     gpu/run.sh [--limit-s 540] [--criu 4.2|4.1] [--name NAME] [--mock] [--dry-run]
#                STEP [--OPTION VALUE]... [STEP [--OPTION VALUE]...]...
#
# (the call's options first; then each step, followed by its own options)
#
# e.g.  gpu/run.sh pair --gib 16          gpu/run.sh prepare kill-matrix --points dump-drained
#       gpu/run.sh precopy --gib 16       gpu/run.sh conformance --suites cupy-cuda_tests
#       gpu/run.sh all                    gpu/run.sh prepare warmup pair --gib 64 --orders 2
#
# The steps run in the order given, each cut by its own time limit (below) and all of them by
# --limit-s (default 540 s, or CALL_LIMIT_S, for a 10-minute device call with room to pack);
# a step that the time left cannot hold is skipped and said so. Every step option takes a value.
# CRIU: --criu 4.2 (default) is .criu-root-sid (the POST_FORKING hook, the restore's
# hand-over beside CRIU's restore), 4.1 is .criu-root; carry it and .devcarry. Any step also
# takes --criu, for itself.
# --mock passes --mock to the steps whose scripts have one (no GPU: a test of the harness) and
# skips the others; --dry-run only says what each step would run.
#
# Steps [defaults] (time limit; the H200's times):
#   prepare      gpu/prepare.sh: builds the CUDA programs, /dev/shm at 120G          (80 s; ~40)
#   warm-shm     [--gib 30] writes and removes that much of /dev/shm, so the VM's first touch
#                of tmpfs pages lands on no measured case                           (40 s; ~15)
#   warmup       [--gib 16] one copy-first dump + restore that nothing measures       (60 s)
#   pair         [--gib 16] [--path splits] [--orders 1] [--leave-running yes] [--chunk-mib 1024]
#                [--env KEY=VALUE,...] (more of criu's environment, e.g.
#                GPUSNAP_ASYNC_SNAPSHOT_SHARE=80)
#                the hand-over against copy-first in one run (gpu/e2e.sh --path splits), dump +
#                restore and -R each; --orders 2 then runs copy-first before the hand-over
#                again; --path split: the hand-over alone; --path split-async: -R with
#                async_leave_running, then `gpusnap wait` and verify                (150 s; ~70)
#   paths        [--gib 16] [--name handover-h200] bench/run.sh: the hand-over, copy-first and
#                transparent in one run                                                (180 s)
#   kill-matrix  [--gib 16] [--paths split] [--points every one] [--name
#                faults-matrix-handover-h200] gpu/faults.py --cases kill-matrix: CRIU killed at
#                each fault point the paths reach                                 (330 s; ~300)
#   precopy      [--gib 16] [--name precopy-handover-h200] gpu/precopy.sh: two live rounds,
#                the final dump against the last, the restore                      (90 s; ~45)
#   conformance  [--suites every one] [--run-timeout-s 110] gpu/conformance.sh: CuPy's and
#                PyTorch's CUDA tests without the agent and with it                   (220 s)
#   ipc          gpu/ipc.sh: CUDA tensors shared with a torch.multiprocessing child    (150 s)
#   ipc-probe    [--configs tensor-no-agent,tensor-agent,event-no-agent] gpu/ipc_probe.py:
#                what the driver's checkpoint does to processes sharing CUDA memory  (150 s)
#   ipc-pair     [--cases dump-restore,leave-running] [--alloc default] [--points every one]
#                [--name ipc-ckpt] gpu/ipc_ckpt.py: a PyTorch producer/consumer pair sharing a
#                tensor through the agent, checkpointed; --cases kill-matrix: its kill points;
#                --alloc expandable: expandable segments                               (250 s)
#   shareable    [--modes scm,pidfd] gpu/shareable_ckpt.py: the shareable-handle pair (100 s)
#   torch        [--cases train-R,train-exp-R] [--paths split,split-copyfirst]
#                [--name torch-handover-h200] gpu/torch_cases.sh                       (300 s)
#   node-checks  [--gib 1] gpu/node_checks.py: an image refused by a node that cannot take it
#                (device_map onto no such GPU, another kernel driver, another libcuda),
#                inspect's fields from a real image, then the plain restore        (120 s)
#   async-kills  [--gib 4] [--points all three] gpu/async_kills.py: the asynchronous -R
#                killed at its points; the job runs on, the image refused     (150 s)
#   jax          [--paths split] gpu/jax_case.sh: JAX in its default configuration    (100 s)
#   cycles       [--cycles 20] [--gib 4] [--path split] gpu/cycles.sh                  (140 s)
#   ring-probe   [--gib 64] the floor: gpu/ring_probe.cu's ring write rate (after prepare) (60 s)
#   cupy-texture [--runs 2] CuPy's test_texture.py with the agent                (120 s a run)
#   all          [--gib 16] = prepare warm-shm pair precopy kill-matrix conformance: a new
#                build's first call (the kill matrix takes most of it; what does not fit is
#                said as skipped: run it in the next call)
#
# Output: $OUT (default ./out) holds NAME.log (one line a step: its return code and what it
# passed) and NAME.tar.gz (everything else: each step's output STEP.out, logs, JSONL records;
# a step's logs.tar is renamed logs-STEP.tar). NAME defaults to run-STEP-STEP... Copy the
# records worth keeping into bench/results/ with the command, the build and the machine.
# Exit status: 0 if every step ran and passed, 1 if one failed or was skipped, 2 on a usage error.

# The steps' functions are called by name (step_STEP):
# shellcheck disable=SC2317
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$PWD
# shellcheck source=gpu/call.sh disable=SC1091
. gpu/call.sh

# criu_root 4.2|4.1: the private CRIU root of that version (GPUSNAP_CRIU_ROOT).
criu_root() {
    case $1 in
        4.2) echo "$repo/.criu-root-sid" ;;
        4.1) echo "$repo/.criu-root" ;;
        *) return 1 ;;
    esac
}
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
die() { echo "gpu/run.sh: $*" >&2; exit 2; }

# The options of each step (each takes a value).
declare -A OPTS=(
    [prepare]="" [warm-shm]="gib" [warmup]="gib" [pair]="gib path orders leave-running chunk-mib env"
    [paths]="gib name" [kill-matrix]="gib paths points name" [precopy]="gib name"
    [conformance]="suites run-timeout-s" [ipc]="" [ipc-probe]="configs"
    [ipc-pair]="cases alloc points name" [shareable]="modes" [torch]="cases paths name"
    [jax]="paths" [node-checks]="gib" [async-kills]="gib points" [cycles]="cycles gib path" [ring-probe]="gib" [cupy-texture]="runs"
    [all]="gib"
)

cmdline="gpu/run.sh $*"
limit=${CALL_LIMIT_S:-540}
criu=4.2
name=
mock=()
dry=0
steps=()  # the step names, in order
args=()   # each step's options, "key=value" lines
while (($#)); do
    if [[ $1 == -h || $1 == --help ]]; then
        usage
        exit 0
    elif ((${#steps[@]} == 0)) && [[ $1 == --* ]]; then
        # The call's own options, before the first step.
        case $1 in
            --limit-s) limit=${2:?--limit-s needs a value}; shift 2 ;;
            --criu) criu=${2:?--criu needs a value}; shift 2 ;;
            --name) name=${2:?--name needs a value}; shift 2 ;;
            --mock) mock=(--mock); shift ;;
            --dry-run) dry=1; shift ;;
            *) die "unknown option $1 (see gpu/run.sh --help)" ;;
        esac
    elif [[ $1 == --* ]]; then
        # An option of the last step named.
        key=${1#--}
        s=${steps[-1]}
        [[ " ${OPTS[$s]} criu " == *" $key "* ]] ||
            die "step $s has no option $1 (it takes: ${OPTS[$s]:+${OPTS[$s]} }criu)"
        (($# >= 2)) || die "$1 needs a value"
        [[ $key != criu ]] || criu_root "$2" >/dev/null || die "--criu $2: 4.2 or 4.1"
        args[-1]+="$key=$2"$'\n'
        shift 2
    else
        [[ -n ${OPTS[$1]+x} ]] || die "unknown step $1 (see gpu/run.sh --help)"
        steps+=("$1")
        args+=("")
        shift
    fi
done
((${#steps[@]})) || { usage; exit 2; }
[[ $limit =~ ^[0-9]+$ ]] || die "--limit-s $limit is not a number of seconds"
criu_root "$criu" >/dev/null || die "--criu $criu: 4.2 or 4.1"
[[ -n $name ]] || name=$(IFS=-; echo "run-${steps[*]}" | cut -c1-40)
# `all` stands for its steps, each given its options (--gib where the step has one).
expanded=() expanded_args=()
for i in "${!steps[@]}"; do
    if [[ ${steps[i]} == all ]]; then
        for s in prepare warm-shm pair precopy kill-matrix conformance; do
            expanded+=("$s")
            expanded_args+=("${args[i]}")
        done
    else
        expanded+=("${steps[i]}")
        expanded_args+=("${args[i]}")
    fi
done
steps=("${expanded[@]}")
args=("${expanded_args[@]}")

call_begin "$name" "$limit"
agent=$repo/.devcarry/libgpusnap_agent.so
say "$cmdline: ${steps[*]} (limit ${limit}s, CRIU $criu${mock[*]:+, mock}$( ((dry)) &&
    echo ", a dry run"))"
if ((dry == 0)); then
    GPUSNAP_CRIU_ROOT=$(criu_root "$criu") call_header
    [[ -n ${mock[*]} || -f $agent ]] || say "WARNING: $agent missing (carry .devcarry)"
fi

status=0
skipped=0 # whether the last run was skipped
cur=""   # the running step's options
label="" # the running step's name in the files ($OUT/LABEL.out), unique in the call
# opt KEY DEFAULT: the running step's option KEY, or DEFAULT.
opt() {
    local line
    while IFS= read -r line; do
        [[ -n $line && ${line%%=*} == "$1" ]] && { echo "${line#*=}"; return; }
    done <<<"$cur"
    echo "$2"
}
# budget MAX: the seconds this step may take: MAX, or what is left if less.
budget() { cap "$1"; }
# run MIN_S LIMIT_S CMD...: CMD cut at LIMIT_S, its output in $OUT/LABEL.out; skipped (a failure
# of the call) when LIMIT_S is under MIN_S. Returns CMD's status.
run() {
    local min=$1 t=$2 rc
    shift 2
    skipped=0
    if ((t < min)); then
        skipped=1
        say "$label skipped: ${t}s left, it needs ${min}s"
        status=1
        return 1
    fi
    if ((dry)); then
        say "$label would run (at most ${t}s): $*"
        return 0
    fi
    timeout "$t" "$@" >"$OUT/$label.out" 2>&1
    rc=$?
    [[ -f $OUT/logs.tar ]] && mv "$OUT/logs.tar" "$OUT/logs-$label.tar"
    ((rc == 0)) || status=1
    ((rc == 124)) && say "$label cut at ${t}s"
    return "$rc"
}
# report TEXT: a step's result line (none in a dry run or for a step skipped).
report() { ((dry || skipped)) || say "$@"; }
# no_mock: under --mock, say that this step has no mock and skip it.
no_mock() {
    ((${#mock[@]})) || return 1
    say "$label skipped: no --mock for it"
    return 0
}

step_prepare() {
    run 20 "$(budget 80)" gpu/prepare.sh "$OUT/prepare.log" "${mock[@]}"
    report "prepare rc $?"
}
step_warm-shm() {
    no_mock && return
    local gib
    gib=$(opt gib 30)
    # The VM's first touch of tmpfs pages would otherwise land on whichever case writes first.
    # shellcheck disable=SC2016
    run 10 "$(budget 40)" bash -c 'dd if=/dev/zero of=/dev/shm/gpusnap-warm bs=1M count="$1" \
        status=none; rc=$?; rm -f /dev/shm/gpusnap-warm; exit "$rc"' _ "$((gib * 1024))"
    report "warmed ${gib} GiB of /dev/shm: rc $?"
}
step_warmup() {
    run 20 "$(budget 60)" gpu/e2e.sh --gib "$(opt gib 16)" --path split-copyfirst \
        --no-leave-running --log-name "$label" "${mock[@]}"
    report "warm-up (copy-first, $(opt gib 16) GiB) rc $?: $(passed "$OUT/$label.jsonl")"
}
step_pair() {
    local gib path orders lr=()
    gib=$(opt gib 16)
    path=$(opt path splits)
    orders=$(opt orders 1)
    [[ $(opt leave-running yes) == yes ]] || lr=(--no-leave-running)
    lr+=(--chunk-mib "$(opt chunk-mib 1024)")
    local kv
    for kv in $(opt env "" | tr ',' ' '); do lr+=(--criu-env "$kv"); done
    run 40 "$(budget 150)" gpu/e2e.sh --gib "$gib" --path "$path" --log-name "$label" \
        "${lr[@]}" "${mock[@]}"
    report "pair ($path, $gib GiB) rc $?: $(passed "$OUT/$label.jsonl")$(lend_times \
        "$OUT/$label.log")"
    if ((orders == 2)); then
        local saved=$label
        label=$saved-b
        run 40 "$(budget 150)" python3 gpu/e2e.py --gib "$gib" --path split-copyfirst \
            --log-name "$label" "${lr[@]}" "${mock[@]}" &&
            label=$saved-c &&
            run 40 "$(budget 150)" python3 gpu/e2e.py --gib "$gib" --path split \
                --log-name "$label" "${lr[@]}" "${mock[@]}"
        report "pair, other order (copy-first, then the hand-over) rc $?:" \
            "$(passed "$OUT/$saved-b.jsonl"); $(passed "$OUT/$saved-c.jsonl")"
        label=$saved
    fi
}
# The lend times the hand-over's dumps logged, if any.
lend_times() {
    local t
    t=$(grep -ho 'lend [0-9.]* s' "$1" 2>/dev/null | tr '\n' ' ')
    [[ -n $t ]] && echo "; $t"
}
step_paths() {
    local t
    t=$(budget 180)
    run 60 "$t" bench/run.sh --sizes "$(opt gib 16)" --paths split,split-copyfirst,transparent \
        --no-pcie --no-floor --name "$(opt name handover-h200)" --budget-s "$((t - 30))" \
        "${mock[@]}"
    report "paths rc $?"
}
step_kill-matrix() {
    local t n points
    t=$(budget 330)
    n=$(opt name faults-matrix-handover-h200)
    points=$(opt points "")
    run 60 "$t" python3 gpu/faults.py --cases kill-matrix --paths "$(opt paths split)" \
        --matrix-gib "$(opt gib 16)" ${points:+--points "$points"} --name "$n" \
        --deadline-s "$((t - 15))" "${mock[@]}"
    report "kill matrix rc $?: $(passed "$OUT/$n.jsonl")"
}
step_precopy() {
    no_mock && return
    run 30 "$(budget 90)" gpu/precopy.sh --gib "$(opt gib 16)" \
        --name "$(opt name precopy-handover-h200)"
    report "precopy rc $?: $(grep -o 'final {"pause_s": [0-9.]*' "$OUT/$label.out" 2>/dev/null |
        tail -1)"
}
step_conformance() {
    no_mock && return
    local t suites
    t=$(budget 220)
    suites=$(opt suites "")
    run 60 "$t" gpu/conformance.sh --deadline-s "$((t - 10))" ${suites:+--suites "$suites"} \
        --run-timeout-s "$(opt run-timeout-s 110)"
    report "conformance rc $?"
}
step_ipc() {
    no_mock && return
    local t
    t=$(budget 150)
    run 40 "$t" gpu/ipc.sh --deadline-s "$((t - 10))"
    report "ipc rc $?"
}
step_ipc-probe() {
    no_mock && return
    local t
    t=$(budget 150)
    run 40 "$t" python3 gpu/ipc_probe.py all --agent "$agent" --out "$OUT" \
        --deadline-s "$((t - 5))" \
        --configs "$(opt configs tensor-no-agent,tensor-agent,event-no-agent)"
    report "ipc probe rc $?"
}
step_ipc-pair() {
    local t cases alloc points n
    t=$(budget 250)
    cases=$(opt cases dump-restore,leave-running)
    alloc=$(opt alloc default)
    points=$(opt points "")
    n=ipc-ckpt
    [[ $cases == kill-matrix ]] && n=ipc-kill-matrix
    [[ $alloc == expandable ]] && n=ipc-torch-expandable
    n=$(opt name "$n")
    run 40 "$t" python3 gpu/ipc_ckpt.py run --agent "$agent" --out "$OUT" --cases "$cases" \
        --alloc "$alloc" ${points:+--points "$points"} --deadline-s "$((t - 10))" --name "$n" \
        "${mock[@]}"
    report "ipc pair ($cases, $alloc) rc $?: $(passed "$OUT/$n.jsonl")"
}
step_shareable() {
    local t
    t=$(budget 100)
    run 30 "$t" python3 gpu/shareable_ckpt.py --agent "$agent" --out "$OUT" \
        --modes "$(opt modes scm,pidfd)" --deadline-s "$((t - 8))" "${mock[@]}"
    report "shareable pair rc $?: $(passed "$OUT/shareable-ckpt.jsonl")"
}
step_torch() {
    local t cpu=()
    t=$(budget 300)
    ((${#mock[@]})) && cpu=(--size tiny --device cpu)
    run 90 "$t" gpu/torch_cases.sh --cases "$(opt cases train-R,train-exp-R)" \
        --paths "$(opt paths split,split-copyfirst)" --name "$(opt name torch-handover-h200)" \
        --budget-s "$((t - 60))" "${cpu[@]}"
    report "torch rc $?: $(grep -ho 'of the lent are RDMA-capable' "$OUT"/*.log 2>/dev/null |
        wc -l) RDMA lines"
}
step_node-checks() {
    no_mock && return
    run 40 "$(budget 120)" python3 gpu/node_checks.py --gib "$(opt gib 1)"
    report "node checks rc $?: $(passed "$OUT/node-checks.jsonl")"
}
step_async-kills() {
    no_mock && return
    run 40 "$(budget 150)" python3 gpu/async_kills.py --gib "$(opt gib 4)" \
        --points "$(opt points dump-snapshot-copied,async-drain-started,async-before-manifest)"
    report "async kill points rc $?: $(passed "$OUT/async-kills.jsonl")"
}
step_jax() {
    local t
    t=$(budget 100)
    run 60 "$t" gpu/jax_case.sh --paths "$(opt paths split)" --budget-s "$((t - 40))" "${mock[@]}"
    report "jax rc $?"
}
step_cycles() {
    local t
    t=$(budget 140)
    run 60 "$t" gpu/cycles.sh --cycles "$(opt cycles 20)" --gib "$(opt gib 4)" \
        --path "$(opt path split)" --budget-s "$((t - 30))" "${mock[@]}"
    report "cycles rc $?"
}
step_ring-probe() {
    no_mock && return
    run 20 "$(budget 60)" /tmp/gpusnap-bin/ring_probe --gib "$(opt gib 64)" --repeat 2 \
        --dir /dev/shm/gpusnap-probe --slots 16 --slot-mib 32 --streams 4 --threads 16
    report "ring probe rc $?: $(grep -o '"write_gbps": [0-9.]*' "$OUT/$label.out" 2>/dev/null |
        tr '\n' ' ')"
    rm -rf /dev/shm/gpusnap-probe
}
step_cupy-texture() {
    no_mock && return
    local i saved=$label
    for ((i = 1; i <= $(opt runs 2); i++)); do
        label=$saved-$i
        # shellcheck disable=SC2016
        run 30 "$(budget 120)" bash -c 'cd .devcarry/conformance/cupy-v14.2.0 &&
            LD_PRELOAD=$1 python3 -m pytest -p no:cacheprovider -q -n 8 \
            tests/cupy_tests/cuda_tests/test_texture.py' _ "$agent"
        report "cupy test_texture.py with the agent, run $i: rc $?" \
            "($(tail -1 "$OUT/$label.out" 2>/dev/null))"
    done
    label=$saved
}

declare -A seen=()
for i in "${!steps[@]}"; do
    s=${steps[i]}
    cur=${args[i]}
    seen[$s]=$((${seen[$s]:-0} + 1))
    label=$s
    ((${seen[$s]} > 1)) && label=$s-${seen[$s]}
    c=$(opt criu "$criu")
    GPUSNAP_CRIU_ROOT=$(criu_root "$c")
    export GPUSNAP_CRIU_ROOT
    ((dry)) || [[ -e $GPUSNAP_CRIU_ROOT/usr/sbin/criu ]] ||
        say "WARNING: no $GPUSNAP_CRIU_ROOT/usr/sbin/criu for CRIU $c (carry it)"
    [[ $c == "$criu" ]] || say "$label on CRIU $c"
    "step_$s"
done
say "finished: status $status"
((dry)) || call_end
exit "$status"
