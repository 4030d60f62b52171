"""What both controller HTTP front ends share: the error→status table, request ids, the body limit.

`control/http/api.py` (management, quart) and `control/datapath/inference.py` (the inference routes, plain
ASGI) answer errors with the same statuses and codes; no quart here.
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any, Final, Protocol

import trio

from nexa.contracts import codec
from nexa.contracts.api import ErrorBody, ErrorEnvelope
from nexa.contracts.bounds import declared_bytes
from nexa.contracts.domain import ApiKey
from nexa.errors import (
    ArtifactDigestMismatch,
    AuthError,
    BackupError,
    BackupNotConfigured,
    BodyTimeout,
    Cancelled,
    Conflict,
    ContractError,
    DeadlineExceeded,
    Forbidden,
    IdempotencyKeyReused,
    MethodNotAllowed,
    NexaError,
    NotDeployable,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RetentionUnavailable,
    RuntimeFailed,
    RuntimeRejected,
    StoreError,
    Unauthenticated,
    Unavailable,
    VerificationFailed,
)
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

_REQUEST_ID_RE: Final = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
#: nginx's "client closed request": what a cancelled workload's status reads.
CLIENT_CLOSED: Final = 499

#: Error class → HTTP status; the most specific class in an error's MRO wins.
STATUS: Final[dict[type[NexaError], int]] = {
    PayloadTooLarge: 413,
    BodyTimeout: 408,
    IdempotencyKeyReused: 422,
    ContractError: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    AuthError: 401,
    MethodNotAllowed: 405,
    NotFound: 404,
    Conflict: 409,
    VerificationFailed: 422,
    NotDeployable: 422,
    ArtifactDigestMismatch: 422,
    RetentionUnavailable: 422,
    RuntimeRejected: 400,
    Overloaded: 429,
    RuntimeFailed: 502,
    Unavailable: 503,
    DeadlineExceeded: 504,
    Cancelled: CLIENT_CLOSED,
    StoreError: 500,
    BackupNotConfigured: 409,
    BackupError: 422,
    NexaError: 500,
}


class KeyAuthority(Protocol):
    """What knows the API keys (`access.accounts.Accounts`)."""

    def authenticate(self, presented: str) -> ApiKey: ...


def bearer_key(
    authorization: str, keys: KeyAuthority, metrics: Metrics, *, how: str = "Authorization: Bearer <key>"
) -> ApiKey:
    """The active key an `Authorization: Bearer <key>` header presents; Unauthenticated otherwise
    (counted in `nexa_auth_failures`), its message saying `how` to present one."""
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        metrics.auth_failures.labels("unauthenticated").inc()
        raise Unauthenticated(f"an API key is required: {how}")
    try:
        return keys.authenticate(presented.strip())
    except Unauthenticated as exc:
        metrics.auth_failures.labels(exc.code).inc()  # `unauthenticated` or `key_expired`
        raise


def status_for(exc: NexaError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def new_request_id(presented: str) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one."""
    return presented if _REQUEST_ID_RE.match(presented) else "req_" + secrets.token_hex(8)


#: The HTTP methods metrics name; every other method a client sends is counted as `other`, so no
#: client's string becomes a label (each label value is a series the controller keeps for ever).
METRIC_METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in METRIC_METHODS else "other"


def declares_body(headers: dict[str, str]) -> bool:
    """Whether a request head (lower-case names) announces a body still to come."""
    return headers.get("content-length", "") not in ("", "0") or "transfer-encoding" in headers


class BodyLimit:
    """ASGI middleware: answer an oversized body with 413, after discarding what the client sends;
    and end every exchange whole, however early its answer.

    Clients such as httpx write the whole body before they read the answer, so replying without
    reading would leave them blocked on a full socket. The discarded bytes are capped; past the
    cap the connection is dropped.

    An answer sent before the request's body has arrived (a 401, 403 or 405 decided from the
    head alone) leaves hypercorn unable to reuse the connection: it closes it once the answer is
    out. quart-trio cancels the request's tasks as soon as hypercorn reports the answer done, which
    used to cancel that close half-way, leaving a connection that read the late body and the next
    request but never answered it (a keep-alive client waited for its timeout). So the answer's
    last message is sent shielded, and an answer that leaves body unread says `Connection: close`,
    so the client opens a new connection instead of reusing this one.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self._app = app
        self._limit = limit
        self._drain_cap = max(64 * 1024 * 1024, 8 * limit)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        declared = declared_bytes(headers.get("content-length"))
        if declared is not None and declared > self._limit:
            await self._drain(receive, declared)
            await self._reply_413(send, new_request_id(headers.get("x-request-id", "")))
            return
        seen = 0
        whole = not declares_body(headers)

        async def counting_receive() -> Any:
            nonlocal seen, whole
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._limit and message.get("more_body"):
                    # Quart refuses the body (413) on its own; make sure the client can read that.
                    await self._drain(receive, self._drain_cap)
                    message = {**message, "more_body": False}
                whole = whole or not message.get("more_body")
            return message

        async def whole_send(message: Any) -> None:
            if message["type"] == "http.response.start" and not whole:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):  # hypercorn recycles or closes the connection in it
                    await send(message)
                return
            await send(message)

        await self._app(scope, counting_receive, whole_send)

    async def _drain(self, receive: Any, expected: int) -> None:
        discarded = 0
        with trio.move_on_after(30):
            while discarded <= min(expected, self._drain_cap):
                message = await receive()
                if message["type"] != "http.request":
                    return
                discarded += len(message.get("body", b""))
                if not message.get("more_body"):
                    return

    async def _reply_413(self, send: Any, rid: str) -> None:
        error = PayloadTooLarge(limit_bytes=self._limit)
        body = ErrorEnvelope(error=ErrorBody(code=error.code, message=error.message, retryable=False, request_id=rid))
        payload = codec.dumps(codec.api, body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"x-request-id", rid.encode()),
                    (b"cache-control", b"no-store"),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})
        log.info("request", extra={"fields": {"status": 413, "route": "unread", "request_id": rid}})
