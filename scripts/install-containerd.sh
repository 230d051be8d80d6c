#!/usr/bin/env bash
# Unpack a private containerd 2.x (containerd, containerd-shim-runc-v2, ctr) from Debian's
# archive into <repo>/.containerd-root, for the CRI test (criu-tests/cri).
#
# Why: Debian 12 ships containerd 1.6, which has no CRI CheckpointContainer (containerd 2.0)
# and no restore from a checkpoint image (2.1). Debian sid and forky ship 2.1.9, a Go program
# linked only against glibc >= 2.34, so it runs on Debian 12 as it is. Nothing is installed
# into the system: the one pinned .deb is fetched from the archive's pool, checked against its
# sha256, and `dpkg-deb -x`ed into the root. runc is the host's (Debian 12's runc 1.1.5).
#
# Usage: scripts/install-containerd.sh   (needs network the first time)
# Env:   GPUSNAP_CONTAINERD_ROOT    target directory (default: <repo>/.containerd-root)
#        GPUSNAP_CONTAINERD_MIRROR  Debian mirror (default: http://deb.debian.org/debian)
#        GPUSNAP_CONTAINERD_FORCE=1 unpack again even if the root already works
#        (do not leave them exported when running criu: gpusnap refuses unknown GPUSNAP_*
#        variables in its environment)
#
# Idempotent: exits at once if the root is complete (stamp file .gpusnap-containerd-root) and
# its containerd reports the pinned version. The binaries are then
# <root>/usr/bin/{containerd,containerd-shim-runc-v2,ctr}.
set -euo pipefail

# The pinned package: when the archive moves on (a new Debian revision in sid and forky, the
# old one removed from the pool), this script fails naming what the archive has now; update
# both lines from the new package's `SHA256:` in dists/sid/main/binary-amd64/Packages.
CONTAINERD_VERSION=2.1.9
DEB_VERSION=2.1.9+ds1-5
DEB_SHA256=2dda86ce7033fd612fc50e136679d8174ccad680eb29cd4611e0d2a1b84cf591
MIRROR=${GPUSNAP_CONTAINERD_MIRROR:-http://deb.debian.org/debian}

script=$(readlink -f -- "${BASH_SOURCE[0]}")
repo=$(dirname -- "$(dirname -- "$script")")
ROOT=$(realpath -m -- "${GPUSNAP_CONTAINERD_ROOT:-$repo/.containerd-root}")
STAMP=.gpusnap-containerd-root
BINARIES=(containerd containerd-shim-runc-v2 ctr)

say() { echo "install-containerd: $*"; }
die() {
    echo "install-containerd: ERROR: $*" >&2
    exit 1
}

# Does the root at $1 hold the three binaries, containerd reporting $CONTAINERD_VERSION?
root_works() {
    local b v
    for b in "${BINARIES[@]}"; do
        [[ -x $1/usr/bin/$b ]] || return 1
    done
    v=$("$1/usr/bin/containerd" --version 2>/dev/null) || return 1
    # e.g. "containerd github.com/containerd/containerd/v2 2.1.9+unknown "
    grep -Eq "[[:space:]]v?${CONTAINERD_VERSION//./\\.}([+~][^[:space:]]*)?([[:space:]]|$)" <<<"$v"
}

if [[ ${GPUSNAP_CONTAINERD_FORCE:-0} != 1 && -f $ROOT/$STAMP ]] && root_works "$ROOT"; then
    say "containerd $CONTAINERD_VERSION already installed in $ROOT (set GPUSNAP_CONTAINERD_FORCE=1 to unpack again)"
    exit 0
fi

# shellcheck source=scripts/pinned-deb.sh
. "$repo/scripts/pinned-deb.sh"
pinned_deb_tools

mkdir -p -- "$(dirname -- "$ROOT")"
pinned_deb_lock containerd "$ROOT"
if [[ ${GPUSNAP_CONTAINERD_FORCE:-0} != 1 && -f $ROOT/$STAMP ]] && root_works "$ROOT"; then
    say "containerd $CONTAINERD_VERSION was installed in $ROOT by a concurrent run"
    exit 0
fi

pinned_deb_clear "$ROOT" "$STAMP" GPUSNAP_CONTAINERD_ROOT

work=$(mktemp -d "${TMPDIR:-/tmp}/gpusnap-containerd-build.XXXXXX")
trap 'rm -rf -- "$work"' EXIT

deb=containerd_${DEB_VERSION}_amd64.deb
url=$MIRROR/pool/main/c/containerd/$deb
pinned_deb_fetch "$url" "$work/$deb" "$DEB_SHA256" containerd "$DEB_VERSION" \
    "update DEB_VERSION, DEB_SHA256 (and CONTAINERD_VERSION) at the top of $script" sid forky

mkdir -p "$ROOT"
echo "incomplete containerd root being built by scripts/install-containerd.sh" >"$ROOT/$STAMP.partial"
dpkg-deb -x "$work/$deb" "$ROOT"
# Only the three binaries are used: not the sample config, the systemd unit, the
# fingerprint test plugins, docs and man pages.
rm -rf -- "${ROOT:?}"/usr/share "${ROOT:?}"/usr/lib "${ROOT:?}"/lib "${ROOT:?}"/etc
find "$ROOT" -depth -type d -empty -delete
for b in "${BINARIES[@]}"; do
    [[ -x $ROOT/usr/bin/$b ]] || die "$deb has no usr/bin/$b"
done
root_works "$ROOT" || {
    "$ROOT/usr/bin/containerd" --version >&2 || true
    die "the unpacked containerd does not run (glibc >= 2.34 needed) or is not $CONTAINERD_VERSION"
}
{
    echo "# containerd root built by scripts/install-containerd.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# source: $url sha256 $DEB_SHA256"
} >"$ROOT/$STAMP"
rm -f -- "$ROOT/$STAMP.partial"
say "installed containerd $CONTAINERD_VERSION in $ROOT ($(du -sh "$ROOT" | cut -f1))"
say "$("$ROOT/usr/bin/containerd" --version)"
