#!/usr/bin/env bash
# The project's single test command. On a fresh Debian 12 (x86_64) machine, as root:
#
#     scripts/test.sh [extra `cargo test` arguments, e.g. -- --nocapture]
#
# 1. builds the private CRIU 4.1.1 and 4.2 roots (scripts/install-criu.sh; fast when present)
#    and unpacks containerd 2.x and checkpointctl for the CRI tests
#    (scripts/install-containerd.sh, scripts/install-checkpointctl.sh),
# 2. cargo fmt --all -- --check
# 3. the structure check, python3 scripts/structure.py (the crates' layers, import cycles and
#    module maps against scripts/layers.toml; its unit tests, scripts/test_*.py, first); skipped
#    with a message if python3 is missing
# 4. cargo clippy --workspace --all-targets -- -D warnings, then cargo doc (broken intra-doc
#    links are errors)
# 5. the GPU harness's Python unit tests (gpu/test_*.py: the tick checker), on the CPU; skipped
#    with a message if python3 is missing
# 6. cargo test --workspace --no-fail-fast  (includes criu-tests: real criu dump/restore, and the
#    Podman test, which installs the gpusnap package, runs containers and purges it; needs root)
# 7. the same tests again against CRIU 4.2.x (Debian sid, in .criu-root-sid): the first CRIU with
#    the POST_FORKING hook, where gpusnap's restore-time checksum pass runs beside CRIU's restore
#
# Stops at the first failing step. GPUSNAP_SKIP_CRIU_TESTS=1 skips the CRIU install and the
# CRIU tests (for machines where you cannot be root); they report themselves as skipped.
#
# Tools the full run needs (.ci/run installs the missing ones on Debian 12): cargo with rustfmt
# and clippy, gcc and libc6-dev, apt/dpkg/flock and debian-archive-keyring (the CRIU roots,
# from the network the first time), python3 (the GPU harness's unit tests), podman, runc,
# busybox-static and tar (the Podman test), protoc, curl and xz (the CRI tests' containerd and
# checkpointctl, unpacked from Debian's archive). What cannot run is SKIPPED, never passed: every
# skipped test or step is listed, with the reason, in the summary at the end (also when a later
# step fails), which then says "passed, except what was SKIPPED". A test says it was skipped
# with a line "<crate>: SKIPPED <test>: <why>" on stderr (criu-tests::harness::skipped); tests
# marked #[ignore] are listed as IGNORED, with cargo's reason. GPUSNAP_REQUIRE_ALL=1 (.ci/run
# sets it) makes a skip a failure; an IGNORED test (a decision written into the code, with its
# reason) is listed but does not fail it.
set -euo pipefail

repo=$(dirname -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")")
cd -- "$repo"

