#!/usr/bin/env bash
# Build the one-file `dist/nexa-linux-arm64` executable (DGX Spark: GB10, arm64) on an x86-64
# Debian 12 machine, under emulation.
#
# The build runs inside a Debian 12 (bookworm) arm64 root, under qemu-user-static through binfmt_misc.
# `debootstrap --arch=arm64 --foreign` fetches the packages and lays out the essential ones; the rest
# are unpacked on the host (`dpkg-deb -x`, native speed) instead of debootstrap's emulated second
# stage, which runs every package's maintainer scripts through qemu (minutes) for nothing this build
# uses (users, alternatives, byte-compiling); `ldconfig` then runs once in the root. Inside it:
# Debian's python3, python3-venv, binutils and libpython3.11 (PyInstaller bundles the shared
# libpython), then a venv with the project's runtime dependencies and PyInstaller: aarch64 wheels
# from PyPI, fetched and unpacked into the venv by the host's pip (`--target --platform`, native
# speed; only wheels, nothing is compiled), then the same PyInstaller one-file build as
# builds/build.sh, from builds/nexa.spec: the one step that runs emulated.
# The console's vendored files are architecture-independent data: builds/console/vendor.sh puts
# them into the source tree on the host, and the copied tree carries them in.
#
# Caches, under ${XDG_CACHE_HOME:-~/.cache}/nexa-build/ (NEXA_BUILD_CACHE overrides):
#   - the root, in a folder named by a hash of its recipe (suite, mirror, packages, flags);
#   - the venv inside it, rebuilt when the dependency list (pyproject.toml) changes;
# and the binary itself is reused while nothing that goes into it changed (the sources under nexa/,
# builds/nexa.spec, the root and the venv: a hash in dist/.nexa-linux-arm64.stamp), also from another
# checkout of the same sources on this machine: the last few binaries are kept in the cache folder,
# named by that hash (a fresh clone then skips PyInstaller's few emulated minutes).
# The binary's glibc requirement (the bootloader and every bundled ELF file) is checked to be no
# newer than Ubuntu 24.04's (DGX OS 7: glibc 2.39); a newer one fails the build.
#
# Needs root (debootstrap, chroot, mounts). Mounts (/proc, /dev in the root) are made in a private
# mount namespace (unshare), so they vanish with the build, also when it is interrupted.
#
# Running the binary on x86-64: binfmt_misc hands it to qemu-aarch64, which needs the arm64 loader and
# libc; `QEMU_LD_PREFIX=$(bash builds/build-arm64.sh --print-root) dist/nexa-linux-arm64 version` takes
# them from the cached root.
#
# Usage: bash builds/build-arm64.sh     (or: bash builds/build.sh --arch arm64)
#        bash builds/build-arm64.sh --print-root   (the cached root's path; exit 1 when not built yet)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SUITE="bookworm"
MIRROR="http://deb.debian.org/debian"
KEYRING="/usr/share/keyrings/debian-archive-keyring.gpg"
INCLUDE="python3,python3-venv,libpython3.11,binutils,ca-certificates"
DEBOOTSTRAP_ARGS=(--arch=arm64 --foreign --variant=minbase "--include=$INCLUDE" "--keyring=$KEYRING")
#: Ubuntu 24.04 (DGX OS 7) ships glibc 2.39: no bundled file may need a newer GLIBC_x.y.
MAX_GLIBC="2.39"
OUT="dist/nexa-linux-arm64"
VENV_IN_ROOT="/opt/nexa-venv"
QEMU="/usr/bin/qemu-aarch64-static"
BINFMT="/proc/sys/fs/binfmt_misc"
# The binfmt_misc entry for aarch64 ELF executables (the magic and mask Debian's qemu-user-static
# registers), with F: the interpreter is opened now, so it also runs inside the chroot.
AARCH64_MAGIC='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
AARCH64_MASK='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'

STAMP_OUT="dist/.nexa-linux-arm64.stamp"
#: Built binaries kept in the cache folder (the newest; each is about 30 MiB).
KEEP_BINARIES=3

log() { echo "build-arm64.sh: $*" >&2; }
fail() {
    echo "build-arm64.sh: FAIL: $*" >&2
    exit 1
}

