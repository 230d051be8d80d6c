#!/usr/bin/env bash
# Build a private, self-contained CRIU 4.1.1 root from Debian trixie packages.
#
# Why: Debian 12's own criu 3.17 fails on current kernels ("vdso: Unexpected rt
# vDSO area bounds") and predates the plugin hooks gpusnap uses. trixie's 4.1.1
# works. We do not install anything into the system: apt runs with a private
# sources list, state and cache, `apt-get download`s criu plus the run-time
# closure of its Depends (glibc 2.41 included) and `dpkg-deb -x`s them into the
# root. scripts/criu then runs the root's criu through the root's own loader.
#
# Usage: scripts/install-criu.sh   (needs network the first time; criu itself needs root
#                                   to dump/restore, and `criu check` is run when root)
# Env:   GPUSNAP_CRIU_ROOT    target directory (default: <repo>/.criu-root); also read by
#                             scripts/criu
#        GPUSNAP_CRIU_MIRROR  Debian mirror (default: http://deb.debian.org/debian)
#        GPUSNAP_CRIU_FORCE=1 rebuild even if the root already works
#        GPUSNAP_CRIU_SUITE   trixie (CRIU 4.1.1, default) or sid (CRIU 4.2.x); give each its
#                             own GPUSNAP_CRIU_ROOT
#        (do not leave the last two exported when running criu: gpusnap refuses unknown
#        GPUSNAP_* variables in its environment)
#
# Idempotent: exits at once if the root is complete (stamp file .gpusnap-criu-root) and
# its criu runs and reports 4.1.1.
# The resulting root is ~16 MiB, has no absolute symlinks into the host and can
# be copied as a directory to a machine with no network (e.g. the GPU host).
set -euo pipefail

# GPUSNAP_CRIU_SUITE picks the CRIU: trixie (4.1.1, the default, what everything is tested
# with) or sid (4.2.x, the first CRIU with the POST_FORKING hook; .ci/run tests against both).
SUITE=${GPUSNAP_CRIU_SUITE:-trixie}
case $SUITE in
    trixie) CRIU_VERSION=4.1.1 ;;
    sid) CRIU_VERSION=4.2 ;;  # a prefix: sid moves (4.2.1 as of 2026-11)
    *) echo "install-criu: ERROR: GPUSNAP_CRIU_SUITE must be trixie or sid, not '$SUITE'" >&2; exit 1 ;;
