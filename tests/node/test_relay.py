"""The node's inference relay against a real HTTP runtime on 127.0.0.1, over a real Link/Uplink pair.

The "runtime" is a small OpenAI-shaped ASGI app served by hypercorn in this test's trio run: it is
the far end, not the thing under test. The controller side is the real `nexa.control.relay.Relay`.
Every I/O test runs under an absolute `trio.fail_after`. Also holds the harness the controller
relay tests (tests/control/test_relay.py) use.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import pytest
import trio
import trio.testing

from nexa.config import Bytes, RelayConfig
from nexa.contracts import wire
from nexa.control.relay import Relay, RelayStream
from nexa.messaging import DataInbound, Link, Uplink
from nexa.node.relay import NodeRelay, _split_events
from tests.node import test_supervisor as supervised
from tests.test_messaging import Fleet, hello

TIMEOUT_S = 10
CHAT = "/v1/chat/completions"


# --- the far end: an OpenAI-shaped runtime ------------------------------------------------------


@attrs.define
class Runtime:
    """ASGI app. The request's JSON picks the behaviour (`mode`); what it saw is recorded."""

    #: X-Nexa-Request-Id → set when the runtime saw the client go away (http.disconnect).
    disconnected: dict[str, trio.Event] = attrs.field(factory=dict)
    #: (path, headers, body) of every request.
    seen: list[tuple[str, dict[str, str], bytes]] = attrs.field(factory=list)

    def gone(self, request_id: str) -> trio.Event:
        return self.disconnected.setdefault(request_id, trio.Event())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((scope["path"], headers, body))
        req = json.loads(body)
        rid = headers.get("x-nexa-request-id", "")
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.gone(rid).set()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await self._answer(req, send)
            nursery.cancel_scope.cancel()

    async def _answer(self, req: dict[str, Any], send: Any) -> None:
        mode = req.get("mode", "unary")
        if mode == "unary":
            answer = {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * req.get("pad", 5)}}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            }
            await _respond(send, 200, json.dumps(answer).encode())
        elif mode == "status":
            error = {"error": {"message": "prompt is too long", "type": "BadRequestError", "code": 400}}
            await _respond(send, req["status"], json.dumps(error).encode())
        elif mode == "hang":
            await trio.sleep_forever()
        else:
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await self._events(req, mode, send)

    async def _events(self, req: dict[str, Any], mode: str, send: Any) -> None:
        include_usage = req.get("stream_options", {}).get("include_usage", False)
        tail = ',"usage":null' if include_usage else ""

        async def event(data: str) -> None:
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        await event('{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]' + tail + "}")
        if big := req.get("big", 0):
            await event('{"choices":[{"index":0,"delta":{"content":"%s"}}]%s}' % ("y" * big, tail))  # noqa: UP031
        count = req.get("events", 5) if mode != "endless" else 10**9
        for i in range(count):
            await event('{"choices":[{"index":0,"delta":{"content":"tok%d"}}]%s}' % (i, tail))  # noqa: UP031
            if mode == "abort" and i == 1:
                raise RuntimeError("the runtime crashed mid-stream")
            if mode == "endless":
                await trio.sleep(0.01)
        if include_usage:
            await event('{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":%d,"total_tokens":0}}' % count)  # noqa: UP031
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _respond(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def serve_runtime(runtime: Runtime, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, runtime, config, shutdown_trigger=trio.sleep_forever))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


def closed_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the harness: controller Relay ⇄ Link ⇄ Uplink ⇄ NodeRelay ⇄ runtime -------------------------


@attrs.define
class DataPath:
    relay: Relay
    node: NodeRelay
    link: Link
    uplink: Uplink
    runtime: Runtime
    fleet: Fleet
    endpoint: str
    #: Ports the node's `endpoint()` reports, by assignment id (edit to make one unavailable).
    ports: dict[str, int]
    #: Cancel to kill the node (its uplink and relay) mid-stream.
    node_scope: trio.CancelScope
    #: Data frames the node received, when it does not answer them itself (`node_answers=False`).
    node_frames: list[wire.DataFrame]


