"""Followers pass management writes to the leader (DESIGN §5): an ASGI layer around the management app.

Several controllers share one store and one of them leads. On a follower, every request that
could change desired state goes to the leader as through a reverse proxy (same method, path,
query, body and end-to-end headers; the answer relayed with its status and headers, plus
`x-nexa-forwarded: <leader id>`), so there is one writer and no cache to keep coherent for writes:
Vault's "standby forwards to active". What is forwarded (`forwarded`):

- every method but GET, HEAD and OPTIONS under `/api/v1/`;
- the console, pages included, but its static files: its signed-in sessions live in the memory of
  the controller that signed the browser in, so a follower that served the pages and forwarded
  only the form posts would send the leader sessions it never saw. Behind one controller the
  console is what it was; a leader change signs its browsers out, as a restart does.

Never forwarded: the inference routes (`/v1/...`, `/api/v1/workloads...`: `inference.InferenceApp`
sits in front of this layer and serves them here), health, readiness, metrics, version and
`/api/v1/cluster`. Reads are answered from this controller's caches (`follow.ChangeFeed`).

Refusals, in the error envelope and retryable (503 `not_leader`, `Retry-After`): no leader is known
(an election is under way); the request was forwarded already (a loop while the lease moves); the
leader did not answer. A leader that fails after its answer began cuts the connection (a
truncated body must not look whole). Bodies stream both ways and keep the body limit
(`http.max_body_bytes`). The home of httpx for this peer: its errors become nexa errors here.
Each forwarded request is counted by how it ended: `nexa_forwarded_requests_total{result}`.

Encrypted between hosts: a leader whose address is https:// is reached over TLS, its certificate
verified against `[cluster] peer_ca_file` (or the system's CA store); one that does not verify is
refused (`leader_untrusted`, logged with what to set). A leader on another host whose address is
plain http:// is not sent the write at all (`plain_http_refused`, logged once per address) unless
`[cluster] allow_plain_http_peers` is set: API keys, cookies and bodies would cross the network in
clear. Loopback addresses (one host, several workers) may stay plain.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from functools import partial
from typing import Any, Final, NoReturn, Protocol

import httpx
import trio

from nexa.contracts import codec
from nexa.contracts.api import ErrorBody, ErrorEnvelope
from nexa.contracts.hosts import is_loopback_host
from nexa.control.console.sessions import reached_over_https, trusted_networks
from nexa.control.http.common import BodyLimit, new_request_id, status_for
from nexa.errors import NexaError, NotLeader, PayloadTooLarge, PlainHttpPeer, Unavailable
from nexa.telemetry import Children, Metrics
from nexa.tls import PEER_FIX, ClientTls

log = logging.getLogger(__name__)

# ASGI as hypercorn and quart type it is stricter than this module needs (as in `inference`).
Scope = Any
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
AsgiApp = Callable[[Any, Any, Any], Awaitable[None]]

#: On a forwarded request: the follower that sent it (the leader serves it, or refuses a loop);
#: on its relayed answer: the leader that answered.
FORWARDED_HEADER: Final = "x-nexa-forwarded"
_FORWARDED: Final = FORWARDED_HEADER.encode()
#: A leader that does not accept the connection within this long is taken for gone.
CONNECT_TIMEOUT_S: Final = 3.0
#: A leader silent this long within one answer is taken for gone. As long as the slowest write a
#: follower passes on may take: a model verification streams and hashes its artifact first.
READ_TIMEOUT_S: Final = 300.0
#: After a forwarded write succeeded, how long its answer waits for this controller's caches to
#: show it (`after_write`), so a client that reads back through the same follower sees its write.
CATCH_UP_S: Final = 1.0
#: What a refusal tells the client to wait before retrying (a lease moves within `cluster.lease_s`).
RETRY_AFTER_S: Final = 2
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_LOCAL_PATHS: Final = frozenset({"/healthz", "/readyz", "/metrics", "/version", "/api/v1/cluster"})
#: RFC 9110 §7.6.1: hop-by-hop fields, never relayed (with those a `Connection` field names).
_HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
#: Request fields the forwarder sets itself.
_SET_HERE: Final = frozenset({b"host", b"content-length", b"x-request-id", _FORWARDED, b"x-forwarded-proto"})


class LeaderView(Protocol):
    """What the forwarder reads of the leadership (`leadership.Leadership`), at each request."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def leader_address(self) -> str | None: ...

    @property
    def leader_id(self) -> str | None: ...


