"""The inference routes: OpenAI-compatible `/v1/*` and the canonical `/api/v1/workloads`, as plain ASGI.

These sit in front of the quart management app (`InferenceApp(fallback)`): every other path goes
to quart. Plain ASGI keeps the per-request cost of the hot path small and gives full control of
streaming and of the client going away: a request still running `WATCH_AFTER_S` (`disconnects`) after its body
arrived gets a task that waits for its `http.disconnect` and cancels the work (`Disconnects`, one
loop for all), and that cancellation travels through the relay to the runtime. Both APIs build one
`calls.Work` and run it through `Gateway.call`; a workload's terminal state and receipt come from
the call's outcome in `Workloads.end`.

OpenAI routes answer errors in OpenAI's shape (`{"error": {"message", "type", "code"}}`) with the
statuses of `control/http/common.py`, so the official SDKs raise their usual exceptions; the canonical
routes answer in nexa's error envelope. Request logs carry metadata only, never bodies. Each route
(its roles, bodies, headers and description) is declared once in `inference_routes`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final, NoReturn

import attrs
import trio

from nexa import supervision
from nexa.config import GatewayConfig, PriorityOverGrant
from nexa.contracts import codec, pages
from nexa.contracts.api import ErrorBody, ErrorEnvelope
from nexa.contracts.domain import Actor, ApiKey, TenantId
from nexa.contracts.gateway import (
    UNRESOLVED_MODEL,
    Api,
    Capability,
    OpenAIError,
    OpenAIErrorBody,
    Priority,
    SignedReceipt,
    WorkloadCreate,
    WorkloadList,
    WorkloadState,
    WorkloadView,
    body_problems,
    model_problem,
    request_sha256,
    workload_problems,
)
from nexa.contracts.node import data_class_problem
from nexa.contracts.retention import EPHEMERAL, retention_problem
from nexa.control.access.accounts import Accounts
from nexa.control.datapath import media, native
from nexa.control.datapath import messages as anthropic
from nexa.control.datapath.calls import Work
from nexa.control.datapath.disconnects import Disconnects
from nexa.control.datapath.gateway import Call, Gateway
from nexa.control.datapath.inference_routes import (
    CAPABILITY_ALIASES,
    DATA_CLASS_HEADER,
    DEADLINE_HEADER,
    INFERENCE_ROUTES,
    OVERHEAD_HEADER,
    PRIORITY_HEADER,
    RETENTION_HEADER,
    STORED_RULE,
)
from nexa.control.datapath.pins import Pins
from nexa.control.datapath.retention import Capture, Retention
from nexa.control.datapath.stored import STORED_ROUTES, StoredRoute
from nexa.control.datapath.translated import TRANSLATIONS, serve
from nexa.control.datapath.translation import Translation, param_of
from nexa.control.datapath.workloads import ActiveWorkload, Workloads
from nexa.control.http.common import (
    CLIENT_CLOSED,
    bearer_key,
    declares_body,
    method_label,
    new_request_id,
    status_for,
)
from nexa.errors import (
    BodyTimeout,
    Cancelled,
    ContractError,
    FieldNotSupported,
    Forbidden,
    MethodNotAllowed,
    NexaError,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PriorityNotGranted,
    RetentionUnavailable,
    Unauthenticated,
)
from nexa.telemetry import Children, Metrics, request_id

log = logging.getLogger(__name__)

# ASGI as hypercorn and quart type it is stricter than this module needs: plain dicts here.
Scope = Any
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
AsgiApp = Callable[[Any, Any, Any], Awaitable[None]]

_CAPABILITY_BY_PATH: Final = {c.path: c for c in Capability if not c.native} | CAPABILITY_ALIASES
_BARE_PATHS: Final = frozenset(p for p in _CAPABILITY_BY_PATH if not p.startswith("/v1/"))  # OpenAI's error shape
_WORKLOAD_PATH: Final = re.compile(r"^/api/v1/workloads/([^/]{1,256})(/cancel|/receipt)?$")
#: A stored response's own routes (`stored.STORED_ROUTES`), by method and the rest of the path.
_STORED_PATH: Final = re.compile(r"^/v1/responses/([^/]{1,256})(/cancel|/input_items)?$")
_STORED_ROUTES: Final = {(r.method.value, STORED_RULE + r.suffix): r for r in STORED_ROUTES}
_OVERHEAD_HEADER: Final = OVERHEAD_HEADER.encode()
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),
]
_OPENAI_TYPES: Final = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def _route(method: str, path: str) -> tuple[str, str] | None:
    """The route template of a request, or None when the path is not an inference route."""
    if (stored := _STORED_PATH.match(path)) is not None:
        return (method, STORED_RULE + (stored.group(2) or ""))
    if path.startswith("/v1/") or path in _BARE_PATHS:
        return (method, path)
    if path == "/api/v1/workloads":
        return (method, path)
    m = _WORKLOAD_PATH.match(path)
    if m is None:
        return None
    return (method, "/api/v1/workloads/<workload_id>" + (m.group(2) or ""))


class InferenceApp:
    """ASGI: the inference routes here, everything else to `fallback` (the quart app)."""

    def __init__(
        self,
        fallback: AsgiApp,
        *,
        cfg: GatewayConfig,
        gateway: Gateway,
        workloads: Workloads,
        accounts: Accounts,
        metrics: Metrics,
        pins: Pins,
        max_body_bytes: int,
        body_timeout_s: float = 60.0,
        retention: Retention | None = None,
    ) -> None:
        self._fallback = fallback
        self._cfg = cfg
        self._gateway = gateway
        self._workloads = workloads
        self._pins = pins
        self._accounts = accounts
        self._metrics = metrics
        # Bound once per (route, method, status), not per request.
        self._answered = Children(metrics.http_requests)
        self._seconds = Children(metrics.http_request_seconds)
        self._overhead = Children(metrics.gateway_overhead_seconds)
        self._max_body = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._retention = retention
        self.disconnects = Disconnects()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._fallback(scope, receive, send)
            return
        method = "GET" if scope["method"] == "HEAD" else scope["method"]
        route = _route(method, scope["path"])
        if route is None:
            await self._fallback(scope, receive, send)
            return
        await _Exchange(self, scope, receive, send, route).run()

    # ---- handlers (each returns the status it answered) ------------------------------------------------

    async def models(self, x: _Exchange) -> int:
        data = [
            {"id": m.id, "object": "model", "created": int(m.created), "owned_by": "nexa"}
            for m in self._gateway.served_models()
        ]
        return await x.json(200, {"object": "list", "data": data})

    async def openai(self, x: _Exchange, capability: Capability) -> int:
        body = _json_object(await x.body())
        model = body.pop("model", None)
        problem = model_problem(model)
        if problem is not None or not isinstance(model, str):
            raise ContractError(problem or "model: required", problems=(problem or "model: required",))
        stream = body.pop("stream", False)
        if not isinstance(stream, bool) or (stream and not capability.streams):
            raise ContractError(f"stream: true or false ({capability} answers do not stream)", problems=("stream",))
        options = body.get("stream_options")
        if options is not None and not stream:
            raise ContractError("stream_options: only with stream: true", problems=("stream_options",))
        if options is not None and (
            not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)
        ):
            raise ContractError("stream_options: an object; include_usage: true or false", problems=("stream_options",))
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        problems = body_problems(capability, body)
        if problems:
            raise ContractError("invalid request: " + "; ".join(problems), problems=tuple(problems))
        work = self._work(x, Api.OPENAI, capability, model, body, stream=stream, include_usage=include_usage)
        call = x.call = self._gateway.call(work)
        async with call as answer:
            if not stream:
                body_out = await answer.read_all()
                if answer.error is not None:
                    raise answer.error
                return await x.raw(200, body_out, b"application/json")
            await x.start_stream(200)
            async for chunk in answer:
                await x.chunk(chunk)
            if answer.error is not None:
                await x.chunk(_sse_data(_openai_error(answer.error, x.rid)))
            await x.chunk(b"", more=False)
            return 200

    async def translated(self, x: _Exchange, translation: Translation[Any] | None) -> int:
        """Another API's request, passed through (`native`) or as a chat completion and back (`translated`)."""
        body = _json_object(await x.body())
        passed = await native.passed(
            self._gateway, self._pins, x.route[1], body, translated=translation is not None, tenant=x.tenant
        )
        if passed is not None:
            work = self._work(x, *passed[:4], stream=passed.stream, include_usage=True)
            x.call = self._gateway.call(attrs.evolve(work, pin=passed.pin))
            remember = native.remembering(self._pins, x.tenant) if passed.stores else None
            return await native.serve(x, x.call, passed.capability, stream=passed.stream, remember=remember)
        assert translation is not None  # `passed` raised otherwise
        req = translation.to_chat(body)
        work = self._work(
            x, translation.api, Capability.CHAT, req.model, req.chat, stream=req.stream, include_usage=True
        )
        x.call = self._gateway.call(work)
        return await serve(x, x.call, translation, req)

    async def stored(self, x: _Exchange, route: StoredRoute, response_id: str) -> int:
        """A stored response's own route (`stored.STORED_ROUTES`): to the replica keeping it, with no
        body, answered as the runtime answers; counted as a request, metered in no tokens."""
        pin = await native.stored_pin(self._pins, x.tenant, route, response_id, x.query)
        work = self._work(x, Api.RESPONSES, Capability.RESPONSES, pin.model, {}, stream=False, include_usage=False)
        x.call = self._gateway.call(
            attrs.evolve(work, pin=pin.replica_id, route=native.stored_route(route, response_id))
        )
        return await native.serve(x, x.call, Capability.RESPONSES, stream=False)

    def _work(self, x: _Exchange, api: Api, cap: Capability, model: str, body: dict[str, Any], **how: bool) -> Work:
        """The call an OpenAI-shaped request makes (headers: retention, priority, deadline, data class)."""
        self._retain(x, x.header(RETENTION_HEADER) or EPHEMERAL, api)
        return Work(
            request_id=x.rid,
            api=api,
            tenant=x.tenant,
            key_id=x.key.id,
            capability=cap,
            model=model,
            body=body,
            priority=self._entitled(x.key, _priority(x.header(PRIORITY_HEADER))),
            deadline_at=self._deadline(x.header(DEADLINE_HEADER)),
            data_class=_data_class(x.header(DATA_CLASS_HEADER)),
            stream=how["stream"],
            include_usage=how["include_usage"],
        )

    async def submit(self, x: _Exchange) -> int:
        # Parsed strictly first (no NaN, bounded nesting), then structured: what the codec refuses is a 400.
        req = codec.structure(codec.api, _json_object(await x.body()), WorkloadCreate)
        problems = workload_problems(req)
        if problems:
            raise ContractError("invalid workload: " + "; ".join(problems), problems=tuple(problems))
        if req.stream and not req.capability.streams:
            raise FieldNotSupported(f"stream: {req.capability} answers do not stream; send false", field="stream")
        self._retain(x, req.retention, Api.WORKLOADS)
        digest = request_sha256(req)
        priority = self._entitled(x.key, req.admission_priority)
        if priority is not req.admission_priority:  # lowered ("lower"): stored and answered as run
            req = attrs.evolve(req, priority=priority, latency_class=None)
        # Reads only: a refusal from here to admission writes nothing to the store.
        stored = await self._workloads.lookup(x.tenant, req.idempotency_key, digest)
        if stored is not None:
            return await x.json(200, codec.api.unstructure(_view(stored, req)))
        now = time.time()
        deadline_at = self._deadline(None) if req.deadline_at is None else req.deadline_at
        if deadline_at > now + self._cfg.max_deadline_s:
            raise ContractError(
                f"deadline_at: at most {self._cfg.max_deadline_s:g} s from now", problems=("deadline_at",)
            )
        active = await self._workloads.begin(
            x.tenant, x.key.id, req, alias=req.model, accepted_at=now, request_sha256=digest
        )
        work = Work(
            request_id=x.rid,
            api=Api.WORKLOADS,
            tenant=x.tenant,
            key_id=x.key.id,
            capability=req.capability,
            model=req.model,
            body=dict(req.payload),
            stream=req.stream,
            include_usage=True,
            priority=req.admission_priority,
            deadline_at=deadline_at,
            workload_id=req.workload_id,
            data_class=req.data_class,
        )
        run = await self._run(x, active, work)
        view = _view(run.receipt, req)
        if run.streamed:
            if run.error is not None:
                await x.chunk(_sse_event("error", codec.dumps(codec.api, _envelope(run.error, x.rid)).encode()))
            await x.chunk(_sse_event("end", codec.dumps(codec.api, view).encode()), more=False)
            return 200
        if run.error is not None:
            raise run.error
        parsed = json.loads(run.output) if run.output else None
        return await x.json(200, codec.api.unstructure(_with_output(view, parsed)))

    async def _run(self, x: _Exchange, active: ActiveWorkload, work: Work) -> _Run:
        """Run a workload under its cancel scope (`POST …/cancel`); its receipt is written whatever happens."""
        run = _Run()
        call: Call | None = None
        try:
            # The workload is written to the store once admitted, not before (see Workloads.record).
            call = x.call = self._gateway.call(work, admitted=partial(self._workloads.record, active))
            with active.scope:
                async with call as answer:
                    active.set_state(WorkloadState.STREAMING if work.stream else WorkloadState.RUNNING)
                    if work.stream:
                        await x.start_stream(200)
                        run.streamed = True
                        async for chunk in answer:
                            await x.chunk(chunk)
                    else:
                        run.output = await answer.read_all()
                    run.error = answer.error
            if active.scope.cancelled_caught:
                run.error = Cancelled("the workload was cancelled")
        except NexaError as exc:
            run.error = exc
        except BaseException:
            run.error = Cancelled("the client went away")
            raise
        finally:
            # Runs even when the client went away: the store write is shielded (bounded) there.
            run.receipt = await self._workloads.end(active, call.outcome if call is not None else None, run.error)
        return run

    async def list_workloads(self, x: _Exchange) -> int:
        """A page of the caller's tenant's workloads (`contracts.pages`), oldest accepted first."""
        after, limit = pages.from_query("workloads", (float, str), x.query("cursor"), x.query("limit"))
        views = await self._workloads.page(
            x.tenant, None if after is None else (float(after[0]), str(after[1])), limit + 1
        )
        views, last = pages.cut(views, limit, lambda v: (v.accepted_at, v.workload_id))
        next_cursor = None if last is None else pages.encode_cursor("workloads", last)
        return await x.json(200, codec.api.unstructure(WorkloadList(workloads=views, next_cursor=next_cursor)))

    async def status(self, x: _Exchange, workload_id: str) -> int:
        return await x.json(200, codec.api.unstructure(await self._workloads.status(x.tenant, workload_id)))

    async def cancel(self, x: _Exchange, workload_id: str) -> int:
        await self._workloads.cancel(x.tenant, workload_id)
        await trio.lowlevel.checkpoint()  # let the cancelled workload record its end
        return await x.json(202, codec.api.unstructure(await self._workloads.status(x.tenant, workload_id)))

    async def receipt(self, x: _Exchange, workload_id: str) -> int:
        return await x.json(200, codec.api.unstructure(await self._workloads.receipt(x.tenant, workload_id)))

    def _retain(self, x: _Exchange, retention: str, api: Api) -> None:
        """Capture the request and what it is answered (`control.datapath.retention`) when it names a policy
        its tenant may use; the typed refusal (nothing kept, nothing run) otherwise."""
        if retention == EPHEMERAL:
            return
        if (problem := retention_problem(retention)) is not None:
            raise ContractError(f"{RETENTION_HEADER}: {problem}", problems=(problem,))
        if self._retention is None:
            raise RetentionUnavailable(f"retention {retention}: this controller keeps nothing; send ephemeral")
        x.capture = self._retention.capture(x.tenant, retention, x.rid, api.value, x.body_read())

    def _entitled(self, key: ApiKey, asked: Priority) -> Priority:
        """The class a request asking for `asked` runs at: `asked` when the key is granted it; else
        PriorityNotGranted, or (`priority_over_grant = "lower"`) the highest granted class below it
        (the lowest granted when none is below)."""
        granted = key.granted
        if asked in granted:
            return asked
        if self._cfg.priority_over_grant is PriorityOverGrant.REFUSE:
            raise PriorityNotGranted(
                f"priority {asked.value}: this key may ask for "
                + ", ".join(p.value for p in granted)
                + "; send one of those, or have an admin create a key granted it (nexa keys create --priorities)"
            )
        below = [p for p in granted if p.rank > asked.rank]
        return min(below, key=lambda p: p.rank) if below else max(granted, key=lambda p: p.rank)

    def _deadline(self, header: str | None) -> float:
        now = time.time()
        if header is None:
            return now + self._cfg.default_deadline_s
        # ASCII digits, and few: headers decode as latin-1, where "²".isdigit() is true and int()
        # refuses it, as it does thousands of digits (both were a 500, found by the OpenAPI fuzzer).
        digits = header.isascii() and header.isdigit() and len(header) <= 15
        if not digits or not 0 < int(header) <= self._cfg.max_deadline_s * 1000:
            raise ContractError(
                f"{DEADLINE_HEADER}: milliseconds from now, 1 to {int(self._cfg.max_deadline_s * 1000)}",
                problems=(DEADLINE_HEADER,),
            )
        return now + int(header) / 1000.0


