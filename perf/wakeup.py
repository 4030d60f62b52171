"""What one wake-up costs a thread on this machine: bare epoll against trio's `wait_readable`.

A writer thread writes one byte to a socketpair every `--interval-ms`; the reader sleeps until the
byte is readable, reads it, and sleeps again. Prints the reader thread's CPU time per wake-up
(`time.thread_time`), for bare `select.epoll`, trio's `wait_readable`, and trio's `wait_readable`
inside a cancel scope (as `ZmqPump` waits, so that a sender can wake it), interleaved `--rounds`
times. It is the floor under the per-message cost of any loop that wakes once per message
(`perf/southbound_fanin.py --slices 1000`).

    .venv/bin/python perf/wakeup.py --wakeups 3000
"""

from __future__ import annotations

import argparse
import select
import shlex
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

import trio


def _writer(sock: socket.socket, count: int, interval_s: float) -> None:
    for _ in range(count):
        sock.send(b"x")
        time.sleep(interval_s)
    sock.send(b"q")


def _run(reader: Callable[[socket.socket], int], count: int, interval_s: float) -> float:
    """µs of the reader's thread CPU per wake-up."""
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        writer = threading.Thread(target=_writer, args=(a, count, interval_s), daemon=True)
        writer.start()
        started = time.thread_time()
        wakeups = reader(b)
        spent = time.thread_time() - started
        writer.join()
    return spent / wakeups * 1e6


def bare_epoll(sock: socket.socket) -> int:
    poller, wakeups = select.epoll(), 0
    poller.register(sock.fileno(), select.EPOLLIN)
    with poller:
        while True:
            poller.poll()
            wakeups += 1
            if b"q" in sock.recv(4096):
                return wakeups


def trio_wait(sock: socket.socket, *, scoped: bool = False) -> int:
    async def main() -> int:
        wakeups = 0
        while True:
            if scoped:
                with trio.CancelScope():
                    await trio.lowlevel.wait_readable(sock)
            else:
                await trio.lowlevel.wait_readable(sock)
            wakeups += 1
            if b"q" in sock.recv(4096):
                return wakeups

    return trio.run(main)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wakeups", type=int, default=3000)
    parser.add_argument("--interval-ms", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    readers: dict[str, Callable[[socket.socket], int]] = {
        "bare epoll": bare_epoll,
        "trio wait_readable": trio_wait,
        "trio wait_readable in a cancel scope": lambda s: trio_wait(s, scoped=True),
    }
    figures: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(args.rounds):
        for name, reader in readers.items():
            figures[name].append(_run(reader, args.wakeups, args.interval_ms / 1000))
    for name, runs in figures.items():
        shown = ", ".join(f"{r:.1f}" for r in runs)
        print(f"{name}: median {statistics.median(runs):.1f} us of thread CPU per wake-up ({shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
