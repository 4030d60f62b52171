"""The management HTTP API (`/api/v1`, `/healthz`, `/readyz`, `/version`, `/metrics`): a quart-trio app.

`routes.ROUTE_ROLES` is the one table of routes and the roles that may call each (`_authorize` checks it
before any handler runs; a route missing from it is refused). `_Handlers` has one method per route,
named after it (`get_nodes_by_node_id`), each a thin adapter: decode the body or query with
`contracts.codec`, call the component that owns the state (the store only for audit reads), encode
the answer. Lists page with `?cursor=&limit=` (`contracts.pages`). Errors: the nexa envelope
(`control.http.common`). Console pages and, in front, inference routes: `control.console`, `.inference`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Final

import attrs
import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from nexa import __version__, security
from nexa.config import HttpConfig
from nexa.contracts import codec, pages
from nexa.contracts.api import (
    AuditCheckpoint,
    AuditPage,
    AuditVerifyRequest,
    ClusterView,
    EnrollmentTokenCreate,
    EnrollmentTokenCreated,
    EnrollRequest,
    EnrollResponse,
    ErrorBody,
    ErrorEnvelope,
    Health,
    KeyCreate,
    KeyCreated,
    KeyList,
    KeyRotate,
    KeyRotated,
    KeyView,
    NodeList,
    NodeView,
    Readiness,
    ReceiptPublicKey,
    TenantCreate,
    TenantList,
    TenantView,
    VersionInfo,
)
from nexa.contracts.backup import BackupList
from nexa.contracts.deployments import CanaryCreate, DeploymentCreate, DeploymentList, RoutingWeights, ScaleRequest
from nexa.contracts.domain import Actor, ApiKey, KeyId, NodeState, Tenant, TenantId
from nexa.contracts.gateway import QuotaLimits
from nexa.contracts.models import (
    AliasDetail,
    AliasList,
    AliasPromote,
    EvaluationCreate,
    EvaluationResult,
    LicenseSet,
    ModelCreate,
    ModelDetail,
    ModelList,
    ModelState,
    RuntimeCreate,
    RuntimeList,
    RuntimeRegistered,
    VerifyRequest,
)
from nexa.control import console
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.cluster.leadership import Leadership
from nexa.control.datapath.admission import Admission
from nexa.control.datapath.metering import Meter
from nexa.control.datapath.quotas import Quotas
from nexa.control.datapath.retention import Retention
from nexa.control.deployments import Deployments
from nexa.control.deployments.scheduler import image_platform_warnings
from nexa.control.fleet import grants
from nexa.control.fleet.keyring import KeyRotation
from nexa.control.fleet.nodes import Fleet, NodeLive
from nexa.control.http.api_io import actor as _actor
from nexa.control.http.api_io import body as _body
from nexa.control.http.api_io import json_response as _json
from nexa.control.http.api_io import next_cursor as _next_cursor
from nexa.control.http.api_io import page as _page
from nexa.control.http.api_records import RecordHandlers
from nexa.control.http.api_retention import RetentionHandlers
from nexa.control.http.common import BodyLimit, bearer_key, method_label, new_request_id, status_for
from nexa.control.http.routes import ROUTE_ROLES
from nexa.control.operations.backup import Backups
from nexa.control.operations.benchmarks import Benchmarks
from nexa.control.operations.evidence import Evidence
from nexa.control.operations.jobs import Jobs
from nexa.control.operations.qualification import Qualifications
from nexa.control.operations.recovery import Recovery
from nexa.control.registry.models import ModelRegistry
from nexa.errors import (
    REENROLL_HINT,
    BadSignature,
    CheckpointRejected,
    ContractError,
    Forbidden,
    NexaError,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Recovering,
    Unauthenticated,
    Unavailable,
)
from nexa.security import SigningKey, sign_audit_checkpoint, verify_audit_checkpoint
from nexa.telemetry import METRICS_CONTENT_TYPE, Metrics, request_id

log = logging.getLogger(__name__)


_HTTP_ERRORS: Final = {
    400: ("invalid_request", "the request is malformed"),
    404: ("not_found", "no such route"),
    405: ("method_not_allowed", "this route does not take that method"),
    408: ("request_timeout", "the request body did not arrive in time ([http] body_timeout_s); send it again"),
}


@attrs.frozen(kw_only=True)
class ControllerPublicKeys:
    """What nodes pin at enrollment: Ed25519 (base64) and CurveZMQ (Z85) public keys."""

    signing: str
    curve: str

    @property
    def fingerprint(self) -> str:
        """What enrollment tokens carry and nodes check (`security.controller_fingerprint`)."""
        return security.controller_fingerprint(self.signing, self.curve)


@attrs.define(kw_only=True)
class AppState:
    """What the app needs from the composition root."""

    accounts: Accounts
    fleet: Fleet
    models: ModelRegistry
    deployments: Deployments
    store: st.Store
    metrics: Metrics
    started_at: float
    controller_keys: ControllerPublicKeys
    #: The controller's Ed25519 key (the private half of `controller_keys.signing`): signs audit checkpoints.
    signing_key: SigningKey
    quotas: Quotas
    meter: Meter
    admission: Admission
    ready: bool = False
    #: This controller's role in its cluster (`control.cluster.leadership`); None: the only one (tests).
    leadership: Leadership | None = None
    #: `GET /api/v1/openapi.json`'s answer (`control/http/openapi.py`, built by the composition root).
    openapi: bytes = b""
    #: `nodes.max_clock_skew_s`, reported by `GET /version` for `nexa node doctor`.
    max_clock_skew_s: float = 30.0
    #: The controller's recovery (`control.operations.recovery`); None: it never recovers (tests).
    recovery: Recovery | None = None
    #: `/api/v1/backups` (nexa.control.operations.backup); None: refused as backup_not_configured.
    backups: Backups | None = None
    key_rotation: KeyRotation | None = None  # `control.fleet.keyring`; None: keys never rotate (tests)
    benchmarks: Benchmarks | None = (
        None  # `control.operations.benchmarks`, `.jobs`, `.evidence`: None (tests) answers 404
    )
    jobs: Jobs | None = None
    evidence: Evidence | None = None
    #: `control.operations.qualification`; None (tests): its routes answer 404.
    qualifications: Qualifications | None = None
    #: `control.datapath.retention`; None (tests): its routes answer 404.
    retention: Retention | None = None


def create_app(cfg: HttpConfig, state: AppState) -> QuartTrio:
    app = QuartTrio("nexa.control", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["BODY_TIMEOUT"] = cfg.body_timeout_s
    app.config["RESPONSE_TIMEOUT"] = None
    handlers = _Handlers(state)
    app.asgi_app = BodyLimit(app.asgi_app, cfg.max_body_bytes)  # type: ignore[method-assign]

    for (method, rule), _roles in ROUTE_ROLES.items():
        view = getattr(handlers, _view_name(method, rule))
        app.add_url_rule(
            rule,
            endpoint=f"{method} {rule}",
            view_func=view,
            methods=[method],
            provide_automatic_options=False,
        )
    # The console's pages answer to its own session cookie; its actions check these same roles.
    console.register(app, state, ROUTE_ROLES, trusted_proxies=cfg.trusted_proxies)

    @app.before_request
    async def _begin() -> None:
        rid = new_request_id(request.headers.get("X-Request-Id", ""))
        request_id.set(rid)
        g.request_id = rid
        g.started = time.perf_counter()
        length = request.content_length
        if length is not None and length > cfg.max_body_bytes:
            raise PayloadTooLarge(limit_bytes=cfg.max_body_bytes)
        await _authorize(state)
        if state.recovery is not None and state.recovery.refuses(request.method, request.url_rule):
            raise Recovering()  # before the handler: nothing is read from the body, nothing changes

    @app.after_request
    async def _finish(response: Response) -> Response:
        rid = getattr(g, "request_id", None) or request_id.get() or ""
        response.headers["X-Request-Id"] = rid
        response.headers.setdefault("Cache-Control", "no-store")
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        elapsed = time.perf_counter() - getattr(g, "started", time.perf_counter())
        method = method_label(request.method)
        state.metrics.http_requests.labels(route, method, str(response.status_code)).inc()
        state.metrics.http_request_seconds.labels(route, method).observe(elapsed)
        log.info(
            "request",
            extra={
                "fields": {
                    "method": request.method,
                    "route": route,
                    "status": response.status_code,
                    "ms": round(elapsed * 1000, 3),
                    "bytes_in": request.content_length or 0,
                    "actor": getattr(g, "actor_key_id", None),
                }
            },
        )
        return response

    @app.errorhandler(NexaError)
    async def _nexa_error(exc: NexaError) -> Response:
        return _error_response(exc)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if status == 413:
            return _error_response(PayloadTooLarge(limit_bytes=cfg.max_body_bytes))
        code, message = _HTTP_ERRORS.get(status, ("http_error", f"HTTP {status}"))
        response = _envelope(status, code, message, retryable=False)
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            response.headers["Allow"] = ", ".join(sorted(exc.valid_methods))  # RFC 9110 §15.5.6
        return response

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc)
        return _envelope(500, "internal", "internal error", retryable=True)

    return app


def _view_name(method: str, rule: str) -> str:
    """`GET /api/v1/nodes/<node_id>` → `get_nodes_by_node_id`; the handler method of that name serves it."""
    parts = [f"by_{p[1:-1]}" if p.startswith("<") else p for p in rule.strip("/").split("/") if p not in {"api", "v1"}]
    return "_".join([method.lower(), *parts]).replace("-", "_").replace(".", "_")


async def _authorize(state: AppState) -> None:
    rule = request.url_rule
    if rule is None:
        return  # 404/405 follow; nothing to protect
    method = "GET" if request.method == "HEAD" else request.method
    if (method, rule.rule) in console.CONSOLE_ROUTES:
        return  # the console authenticates by its session (nexa.control.console)
    roles = ROUTE_ROLES.get((method, rule.rule), frozenset())
    if roles is None:
        return
    key = bearer_key(request.headers.get("Authorization", ""), state.accounts, state.metrics)
    g.actor = Actor(key_id=key.id, role=key.role, tenant=key.tenant)
    g.actor_key_id = key.id
    if key.role not in roles:
        state.metrics.auth_failures.labels("forbidden").inc()
        if method not in {"GET", "HEAD"}:
            await state.accounts.record_denied(
                g.actor, f"{method} {rule.rule}", request.path, f"role {key.role} may not call this route"
            )
        raise Forbidden(f"role {key.role} may not call {method} {rule.rule}")


def _error_response(exc: NexaError) -> Response:
    status = status_for(exc)
    response = _envelope(status, exc.code, exc.message, retryable=exc.retryable)
    if isinstance(exc, Overloaded):
        response.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if isinstance(exc, Unauthenticated):
        response.headers["WWW-Authenticate"] = 'Bearer realm="nexa"'
    if status >= 500:
        log.warning("request failed: %s", exc.code)
    return response


def _envelope(status: int, code: str, message: str, *, retryable: bool) -> Response:
    rid = request_id.get() or ""
    body = ErrorEnvelope(error=ErrorBody(code=code, message=message, retryable=retryable, request_id=rid))
    return _json(body, status)


async def _optional_body(cls: type[codec.T]) -> codec.T:
    """A body that may be left out: none (or `{}`) means every field's default."""
    raw = await request.get_data(as_text=False)
    return codec.loads(codec.api, raw, cls) if raw.strip() else cls()


