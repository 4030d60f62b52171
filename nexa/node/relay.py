"""The node's inference relay: `infer` frames from the controller → the local runtime over loopback
HTTP → `chunk` frames and exactly one `end` back. A request is a POST with its body, or (its head's
`method`) a body-less GET, DELETE or POST; a GET or DELETE that carries a body is refused.

One task per request, owned by `run`'s nursery, and one shared keep-alive HTTP/1.1 client to the
runtimes on the node's loopback address (`node.http1`). Output goes back in chunks of at most `max_chunk_bytes`, never
more than the request's window ahead of the credit the controller returned: a slow client stops
only its own request, and the runtime feels it as TCP backpressure. A streamed chunk holds whole
SSE events (only an event larger than `max_chunk_bytes` is split). `cancel` cancels the request's
task, which closes its HTTP connection so the runtime sees the client go away. Never logs bodies.

One table routes the data path on the node: `_requests`, request id → the request's task state
(its credit and its cancel scope: the task's inbox) and the channel its answer goes back on (the
one its `infer` came on, `nexa.channel.endpoints.Routed`). A `credit` or `cancel` is looked up
there, once; one from another channel than its request's is dropped and counted
(`foreign_frames`); `chunk` and `end` go out on the request's own channel with no lookup.
"""

from __future__ import annotations

import logging
import re
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, NoReturn

import attrs
import msgspec
import trio

from nexa.channel.endpoints import DataSender
from nexa.channel.flow import SendWindow
from nexa.config import RelayConfig
from nexa.contracts import heads, wire
from nexa.contracts.bounds import MAX_TOKENS
from nexa.errors import ChannelError, ContractError, NexaError, RuntimeFailed
from nexa.node.http1 import Response, RuntimeClient, RuntimeHTTPError

log = logging.getLogger(__name__)

#: Most bytes of a runtime's error answer read (for its message).
ERROR_BODY_LIMIT: Final = 64 * 1024
#: Unary answers larger than this are forwarded without reading their usage.
USAGE_PARSE_LIMIT: Final = 4 * 1024 * 1024
#: Longest runtime error message passed on to the client.
_MESSAGE_CHARS: Final = 2000
#: How long an `end` may wait for room in the channel's outbox (no connection): after that the
#: controller has ended the stream on its own deadline, so the end is not worth a task.
_END_SEND_TIMEOUT_S: Final = 10.0

# The runtime's path: a plain absolute path, so the URL always names 127.0.0.1.
_PATH: Final = re.compile(r"/[A-Za-z0-9/_.\-]*")
_NULL_USAGE: Final = (b'"usage":null', b'"usage": null')
_DONE: Final = b"data: [DONE]"
#: A runtime's answers and events (`_json`): msgspec's JSON decoder, to Python objects.
_ANSWER_DECODER: Final = msgspec.json.Decoder()
#: The header the relay names each request by (the runtime's own X-Request-Id is left to it).
REQUEST_ID_HEADER: Final = "X-Nexa-Request-Id"

Code = str
RUNTIME_UNAVAILABLE: Final[Code] = "runtime_unavailable"
RUNTIME_ERROR: Final[Code] = "runtime_error"
RUNTIME_REJECTED: Final[Code] = "runtime_rejected"
DEADLINE_EXCEEDED: Final[Code] = "deadline_exceeded"
NODE_BUSY: Final[Code] = "node_busy"
INVALID_REQUEST: Final[Code] = "invalid_request"
CANCELLED: Final[Code] = "cancelled"


@attrs.frozen(kw_only=True)
class NodeRelayStatistics:
    """A snapshot of the node's relay (trio's `statistics()` convention)."""

    inflight: int
    accepted: int
    #: Ends sent, by status (ok, error, cancelled), and refusals with `node_busy`.
    completed: int
    failed: int
    cancelled: int
    busy: int
    chunks_sent: int
    bytes_sent: int
    #: Open requests waiting for the controller's credit.
    waiting_for_credit: int
    #: Chunks each open request has sent beyond its credit (never above its window).
    unacknowledged: Mapping[str, int]
    #: Frames for no open request, duplicate or unreadable ones.
    dropped_frames: int
    #: Token counts runtimes reported outside 0 … 2^31 (or not whole): not passed on.
    usage_refused: int = 0
    #: `credit` and `cancel` frames from another channel than their request's (dropped).
    foreign_frames: int = 0


