"""The controller's data-path multiplexer: inference streams to and from nodes over their channels.

One `Relay` serves every node channel. `open` sends an `infer` frame and yields a `RelayStream`
that the gateway reads chunk by chunk; `deliver` (from the southbound receive loop) files each
`chunk`/`end` under its request id and never blocks. Flow control is per request: a node may have
at most `window` chunks the consumer has not taken, and the relay returns `credit` as chunks are
taken, so a slow client slows only its own stream. Never logs bodies; no store writes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Final, NoReturn, Protocol

import attrs
import trio

from nexa.channel.flow import CreditReturn
from nexa.contracts import heads, wire
from nexa.errors import ChannelError, Conflict, ContractError

log = logging.getLogger(__name__)

#: Beyond the request's own deadline (which the node enforces and reports), how long the
#: controller waits for the node's `end` before ending the stream itself: an `infer`, `credit`
#: or `end` frame dropped on the way (a vanished or congested peer) must not hang a stream.
DEADLINE_GRACE_S: Final = 5.0

#: How often `Relay.expire` looks for streams past their deadline (so they end up to this late).
EXPIRY_TICK_S: Final = 0.25

#: Codes of the ends the controller makes up itself (the node's own codes are in `wire.EndHead`).
NODE_LOST: Final = "node_lost"
DEADLINE_EXCEEDED: Final = "deadline_exceeded"
#: The node sent more chunks than the window allows, or an `end` that does not parse.
PROTOCOL_ERROR: Final = "node_protocol_error"

#: Why `deliver` refused a frame (counted by the caller as `nexa_node_messages_rejected_total{reason}`).
UNKNOWN_STREAM: Final = "unknown_stream"
OVERSIZED_CHUNK: Final = "oversized_chunk"
STREAM_OVERFLOW: Final = "stream_overflow"
MALFORMED: Final = "malformed"


def _chunk_overhead(head: bytes) -> float | None:
    """The overhead figure of a first chunk's head; NaN (refused later, and counted) when unreadable."""
    try:
        return heads.decode(head, wire.ChunkHead).overhead_ms
    except ContractError:
        return math.nan


