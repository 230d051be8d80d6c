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

# shellcheck source=scripts/pinned-deb.sh
. "$repo/scripts/pinned-deb.sh"
pinned_deb_tools
glibc_dir=$CRIU_ROOT/usr/lib/x86_64-linux-gnu
for f in ld-linux-x86-64.so.2 libc.so.6; do
    [[ -e $glibc_dir/$f ]] || die "no $glibc_dir/$f: checkpointctl runs on the CRIU root's glibc; run scripts/install-criu.sh first (or set GPUSNAP_CRIU_ROOT)"
done

mkdir -p -- "$(dirname -- "$ROOT")"
pinned_deb_lock checkpointctl "$ROOT"
if [[ ${GPUSNAP_CHECKPOINTCTL_FORCE:-0} != 1 ]] && root_works "$ROOT"; then
    say "checkpointctl $DEB_VERSION was installed in $ROOT by a concurrent run"
    exit 0
fi

pinned_deb_clear "$ROOT" "$STAMP" GPUSNAP_CHECKPOINTCTL_ROOT

work=$(mktemp -d "${TMPDIR:-/tmp}/gpusnap-checkpointctl-build.XXXXXX")
trap 'rm -rf -- "$work"' EXIT

deb=checkpointctl_${DEB_VERSION}_amd64.deb
url=$MIRROR/$POOL/$deb
pinned_deb_fetch "$url" "$work/$deb" "$DEB_SHA256" checkpointctl "$DEB_VERSION" \
    "update DEB_VERSION and DEB_SHA256 at the top of $script" trixie forky sid

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
