"""What `nexa bench` shows on stderr while it works: a bar redrawn in place when stderr is a
terminal, one plain line per finished step otherwise (logs, CI). Never on stdout: that is the result."""

from __future__ import annotations

import sys
from typing import Final, TextIO

import trio

from nexa.bench.load import Tally
from nexa.contracts.evidence import BenchPoint

#: How often the bar is redrawn.
REDRAW_S: Final = 0.2
BAR_WIDTH: Final = 24


def step_name(p: BenchPoint) -> str:
    if p.concurrency is not None:
        return f"c={p.concurrency}"
    return f"rate {p.rate_rps:g}/s"


def step_line(p: BenchPoint) -> str:
    """One finished step, in a line: what it sent, what failed, the latencies and the throughput."""
    failed = sum(p.errors.values())
    parts = [f"{step_name(p)}: {p.requests} requests, {failed} failed"]
    for name, figures in (("ttft", p.ttft_ms), ("tpot", p.tpot_ms), ("e2e", p.e2e_ms)):
        if figures.p95 is not None:
            parts.append(f"{name} p95 {figures.p95:.1f} ms")
    parts.append(f"{p.tokens_per_s:.0f} tok/s, {p.requests_per_s:.1f} req/s")
    return ", ".join(parts)


class Progress:
    """The bar (or the lines) of one run of `total` steps."""

    def __init__(self, total: int, *, out: TextIO | None = None, tty: bool | None = None) -> None:
        self._out = out or sys.stderr
        self._tty = self._out.isatty() if tty is None else tty
        self._total = total
        self._done = 0

    async def show(self, label: str, duration_s: float, tally: Tally) -> None:
        """Redraw the bar of the step running now until cancelled (nothing without a terminal)."""
        if not self._tty:
            await trio.sleep_forever()
        while True:
            elapsed = 0.0 if tally.started_at is None else trio.current_time() - tally.started_at
            share = (self._done + min(1.0, elapsed / max(duration_s, 1e-9))) / max(self._total, 1)
            filled = round(share * BAR_WIDTH)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self._out.write(
                f"\r[{bar}] step {self._done + 1}/{self._total} {label} "
                f"{min(elapsed, duration_s):.0f}/{duration_s:g}s {len(tally.samples)} requests, "
                f"{tally.errors} failed\x1b[K"
            )
            self._out.flush()
            await trio.sleep(REDRAW_S)

    def step_done(self, p: BenchPoint) -> None:
        self._done += 1
        prefix = "\r\x1b[K" if self._tty else ""
        self._out.write(f"{prefix}step {self._done}/{self._total} {step_line(p)}\n")
        self._out.flush()

    def note(self, text: str) -> None:
        """A line between steps (cold start's phases, the stop of a saturation run)."""
        prefix = "\r\x1b[K" if self._tty else ""
        self._out.write(f"{prefix}{text}\n")
        self._out.flush()
