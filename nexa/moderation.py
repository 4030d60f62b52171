"""Wake-up moderation of a whole trio run, as a network card moderates its interrupts.

A process that relays many slow streams (the node agent: each runtime writes a token every few tens
of milliseconds, on its own connection) otherwise sleeps and wakes once per token: every token
arrives while the run loop waits in `epoll_wait`, alone. On a virtual machine a thread's sleep and
wake costs tens of µs (`perf/wakeup.py`), more than the token's own work, and each token leaves as
its own channel message. `WakeModeration` is a trio instrument: while `when()` holds, once the
run loop woke up it does not wait for I/O again until that long after the wake-up; it sleeps the
rest of the window instead, and then takes in one pass all that arrived meanwhile (their tokens
leave together, as one channel message). A wake-up after a quiet spell is immediate, so an idle
process answers at once; under load, anything (a read, a timer) waits at most one window.

The sleep happens only where trio would block anyway (`before_io_wait` with a timeout above 0: no
task is runnable), and never past trio's own timeout.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import trio


class WakeModeration(trio.abc.Instrument):
    """Add to a run (`trio.lowlevel.add_instrument`): wake-ups are gathered over `window_s` while
    `when()` holds, asked at each wait (it must be cheap and must not raise)."""

    def __init__(self, window_s: float, when: Callable[[], bool]) -> None:
        self._window_s = window_s
        self._when = when
        self._woke = -math.inf
        #: Moderated waits: times the run loop slept out a window before looking for I/O.
        self.moderated = 0

    def before_io_wait(self, timeout: float) -> None:
        if timeout <= 0 or not self._when():
            return  # tasks are runnable (this pass does not block), or not now
        rest = self._woke + self._window_s - time.monotonic()
        if rest > 0:
            self.moderated += 1
            time.sleep(min(rest, timeout))

    def after_io_wait(self, timeout: float) -> None:
        if timeout > 0:  # the run loop may have slept: this is a wake-up
            self._woke = time.monotonic()


@contextlib.contextmanager
def moderated(window_s: float, when: Callable[[], bool]) -> Iterator[WakeModeration | None]:
    """Moderate the current run's wake-ups by `window_s` while `when()` holds, inside the block
    (None, and nothing added, when `window_s` is 0)."""
    if window_s <= 0:
        yield None
        return
    instrument = WakeModeration(window_s, when)
    trio.lowlevel.add_instrument(instrument)
    try:
        yield instrument
    finally:
        with contextlib.suppress(KeyError):  # already removed (trio drops an instrument that raised)
            trio.lowlevel.remove_instrument(instrument)
