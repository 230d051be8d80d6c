#!/usr/bin/env bash
# Builds the Debian package gpusnap_<version>_amd64.deb from this workspace:
#
#     scripts/build-deb.sh [--from DIR] [--out DIR]
#
# - /usr/lib/criu/gpusnap.so                 the CRIU plugin (CRIU's default plugin directory,
#                                            the one Debian's and upstream's criu are built with)
# - /usr/lib/gpusnap/libgpusnap_agent.so     the agent (LD_PRELOAD; never in the plugin dir)
# - /usr/bin/gpusnap                         the command-line tool
# - /etc/criu/gpusnap.conf                   the configuration, every key commented out at its
#                                            default (a conffile: kept on remove, gone on purge)
# - /usr/share/doc/gpusnap/copyright
#
# Without --from it builds the three artifacts with `cargo build --release` (in
# $CARGO_TARGET_DIR, default target/); --from DIR takes libgpusnap.so, libgpusnap_agent.so and
# gpusnap from DIR instead (the tests pass their own build). The package goes to --out DIR
# (default target/deb/); its path is the last line printed.
#
# CRIU >= 4.1.1 is a Recommends (Debian 12's own criu, 3.17, is too old, so it cannot be a
# Depends there): the postinst says plainly when the criu on PATH is missing or too old.
# `dpkg --purge gpusnap` (or `apt purge gpusnap`) removes every file the package installed.
set -euo pipefail
repo=$(dirname -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")")
cd -- "$repo"

die() {
    echo "build-deb.sh: $*" >&2
    exit 1
}

from=
out=${CARGO_TARGET_DIR:-$repo/target}/deb
while (($#)); do
    case $1 in
    --from) from=${2:?--from needs a directory}; shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument ${1@Q} (usage: scripts/build-deb.sh [--from DIR] [--out DIR])" ;;
    esac
done

command -v dpkg-deb >/dev/null || die "dpkg-deb not found (it is part of dpkg, on every Debian system)"
[[ $(uname -m) == x86_64 ]] || die "only amd64 is packaged (this is $(uname -m))"

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || die "cannot read the workspace version from Cargo.toml (got ${version@Q})"

if [[ -z $from ]]; then
    cargo build --release -p gpusnap-plugin -p gpusnap-agent -p gpusnap >&2
    from=${CARGO_TARGET_DIR:-$repo/target}/release
fi
for f in libgpusnap.so libgpusnap_agent.so gpusnap; do
    [[ -f $from/$f ]] || die "$from/$f is missing (build it, or point --from at a directory with it)"
done

pkg=gpusnap_${version}_amd64
stage=$(mktemp -d "${TMPDIR:-/tmp}/gpusnap-deb.XXXXXX")
trap 'rm -rf -- "$stage"' EXIT
root=$stage/$pkg

install -D -m 0644 "$from/libgpusnap.so" "$root/usr/lib/criu/gpusnap.so"
install -D -m 0644 "$from/libgpusnap_agent.so" "$root/usr/lib/gpusnap/libgpusnap_agent.so"
install -D -m 0755 "$from/gpusnap" "$root/usr/bin/gpusnap"
if command -v strip >/dev/null; then
    strip --strip-debug "$root/usr/lib/criu/gpusnap.so" "$root/usr/lib/gpusnap/libgpusnap_agent.so" "$root/usr/bin/gpusnap"
fi
# The example configuration with every setting commented out: the installed file changes
# nothing until a line is uncommented.
install -d -m 0755 "$root/etc/criu"
{
    echo "# /etc/criu/gpusnap.conf, installed by the gpusnap package. Every setting below is"
    echo "# commented out at its default; uncomment a line to change it."
    echo "#"
    sed -E 's/^([a-z_]+ = )/# \1/' config/gpusnap.conf.example
} >"$root/etc/criu/gpusnap.conf"
chmod 0644 "$root/etc/criu/gpusnap.conf"
install -D -m 0644 LICENSE "$root/usr/share/doc/gpusnap/copyright"

mkdir -p "$root/DEBIAN"
echo /etc/criu/gpusnap.conf >"$root/DEBIAN/conffiles"
installed_kib=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
cat >"$root/DEBIAN/control" <<EOF
Package: gpusnap
Version: $version
Architecture: amd64
Maintainer: gpusnap developers <gpusnap@localhost>
Installed-Size: $installed_kib
Depends: libc6 (>= 2.34)
Recommends: criu (>= 4.1.1)
Enhances: criu, podman
Section: admin
Priority: optional
Description: CRIU plugin that checkpoints and restores CUDA processes
 gpusnap is a CRIU plugin (/usr/lib/criu/gpusnap.so) that brings the GPU state
 of CUDA processes along with criu dump and criu restore, and so with Podman's
 container checkpoint and restore. It needs CRIU 4.1.1 or newer (Debian 12's
 criu 3.17 is too old) and NVIDIA driver r570 or newer. The agent
 (/usr/lib/gpusnap/libgpusnap_agent.so, LD_PRELOAD) enables the faster split
 path; gpusnap check diagnoses the host. Built from commit $commit.
EOF
# A clear word about CRIU at install time; never a failed install (CRIU may come later, or be
# a private build that runc finds through a wrapper on PATH).
cat >"$root/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    v=$(criu --version 2>/dev/null | sed -n 's/^Version: *//p' || true)
    case "$v" in
    "")
        echo "gpusnap: no criu on PATH. gpusnap needs CRIU >= 4.1.1 (Debian 12's criu 3.17 is too old); see 'gpusnap check'." >&2 ;;
    [0-3].* | 4.0 | 4.0.* | 4.1 | 4.1.0)
        echo "gpusnap: criu on PATH is $v; gpusnap needs CRIU >= 4.1.1 and stays disabled under older ones; see 'gpusnap check'." >&2 ;;
    esac
fi
exit 0
EOF
chmod 0755 "$root/DEBIAN/postinst"
(cd "$root" && find . \( -path ./DEBIAN -o -path ./etc \) -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"

mkdir -p "$out"
dpkg-deb --root-owner-group -Zxz --build "$root" "$out/$pkg.deb" >&2
echo "$out/$pkg.deb"
