"""Signing in to the console over HTTP, as a browser form would (the CSRF token from the page)."""

from __future__ import annotations

import re
from typing import Final

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
