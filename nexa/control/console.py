"""The operator console: server-rendered pages (Jinja), htmx for partial updates, SSE for live data.

It calls the same registry, fleet, model, deployment, quota and meter methods the API handlers call,
with the signed-in key's `Actor`, so role checks and audit events are the API's own: each view and
action names the API route it mirrors, and `ROUTE_ROLES` (handed in by `api.create_app`) decides.

Sessions are server-side, in memory: the browser holds only a random session id in an HttpOnly,
SameSite=Strict cookie, never the API key. A revoked key's session stops at its next request; a
controller restart signs everyone out. Every POST carries the session's CSRF token (form field or
`X-CSRF-Token` header); without it nothing changes. Nothing here logs or renders a payload.

The sign-in form keeps no server-side state: its CSRF token is an HMAC (per-process secret) over a
time and a nonce, sent both in the form and in a SameSite=Strict cookie, so anonymous visitors
cannot fill, or evict from, the pool of signed-in sessions.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import trio
from quart import (
    Blueprint,
    Response,
    redirect,
    render_template,
    request,
    send_from_directory,
    stream_with_context,
)
from quart_trio import QuartTrio
from werkzeug.exceptions import NotFound as HttpNotFound
from werkzeug.sansio.response import Response as BaseResponse

from nexa.contracts.domain import AuditResult, KeyId, NodeState, Role, TenantId
from nexa.contracts.gateway import QuotaLimits
from nexa.contracts.models import AliasPromote, ModelState
from nexa.contracts.wire import RuntimeState
from nexa.control import store as st
from nexa.control.deployments import Deployments
from nexa.control.fleet import Fleet
from nexa.control.metering import Meter
from nexa.control.models import ALLOWED_FROM, ModelRegistry
from nexa.control.quotas import Quotas
from nexa.control.registry import Actor, Registry, audit_draft
from nexa.control.rollout import breach as rollout_breach
from nexa.errors import ContractError, NexaError, Unauthenticated
from nexa.supervision import supervised
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

COOKIE: Final = "nexa_console"
#: The sign-in form's CSRF cookie (double submit: it must equal the form's token).
LOGIN_COOKIE: Final = "nexa_console_login"
#: How long a signed-in session lasts (seconds); a controller restart ends it sooner.
SESSION_TTL_S: Final = 8 * 3600.0
#: How long a sign-in form stays valid (its stateless CSRF token expires then).
ANON_TTL_S: Final = 600.0
#: Signed-in sessions kept at most; the oldest are dropped beyond it.
MAX_SESSIONS: Final = 10_000
#: Signed-in sessions one key may hold; its oldest is dropped beyond it (not another key's).
MAX_SESSIONS_PER_KEY: Final = 32
#: How often a live view checks for a change (a change shows within two of these).
LIVE_TICK_S: Final = 0.5
#: Metric samples kept for the request charts: one a second, ten minutes.
SAMPLES_KEPT: Final = 600
#: A latency point covers the requests finished over this many samples.
QUANTILE_SPAN: Final = 10
#: Licences expiring within this many seconds are flagged.
LICENSE_WARN_S: Final = 30 * 86400.0
STATIC_DIR: Final = Path(__file__).parent / "static"
VENDOR_FILES: Final = ("vendor/htmx.min.js", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css")

_Route = tuple[str, str]


class ConsoleState(Protocol):
    """What the console reads from the app state (`api.AppState` satisfies it)."""

    registry: Registry
    fleet: Fleet
    models: ModelRegistry
    deployments: Deployments
    store: st.Store
    metrics: Metrics
    quotas: Quotas
    meter: Meter
    ready: bool


#: Views: path name, title, the API route whose roles may see it.
VIEWS: Final[tuple[tuple[str, str, _Route], ...]] = (
    ("overview", "Overview", ("GET", "/api/v1/nodes")),
    ("nodes", "Nodes", ("GET", "/api/v1/nodes")),
    ("models", "Models", ("GET", "/api/v1/models")),
    ("deployments", "Deployments", ("GET", "/api/v1/deployments")),
    ("requests", "Requests", ("GET", "/api/v1/usage")),
    ("audit", "Audit", ("GET", "/api/v1/audit")),
    ("keys", "Keys and quotas", ("GET", "/api/v1/keys")),
)
#: Actions: name → the API route it performs (and whose roles may perform it).
ACTIONS: Final[dict[str, _Route]] = {
    "cordon": ("POST", "/api/v1/nodes/<node_id>/cordon"),
    "uncordon": ("POST", "/api/v1/nodes/<node_id>/uncordon"),
    "drain": ("POST", "/api/v1/nodes/<node_id>/drain"),
    "approve": ("POST", "/api/v1/models/<name>/<version>/approve"),
    "promote": ("POST", "/api/v1/aliases/<name>/promote"),
    "rollback": ("POST", "/api/v1/aliases/<name>/rollback"),
    "scale": ("POST", "/api/v1/deployments/<name>/scale"),
    "delete": ("DELETE", "/api/v1/deployments/<name>"),
    "verify": ("POST", "/api/v1/audit/verify"),
    "key_create": ("POST", "/api/v1/keys"),
    "key_revoke": ("DELETE", "/api/v1/keys/<key_id>"),
    "quota_set": ("PUT", "/api/v1/quotas/<tenant>"),
    "usage": ("GET", "/api/v1/usage"),
    "quotas": ("GET", "/api/v1/quotas"),
}
_NODE_ACTIONS: Final = {
    "cordon": "no new replicas are placed on it; the ones it runs stay",
    "uncordon": "it takes new replicas again",
    "drain": "its replicas are moved to other nodes and it takes no new ones",
}

#: Every console route (method, rule); the API's `_authorize` leaves them to the console's session.
CONSOLE_ROUTES: Final = frozenset(
    {
        ("GET", "/"),
        ("GET", "/console/"),
        ("GET", "/console/static/<path:name>"),
        ("GET", "/console/login"),
        ("POST", "/console/login"),
        ("POST", "/console/logout"),
        ("GET", "/console/events/<view>"),
        ("GET", "/console/overview"),
        ("GET", "/console/nodes"),
        ("GET", "/console/nodes/<node_id>/<action>"),
        ("POST", "/console/nodes/<node_id>/<action>"),
        ("GET", "/console/models"),
        ("POST", "/console/models/<name>/<version>/approve"),
        ("POST", "/console/aliases/<name>/promote"),
        ("GET", "/console/aliases/<name>/rollback"),
        ("POST", "/console/aliases/<name>/rollback"),
        ("GET", "/console/deployments"),
        ("GET", "/console/deployments/<name>"),
        ("GET", "/console/deployments/<name>/<action>"),
        ("POST", "/console/deployments/<name>/<action>"),
        ("GET", "/console/requests"),
        ("GET", "/console/requests/series"),
        ("GET", "/console/audit"),
        ("POST", "/console/audit/verify"),
        ("GET", "/console/keys"),
        ("POST", "/console/keys"),
        ("GET", "/console/keys/<key_id>/revoke"),
        ("POST", "/console/keys/<key_id>/revoke"),
        ("POST", "/console/quotas/<tenant>"),
    }
)


@attrs.define
class Session:
    """One browser's sign-in (only signed-in browsers have one; the sign-in form is stateless)."""

    csrf: str
    expires_at: float
    key_id: KeyId | None = None
    role: Role | None = None
    tenant: TenantId | None = None
    flash: list[tuple[str, str]] = attrs.Factory(list)

    @property
    def actor(self) -> Actor:
        return Actor(key_id=self.key_id, role=self.role, tenant=self.tenant)


