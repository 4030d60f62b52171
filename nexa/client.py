"""A small synchronous client for the controller's HTTP API, used by the operator CLI.

httpx failures and error envelopes become nexa errors here, so the CLI prints one clear line.
"""

from __future__ import annotations

import json
from typing import Any, Final

import httpx

from nexa import __version__
from nexa.errors import RemoteError, Unavailable

DEFAULT_TIMEOUT_S: Final = 30.0


class ApiClient:
    def __init__(self, base_url: str, token: str | None, *, transport: httpx.BaseTransport | None = None) -> None:
        headers = {"User-Agent": f"nexa-cli/{__version__}", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self._base_url, headers=headers, timeout=DEFAULT_TIMEOUT_S, transport=transport
        )

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def call(self, method: str, path: str, *, body: object | None = None, params: dict[str, str] | None = None) -> Any:
        """Send one request; return the decoded JSON body, or raise RemoteError / Unavailable."""
        try:
            resp = self._http.request(method, path, json=body, params=params)
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach the controller at {self._base_url}: {type(exc).__name__}") from None
        if resp.is_success:
            return resp.json() if resp.content else None
        raise _remote_error(resp)

    def text(self, method: str, path: str, *, params: dict[str, str] | None = None) -> str:
        """Like `call`, for answers that are not JSON (a CSV export)."""
        try:
            resp = self._http.request(method, path, params=params, headers={"Accept": "*/*"})
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach the controller at {self._base_url}: {type(exc).__name__}") from None
        if resp.is_success:
            return resp.text
        raise _remote_error(resp)


def _remote_error(resp: httpx.Response) -> RemoteError:
    try:
        err = resp.json()["error"]
        return RemoteError(
            str(err["message"]),
            remote_code=str(err["code"]),
            status=resp.status_code,
            request_id=err.get("request_id"),
        )
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        return RemoteError(
            f"HTTP {resp.status_code} without an error envelope",
            remote_code="http_error",
            status=resp.status_code,
            request_id=resp.headers.get("X-Request-Id"),
        )
