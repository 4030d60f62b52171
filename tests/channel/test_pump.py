"""nexa.channel.pump's wake-up moderation (`gather`) and its sends, over a real zmq ROUTER-DEALER
pair (inproc).

The windows here are long (0.5 s) so that what the tests tell apart (at once, or at the window's
end) is far wider than a busy machine's scheduling delays; each test runs under `trio.fail_after`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio
import zmq

from nexa.channel.pump import ZmqPump

TIMEOUT_S = 10
WINDOW_S = 0.5
#: "At once": well under the window, and far above a loaded machine's wake-up delays.
AT_ONCE_S = 0.3

_Pair = tuple[ZmqPump, "zmq.Socket[bytes]", list[tuple[bytes, float]]]


@asynccontextmanager
async def pumped_router(gather: Callable[[], float] | None) -> AsyncIterator[_Pair]:
    """A ROUTER behind a pump whose `take` records each message's body and the trio time it was
    taken, and a DEALER (identity `n1`) connected to it that the test sends from."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    taken: list[tuple[bytes, float]] = []

    def take(frames: list[zmq.Frame], _inbox_empty: bool) -> bool:
        taken.append((frames[-1].bytes, trio.current_time()))
        return True

    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # as `Link` sets it: unroutable sends fail
        router.bind("inproc://gather")
        dealer.setsockopt(zmq.IDENTITY, b"n1")
        dealer.connect("inproc://gather")
        pump = ZmqPump(router, drop_unroutable=True, take=take, gather=gather)
        _others[0] = waiting_for_reads()
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.run)
            yield pump, dealer, taken
            nursery.cancel_scope.cancel()
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def waiting_for_reads() -> int:
    return trio.lowlevel.current_statistics().io_statistics.tasks_waiting_read


#: Tasks that waited on a file descriptor before the pump started (trio's and pytest-trio's own).
_others = [0]


def waits_on_its_socket() -> bool:
    """Whether the pump waits on its socket's FD, rather than sleeping through a window."""
    return waiting_for_reads() == _others[0] + 1


async def received(dealer: zmq.Socket[bytes]) -> list[bytes]:
    """The DEALER's next message, once it has one."""
    while not dealer.poll(0):  # noqa: ASYNC110 - the DEALER is a plain zmq socket
        await trio.sleep(0.002)
    return dealer.recv_multipart()


async def until(check: Callable[[], bool]) -> None:
    while not check():  # noqa: ASYNC110 - zmq's I/O delivers with no trio event to wait on
        await trio.sleep(0.002)


async def test_a_gathering_pump_takes_the_first_message_at_once_and_what_follows_at_its_windows_end() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with pumped_router(lambda: WINDOW_S) as (_pump, dealer, taken):
            await trio.sleep(WINDOW_S)  # a quiet spell
            assert waits_on_its_socket()
            sent = trio.current_time()
            dealer.send(b"first")
            await until(lambda: len(taken) == 1)
            first_at = taken[0][1]
            assert first_at - sent < AT_ONCE_S
            assert not waits_on_its_socket()  # it gathers
            dealer.send(b"second")
            dealer.send(b"third")
            await until(lambda: len(taken) == 3)
            (_, second_at), (_, third_at) = taken[1:]
            # Both waited for the window that the wake-up which received "first" opened, and came
            # in one pass at its end.
            assert second_at - first_at >= WINDOW_S * 0.9
            assert third_at - second_at < AT_ONCE_S / 3
            assert [body for body, _ in taken] == [b"first", b"second", b"third"]
            # A window that received nothing ends the gathering: the next message is taken at once.
            await trio.sleep(WINDOW_S * 2.5)
            assert waits_on_its_socket()
            sent = trio.current_time()
            dealer.send(b"after a quiet spell")
            await until(lambda: len(taken) == 4)
            assert taken[3][1] - sent < AT_ONCE_S


async def test_a_send_never_waits_for_the_window_and_its_wake_up_reads_what_came() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with pumped_router(lambda: WINDOW_S * 4) as (pump, dealer, taken):
            dealer.send(b"opens a window")
            await until(lambda: len(taken) == 1)
            dealer.send(b"waits in it")
            await trio.sleep(0.05)
            sent = trio.current_time()
            pump.send_nowait([b"n1", b"out"])
            assert await received(dealer) == [b"out"]
            assert trio.current_time() - sent < AT_ONCE_S
            await until(lambda: len(taken) == 2)
            assert taken[1][1] - sent < AT_ONCE_S  # the send's wake-up read it too, long before the window's end


async def test_without_gather_every_message_is_taken_at_once() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with pumped_router(None) as (_pump, dealer, taken):
            for n in range(3):
                sent = trio.current_time()
                dealer.send(b"m%d" % n)
                await until(lambda n=n: len(taken) == n + 1)
                assert taken[n][1] - sent < AT_ONCE_S


async def test_the_window_is_asked_at_each_wait() -> None:
    """The link's windows follow what it carries (`Southbound._gather`): once the window asked
    is 0, a message that follows a received one is taken at once."""
    window = [WINDOW_S * 4]
    with trio.fail_after(TIMEOUT_S):
        async with pumped_router(lambda: window[0]) as (_pump, dealer, taken):
            dealer.send(b"one")
            await until(lambda: len(taken) == 1)
            await trio.sleep(WINDOW_S * 4.4)  # that window ends, having received nothing more
            window[0] = 0.0
            dealer.send(b"two")
            await until(lambda: len(taken) == 2)
            sent = trio.current_time()
            dealer.send(b"three")  # with the first window (2 s) it would wait for its end
            await until(lambda: len(taken) == 3)
            assert taken[2][1] - sent < AT_ONCE_S


async def test_a_send_leaves_whole_and_in_order_and_an_unroutable_one_is_dropped_whole() -> None:
    """`send_frames` sends a message's frames as one message; one zmq refuses (here: its peer is
    unknown) is counted as dropped and leaves no frame behind to join the next message."""
    with trio.fail_after(TIMEOUT_S):
        async with pumped_router(None) as (pump, dealer, _taken):
            frames = [b"n1", *(b"frame %d" % n for n in range(12)), b""]
            pump.send_nowait(frames)
            pump.send_nowait([b"nobody", b"lost", b"whole"])
            pump.send_nowait([b"n1", b"after"])
            assert [await received(dealer), await received(dealer)] == [frames[1:], [b"after"]]
            stats = pump.statistics()
            assert (stats.sent, stats.dropped) == (2, 1)