async def _no_body() -> None:
    raw = await request.get_data(as_text=False)
    if raw.strip() and codec.loads(codec.api, raw, dict[str, object]):
        raise ContractError("this route takes no body (or an empty object)", problems=("(body): must be empty",))


def _key_view(key: ApiKey) -> KeyView:
    return KeyView(
        id=key.id,
        name=key.name,
        role=key.role,
        tenant=key.tenant,
        created_at=key.created_at,
        created_by=key.created_by,
        revoked_at=key.revoked_at,
        expires_at=key.expires_at,
        rotated_to=key.rotated_to,
        priorities=list(key.granted),
    )


def _tenant_view(t: Tenant) -> TenantView:
    return TenantView(id=t.id, display_name=t.display_name, created_at=t.created_at)


def _query_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    # ASCII digits only ("²".isdigit() is true, and int() refuses it), and few of them: int() of
    # thousands of digits raises ValueError (found by the OpenAPI fuzzer).
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(hi)) or not lo <= int(raw) <= hi:
        raise ContractError(f"query {name} must be an integer from {lo} to {hi}", problems=(f"{name}: out of range",))
    return int(raw)


def _query_float(name: str) -> float | None:
    raw = request.args.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # `nan` and `inf` parse, and then cannot be answered in JSON
        raise ContractError(f"query {name} must be a number (unix seconds)", problems=(f"{name}: not a number",))
    return value


