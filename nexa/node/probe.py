"""HTTP probes from the node: `nexa node doctor`'s GET of the controller's /version. The one home of
httpx for them: a probe that gets no answer raises `Unavailable` naming what failed (`ConnectError`,
`ReadTimeout`, …), never an httpx error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import final

import attrs
import httpx

from nexa.errors import Unavailable
from nexa.tls import ClientTls


@attrs.frozen
class ProbeAnswer:
    """A probe's answer, read whole; header names lower-case."""

    status: int
    content: bytes
    headers: Mapping[str, str]


def http_url_host(url: str) -> str:
    """The host of an `http://` or `https://` URL; "" when `url` is not one (or names no host)."""
    if not url.startswith(("http://", "https://")):
        return ""
    try:
        return httpx.URL(url).host
    except httpx.InvalidURL:
        return ""


@final
class HttpProbe:
    """GETs with one timeout, over pooled connections. Use as `async with HttpProbe(…) as probe:`, or
    call `aclose()`. `trust_env`: proxies from the environment (an operator's network, not loopback).
    `tls`: how https servers are verified (default: `NEXA_CA_FILE`, or the system's CA store); a
    certificate that does not verify raises `CertificateNotTrusted`, never skipped."""

    def __init__(self, *, timeout_s: float, trust_env: bool = False, tls: ClientTls | None = None) -> None:
        self._tls = tls if tls is not None else ClientTls.from_env()
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=trust_env, verify=self._tls.context)

    async def __aenter__(self) -> HttpProbe:
        await self._http.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def get(self, url: str, *, headers: Mapping[str, str] | None = None) -> ProbeAnswer:
        """`GET url`, its answer read whole; Unavailable (its message the failure's name) when it gets
        none."""
        try:
            response = await self._http.get(url, headers=headers)
        except httpx.HTTPError as exc:
            if (untrusted := self._tls.not_trusted(exc, url)) is not None:
                raise untrusted from None
            raise Unavailable(type(exc).__name__) from None
        return ProbeAnswer(response.status_code, response.content, dict(response.headers.items()))
