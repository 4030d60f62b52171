"""The pump: the one task that moves a zmq socket's messages, and the socket helpers of `nexa.channel.links`."""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable
from typing import Final, NoReturn, cast

import attrs
import trio
import zmq

from nexa.errors import ChannelClosed, ChannelError

log = logging.getLogger(__name__)

Frames = list[bytes]
_Socket = zmq.Socket[bytes]
_Context = zmq.Context[_Socket]

#: Messages a pump moves between two checkpoints when it keeps making progress.
_BATCH: Final = 16
#: How long a pump waits before retrying a send that zmq refused right after POLLOUT.
SEND_RETRY_S: Final = 0.01
#: Most messages, and most bytes, a pump joins into one (`coalesce`): far below any peer's limit.
COALESCE_MESSAGES: Final = 64
COALESCE_BYTES: Final = 64 * 1024
#: zmq's event bits as plain ints: pyzmq's `zmq.POLLIN` is an enum.IntFlag, and `int & IntFlag`
#: builds a new flag through enum's machinery (about 4 µs), twice a message in a pump's loop.
POLLIN: Final = int(zmq.POLLIN)
POLLOUT: Final = int(zmq.POLLOUT)
_EVENTS: Final = int(zmq.EVENTS)
_NOBLOCK: Final = int(zmq.NOBLOCK)
_NOBLOCK_MORE: Final = int(zmq.NOBLOCK | zmq.SNDMORE)


@attrs.frozen(kw_only=True)
class PumpStatistics:
    #: zmq messages (several data messages a node joined count as one: `ZmqPump`'s coalesce).
    received: int
    sent: int
    #: Messages a ROUTER could not route (peer gone or not keeping up); never silent.
    dropped: int
    inbox_depth: int
    outbox_depth: int


