# shellcheck shell=bash
# Sourced by scripts/install-containerd.sh and scripts/install-checkpointctl.sh: one pinned
# Debian package, fetched from the archive's pool and checked against its sha256, unpacked into
# a private root of the repository. The caller defines `say` and `die` and sets MIRROR.

# The tools unpacking needs, and `fetch URL FILE` (curl, else apt's helper).
pinned_deb_tools() {
    local tool
    [[ $(uname -m) == x86_64 ]] || die "only x86_64 is supported (this is $(uname -m))"
    for tool in dpkg-deb flock sha256sum xz; do
        command -v "$tool" >/dev/null || die "'$tool' not found: this script needs a Debian/Ubuntu host (dpkg, util-linux, coreutils, xz-utils)"
    done
    # shellcheck disable=SC2317 # fetch is called by the functions below and the caller
    if command -v curl >/dev/null; then
        fetch() { curl -fsSL --retry 3 -o "$2" "$1"; }
    elif [[ -x /usr/lib/apt/apt-helper ]]; then
        fetch() { /usr/lib/apt/apt-helper -q download-file "$1" "$2" >/dev/null; }
    else
        die "neither curl nor apt's apt-helper found: install curl"
    fi
}

# pinned_deb_lock NAME ROOT: serializes concurrent installers of ROOT on descriptor 9. The lock
# lives in /tmp so that nothing but the (gitignored) root appears in the repository.
pinned_deb_lock() {
    exec 9>"${TMPDIR:-/tmp}/gpusnap-$1-root-$(printf %s "$2" | md5sum | cut -c1-16).lock"
    flock 9
}

# pinned_deb_clear ROOT STAMP ENV: removes a broken or outdated ROOT, but only one this script
# made (its STAMP, or STAMP.partial, or an empty folder); anything else is refused, naming ENV.
pinned_deb_clear() {
    local root=$1 stamp=$2 env=$3
    [[ -e $root ]] || return 0
    if [[ -f $root/$stamp || -f $root/$stamp.partial ]] || [[ -d $root && -z $(ls -A -- "$root") ]]; then
        say "removing broken or outdated root $root"
        rm -rf -- "$root"
    else
        die "$root exists but was not created by this script (no $stamp); move it away or set $env"
    fi
}

# pinned_deb_archive_has WORK PACKAGE SUITE...: what each suite's package index offers now of
# PACKAGE, for the message when the pinned package is gone or differs.
pinned_deb_archive_has() {
    local work=$1 package=$2 suite out=""
    shift 2
    for suite in "$@"; do
        if fetch "$MIRROR/dists/$suite/main/binary-amd64/Packages.xz" "$work/Packages-$suite.xz" 2>/dev/null; then
            out+=$(xz -dc "$work/Packages-$suite.xz" | awk -v s="$suite" -v pkg="$package" '
                $0 == "Package: " pkg { p = 1 }
                p && /^Version:/ { v = $2 }
                p && /^SHA256:/ { h = $2 }
                p && /^$/ { printf "    %s: %s %s (sha256 %s)\n", s, pkg, v, h; p = 0 }')$'\n'
        else
            out+="    $suite: could not read its package index"$'\n'
        fi
    done
    printf '%s' "$out"
}

# pinned_deb_fetch URL FILE SHA256 PACKAGE VERSION HINT SUITE...: fetches the pinned .deb and
# checks it; where the pool no longer has it or it changed, dies naming what the SUITEs have
# now (HINT: which lines of the calling script to update).
pinned_deb_fetch() {
    local url=$1 file=$2 sha=$3 package=$4 version=$5 hint=$6 got
    shift 6
    say "fetching $url"
    if ! fetch "$url" "$file"; then
        die "the pinned $package $version is no longer in $MIRROR's pool ($url); the archive now has:
$(pinned_deb_archive_has "$(dirname -- "$file")" "$package" "$@")
  $hint"
    fi
    got=$(sha256sum "$file" | cut -d' ' -f1)
    [[ $got == "$sha" ]] || die "$(basename -- "$file") has sha256 $got, expected $sha (the file at $url changed); the archive now has:
$(pinned_deb_archive_has "$(dirname -- "$file")" "$package" "$@")"
}
