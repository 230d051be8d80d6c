#!/usr/bin/env bash
# Builds the Debian package gpusnap_<version>_amd64.deb from this workspace, and with
# --with-criu (or --criu-root DIR) also gpusnap-criu_<criu version>+gpusnap1_amd64.deb:
#
#     scripts/build-deb.sh [--from DIR] [--out DIR] [--with-criu | --criu-root DIR]
#
# gpusnap:
# - /usr/lib/criu/gpusnap.so                 the CRIU plugin (CRIU's default plugin directory,
#                                            the one Debian's and upstream's criu are built with)
# - /usr/lib/gpusnap/libgpusnap_agent.so     the agent (LD_PRELOAD; never in the plugin dir)
# - /usr/bin/gpusnap                         the command-line tool
# - /usr/libexec/gpusnap/gpusnap-keeper      the split path's keeper (the plugin starts it to
#                                            hold and drain device memory beside CRIU's dump)
# - /etc/criu/gpusnap.conf                   the configuration, every key commented out at its
#                                            default (a conffile: kept on remove, gone on purge)
# - /etc/cdi/gpusnap.json                    a CDI spec (conffile): a container run with
#                                            `--device gpusnap.dev/agent=split` gets the agent
#                                            mounted read-only and preloaded
# - /usr/share/doc/gpusnap/copyright
#
# gpusnap-criu (only with --with-criu / --criu-root): the CRIU that scripts/install-criu.sh
# unpacks from pinned Debian binaries (trixie's criu 4.1.1 by default; sid's 4.2.x with
# GPUSNAP_CRIU_SUITE=sid) with its own libraries, for hosts whose distribution CRIU is too old
# (Debian 12: 3.17). It lives in /usr/lib/gpusnap-criu/ and installs /usr/sbin/criu, a
# launcher that runs it through its own loader, so that runc and Podman find it on PATH.
# Debian's own /usr/sbin/criu, if any, is diverted to /usr/sbin/criu.distrib while it is
# installed (dpkg-divert) and put back when it is removed. --with-criu runs
# scripts/install-criu.sh for the default root (.criu-root); --criu-root DIR packages DIR (a
# root that script made: its stamp file lists the Debian packages it holds).
#
# Without --from it builds the four artifacts with `cargo build --release` (in
# $CARGO_TARGET_DIR, default target/); --from DIR takes libgpusnap_plugin.so, libgpusnap_agent.so,
# gpusnap and gpusnap-keeper from DIR instead (the tests pass their own build). The packages go to --out DIR
# (default target/deb/); their paths are the last lines printed (gpusnap first).
#
# CRIU >= 4.1.1 is a Recommends of gpusnap (gpusnap-criu Provides it, so does Debian 13's
# criu): the postinst says plainly when the criu on PATH is missing or too old.
# `dpkg --purge gpusnap gpusnap-criu` removes every file the packages installed.
set -euo pipefail
repo=$(dirname -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")")
cd -- "$repo"

die() {
    echo "build-deb.sh: $*" >&2
    exit 1
}

from=
out=${CARGO_TARGET_DIR:-$repo/target}/deb
criu_root=
with_criu=0
while (($#)); do
    case $1 in
    --from) from=${2:?--from needs a directory}; shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --with-criu) with_criu=1; shift ;;
    --criu-root) criu_root=${2:?--criu-root needs a directory}; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument ${1@Q} (usage: scripts/build-deb.sh [--from DIR] [--out DIR] [--with-criu | --criu-root DIR])" ;;
    esac
done

command -v dpkg-deb >/dev/null || die "dpkg-deb not found (it is part of dpkg, on every Debian system)"
[[ $(uname -m) == x86_64 ]] || die "only amd64 is packaged (this is $(uname -m))"

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || die "cannot read the workspace version from Cargo.toml (got ${version@Q})"

if [[ -z $from ]]; then
    cargo build --release -p gpusnap-plugin -p gpusnap-agent -p gpusnap -p gpusnap-keeper >&2
    from=${CARGO_TARGET_DIR:-$repo/target}/release
fi
for f in libgpusnap_plugin.so libgpusnap_agent.so gpusnap gpusnap-keeper; do
    [[ -f $from/$f ]] || die "$from/$f is missing (build it, or point --from at a directory with it)"
done

