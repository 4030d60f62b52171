"""The relay's data path, end to end in one trio run: the controller's `Relay` ⇄ `Link` ⇄ `Uplink` ⇄
the node's `NodeRelay` ⇄ a runtime. The runtime is a small OpenAI-shaped ASGI app served by hypercorn
on 127.0.0.1: it is the far end, not the thing under test. Also the requests and drains the node and
controller relay tests share."""

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
import trio

from nexa.channel.links import DataInbound, Link, Uplink
from nexa.config import RelayConfig
from nexa.contracts import wire
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, Capability
from nexa.control.datapath.calls import Work
from nexa.control.datapath.relay import Relay, RelayStream
from nexa.node.relay import NodeRelay
from tests.support.messaging import Fleet, hello

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
    #: The HTTP method of every request, in the same order.
    methods: list[str] = attrs.field(factory=list)

    def gone(self, request_id: str) -> trio.Event:
        return self.disconnected.setdefault(request_id, trio.Event())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await request_body(scope, receive, send)
        if body is None:
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((scope["path"], headers, body))
        self.methods.append(scope["method"])
        if not body:  # a body-less request (a stored response's own route): what it asked, back
            await _respond(send, 200, json.dumps({"method": scope["method"], "path": scope["path"]}).encode())
            return
        req = json.loads(body)
        if scope["path"] == Capability.IMAGE.path:
            await _sd_server_image(req, send)
            return
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


#: A 1x1 PNG, base64: what stands in for stable-diffusion.cpp's images.
SD_IMAGE_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="


async def _sd_server_image(req: dict[str, Any], send: Any) -> None:
    """`POST /v1/images/generations` as stable-diffusion.cpp's sd-server answers it
    (examples/server/routes_openai.cpp at 97d2990, lines 22-80 and 257-329): 400 `{"error": "prompt
    required"}` without a prompt, else `n` images (at least 1), base64 always, and the output format."""
    prompt, n = req.get("prompt", ""), max(1, req.get("n", 1))
    if not prompt:
        await _respond(send, 400, json.dumps({"error": "prompt required"}).encode())
        return
    data = [{"b64_json": SD_IMAGE_B64}] * n
    answer = {"created": int(time.time()), "data": data, "output_format": req.get("output_format", "png")}
    await _respond(send, 200, json.dumps(answer).encode())


async def request_body(scope: dict[str, Any], receive: Any, send: Any) -> bytes | None:
    """An ASGI far end's first step: a request's whole body, or None once a lifespan is served."""
    if scope["type"] == "lifespan":
        while (msg := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return None
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


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
    kw.setdefault("path", CHAT)
    return wire.InferHead(stream=stream, deadline_at=time.time() + deadline_s, window=4, **kw)


def request(mode: str, **kw: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [], "mode": mode, **kw}).encode()


async def drain(stream: RelayStream) -> tuple[bytes, wire.EndHead]:
    out = b"".join([chunk async for chunk in stream])
    assert stream.end is not None
    return out, stream.end


async def wait_until(predicate: Any) -> None:
    while not predicate():  # noqa: ASYNC110 - polls statistics, which signal nothing
        await trio.sleep(0.005)


def chat_work(*, stream: bool, include_usage: bool = False, messages: list[dict[str, str]] | None = None) -> Work:
    """A chat call's `Work` as the gateway makes it (tenant acme, key k1, model `chat`)."""
    return Work(
        request_id="rid-1",
        api=Api.OPENAI,
        tenant=TenantId("acme"),
        key_id=KeyId("k1"),
        capability=Capability.CHAT,
        model="chat",
        body={"messages": messages or []},
        stream=stream,
        include_usage=include_usage,
        deadline_at=time.time() + 60,
    )
