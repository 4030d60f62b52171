"""nexa.supervision: restarts with capped backoff, what passes through, the start protocol (in virtual time); the
event-loop watchdog (in real time)."""

from __future__ import annotations

import itertools
import logging
import time
from functools import partial
from typing import NoReturn

import pytest
import trio
import trio.lowlevel
import trio.testing

from nexa.errors import StoreError, StoreUnusable
from nexa.supervision import MESSAGE_MAX_CHARS, Supervision, supervised, watch_event_loop


class Flaky:
    """A loop that fails its first `failures` runs (after `started`, when it speaks the protocol)."""

    def __init__(self, failures: int, exc: BaseException | None = None) -> None:
        self.failures = failures
        self.exc = exc
        self.runs: list[float] = []
        self.healthy = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        self.runs.append(trio.current_time())
        task_status.started(f"run {len(self.runs)}")
        await trio.lowlevel.checkpoint()
        if len(self.runs) <= self.failures:
            raise self.exc or ValueError(f"bad input {len(self.runs)}")
        self.healthy.set()
        await trio.sleep_forever()

    async def plain(self) -> NoReturn:
        await self.run()


async def test_a_failing_loop_is_restarted_with_capped_exponential_backoff(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    counted: list[str] = []
    sup = Supervision(on_failure=counted.append, first_backoff_s=1.0, max_backoff_s=8.0)
    loop = Flaky(failures=6)
    with sup.installed():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervised, "flaky", loop.plain)
            await loop.healthy.wait()
            nursery.cancel_scope.cancel()
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(loop.runs)]
    assert gaps == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert counted == ["flaky"] * 6
    assert sup.statistics().failures == {"flaky": 6}
    assert sup.statistics().restarts == 6
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failures) == 6
    assert failures[0].getMessage() == "loop flaky failed: ValueError: bad input 1"
    assert failures[0].fields["loop"] == "flaky"  # type: ignore[attr-defined]
    assert failures[0].exc_info is None  # the type and a cut message, never a traceback with locals


async def test_the_backoff_starts_over_after_a_healthy_run(autojump_clock: trio.testing.MockClock) -> None:
    sup = Supervision(first_backoff_s=1.0, max_backoff_s=8.0, healthy_after_s=60.0)
    runs: list[float] = []

    async def loop() -> None:
        runs.append(trio.current_time())
        # Three quick failures, then one after a long healthy run, then quick again.
        await trio.sleep(100.0 if len(runs) == 4 else 0.0)
        if len(runs) < 6:
            raise RuntimeError("boom")
        await trio.sleep_forever()

    with sup.installed(), trio.move_on_after(1000):
        await supervised("loop", loop)
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(runs)]
    assert gaps == [1.0, 2.0, 4.0, 100.0 + 1.0, 2.0]


async def test_started_is_reported_once_and_later_starts_are_dropped(autojump_clock: trio.testing.MockClock) -> None:
    loop = Flaky(failures=3)
    with Supervision(first_backoff_s=0.5).installed() as sup:
        async with trio.open_nursery() as nursery:
            value = await nursery.start(supervised, "proto", loop.run)
            await loop.healthy.wait()
            nursery.cancel_scope.cancel()
    assert value == "run 1"
    assert len(loop.runs) == 4
    assert sup.statistics().failures == {"proto": 3}


async def test_a_failure_before_the_first_start_is_raised(autojump_clock: trio.testing.MockClock) -> None:
    async def never_starts(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        raise StoreError("cannot open the database")

    with Supervision().installed() as sup, pytest.RaisesGroup(StoreError, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervised, "store", never_starts)
    assert sup.statistics().failures == {"store": 1}
    assert sup.statistics().restarts == 0


async def test_a_restart_that_fails_before_started_is_retried(autojump_clock: trio.testing.MockClock) -> None:
    runs = 0
    ready = trio.Event()

    async def loop(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal runs
        runs += 1
        if runs in (2, 3):
            raise OSError("address in use")  # a rebind that fails: not a failed start of the process
        task_status.started(runs)
        if runs == 1:
            raise ValueError("bad frame")
        ready.set()
        await trio.sleep_forever()

    with Supervision().installed() as sup:
        async with trio.open_nursery() as nursery:
            assert await nursery.start(supervised, "link", loop) == 1
            await ready.wait()
            nursery.cancel_scope.cancel()
    assert runs == 4
    assert sup.statistics().failures == {"link": 3}


async def test_an_unusable_store_ends_the_supervision(autojump_clock: trio.testing.MockClock) -> None:
    loop = Flaky(failures=1, exc=StoreUnusable("the store is unusable: CorruptError"))
    with Supervision().installed() as sup, pytest.raises(StoreUnusable):
        await supervised("metering", loop.plain)
    assert len(loop.runs) == 1
    assert sup.statistics().failures == {}


async def test_an_unusable_store_inside_a_group_is_not_restarted(autojump_clock: trio.testing.MockClock) -> None:
    async def loop() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.sleep, 0))
            raise StoreUnusable("the store is unusable: IOError")

    with Supervision().installed(), pytest.RaisesGroup(StoreUnusable):
        await supervised("deployments", loop)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)])