# The root's place: a hash of its recipe, under the cache folder.
cache_base="${NEXA_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nexa-build}"
[[ "$cache_base" == /* ]] || fail "the cache folder must be an absolute path: $cache_base"
recipe="debootstrap ${DEBOOTSTRAP_ARGS[*]} $SUITE <target> $MIRROR; every .deb unpacked on the host; ldconfig; v2"
key="$(printf '%s\n' "$recipe" | sha256sum | cut -c1-16)"
rootfs="$cache_base/debian-$SUITE-arm64-$key"

case "${1:-}" in
    "") ;;
    --print-root)
        [[ -e "$rootfs/.nexa-root-done" ]] || fail "no arm64 root at $rootfs yet (run the build)"
        echo "$rootfs"
        exit 0
        ;;
    *) echo "usage: bash builds/build-arm64.sh [--print-root]" >&2; exit 2 ;;
esac

[[ "$(id -u)" -eq 0 ]] || fail "needs root (debootstrap, chroot, binfmt_misc); run it with sudo"
[[ "$(uname -m)" == "x86_64" || "$(uname -m)" == "aarch64" ]] || fail "unsupported build machine $(uname -m)"

# One build at a time per checkout, as in build.sh (its own lock: the two may run together).
mkdir -p build dist
exec 9>build/.build-arm64.lock
flock 9

t_start=$(date +%s)

report() { # $1: the glibc version the binary needs
    local size
    size=$(stat -c %s "$OUT")
    echo "build-arm64.sh: built $OUT in $(($(date +%s) - t_start))s${2:-}: ${size} bytes ($(awk -v b="$size" 'BEGIN { printf "%.1f MiB", b / 1048576 }')), needs glibc >= $1"
}

# 1. What this script needs from Debian, installed when missing.
# The caller's python3 when it has pip (a project venv), else Debian's with python3-pip.
host_python="$(command -v python3 || true)"
if [[ -z "$host_python" ]] || ! "$host_python" -m pip --version >/dev/null 2>&1; then
    host_python=/usr/bin/python3
fi
apt_packages=(debootstrap debian-archive-keyring qemu-user-static binfmt-support binutils python3 python3-pip curl)
missing=()
for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    log "installing Debian packages: ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
export PATH="/usr/sbin:/usr/bin:/sbin:/bin:$PATH"

# 2. binfmt_misc: mounted, and qemu-aarch64 registered with the F flag (a chroot cannot see the
#    interpreter's path otherwise). Not needed on an arm64 build machine.
if [[ "$(uname -m)" != "aarch64" ]]; then
    [[ -e "$BINFMT/status" ]] || mount -t binfmt_misc binfmt_misc "$BINFMT" || fail "cannot mount binfmt_misc on $BINFMT"
    [[ "$(cat "$BINFMT/status")" == enabled ]] || echo 1 >"$BINFMT/status"
    if [[ ! -e "$BINFMT/qemu-aarch64" ]]; then
        update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    fi
    if [[ -e "$BINFMT/qemu-aarch64" ]] && ! grep -q '^flags:.*F' "$BINFMT/qemu-aarch64"; then
        # Registered without F (the chroot would not find the interpreter): register it again.
        echo -1 >"$BINFMT/qemu-aarch64"
    fi
    if [[ ! -e "$BINFMT/qemu-aarch64" ]]; then
        [[ -x "$QEMU" ]] || fail "$QEMU is missing (apt-get install qemu-user-static)"
        printf ':qemu-aarch64:M::%s:%s:%s:F\n' "$AARCH64_MAGIC" "$AARCH64_MASK" "$QEMU" >"$BINFMT/register" ||
            fail "cannot register qemu-aarch64 in $BINFMT"
    fi
    grep -q '^enabled' "$BINFMT/qemu-aarch64" || fail "binfmt_misc entry qemu-aarch64 is disabled"
    log "binfmt_misc: qemu-aarch64 registered ($(grep '^flags:' "$BINFMT/qemu-aarch64"))"
fi

# 3. The arm64 root, cached by its recipe.
mkdir -p "$cache_base"
# The cache folder is shared by every checkout on this machine (the root, its /src, the kept binaries):
# one build at a time uses it.
exec 8>"$cache_base/.build.lock"
flock 8

# Run a command in the root: a private mount namespace with /proc and /dev, no host environment (and
# nothing in it needs the network: pip runs on the host).
in_root() {
    unshare --mount --propagation private -- /bin/sh -euc '
        r=$1; shift
        mount -t proc proc "$r/proc"
        mount --rbind /dev "$r/dev"
        exec chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 "$@"
    ' in_root "$rootfs" "$@"
}

if [[ -x "$rootfs/usr/bin/python3" && -e "$rootfs/.nexa-root-done" ]]; then
    log "reusing the arm64 root $rootfs"
else
    t0=$(date +%s)
    tmp="$cache_base/.partial-$key"
    # Anything left there by an interrupted run is never mounted (the mounts were private).
    rm -rf "$tmp"
    log "debootstrap (first stage) into $tmp"
    LC_ALL=C debootstrap "${DEBOOTSTRAP_ARGS[@]}" "$SUITE" "$tmp" "$MIRROR" >"$cache_base/debootstrap-$key.log" 2>&1 ||
        fail "debootstrap first stage failed; see $cache_base/debootstrap-$key.log"
    # The second stage's work that matters here, natively: every fetched package's files (the
    # essential ones again: the same files), then the loader's cache.
    log "unpacking $(find "$tmp/var/cache/apt/archives" -name '*.deb' | wc -l) packages on the host"
    for deb in "$tmp"/var/cache/apt/archives/*.deb; do
        dpkg-deb -x "$deb" "$tmp" || fail "dpkg-deb -x $deb failed"
    done
    unshare --mount --propagation private -- chroot "$tmp" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        /sbin/ldconfig || fail "ldconfig in the arm64 root failed"
    rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/*
    touch "$tmp/.nexa-root-done"
    rm -rf "$rootfs"
    mv "$tmp" "$rootfs"
    log "arm64 root made in $(($(date +%s) - t0))s"
fi
# 4. The venv in the root: the runtime dependencies and PyInstaller, from pyproject.toml.
mapfile -t deps < <(python3 -c '
import sys, tomllib
with open("pyproject.toml", "rb") as f:
    p = tomllib.load(f)["project"]
for d in p["dependencies"] + p["optional-dependencies"]["build"]:
    print(d)
')
[[ ${#deps[@]} -gt 0 ]] || fail "no dependencies read from pyproject.toml"
want="$(printf '%s\n' "$key" "${deps[@]}" | sha256sum | cut -d' ' -f1)"
stamp="$rootfs$VENV_IN_ROOT/.nexa-build-stamp"
if [[ -x "$rootfs$VENV_IN_ROOT/bin/python" && "$(cat "$stamp" 2>/dev/null || true)" == "$want" ]]; then
    log "reusing the root's venv $VENV_IN_ROOT (dependencies unchanged)"
else
    t0=$(date +%s)
    log "creating the root's venv $VENV_IN_ROOT: ${deps[*]}"
    rm -rf "${rootfs:?}$VENV_IN_ROOT"
    in_root /usr/bin/python3 -m venv --without-pip "$VENV_IN_ROOT"
    site="$rootfs$VENV_IN_ROOT/lib/$(in_root "$VENV_IN_ROOT/bin/python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')/site-packages"
    pyver="$(basename "$(dirname "$site")" | sed 's/^python//')"
    # Wheels for the root's interpreter and glibc (bookworm: 2.36), aarch64; nothing is compiled.
    platforms=(--platform manylinux2014_aarch64 --platform linux_aarch64)
    for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_aarch64"); done
    "$host_python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-compile --only-binary=:all: \
        --target "$site" "${platforms[@]}" --python-version "$pyver" --implementation cp --abi "cp${pyver/./}" \
        "${deps[@]}" || fail "pip could not fetch the aarch64 wheels into $site"
    printf '%s\n' "$want" >"$stamp"
    log "venv made in $(($(date +%s) - t0))s"
fi

# 5. The sources (with the console's vendored files) copied into the root, then the build; none
#    when the binary was built from these very inputs before.
bash builds/console/vendor.sh
src_hash="$( {
    printf '%s\n' "$want" "$MAX_GLIBC"
    find nexa -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
    sha256sum builds/nexa.spec
} | sha256sum | cut -d' ' -f1)"
if [[ -x "$OUT" ]] && read -r have_hash have_glibc <"$STAMP_OUT" 2>/dev/null && [[ "$have_hash" == "$src_hash" ]]; then
    log "reusing $OUT (sources, root and venv unchanged)"
    report "$have_glibc" " (cached)"
    exit 0
fi
rm -f "$STAMP_OUT"
kept="$cache_base/nexa-linux-arm64-${src_hash:0:16}"
if [[ -x "$kept" ]] && read -r have_hash have_glibc <"$kept.stamp" 2>/dev/null && [[ "$have_hash" == "$src_hash" ]]; then
    log "reusing $kept (built from the same sources, root and venv)"
    install -m 0755 "$kept" "$OUT"
    cp "$kept.stamp" "$STAMP_OUT"
    touch "$kept" # last used: the pruning below goes by age
    report "$have_glibc" " (cached)"
    exit 0
fi
src="$rootfs/src"
rm -rf "$src"
mkdir -p "$src/builds"
tar -C "$ROOT" --exclude=__pycache__ -cf - nexa | tar -C "$src" -xf -
cp builds/nexa.spec "$src/builds/nexa.spec"

t_build=$(date +%s)
in_root "$VENV_IN_ROOT/bin/python" -m PyInstaller /src/builds/nexa.spec \
    --distpath /src/dist --workpath /src/build/pyinstaller --noconfirm --clean --log-level WARN
[[ -x "$src/dist/nexa" ]] || fail "pyinstaller finished but the binary is missing"
pyi_s=$(($(date +%s) - t_build))

# 6. The glibc check: the highest GLIBC_x.y that the bootloader or any bundled ELF file needs.
#    Every bundled ELF must also be aarch64 (nothing of the host's may slip in).
in_root "$VENV_IN_ROOT/bin/python" - <<'EOF'
import os, subprocess, sys
from PyInstaller.archive.readers import CArchiveReader

out = "/src/build/elf"
os.makedirs(out, exist_ok=True)
files = ["/src/dist/nexa"]
arch = CArchiveReader("/src/dist/nexa")
for i, name in enumerate(sorted(arch.toc)):
    data = arch.extract(name)
    if data and data[:4] == b"\x7fELF":
        if data[18:20] != b"\xb7\x00":
            sys.exit(f"build-arm64.sh: FAIL: bundled {name} is not an aarch64 ELF file")
        path = os.path.join(out, f"{i}-{os.path.basename(name)}")
        with open(path, "wb") as f:
            f.write(data)
        files.append(path)
with open(os.path.join(out, "LIST"), "w") as f:
    f.write("\n".join(files) + "\n")
EOF
mapfile -t elfs <"$src/build/elf/LIST"
# readelf reads any architecture's ELF files (the host's objdump knows only its own).
highest="$(for f in "${elfs[@]}"; do readelf -W -V "$rootfs$f"; done |
    grep -oE 'GLIBC_[0-9]+(\.[0-9]+)+' | sed 's/GLIBC_//' | sort -uV | tail -n1)"
[[ -n "$highest" ]] || fail "no GLIBC_ version found in the binary's ELF files"
newest="$(printf '%s\n%s\n' "$highest" "$MAX_GLIBC" | sort -V | tail -n1)"
if [[ "$newest" != "$MAX_GLIBC" ]]; then
    fail "the binary needs glibc $highest, newer than Ubuntu 24.04's $MAX_GLIBC"
fi
log "glibc: the bootloader and ${#elfs[@]} ELF files need at most GLIBC_$highest (limit $MAX_GLIBC)"

install -m 0755 "$src/dist/nexa" "$OUT"
printf '%s %s\n' "$src_hash" "$highest" >"$STAMP_OUT"
# Kept for other checkouts (stamp last: a binary without its stamp is never reused), the oldest pruned.
install -m 0755 "$OUT" "$kept.tmp" && mv "$kept.tmp" "$kept"
cp "$STAMP_OUT" "$kept.stamp"
ls -1t "$cache_base"/nexa-linux-arm64-???????????????? 2>/dev/null | tail -n +$((KEEP_BINARIES + 1)) |
    while read -r old; do rm -f "$old" "$old.stamp"; done
report "$highest" " (pyinstaller ${pyi_s}s)"
