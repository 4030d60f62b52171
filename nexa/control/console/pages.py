"""What every console page shares: the tables of views and actions, the signed-in session of a
request, role checks, rendering, the live stream, and turning refusals into pages.

A view or action names the API route it mirrors; the roles declared with it (handed in by `api.create_app`)
decide who may, so the console's role checks and audit events are the API's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import trio
from quart import Blueprint, Response, redirect, render_template, request
from werkzeug.sansio.response import Response as BaseResponse

from nexa.contracts.domain import KeyId, Role
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.console.sessions import (
    COOKIE,
    LoginForms,
    Session,
    Sessions,
    csrf_ok,
    reached_over_https,
    trusted_networks,
)
from nexa.control.datapath.admission import Admission
from nexa.control.datapath.metering import Meter
from nexa.control.datapath.quotas import Quotas
from nexa.control.deployments import Deployments
from nexa.control.fleet.nodes import Fleet
from nexa.control.http.common import status_for
from nexa.control.operations.benchmarks import Benchmarks
from nexa.control.operations.evals import Evals
from nexa.control.operations.jobs import Jobs
from nexa.control.operations.qualification import Qualifications
from nexa.control.operations.recovery import Recovery
from nexa.control.registry.models import ModelRegistry
from nexa.errors import ContractError, NexaError
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: How often a live view checks for a change (a change shows within two of these).
LIVE_TICK_S: Final = 0.5
STATIC_DIR: Final = Path(__file__).parent / "static"
VENDOR_FILES: Final = ("vendor/htmx.min.js", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css")

Route = tuple[str, str]
Context = dict[str, Any]


class ConsoleState(Protocol):
    """What the console reads from the app state (`api.AppState` satisfies it)."""

    accounts: Accounts
    fleet: Fleet
    models: ModelRegistry
    deployments: Deployments
    store: st.Store
    metrics: Metrics
    quotas: Quotas
    meter: Meter
    admission: Admission
    #: The controller's recovery; None: it never recovers (tests). The overview says when it is active.
    recovery: Recovery | None
    #: Benchmark runs and jobs (`control.operations.benchmarks`, `.jobs`); None: none are kept (tests).
    benchmarks: Benchmarks | None
    jobs: Jobs | None
    ready: bool
    #: Runtime qualifications (`control.operations.qualification`), shown beside the runtimes; None: none (tests).
    qualifications: Qualifications | None
    #: Evaluation suites and runs (`control.operations.evals`), compared; None: none are kept (tests).
    evals: Evals | None


@attrs.frozen
class View:
    """A page of the navigation: its path name, title, the API route whose roles may see it, and
    what its live fragment (`live_<name>.html`) is rendered from."""

    name: str
    title: str
    route: Route
    context: Callable[[Session, float], Awaitable[Context]]


#: Actions: name → the API route it performs (and whose roles may perform it).
ACTIONS: Final[dict[str, Route]] = {
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
    "rollout_pause": ("POST", "/api/v1/deployments/<name>/rollout/pause"),
    "rollout_resume": ("POST", "/api/v1/deployments/<name>/rollout/resume"),
    "rollout_undo": ("POST", "/api/v1/deployments/<name>/rollout/undo"),
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
        ("GET", "/console/fleet/series"),
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
        ("GET", "/console/benchmarks"),
        ("GET", "/console/benchmarks/<run_id>"),
        ("GET", "/console/jobs"),
        ("GET", "/console/evals/compare"),
        ("GET", "/console/docs"),
        ("GET", "/console/docs/<name>"),
    }
)


@attrs.frozen(kw_only=True)
class ConsoleStatistics:
    sessions: int
    live_streams: int


class Refused(Exception):
    """A console request that is answered with a page, not the API's JSON envelope."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Console:
    """The signed-in session of each request, role checks, and rendering, for every view module."""

    def __init__(
        self,
        state: ConsoleState,
        route_roles: Mapping[Route, frozenset[Role] | None],
        *,
        trusted_proxies: Iterable[str] = (),
    ) -> None:
        self.state = state
        self._roles = route_roles
        if undeclared := sorted(set(ACTIONS.values()) - set(route_roles)):
            raise LookupError(f"console actions name routes no resource module declares: {undeclared}")
        self._proxies = trusted_networks(trusted_proxies)
        self.sessions = Sessions(self._key_active)
        self.login_forms = LoginForms()
        self._views: dict[str, View] = {}
        self._streams = 0
        missing = [f for f in VENDOR_FILES if not (STATIC_DIR / f).is_file()]
        if missing:
            log.warning("console vendor files are missing (run builds/console/vendor.sh): %s", ", ".join(missing))

    def statistics(self) -> ConsoleStatistics:
        return ConsoleStatistics(sessions=len(self.sessions), live_streams=self._streams)

    def _key_active(self, key_id: KeyId) -> bool:
        key = next((k for k in self.state.accounts.api_keys() if k.id == key_id), None)
        return key is not None and key.usable(time.time())  # revoked or expired: the session ends

    # ---- the session of this request -----------------------------------------------------------

    def lookup(self) -> tuple[str, Session] | None:
        sid = request.cookies.get(COOKIE, "")
        session = self.sessions.current(sid, now=time.time())
        return None if session is None else (sid, session)

    def signed_in(self) -> Session:
        found = self.lookup()
        if found is None or found[1].key_id is None:
            raise Refused(401, "sign in first")
        return found[1]

    def check_csrf(self, session: Session, form: Mapping[str, str]) -> None:
        presented = form.get("csrf_token") or request.headers.get("X-CSRF-Token", "")
        if not csrf_ok(session, presented):
            raise Refused(403, "the form has expired or did not come from this console; reload the page and retry")

    async def form(self, session: Session) -> Mapping[str, str]:
        """The POSTed form, once its CSRF token is this session's."""
        form = await request.form
        self.check_csrf(session, form)
        return form

    async def confirmed(self, action: str, kind: str, name: str) -> Session:
        """A destructive POST: signed in, its CSRF token, a role that may, and the confirmation
        page's answer naming this very scope (`<kind> <name>`)."""
        session = self.signed_in()
        form = await self.form(session)
        await self.require(session, action, f"{kind}/{name}")
        if form.get("confirm") != f"{kind} {name}":
            raise Refused(400, "confirm the action on its confirmation page")
        return session

    def secure(self) -> bool:
        """Whether the browser reached us over https: directly, or through a trusted proxy that says so."""
        client = request.scope.get("client")  # the TCP peer itself; never a header
        proto = request.headers.get("X-Forwarded-Proto", "")
        return reached_over_https(request.scheme, client[0] if client else None, proto, self._proxies)

    def set_cookie(
        self, response: BaseResponse, value: str, max_age: float, *, name: str = COOKIE, path: str = "/"
    ) -> None:
        response.set_cookie(
            name, value, max_age=int(max_age), path=path, httponly=True, samesite="Strict", secure=self.secure()
        )

    async def audit(self, session: Session, action: str) -> None:
        """A console event of the signed-in key (sign-in, sign-out), through the accounts."""
        await self.state.accounts.record(session.actor, action, f"key/{session.key_id}", detail="console")

    # ---- roles ---------------------------------------------------------------------------------

    def may(self, session: Session, route: Route) -> bool:
        roles = self._roles.get(route, frozenset())
        return roles is None or (session.role is not None and session.role in roles)

    def views(self, session: Session) -> list[tuple[str, str]]:
        return [(v.name, v.title) for v in self._views.values() if self.may(session, v.route)]

    def view_allowed(self, session: Session, view: str) -> None:
        if view not in {name for name, _ in self.views(session)}:
            raise Refused(403, f"role {session.role} may not see this view")

    async def require(self, session: Session, action: str, target: str) -> None:
        route = ACTIONS[action]
        if not self.may(session, route):
            if route[0] != "GET":
                await self.state.accounts.record_denied(
                    session.actor, f"{route[0]} {route[1]}", target, f"role {session.role} may not call this route"
                )
            raise Refused(403, f"role {session.role} may not do this")

    # ---- views and rendering -------------------------------------------------------------------

    def add_view(self, bp: Blueprint, view: View) -> None:
        """Add `view` to the navigation (in the order added) and its page, `GET /console/<name>`."""
        if view.route not in self._roles:
            raise LookupError(f"console view {view.name} names a route no resource module declares: {view.route}")
        self._views[view.name] = view

        async def show() -> Response:
            return await self.show(view.name)

        show.__name__ = f"view_{view.name}"
        bp.add_url_rule(f"/console/{view.name}", endpoint=show.__name__, view_func=self.handler(show), methods=["GET"])

    async def show(self, view: str, **extra: Any) -> Response:
        """A view's page: its live fragment inside the page, for the signed-in session."""
        session = self.signed_in()
        self.view_allowed(session, view)
        live = await self.live(session, view)
        return await self.page(session, view, "view.html", live=live, title=self._views[view].title, **extra)

    async def page(self, session: Session, view: str, template: str, status: int = 200, **ctx: Any) -> Response:
        flash, session.flash = session.flash, []
        html = await render_template(
            f"console/{template}",
            session=session,
            views=self.views(session),
            view=view,
            flash=flash,
            can=lambda action: self.may(session, ACTIONS[action]),
            vendor_ok=all((STATIC_DIR / f).is_file() for f in VENDOR_FILES),
            **ctx,
        )
        return html_response(html, status)

    async def live(self, session: Session, view: str) -> str:
        found = self._views.get(view)
        if found is None:
            raise Refused(404, "no such view")
        ctx = await found.context(session, time.time())
        return await render_template(
            f"console/live_{view}.html",
            session=session,
            can=lambda action: self.may(session, ACTIONS[action]),
            **ctx,
        )

    async def confirm(
        self, session: Session, view: str, *, action: str, scope: str, effect: str, post: str
    ) -> Response:
        """The confirmation page of a destructive action (its POST carries `confirm=<scope>`)."""
        return await self.page(
            session, view, "confirm.html", action=action, scope=scope, effect=effect, post=post, back=f"/console/{view}"
        )

    def handler(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """Turn `Refused` and nexa errors into pages (or a sign-in redirect) instead of the JSON envelope."""

        async def wrapper(**kwargs: Any) -> Any:
            try:
                return await fn(**kwargs)
            except Refused as exc:
                if exc.status == 401 and request.method == "GET" and not request.path.startswith("/console/events/"):
                    return redirect("/console/login", 303)
                return await self.problem(exc.status, exc.message)
            except NexaError as exc:
                return await self.problem(status_for(exc), exc.message)

        wrapper.__name__ = fn.__name__
        return wrapper

    async def problem(self, status: int, message: str) -> Response:
        found = self.lookup()
        session = found[1] if found else None
        if session is None or session.key_id is None:
            html = await render_template("console/problem.html", message=message, session=None, views=[], view="")
            return html_response(html, status)
        return await self.page(session, "", "problem.html", status=status, message=message)

    # ---- the live stream -----------------------------------------------------------------------

    async def stream(self, sid: str, session: Session, view: str) -> AsyncGenerator[bytes, None]:
        """Server-sent events: the view's live fragment whenever it changes; ends when the client
        goes (quart cancels the response), the session ends, or the controller stops."""
        self._streams += 1
        try:
            last = ""
            yield b"retry: 1000\n\n"
            while self.state.ready and self.sessions.current(sid, now=time.time()) is session:
                html = await self.live(session, view)
                if html != last:
                    last = html
                    data = "".join(f"data: {line}\n" for line in html.splitlines() or [""])
                    yield f"event: fragment\n{data}\n".encode()
                await trio.sleep(LIVE_TICK_S)
            yield b"event: signed-out\ndata: \n\n"
        finally:
            self._streams -= 1


def html_response(html: str, status: int = 200) -> Response:
    return Response(html, status=status, content_type="text/html; charset=utf-8")


async def done(session: Session, message: str, to: str) -> Any:
    """After an action: flash `message` on the next page, and go to `to`."""
    session.flash.append(("ok", message))
    return redirect(to, 303)


def int_field(form: Mapping[str, str], name: str, *, optional: bool = False) -> int | None:
    raw = (form.get(name) or "").strip()
    if not raw and optional:
        return None
    if not raw.isdigit():
        raise ContractError(f"{name} must be a whole number", problems=(f"{name}: not a whole number",))
    return int(raw)


# ---- template filters ------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_time(t: float | None) -> str:
    return "—" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def fmt_duration(seconds: float | None) -> str:
    """A run's or job's length: "0.8 s", "42 s", "3 min 20 s", "2 h 05 min"."""
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