@attrs.define(eq=False)
class _Request:
    request_id: str
    head: wire.InferHead
    body: bytes
    #: The channel the request's `infer` came on: its chunks and its end go back there.
    reply: DataSender
    #: Chunks it may send ahead of the controller's credit.
    flow: SendWindow
    #: Cancelled by the controller's `cancel`; its deadline is the request's.
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: The controller sent `cancel` (else a cancelled scope means the deadline passed).
    cancelled: bool = False
    #: The runtime's first bytes have not come yet (`NodeRelay.gathering` is off meanwhile).
    waiting: bool = True
    #: The runtime answered (status line received).
    responded: bool = False
    http_status: int | None = None
    #: trio clock: the `infer` frame arrived; the runtime request was written; the runtime's first
    #: body bytes (streams) and its whole answer were read (the node's overhead is measured from them).
    arrived: float = 0.0
    sent_at: float | None = None
    first_read_at: float | None = None
    answered_at: float | None = None
    #: Called once the runtime is done with it: the LoRA adapter it used may be unloaded again.
    release: Callable[[], None] | None = None


@attrs.define
class _Held:
    """A stream's reads held for its flush window (`RelayConfig.flush_window_s`), and until when."""

    data: bytearray = attrs.Factory(bytearray)
    flush_at: float = 0.0


@attrs.define
class _Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: Counts the runtime reported outside 0 … 2^31 (or not whole numbers): not passed on.
    refused: int = 0

    def take(self, obj: object) -> None:
        """Read `usage` of a runtime's answer; only whole counts in 0 … `MAX_TOKENS` are kept."""
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if isinstance(usage, dict):
            for name in ("prompt_tokens", "completion_tokens"):
                value = usage.get(name)
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
                    # The controller then meters its own estimate (prompt) or the events it counted.
                    self.refused += 1
                    continue
                setattr(self, name, value)


