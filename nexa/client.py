"""A small synchronous client for the controller's HTTP API, used by the operator CLI.

Answers are decoded into their contract types with the one codec (`client.get(path, NodeList)`),
so a renamed API field breaks the type check, not an operator's terminal. httpx failures and
error envelopes become nexa errors here, so the CLI prints one clear line.

An https controller's certificate is verified against the system's CA store, or the CA file
`NEXA_CA_FILE` names (`tls.ClientTls`); one that does not verify is `CertificateNotTrusted`,
saying what to set, never skipped.
"""

from __future__ import annotations

import json
from typing import Final, TypeVar

import httpx

from nexa import __version__
from nexa.contracts import codec
from nexa.errors import ContractError, RemoteError, Unavailable
from nexa.tls import ClientTls

T = TypeVar("T")
#: Query parameters: a value of None is left out.
Params = dict[str, str | None]

DEFAULT_TIMEOUT_S: Final = 30.0


class ApiClient:
    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        transport: httpx.BaseTransport | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        """`tls`: how an https controller is verified; default `NEXA_CA_FILE` or the system's store."""
        headers = {"User-Agent": f"nexa-cli/{__version__}", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._base_url = base_url.rstrip("/")
        self._tls = tls if tls is not None or not self._base_url.startswith("https:") else ClientTls.from_env()
        self._http = httpx.Client(
            base_url=self._base_url,
            headers=headers,
            timeout=DEFAULT_TIMEOUT_S,
            transport=transport,
            verify=self._tls.context if self._tls is not None else True,
        )

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def get(self, path: str, answer: type[T], *, params: Params | None = None) -> T:
        """`GET path`, its answer decoded into `answer` (a contract type)."""
        return self.request("GET", path, answer, params=params)

    def post(self, path: str, answer: type[T], *, body: object | None = None) -> T:
        return self.request("POST", path, answer, body=body)

    def put(self, path: str, answer: type[T], *, body: object | None = None) -> T:
        return self.request("PUT", path, answer, body=body)

    def delete(self, path: str, answer: type[T]) -> T:
        return self.request("DELETE", path, answer)

    def request(
        self, method: str, path: str, answer: type[T], *, body: object | None = None, params: Params | None = None
    ) -> T:
        """Send one request; return its answer as `answer`, or raise RemoteError / Unavailable
        (ContractError when the answer is not that type's JSON)."""
        resp = self._send(method, path, body=body, params=params)
        try:
            return codec.loads(codec.api, resp.content, answer)
        except ContractError as exc:
            raise ContractError(
                f"the controller's answer to {method} {path} is not a {answer.__name__}: {exc.message}",
                problems=exc.problems,
            ) from None

    def download(self, path: str) -> bytes:
        """`GET path`'s answer as bytes (a backup file), or raise RemoteError / Unavailable."""
        return self._send("GET", path, headers={"Accept": "application/octet-stream"}).content

    def text(self, method: str, path: str, *, params: Params | None = None) -> str:
        """Like `request`, for answers that are not JSON (a CSV export)."""
        return self._send(method, path, params=params, headers={"Accept": "*/*"}).text

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: object | None = None,
        params: Params | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            resp = self._http.request(method, path, json=body, params=query, headers=headers)
        except httpx.TransportError as exc:
            if self._tls is not None and (untrusted := self._tls.not_trusted(exc, self._base_url)) is not None:
                raise untrusted from None
            raise Unavailable(f"cannot reach the controller at {self._base_url}: {type(exc).__name__}") from None
        if resp.is_success:
            return resp
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