class _Handlers(RecordHandlers, RetentionHandlers):
    """One method per route; names derive from the route table (`post_keys` for POST /api/v1/keys)."""

    _s: AppState

    def __init__(self, state: AppState) -> None:
        self._s = state

    def _epoch(self) -> int:
        """The epoch this controller signs with: its leadership's (leased: the lease's; solo: the store's)."""
        lead = self._s.leadership
        return lead.epoch if lead is not None else self._s.store.epoch

    async def get_healthz(self) -> Response:
        return _json(Health(status="ok"))

    async def get_readyz(self) -> Response:
        if not self._s.ready:
            raise Unavailable("the controller is starting or stopping")
        # Recovering serves reads and inference: ready for traffic, and it says so.
        recovering = self._s.recovery is not None and self._s.recovery.active
        lead, status = self._s.leadership, "recovering" if recovering else "ready"
        if lead is None:
            return _json(Readiness(status=status, epoch=self._s.store.epoch if self._s.store is not None else 0))
        return _json(Readiness(status=status, role=lead.role, epoch=lead.epoch, lease_age_s=lead.lease_age_s))

    async def get_cluster(self) -> Response:
        lead = self._s.leadership
        if lead is None:
            raise Unavailable("this controller runs without a leadership (a test's app)")
        view: ClusterView = await lead.view()
        return _json(view)

    async def get_version(self) -> Response:
        return _json(
            VersionInfo(
                version=__version__,
                epoch=self._epoch(),
                started_at=self._s.started_at,
                controller_fingerprint=self._s.controller_keys.fingerprint,
                now=time.time(),
                max_clock_skew_s=self._s.max_clock_skew_s,
                recovering=self._s.recovery is not None and self._s.recovery.active,
            )
        )

    async def get_openapi_json(self) -> Response:
        if not self._s.openapi:
            raise Unavailable("no OpenAPI document was built")
        return Response(self._s.openapi, status=200, content_type="application/json")

    async def get_metrics(self) -> Response:
        for role, count in self._s.accounts.active_keys_by_role().items():
            self._s.metrics.api_keys.labels(role.value).set(count)
        # The fleet's figures are read here, on the loop; the text (long with a large fleet) is
        # written on a worker thread, so a scrape never stalls the data path.
        fleet = self._s.fleet.figures()
        body = await trio.to_thread.run_sync(self._s.metrics.render, fleet)
        return Response(body, status=200, content_type=METRICS_CONTENT_TYPE)

    async def post_keys(self) -> Response:
        req = await _body(KeyCreate)
        secret, key = await self._s.accounts.create_key(_actor(), req)
        return _json(KeyCreated(key=secret, info=_key_view(key)), 201)

    async def get_keys(self) -> Response:
        after, limit = _page("keys", (float, str))
        keys, last = pages.page_of(self._s.accounts.api_keys(), lambda k: (k.created_at, k.id), after, limit)
        return _json(KeyList(keys=[_key_view(k) for k in keys], next_cursor=_next_cursor("keys", last)))

    async def get_keys_by_key_id(self, key_id: str) -> Response:
        return _json(_key_view(self._s.accounts.api_key(KeyId(key_id))))

    async def post_keys_by_key_id_rotate(self, key_id: str) -> Response:
        req = await _optional_body(KeyRotate)
        secret, successor, old = await self._s.accounts.rotate_key(_actor(), KeyId(key_id), req)
        return _json(KeyRotated(key=secret, info=_key_view(successor), previous=_key_view(old)), 201)

    async def delete_keys_by_key_id(self, key_id: str) -> Response:
        key = await self._s.accounts.revoke_key(_actor(), KeyId(key_id))
        return _json(_key_view(key))

    async def post_tenants(self) -> Response:
        req = await _body(TenantCreate)
        tenant = await self._s.accounts.create_tenant(_actor(), req)
        return _json(_tenant_view(tenant), 201)

    async def get_tenants(self) -> Response:
        after, limit = _page("tenants", (str,))
        tenants, last = pages.page_of(self._s.accounts.tenants(), lambda t: (t.id,), after, limit)
        return _json(TenantList(tenants=[_tenant_view(t) for t in tenants], next_cursor=_next_cursor("tenants", last)))

    async def get_audit(self) -> Response:
        after, limit = _page("audit", (int,))
        legacy = request.args.get("after")  # deprecated alias: the seq of the last event seen, or a cursor
        if legacy is not None:
            if after is not None:
                raise ContractError("send cursor, or the deprecated after, not both", problems=("after",))
            digits = legacy.isascii() and legacy.isdigit()
            after = (
                (_query_int("after", 0, 0, 2**62),) if digits else pages.decode_cursor("audit", legacy, (int,), "after")
            )
        q = st.AuditQuery(
            after_seq=0 if after is None else int(after[0]),
            limit=limit + 1,
            action=request.args.get("action"),
            actor_key_id=request.args.get("actor"),
            target=request.args.get("target"),
            since=_query_float("since"),
            until=_query_float("until"),
        )
        events, last = pages.cut(await self._s.store.read(st.list_audit, q), limit, lambda e: (e.seq,))
        return _json(AuditPage(events=events, next_cursor=_next_cursor("audit", last)))

    async def post_audit_verify(self) -> Response:
        """Recompute the chain on the read-only connection (writes go on meanwhile); with
        `against`, also check a signed checkpoint (`nexa audit head`) still holds."""
        req = await _optional_body(AuditVerifyRequest)
        checkpoint = None
        if req.against is not None:
            # Signed by the current key, or by one it rotated away from (its public half is kept).
            rotation, pub = self._s.key_rotation, self._s.signing_key.public
            keys = rotation.keys.verifying_keys() if rotation else {pub.fingerprint: pub}
            embedded = req.against.public_key.strip()
            signer = next((k for k in keys.values() if k.b64 == embedded), pub)
            try:
                verify_audit_checkpoint(signer, req.against)
            except BadSignature as exc:
                raise CheckpointRejected(f"the checkpoint is not this controller's: {exc.message}") from None
            checkpoint = req.against.checkpoint
        verdict = await self._s.store.read(st.verify_audit, checkpoint)
        return _json(verdict)

    async def get_audit_head(self) -> Response:
        """The chain's head (seq, sha256), signed with the controller's Ed25519 key: keep it, and
        `nexa audit verify --against` it later to detect a chain rebuilt after it."""
        seq, sha256 = await self._s.store.read(st.audit_head)
        checkpoint = AuditCheckpoint(seq=seq, sha256=sha256, at=time.time(), epoch=self._epoch())
        return _json(sign_audit_checkpoint(self._s.signing_key, checkpoint))

    # ---- usage, quotas and receipts ------------------------------------------------------------------

    async def get_usage(self) -> Response:
        """Usage by tenant, model and UTC day; `?format=csv` for a CSV file. Default: the last 30 days.

        The JSON form is a page of groups (`?cursor=&limit=`); the CSV file has every group."""
        until = _query_float("until") or time.time()
        since = _query_float("since") or until - 30 * 86400
        if since > until:
            raise ContractError("since: must not be after until", problems=("since",))
        fmt = request.args.get("format", "json")
        if fmt not in {"json", "csv"}:
            raise ContractError("format: json or csv", problems=("format",))
        tenant, model = request.args.get("tenant"), request.args.get("model")
        if fmt == "csv":
            if "cursor" in request.args or "limit" in request.args:
                raise ContractError("the CSV form has every group: leave cursor and limit out", problems=("cursor",))
            report = await self._s.meter.usage(since=since, until=until, tenant=tenant, model=model)
            response = Response(Meter.to_csv(report), content_type="text/csv; charset=utf-8")
            response.headers["Content-Disposition"] = 'attachment; filename="nexa-usage.csv"'
            return response
        after, limit = _page("usage", (str, str, str))
        report = await self._s.meter.usage(
            since=since,
            until=until,
            tenant=tenant,
            model=model,
            after=None if after is None else (str(after[0]), str(after[1]), str(after[2])),
            limit=limit + 1,
        )
        rows, last = pages.cut(report.rows, limit, lambda r: (r.day, r.tenant, r.model))
        return _json(attrs.evolve(report, rows=rows, next_cursor=_next_cursor("usage", last)))

    async def get_quotas(self) -> Response:
        return _json(self._s.quotas.all(time.time()))

    async def get_quotas_by_tenant(self, tenant: str) -> Response:
        if not self._s.accounts.tenant_exists(TenantId(tenant)):
            raise NotFound(f"no tenant {tenant}")
        return _json(self._s.quotas.view(TenantId(tenant), time.time()))

    async def put_quotas_by_tenant(self, tenant: str) -> Response:
        req = await _body(QuotaLimits)
        return _json(await self._s.quotas.set(_actor(), TenantId(tenant), req))

    async def get_receipts_public_key(self) -> Response:
        rotation, pub = self._s.key_rotation, self._s.signing_key.public  # every key by id: `nexa receipts verify`
        listed = rotation.keys.listed() if rotation else []
        return _json(ReceiptPublicKey(public_key=pub.b64, key_id=pub.fingerprint, keys=listed))

    async def post_controller_rotate_keys(self) -> Response:
        await _no_body()
        return _json(await KeyRotation.of(self._s.key_rotation).rotate(_actor()))

    # ---- backups: made into [backup] dir, listed, downloaded (`nexa backup --out`) ----------------

    async def post_backups(self) -> Response:
        await _no_body()
        return _json(await Backups.of(self._s.backups).create(_actor()), 201)

    async def get_backups(self) -> Response:
        after, limit = _page("backups", (str,))
        views, last = await trio.to_thread.run_sync(Backups.of(self._s.backups).list_page, after, limit)
        return _json(BackupList(backups=views, next_cursor=_next_cursor("backups", last)))

    async def get_backups_by_name(self, name: str) -> Response:
        chunks = await Backups.of(self._s.backups).download(name)
        return Response(chunks, mimetype="application/octet-stream")

    async def get_recovery_plan(self) -> Response:
        return _json(Recovery.of(self._s.recovery).plan())

    async def post_recovery_finish(self) -> Response:
        await _no_body()
        return _json(await Recovery.of(self._s.recovery).finish(_actor()))

    # ---- enrollment and nodes ----------------------------------------------------------------------

    async def post_enrollment_tokens(self) -> Response:
        req = await _body(EnrollmentTokenCreate)
        secret, token = await self._s.fleet.create_token(_actor(), req)
        fingerprint = self._s.controller_keys.fingerprint
        created = EnrollmentTokenCreated(
            id=token.id,
            token=security.pinned_enrollment_token(secret, fingerprint),
            expires_at=token.expires_at,
            labels=token.labels,
            controller_fingerprint=fingerprint,
        )
        return _json(created, 201)

    async def post_enroll(self) -> Response:
        req = await _body(EnrollRequest)
        node = await self._s.fleet.enroll(req)
        keys = self._s.controller_keys
        resp = EnrollResponse(
            node_id=node.id,
            controller_signing_public_key=keys.signing,
            controller_curve_public_key=keys.curve,
            channel_endpoint=self._s.fleet.channel_endpoint,
            labels=node.labels,
        )
        return _json(resp, 201)

    async def get_nodes(self) -> Response:
        after, limit = _page("nodes", (str,))
        nodes, last = pages.page_of(self._s.fleet, lambda live: (live.node.id,), after, limit)
        return _json(NodeList(nodes=[_node_view(live) for live in nodes], next_cursor=_next_cursor("nodes", last)))

    async def get_nodes_by_node_id(self, node_id: str) -> Response:
        return _json(_node_view(self._s.fleet.get(node_id)))

    async def post_nodes_by_node_id_cordon(self, node_id: str) -> Response:
        return _json(_node_view(await self._s.fleet.act(_actor(), node_id, "cordon")))

    async def post_nodes_by_node_id_uncordon(self, node_id: str) -> Response:
        return _json(_node_view(await self._s.fleet.act(_actor(), node_id, "uncordon")))

    async def post_nodes_by_node_id_drain(self, node_id: str) -> Response:
        return _json(_node_view(await self._s.fleet.act(_actor(), node_id, "drain")))

    async def post_nodes_by_node_id_revoke(self, node_id: str) -> Response:
        return _json(_node_view(await self._s.fleet.act(_actor(), node_id, "revoke")))

    async def post_nodes_by_node_id_rotate_keys(self, node_id: str) -> Response:
        return _json(_node_view(await self._s.fleet.request_rotation(_actor(), node_id)))

    # ---- registry: runtimes, models, aliases ---------------------------------------------------------

    async def post_runtimes(self) -> Response:
        runtime = await self._s.models.register_runtime(_actor(), await _body(RuntimeCreate))
        # Enrolled (not revoked) nodes that reported an inventory: could any of them run the image?
        archs = [
            live.inventory.arch
            for live in self._s.fleet
            if live.inventory is not None and live.state is not NodeState.REVOKED
        ]
        warnings = image_platform_warnings(runtime.image_archs, archs)
        return _json(RuntimeRegistered(**attrs.asdict(runtime, recurse=False), warnings=warnings), 201)

    async def get_runtimes(self) -> Response:
        return _json(RuntimeList(runtimes=self._s.models.runtimes()))

    async def get_runtimes_by_name(self, name: str) -> Response:
        return _json(self._s.models.runtime(name))

    async def post_models(self) -> Response:
        model = await self._s.models.register_model(_actor(), await _body(ModelCreate))
        return _json(model, 201)

    async def get_models(self) -> Response:
        raw_state = request.args.get("state")
        state = None
        if raw_state is not None:
            try:
                state = ModelState(raw_state)
            except ValueError:
                states = ", ".join(s.value for s in ModelState)
                raise ContractError(f"query state must be one of {states}", problems=("state: unknown",)) from None
        return _json(ModelList(models=self._s.models.models(name=request.args.get("name"), state=state)))

    async def get_models_by_name_by_version(self, name: str, version: str) -> Response:
        models = self._s.models
        detail = ModelDetail(
            model=models.model(name, version),
            evaluations=models.evaluations(name, version),
            aliases=models.aliases_of(name, version),
        )
        return _json(detail)

    async def post_models_by_name_by_version_license(self, name: str, version: str) -> Response:
        return _json(await self._s.models.set_license(_actor(), name, version, await _body(LicenseSet)))

    async def post_models_by_name_by_version_verify(self, name: str, version: str) -> Response:
        req = await _optional_body(VerifyRequest)
        return _json(await self._s.models.verify(_actor(), name, version, req))

    async def post_models_by_name_by_version_evaluations(self, name: str, version: str) -> Response:
        req = await _body(EvaluationCreate)
        evaluation, model = await self._s.models.evaluate(_actor(), name, version, req)
        return _json(EvaluationResult(evaluation=evaluation, model=model), 201)

    async def post_models_by_name_by_version_approve(self, name: str, version: str) -> Response:
        await _no_body()
        return _json(await self._s.models.approve(_actor(), name, version))

    async def post_models_by_name_by_version_retire(self, name: str, version: str) -> Response:
        await _no_body()
        return _json(await self._s.models.retire(_actor(), name, version))

    async def get_aliases(self) -> Response:
        return _json(AliasList(aliases=self._s.models.aliases()))

    async def get_aliases_by_name(self, name: str) -> Response:
        alias, history = self._s.models.alias(name)
        return _json(AliasDetail(alias=alias, history=history))

    async def post_aliases_by_name_promote(self, name: str) -> Response:
        return _json(await self._s.models.promote(_actor(), name, await _body(AliasPromote)))

    async def post_aliases_by_name_rollback(self, name: str) -> Response:
        await _no_body()
        return _json(await self._s.models.rollback(_actor(), name))

    # ---- deployments and capacity ------------------------------------------------------------------

    async def post_deployments(self) -> Response:
        return _json(await self._s.deployments.create(_actor(), await _body(DeploymentCreate)), 201)

    async def get_deployments(self) -> Response:
        after, limit = _page("deployments", (str,))
        views, last = pages.page_of(self._s.deployments.all(), lambda v: (v.deployment.name,), after, limit)
        return _json(DeploymentList(deployments=views, next_cursor=_next_cursor("deployments", last)))

    async def get_deployments_by_name(self, name: str) -> Response:
        return _json(self._s.deployments.show(name))

    async def delete_deployments_by_name(self, name: str) -> Response:
        return _json(await self._s.deployments.delete(_actor(), name))

    async def get_deployments_by_name_placement(self, name: str) -> Response:
        return _json(self._s.deployments.placement(name))

    async def post_deployments_by_name_scale(self, name: str) -> Response:
        req = await _body(ScaleRequest)
        return _json(await self._s.deployments.scale(_actor(), name, req.replicas))

    async def post_deployments_by_name_routing(self, name: str) -> Response:
        return _json(await self._s.deployments.set_routing(_actor(), name, await _body(RoutingWeights)))

    async def post_deployments_by_name_canary(self, name: str) -> Response:
        req = await _body(CanaryCreate)
        return _json(await self._s.deployments.start_canary(_actor(), name, req), 201)

    async def post_deployments_by_name_promote(self, name: str) -> Response:
        await _no_body()
        return _json(await self._s.deployments.promote(_actor(), name))

    async def post_deployments_by_name_rollback(self, name: str) -> Response:
        await _no_body()
        return _json(await self._s.deployments.rollback(_actor(), name))

    async def post_capacity_forecast(self) -> Response:
        return _json(self._s.deployments.forecast(await _body(DeploymentCreate)))


