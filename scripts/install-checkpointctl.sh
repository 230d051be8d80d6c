#!/usr/bin/env bash
# Unpack Debian's checkpointctl (the checkpoint-restore project's tool that reads the checkpoint
# archives of Podman, CRI-O and containerd) into <repo>/.checkpointctl-root, for the CRI tests
# (criu-tests/cri), which run `checkpointctl inspect` on the CRI checkpoint archives.
#
# Why: Debian 12 has no checkpointctl; trixie, forky and sid ship 1.3.0, a Go program that
# needs glibc >= 2.38 (one symbol, __isoc23_strtol), and Debian 12 has 2.36. Nothing is
# installed into the system: the one pinned .deb is fetched from the archive's pool, checked
# against its sha256 and `dpkg-deb -x`ed into the root, and the glibc it runs on (loader and
# libc.so.6) is copied there from the CRIU root that scripts/install-criu.sh built (trixie's
# glibc 2.41: run that script first; scripts/test.sh does). scripts/checkpointctl runs it
# through that loader.
#
# Usage: scripts/install-checkpointctl.sh   (needs network the first time)
# Env:   GPUSNAP_CHECKPOINTCTL_ROOT    target directory (default: <repo>/.checkpointctl-root);
#                                      also read by scripts/checkpointctl
#        GPUSNAP_CHECKPOINTCTL_MIRROR  Debian mirror (default: http://deb.debian.org/debian)
#        GPUSNAP_CHECKPOINTCTL_FORCE=1 unpack again even if the root already works
#        GPUSNAP_CRIU_ROOT             the CRIU root whose glibc is copied (default:
#                                      <repo>/.criu-root)
#        (do not leave the GPUSNAP_CHECKPOINTCTL_* ones exported when running criu: gpusnap
#        refuses unknown GPUSNAP_* variables in its environment)
#
# Idempotent: exits at once if the root is complete (stamp file .gpusnap-checkpointctl-root,
# naming the pinned package) and its checkpointctl runs.
set -euo pipefail