class ZmqPump:
    """Moves frames between one zmq socket and two bounded memory channels.

    Only `run` calls into zmq. Other tasks use `send`/`receive`, which wake the pump by
    cancelling its idle scope. zmq's FD is edge-triggered, so EVENTS is re-read after every
    operation and the pump only sleeps when nothing can progress.

    `coalesce(joined, message)` (optional) says whether a queued message may be sent as part of the
    one before it: the pump then appends its frames, so several queued messages cost one zmq send
    (and the peer one receive). At most `COALESCE_MESSAGES` and `COALESCE_BYTES` go in one; order
    is kept, and a message that may not join waits for the next send.

    `take(message, inbox_empty)` (optional) may handle a received message in the pump's own task,
    with no task switch: it is offered each message that arrives, with whether the inbox is empty
    (nothing received before it is still on its way to the consumer), and returns True when it
    took it (False: it goes to the inbox as any other). It keeps whatever order its consumer needs:
    while the inbox is not empty a message it takes overtakes those in it (`Link` keeps each node's
    own messages in order, so a node's beat may overtake another node's). It must not block or
    raise. Only for a pump whose inbox its own `receive` alone reads (no `share_inbox`).

    `gather()` (optional: seconds, asked at each wait) moderates wake-ups, as a network card
    moderates its interrupts: a pump whose last wake-up received messages comes back for more only
    `gather()` after that wake-up, and then takes everything that arrived meanwhile in one pass. A
    message after a quiet spell is taken at once; under load each waits at most `gather()`, and one
    wake-up (the larger part of what a message costs) serves many. Sends never wait for it: `send`
    wakes the pump at once, and that wake-up reads what arrived too.
    """

    def __init__(
        self,
        sock: _Socket,
        *,
        inbox_size: int = 64,
        outbox_size: int = 64,
        drop_unroutable: bool = False,
        coalesce: Callable[[Frames, Frames], bool] | None = None,
        take: Callable[[list[zmq.Frame], bool], bool] | None = None,
        gather: Callable[[], float] | None = None,
    ) -> None:
        self._sock = sock
        self._gather = gather
        self._inbox_tx, self._inbox_rx = trio.open_memory_channel[list[zmq.Frame]](inbox_size)
        self._outbox_tx, self._outbox_rx = trio.open_memory_channel[Frames](outbox_size)
        # ROUTER: always try to send and drop what cannot be routed, so one slow or vanished
        # node never blocks the others. DEALER: wait for POLLOUT (backpressure to producers).
        self._drop_unroutable = drop_unroutable
        self._idle = trio.CancelScope()
        # At most one message held by the pump in each direction (counted in statistics()).
        self._incoming: list[zmq.Frame] | None = None
        self._outgoing: Frames | None = None
        self._coalesce = coalesce
        # The message taken from the outbox that could not join the one before it (sent next).
        self._lookahead: Frames | None = None
        self._received = self._sent = self._dropped = 0
        self._take = take
        #: Messages put in the inbox, and those `receive` returned: equal when none is on its way.
        self._handed = self._handed_out = 0
        #: Messages put in the outbox and not yet taken by the pump: an empty outbox costs the pump's
        #: loop no `receive_nowait` (and its WouldBlock) per pass.
        self._queued_out = 0

    async def send(self, frames: Frames) -> None:
        try:
            await self._outbox_tx.send(frames)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ChannelClosed("the channel is closed") from None
        self._queued_out += 1
        self._idle.cancel()

    def send_nowait(self, frames: Frames) -> None:
        """Queue without waiting; raises trio.WouldBlock when the outbox is full."""
        try:
            self._outbox_tx.send_nowait(frames)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ChannelClosed("the channel is closed") from None
        self._queued_out += 1
        self._idle.cancel()

    async def receive(self) -> list[zmq.Frame]:
        try:
            frames = await self._inbox_rx.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise ChannelClosed("the channel is closed") from None
        self._handed_out += 1
        if self._incoming is not None:
            self.wake()  # it holds a message for want of inbox room, and there is room again
        return frames

    def wake(self) -> None:
        """Have the pump look again (it may wait for inbox room); `share_inbox` pumps need it."""
        self._idle.cancel()

    def share_inbox(self, other: ZmqPump) -> None:
        """Deliver into `other`'s inbox (before `run`): one queue, each pump's messages in order."""
        self._inbox_tx, self._inbox_rx = other._inbox_tx.clone(), other._inbox_rx

    def statistics(self) -> PumpStatistics:
        return PumpStatistics(
            received=self._received,
            sent=self._sent,
            dropped=self._dropped,
            inbox_depth=self._inbox_rx.statistics().current_buffer_used + (self._incoming is not None),
            outbox_depth=self._outbox_rx.statistics().current_buffer_used
            + (self._outgoing is not None)
            + (self._lookahead is not None),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        sock = self._sock
        fd = sock.fileno()  # zmq.FD: edge-triggered
        task_status.started()
        streak = 0
        # Wake-up moderation (`gather`): when the pump last woke, and whether it received since.
        gather, woke, found = self._gather, -math.inf, False
        try:
            while True:
                events = read_events(sock)
                progressed = False
                if self._incoming is None and events & POLLIN:
                    progressed, found = self._read(), True
                if self._incoming is not None and self._deliver(self._incoming):
                    self._incoming, progressed = None, True
                if self._outgoing is None:
                    self._outgoing = self._next_outgoing()
                if self._outgoing is not None and (self._drop_unroutable or events & POLLOUT):
                    if self._send(self._outgoing):
                        self._outgoing, progressed = None, True
                    else:
                        # POLLOUT said yes, then the peer went away (its handshake was refused,
                        # or it disconnected): keep the message and look again shortly.
                        await trio.sleep(SEND_RETRY_S)
                        continue
                if progressed:
                    # Let consumers and producers run now and then, not after every message: a
                    # task switch per frame was most of the channel's cost under load.
                    streak += 1
                    if streak >= _BATCH:
                        streak = 0
                        await trio.lowlevel.checkpoint()
                    continue
                streak = 0
                await self._wait(fd, woke + gather() if found and gather is not None else -math.inf)
                if gather is not None:
                    woke, found = trio.current_time(), False
        except zmq.ZMQError as exc:
            raise ChannelError(f"node channel socket failed: {exc.strerror}") from exc
        finally:
            self._inbox_tx.close()
            self._outbox_rx.close()

    def _deliver(self, message: list[zmq.Frame]) -> bool:
        """Put a received message in the inbox; False when it is full. Never blocks: the pump must
        keep sending, or a consumer that replies would deadlock against it. A full inbox stops
        reading, and zmq's high-water mark pushes back on the peer."""
        try:
            self._inbox_tx.send_nowait(message)
        except trio.WouldBlock:
            return False
        self._handed += 1
        return True

    async def _wait(self, fd: int, until: float) -> None:
        """Sleep until something may progress: the socket's FD fires (edge-triggered: no zmq call
        may come between the EVENTS read and this wait), a sender wakes the pump, or, while it
        gathers (`until` ahead: the last wake-up received messages), until `until`."""
        self._idle = scope = trio.CancelScope()
        with scope:
            if until > trio.current_time():
                scope.deadline = until
                await trio.sleep_forever()
            else:
                await trio.lowlevel.wait_readable(fd)

    def _read(self) -> bool:
        """Receive one message: True when `take` took it (in this task: no task switch for it),
        else it waits in `_incoming` for room in the inbox."""
        message = receive_frames(self._sock)
        self._received += 1
        if self._take is not None and self._take(message, self._inbox_empty()):
            return True
        self._incoming = message
        return False

    def _inbox_empty(self) -> bool:
        """No message is in the inbox or on its way to the consumer (handed to its waiting task,
        which has not run yet): one taken now overtakes none."""
        return self._handed == self._handed_out

    def _next_outgoing(self) -> Frames | None:
        """The next message to send (joined with those after it that may join it), or None."""
        first, self._lookahead = self._lookahead, None
        if first is None:
            if not self._queued_out:
                return None
            try:
                first = self._outbox_rx.receive_nowait()
            except trio.WouldBlock:
                return None
            self._queued_out -= 1
        return first if self._coalesce is None else self._joined(first)

    def _joined(self, first: Frames) -> Frames:
        """`first` with the queued messages after it that may join it (`coalesce`)."""
        coalesce = self._coalesce
        assert coalesce is not None
        joined, count, size = first, 1, sum(map(len, first))
        while count < COALESCE_MESSAGES:
            if not self._queued_out:
                break
            try:
                nxt = self._outbox_rx.receive_nowait()
            except trio.WouldBlock:
                break
            self._queued_out -= 1
            more = sum(map(len, nxt))
            if size + more > COALESCE_BYTES or not coalesce(joined, nxt):
                self._lookahead = nxt
                break
            if joined is first:
                joined = list(first)  # the sender's list stays as it was
            joined += nxt
            count, size = count + 1, size + more
        return joined

    def _send(self, frames: Frames) -> bool:
        """Send now; False means "not now, keep it" (a DEALER whose connection just went away)."""
        try:
            send_frames(self._sock, frames)
            self._sent += 1
        except zmq.Again:
            if not self._drop_unroutable:
                return False
            self._dropped += 1
            log.warning("dropped a %d-frame message: the peer is not keeping up", len(frames))
        except zmq.ZMQError as exc:
            if not (self._drop_unroutable and exc.errno == errno.EHOSTUNREACH):
                raise
            self._dropped += 1
            log.warning("dropped a %d-frame message: the peer is no longer connected", len(frames))
        return True


def receive_frames(sock: _Socket) -> list[zmq.Frame]:
    """One whole message, its frames not copied: `recv_multipart(NOBLOCK, copy=False)` without its
    RCVMORE query after every frame (each received frame says whether more follow). zmq delivers a
    message's frames together, so none after the first can be missing. About 6 µs less a message
    (`perf/southbound_fanin.py`: most of what 1,000 nodes send are 4-frame liveness beats)."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def send_frames(sock: _Socket, frames: Frames) -> None:
    """One whole message, without blocking: `send_multipart(frames, NOBLOCK)` without its flag
    arithmetic for every frame (pyzmq's `SNDMORE | flags` goes through enum's machinery, about 0.8 µs
    a frame: most of what sending a node's joined data frames cost in Python). zmq takes a message's
    frames as one: only the first can be refused (`Again`, `EHOSTUNREACH`), and then none is sent."""
    send = sock.send
    for frame in frames[:-1]:
        send(frame, _NOBLOCK_MORE)
    send(frames[-1], _NOBLOCK)


def read_events(sock: _Socket) -> int:
    """Read (and so reset) the socket's event state; the FD fires again only after this."""
    return cast("int", sock.getsockopt(_EVENTS))


def close_all(ctx: _Context, sockets: list[_Socket]) -> None:
    for sock in reversed(sockets):
        sock.close(linger=0)
    ctx.term()  # immediate: every socket is closed with linger 0


def new_socket(ctx: _Context, kind: int, sockets: list[_Socket]) -> _Socket:
    sock = ctx.socket(kind)
    sockets.append(sock)
    sock.setsockopt(zmq.LINGER, 0)
    return sock