@attrs.frozen
class _Sample:
    at: float
    requests: float
    errors: float
    duration: tuple[float, ...]  # cumulative bucket counts, le ascending, +Inf last
    ttft: tuple[float, ...]


@attrs.frozen(kw_only=True)
class ConsoleStatistics:
    sessions: int
    live_streams: int


class _Refused(Exception):
    """A console request that is answered with a page, not the API's JSON envelope."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Console:
    """Sessions, the metric samples behind the charts, and the page handlers."""

    def __init__(
        self,
        state: ConsoleState,
        route_roles: Mapping[_Route, frozenset[Role] | None],
        *,
        trusted_proxies: Iterable[str] = (),
    ) -> None:
        self._s = state
        self._roles = route_roles
        self._proxies = tuple(ipaddress.ip_network(p, strict=False) for p in trusted_proxies)
        #: Keys the sign-in form's CSRF tokens; a restart invalidates open forms (they reload).
        self._form_secret = secrets.token_bytes(32)
        self._sessions: dict[str, Session] = {}
        self._samples: deque[_Sample] = deque(maxlen=SAMPLES_KEPT)
        self._buckets: tuple[float, ...] = ()
        self._streams = 0
        self._audit_tail = 0
        missing = [f for f in VENDOR_FILES if not (STATIC_DIR / f).is_file()]
        if missing:
            log.warning("console vendor files are missing (run builds/console/vendor.sh): %s", ", ".join(missing))

    def statistics(self) -> ConsoleStatistics:
        return ConsoleStatistics(sessions=len(self._sessions), live_streams=self._streams)

    # ---- sessions ------------------------------------------------------------------------------

    def _new_session(self, session: Session) -> str:
        now = time.time()
        mine = [sid for sid, s in self._sessions.items() if s.key_id == session.key_id]
        for sid in mine[: max(0, len(mine) - MAX_SESSIONS_PER_KEY + 1)]:
            del self._sessions[sid]  # this key's oldest: one key cannot push out the others
        if len(self._sessions) >= MAX_SESSIONS:
            for sid in [s for s, v in self._sessions.items() if v.expires_at <= now]:
                del self._sessions[sid]
            while len(self._sessions) >= MAX_SESSIONS:
                del self._sessions[next(iter(self._sessions))]
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = session
        return sid

    def _lookup(self) -> tuple[str, Session] | None:
        sid = request.cookies.get(COOKIE, "")
        session = self._current(sid)
        return None if session is None else (sid, session)

    def _current(self, sid: str) -> Session | None:
        """The live session of `sid`: None when unknown, expired, or its key was revoked."""
        session = self._sessions.get(sid)
        if session is None:
            return None
        if session.expires_at <= time.time():
            del self._sessions[sid]
            return None
        if session.key_id is not None:
            key = next((k for k in self._s.registry.api_keys() if k.id == session.key_id), None)
            if key is None or not key.active:
                del self._sessions[sid]  # revoked: the session ends at once
                return None
        return session

    def _signed_in(self) -> Session:
        found = self._lookup()
        if found is None or found[1].key_id is None:
            raise _Refused(401, "sign in first")
        return found[1]

    def _check_csrf(self, session: Session, form: Mapping[str, str]) -> None:
        presented = form.get("csrf_token") or request.headers.get("X-CSRF-Token", "")
        if not hmac.compare_digest(presented.encode(), session.csrf.encode()):
            raise _Refused(403, "the form has expired or did not come from this console; reload the page and retry")

    def _login_token(self, now: float) -> str:
        """A sign-in form's CSRF token: `time.nonce.mac`, nothing kept server-side."""
        body = f"{int(now)}.{secrets.token_urlsafe(16)}"
        return f"{body}.{self._login_mac(body)}"

    def _login_mac(self, body: str) -> str:
        return hmac.new(self._form_secret, b"console-login\x00" + body.encode(), hashlib.sha256).hexdigest()

    def _login_token_ok(self, presented: str, cookie: str, now: float) -> bool:
        """The form's token equals the cookie's (double submit), is ours, and is not expired."""
        if not presented or len(presented) > 256 or not hmac.compare_digest(presented.encode(), cookie.encode()):
            return False
        body, _, mac = presented.rpartition(".")
        issued = body.partition(".")[0]
        if not issued.isdigit() or not hmac.compare_digest(mac.encode(), self._login_mac(body).encode()):
            return False
        return 0 <= now - int(issued) <= ANON_TTL_S

    def _secure(self) -> bool:
        """Whether the browser reached us over https: directly, or through a trusted proxy that says so."""
        if request.scheme in {"https", "wss"}:
            return True
        if not self._proxies:
            return False
        client = request.scope.get("client")  # the TCP peer itself; never a header
        try:
            peer = ipaddress.ip_address(client[0] if client else "")
        except ValueError:
            return False
        if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
            peer = peer.ipv4_mapped
        if not any(peer in net for net in self._proxies):
            return False
        # The nearest proxy (the trusted one) appends last; earlier values came from the client.
        proto = request.headers.get("X-Forwarded-Proto", "").rsplit(",", 1)[-1]
        return proto.strip().lower() == "https"

    def _may(self, session: Session, route: _Route) -> bool:
        roles = self._roles.get(route, frozenset())
        return roles is None or (session.role is not None and session.role in roles)

    def _views(self, session: Session) -> list[tuple[str, str]]:
        return [(name, title) for name, title, route in VIEWS if self._may(session, route)]

    async def _require(self, session: Session, action: str, target: str) -> None:
        route = ACTIONS[action]
        if not self._may(session, route):
            if route[0] != "GET":
                await self._s.registry.record_denied(
                    session.actor, f"{route[0]} {route[1]}", target, f"role {session.role} may not call this route"
                )
            raise _Refused(403, f"role {session.role} may not do this")

    def _view_allowed(self, session: Session, view: str) -> None:
        if view not in {name for name, _ in self._views(session)}:
            raise _Refused(403, f"role {session.role} may not see this view")

    def _set_cookie(
        self, response: BaseResponse, sid: str, max_age: float, *, name: str = COOKIE, path: str = "/"
    ) -> None:
        response.set_cookie(
            name,
            sid,
            max_age=int(max_age),
            path=path,
            httponly=True,
            samesite="Strict",
            secure=self._secure(),
        )

    async def _audit(self, session: Session, action: str) -> None:
        event = await self._s.store.run(
            st.record_audit, audit_draft(session.actor, action, f"key/{session.key_id}", detail="console")
        )
        self._s.metrics.audit_events.labels(event.result.value).inc()

    # ---- rendering -----------------------------------------------------------------------------

    async def _page(self, session: Session, view: str, template: str, status: int = 200, **ctx: Any) -> Response:
        flash, session.flash = session.flash, []
        html = await render_template(
            f"console/{template}",
            session=session,
            views=self._views(session),
            view=view,
            flash=flash,
            can=lambda action: self._may(session, ACTIONS[action]),
            vendor_ok=all((STATIC_DIR / f).is_file() for f in VENDOR_FILES),
            **ctx,
        )
        return Response(html, status=status, content_type="text/html; charset=utf-8")

    async def _live(self, session: Session, view: str) -> str:
        ctx = await self._context(session, view)
        return await render_template(
            f"console/live_{view}.html",
            session=session,
            can=lambda action: self._may(session, ACTIONS[action]),
            **ctx,
        )

    async def _context(self, session: Session, view: str) -> dict[str, Any]:  # noqa: PLR0911 - one branch a view
        now = time.time()
        if view == "overview":
            return await self._overview(now)
        if view == "nodes":
            return {"nodes": list(self._s.fleet), "now": now}
        if view == "models":
            return self._models(now)
        if view == "deployments":
            return {"deployments": [self._deployment(v.deployment.name, now) for v in self._s.deployments.all()]}
        if view == "requests":
            report = await self._s.meter.usage(since=now - 86400, until=now + 1)
            return {"usage": report.rows, "summary": self._summary(60)}
        if view == "audit":
            return await self._audit_page(session)
        if view == "keys":
            return {
                "keys": self._s.registry.api_keys(),
                "tenants": self._s.registry.tenants(),
                "quotas": {q.tenant: q for q in self._s.quotas.all(now).quotas},
                "roles": list(Role),
            }
        raise _Refused(404, "no such view")

    async def _overview(self, now: float) -> dict[str, Any]:
        nodes = list(self._s.fleet)
        by_state = {s: sum(1 for n in nodes if n.state is s) for s in NodeState}
        inventories = [n.inventory for n in nodes if n.inventory is not None]
        memory_total = sum(i.memory_total_bytes for i in inventories)
        gpus_total = sum(len(i.gpus) for i in inventories)
        reachable = [n for n in nodes if n.state is not NodeState.UNREACHABLE and n.state is not NodeState.REVOKED]
        alerts: list[str] = [f"node {n.node.id} is unreachable" for n in nodes if n.state is NodeState.UNREACHABLE]
        for n in nodes:
            alerts += [
                f"replica {s.assignment_id} on {n.node.id} is crash-looping ({s.restarts} restarts)"
                for s in n.statuses
                if s.reason == "crash_loop" or s.restarts >= 3
            ]
        for name, canary in self._s.deployments.canaries():
            stats = self._s.meter.window(name, canary=True, seconds=canary.objective.window_s, now=now)
            breach = rollout_breach(canary.objective, stats)
            if breach:
                alerts.append(f"canary of {name} breaches its objective: {breach}")
        for q in self._s.quotas.all(now).quotas:
            alerts += [f"tenant {q.tenant} is at {pct}% of its {what}" for what, pct in _saturation(q.limits, q.use)]
        queues = _gauge_by(self._s.metrics.gateway_queue_depth.collect(), "model")
        self._sample(trio.current_time())
        return {
            "nodes": nodes,
            "by_state": by_state,
            "memory_total": memory_total,
            "memory_free": sum(n.free_memory_bytes for n in reachable),
            "gpus_total": gpus_total,
            "gpus_free": sum(n.free_accelerators for n in reachable),
            "approved": [m for m in self._s.models.models() if m.state is ModelState.APPROVED],
            "aliases": self._s.models.aliases(),
            "deployments": self._s.deployments.all(),
            "queues": queues,
            "summary": self._summary(60),
            "recent": await self._recent(10),
            "alerts": alerts,
        }

    def _models(self, now: float) -> dict[str, Any]:
        rows = []
        for m in self._s.models.models():
            evaluations = self._s.models.evaluations(m.name, m.version)
            lic = m.license
            if lic is None:
                warn = "no licence recorded"
            elif lic.expires_at is not None and lic.expires_at <= now:
                warn = "licence expired"
            elif lic.expires_at is not None and lic.expires_at - now <= LICENSE_WARN_S:
                warn = f"licence expires in {math.ceil((lic.expires_at - now) / 86400)} days"
            else:
                warn = None
            rows.append(
                {
                    "m": m,
                    "evaluations": evaluations,
                    "aliases": self._s.models.aliases_of(m.name, m.version),
                    "license_warning": warn,
                    "may_approve": m.state in ALLOWED_FROM["approve"],
                    "may_promote": m.state is ModelState.APPROVED,
                }
            )
        aliases = []
        for a in self._s.models.aliases():
            _, history = self._s.models.alias(a.name)
            aliases.append({"a": a, "history": history[-10:][::-1]})
        return {"models": rows, "aliases": aliases}

    def _deployment(self, name: str, now: float) -> dict[str, Any]:
        view = self._s.deployments.show(name)
        d = view.deployment
        observed: dict[str, RuntimeState] = {}
        node_state: dict[str, NodeState] = {}
        for live in self._s.fleet:
            node_state[live.node.id] = live.state
            observed.update({s.assignment_id: s.state for s in live.statuses})
        replicas = [(r, False) for r in d.placed] + [(r, True) for r in (d.canary.placed if d.canary else [])]
        canary = None
        if d.canary is not None:
            o = d.canary.objective
            stats = self._s.meter.window(name, canary=True, seconds=o.window_s, now=now)
            canary = {
                "c": d.canary,
                "stats": stats,
                "breach": rollout_breach(o, stats),
            }
        return {
            "view": view,
            "d": d,
            "replicas": [
                {"r": r, "canary": c, "observed": observed.get(r.id), "node_state": node_state.get(r.node_id)}
                for r, c in replicas
            ],
            "desired": RuntimeState.READY,
            "canary": canary,
        }

    async def _recent(self, count: int) -> list[Any]:
        events: list[Any] = []
        after = max(0, self._audit_tail - count)
        while True:
            page = await self._s.store.read(st.list_audit, st.AuditQuery(after_seq=after, limit=500))
            events = (events + page)[-count:]
            if len(page) < 500:
                break
            after = page[-1].seq
        if events:
            self._audit_tail = events[-1].seq
        return events[::-1]

    async def _audit_page(self, session: Session) -> dict[str, Any]:
        args = request.args
        after = args.get("after", "0")
        q = st.AuditQuery(
            after_seq=int(after) if after.isdigit() else 0,
            limit=100,
            action=args.get("action") or None,
            actor_key_id=args.get("actor") or None,
            target=args.get("target") or None,
        )
        events = await self._s.store.read(st.list_audit, q)
        return {
            "events": events,
            "filters": {"action": q.action or "", "actor": q.actor_key_id or "", "target": q.target or ""},
            "next_after": events[-1].seq if len(events) == q.limit else None,
            "results": list(AuditResult),
        }

    # ---- request charts: samples of the gateway's Prometheus metrics --------------------------

    async def sample_forever(self) -> None:
        """Sample once a second for as long as the controller serves, so the request charts show the
        last ten minutes whenever a console page is opened."""
        while True:
            self._sample(trio.current_time())
            await trio.sleep(1.0)

    def _sample(self, now: float) -> None:
        """Take a sample if a second has passed since the last one (the sampler, and the live views)."""
        if self._samples and now - self._samples[-1].at < 1.0:
            return
        m = self._s.metrics
        requests = errors = 0.0
        for family in m.gateway_requests.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    requests += s.value
                    errors += s.value if s.labels.get("status") != "ok" else 0.0
        duration = self._histogram(m.gateway_request_seconds.collect())
        ttft = self._histogram(m.gateway_ttft_seconds.collect())
        self._samples.append(_Sample(now, requests, errors, duration, ttft))

    def _histogram(self, families: Iterable[Any]) -> tuple[float, ...]:
        sums: dict[float, float] = {}
        for family in families:
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    sums[le] = sums.get(le, 0.0) + s.value
        bounds = tuple(sorted(sums))
        if bounds:
            self._buckets = bounds
        return tuple(sums.get(b, 0.0) for b in self._buckets)

    def _summary(self, seconds: float) -> dict[str, float | None]:
        """Throughput (req/s), error share and p95 (ms) over the last `seconds` of samples."""
        self._sample(trio.current_time())
        if len(self._samples) < 2:
            return {"rps": 0.0, "error_rate": None, "p95_ms": None}
        last = self._samples[-1]
        first = next((s for s in self._samples if s.at >= last.at - seconds), self._samples[0])
        if first is last:
            first = self._samples[-2]
        done = last.requests - first.requests
        return {
            "rps": done / max(1e-9, last.at - first.at),
            "error_rate": (last.errors - first.errors) / done if done else None,
            "p95_ms": _quantile(self._buckets, first.duration, last.duration, 0.95),
        }

    def series(self) -> dict[str, list[float | None]]:
        """Columns for uPlot: time, throughput, errors/s, p50/p95/p99 latency and p50/p95 TTFT (ms)."""
        self._sample(trio.current_time())
        out: dict[str, list[float | None]] = {
            k: [] for k in ("t", "rps", "errors", "p50", "p95", "p99", "ttft50", "ttft95")
        }
        samples = list(self._samples)
        wall = time.time() - trio.current_time()
        for i in range(1, len(samples)):
            prev, cur, base = samples[i - 1], samples[i], samples[max(0, i - QUANTILE_SPAN)]
            dt = max(1e-9, cur.at - prev.at)
            out["t"].append(round(cur.at + wall, 3))
            out["rps"].append(round((cur.requests - prev.requests) / dt, 3))
            out["errors"].append(round((cur.errors - prev.errors) / dt, 3))
            for key, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
                out[key].append(_quantile(self._buckets, base.duration, cur.duration, q))
            for key, q in (("ttft50", 0.5), ("ttft95", 0.95)):
                out[key].append(_quantile(self._buckets, base.ttft, cur.ttft, q))
        return out

    # ---- live stream ---------------------------------------------------------------------------

    async def stream(self, sid: str, session: Session, view: str) -> AsyncIterator[bytes]:
        """Server-sent events: the view's live fragment whenever it changes; ends when the client
        goes (quart cancels the response), the session ends, or the controller stops."""
        self._streams += 1
        try:
            last = ""
            yield b"retry: 1000\n\n"
            while self._s.ready and self._current(sid) is session:
                html = await self._live(session, view)
                if html != last:
                    last = html
                    data = "".join(f"data: {line}\n" for line in html.splitlines() or [""])
                    yield f"event: fragment\n{data}\n".encode()
                await trio.sleep(LIVE_TICK_S)
            yield b"event: signed-out\ndata: \n\n"
        finally:
            self._streams -= 1


