"""The local parts' child processes: free loopback ports, waiting until a part answers, stopping it
by its PID, and unmounting what a part left mounted below its folder."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from nexa.errors import Unavailable

#: Plain unmounts of a private store's busy mounts before a lazy one, and the wait between.
UNMOUNT_ATTEMPTS: Final = 5
UNMOUNT_RETRY_S: Final = 0.5


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports the OS considers free on `host` right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(
    check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float
) -> float:
    """Poll `check` until it holds; seconds it took. Unavailable (with the log's tail) if the
    process exits or the time runs out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise Unavailable(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        if check():
            return time.monotonic() - started
        time.sleep(0.1)
    raise Unavailable(f"{what} did not answer within {timeout_s:g} s:\n{tail(log)}")


def tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; only the process we started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def mounted_below(base: Path) -> list[str]:
    prefix = str(base.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        return [p for line in f if (p := line.split()[4].encode().decode("unicode_escape")).startswith(prefix)]


def unmount_below(base: Path) -> None:
    """Unmount what is mounted under `base` (podman's overlay home, debootstrap's /proc), deepest
    first; a mount still busy is tried again, the last time detached lazily (`umount -l`)."""
    for attempt in range(UNMOUNT_ATTEMPTS + 1):
        if attempt and mounted_below(base):
            time.sleep(UNMOUNT_RETRY_S)
        lazy = ["-l"] if attempt == UNMOUNT_ATTEMPTS else []
        for point in sorted(mounted_below(base), key=len, reverse=True):
            subprocess.run(["umount", *lazy, point], capture_output=True, timeout=30, check=False)