# gpusnap-criu from a CRIU root of scripts/install-criu.sh, staged in $stage and written to
# $out; prints the package's path.
build_criu_package() {
    local src stamp cver dver cpkg croot kib source
    src=$(realpath -e -- "$1") || die "--criu-root: no such directory ${1@Q}"
    stamp=$src/.gpusnap-criu-root
    [[ -f $stamp ]] || die "$src has no .gpusnap-criu-root: not a CRIU root made by scripts/install-criu.sh"
    [[ -x $src/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 && -f $src/usr/sbin/criu ]] ||
        die "$src has no usr/sbin/criu or no loader: rebuild it with scripts/install-criu.sh"
    # The Debian version of criu the root holds (e.g. 4.1.1-1), from the stamp's package list.
    dver=$(awk '$1 == "criu" {print $2}' "$stamp")
    [[ $dver =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?-[0-9A-Za-z.+~]+$ ]] || die "$stamp names no criu version (got ${dver@Q})"
    cver=$(GPUSNAP_CRIU_ROOT=$src scripts/criu --version | sed -n 's/^Version: *//p')
    [[ ${dver%%-*} == "$cver" ]] || die "$src: criu says it is version ${cver@Q}, the stamp says ${dver@Q}"
    source=$(sed -n 's/^# source: //p' "$stamp")
    cpkg=gpusnap-criu_${dver}+gpusnap1_amd64
    croot=$stage/$cpkg
    install -d -m 0755 "$croot/usr/lib/gpusnap-criu" "$croot/usr/sbin" "$croot/usr/share/doc/gpusnap-criu" "$croot/DEBIAN"
    cp -a "$src/usr" "$src/etc" "$croot/usr/lib/gpusnap-criu/"
    find "$croot/usr/lib/gpusnap-criu" -type d -exec chmod 0755 {} +
    cat >"$croot/usr/sbin/criu" <<'LAUNCHER'
#!/bin/sh
# criu of the gpusnap-criu package: Debian's criu binary and the libraries it was built
# against (glibc included) in /usr/lib/gpusnap-criu, run through their own loader. Only criu
# runs on them: what criu starts and what it restores use the host's libraries.
r=/usr/lib/gpusnap-criu/usr/lib/x86_64-linux-gnu
exec "$r/ld-linux-x86-64.so.2" --library-path "$r" --argv0 criu /usr/lib/gpusnap-criu/usr/sbin/criu "$@"
LAUNCHER
    chmod 0755 "$croot/usr/sbin/criu"
    {
        echo "gpusnap-criu: Debian packages unpacked unchanged into /usr/lib/gpusnap-criu by"
        echo "scripts/install-criu.sh of gpusnap (commit $commit), from $source."
        echo "Each package's own copyright file is in the Debian archive; the versions:"
        echo
        grep -v '^#' "$stamp"
    } >"$croot/usr/share/doc/gpusnap-criu/copyright"
    chmod 0644 "$croot/usr/share/doc/gpusnap-criu/copyright"
    kib=$(du -sk --exclude=DEBIAN "$croot" | cut -f1)
    cat >"$croot/DEBIAN/control" <<CONTROL
Package: gpusnap-criu
Version: ${dver}+gpusnap1
Architecture: amd64
Maintainer: gpusnap developers <gpusnap@localhost>
Installed-Size: $kib
Provides: criu (= $dver)
Section: admin
Priority: optional
Description: CRIU $cver for gpusnap, with the libraries it runs on
 Debian's criu $dver and the libraries it needs (glibc included), unpacked
 unchanged into /usr/lib/gpusnap-criu from $source
 (the versions are listed in /usr/share/doc/gpusnap-criu/copyright), and
 /usr/sbin/criu, which runs it through its own loader so that runc and Podman
 find it on PATH.
 .
 For hosts whose distribution CRIU is too old for gpusnap: Debian 12's criu
 3.17 fails on current kernels and lacks the plugin hooks gpusnap needs. Where
 the distribution's criu is 4.1.1 or newer (Debian 13, Fedora, Arch), use it
 and do not install this package.
 .
 Debian's own criu package is left installed: while this package is
 installed, its /usr/sbin/criu is diverted to /usr/sbin/criu.distrib
 (dpkg-divert); removing this package puts it back.
CONTROL
    cat >"$croot/DEBIAN/preinst" <<'SCRIPT'
#!/bin/sh
set -e
case "$1" in
install | upgrade)
    dpkg-divert --package gpusnap-criu --add --rename --divert /usr/sbin/criu.distrib /usr/sbin/criu >/dev/null ;;
esac
exit 0
SCRIPT
    cat >"$croot/DEBIAN/postrm" <<'SCRIPT'