def _saturation(limits: QuotaLimits, use: Any) -> list[tuple[str, int]]:
    pairs = (
        ("concurrent requests", limits.concurrent_requests, use.concurrent_requests),
        ("requests per minute", limits.requests_per_minute, use.requests_last_minute),
        ("tokens per minute", limits.tokens_per_minute, use.tokens_last_minute),
        ("tokens per day", limits.tokens_per_day, use.tokens_today),
    )
    return [(what, round(100 * used / limit)) for what, limit, used in pairs if limit and used >= 0.9 * limit]


def _gauge_by(families: Iterable[Any], label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in families:
        for s in family.samples:
            out[s.labels.get(label, "")] = out.get(s.labels.get(label, ""), 0.0) + s.value
    return out


def _quantile(bounds: tuple[float, ...], before: tuple[float, ...], after: tuple[float, ...], q: float) -> float | None:
    """Prometheus-style histogram_quantile over the bucket increase between two samples (ms)."""
    if not bounds or len(before) != len(bounds) or len(after) != len(bounds):
        return None
    counts = [a - b for a, b in zip(after, before, strict=True)]
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if math.isinf(bound):
                return round(lower * 1000, 3)
            inside = cum - below
            share = (rank - below) / inside if inside else 1.0
            return round((lower + (bound - lower) * share) * 1000, 3)
        lower, below = bound, cum
    return None


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt_time(t: float | None) -> str:
    return "—" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _node_age(live: Any) -> float | None:
    return None if live.last_seen is None else max(0.0, trio.current_time() - live.last_seen)


def _int_field(form: Mapping[str, str], name: str, *, optional: bool = False) -> int | None:
    raw = (form.get(name) or "").strip()
    if not raw and optional:
        return None
    if not raw.isdigit():
        raise ContractError(f"{name} must be a whole number", problems=(f"{name}: not a whole number",))
    return int(raw)


def register(  # noqa: PLR0915 - every console route, side by side, as closures over `console`
    app: QuartTrio,
    state: ConsoleState,
    route_roles: Mapping[_Route, frozenset[Role] | None],
    *,
    trusted_proxies: Iterable[str] = (),
) -> Console:
    """Add the console's routes to `app`; every one is in `CONSOLE_ROUTES`."""
    console = Console(state, route_roles, trusted_proxies=trusted_proxies)
    app.extensions["nexa.console"] = console  # its statistics(), for tests and diagnostics
    bp = Blueprint("console", __name__, template_folder="templates")
    sampler = trio.CancelScope()

    @app.before_serving
    async def _start_sampler() -> None:
        async def sample() -> None:
            with sampler:
                await supervised("console.sample", console.sample_forever)

        app.nursery.start_soon(sample)

    @app.after_serving
    async def _stop_sampler() -> None:
        sampler.cancel()

    app.jinja_env.filters.update(bytes=_fmt_bytes, time=_fmt_time, age=_fmt_age)
    app.jinja_env.globals.update(node_age=_node_age, node_actions=_NODE_ACTIONS)

    def page(fn: Callable[..., Any]) -> Callable[..., Any]:
        """Turn `_Refused` and nexa errors into pages (or a sign-in redirect) instead of the JSON envelope."""

        async def wrapper(**kwargs: Any) -> Any:
            try:
                return await fn(**kwargs)
            except _Refused as exc:
                if exc.status == 401 and request.method == "GET" and not request.path.startswith("/console/events/"):
                    return redirect("/console/login", 303)
                return await _problem(exc.status, exc.message)
            except NexaError as exc:
                return await _problem_for(exc)

        wrapper.__name__ = fn.__name__
        return wrapper

    async def _problem(status: int, message: str) -> Response:
        found = console._lookup()
        session = found[1] if found else None
        if session is None or session.key_id is None:
            html = await render_template("console/problem.html", message=message, session=None, views=[], view="")
            return Response(html, status=status, content_type="text/html; charset=utf-8")
        return await console._page(session, "", "problem.html", status=status, message=message)

    async def _problem_for(exc: NexaError) -> Response:
        from nexa.control.http import status_for

        return await _problem(status_for(exc), exc.message)

    async def _done(session: Session, message: str, to: str) -> Any:
        session.flash.append(("ok", message))
        return redirect(to, 303)

    async def _form(session: Session) -> Mapping[str, str]:
        form = await request.form
        console._check_csrf(session, form)
        return form

    async def _confirmed(action: str, kind: str, name: str) -> Session:
        """A destructive POST: signed in, its CSRF token, a role that may, and the confirmation
        page's answer naming this very scope (`<kind> <name>`)."""
        session = console._signed_in()
        form = await _form(session)
        await console._require(session, action, f"{kind}/{name}")
        if form.get("confirm") != f"{kind} {name}":
            raise _Refused(400, "confirm the action on its confirmation page")
        return session

    # ---- sign-in -----------------------------------------------------------------------------

    @bp.get("/")
    @bp.get("/console/")
    @page
    async def home() -> Any:
        found = console._lookup()
        if found is None or found[1].key_id is None:
            return redirect("/console/login", 303)
        views = console._views(found[1])
        return redirect(f"/console/{views[0][0]}", 303)

    @bp.get("/console/login")
    @page
    async def login_form(error: str = "", status: int = 200) -> Any:
        # Stateless: the token is in the page and in a cookie, nothing is kept here (issue 12, 9).
        token = console._login_token(time.time())
        html = await render_template(
            "console/login.html", csrf=token, error=error, session=None, views=[], view="login"
        )
        response = Response(html, status=status, content_type="text/html; charset=utf-8")
        console._set_cookie(response, token, ANON_TTL_S, name=LOGIN_COOKIE, path="/console/login")
        return response

    @bp.post("/console/login")
    @page
    async def login() -> Any:
        form = await request.form
        presented = form.get("csrf_token") or request.headers.get("X-CSRF-Token", "")
        if not console._login_token_ok(presented, request.cookies.get(LOGIN_COOKIE, ""), time.time()):
            return await login_form(
                error="The sign-in form expired or did not come from this console; try again.", status=403
            )
        found = console._lookup()
        old_sid = found[0] if found is not None else None
        try:
            key = state.registry.authenticate((form.get("api_key") or "").strip())
        except Unauthenticated:
            state.metrics.auth_failures.labels("unauthenticated").inc()
            return await login_form(error="That key is unknown or revoked.", status=401)
        session = Session(
            csrf=secrets.token_urlsafe(32),
            expires_at=time.time() + SESSION_TTL_S,
            key_id=key.id,
            role=key.role,
            tenant=key.tenant,
        )
        views = console._views(session)
        if not views:
            return await login_form(error=f"Keys with the role {key.role} have no console views.", status=403)
        if old_sid is not None:
            console._sessions.pop(old_sid, None)  # signing in again replaces this browser's session
        sid = console._new_session(session)  # always a fresh id
        await console._audit(session, "console.sign_in")
        response = redirect(f"/console/{views[0][0]}", 303)
        console._set_cookie(response, sid, SESSION_TTL_S)
        return response

    @bp.post("/console/logout")
    @page
    async def logout() -> Any:
        session = console._signed_in()
        await _form(session)
        found = console._lookup()
        if found is not None:
            console._sessions.pop(found[0], None)
        await console._audit(session, "console.sign_out")
        response = redirect("/console/login", 303)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="Strict", secure=console._secure())
        return response

    # ---- static files and live data -----------------------------------------------------------

    @bp.get("/console/static/<path:name>")
    async def static(name: str) -> Any:
        try:
            response = await send_from_directory(STATIC_DIR, name)
        except HttpNotFound:
            return Response("not found", status=404, content_type="text/plain")
        response.headers["Cache-Control"] = "private, max-age=300"
        return response

    @bp.get("/console/events/<view>")
    @page
    async def events(view: str) -> Any:
        session = console._signed_in()
        console._view_allowed(session, view)
        sid = request.cookies.get(COOKIE, "")

        @stream_with_context
        async def body() -> AsyncIterator[bytes]:
            async for chunk in console.stream(sid, session, view):
                yield chunk

        response = Response(body(), content_type="text/event-stream")
        response.timeout = None
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Accel-Buffering"] = "no"
        return response

    # ---- views ---------------------------------------------------------------------------------

    async def _view(view: str, **extra: Any) -> Response:
        session = console._signed_in()
        console._view_allowed(session, view)
        live = await console._live(session, view)
        title = dict(console._views(session))[view]
        return await console._page(session, view, "view.html", live=live, title=title, **extra)

    for _name, _, _ in VIEWS:

        async def _show(_v: str = _name) -> Response:
            return await _view(_v)

        _show.__name__ = f"view_{_name}"
        bp.add_url_rule(f"/console/{_name}", endpoint=f"view_{_name}", view_func=page(_show), methods=["GET"])

    @bp.get("/console/requests/series")
    @page
    async def series() -> Any:
        session = console._signed_in()
        console._view_allowed(session, "requests")
        return console.series()

    @bp.get("/console/deployments/<name>")
    @page
    async def deployment(name: str) -> Any:
        session = console._signed_in()
        console._view_allowed(session, "deployments")
        detail = console._deployment(name, time.time())
        placement = state.deployments.placement(name)
        return await console._page(
            session, "deployments", "deployment.html", dep=detail, placement=placement.decision, title=name
        )

    # ---- actions -------------------------------------------------------------------------------

    async def _confirm(session: Session, view: str, *, action: str, scope: str, effect: str, post: str) -> Response:
        return await console._page(
            session, view, "confirm.html", action=action, scope=scope, effect=effect, post=post, back=f"/console/{view}"
        )

    @bp.get("/console/nodes/<node_id>/<action>")
    @page
    async def node_confirm(node_id: str, action: str) -> Any:
        session = console._signed_in()
        if action not in _NODE_ACTIONS:
            raise _Refused(404, "no such action")
        await console._require(session, action, f"node/{node_id}")
        live = state.fleet.get(node_id)
        effect = f"Node {node_id}: {_NODE_ACTIONS[action]}. It runs {len(live.statuses)} replica(s) now."
        return await _confirm(
            session, "nodes", action=action, scope=f"node {node_id}", effect=effect, post=request.path
        )

    @bp.post("/console/nodes/<node_id>/<action>")
    @page
    async def node_act(node_id: str, action: str) -> Any:
        if action not in _NODE_ACTIONS:
            raise _Refused(404, "no such action")
        session = await _confirmed(action, "node", node_id)
        live = await state.fleet.act(session.actor, node_id, action)
        return await _done(session, f"Node {node_id} is now {live.state.value}.", "/console/nodes")

    @bp.post("/console/models/<name>/<version>/approve")
    @page
    async def approve(name: str, version: str) -> Any:
        session = console._signed_in()
        await _form(session)
        await console._require(session, "approve", f"model/{name}/{version}")
        model = await state.models.approve(session.actor, name, version)
        return await _done(session, f"{name} {version} is now {model.state.value}.", "/console/models")

    @bp.post("/console/aliases/<name>/promote")
    @page
    async def promote(name: str) -> Any:
        session = console._signed_in()
        form = await _form(session)
        alias = (form.get("alias") or name).strip()
        await console._require(session, "promote", f"alias/{alias}")
        req = AliasPromote(model=form.get("model", ""), version=form.get("version", ""))
        receipt = await state.models.promote(session.actor, alias, req)
        to = f"{receipt.to.model} {receipt.to.version}"
        return await _done(
            session, f"Alias {alias} now points at {to} (generation {receipt.generation}).", "/console/models"
        )

    @bp.get("/console/aliases/<name>/rollback")
    @page
    async def rollback_confirm(name: str) -> Any:
        session = console._signed_in()
        await console._require(session, "rollback", f"alias/{name}")
        alias, history = state.models.alias(name)
        prior = history[-1].from_ if history else None
        effect = f"Alias {name} points at {alias.target.model} {alias.target.version}; it returns to " + (
            f"{prior.model} {prior.version}." if prior else "its previous target."
        )
        return await _confirm(
            session, "models", action="rollback", scope=f"alias {name}", effect=effect, post=request.path
        )

    @bp.post("/console/aliases/<name>/rollback")
    @page
    async def rollback(name: str) -> Any:
        session = await _confirmed("rollback", "alias", name)
        receipt = await state.models.rollback(session.actor, name)
        return await _done(
            session, f"Alias {name} rolled back to {receipt.to.model} {receipt.to.version}.", "/console/models"
        )

    @bp.get("/console/deployments/<name>/<action>")
    @page
    async def deployment_confirm(name: str, action: str) -> Any:
        session = console._signed_in()
        if action not in {"scale", "delete"}:
            raise _Refused(404, "no such action")
        await console._require(session, action, f"deployment/{name}")
        d = state.deployments.show(name).deployment
        if action == "delete":
            effect = (
                f"Deployment {name} and its {len(d.placed)} replica(s) stop; requests for "
                f"{d.alias or d.model.model} go to other deployments, or are refused when there are none."
            )
        else:
            wanted = _int_field(request.args, "replicas")
            effect = f"Deployment {name} goes from {d.replicas} to {wanted} replica(s)."
        return await _confirm(
            session,
            "deployments",
            action=action,
            scope=f"deployment {name}",
            effect=effect,
            post=request.full_path.rstrip("?"),
        )

    @bp.post("/console/deployments/<name>/<action>")
    @page
    async def deployment_act(name: str, action: str) -> Any:
        if action not in {"scale", "delete"}:
            raise _Refused(404, "no such action")
        session = await _confirmed(action, "deployment", name)
        if action == "delete":
            await state.deployments.delete(session.actor, name)
            return await _done(session, f"Deployment {name} deleted.", "/console/deployments")
        replicas = _int_field(request.args, "replicas")
        assert replicas is not None
        view = await state.deployments.scale(session.actor, name, replicas)
        return await _done(session, f"Deployment {name} scaled to {view.deployment.replicas}.", "/console/deployments")

    @bp.post("/console/audit/verify")
    @page
    async def verify() -> Any:
        session = console._signed_in()
        await _form(session)
        await console._require(session, "verify", "audit")
        verdict = await state.store.read(st.verify_audit)
        if request.headers.get("HX-Request") == "true":
            html = await render_template("console/verdict.html", verdict=verdict)
            return Response(html, content_type="text/html; charset=utf-8")
        return await _view("audit", verdict=verdict)

    @bp.post("/console/keys")
    @page
    async def key_create() -> Any:
        from nexa.contracts.api import KeyCreate

        session = console._signed_in()
        form = await _form(session)
        await console._require(session, "key_create", "keys")
        try:
            role = Role(form.get("role", ""))
        except ValueError:
            raise ContractError("role: unknown", problems=("role: unknown",)) from None
        tenant = (form.get("tenant") or "").strip() or None
        req = KeyCreate(role=role, name=(form.get("name") or "").strip(), tenant=TenantId(tenant) if tenant else None)
        secret, key = await state.registry.create_key(session.actor, req)
        return await _view("keys", created=(secret, key))

    @bp.get("/console/keys/<key_id>/revoke")
    @page
    async def key_revoke_confirm(key_id: str) -> Any:
        session = console._signed_in()
        await console._require(session, "key_revoke", f"key/{key_id}")
        key = next((k for k in state.registry.api_keys() if k.id == key_id), None)
        if key is None:
            raise _Refused(404, f"no key {key_id}")
        named = f", {key.name}" if key.name else ""
        effect = f"Key {key_id} ({key.role}{named}) stops working at once, and so do its console sessions."
        return await _confirm(session, "keys", action="revoke", scope=f"key {key_id}", effect=effect, post=request.path)

    @bp.post("/console/keys/<key_id>/revoke")
    @page
    async def key_revoke(key_id: str) -> Any:
        session = await _confirmed("key_revoke", "key", key_id)
        await state.registry.revoke_key(session.actor, KeyId(key_id))
        return await _done(session, f"Key {key_id} revoked.", "/console/keys")

    @bp.post("/console/quotas/<tenant>")
    @page
    async def quota_set(tenant: str) -> Any:
        session = console._signed_in()
        form = await _form(session)
        await console._require(session, "quota_set", f"quota/{tenant}")
        limits = QuotaLimits(
            concurrent_requests=_int_field(form, "concurrent_requests", optional=True),
            requests_per_minute=_int_field(form, "requests_per_minute", optional=True),
            tokens_per_minute=_int_field(form, "tokens_per_minute", optional=True),
            tokens_per_day=_int_field(form, "tokens_per_day", optional=True),
        )
        await state.quotas.set(session.actor, TenantId(tenant), limits)
        return await _done(session, f"Quotas of {tenant} saved.", "/console/keys")

    app.register_blueprint(bp)
    return console
