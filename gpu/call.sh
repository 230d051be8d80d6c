# Sourced by the scripts that make one device call (gpu/run.sh): the call's name and time
# limit, its log, and the packing of everything it wrote into one archive (a device call brings
# back at most 8 files).
#
#     . gpu/call.sh; call_begin NAME LIMIT_S
#     say "text"              # a line in $OUT/NAME.log, with the seconds since the start
#     call_header             # say the build, the GPU and the CRIU the call runs on
#     left                    # the seconds left of LIMIT_S
#     cap S                   # S, or the seconds left if fewer
#     passed FILE.jsonl       # "N passed of M" (", K refused") of a file of case records
#     call_end                # $OUT/NAME.tar.gz (and NAME.log) only, the rest removed
call_begin() {
    CALL_NAME=$1
    CALL_LIMIT=$2
    export OUT=${OUT:-$PWD/out}
    mkdir -p "$OUT"
    CALL_T0=$(date +%s)
}
say() { echo "[$CALL_NAME +$(( $(date +%s) - CALL_T0 ))s] $*" | tee -a "$OUT/$CALL_NAME.log"; }
left() { echo $(( CALL_LIMIT - ($(date +%s) - CALL_T0) )); }
cap() { local l; l=$(left); (( l < $1 )) && echo "$l" || echo "$1"; }
call_end() {
    (cd "$OUT" && tar czf "$CALL_NAME.tar.gz" --exclude="$CALL_NAME.tar.gz" \
        --exclude="$CALL_NAME.log" . 2>/dev/null)
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name "$CALL_NAME.tar.gz" ! -name "$CALL_NAME.log" \
        -exec rm -rf {} +
    # shellcheck disable=SC2012
    say "done; $(ls "$OUT" | tr '\n' ' ')"
}
call_header() {
    say "build $(cat .devcarry/COMMIT 2>/dev/null); $(nvidia-smi --query-gpu=name,driver_version \
        --format=csv,noheader 2>&1 | head -1); criu $(scripts/criu --version 2>&1 | head -1)"
}
passed() {
    local n p r
    [[ -f $1 ]] || { echo "no ${1##*/}"; return; }
    n=$(wc -l <"$1")
    p=$(grep -c '"pass": true' "$1")
    r=$(grep -c '"refused": true' "$1")
    echo "$p passed of $n$( ((r)) && echo ", $r refused")"
}