esac
MIRROR=${GPUSNAP_CRIU_MIRROR:-http://deb.debian.org/debian}

script=$(readlink -f -- "${BASH_SOURCE[0]}")
scripts_dir=$(dirname -- "$script")
repo=$(dirname -- "$scripts_dir")
ROOT=$(realpath -m -- "${GPUSNAP_CRIU_ROOT:-$repo/.criu-root}")
WRAPPER=$scripts_dir/criu
STAMP=.gpusnap-criu-root

say() { echo "install-criu: $*"; }
die() {
    echo "install-criu: ERROR: $*" >&2
    exit 1
}

[[ -f $WRAPPER ]] || die "wrapper $WRAPPER is missing (it is part of the repository)"
[[ -x $WRAPPER ]] || chmod +x "$WRAPPER"

# Does the root at $1 contain a working criu $CRIU_VERSION?
root_works() {
    local v
    v=$(GPUSNAP_CRIU_ROOT=$1 "$WRAPPER" --version 2>/dev/null) || return 1
    grep -Eq "^Version: ${CRIU_VERSION//./\\.}(\.[0-9]+)?\$" <<<"$v"
}

if [[ ${GPUSNAP_CRIU_FORCE:-0} != 1 && -f $ROOT/$STAMP ]] && root_works "$ROOT"; then
    say "CRIU $CRIU_VERSION already installed in $ROOT (set GPUSNAP_CRIU_FORCE=1 to rebuild)"
    exit 0
fi

[[ $(uname -m) == x86_64 ]] || die "only x86_64 is supported (this is $(uname -m))"
for tool in apt-get apt-cache dpkg-deb flock; do
    command -v "$tool" >/dev/null || die "'$tool' not found: this script needs a Debian/Ubuntu host with apt and dpkg"
done

mkdir -p -- "$(dirname -- "$ROOT")"
# Serialize concurrent installers (e.g. several test binaries starting at once).
# The lock lives in /tmp so that nothing but the (gitignored) root appears in the repo.
exec 9>"${TMPDIR:-/tmp}/gpusnap-criu-root-$(printf %s "$ROOT" | md5sum | cut -c1-16).lock"
flock 9
if [[ ${GPUSNAP_CRIU_FORCE:-0} != 1 && -f $ROOT/$STAMP ]] && root_works "$ROOT"; then
    say "CRIU $CRIU_VERSION was installed in $ROOT by a concurrent run"
    exit 0
fi

if [[ -e $ROOT ]]; then
    # Only ever delete something we created ourselves.
    if [[ -f $ROOT/$STAMP || -f $ROOT/$STAMP.partial ]] || [[ -d $ROOT && -z $(ls -A -- "$ROOT") ]]; then
        say "removing broken or outdated root $ROOT"
        rm -rf -- "$ROOT"
    else
        die "$ROOT exists but was not created by this script (no $STAMP); move it away or set GPUSNAP_CRIU_ROOT"
    fi
fi

# apt state and .debs go to a temporary directory; the root is unpacked in place
# (it is gitignored) and only counts as installed once the stamp file is written last.
work=$(mktemp -d "${TMPDIR:-/tmp}/gpusnap-criu-build.XXXXXX")
trap 'rm -rf -- "$work"' EXIT
stage=$ROOT
mkdir -p "$work"/{lists/partial,cache/archives/partial,debs,etc} "$stage"
echo "incomplete CRIU root being built by scripts/install-criu.sh" >"$stage/$STAMP.partial"

# The bookworm debian-archive-keyring (2023.3+deb12u1 and later) already contains
# the trixie release keys (debian-archive-trixie-{stable,automatic}.gpg), so the
# trixie Release file is verified normally; no [trusted=yes] is needed.
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[[ -r $KEYRING ]] || die "$KEYRING not found: install the debian-archive-keyring package"
echo "deb [signed-by=$KEYRING target=Packages arch=amd64] $MIRROR $SUITE main" >"$work/etc/sources.list"

# Private apt: own sources, lists, cache; no system status/preferences; the
# host's apt.conf.d (proxies etc.) still applies.
APT_OPTS=(
    -o "Dir::Etc::SourceList=$work/etc/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::Etc::Preferences=/dev/null"
    -o "Dir::Etc::PreferencesParts=/dev/null"
    -o "Dir::State::Lists=$work/lists"
    -o "Dir::State::status=/dev/null"
    -o "Dir::Cache=$work/cache"
    -o "Dir::Cache::pkgcache=$work/cache/pkgcache.bin"
    -o "Dir::Cache::srcpkgcache=$work/cache/srcpkgcache.bin"
    -o "APT::Architecture=amd64"
    -o "APT::Architectures::=amd64"
    -o "APT::Sandbox::User=root"
    -o "Acquire::Languages=none"
    -o "Debug::NoLocking=1"
)

say "fetching the $SUITE package index from $MIRROR (private apt state in $work)"
if ! apt-get "${APT_OPTS[@]}" -q update >"$work/update.log" 2>&1; then
    cat "$work/update.log" >&2
    if grep -qE 'NO_PUBKEY|not signed|EXPKEYSIG' "$work/update.log"; then
        die "the $SUITE Release file could not be verified with $KEYRING; upgrade debian-archive-keyring (bookworm-updates ships the trixie keys)"
    fi
    die "apt-get update for $SUITE failed (network? mirror $MIRROR)"
fi
grep -E '^(W|E):' "$work/update.log" >&2 || true

# Run-time closure of criu's Depends/Pre-Depends (no Recommends: iproute2 and
# python3-pycriu are not needed to dump/restore; virtual names are skipped).
# As of 4.1.1-1 this is: criu libcompel1 libc6 libgcc-s1 gcc-14-base libbsd0 libmd0
# libgnutls30t64 libgmp10 libhogweed6t64 libnettle8t64 libidn2-0 libunistring5
# libp11-kit0 libffi8 libtasn1-6 libnet1 libnftables1 libjansson4 libmnl0
# libnftnl11 libxtables12 libnl-3-200 libprotobuf-c1 libuuid1.
mapfile -t PKGS < <(apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances criu | grep -v '^ ' | grep -v '^<' | sort -u)
((${#PKGS[@]} > 0)) || die "could not resolve the dependencies of criu in $SUITE"
printf -v pkglist '%s ' "${PKGS[@]}"
say "packages (${#PKGS[@]}): $pkglist"

cand=$(apt-cache "${APT_OPTS[@]}" policy criu | awk '/Candidate:/ {print $2}')
[[ $cand == "$CRIU_VERSION"-* || $cand == "$CRIU_VERSION".* ]] ||
    die "$SUITE offers criu '$cand', expected $CRIU_VERSION"

say "downloading ${#PKGS[@]} packages"
(cd "$work/debs" && apt-get "${APT_OPTS[@]}" -q download "${PKGS[@]}" >"$work/download.log" 2>&1) || {
    cat "$work/download.log" >&2
    die "apt-get download failed"
}

for deb in "$work"/debs/*.deb; do
    dpkg-deb -x "$deb" "$stage"
    # shellcheck disable=SC2016 # dpkg-deb's ${Field} syntax, not shell
    dpkg-deb -W --showformat='${Package} ${Version}\n' "$deb" >>"$work/manifest"
done
say "unpacked $(wc -l <"$work/manifest") packages, $(du -sh "$stage" | cut -f1) before pruning"

# Prune what CRIU never reads at run time: docs, man pages, translations, lintian
# overrides, iconv modules (criu only uses builtin charsets), libc debug/profiling
# helpers, compel's development tool.
rm -rf -- "$stage"/usr/share/{doc,man,info,locale,lintian,bug,bash-completion} \
    "$stage"/usr/lib/x86_64-linux-gnu/gconv \
    "$stage"/usr/lib/x86_64-linux-gnu/{libmemusage.so,libpcprofile.so,libc_malloc_debug.so.0} \
    "$stage"/usr/lib/x86_64-linux-gnu/audit \
    "$stage"/usr/bin/compel "$stage"/usr/libexec
find "$stage" -depth -type d -empty -delete

loader=$stage/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
libpath=$stage/usr/lib/x86_64-linux-gnu:$stage/lib/x86_64-linux-gnu
[[ -x $loader ]] || die "the unpacked libc6 has no $loader"

# ldd-style check: every ELF object in the root must resolve inside the root.
say "checking that all shared objects resolve inside the root"
missing=0
while IFS= read -r -d '' f; do
    head -c4 "$f" | grep -q $'^\x7fELF' || continue
    [[ $f == "$loader" ]] && continue
    if out=$("$loader" --library-path "$libpath" --list "$f" 2>&1); then
        if grep -q 'not found' <<<"$out"; then
            echo "$f:" >&2
            grep 'not found' <<<"$out" >&2
            missing=1
        fi
    else
        # non-loadable objects (none expected) are reported, not fatal
        say "note: could not list $f: ${out//$'\n'/ }"
    fi
done < <(find "$stage/usr/sbin" "$stage/usr/lib/x86_64-linux-gnu" -type f -print0)
((missing == 0)) || die "unresolved libraries in the CRIU root (see above)"

root_works "$stage" || {
    GPUSNAP_CRIU_ROOT=$stage "$WRAPPER" --version >&2 || true
    die "the unpacked criu does not run or is not $CRIU_VERSION"
}

{
    echo "# CRIU root built by scripts/install-criu.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# source: $MIRROR $SUITE main"
    sort "$work/manifest"
} >"$stage/$STAMP"
rm -f -- "$stage/$STAMP.partial"
say "installed CRIU root in $ROOT ($(du -sh "$ROOT" | cut -f1))"
say "$("$WRAPPER" --version | tr '\n' ' ')"

# `criu check` needs root (and a kernel with the CRIU features); report, don't fail.
if [[ $(id -u) == 0 ]]; then
    say "criu check:"
    if "$WRAPPER" check 2>&1 | sed 's/^/    /'; then
        say "criu check passed"
    else
        say "WARNING: criu check reported problems (see above); dump/restore may still work"
    fi
else
    say "not root: skipping 'criu check' (dump/restore need root)"
fi
