#!/usr/bin/env bash
# Smoke-test the built executable: version, check-config, and one controller start/stop cycle.
#
# Usage: bash builds/smoke.sh [BINARY]    (default dist/nexa; NEXA_BINARY also works)
# Uses 127.0.0.1 only; stops only the controller it started (by PID), and removes its temp dir.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

BIN="${1:-${NEXA_BINARY:-dist/nexa}}"
# Under emulation (an arm64 binary on x86-64 through qemu-user) the start takes longer.
START_TIMEOUT_S=${NEXA_SMOKE_START_TIMEOUT_S:-15}
STOP_TIMEOUT_S=30

fail() {
    echo "smoke.sh: FAIL: $*" >&2
    exit 1
}

[[ -x "$BIN" ]] || fail "$BIN is not an executable (run builds/build.sh first)"

TMP="$(mktemp -d "${TMPDIR:-/tmp}/nexa-smoke.XXXXXX")"
PID=""
cleanup() {
    if [[ -n "$PID" ]] && kill -0 "$PID" 2>/dev/null; then
        kill -KILL "$PID" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT

# 1. version
out="$("$BIN" version)"
[[ "$out" == nexa\ * ]] || fail "version printed '$out'"
echo "smoke.sh: ok: $out"

# 2. check-config on the shipped example, and on a file with a bad key
"$BIN" check-config units/control.toml >/dev/null || fail "check-config units/control.toml exited $?"
echo "smoke.sh: ok: check-config units/control.toml"
"$BIN" check-config --role node units/node.toml >/dev/null || fail "check-config --role node units/node.toml exited $?"
echo "smoke.sh: ok: check-config --role node units/node.toml"
printf '[http]\nlisten = "127.0.0.1:8470"\nno_such_key = 1\n' >"$TMP/bad.toml"
rc=0
"$BIN" check-config "$TMP/bad.toml" >/dev/null 2>"$TMP/bad.err" || rc=$?
[[ $rc -eq 2 ]] || fail "check-config on a bad file exited $rc, expected 2"
grep -q no_such_key "$TMP/bad.err" || fail "check-config did not name the bad key: $(cat "$TMP/bad.err")"
echo "smoke.sh: ok: check-config rejects an unknown key (exit 2)"

# 3. the controller: start on a free loopback port, wait for /healthz, SIGTERM, expect exit 0
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
url="http://127.0.0.1:$port"
# The node channel takes a free port too ("*"), so a controller already on 8471 does not clash.
"$BIN" control --state-dir "$TMP/state" --listen "127.0.0.1:$port" --channel "tcp://127.0.0.1:*" \
    >"$TMP/out" 2>"$TMP/err" &
PID=$!

t0=$(date +%s%N)
deadline=$(($(date +%s) + START_TIMEOUT_S))
until curl -fsS -o /dev/null --max-time 1 "$url/healthz" 2>/dev/null; do
    if ! kill -0 "$PID" 2>/dev/null; then
        cat "$TMP/err" >&2
        fail "the controller exited before answering /healthz"
    fi
    if (($(date +%s) >= deadline)); then
        cat "$TMP/err" >&2
        fail "no /healthz answer within ${START_TIMEOUT_S}s"
    fi
    sleep 0.05
done
echo "smoke.sh: ok: /healthz answered $((($(date +%s%N) - t0) / 1000000)) ms after start"
curl -fsS --max-time 2 "$url/version" || fail "/version did not answer"
echo
grep -q "listening on $url" "$TMP/out" || fail "no 'listening on $url' line on stdout: $(cat "$TMP/out")"
grep -q "NEXA_TOKEN=nxk_" "$TMP/out" || fail "no admin key on first start"

kill -TERM "$PID"
rc=0
for _ in $(seq $((STOP_TIMEOUT_S * 10))); do
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.1
done
kill -0 "$PID" 2>/dev/null && fail "the controller did not exit within ${STOP_TIMEOUT_S}s of SIGTERM"
wait "$PID" || rc=$?
PID=""
[[ $rc -eq 0 ]] || {
    cat "$TMP/err" >&2
    fail "the controller exited $rc after SIGTERM, expected 0"
}
echo "smoke.sh: ok: SIGTERM -> exit 0"
echo "smoke.sh: all checks passed for $BIN"