class _Exchange:
    """One HTTP request/response on the inference routes."""

    def __init__(self, app: InferenceApp, scope: Scope, receive: Receive, send: Send, route: tuple[str, str]) -> None:
        self._app = app
        self._scope = scope
        self._receive = receive
        self._send = send
        self.route = route
        self.openai = route[1].startswith("/v1/") or route[1] in _BARE_PATHS
        self.anthropic = route[1].startswith(anthropic.MESSAGES_PATH)
        self._headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.rid = new_request_id(self._headers.get("x-request-id", ""))
        #: trio clock time the request arrived (its overhead counts from here).
        self._arrived = trio.current_time()
        #: The gateway call made for it, if any (its response head says the call's overhead).
        self.call: Call | None = None
        self.key: ApiKey
        self.tenant: TenantId
        self._started_response = False
        self._bytes_in = 0
        #: What this request asked to keep (`control.datapath.retention`): its answer is added as it is sent.
        self.capture: Capture | None = None

    def header(self, name: str) -> str | None:
        return self._headers.get(name)

    def query(self, name: str) -> str | None:
        """The first value of query parameter `name` (percent-decoded), or None when it is left out."""
        raw = self._scope.get("query_string", b"").decode("latin-1")
        values = urllib.parse.parse_qs(raw, keep_blank_values=True).get(name)
        return values[0] if values else None

    async def run(self) -> None:
        request_id.set(self.rid)
        app = self._app
        started = time.perf_counter()
        status = 500
        app._metrics.http_in_flight.inc()
        try:
            try:
                await self._authorize()
                status = await self._dispatch()
            except NexaError as exc:
                status = await self._error(exc)
            except _ClientGone:
                status = CLIENT_CLOSED
            except Exception as exc:
                # Last resort: a bug still answers in the error envelope, never as a bare 500. The
                # type and place only: an exception's message may quote the request.
                log.error("request failed unexpectedly: %s", supervision.kinds(exc))  # noqa: TRY400
                status = await self._error(NexaError("internal error"))
            except trio.Cancelled:
                status = CLIENT_CLOSED
                raise
        finally:
            if self.capture is not None:  # kept once answered in full; else nothing is
                self.capture.keep() if status == 200 else self.capture.drop()
            app._metrics.http_in_flight.dec()
            elapsed = time.perf_counter() - started
            route = self.route[1] if self.route in INFERENCE_ROUTES else "unmatched"
            method = method_label(self.route[0])
            app._answered(route, method, str(status)).inc()
            app._seconds(route, method).observe(elapsed)
            log.info(
                "request",
                extra={
                    "fields": {
                        "method": self.route[0],
                        "route": route,
                        "status": status,
                        "ms": round(elapsed * 1000, 3),
                        "bytes_in": self._bytes_in,
                        "actor": getattr(self, "key", None) and self.key.id,
                    }
                },
            )

    async def _authorize(self) -> None:
        app = self._app
        roles = INFERENCE_ROUTES.get(self.route)
        if roles is None:
            allowed = tuple(sorted(m for m, rule in INFERENCE_ROUTES if rule == self.route[1]))
            raise MethodNotAllowed(allowed) if allowed else _no_route(self.route)
        authorization = self._headers.get("authorization", "")
        if self.anthropic and not authorization and (api_key := self._headers.get("x-api-key")):
            authorization = "Bearer " + api_key
        how = "x-api-key: <key> (or Authorization: Bearer <key>)" if self.anthropic else "Authorization: Bearer <key>"
        key = bearer_key(authorization, app._accounts, app._metrics, how=how)
        self.key = key
        if key.role not in roles or key.tenant is None:
            app._metrics.auth_failures.labels("forbidden").inc()
            reason = (
                f"role {key.role} may not call this route"
                if key.role not in roles
                else "inference keys must belong to a tenant"
            )
            if self.route[0] != "GET":
                actor = Actor(key_id=key.id, role=key.role, tenant=key.tenant)
                await app._accounts.record_denied(
                    actor, f"{self.route[0]} {self.route[1]}", self._scope["path"], reason
                )
            raise Forbidden(reason)
        self.tenant = key.tenant

    async def _dispatch(self) -> int:
        app = self._app
        method, rule = self.route
        if method == "POST":
            await self.body()  # read it all first: what arrives after it can only be a disconnect
        status = CLIENT_CLOSED  # unless the handler returns: the client went away and cancelled it
        with trio.CancelScope() as scope:
            watched = app.disconnects.watch(self._receive, scope)
            try:
                status = await self._handle(app, method, rule)
            finally:
                app.disconnects.forget(watched)
        return status

    async def _handle(self, app: InferenceApp, method: str, rule: str) -> int:  # noqa: PLR0911 - one per route kind
        if rule in media.CAPABILITY_BY_PATH:
            return await media.serve(app, self, media.CAPABILITY_BY_PATH[rule])
        if (stored := _STORED_ROUTES.get((method, rule))) is not None:
            return await app.stored(self, stored, self._scope["path"].split("/")[3])
        if rule in native.NATIVE or rule == "/v1/models":
            return await (app.models(self) if rule == "/v1/models" else app.translated(self, TRANSLATIONS.get(rule)))
        if rule in _CAPABILITY_BY_PATH:
            return await app.openai(self, _CAPABILITY_BY_PATH[rule])
        if rule == "/api/v1/workloads":
            return await (app.submit(self) if method == "POST" else app.list_workloads(self))
        workload_id = self._scope["path"].split("/")[4]
        if rule.endswith("/cancel"):
            return await app.cancel(self, workload_id)
        if rule.endswith("/receipt"):
            return await app.receipt(self, workload_id)
        return await app.status(self, workload_id)

    _body: bytes | None = None

    async def body(self) -> bytes:
        if self._body is not None:
            return self._body
        parts: list[bytes] = []
        size = 0
        limit = media.upload_limit(self.route[1], self._app._cfg.max_upload_bytes, self._app._max_body)
        with trio.move_on_after(self._app._body_timeout_s) as waiting:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(limit_bytes=limit)
                parts.append(chunk)
                if not message.get("more_body"):
                    break
        if waiting.cancelled_caught:
            raise BodyTimeout(timeout_s=self._app._body_timeout_s)
        self._bytes_in = size
        self._body = b"".join(parts)
        return self._body

    def body_read(self) -> bytes:
        return self._body or b""

    # ---- answering

    async def raw(
        self, status: int, payload: bytes, content_type: bytes, headers: list[tuple[bytes, bytes]] | None = None
    ) -> int:
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(payload)).encode()),
                    (b"x-request-id", self.rid.encode()),
                    (b"cache-control", b"no-store"),
                    self._overhead_header(),
                    *(headers or ()),
                ],
            }
        )
        self._started_response = True
        if self.capture is not None:
            self.capture.add(payload)
        await self._send({"type": "http.response.body", "body": payload, "more_body": False})
        return status

    async def json(self, status: int, obj: object) -> int:
        payload = json.dumps(obj, separators=(",", ":")).encode()
        return await self.raw(status, payload, b"application/json")

    async def start_stream(self, status: int, *, content_type: bytes | None = None) -> None:
        """Start a streamed response: server-sent events, or bytes of `content_type` (media)."""
        kind = _SSE_HEADERS
        if content_type is not None:
            kind = [(b"content-type", content_type), (b"cache-control", b"no-store")]
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*kind, (b"x-request-id", self.rid.encode()), self._overhead_header()],
            }
        )
        self._started_response = True

    def _overhead_header(self) -> tuple[bytes, bytes]:
        """`x-nexa-overhead-ms` of the response head written now: the call's (`Progress.overhead_ms`),
        observed in `nexa_gateway_overhead_seconds` once a call; without a call (refused before one
        was made, a read route) all the time since arrival, which was nexa's."""
        now = trio.current_time()
        call = self.call
        if call is None:
            ms = (now - self._arrived) * 1000.0
        else:
            progress = call.progress
            ms = progress.overhead_ms(self._arrived, now)
            # The model label as the other gateway metrics: the alias, never a name that did not resolve.
            self._app._overhead(progress.alias if progress.model is not None else UNRESOLVED_MODEL).observe(ms / 1000)
        return (_OVERHEAD_HEADER, b"%.2f" % ms)

    async def chunk(self, data: bytes, *, more: bool = True) -> None:
        if self.capture is not None:
            self.capture.add(data)
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def _error(self, exc: NexaError) -> int:
        status = status_for(exc)
        if status >= 500:
            log.warning("request failed: %s", exc.code)
        if self._started_response:
            return status  # a stream already answered 200; its error went in-band
        headers: list[tuple[bytes, bytes]] = []
        if isinstance(exc, Overloaded):
            headers.append((b"retry-after", str(max(1, round(exc.retry_after_s))).encode()))
        if isinstance(exc, Unauthenticated):
            headers.append((b"www-authenticate", b'Bearer realm="nexa"'))
        if isinstance(exc, MethodNotAllowed):
            headers.append((b"allow", ", ".join(exc.allowed).encode()))  # RFC 9110 §15.5.6
        if self._body is None and declares_body(self._headers):
            # Answered from the head: the unread body ends this connection (see `http.BodyLimit`).
            headers.append((b"connection", b"close"))
        if self.anthropic:
            body = codec.dumps(codec.api, anthropic.error_body(exc, self.rid)).encode()
        elif self.openai:
            body = codec.dumps(codec.api, _openai_error(exc, self.rid)).encode()
        else:
            body = codec.dumps(codec.api, _envelope(exc, self.rid)).encode()
        return await self.raw(status, body, b"application/json", headers)