#!/bin/sh
set -e
case "$1" in
remove | abort-install | disappear)
    dpkg-divert --package gpusnap-criu --remove --rename --divert /usr/sbin/criu.distrib /usr/sbin/criu >/dev/null ;;
esac
exit 0
SCRIPT
    cat >"$croot/DEBIAN/postinst" <<'SCRIPT'
#!/bin/sh
set -e
if [ "$1" = configure ] && ! /usr/sbin/criu --version >/dev/null 2>&1; then
    echo "gpusnap-criu: '/usr/sbin/criu --version' failed on this host; gpusnap cannot use this CRIU" >&2
fi
exit 0
SCRIPT
    chmod 0755 "$croot/DEBIAN/preinst" "$croot/DEBIAN/postrm" "$croot/DEBIAN/postinst"
    (cd "$croot" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) >"$croot/DEBIAN/md5sums"
    dpkg-deb --root-owner-group -Zxz --build "$croot" "$out/$cpkg.deb" >&2
    echo "$out/$cpkg.deb"
}

pkg=gpusnap_${version}_amd64
stage=$(mktemp -d "${TMPDIR:-/tmp}/gpusnap-deb.XXXXXX")
trap 'rm -rf -- "$stage"' EXIT
root=$stage/$pkg

install -D -m 0644 "$from/libgpusnap_plugin.so" "$root/usr/lib/criu/gpusnap.so"
install -D -m 0644 "$from/libgpusnap_agent.so" "$root/usr/lib/gpusnap/libgpusnap_agent.so"
install -D -m 0755 "$from/gpusnap" "$root/usr/bin/gpusnap"
install -D -m 0755 "$from/gpusnap-keeper" "$root/usr/libexec/gpusnap/gpusnap-keeper"
if command -v strip >/dev/null; then
    strip --strip-debug "$root/usr/lib/criu/gpusnap.so" "$root/usr/lib/gpusnap/libgpusnap_agent.so" "$root/usr/bin/gpusnap" \
        "$root/usr/libexec/gpusnap/gpusnap-keeper"
fi
# The example configuration with every setting commented out: the installed file changes
# nothing until a line is uncommented.
install -d -m 0755 "$root/etc/criu"
{
    echo "# /etc/criu/gpusnap.conf, installed by the gpusnap package. Every setting below is"
    echo "# commented out at its default; uncomment a line to change it."
    echo "#"
    sed -E 's/^([a-z_]+ = )/# \1/' common/config/gpusnap.conf.example
} >"$root/etc/criu/gpusnap.conf"
chmod 0644 "$root/etc/criu/gpusnap.conf"
install -D -m 0644 LICENSE "$root/usr/share/doc/gpusnap/copyright"
# The CDI spec (Podman >= 4.1, containerd and CRI-O read /etc/cdi): one device,
# gpusnap.dev/agent=split, whose edits bind-mount the agent read-only at the same path and
# preload it. cdiVersion 0.3.0 (env and mounts only) is the oldest the runtimes accept.
install -d -m 0755 "$root/etc/cdi"
cat >"$root/etc/cdi/gpusnap.json" <<'SPEC'
{
  "cdiVersion": "0.3.0",
  "kind": "gpusnap.dev/agent",
  "devices": [
    {
      "name": "split",
      "containerEdits": {
        "env": [
          "LD_PRELOAD=/usr/lib/gpusnap/libgpusnap_agent.so"
        ],
        "mounts": [
          {
            "hostPath": "/usr/lib/gpusnap/libgpusnap_agent.so",
            "containerPath": "/usr/lib/gpusnap/libgpusnap_agent.so",
            "options": ["ro", "nosuid", "nodev", "bind"]
          }
        ]
      }
    }
  ]
}
SPEC
chmod 0644 "$root/etc/cdi/gpusnap.json"

mkdir -p "$root/DEBIAN"
printf '%s\n' /etc/criu/gpusnap.conf /etc/cdi/gpusnap.json >"$root/DEBIAN/conffiles"
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
 path; a container gets it with --device gpusnap.dev/agent=split (the CDI
 spec /etc/cdi/gpusnap.json). gpusnap check diagnoses the host. Built from
 commit $commit.
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

if ((with_criu)) && [[ -z $criu_root ]]; then
    scripts/install-criu.sh >&2 || die "scripts/install-criu.sh failed (see above)"
    criu_root=$repo/.criu-root
fi
criu_deb=
if [[ -n $criu_root ]]; then
    criu_deb=$(build_criu_package "$criu_root")
fi
echo "$out/$pkg.deb"
[[ -z $criu_deb ]] || echo "$criu_deb"
