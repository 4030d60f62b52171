"""The ASGI edge: scopes and messages are plain dicts, read here and in `app`; a body read with
a size limit, a reply, an error envelope, a server-sent event, and the lifespan protocol."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

#: Largest request body accepted.
MAX_BODY_BYTES: Final = 16 << 20
JSON_HEADERS: Final = [(b"content-type", b"application/json")]

# ASGI messages and scopes are plain dicts: this package is the edge where they are read.
Scope = Mapping[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BadRequest(Exception):
    """A request the simulator answers with an OpenAI-shaped error (`status`, 400 unless said)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise BadRequest("the client went away", status=499)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def reply(send: Send, status: int, body: bytes, *, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or JSON_HEADERS})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def error_body(message: str, kind: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": code, "param": param}}).encode()


def sse(data: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
