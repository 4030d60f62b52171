#!/usr/bin/env bash
# Build the one-file `dist/nexa` executable with PyInstaller.
#
# The build runs from a CLEAN runtime-only venv (build/venv-runtime: the runtime dependencies
# plus pyinstaller, no test tools), so nothing from the dev venv (numpy, pytest, ...) can be
# bundled. The venv is reused while pyproject.toml and the interpreter are unchanged (a sha256
# stamp inside the venv records both); otherwise it is rebuilt from scratch.
#
# Usage: bash builds/build.sh            (PYTHON=/path/to/python3.11 to pick the interpreter)
#        bash builds/build.sh --arch arm64   (dist/nexa-linux-arm64, under emulation: builds/build-arm64.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

case "${1:-}" in
    "") ;;
    --arch)
        case "${2:-}" in
            arm64 | aarch64) exec bash "$ROOT/builds/build-arm64.sh" ;;
            amd64 | x86_64) ;;
            *) echo "build.sh: unknown architecture '${2:-}' (arm64 or amd64)" >&2; exit 2 ;;
        esac
        ;;
    *) echo "usage: bash builds/build.sh [--arch arm64|amd64]" >&2; exit 2 ;;
esac

PYTHON="${PYTHON:-python3}"
VENV="build/venv-runtime"
STAMP="$VENV/.nexa-build-stamp"

# One build at a time per checkout (a test session and a person may start one together): the
# second waits for the first instead of both writing build/ and dist/nexa.
mkdir -p build
exec 9>build/.build.lock
flock 9

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "build.sh: interpreter not found: $PYTHON" >&2
    exit 1
fi

# The stamp covers what decides the venv's contents: the dependency list and the interpreter.
# (PyInstaller needs libpython as a shared library: pyenv builds with --enable-shared, and on
# Debian's own python3 the python3-dev package provides it.)
py_id="$("$PYTHON" -c 'import sys; print(sys.executable, sys.version.replace("\n", " "))')"
want="$( { sha256sum pyproject.toml; printf '%s\n' "$py_id"; } | sha256sum | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"

if [[ -x "$VENV/bin/python" && "$want" == "$have" ]]; then
    echo "build.sh: reusing $VENV (pyproject.toml and interpreter unchanged)"
else
    echo "build.sh: creating clean runtime venv $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    # `.[build]` = the runtime dependencies + pyinstaller; the `test` extra stays out.
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet ".[build]"
    # The stamp is written last, so an interrupted install is redone next time.
    printf '%s\n' "$want" >"$STAMP"
fi

# The console's front-end libraries (npm ci against builds/console/package-lock.json) go into
# nexa/control/console/static/vendor/, which the spec bundles with the templates.
bash builds/console/vendor.sh

# The spec bundles nexa from this source tree (not from the venv's installed copy), so the
# code is always current even when the venv is reused.
start=$(date +%s)
"$VENV/bin/pyinstaller" builds/nexa.spec \
    --distpath dist --workpath build/pyinstaller --noconfirm --clean --log-level WARN
elapsed=$(($(date +%s) - start))

if [[ ! -x dist/nexa ]]; then
    echo "build.sh: pyinstaller finished but dist/nexa is missing" >&2
    exit 1
fi
size=$(stat -c %s dist/nexa)
echo "build.sh: built dist/nexa in ${elapsed}s: ${size} bytes ($(awk -v b="$size" 'BEGIN { printf "%.1f MiB", b / 1048576 }'))"
