"""Signing in and out, the console's own files, and the live stream every view listens to."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from quart import Blueprint, Response, redirect, render_template, request, send_from_directory
from quart.globals import request_ctx
from werkzeug.exceptions import NotFound as HttpNotFound

from nexa.control.console.pages import STATIC_DIR, Console, html_response
from nexa.control.console.sessions import ANON_TTL_S, COOKIE, LOGIN_COOKIE, SESSION_TTL_S, new_session
from nexa.errors import KeyExpired, Unauthenticated


def register(bp: Blueprint, console: Console) -> None:
    _sign_in_routes(bp, console)
    _file_and_event_routes(bp, console)


def _sign_in_routes(bp: Blueprint, console: Console) -> None:
    state = console.state

    @bp.get("/")
    @bp.get("/console/")
    @console.handler
    async def home() -> Any:
        found = console.lookup()
        if found is None or found[1].key_id is None:
            return redirect("/console/login", 303)
        views = console.views(found[1])
        return redirect(f"/console/{views[0][0]}", 303)

    @bp.get("/console/login")
    @console.handler
    async def login_form(error: str = "", status: int = 200) -> Any:
        # Stateless: the token is in the page and in a cookie, nothing is kept here (issue 12, 9).
        token = console.login_forms.token(time.time())
        html = await render_template(
            "console/login.html", csrf=token, error=error, session=None, views=[], view="login"
        )
        response = html_response(html, status)
        console.set_cookie(response, token, ANON_TTL_S, name=LOGIN_COOKIE, path="/console/login")
        return response

    @bp.post("/console/login")
    @console.handler
    async def login() -> Any:
        form = await request.form
        presented = form.get("csrf_token") or request.headers.get("X-CSRF-Token", "")
        if not console.login_forms.token_ok(presented, request.cookies.get(LOGIN_COOKIE, ""), time.time()):
            return await login_form(
                error="The sign-in form expired or did not come from this console; try again.", status=403
            )
        found = console.lookup()
        old_sid = found[0] if found is not None else None
        try:
            key = state.accounts.authenticate((form.get("api_key") or "").strip())
        except KeyExpired as exc:
            state.metrics.auth_failures.labels(exc.code).inc()
            return await login_form(error=exc.message, status=401)
        except Unauthenticated:
            state.metrics.auth_failures.labels("unauthenticated").inc()
            return await login_form(error="That key is unknown or revoked.", status=401)
        now = time.time()
        session = new_session(key.id, key.role, key.tenant, now=now)
        views = console.views(session)
        if not views:
            return await login_form(error=f"Keys with the role {key.role} have no console views.", status=403)
        if old_sid is not None:
            console.sessions.drop(old_sid)  # signing in again replaces this browser's session
        sid = console.sessions.add(session, now=now)  # always a fresh id
        await console.audit(session, "console.sign_in")
        response = redirect(f"/console/{views[0][0]}", 303)
        console.set_cookie(response, sid, SESSION_TTL_S)
        return response

    @bp.post("/console/logout")
    @console.handler
    async def logout() -> Any:
        session = console.signed_in()
        await console.form(session)
        found = console.lookup()
        if found is not None:
            console.sessions.drop(found[0])
        await console.audit(session, "console.sign_out")
        response = redirect("/console/login", 303)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="Strict", secure=console.secure())
        return response


def _file_and_event_routes(bp: Blueprint, console: Console) -> None:
    @bp.get("/console/static/<path:name>")
    async def static(name: str) -> Any:
        try:
            response = await send_from_directory(STATIC_DIR, name)
        except HttpNotFound:
            return Response("not found", status=404, content_type="text/plain")
        response.headers["Cache-Control"] = "private, max-age=300"
        return response

    @bp.get("/console/events/<view>")
    @console.handler
    async def events(view: str) -> Any:
        session = console.signed_in()
        console.view_allowed(session, view)
        sid = request.cookies.get(COOKIE, "")

        # The request's context travels with the stream (templates need it), and the stream is closed with
        # `body`: quart closes `body` when the client goes, `body` closes the stream at once. (quart's
        # stream_with_context does not close the generator it wraps; trio then warns when that is collected.)
        context = request_ctx.copy()

        async def body() -> AsyncIterator[bytes]:
            async with context, aclosing(console.stream(sid, session, view)) as chunks:
                async for chunk in chunks:
                    yield chunk

        response = Response(body(), content_type="text/event-stream")
        response.timeout = None
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Accel-Buffering"] = "no"
        return response