@contextlib.asynccontextmanager
async def data_path(
    *, window: int = 4, relay_cfg: RelayConfig | None = None, node_answers: bool = True, chunk_limit: int = 65536
) -> AsyncIterator[DataPath]:
    fleet = Fleet()
    n1 = fleet.enroll("n1")
    runtime = Runtime()
    node_frames: list[wire.DataFrame] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_runtime, runtime)
        link = fleet.link()
        endpoint = await nursery.start(link.run)
        relay = Relay(link, window=window, max_chunk_bytes=chunk_limit)
        ports = {"a1": port}
        uplink = fleet.uplink(endpoint, n1)
        node = NodeRelay(relay_cfg or RelayConfig(), uplink, ports.get)

        async def controller() -> None:
            while True:
                got = await link.receive_any()
                if isinstance(got, DataInbound):
                    relay.deliver(got.node_id, got.frame)

        async def node_side(*, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as parts:
                    await parts.start(uplink.run)
                    await parts.start(node.run)
                    task_status.started(scope)
                    while True:
                        msg = await uplink.receive()
                        if isinstance(msg, wire.DataFrame):
                            if node_answers:
                                node.deliver(msg)
                            else:
                                node_frames.append(msg)

        nursery.start_soon(controller)
        node_scope = await nursery.start(node_side)
        await uplink.send(hello("n1"))  # the link learns its route from a signed message
        await wait_until(lambda: link.connected("n1"))
        yield DataPath(relay, node, link, uplink, runtime, fleet, endpoint, ports, node_scope, node_frames)
        nursery.cancel_scope.cancel()


def infer_head(*, stream: bool = False, deadline_s: float = 10.0, **kw: Any) -> wire.InferHead:
    kw.setdefault("assignment_id", "a1")
    return wire.InferHead(path=CHAT, stream=stream, deadline_at=time.time() + deadline_s, window=4, **kw)


def request(mode: str, **kw: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [], "mode": mode, **kw}).encode()


async def drain(stream: RelayStream) -> tuple[bytes, wire.EndHead]:
    out = b"".join([chunk async for chunk in stream])
    assert stream.end is not None
    return out, stream.end


async def wait_until(predicate: Any) -> None:
    while not predicate():  # noqa: ASYNC110 - polls statistics, which signal nothing
        await trio.sleep(0.005)


# --- unary and streamed answers -----------------------------------------------------------------


async def test_unary_answer_comes_back_whole_with_its_usage() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path(relay_cfg=RelayConfig(max_chunk_bytes=Bytes(100))) as p:
            async with p.relay.open("n1", "r1", infer_head(), request("unary", pad=1000)) as s:
                body, end = await drain(s)
            answer = json.loads(body)
            assert answer["choices"][0]["message"]["content"] == "x" * 1000
            assert end.status is wire.EndStatus.OK
            assert (end.prompt_tokens, end.completion_tokens, end.http_status) == (7, 3, 200)
            assert end.first_byte_sent
            assert end.runtime_ms > 0
            assert p.node.statistics().chunks_sent == -(-len(body) // 100)  # 100-byte chunks
            path, headers, sent = p.runtime.seen[0]
            assert (path, sent) == (CHAT, request("unary", pad=1000))
            assert headers["x-nexa-request-id"] == "r1"
            assert headers["content-type"] == "application/json"


async def test_stream_forwards_events_and_reads_usage_from_the_runtime() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            body_json = request("stream", events=6, stream_options={"include_usage": True})
            async with p.relay.open("n1", "r1", infer_head(stream=True), body_json) as s:
                body, end = await drain(s)
    events = body.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert b'"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":6' in body  # kept: the client asked
    assert end.status is wire.EndStatus.OK
    assert (end.prompt_tokens, end.completion_tokens) == (7, 6)


async def test_the_usage_only_event_is_dropped_when_asked_after_its_counts_are_read() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            body_json = request("stream", events=6, stream_options={"include_usage": True})
            head = infer_head(stream=True, strip_usage_chunk=True)
            async with p.relay.open("n1", "r1", head, body_json) as s:
                body, end = await drain(s)
    assert b'"choices":[]' not in body
    assert body.count(b'"content":"tok') == 6
    assert body.endswith(b"data: [DONE]\n\n")
    assert (end.prompt_tokens, end.completion_tokens) == (7, 6)


async def test_without_usage_completion_tokens_count_the_content_events() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with (
            data_path() as p,
            p.relay.open("n1", "r1", infer_head(stream=True, strip_usage_chunk=True), request("stream", events=4)) as s,
        ):
            body, end = await drain(s)
    assert end.status is wire.EndStatus.OK
    assert (end.prompt_tokens, end.completion_tokens) == (None, 4)  # the role-only event carries no text
    assert b'"usage"' not in body  # the client did not ask for usage


async def test_a_runtime_without_stream_usage_gets_one_made_from_the_counts_when_the_client_asked() -> None:
    """llama-cpp-python ignores stream_options: the client that asked still gets a usage event."""
    with trio.fail_after(TIMEOUT_S):
        async with (
            data_path() as p,
            p.relay.open(
                "n1", "r1", infer_head(stream=True, prompt_tokens_estimate=9), request("stream", events=4)
            ) as s,
        ):
            body, end = await drain(s)
    assert (end.prompt_tokens, end.completion_tokens) == (9, 4)
    events = body.split(b"\n\n")
    assert events[-2] == b"data: [DONE]"
    usage = json.loads(events[-3].removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}


def test_events_split_on_blank_lines_and_keep_the_rest() -> None:
    events, rest = _split_events(b"data: a\n\ndata: b\r\n\r\ndata: c\n\ndata: part")
    assert events == [b"data: a\n\n", b"data: b\r\n\r\n", b"data: c\n\n"]
    assert rest == b"data: part"
    assert _split_events(b"data: x\n") == ([], b"data: x\n")


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "message"),
    [(500, "runtime_error", ""), (503, "runtime_error", ""), (400, "runtime_rejected", "prompt is too long")],
)
async def test_a_runtime_error_answer_ends_before_the_first_byte(status: int, code: str, message: str) -> None:
    with trio.fail_after(TIMEOUT_S):
        head, body_json = infer_head(stream=True), request("status", status=status)
        async with data_path() as p, p.relay.open("n1", "r1", head, body_json) as s:
            body, end = await drain(s)
    assert body == b""
    assert end.status is wire.EndStatus.ERROR
    assert (end.code, end.http_status, end.message, end.first_byte_sent) == (code, status, message, False)


