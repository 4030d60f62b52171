"""Signing in to the console over HTTP, as a browser form would (the CSRF token from the page), and
in Chromium (Playwright)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, Final

import httpx

_CSRF_RE: Final = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf(html: str) -> str:
    """The CSRF token a console page carries (fails the test when it carries none)."""
    match = _CSRF_RE.search(html)
    assert match, "the page carries no CSRF token"
    return match.group(1)


async def sign_in(http: httpx.AsyncClient, key: str) -> httpx.Response:
    """POST the sign-in form with `key`; the answer (303 on success) is returned unfollowed."""
    form = await http.get("/console/login")
    assert form.status_code == 200
    return await http.post("/console/login", data={"csrf_token": csrf(form.text), "api_key": key})


#: Debian's headless Chromium and the flags every console browser test launches it with.
CHROMIUM: Final = "/usr/bin/chromium"
CHROMIUM_ARGS: Final = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextlib.contextmanager
def signed_in_page(base_url: str, key: str) -> Iterator[Any]:
    """A Playwright page in Chromium signed in to the console at `base_url` with `key` (sync API:
    call it from one worker thread, as `trio.to_thread.run_sync` does)."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=base_url, viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.set_default_timeout(15_000)
            page.goto("/console/login")
            page.get_by_label("API key").fill(key)
            page.get_by_role("button", name="Sign in").click()
            expect(page).not_to_have_url(re.compile(r"/console/login$"))
            yield page
            context.close()
        finally:
            browser.close()
