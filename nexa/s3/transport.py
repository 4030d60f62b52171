"""Large socket reads for the S3 client: an httpx transport whose connections read `S3_READ_BYTES`
at a time, through httpcore's network-backend extension point. Used by `nexa.s3.client` only.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Final

import httpcore
import httpx

#: What one socket read of an S3 answer asks for. httpcore asks for 64 KiB, and at a few GB/s the
#: per-read cost (h11 event, httpx chunk, trio checkpoint) is what limits a download. On loopback
#: (`perf/artifacts.py`, 2 CPUs) 256 KiB reads took the node's fetch from ~56 % to ~70 % of
#: parallel curl, as 1 MiB reads did, but with a peak RSS of 55 MiB instead of 72 MiB: each
#: download holds a few received chunks, and a chunk is at most one read.
S3_READ_BYTES: Final = 256 * 1024
#: httpx's defaults (`httpx.Limits()`), for the connection pool built here.
_MAX_CONNECTIONS: Final = 100
_MAX_KEEPALIVE: Final = 20
_KEEPALIVE_EXPIRY_S: Final = 5.0


class _LargeReadStream(httpcore.AsyncNetworkStream):
    """A connection whose reads ask for at least `S3_READ_BYTES` (a read still returns what the
    socket holds, so small answers are not delayed)."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109 - httpcore's signature
        return await self._inner.read(max(max_bytes, S3_READ_BYTES), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 - httpcore's signature
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
    ) -> httpcore.AsyncNetworkStream:
        return _LargeReadStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> object:
        return self._inner.get_extra_info(info)


class _LargeReads(httpcore.AsyncNetworkBackend):
    """httpcore's trio backend (nexa runs under trio only), its connections `_LargeReadStream`s:
    httpcore's documented extension point for the network layer."""

    def __init__(self) -> None:
        self._inner = httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _LargeReadStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _LargeReadStream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def large_read_transport(*, tls_verify: bool, trust_env: bool) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose connections read `S3_READ_BYTES` at a time.

    httpx has no public way to give its transport a network backend, so this replaces the
    transport's private connection pool (`_pool`) with one built on `_LargeReads`: the one
    private attribute used, here only. `tests/test_s3_client.py` fails if an httpx or httpcore
    upgrade drops it (a body of several MiB must arrive in reads larger than 64 KiB).
    """
    # trust_env: SSL_CERT_FILE and SSL_CERT_DIR name the CA certificates, as for any httpx client.
    ssl_context = httpx.create_ssl_context(verify=tls_verify, trust_env=trust_env)
    transport = httpx.AsyncHTTPTransport(verify=ssl_context)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=ssl_context,
        max_connections=_MAX_CONNECTIONS,
        max_keepalive_connections=_MAX_KEEPALIVE,
        keepalive_expiry=_KEEPALIVE_EXPIRY_S,
        network_backend=_LargeReads(),
    )
    return transport