@attrs.define
class _Run:
    streamed: bool = False
    output: bytes | None = None
    error: NexaError | None = None
    receipt: SignedReceipt = attrs.field(init=False)


class _ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


def _no_route(route: tuple[str, str]) -> NexaError:
    return NotFound(f"no route {route[0]} {route[1]}")


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; strict: NaN, Infinity and numbers beyond a float's range are
    refused (JSON has none of them), and so is nesting deep enough to exhaust the parser."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ContractError("the body is not valid JSON", problems=("(body): invalid JSON",)) from None
    if not isinstance(body, dict):
        raise ContractError("the body must be a JSON object", problems=("(body): not an object",))
    return body


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a number beyond a float's range")
    return value


def _data_class(value: str | None) -> str | None:
    if value is None:
        return None
    problem = data_class_problem(value)
    if problem is not None:
        raise ContractError(f"{DATA_CLASS_HEADER}: {problem}", problems=(DATA_CLASS_HEADER,))
    return value


def _priority(value: str | None) -> Priority:
    if value is None:
        return Priority.STANDARD
    try:
        return Priority(value)
    except ValueError:
        raise ContractError(
            f"{PRIORITY_HEADER}: one of " + ", ".join(p.value for p in Priority), problems=(PRIORITY_HEADER,)
        ) from None


def _openai_error(exc: NexaError, rid: str) -> OpenAIError:
    status = status_for(exc)
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = OpenAIErrorBody(message=f"{exc.message} (request {rid})", type=kind, code=exc.code, param=param_of(exc))
    return OpenAIError(error=body)


def _envelope(exc: NexaError, rid: str) -> ErrorEnvelope:
    return ErrorEnvelope(error=ErrorBody(code=exc.code, message=exc.message, retryable=exc.retryable, request_id=rid))


def _sse_data(obj: object) -> bytes:
    return b"data: " + codec.dumps(codec.api, obj).encode() + b"\n\n"


def _sse_event(event: str, data: bytes) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


def _view(signed: SignedReceipt, req: WorkloadCreate) -> WorkloadView:
    return WorkloadView.from_receipt(signed, model=req.model, priority=req.admission_priority)


def _with_output(view: WorkloadView, output: object) -> WorkloadView:
    return attrs.evolve(view, output=output if isinstance(output, dict) else None)
