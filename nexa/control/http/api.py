"""The management HTTP API (`/api/v1`, `/healthz`, `/readyz`, `/version`, `/metrics`): a quart-trio app.

Each route is declared once, beside its handler, in its resource module (`http.declare`; the modules
are listed in `http.resources`). `create_app` builds the router from those declarations and checks
each route's declared roles before any handler runs (`_authorize`; a route not declared is refused).
Handlers are thin adapters: decode the body or query with `contracts.codec`, call the component that
owns the state (the store only for audit reads), encode the answer. Lists page with
`?cursor=&limit=` (`contracts.pages`). Errors: the nexa envelope (`control.http.common`). Console
pages and, in front, inference routes: `control.console`, `.inference`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any, Final

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from nexa.config import HttpConfig
from nexa.contracts.api import ErrorBody, ErrorEnvelope
from nexa.contracts.domain import Actor, Role
from nexa.control import console
from nexa.control.http import resources
from nexa.control.http.api_io import json_response as _json
from nexa.control.http.common import BodyLimit, bearer_key, method_label, new_request_id, status_for
from nexa.control.http.declare import Handler, RouteKey, collect, role_table
from nexa.control.http.state import AppState
from nexa.errors import Forbidden, NexaError, Overloaded, PayloadTooLarge, Recovering, Unauthenticated
from nexa.telemetry import request_id

log = logging.getLogger(__name__)

__all__ = ["create_app"]


_HTTP_ERRORS: Final = {
    400: ("invalid_request", "the request is malformed"),
    404: ("not_found", "no such route"),
    405: ("method_not_allowed", "this route does not take that method"),
    408: ("request_timeout", "the request body did not arrive in time ([http] body_timeout_s); send it again"),
}


def create_app(cfg: HttpConfig, state: AppState, modules: Iterable[ModuleType] = resources.MODULES) -> QuartTrio:
    """The app serving every route `modules` declare (`http.resources.MODULES`), and the console."""
    app = QuartTrio("nexa.control", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["BODY_TIMEOUT"] = cfg.body_timeout_s
    app.config["RESPONSE_TIMEOUT"] = None
    app.asgi_app = BodyLimit(app.asgi_app, cfg.max_body_bytes)  # type: ignore[method-assign]

    routes = collect(modules)
    roles = role_table(routes)
    for r in routes:
        if r.handler is None:
            raise LookupError(f"{r.method} {r.path}: declared without a handler")
        app.add_url_rule(
            r.path,
            endpoint=f"{r.method} {r.path}",
            view_func=_view(r.handler, state),
            methods=[r.method],
            provide_automatic_options=False,
        )
    # The console's pages answer to its own session cookie; its actions check these same roles.
    console.register(app, state, roles, trusted_proxies=cfg.trusted_proxies)

    @app.before_request
    async def _begin() -> None:
        rid = new_request_id(request.headers.get("X-Request-Id", ""))
        request_id.set(rid)
        g.request_id = rid
        g.started = time.perf_counter()
        length = request.content_length
        if length is not None and length > cfg.max_body_bytes:
            raise PayloadTooLarge(limit_bytes=cfg.max_body_bytes)
        await _authorize(state, roles)
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


def _view(handler: Handler, state: AppState) -> Any:
    """The quart view of a declared handler: called with the app state and the path's parameters."""

    async def view(**params: str) -> Any:
        return await handler(state, **params)

    view.__name__ = handler.__name__
    return view


async def _authorize(state: AppState, table: Mapping[RouteKey, frozenset[Role] | None]) -> None:
    rule = request.url_rule
    if rule is None:
        return  # 404/405 follow; nothing to protect
    method = "GET" if request.method == "HEAD" else request.method
    if (method, rule.rule) in console.CONSOLE_ROUTES:
        return  # the console authenticates by its session (nexa.control.console)
    roles = table.get((method, rule.rule), frozenset())
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