def _node_view(live: NodeLive) -> NodeView:
    inventory = live.inventory
    merged = grants.labels(live.node.labels, inventory.labels.items() if inventory else ())
    labels = {str(k): str(v) for k, v in merged.items()}
    age = None if live.last_seen is None else max(0.0, trio.current_time() - live.last_seen)
    return NodeView(
        id=live.node.id,
        hostname=live.node.hostname,
        state=live.state,
        admin_state=live.node.admin_state,
        labels=labels,
        enrolled_at=live.node.enrolled_at,
        last_heartbeat_at=live.last_seen_wall,
        last_heartbeat_age_s=None if age is None else round(age, 3),
        agent_version=live.agent_version,
        inventory=inventory,
        free_memory_bytes=live.free_memory_bytes,
        free_accelerators=live.free_accelerators,
        assignments=list(live.statuses),
        desired_generation=live.desired.generation,
        acked_epoch=live.desired.acked_epoch,
        acked_generation=live.desired.acked_generation,
        ack_reason=live.desired.ack_reason,
        needs_reenrollment=bool(live.reenroll_key_id),
        hint=REENROLL_HINT if live.reenroll_key_id else "",
        cache_disk=live.cache_disk,
        channel=dict(live.channel),
        runtime_cache=live.runtime_cache,
        memory_pressure=live.memory_pressure,
        data_classes=list(grants.data_classes(live.node.labels, inventory)),
    )