def check_peer(address: str, *, allow_plain_http: bool) -> None:
    """PlainHttpPeer unless the leader at `address` is reached over https, on this host (a loopback
    address or `localhost`), or plain http to other hosts is allowed (`allow_plain_http`)."""
    url = httpx.URL(address)
    if url.scheme == "https" or allow_plain_http or is_loopback_host(url.host):
        return
    raise PlainHttpPeer(url=address)


def forwarded(method: str, path: str) -> bool:
    """Whether a follower sends this request to the leader (the module docstring says which)."""
    if path in _LOCAL_PATHS or path.startswith("/v1/") or path.startswith("/api/v1/workloads"):
        return False
    if path == "/" or path.startswith("/console/"):
        return not path.startswith("/console/static/")
    return path.startswith("/api/v1/") and method not in _SAFE_METHODS


class _BodyRefused(Exception):
    """Raised from the streamed request body: the forwarded request is abandoned, `error` answered."""

    def __init__(self, error: NexaError | None) -> None:
        super().__init__()
        self.error = error  # None: the client went away; nothing to answer


class Forwarder:
    """ASGI: on a follower, `forwarded` requests to the leader; everything else to `app`.

    Its loop (`run`) holds one httpx client to the leader (bounded timeouts, no proxies from the
    environment, no redirects followed).

    - `controller_id` names this controller in `x-nexa-forwarded` on what it sends (the leader's
      id, the lease's holder, names it on the answers relayed);
    - `after_write` runs (bounded by `CATCH_UP_S`) once a forwarded request succeeded, before its
      answer is relayed: the change feed's catch-up, so this controller's reads show the write;
    - `trusted_proxies` (`http.trusted_proxies`) decide the `X-Forwarded-Proto` sent on, as the
      console decides it (the leader trusts it from followers listed in its own);
    - `metrics`: where each forwarded request is counted by result (`nexa_forwarded_requests_total`);
    - `peer_tls`: how an https leader's certificate is verified (default: the system's CA store);
    - `allow_plain_http_peers`: forward over plain http to a leader on another host too
      (`[cluster] allow_plain_http_peers`; `check_peer`).
    """

    def __init__(
        self,
        app: AsgiApp,
        leadership: LeaderView,
        *,
        controller_id: str,
        max_body_bytes: int,
        after_write: Callable[[], Awaitable[object]] | None = None,
        trusted_proxies: Iterable[str] = (),
        transport: httpx.AsyncBaseTransport | None = None,
        metrics: Metrics | None = None,
        peer_tls: ClientTls | None = None,
        allow_plain_http_peers: bool = False,
    ) -> None:
        self._counted = None if metrics is None else Children(metrics.forwarded_requests)
        self._app = app
        self._leadership = leadership
        self._controller_id = controller_id
        self._limit = max_body_bytes
        self._after_write = after_write
        self._proxies = trusted_networks(trusted_proxies)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        # Bodies over the limit that declare their length: drained and answered 413 without forwarding.
        self._limited = BodyLimit(self._forward, max_body_bytes)
        self._peer_tls = peer_tls
        self._allow_plain = allow_plain_http_peers
        #: The plain-http leader address last refused (logged once per address, not per request).
        self._refused_plain: str | None = None

    def _count(self, result: str) -> None:
        if self._counted is not None:
            self._counted(result).inc()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Hold the client to the leader open until cancelled: start it before HTTP serves, cancel
        it after HTTP has drained (the composition root's loop order). Until then requests that
        would be forwarded are refused (`not_leader`)."""
        if self._peer_tls is None:
            self._peer_tls = await trio.to_thread.run_sync(partial(ClientTls.load, fix=PEER_FIX))
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S),
            # No idle connection kept to the leader: hypercorn's graceful shutdown waits for open
            # connections, so one would hold back a leader's clean stop and the hand-over of its
            # lease by up to `http.graceful_timeout_s`. Writes are few; a connection each is cheap.
            limits=httpx.Limits(max_keepalive_connections=0),
            transport=self._transport,
            verify=self._peer_tls.context,
            follow_redirects=False,
            trust_env=False,
        ) as client:
            self._client = client
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._client = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._leadership.is_leader or not forwarded(scope["method"], scope["path"]):
            await self._app(scope, receive, send)
            return
        await self._limited(scope, receive, send)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        headers: list[tuple[bytes, bytes]] = [(k.lower(), v) for k, v in scope["headers"]]
        rid = new_request_id(_header(headers, b"x-request-id"))
        if any(k == _FORWARDED for k, _ in headers):
            self._count("loop")
            await _refuse(send, rid, NotLeader(_LOOP))
            return
        address, client = self._leadership.leader_address, self._client
        plain = address is not None and self._plain_refused(address)
        if self._leadership.is_leader or not address or client is None or plain:
            # Leading after all (it took the lease meanwhile): the request is ours to serve.
            if self._leadership.is_leader:
                await self._app(scope, receive, send)
            else:
                self._count("plain_http_refused" if plain else "no_leader")
                await _refuse(send, rid, NotLeader(_PLAIN_REFUSED if plain else _NO_LEADER))
            return
        first = await receive()
        if first["type"] != "http.request":
            self._count("client_gone")
            return  # the client went away before sending its body
        body: bytes = first.get("body", b"")
        if len(body) > self._limit:
            self._count("too_large")
            await _refuse(send, rid, PayloadTooLarge(limit_bytes=self._limit))
            return
        out = self._request_headers(scope, headers, rid)
        declared = _header(headers, b"content-length")
        content: bytes | AsyncIterator[bytes] = body
        if first.get("more_body"):
            content = self._rest(receive, body)
            if declared.isdigit():
                out.append((b"content-length", declared.encode()))  # else httpx sends it chunked
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        query: bytes = scope.get("query_string", b"")
        url = httpx.URL(address.rstrip("/")).copy_with(raw_path=raw_path + (b"?" + query if query else b""))
        request = client.build_request(scope["method"], url, headers=out, content=content)
        try:
            response = await client.send(request, stream=True)
        except _BodyRefused as refused:
            self._count("client_gone" if refused.error is None else "too_large")
            if refused.error is not None:
                await _refuse(send, rid, refused.error)
            return
        except httpx.HTTPError as exc:
            result, error = self._not_answered(exc, scope["method"], address)
            self._count(result)
            await _refuse(send, rid, error)
            return
        try:
            await self._relay(response, send, rid)
        finally:
            await response.aclose()
        log.info(
            "forwarded",
            extra={
                "fields": {
                    "method": scope["method"],
                    "status": response.status_code,
                    "ms": round((time.perf_counter() - started) * 1000, 3),
                    "request_id": rid,
                }
            },
        )

    def _plain_refused(self, address: str) -> bool:
        """Whether the leader at `address` is refused for plain http (`check_peer`; logged once per address)."""
        try:
            check_peer(address, allow_plain_http=self._allow_plain)
        except PlainHttpPeer as exc:
            refused = exc
        else:
            return False
        if self._refused_plain != address:  # once per address, not once per request
            self._refused_plain = address
            log.error("%s", refused.message)
        return True

    def _not_answered(self, exc: httpx.HTTPError, method: str, address: str) -> tuple[str, NexaError]:
        """A forwarded request the leader did not answer: its result and the error answered."""
        untrusted = None if self._peer_tls is None else self._peer_tls.not_trusted(exc, address)
        if untrusted is not None:
            log.warning("a forwarded %s was not sent: %s", method, untrusted.message)
            return "leader_untrusted", NotLeader(_LEADER_UNTRUSTED)
        log.warning("the leader did not answer a forwarded %s (%s)", method, type(exc).__name__)
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
            return "leader_unreachable", NotLeader(_LEADER_GONE)
        return "leader_lost", NotLeader(_LEADER_LOST)

    def _request_headers(self, scope: Scope, headers: list[tuple[bytes, bytes]], rid: str) -> list[tuple[bytes, bytes]]:
        """The end-to-end fields as the client sent them, and what the leader must know of it."""
        named = {n.strip().lower() for n in _header(headers, b"connection").encode().split(b",")}
        out = [(k, v) for k, v in headers if k not in _HOP_BY_HOP and k not in _SET_HERE and k not in named]
        client = scope.get("client")
        peer = client[0] if client else None
        secure = reached_over_https(
            scope.get("scheme", "http"), peer, _header(headers, b"x-forwarded-proto"), self._proxies
        )
        out.append((b"x-forwarded-proto", b"https" if secure else b"http"))
        if peer:
            before = _header(headers, b"x-forwarded-for")
            out = [(k, v) for k, v in out if k != b"x-forwarded-for"]
            out.append((b"x-forwarded-for", f"{before}, {peer}".encode() if before else peer.encode()))
        out.append((b"x-request-id", rid.encode()))
        out.append((_FORWARDED, self._controller_id.encode()))
        return out

    async def _rest(self, receive: Receive, first: bytes) -> AsyncIterator[bytes]:
        """The request body as it arrives (after `first`), within the body limit."""
        seen = len(first)
        if first:
            yield first
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _BodyRefused(None)
            chunk: bytes = message.get("body", b"")
            seen += len(chunk)
            if seen > self._limit:
                raise _BodyRefused(PayloadTooLarge(limit_bytes=self._limit))
            if chunk:
                yield chunk
            if not message.get("more_body"):
                return

    async def _relay(self, response: httpx.Response, send: Send, rid: str) -> None:
        if response.status_code < 400 and self._after_write is not None:
            with trio.move_on_after(CATCH_UP_S):
                try:
                    await self._after_write()
                except NexaError as exc:  # the write is done; only the read-back may lag
                    log.warning("catching up after a forwarded write failed (%s)", exc.code)
        named = {n.strip().lower().encode() for n in response.headers.get("connection", "").split(",")}
        headers = [
            (k.lower(), v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP and k.lower() not in named
        ]
        if not any(k == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", rid.encode()))
        headers.append((_FORWARDED, (self._leadership.leader_id or "").encode()))  # the lease's holder
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            # The answer began: a truncated body must not look whole, so the connection is cut.
            log.warning("the leader stopped in the middle of a forwarded answer (%s)", type(exc).__name__)
            self._count("answer_cut")
            raise Unavailable("the leader stopped in the middle of its answer; retry in a few seconds") from exc
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._count("ok")


_NO_LEADER: Final = (
    "no controller holds the leader's lease right now (an election is under way), so this change was "
    "not made: retry in a few seconds"
)
_LOOP: Final = (
    "this request was passed on already, and the controller it reached is not the leader either (the "
    "leadership is moving), so this change was not made: retry in a few seconds"
)
_LEADER_GONE: Final = (
    "the leader could not be reached, so this change was not made: retry in a few seconds, once another "
    "controller has taken the lease"
)
_PLAIN_REFUSED: Final = (
    "the leader is on another host and reachable only over plain http, which this controller does not "
    "forward writes over (its log says what to configure), so this change was not made"
)
_LEADER_UNTRUSTED: Final = (
    "the leader's https certificate is not trusted by this controller (its log says what to configure), "
    "so this change was not made"
)
_LEADER_LOST: Final = (
    "the leader stopped answering after it was sent this request, so the change may or may not have been "
    "made: check before retrying in a few seconds, or retry with the same Idempotency-Key"
)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return ""


async def _refuse(send: Send, rid: str, error: NexaError) -> None:
    """Answer `error` in the error envelope (503s with `Retry-After`), as the management app would."""
    status = status_for(error)
    body = ErrorEnvelope(
        error=ErrorBody(code=error.code, message=error.message, retryable=error.retryable, request_id=rid)
    )
    payload = codec.dumps(codec.api, body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"x-request-id", rid.encode()),
        (b"cache-control", b"no-store"),
    ]
    if status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
    log.info("request", extra={"fields": {"status": status, "route": "forward", "code": error.code, "request_id": rid}})
