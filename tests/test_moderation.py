"""Wake-up moderation of a trio run (`nexa.moderation`), in real trio runs with real sockets.

A socket pair stands for a runtime's connection: a thread writes to one end at a known time, a task
reads the other. Each window is long (0.3 s) against what the loop takes to see a ready socket, so the
checks hold on a busy machine; the bounds say which side of the window a read fell on.
"""

from __future__ import annotations

import socket
import threading
import time

import trio

from nexa.moderation import WakeModeration, moderated

WINDOW_S = 0.3


def _write_later(sock: socket.socket, delay_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), sock.send(b"x")), daemon=True)
    thread.start()
    return thread


async def _read_after_a_wake(active: bool) -> tuple[float, WakeModeration | None]:
    """Wake the loop with a timer, have a byte arrive 20 ms later: seconds from the wake to the read."""
    a, b = socket.socketpair()
    with a, b, moderated(WINDOW_S, lambda: active) as instrument:
        trio_b = trio.socket.from_stdlib_socket(b)
        got = 0.0
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                nonlocal got
                await trio_b.recv(1)
                got = time.monotonic()

            nursery.start_soon(read)
            await trio.sleep(0.05)  # the loop sleeps, then wakes for this timer
            woke = time.monotonic()
            writer = _write_later(a, 0.02)
        writer.join()
    return got - woke, instrument


async def test_after_a_wake_up_io_is_looked_for_only_once_the_window_ends() -> None:
    with trio.fail_after(10):
        waited, instrument = await _read_after_a_wake(active=True)
    assert waited >= WINDOW_S - 0.05, waited  # the byte came 20 ms after the wake, and waited out the window
    assert instrument is not None
    assert instrument.moderated >= 1


async def test_while_not_active_io_is_taken_at_once() -> None:
    with trio.fail_after(10):
        waited, instrument = await _read_after_a_wake(active=False)
    assert waited < WINDOW_S - 0.1, waited
    assert instrument is not None
    assert instrument.moderated == 0


async def test_a_wake_up_after_a_quiet_spell_is_immediate() -> None:
    """A byte that comes after the window has ended (the loop waits for I/O again) is read at once."""
    a, b = socket.socketpair()
    with trio.fail_after(10), a, b, moderated(WINDOW_S, lambda: True):
        trio_b = trio.socket.from_stdlib_socket(b)
        await trio.sleep(0.05)  # a wake-up
        writer = _write_later(a, WINDOW_S + 0.2)
        sent = time.monotonic() + WINDOW_S + 0.2
        await trio_b.recv(1)
        got = time.monotonic()
        writer.join()
    assert got - sent < 0.1, got - sent


async def test_a_timer_is_never_held_past_its_own_time_by_more_than_a_window() -> None:
    """The sleep never outlasts trio's timeout: a timer due 30 ms after a wake-up fires well before
    the window (0.3 s) would have ended."""
    with trio.fail_after(10), moderated(WINDOW_S, lambda: True):
        await trio.sleep(0.05)  # a wake-up
        start = time.monotonic()
        await trio.sleep(0.03)
        took = time.monotonic() - start
    assert took < 0.03 + 0.1, took


async def test_off_adds_nothing_and_the_instrument_goes_with_its_block() -> None:
    with moderated(0.0, lambda: True) as none:
        assert none is None
    with moderated(WINDOW_S, lambda: True) as instrument:
        assert instrument is not None
        trio.lowlevel.remove_instrument(instrument)  # trio drops an instrument that raised: the block still ends
    with moderated(WINDOW_S, lambda: True) as instrument:
        pass
    assert instrument is not None
    moderation_before = instrument.moderated
    await trio.sleep(0.05)
    with trio.move_on_after(0.05):
        await trio.sleep_forever()
    assert instrument.moderated == moderation_before  # removed: it no longer runs