async def test_base_exceptions_pass_through(autojump_clock: trio.testing.MockClock, exc: BaseException) -> None:
    loop = Flaky(failures=1, exc=exc)
    with Supervision().installed() as sup, pytest.raises(type(exc)):
        await supervised("loop", loop.plain)
    assert sup.statistics().failures == {}


async def test_cancellation_passes_through_even_mid_backoff(autojump_clock: trio.testing.MockClock) -> None:
    loop = Flaky(failures=100)
    with Supervision(first_backoff_s=10.0).installed() as sup:
        with trio.move_on_after(15.0) as scope:
            await supervised("loop", loop.plain)
        assert scope.cancelled_caught
    assert len(loop.runs) == 2  # t=0 and t=10; cancelled in the second backoff
    assert sup.statistics().failures == {"loop": 2}


async def test_a_failure_during_cancellation_is_logged_and_the_cancellation_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def loop() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            try:
                await trio.sleep_forever()
            finally:
                # Fails while the cancellation of its scope unwinds the nursery.
                raise ValueError("in cleanup")

    with Supervision().installed() as sup:
        with trio.move_on_after(1.0) as scope:
            await supervised("loop", loop)
        assert scope.cancelled_caught
    assert sup.statistics().failures == {"loop": 1}


async def test_a_loop_that_returns_is_done(autojump_clock: trio.testing.MockClock) -> None:
    calls = 0

    async def once() -> None:
        nonlocal calls
        calls += 1

    with Supervision().installed() as sup:
        await supervised("once", once)
    assert calls == 1
    assert sup.statistics().restarts == 0


async def test_the_log_cuts_long_messages_and_names_no_payload(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "prompt text " * 1000
    loop = Flaky(failures=1, exc=ValueError(secret))
    with Supervision().installed(), trio.move_on_after(1.0):
        await supervised("gateway", loop.plain)
    record = next(r for r in caplog.records if r.levelno == logging.ERROR)
    text = record.getMessage()
    assert len(text) < MESSAGE_MAX_CHARS + 100
    assert secret not in text
    assert record.fields["where"][-1].startswith("test_supervision.py:")  # type: ignore[attr-defined]


async def test_without_an_installed_supervision_loops_are_still_restarted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    loop = Flaky(failures=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervised, "component", loop.plain)
        await loop.healthy.wait()
        nursery.cancel_scope.cancel()
    assert len(loop.runs) == 3


def _block_the_event_loop(seconds: float) -> None:
    """A sync call that holds the event loop (what `watch_event_loop` must find)."""
    time.sleep(seconds)


async def test_a_blocked_event_loop_is_logged_with_where_it_was_and_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Real time and a real thread: the watchdog must see through a loop that runs no task at all.
    stalls: list[float] = []
    with caplog.at_level(logging.WARNING, logger="nexa.supervision"):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(watch_event_loop, stalls.append, stall_after_s=0.2))
            await trio.sleep(0.3)  # running freely: no stall
            assert stalls == []
            _block_the_event_loop(0.8)
            await trio.sleep(0.3)  # the loop runs again: the stall is reported once, not per tick
            nursery.cancel_scope.cancel()
    assert len(stalls) == 1 and 0.2 <= stalls[0] < 0.8
    [record] = [r for r in caplog.records if "event loop" in r.getMessage()]
    assert "_block_the_event_loop" in record.getMessage()  # the stack names the blocking call
