"""Controller start-up benchmark: process start → first `/healthz` 200, binary size, idle RSS.

Starts `nexa control` N times, each on a fresh temporary state dir and free loopback ports,
polls `/healthz` every 5 ms, reads the idle controller's VmRSS from /proc, then stops it with
SIGTERM. Never part of the test run. Targets (DESIGN.md §7): start → /healthz ≤ 1.5 s,
binary ≤ 60 MB.

    python perf/startup.py                 # dist/nexa (build it first: bash builds/build.sh)
    python perf/startup.py --binary PATH   # another binary
    python perf/startup.py --venv          # the nexa console script next to this interpreter
    python perf/startup.py -n 20
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.005
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
#: Let the controller settle after its first answer before reading its idle memory.
SETTLE_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _one_run(cmd: list[str], workdir: Path) -> tuple[float, int, int, float, int]:
    """(seconds to first 200, controller RSS KiB, total RSS KiB incl. bootloader, stop seconds, exit code)."""
    state = workdir / "state"
    tmp = workdir / "tmp"
    tmp.mkdir()
    port = _free_port()
    url = f"http://127.0.0.1:{port}/healthz"
    args = [
        *cmd,
        "control",
        "--state-dir",
        str(state),
        "--listen",
        f"127.0.0.1:{port}",
        "--channel",
        "tcp://127.0.0.1:*",
    ]
    env = {**os.environ, "TMPDIR": str(tmp), "NEXA_LOG_LEVEL": "warning"}
    with (workdir / "stdout").open("wb") as out, (workdir / "stderr").open("wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
    try:
        while not _healthy(url):
            if proc.poll() is not None:
                raise SystemExit(f"the controller exited {proc.returncode}; see {workdir / 'stderr'}")
            if time.perf_counter() - t0 > START_TIMEOUT_S:
                raise SystemExit(f"no /healthz 200 within {START_TIMEOUT_S} s")
            time.sleep(POLL_S)
        started = time.perf_counter() - t0
        time.sleep(SETTLE_S)
        # A one-file binary is a small bootloader whose child runs Python; a venv script is one process.
        kids = _children(proc.pid)
        controller = kids[0] if kids else proc.pid
        rss = _rss_kib(controller)
        total = sum(_rss_kib(p) for p in {proc.pid, controller})
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=STOP_TIMEOUT_S)
        stopped = time.perf_counter() - t1
        return started, rss, total, stopped, code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _summary(values: list[float], fmt: str) -> str:
    return "  ".join(
        f"{name} {fmt.format(v)}"
        for name, v in (("min", min(values)), ("p50", statistics.median(values)), ("max", max(values)))
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--binary", type=Path, default=ROOT / "dist" / "nexa", help="default: dist/nexa")
    which.add_argument("--venv", action="store_true", help="run the nexa console script beside this Python")
    parser.add_argument("-n", type=int, default=5, help="number of starts (default 5)")
    args = parser.parse_args()

    if args.venv:
        exe = Path(sys.executable).parent / "nexa"
        label = f"venv console script {exe}"
    else:
        exe = args.binary.resolve()
        label = f"one-file binary {exe}"
    if not os.access(exe, os.X_OK):
        raise SystemExit(f"{exe} is not executable (build it with: bash builds/build.sh)")

    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd() + os.sep) else sys.executable
    print("command:", shlex.join([python, *sys.argv]), f"(cwd {Path.cwd()})")
    print(
        f"host: {platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )
    print(f"target: {label}")
    if not args.venv:
        size = exe.stat().st_size
        print(f"binary size: {size} bytes ({size / 1_048_576:.1f} MiB; target ≤ 60 MB)")

    starts: list[float] = []
    rss: list[float] = []
    totals: list[float] = []
    stops: list[float] = []
    for i in range(args.n):
        with tempfile.TemporaryDirectory(prefix="nexa-perf-") as tmp:
            started, rss_kib, total_kib, stopped, code = _one_run([str(exe)], Path(tmp))
        if code != 0:
            raise SystemExit(f"run {i + 1}: exit code {code} after SIGTERM")
        starts.append(started)
        rss.append(rss_kib / 1024)
        totals.append(total_kib / 1024)
        stops.append(stopped)
        boot = "" if args.venv else f" (with bootloader {total_kib / 1024:.1f} MiB)"
        print(
            f"run {i + 1}/{args.n}: /healthz after {started * 1000:.0f} ms, idle RSS {rss_kib / 1024:.1f} MiB{boot}, "
            f"SIGTERM → exit 0 in {stopped * 1000:.0f} ms"
        )

    start_ms = [s * 1000 for s in starts]
    print(f"start → first /healthz 200 (ms, n={args.n}): {_summary(start_ms, '{:.0f}')}  (target ≤ 1500)")
    print(f"idle controller RSS (MiB): {_summary(rss, '{:.1f}')}")
    if not args.venv:
        print(f"idle RSS incl. bootloader (MiB): {_summary(totals, '{:.1f}')}")
    print(f"SIGTERM → exit (ms): {_summary([s * 1000 for s in stops], '{:.0f}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
