"""Issue 12, points 9 and 13: the sign-in form keeps no server-side state, so anonymous visitors
cannot evict signed-in sessions; the session cookie is `Secure` behind a trusted TLS ingress only.
And the live stream a signed-in page listens to ends with its client, at once.

The app is the real one (`create_app`, a real store and accounts) driven in process by quart's test
client, so 20,000 requests take seconds; one check goes through a real hypercorn listener.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa.config import HttpConfig
from nexa.control import console as con
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.http.api import create_app
from nexa.telemetry import Metrics
from tests.conftest import local_config, start_controller
from tests.support.api import bare_state

_CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')
_LOCAL = {"client": ("127.0.0.1", 40000)}


@attrs.frozen
class _App:
    app: Any
    console: con.Console
    accounts: Accounts
    admin_key: str


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[_App]:
    async with st.open_store(tmp_path / "state") as store:
        yield await _make_app(store, HttpConfig())


async def _make_app(store: st.Store, cfg: HttpConfig) -> _App:
    metrics = Metrics()
    accounts = await Accounts.load(store, metrics)
    admin_key = await accounts.ensure_admin_key(None)
    assert admin_key is not None
    state = bare_state(accounts=accounts, store=store, metrics=metrics, ready=True)
    quart_app = create_app(cfg, state)
    return _App(quart_app, quart_app.extensions["nexa.console"], accounts, admin_key)


def _csrf(html: str) -> str:
    match = _CSRF_RE.search(html)
    assert match, "the page carries no CSRF token"
    return match.group(1)


async def _sign_in(client: Any, key: str, **kw: Any) -> Any:
    form = await client.get("/console/login", scope_base=_LOCAL, **kw)
    assert form.status_code == 200
    token = _csrf(await form.get_data(as_text=True))
    return await client.post("/console/login", form={"csrf_token": token, "api_key": key}, scope_base=_LOCAL, **kw)


@pytest.mark.slow  # about 15 s in process on a busy machine
async def test_20000_anonymous_sign_in_forms_leave_signed_in_sessions_alone(app: _App) -> None:
    admin = app.app.test_client()
    signed_in = await _sign_in(admin, app.admin_key)
    assert signed_in.status_code == 303
    assert app.console.statistics().sessions == 1

    anonymous = app.app.test_client()
    for _ in range(20_000):
        form = await anonymous.get("/console/login", scope_base=_LOCAL)
        assert form.status_code == 200
    assert app.console.statistics().sessions == 1  # the forms created no server-side state

    page = await admin.get("/console/audit", scope_base=_LOCAL)
    assert page.status_code == 200
    assert "console.sign_in" in await page.get_data(as_text=True)
    # And a form fetched among them still signs in.
    assert (await _sign_in(anonymous, app.admin_key)).status_code == 303
    assert app.console.statistics().sessions == 2


async def test_the_sign_in_form_refuses_a_token_it_did_not_issue_or_that_expired(app: _App) -> None:
    client = app.app.test_client()
    form = await client.get("/console/login", scope_base=_LOCAL)
    token = _csrf(await form.get_data(as_text=True))
    cookie = form.headers["Set-Cookie"]
    assert f"{con.LOGIN_COOKIE}={token}" in cookie
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/console/login" in cookie

    async def attempt(csrf: str, login_cookie: str | None) -> int:
        fresh = app.app.test_client()
        headers = {"Cookie": f"{con.LOGIN_COOKIE}={login_cookie}"} if login_cookie is not None else {}
        resp = await fresh.post(
            "/console/login", form={"csrf_token": csrf, "api_key": app.admin_key}, headers=headers, scope_base=_LOCAL
        )
        return int(resp.status_code)

    body, _, mac = token.rpartition(".")
    expired = app.console.login_forms.token(time.time() - con.ANON_TTL_S - 1)
    other = app.console.login_forms.token(time.time())
    assert await attempt(token, None) == 403  # no cookie: a cross-site post (SameSite=Strict) has none
    assert await attempt(token, other) == 403  # the form's token is not the cookie's
    assert await attempt(body + "." + "0" * len(mac), body + "." + "0" * len(mac)) == 403  # not our MAC
    assert await attempt(expired, expired) == 403
    assert await attempt(token, token) == 303
    assert app.console.statistics().sessions == 1


async def test_one_key_signing_in_again_and_again_drops_only_its_own_oldest_sessions(app: _App) -> None:
    first = app.app.test_client()
    assert (await _sign_in(first, app.admin_key)).status_code == 303
    from nexa.contracts.api import KeyCreate
    from nexa.contracts.domain import SYSTEM, Role

    other_key, _ = await app.accounts.create_key(SYSTEM, KeyCreate(role=Role.AUDIT, name="auditor"))
    other = app.app.test_client()
    assert (await _sign_in(other, other_key)).status_code == 303
    for _ in range(con.MAX_SESSIONS_PER_KEY):
        assert (await _sign_in(app.app.test_client(), app.admin_key)).status_code == 303
    assert app.console.statistics().sessions == con.MAX_SESSIONS_PER_KEY + 1
    assert (await first.get("/console/audit", scope_base=_LOCAL)).status_code == 303  # the admin's oldest
    assert (await other.get("/console/audit", scope_base=_LOCAL)).status_code == 200  # another key's: kept


async def test_a_live_stream_left_while_it_sends_closes_at_once_and_leaves_nothing_to_the_collector(
    app: _App,
) -> None:
    """quart closes a response's body when its client goes while a chunk is being sent (the body is
    suspended at its `yield`). Everything under it must close then, not when the collector finds
    it: trio warns about an unexhausted generator it has to close (an error in these tests), and
    the stream would count as open until then. Once, in CI, this was `test_console_in_chromium`."""
    client = app.app.test_client()
    signed_in = await _sign_in(client, app.admin_key)
    assert signed_in.status_code == 303
    session_cookie = next(c for c in signed_in.headers.getlist("Set-Cookie") if c.startswith(f"{con.COOKIE}="))
    headers = {"Cookie": session_cookie.split(";", 1)[0]}
    async with app.app.test_request_context("/console/events/overview", headers=headers, scope_base=_LOCAL):
        response = await app.app.full_dispatch_request()
    assert response.status_code == 200
    assert response.content_type == "text/event-stream"
    # As quart's `_send_response` does, with the send failing after the first chunk.
    async with response.response as body:
        async for chunk in body:
            assert chunk == b"retry: 1000\n\n"
            assert app.console.statistics().live_streams == 1
            break
    assert app.console.statistics().live_streams == 0  # closed by now, before any other task ran
    gc.collect()


@pytest.mark.parametrize(
    ("proxies", "peer", "forwarded", "secure"),
    [
        ((), "127.0.0.1", "https", False),  # no trusted proxy: the header is ignored
        (("127.0.0.1",), "127.0.0.1", "https", True),
        (("127.0.0.0/8",), "::ffff:127.0.0.2", "https", True),
        (("127.0.0.1",), "127.0.0.1", "http", False),
        (("127.0.0.1",), "192.0.2.7", "https", False),  # a peer that is not the proxy cannot claim https
        (("127.0.0.1",), "127.0.0.1", "https, http", False),  # the proxy's own (last) value counts
    ],
)
async def test_the_cookie_is_secure_only_behind_a_trusted_tls_ingress(
    tmp_path: Path, proxies: tuple[str, ...], peer: str, forwarded: str, secure: bool
) -> None:
    async with st.open_store(tmp_path / "state") as store:
        made = await _make_app(store, HttpConfig(trusted_proxies=proxies))
        client = made.app.test_client()
        where = {"client": (peer, 40000)}
        headers = {"X-Forwarded-Proto": forwarded}
        form = await client.get("/console/login", headers=headers, scope_base=where)
        token = _csrf(await form.get_data(as_text=True))
        resp = await client.post(
            "/console/login", form={"csrf_token": token, "api_key": made.admin_key}, headers=headers, scope_base=where
        )
        assert resp.status_code == 303
        for cookie in (form.headers["Set-Cookie"], resp.headers["Set-Cookie"]):
            assert ("; Secure" in cookie) is secure


async def test_a_real_listener_honours_only_its_trusted_proxy(nursery: trio.Nursery, tmp_path: Path) -> None:
    cfg = local_config(tmp_path)
    cfg = attrs.evolve(cfg, http=attrs.evolve(cfg.http, trusted_proxies=("127.0.0.1",)))
    controller = await start_controller(nursery, cfg)
    async with httpx.AsyncClient(base_url=controller.url) as http:
        behind = await http.get("/console/login", headers={"X-Forwarded-Proto": "https"})
        direct = await http.get("/console/login")
    assert "Secure" in behind.headers["set-cookie"]
    assert "Secure" not in direct.headers["set-cookie"]
    controller.stopping.set()


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    from nexa.config import structure_config
    from nexa.errors import ConfigError

    assert structure_config({"trusted_proxies": ["127.0.0.1", "198.51.100.0/24", "::1"]}, HttpConfig).trusted_proxies
    for bad in (["ingress.example"], "127.0.0.1", [1]):
        with pytest.raises(ConfigError):
            structure_config({"trusted_proxies": bad}, HttpConfig)


async def test_the_audit_view_pages_by_cursor(app: _App) -> None:
    from nexa.contracts.domain import SYSTEM

    for n in range(120):
        await app.accounts.record(SYSTEM, "test.event", f"thing/{n:03}")
    client = app.app.test_client()
    assert (await _sign_in(client, app.admin_key)).status_code == 303
    first = await (await client.get("/console/audit", scope_base=_LOCAL)).get_data(as_text=True)
    link = re.search(r'href="(/console/audit\?cursor=(\d+)&amp;[^"]*)"', first)
    assert link, "a full page links to the next one by cursor"
    assert "thing/000" in first and "thing/098" in first and "thing/099" not in first
    second = await (await client.get(link.group(1).replace("&amp;", "&"), scope_base=_LOCAL)).get_data(as_text=True)
    assert "thing/099" in second and "thing/119" in second and "thing/098" not in second
    assert "console.sign_in" in second
    assert "Next page" in first and "Next page" not in second  # the last page links nowhere
    # The old parameter names nothing any more: `after` is ignored, the first page again.
    old = await (await client.get(f"/console/audit?after={link.group(2)}", scope_base=_LOCAL)).get_data(as_text=True)
    assert "thing/000" in old


async def test_control_characters_in_what_a_page_shows_are_escaped(app: _App) -> None:
    """Issue 30 point 8: an audit target (what a client or node chose) with a terminal escape, a bell
    and a right-to-left override reaches the page as visible escapes, never raw."""
    from nexa.contracts.domain import SYSTEM

    await app.accounts.record(SYSTEM, "test.event", "thing/evil\x1b]0;x\x07\u202eliam")
    client = app.app.test_client()
    assert (await _sign_in(client, app.admin_key)).status_code == 303
    page = await (await client.get("/console/audit", scope_base=_LOCAL)).get_data(as_text=True)
    assert "thing/evil\\x1b]0;x\\x07\\u202eliam" in page
    assert not any(c in page for c in "\x1b\x07\u202e")