class DataLink(Protocol):
    """What the relay needs of the node channel (`nexa.channel.links.Link`)."""

    async def send_data(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None: ...

    def send_data_nowait(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None: ...


@attrs.frozen(kw_only=True)
class RelayStatistics:
    """A snapshot of the relay (trio's `statistics()` convention)."""

    open_streams: int
    opened: int
    #: `chunk` and `end` frames filed under an open stream.
    frames_in: int
    #: `infer`, `credit` and `cancel` frames handed to the channel.
    frames_out: int
    #: Frames for no open stream, for a stream of another node, or after the stream's end.
    dropped_frames: int
    #: Streams ended because their node broke the window or sent an unreadable `end`.
    protocol_errors: int
    #: Bytes of chunks received and not yet taken by consumers, over all open streams.
    buffered_bytes: int
    #: Streams ended because their node was lost (unreachable, revoked, restarted).
    lost: int
    #: Streams the controller ended itself after the deadline and its grace.
    expired: int
    cancels_sent: int
    #: Cancels that could not be queued (outbox full, no route): the node's deadline ends those.
    cancels_lost: int


class RelayStream:
    """One request's output as it arrives from its node. Read by one consumer task."""

    def __init__(
        self, relay: Relay, node_id: str, request_id: str, *, window: int, deadline: float, max_bytes: int
    ) -> None:
        self.node_id = node_id
        self.request_id = request_id
        #: The node's `end` (or one the controller made up); set once `receive` has returned None.
        self.end: wire.EndHead | None = None
        #: trio clock time the first chunk arrived.
        self.first_chunk_at: float | None = None
        #: `time.perf_counter()` when the stream was opened, its first chunk came and its end was
        #: known (`waited_s`: durations only; also outside a trio run, as in sync tests of `deliver`).
        self._opened_at = time.perf_counter()
        self._first_at: float | None = None
        self._ended_at: float | None = None
        #: The node's overhead up to its first chunk (`wire.ChunkHead`), unchecked: NaN when that head
        #: did not parse, None when the node sent none (the gateway checks and counts it).
        self.first_overhead_ms: float | None = None
        self._relay = relay
        self._window = window
        #: trio clock time after which the controller ends the stream itself.
        self._deadline = deadline
        self._chunks: collections.deque[bytes] = collections.deque()
        #: Bytes in `_chunks`, bounded by `_max_bytes` (the window times the largest chunk).
        self._bytes = 0
        self._max_bytes = max_bytes
        self._final: wire.EndHead | None = None
        self._arrived = trio.Event()
        #: Chunks taken by the consumer, credited back to the node every half window.
        self._credits = CreditReturn(window)
        #: The node is (as far as we know) still working on it: leaving must send `cancel`.
        self._node_busy = False

    @property
    def buffered(self) -> int:
        """Chunks received and not yet taken by the consumer (at most the window)."""
        return len(self._chunks)

    @property
    def ended(self) -> bool:
        """Whether the end is known (the consumer may still have chunks to take)."""
        return self._final is not None

    async def receive(self) -> bytes | None:
        """The next chunk body; None once the stream has ended, and then `end` says how.

        A chunk already here is taken with no checkpoint (nothing can block: the consumer's write
        to its client is the next one). While the relay's `expire` task runs it ends streams past
        their deadline, so a wait here is a bare wait, with no timeout of its own."""
        while not self._chunks:
            if self._final is not None:
                self.end = self._final
                await trio.lowlevel.checkpoint()
                return None
            if self._relay._expiring:
                await self._arrived.wait()
            else:
                with trio.move_on_at(self._deadline):
                    await self._arrived.wait()
                if not self._chunks and self._final is None and trio.current_time() >= self._deadline:
                    self._relay._expire(self)
            self._arrived = trio.Event()
        chunk = self._take()
        if (credit := self._credits.took()) and self._final is None:
            await self._relay._credit(self, credit)
        return chunk

    def _take(self) -> bytes:
        chunk = self._chunks.popleft()
        self._bytes -= len(chunk)
        self._relay._buffered -= len(chunk)
        return chunk

    async def receive_all(self) -> bytes | None:
        """Every chunk buffered now, joined: at least one (waiting like `receive`); None once ended.

        What a client can be sent in one write: under load, several frames arrive between two
        writes and cost one system call instead of one each."""
        first = await self.receive()
        if first is None or not self._chunks:
            return first
        parts = [first]
        while self._chunks:
            parts.append(self._take())
        if (credit := self._credits.took(len(parts) - 1)) and self._final is None:
            await self._relay._credit(self, credit)
        return b"".join(parts)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.receive()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    # --- what the relay calls

    def _put(self, chunk: bytes) -> bool:
        """File a chunk; False when the node broke the window or the byte bound (the caller ends the stream)."""
        if len(self._chunks) >= self._window or self._bytes + len(chunk) > self._max_bytes:
            return False
        if self.first_chunk_at is None:
            self.first_chunk_at = trio.current_time()
            self._first_at = time.perf_counter()
        self._chunks.append(chunk)
        self._bytes += len(chunk)
        self._relay._buffered += len(chunk)
        self._arrived.set()
        return True

    def _drop_buffer(self) -> None:
        """Forget unread chunks (the consumer left): their bytes no longer count."""
        self._relay._buffered -= self._bytes
        self._chunks.clear()
        self._bytes = 0

    def waited_s(self, *, whole: bool) -> float:
        """Seconds from sending `infer` until the node's first answer frame arrived (`whole`: until
        its end, the whole answer); 0 while it has not."""
        answered = self._ended_at if whole or self._first_at is None else self._first_at
        return 0.0 if answered is None else answered - self._opened_at

    def _finish(self, end: wire.EndHead) -> None:
        if self._final is None:
            self._final = end
            self._ended_at = time.perf_counter()
            self._arrived.set()


class Relay:
    """Multiplexes inference requests over the node channels, with per-request flow control.

    `window` is the number of chunks a node may send ahead of the consumer; it replaces the
    window of every `InferHead` sent, so the buffers here and the node's sending agree. A chunk
    may be at most `max_chunk_bytes`, so one stream buffers at most `window * max_chunk_bytes`.
    """

    def __init__(self, link: DataLink, *, window: int, max_chunk_bytes: int = 65536) -> None:
        if window < 1:
            raise ValueError("the stream window is at least one chunk")
        if max_chunk_bytes < 1:
            raise ValueError("a chunk may be at least one byte")
        self._link = link
        self._window = window
        self._max_chunk_bytes = max_chunk_bytes
        self._buffered = 0
        self._streams: dict[str, RelayStream] = {}
        self._by_node: dict[str, set[str]] = collections.defaultdict(set)
        self._opened = self._frames_in = self._frames_out = self._dropped = 0
        self._protocol_errors = self._lost = self._expired = self._cancels_sent = self._cancels_lost = 0
        #: `expire` runs: it ends the streams past their deadline (else each wait has a timeout).
        self._expiring = False

    async def expire(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """End every open stream past its deadline (`deadline_exceeded`), every `EXPIRY_TICK_S`:
        one task for all streams instead of a timeout on each wait for a chunk."""
        self._expiring = True
        try:
            task_status.started()
            while True:
                await trio.sleep(EXPIRY_TICK_S)
                now = trio.current_time()
                for stream in [s for s in self._streams.values() if s._deadline <= now]:
                    self._expire(stream)
        finally:
            self._expiring = False
            for stream in self._streams.values():
                stream._arrived.set()  # its consumer waits again, with the stream's own timeout

    @contextlib.asynccontextmanager
    async def open(
        self, node_id: str, request_id: str, head: wire.InferHead, body: bytes
    ) -> AsyncIterator[RelayStream]:
        """Send `infer` to the node and yield its stream.

        Raises NotConnected (retryable) when the node has no route, Conflict when the request id
        is already open. Leaving before the stream ended sends `cancel` to the node without waiting.
        """
        if request_id in self._streams:
            raise Conflict(f"request {request_id} is already open")
        if head.window != self._window:
            head = attrs.evolve(head, window=self._window)
        # The node gives up at deadline_at (wall clock); this side waits a grace longer for its end.
        deadline = trio.current_time() + max(0.0, head.deadline_at - time.time()) + DEADLINE_GRACE_S
        stream = RelayStream(
            self,
            node_id,
            request_id,
            window=self._window,
            deadline=deadline,
            max_bytes=self._window * self._max_chunk_bytes,
        )
        self._streams[request_id] = stream
        self._by_node[node_id].add(request_id)
        try:
            await self._link.send_data(node_id, wire.INFER, request_id, heads.encode(head), body)
            stream._node_busy = True
            self._frames_out += 1
            self._opened += 1
            yield stream
        finally:
            self._forget(stream)
            stream._drop_buffer()
            if stream._node_busy:
                # The node has not ended it: tell it to stop (and close its request to the runtime).
                self._cancel(stream, "the client went away")

    def deliver(self, node_id: str, frame: wire.DataFrame) -> str | None:
        """File a node's `chunk` or `end` under its request. Never blocks, never raises.

        Returns None when the frame was taken, else why it was refused (`UNKNOWN_STREAM`,
        `OVERSIZED_CHUNK`, `STREAM_OVERFLOW`, `MALFORMED`) for the caller to count. Frames for no
        open request, or from another node than the one the request went to, are dropped: a node
        cannot write into another node's stream. A chunk above `max_chunk_bytes`, one beyond the
        window or the stream's byte bound, or an unreadable `end` ends that stream as a protocol error.
        """
        stream = self._streams.get(frame.request_id)
        if stream is None or stream.node_id != node_id or stream._final is not None:
            self._dropped += 1
            oversized = frame.kind == wire.CHUNK and len(frame.body) > self._max_chunk_bytes
            return OVERSIZED_CHUNK if oversized else UNKNOWN_STREAM
        self._frames_in += 1
        if frame.kind == wire.CHUNK:
            if len(frame.body) > self._max_chunk_bytes:
                log.warning(
                    "node %s sent a chunk of %d bytes (limit %d)", node_id, len(frame.body), self._max_chunk_bytes
                )
                self._protocol_error(stream)
                return OVERSIZED_CHUNK
            if frame.head and stream.first_chunk_at is None:
                stream.first_overhead_ms = _chunk_overhead(frame.head)
            if not stream._put(frame.body):
                log.warning(
                    "node %s sent more than its window (%d chunks) ahead; ending its stream", node_id, self._window
                )
                self._protocol_error(stream)
                return STREAM_OVERFLOW
            return None
        if frame.kind == wire.END:
            refused = None
            try:
                end = heads.decode(frame.head, wire.EndHead)
            except ContractError as exc:
                self._protocol_errors += 1
                refused = MALFORMED
                log.warning("node %s sent an unreadable end: %s", node_id, exc.message)
                end = wire.EndHead(
                    status=wire.EndStatus.ERROR, code=PROTOCOL_ERROR, first_byte_sent=stream.first_chunk_at is not None
                )
            stream._node_busy = False  # the node is done with it, whatever it said
            self._end(stream, end)
            return refused
        self._dropped += 1  # the link admits only DATA_FROM_NODE kinds
        return MALFORMED

    def _protocol_error(self, stream: RelayStream) -> None:
        self._protocol_errors += 1
        self._end(stream, wire.EndHead(status=wire.EndStatus.ERROR, code=PROTOCOL_ERROR, first_byte_sent=True))
        self._cancel(stream, PROTOCOL_ERROR)
        stream._node_busy = False

    def node_lost(self, node_id: str) -> None:
        """End every open stream on that node with `node_lost` (unreachable, revoked or restarted)."""
        for request_id in list(self._by_node.get(node_id, ())):
            stream = self._streams[request_id]
            stream._node_busy = False  # nothing to cancel: the node is gone (or restarted)
            self._lost += 1
            self._end(
                stream,
                wire.EndHead(
                    status=wire.EndStatus.ERROR, code=NODE_LOST, first_byte_sent=stream.first_chunk_at is not None
                ),
            )

    @property
    def relaying(self) -> bool:
        """Whether any stream is open (a request relayed, its answer not yet ended)."""
        return bool(self._streams)

    def nodes(self) -> list[str]:
        """Nodes with open streams."""
        return list(self._by_node)

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            open_streams=len(self._streams),
            opened=self._opened,
            frames_in=self._frames_in,
            frames_out=self._frames_out,
            dropped_frames=self._dropped,
            protocol_errors=self._protocol_errors,
            buffered_bytes=self._buffered,
            lost=self._lost,
            expired=self._expired,
            cancels_sent=self._cancels_sent,
            cancels_lost=self._cancels_lost,
        )

    # --- internals

    def _end(self, stream: RelayStream, end: wire.EndHead) -> None:
        stream._finish(end)
        # Ended: later frames for it are dropped; the id may be reused once the consumer leaves.
        self._forget(stream)

    def _forget(self, stream: RelayStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            ids = self._by_node[stream.node_id]
            ids.discard(stream.request_id)
            if not ids:
                del self._by_node[stream.node_id]

    def _expire(self, stream: RelayStream) -> None:
        self._expired += 1
        self._end(
            stream,
            wire.EndHead(
                status=wire.EndStatus.ERROR, code=DEADLINE_EXCEEDED, first_byte_sent=stream.first_chunk_at is not None
            ),
        )

    async def _credit(self, stream: RelayStream, chunks: int) -> None:
        head = heads.encode(wire.CreditHead(chunks=chunks))
        try:
            await self._link.send_data(stream.node_id, wire.CREDIT, stream.request_id, head, b"")
        except ChannelError:
            return  # no route now: the node is being lost, and node_lost or the deadline ends the stream
        self._frames_out += 1

    def _cancel(self, stream: RelayStream, reason: str) -> None:
        # Sync and non-blocking: it runs while the consumer is being cancelled.
        head = heads.encode(wire.CancelHead(reason=reason))
        try:
            self._link.send_data_nowait(stream.node_id, wire.CANCEL, stream.request_id, head, b"")
        except (trio.WouldBlock, ChannelError):
            self._cancels_lost += 1
            return
        self._cancels_sent += 1
        self._frames_out += 1