# The pinned package (trixie's, also what forky and sid have of 1.3.0): when the archive moves
# on (a new Debian revision, the old one removed from the pool), this script fails naming what
# the archive has now; update both lines from the new package's `SHA256:` in
# dists/<suite>/main/binary-amd64/Packages.
DEB_VERSION=1.3.0+ds1-2+b5
DEB_SHA256=7898b01698f87fe6693bfb39d3a5b2ab3018c762cade68ef6042c5ab8d112185
MIRROR=${GPUSNAP_CHECKPOINTCTL_MIRROR:-http://deb.debian.org/debian}
POOL=pool/main/g/golang-github-checkpoint-restore-checkpointctl

script=$(readlink -f -- "${BASH_SOURCE[0]}")
repo=$(dirname -- "$(dirname -- "$script")")
ROOT=$(realpath -m -- "${GPUSNAP_CHECKPOINTCTL_ROOT:-$repo/.checkpointctl-root}")
CRIU_ROOT=$(realpath -m -- "${GPUSNAP_CRIU_ROOT:-$repo/.criu-root}")
LAUNCHER=$repo/scripts/checkpointctl
STAMP=.gpusnap-checkpointctl-root

say() { echo "install-checkpointctl: $*"; }
die() {
    echo "install-checkpointctl: ERROR: $*" >&2
    exit 1
}

[[ -f $LAUNCHER ]] || die "launcher $LAUNCHER is missing (it is part of the repository)"
[[ -x $LAUNCHER ]] || chmod +x "$LAUNCHER"

# Does the root at $1 hold the pinned checkpointctl, running through its loader?
root_works() {
    grep -qxF "package checkpointctl $DEB_VERSION" "$1/$STAMP" 2>/dev/null || return 1
    GPUSNAP_CHECKPOINTCTL_ROOT=$1 "$LAUNCHER" inspect --help 2>/dev/null | grep -q -- '--format'
}

if [[ ${GPUSNAP_CHECKPOINTCTL_FORCE:-0} != 1 ]] && root_works "$ROOT"; then
    say "checkpointctl $DEB_VERSION already installed in $ROOT (set GPUSNAP_CHECKPOINTCTL_FORCE=1 to unpack again)"
    exit 0
fi

[[ $(uname -m) == x86_64 ]] || die "only x86_64 is supported (this is $(uname -m))"
for tool in dpkg-deb flock sha256sum xz; do
    command -v "$tool" >/dev/null || die "'$tool' not found: this script needs a Debian/Ubuntu host (dpkg, util-linux, coreutils, xz-utils)"
done
if command -v curl >/dev/null; then
    fetch() { curl -fsSL --retry 3 -o "$2" "$1"; }
elif [[ -x /usr/lib/apt/apt-helper ]]; then
    fetch() { /usr/lib/apt/apt-helper -q download-file "$1" "$2" >/dev/null; }
else
    die "neither curl nor apt's apt-helper found: install curl"
fi
glibc_dir=$CRIU_ROOT/usr/lib/x86_64-linux-gnu
for f in ld-linux-x86-64.so.2 libc.so.6; do
    [[ -e $glibc_dir/$f ]] || die "no $glibc_dir/$f: checkpointctl runs on the CRIU root's glibc; run scripts/install-criu.sh first (or set GPUSNAP_CRIU_ROOT)"
done

mkdir -p -- "$(dirname -- "$ROOT")"
# Serialize concurrent installers; the lock lives in /tmp so that nothing but the (gitignored)
# root appears in the repository.
exec 9>"${TMPDIR:-/tmp}/gpusnap-checkpointctl-root-$(printf %s "$ROOT" | md5sum | cut -c1-16).lock"
flock 9
if [[ ${GPUSNAP_CHECKPOINTCTL_FORCE:-0} != 1 ]] && root_works "$ROOT"; then
    say "checkpointctl $DEB_VERSION was installed in $ROOT by a concurrent run"
    exit 0
fi

if [[ -e $ROOT ]]; then
    # Only ever delete something we created ourselves.
    if [[ -f $ROOT/$STAMP || -f $ROOT/$STAMP.partial ]] || [[ -d $ROOT && -z $(ls -A -- "$ROOT") ]]; then
        say "removing broken or outdated root $ROOT"
        rm -rf -- "$ROOT"
    else
        die "$ROOT exists but was not created by this script (no $STAMP); move it away or set GPUSNAP_CHECKPOINTCTL_ROOT"
    fi
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpusnap-checkpointctl-build.XXXXXX")
trap 'rm -rf -- "$work"' EXIT

# What the archive offers now, for the message when the pinned package is gone or differs.
what_moved() {
    local suite out=""
    for suite in trixie forky sid; do
        if fetch "$MIRROR/dists/$suite/main/binary-amd64/Packages.xz" "$work/Packages-$suite.xz" 2>/dev/null; then
            out+=$(xz -dc "$work/Packages-$suite.xz" | awk -v s="$suite" '
                /^Package: checkpointctl$/ { p = 1 }
                p && /^Version:/ { v = $2 }
                p && /^SHA256:/ { h = $2 }
                p && /^$/ { printf "    %s: checkpointctl %s (sha256 %s)\n", s, v, h; p = 0 }')$'\n'
        else
            out+="    $suite: could not read its package index"$'\n'
        fi
    done
    printf '%s' "$out"
}

deb=checkpointctl_${DEB_VERSION}_amd64.deb
url=$MIRROR/$POOL/$deb
say "fetching $url"
if ! fetch "$url" "$work/$deb"; then
    die "the pinned checkpointctl $DEB_VERSION is no longer in $MIRROR's pool ($url); the archive now has:
$(what_moved)
  update DEB_VERSION and DEB_SHA256 at the top of $script"
fi
got=$(sha256sum "$work/$deb" | cut -d' ' -f1)
[[ $got == "$DEB_SHA256" ]] || die "$deb has sha256 $got, expected $DEB_SHA256 (the file at $url changed); the archive now has:
$(what_moved)"

mkdir -p "$ROOT"
echo "incomplete checkpointctl root being built by scripts/install-checkpointctl.sh" >"$ROOT/$STAMP.partial"
dpkg-deb -x "$work/$deb" "$ROOT"
# Only the binary is used: not the docs.
rm -rf -- "${ROOT:?}"/usr/share
[[ -x $ROOT/usr/bin/checkpointctl ]] || die "$deb has no usr/bin/checkpointctl"
mkdir -p "$ROOT/glibc"
cp -L -- "$glibc_dir/ld-linux-x86-64.so.2" "$glibc_dir/libc.so.6" "$ROOT/glibc/"
glibc=$("$ROOT/glibc/ld-linux-x86-64.so.2" --version 2>/dev/null | head -n1 || true)
{
    echo "# checkpointctl root built by scripts/install-checkpointctl.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# source: $url sha256 $DEB_SHA256"
    echo "# glibc from $CRIU_ROOT: $glibc"
    echo "package checkpointctl $DEB_VERSION"
} >"$ROOT/$STAMP"
root_works "$ROOT" || {
    GPUSNAP_CHECKPOINTCTL_ROOT=$ROOT "$LAUNCHER" inspect --help >&2 || true
    rm -f -- "$ROOT/$STAMP"
    die "the unpacked checkpointctl does not run through $ROOT/glibc (glibc >= 2.38 needed: $glibc)"
}
rm -f -- "$ROOT/$STAMP.partial"
say "installed checkpointctl $DEB_VERSION in $ROOT ($(du -sh "$ROOT" | cut -f1)), on $glibc"