async def test_a_refused_connection_or_a_runtime_not_ready_is_runtime_unavailable() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            p.ports["a1"] = closed_port()
            async with p.relay.open("n1", "r1", infer_head(stream=True), request("stream")) as s:
                _, refused = await drain(s)
            async with p.relay.open("n1", "r2", infer_head(assignment_id="not-ready"), request("unary")) as s:
                _, not_ready = await drain(s)
    for end in (refused, not_ready):
        assert (end.status, end.code, end.first_byte_sent) == (wire.EndStatus.ERROR, "runtime_unavailable", False)


async def test_a_stream_broken_after_some_output_is_a_runtime_error_with_first_byte_sent() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p, p.relay.open("n1", "r1", infer_head(stream=True), request("abort")) as s:
            body, end = await drain(s)
    assert b"tok0" in body
    assert (end.status, end.code, end.http_status, end.first_byte_sent) == (
        wire.EndStatus.ERROR,
        "runtime_error",
        200,
        True,
    )


async def test_the_deadline_ends_the_request_and_closes_it_at_the_runtime() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            async with p.relay.open("n1", "r1", infer_head(deadline_s=0.3), request("hang")) as s:
                _, end = await drain(s)
            assert (end.status, end.code, end.first_byte_sent) == (wire.EndStatus.ERROR, "deadline_exceeded", False)
            await p.runtime.gone("r1").wait()
            assert p.node.statistics().failed == 1


async def test_more_requests_than_max_inflight_are_refused_as_node_busy() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path(relay_cfg=RelayConfig(max_inflight=1)) as p:
            async with p.relay.open("n1", "r1", infer_head(), request("hang")) as first:
                await wait_until(lambda: p.node.statistics().inflight == 1)
                async with p.relay.open("n1", "r2", infer_head(), request("unary")) as second:
                    _, end = await drain(second)
                assert (end.status, end.code, end.first_byte_sent) == (wire.EndStatus.ERROR, "node_busy", False)
                assert not first.ended
            stats = p.node.statistics()
            assert (stats.busy, stats.accepted) == (1, 1)
            await p.runtime.gone("r1").wait()  # leaving `first` cancelled it at the runtime


async def test_an_unreadable_infer_head_or_an_id_unfit_for_http_is_ended_as_invalid() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            p.node.deliver(wire.DataFrame(kind=wire.INFER, request_id="bad", head=b"{}", body=b""))
            await wait_until(lambda: p.relay.statistics().dropped_frames == 1)  # its end: no stream open here
            assert p.node.statistics().failed == 1
            async with p.relay.open("n1", "r\u00e9q", infer_head(), request("unary")) as s:
                _, end = await drain(s)
            assert (end.status, end.code) == (wire.EndStatus.ERROR, "invalid_request")
            assert p.runtime.seen == []


async def test_an_event_longer_than_a_chunk_is_passed_on_in_pieces() -> None:
    cfg = RelayConfig(max_chunk_bytes=Bytes(1000))
    with trio.fail_after(TIMEOUT_S):
        async with (
            data_path(relay_cfg=cfg) as p,
            p.relay.open("n1", "r1", infer_head(stream=True), request("stream", events=2, big=20_000)) as s,
        ):
            chunks = [chunk async for chunk in s]
    assert max(len(c) for c in chunks) <= 1000
    body = b"".join(chunks)
    assert b"y" * 20_000 in body
    assert body.endswith(b"data: [DONE]\n\n")
    assert s.end is not None
    assert s.end.status is wire.EndStatus.OK


# --- where the relay finds a runtime ------------------------------------------------------------


async def test_the_supervisor_gives_a_runtime_port_only_while_it_is_ready(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    podman, artifacts = supervised.FakePodman(registry={supervised.IMAGE}), supervised.FakeArtifacts()
    podman.healthy = False
    sup = await supervised.start(nursery, podman, artifacts, supervised.assignment())
    await supervised.wait_for(sup, wire.RuntimeState.STARTING)
    assert sup.endpoint("a1") is None  # running, not yet healthy
    podman.healthy = True
    await supervised.wait_for(sup, wire.RuntimeState.READY)
    assert sup.endpoint("a1") == supervised.runtime().port
    assert sup.endpoint("a2") is None  # not an assignment of this node
    sup.update(2, [])
    assert sup.endpoint("a1") is None  # removed: stopping now