started=$SECONDS
step() {
    echo
    echo "==> [$((SECONDS - started))s] $*"
}
# What did not run, one "what: why" a line, for the summary.
skipped=()
ignored=()
skip() {
    skipped+=("$1")
    echo "test.sh: SKIPPED $1"
}
# The tests and steps that did not run, so far.
not_run() {
    if ((${#skipped[@]})); then
        echo "test.sh: ${#skipped[@]} SKIPPED (not run, so not passed):"
        printf '    SKIPPED %s\n' "${skipped[@]}"
    fi
    if ((${#ignored[@]})); then
        echo "test.sh: ${#ignored[@]} IGNORED (#[ignore] in the code, not run, so not passed):"
        printf '    IGNORED %s\n' "${ignored[@]}"
    fi
}
fail() {
    echo >&2
    not_run >&2
    echo "test.sh: FAILED: $*" >&2
    exit 1
}
# `cargo test "$@"` with its output also in a log, whose "<crate>: SKIPPED <test>: <why>"
# lines (the tests' own word that they did not run) and "test <name> ... ignored" lines go to
# the summary.
cargo_test() {
    local label=$1 log line
    shift
    log=$(mktemp "${TMPDIR:-/tmp}/gpusnap-test-log.XXXXXX")
    local rc=0
    cargo test "$@" 2>&1 | tee "$log" || rc=$?
    while IFS= read -r line; do
        skip "$label: ${line#*: SKIPPED }"
    done < <(grep -a -o -E '[A-Za-z0-9_-]+: SKIPPED [^:]+: .*' "$log" | sort -u)
    while IFS= read -r line; do
        line=${line#test }
        ignored+=("$label: ${line/ ... ignored/}")
    done < <(grep -a -o -E 'test .+ \.\.\. ignored.*' "$log" | sort -u)
    rm -f -- "$log"
    return "$rc"
}

command -v cargo >/dev/null || fail "cargo not found on PATH (install Rust with rustup; see README)"

if [[ ${GPUSNAP_SKIP_CRIU_TESTS:-0} == 1 ]]; then
    step "GPUSNAP_SKIP_CRIU_TESTS=1: not installing CRIU; the CRIU tests will be skipped"
    skip "the CRIU roots and every CRIU test (also against CRIU 4.2): GPUSNAP_SKIP_CRIU_TESTS=1"
else
    [[ $(id -u) == 0 ]] ||
        fail "must run as root: the CRIU tests run real criu dump/restore (or set GPUSNAP_SKIP_CRIU_TESTS=1 to skip them)"
    step "scripts/install-criu.sh"
    scripts/install-criu.sh || fail "could not install the private CRIU root (scripts/install-criu.sh)"
    step "GPUSNAP_CRIU_SUITE=sid scripts/install-criu.sh (CRIU 4.2)"
    GPUSNAP_CRIU_SUITE=sid GPUSNAP_CRIU_ROOT=$repo/.criu-root-sid scripts/install-criu.sh ||
        fail "could not install the private CRIU 4.2 root (GPUSNAP_CRIU_SUITE=sid scripts/install-criu.sh)"
    # The CRI test's containerd 2.x (fast when present). Without it that test says SKIPPED.
    step "scripts/install-containerd.sh"
    scripts/install-containerd.sh || skip "containerd 2.x for the CRI test: scripts/install-containerd.sh failed (above)"
    # checkpointctl for the CRI tests (after the CRIU roots: it runs on their glibc). Without
    # it their checkpointctl checks say SKIPPED.
    step "scripts/install-checkpointctl.sh"
    scripts/install-checkpointctl.sh || skip "checkpointctl for the CRI tests: scripts/install-checkpointctl.sh failed (above)"
fi

step "cargo fmt --all -- --check"
cargo fmt --all -- --check || fail "formatting differs: run 'cargo fmt --all'"

# The plan checked against the code: the rules are scripts/layers.toml (docs/development.md).
if command -v python3 >/dev/null; then
    step "python3 scripts/structure.py (after its unit tests, scripts/test_*.py)"
    python3 -B -m unittest discover -s scripts -p 'test_*.py' ||
        fail "the structure checker's unit tests failed (scripts/test_*.py)"
    python3 -B scripts/structure.py ||
        fail "the structure check found a problem (python3 scripts/structure.py; the rules are in scripts/layers.toml)"
else
    step "python3 not found"
    skip "the structure check (python3 scripts/structure.py): python3 not found"
fi

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings || fail "clippy reported warnings or errors"

# The docs' links between items are checked: a moved or renamed item breaks them here first.
step "cargo doc --workspace --no-deps (broken intra-doc links are errors)"
RUSTDOCFLAGS="-D rustdoc::broken_intra_doc_links" cargo doc --workspace --no-deps --quiet ||
    fail "cargo doc found broken intra-doc links"

# The GPU scripts run only on a GPU machine; the parts of them that need none are tested here.
if command -v python3 >/dev/null; then
    step "python3 -m unittest discover -v -s gpu -p 'test_*.py'"
    pylog=$(mktemp "${TMPDIR:-/tmp}/gpusnap-test-log.XXXXXX")
    rc=0
    python3 -B -m unittest discover -v -s gpu -p 'test_*.py' 2>&1 | tee "$pylog" || rc=$?
    # unittest -v: "test_x (module.Class.test_x) ... skipped 'why'" (after the first line of the
    # test's docstring, if it has one)
    while IFS= read -r line; do
        skip "Python unit tests: ${line/ ... skipped /: }"
    done < <(grep -a -E ' \.\.\. skipped ' "$pylog" | sort -u)
    rm -f -- "$pylog"
    ((rc == 0)) || fail "the GPU harness's Python unit tests failed (gpu/test_*.py)"
else
    step "python3 not found"
    skip "the GPU harness's Python unit tests (gpu/test_*.py): python3 not found"
fi

step "cargo test --workspace --no-fail-fast $*"
cargo_test "cargo test (CRIU 4.1.1)" --workspace --no-fail-fast "$@" || fail "tests failed (CRIU test work dirs of failed tests are kept under target/*/criu-tests/)"

if [[ ${GPUSNAP_SKIP_CRIU_TESTS:-0} != 1 ]]; then
    step "cargo test --workspace --no-fail-fast $* against CRIU 4.2 (.criu-root-sid)"
    GPUSNAP_CRIU_SUITE=sid GPUSNAP_CRIU_ROOT=$repo/.criu-root-sid cargo_test "cargo test (CRIU 4.2)" --workspace --no-fail-fast "$@" ||
        fail "tests failed against CRIU 4.2 (GPUSNAP_CRIU_SUITE=sid GPUSNAP_CRIU_ROOT=.criu-root-sid)"
fi

step "summary"
if ((${#skipped[@]})) && [[ ${GPUSNAP_REQUIRE_ALL:-0} == 1 ]]; then
    fail "GPUSNAP_REQUIRE_ALL=1 and ${#skipped[@]} tests or steps were SKIPPED"
fi
not_run
if ((${#skipped[@]} + ${#ignored[@]})); then
    echo "test.sh: passed, except what was SKIPPED or IGNORED (above)"
else
    echo "test.sh: all checks passed (nothing skipped or ignored)"
fi