class NodeRelay:
    """Runs the controller's inference requests against this node's runtimes.

    `endpoint(assignment_id)` gives the loopback port of a Ready runtime, or None. `deliver` is
    called by the agent's receive loop for every data frame and never blocks. `send`: the channel
    a frame delivered without one came on (a node with one channel).
    """

    def __init__(
        self,
        cfg: RelayConfig,
        send: DataSender | None,
        endpoint: Callable[[str], int | None],
        *,
        host: str = "127.0.0.1",
        lora: Callable[[str, str, bytes, int], Awaitable[tuple[bytes, Callable[[], None]]]] | None = None,
    ) -> None:
        self._cfg = cfg
        self._host = host
        #: Rewrites the body of a request for a LoRA adapter (`nexa.node.lora.NodeLoras.prepare`).
        self._lora = lora
        self._uplink = send
        self._endpoint = endpoint
        self._requests: dict[str, _Request] = {}
        self._client: RuntimeClient | None = None
        self._nursery: trio.Nursery | None = None
        self._accepted = self._completed = self._failed = self._cancelled = self._busy = 0
        self._chunks_sent = self._bytes_sent = self._dropped = self._usage_refused = self._foreign = 0
        #: Streams whose events are being relayed, and requests whose runtime's first bytes have not
        #: come yet (`gathering`).
        self._streams = self._waiting = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Own the HTTP client and the request tasks until cancelled."""
        # No read timeout: the request's deadline bounds the whole call.
        client = RuntimeClient(connect_timeout_s=float(self._cfg.connect_timeout_s))
        try:
            async with trio.open_nursery() as nursery:
                self._client, self._nursery = client, nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._client = self._nursery = None
            self._requests.clear()
            await client.aclose()

    def deliver(self, frame: wire.DataFrame, reply: DataSender | None = None) -> None:
        """Act on one data frame from the controller that came on channel `reply` (None: the
        relay's own): `infer`, `cancel` or `credit`. Never blocks."""
        reply = reply or self._uplink
        if frame.kind == wire.INFER:
            if reply is None:
                self._dropped += 1  # no channel to answer on
            else:
                self._infer(frame, reply)
            return
        req = self._requests.get(frame.request_id)
        if req is None:
            self._dropped += 1  # already ended (its end crossed the cancel), or never ours
            return
        if req.reply is not reply:
            self._foreign += 1
            log.warning("dropped a %s frame of request %s: it came on another channel", frame.kind, frame.request_id)
            return
        if frame.kind == wire.CANCEL:
            req.cancelled = True
            req.scope.cancel()
        elif frame.kind == wire.CREDIT:
            try:
                credit = heads.decode(frame.head, wire.CreditHead)
            except ContractError:
                self._dropped += 1
                return
            req.flow.credit(credit.chunks)
        else:
            self._dropped += 1

    @property
    def gathering(self) -> bool:
        """Whether the agent's wake-ups may be moderated now (`RelayConfig.gather_s`): a runtime's
        stream is being relayed, and no request waits for its runtime's first bytes (a first token,
        a unary answer), which go on at once."""
        return self._streams > 0 and not self._waiting

    def _first_bytes(self, req: _Request) -> None:
        if req.waiting:
            req.waiting = False
            self._waiting -= 1

    def open_requests(self, on: DataSender | None = None) -> list[str]:
        """The ids of the requests running now (on channel `on`, if given): a key rotation finishes
        them on the old connection."""
        return [r.request_id for r in self._requests.values() if on is None or r.reply is on]

    def statistics(self) -> NodeRelayStatistics:
        reqs = self._requests.values()
        return NodeRelayStatistics(
            inflight=len(self._requests),
            accepted=self._accepted,
            completed=self._completed,
            failed=self._failed,
            cancelled=self._cancelled,
            busy=self._busy,
            chunks_sent=self._chunks_sent,
            bytes_sent=self._bytes_sent,
            waiting_for_credit=sum(1 for r in reqs if r.flow.waiting),
            unacknowledged=types.MappingProxyType({r.request_id: r.flow.unacknowledged for r in reqs}),
            dropped_frames=self._dropped,
            usage_refused=self._usage_refused,
            foreign_frames=self._foreign,
        )

    # --- one request

    def _infer(self, frame: wire.DataFrame, reply: DataSender) -> None:
        nursery = self._nursery
        if nursery is None or frame.request_id in self._requests:
            self._dropped += 1
            return
        try:
            head: wire.InferHead | None = heads.decode(frame.head, wire.InferHead)
        except ContractError:
            head = None
        # The request id becomes an HTTP header value: printable ASCII only.
        if head is None or not (frame.request_id.isascii() and frame.request_id.isprintable()):
            self._dropped += 1
            nursery.start_soon(self._send_end, reply, frame.request_id, _error(INVALID_REQUEST))
            return
        if len(self._requests) >= self._cfg.max_inflight:
            self._busy += 1
            nursery.start_soon(self._send_end, reply, frame.request_id, _error(NODE_BUSY))
            return
        self._accepted += 1
        req = _Request(
            request_id=frame.request_id,
            head=head,
            body=frame.body,
            reply=reply,
            flow=SendWindow(head.window),
            arrived=trio.current_time(),
        )
        self._requests[req.request_id] = req
        self._waiting += 1
        nursery.start_soon(self._serve, req)

    async def _serve(self, req: _Request) -> None:
        started = trio.current_time()
        head = req.head
        end = _error(CANCELLED)
        # One scope per request: the controller's `cancel` cancels it, and it ends at the deadline.
        req.scope.deadline = started + head.deadline_at - time.time()
        try:
            with req.scope:
                end = await self._call_guarded(req)
            if req.scope.cancelled_caught:
                end = (
                    wire.EndHead(status=wire.EndStatus.CANCELLED, code=CANCELLED, http_status=req.http_status)
                    if req.cancelled
                    else _error(DEADLINE_EXCEEDED, http_status=req.http_status)
                )
        finally:
            del self._requests[req.request_id]
            self._first_bytes(req)
        now = trio.current_time()
        end = attrs.evolve(
            end,
            first_byte_sent=req.flow.sent > 0,
            runtime_ms=(now - started) * 1000,
            overhead_ms=overhead_ms(req.arrived, req.sent_at, req.answered_at, now),
        )
        await self._send_end(req.reply, req.request_id, end)

    async def _call_guarded(self, req: _Request) -> wire.EndHead:
        """`_call`, with a last resort: nothing a runtime answers may end the node's relay."""
        try:
            return await self._call(req)
        except ChannelError:
            raise  # the channel is gone; the relay's supervisor deals with it
        except Exception as exc:
            log.warning("request %s failed in the relay: %s", req.request_id, type(exc).__name__)
            return _error(RUNTIME_ERROR if req.responded else RUNTIME_UNAVAILABLE, http_status=req.http_status)
        finally:
            if req.release is not None:
                req.release()

    async def _prepared(self, req: _Request, port: int | None) -> tuple[bytes, int] | wire.EndHead:
        """The body to send and the runtime's port; the end to answer with when there is none, or
        when the LoRA adapter the request is for cannot be given to this runtime (`nexa.node.lora`:
        then `req.release` frees the adapter once the request is done)."""
        head, body = req.head, req.body
        if port is None:
            return _error(RUNTIME_UNAVAILABLE)
        if not head.lora:
            return body, port
        if self._lora is None:
            return _error(RUNTIME_UNAVAILABLE, message="this node serves no LoRA adapters")
        try:
            body, req.release = await self._lora(head.assignment_id, head.lora, body, port)
        except RuntimeFailed as exc:
            return _error(RUNTIME_ERROR, message=exc.message)  # the runtime refused to load it: a failure there
        except NexaError as exc:
            return _error(RUNTIME_UNAVAILABLE, message=exc.message)  # not there (yet): nothing ran
        return body, port

    async def _call(self, req: _Request) -> wire.EndHead:
        head = req.head
        if not _PATH.fullmatch(head.path):
            return _error(INVALID_REQUEST, message="the runtime path is not a plain absolute path")
        if req.body and head.method is not wire.RuntimeMethod.POST:
            return _error(INVALID_REQUEST, message=f"a {head.method} request carries no body")
        port = self._endpoint(head.assignment_id)
        prepared = await self._prepared(req, port)
        if isinstance(prepared, wire.EndHead):
            return prepared
        body, port = prepared
        client = self._client
        assert client is not None  # set while run() serves, which owns this task
        # Our own header: runtimes treat X-Request-Id as theirs (llama-cpp-python refuses one that is not a UUID).
        headers: tuple[tuple[str, str], ...] = ((REQUEST_ID_HEADER, req.request_id),)
        if body:  # a body-less request (a stored response's GET, DELETE or cancel) names no type
            headers = (("Content-Type", head.content_type), *headers)
        usage = _Usage()
        try:
            async with client.request(self._host, port, head.path, body, headers, method=head.method) as resp:
                req.responded, req.http_status, req.sent_at = True, resp.status_code, resp.sent_at
                if not head.stream:
                    self._first_bytes(req)
                try:
                    if resp.status_code >= 400:
                        return await _runtime_failed(resp)
                    if head.stream:
                        await self._forward_events(req, resp, usage)
                    else:
                        await self._forward_body(req, resp, usage)
                finally:
                    req.answered_at = trio.current_time()
        except RuntimeHTTPError:
            # Refused or reset before an answer: nothing ran. After it: the runtime broke the stream.
            return _error(RUNTIME_ERROR if req.responded else RUNTIME_UNAVAILABLE, http_status=req.http_status)
        if usage.refused:
            self._usage_refused += usage.refused
            log.warning("request %s: the runtime reported %d token counts out of range", req.request_id, usage.refused)
        # No usage from the runtime: None, and the controller, which checks every event anyway,
        # counts the output events (events are counted once, there, not on both sides).
        completion = usage.completion_tokens
        prompt = usage.prompt_tokens
        if prompt is None and head.prompt_tokens_estimate:
            prompt = head.prompt_tokens_estimate
        return wire.EndHead(
            status=wire.EndStatus.OK,
            http_status=req.http_status,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )

    async def _forward_events(self, req: _Request, resp: Response, usage: _Usage) -> None:
        """SSE: whole events, coalesced as they are available; read the usage, maybe drop its event.

        A read of whole events with nothing to read or drop in it goes on as it came, one chunk; only
        the others are split into events (a partial event, the usage event, `[DONE]`). Nothing is
        counted here: the controller counts the output events (`calls.Answer`) and, for a runtime
        that sends no usage to a client that asked for it, adds the usage event."""
        self._streams += 1
        try:
            await self._relay_events(req, resp, usage)
        finally:
            self._streams -= 1

    async def _relay_events(self, req: _Request, resp: Response, usage: _Usage) -> None:
        strip = req.head.strip_usage_chunk
        rest = b""
        limit = int(self._cfg.max_chunk_bytes)
        held = _Held()
        reads = resp.aiter_bytes()
        while (data := await self._read(req, reads, held)) is not None:
            if req.first_read_at is None:
                req.first_read_at = trio.current_time()
                self._first_bytes(req)
            if not rest and len(data) <= limit and _plain_events(data):
                # Whole content events only (the common read): relayed as read, in one chunk.
                await self._send_plain(req, data, held)
                continue
            await self._flush(req, held)  # before what follows it
            events, rest = _split_events(rest + data)
            if len(rest) > limit:
                # An event longer than a chunk: pass it on in pieces rather than hold it all.
                events.append(rest)
                rest = b""
            keep = []
            for event in events:
                if b'"usage"' in event and not any(null in event for null in _NULL_USAGE):
                    obj = _event_json(event)
                    usage.take(obj)
                    if strip and isinstance(obj, dict) and obj.get("choices") == []:
                        continue  # the usage-only event the client did not ask for
                keep.append(event)
            await self._send_coalesced(req, keep)
        await self._flush(req, held)
        if rest:
            await self._send_coalesced(req, [rest])  # a last event without its blank line

    async def _read(self, req: _Request, reads: Response, held: _Held) -> bytes | None:
        """The runtime's next read (None: the end of its answer); what is held goes on when its
        flush window ends first."""
        while held.data:
            with trio.move_on_at(held.flush_at):
                return await anext(reads, None)
            await self._flush(req, held)
        return await anext(reads, None)

    async def _send_plain(self, req: _Request, data: bytes, held: _Held) -> None:
        """A read of whole content events: one chunk now, or (after the stream's first chunk, with
        a flush window) held to go on with the reads that follow it within the window."""
        window = float(self._cfg.flush_window_s)
        if not (window and req.flow.sent):
            await self._send_chunk(req, data)
            return
        if len(held.data) + len(data) > int(self._cfg.max_chunk_bytes):
            await self._flush(req, held)
        if not held.data:
            held.flush_at = trio.current_time() + window
        held.data += data

    async def _flush(self, req: _Request, held: _Held) -> None:
        if held.data:
            await self._send_chunk(req, bytes(held.data))
            held.data.clear()

    async def _forward_body(self, req: _Request, resp: Response, usage: _Usage) -> None:
        """Unary: the body in chunks of at most max_chunk_bytes; usage from the whole body."""
        limit = int(self._cfg.max_chunk_bytes)
        whole: bytearray | None = bytearray()
        piece = bytearray()
        async for data in resp.aiter_bytes():
            if whole is not None and len(whole) + len(data) <= USAGE_PARSE_LIMIT:
                whole += data
            else:
                whole = None  # too large to parse for usage
            piece += data
            while len(piece) >= limit:
                await self._send_chunk(req, bytes(piece[:limit]))
                del piece[:limit]
        if piece:
            await self._send_chunk(req, bytes(piece))
        if whole:
            usage.take(_json(whole))

    async def _send_coalesced(self, req: _Request, events: list[bytes]) -> None:
        limit = int(self._cfg.max_chunk_bytes)
        frame = bytearray()
        for event in events:
            if frame and len(frame) + len(event) > limit:
                await self._send_chunk(req, bytes(frame))
                frame.clear()
            rest = event
            while len(rest) > limit:  # one event above the limit: split (frame is empty here)
                await self._send_chunk(req, rest[:limit])
                rest = rest[limit:]
            frame += rest
        if frame:
            await self._send_chunk(req, bytes(frame))

    async def _send_chunk(self, req: _Request, data: bytes) -> None:
        await req.flow.room()  # the window used up: wait for the controller's credit
        head = b""
        if req.flow.sent == 0 and req.head.stream:
            # A stream's first chunk says the node's overhead up to it (the client's response head
            # is written when it arrives); the other chunks' heads stay empty.
            now = trio.current_time()
            spent = overhead_ms(req.arrived, req.sent_at, req.first_read_at, now)
            head = heads.encode(wire.ChunkHead(overhead_ms=spent))
        try:
            # No wait where nothing blocks: the runtime's read before this was the checkpoint.
            req.reply.send_data_nowait(wire.CHUNK, req.request_id, head, data)
        except trio.WouldBlock:
            await req.reply.send_data(wire.CHUNK, req.request_id, head, data)
        req.flow.sent_one()
        self._chunks_sent += 1
        self._bytes_sent += len(data)

    async def _send_end(self, reply: DataSender, request_id: str, end: wire.EndHead) -> None:
        if end.status is wire.EndStatus.OK:
            self._completed += 1
        elif end.status is wire.EndStatus.CANCELLED:
            self._cancelled += 1
        else:
            self._failed += 1
            log.debug("request %s ended: %s (runtime status %s)", request_id, end.code, end.http_status)
        raw = heads.encode(end)
        try:
            try:
                # No wait where nothing blocks (the outbox has room): no scope, no checkpoint.
                reply.send_data_nowait(wire.END, request_id, raw, b"")
            except trio.WouldBlock:
                with trio.move_on_after(_END_SEND_TIMEOUT_S):
                    await reply.send_data(wire.END, request_id, raw, b"")
        except ChannelError:
            log.warning("could not send the end of request %s: the channel is closed", request_id)


def overhead_ms(arrived: float, sent_at: float | None, answered_at: float | None, now: float) -> float:
    """The node's time outside the runtime (trio clock times, in ms): from the `infer` frame's
    arrival to the runtime request written, plus from the runtime's answer (`answered_at`: its first
    bytes, or the whole of it) to `now`; all of it when the runtime was never asked or never answered."""
    if sent_at is None or answered_at is None:
        return max(0.0, now - arrived) * 1000.0
    return (max(0.0, sent_at - arrived) + max(0.0, now - answered_at)) * 1000.0


def _error(code: Code, *, http_status: int | None = None, message: str = "") -> wire.EndHead:
    return wire.EndHead(status=wire.EndStatus.ERROR, code=code, http_status=http_status, message=message)


async def _runtime_failed(resp: Response) -> wire.EndHead:
    """A 4xx (rejected, with the runtime's own message) or 5xx (failed) answer; reads at most 64 KiB."""
    body = bytearray()
    async for data in resp.aiter_bytes():
        body += data
        if len(body) >= ERROR_BODY_LIMIT:
            break
    if resp.status_code >= 500:
        return _error(RUNTIME_ERROR, http_status=resp.status_code)
    return _error(RUNTIME_REJECTED, http_status=resp.status_code, message=_error_message(bytes(body)))


def _error_message(body: bytes) -> str:
    """`error.message` of an OpenAI-shaped error body (or vLLM's older flat form, or the string
    stable-diffusion.cpp's sd-server answers as `error`: `{"error": "prompt required"}`); "" otherwise."""
    obj = _json(body)
    if not isinstance(obj, dict):
        return ""
    error = obj.get("error")
    message = (
        error if isinstance(error, str) else error.get("message") if isinstance(error, dict) else obj.get("message")
    )
    return message[:_MESSAGE_CHARS] if isinstance(message, str) else ""


def _split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (each with its blank line) and the incomplete rest. Bytes only."""
    events = []
    start = 0
    crlf = b"\r" in buf
    while True:
        lf = buf.find(b"\n\n", start)
        cr = buf.find(b"\n\r\n", start) if crlf else -1
        if lf < 0 and cr < 0:
            break
        end = (lf + 2) if cr < 0 or (0 <= lf < cr) else (cr + 3)
        events.append(buf[start:end])
        start = end
    return events, buf[start:]


def _plain_events(data: bytes) -> bool:
    """Whether `data` ends where an event ends and holds no `[DONE]` and no usage but null ones:
    nothing in it to read, drop or add, so it can be relayed as it is."""
    if not data.endswith((b"\n\n", b"\n\r\n")) or _DONE in data:
        return False
    usages = data.count(b'"usage"')
    return usages == 0 or usages == sum(data.count(null) for null in _NULL_USAGE)


def _event_json(event: bytes) -> object:
    """The JSON of an event's data lines, or None."""
    data = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return _json(b"\n".join(data))


def _json(raw: bytes | bytearray) -> object:
    """A runtime's JSON through msgspec's compiled decoder (as the controller checks answers and
    events: `control.datapath.answers`), or None. Only `usage` and an error's message are read
    here, and checked where they are (`_Usage.take`, `_error_message`)."""
    try:
        return _ANSWER_DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
