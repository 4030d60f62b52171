"""`nexa.s3.S3Client.stream` against a real S3 store (SeaweedFS): whole objects, ranges, and each
refusal typed with its HTTP status and S3 error code; and the client's large socket reads, on a real
loopback socket (the test that fails if an httpx or httpcore upgrade drops them).
"""

from __future__ import annotations

import os
import uuid
from contextlib import aclosing
from typing import Final

import httpx
import pytest
import trio

from nexa.errors import ArtifactRefused, ArtifactUnavailable
from nexa.s3 import client as s3_client
from nexa.s3 import credentials as s3_credentials
from nexa.s3.client import S3Client
from nexa.s3.transport import S3_READ_BYTES
from nexa.sigv4 import S3Credentials
from tests.conftest import free_port
from tests.realparts import S3Store

MiB: Final = 1024**2
#: What httpcore asks a socket for, left to itself.
HTTPCORE_READ_BYTES: Final = 64 * 1024
TIMEOUT_S: Final = 30


def client(s3: S3Store, credentials: S3Credentials | None = None) -> S3Client:
    return S3Client(s3.endpoint, region=s3.region, credentials=credentials or s3.credentials)


async def read_all(c: S3Client, bucket: str, key: str, *, start: int = 0) -> tuple[int, dict[str, str], bytes]:
    async with c.stream(bucket, key, start=start) as response:
        async with aclosing(response.chunks()) as chunks:
            body = b"".join([chunk async for chunk in chunks])
        return response.status, dict(response.headers), body


async def test_stream_gives_the_whole_object_or_the_rest_from_an_offset(s3_store: S3Store) -> None:
    data = os.urandom(3 * MiB + 5)
    key = f"{uuid.uuid4().hex[:12]}/weights.safetensors"
    with trio.fail_after(TIMEOUT_S):
        async with client(s3_store) as c:
            await c.put_bytes(s3_store.bucket, key, data)
            status, _, body = await read_all(c, s3_store.bucket, key)
            assert (status, body) == (200, data)
            status, headers, body = await read_all(c, s3_store.bucket, key, start=MiB + 1)
    assert (status, body) == (206, data[MiB + 1 :])
    assert headers["content-range"] == f"bytes {MiB + 1}-{len(data) - 1}/{len(data)}"


async def test_stream_refusals_carry_the_status_and_the_s3_code(s3_store: S3Store) -> None:
    key = f"{uuid.uuid4().hex[:12]}/config.json"
    wrong = S3Credentials(s3_store.credentials.access_key_id, "not-the-secret")
    with trio.fail_after(TIMEOUT_S):
        async with client(s3_store) as c:
            await c.put_bytes(s3_store.bucket, key, b"{}")
            cases = [
                (c, s3_store.bucket, key + ".missing", 0, 404, "NoSuchKey"),
                (c, "no-such-bucket-" + uuid.uuid4().hex[:8], key, 0, 404, "NoSuchBucket"),
                (c, s3_store.bucket, key, 10, 416, "InvalidRange"),
            ]
            for s3, bucket, k, start, status, code in cases:
                with pytest.raises(ArtifactRefused) as caught:
                    await read_all(s3, bucket, k, start=start)
                assert (caught.value.status, caught.value.s3_code) == (status, code)
                assert caught.value.message == f"S3 GET {bucket}/{k}: {status} {code}"
        async with client(s3_store, wrong) as bad:
            with pytest.raises(ArtifactRefused) as caught:
                await read_all(bad, s3_store.bucket, key)
    assert (caught.value.status, caught.value.s3_code) == (403, "SignatureDoesNotMatch")
    assert "not-the-secret" not in str(caught.value)


async def test_stream_failures_without_a_4xx_are_unavailable() -> None:
    # Fault injection: a 5xx, which SeaweedFS will not give on request; then a closed port.
    def busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, content=b"<Error><Code>SlowDown</Code></Error>")

    async with S3Client("http://s3.invalid", transport=httpx.MockTransport(busy)) as c:
        with pytest.raises(ArtifactUnavailable) as caught:
            await read_all(c, "b", "k")
    assert (caught.value.status, caught.value.s3_code) == (503, "SlowDown")
    async with S3Client(f"http://127.0.0.1:{free_port()}") as c:
        with pytest.raises(ArtifactUnavailable, match=r"did not answer for s3://b/k \(ConnectError\)") as caught:
            await read_all(c, "b", "k")
    assert (caught.value.status, caught.value.s3_code) == (None, "")


async def _chunk_sizes(port: int, s3: bool) -> list[int]:
    url = f"http://127.0.0.1:{port}/b/k"
    if s3:
        async with (
            S3Client(f"http://127.0.0.1:{port}") as c,
            c.stream("b", "k") as response,
            aclosing(response.chunks()) as chunks,
        ):
            return [len(chunk) async for chunk in chunks]
    async with httpx.AsyncClient() as plain, plain.stream("GET", url) as plain_response:
        return [len(chunk) async for chunk in plain_response.aiter_raw()]


async def test_the_client_reads_the_socket_in_large_blocks() -> None:
    """httpcore reads 64 KiB at a time; `S3Client` reads up to `S3_READ_BYTES` through its own network
    backend, wired in through httpx's private `_pool` (`nexa.s3.transport.large_read_transport`). If an
    upgrade drops that wiring, the S3 client's chunks shrink back to 64 KiB and this fails."""
    body = os.urandom(8 * MiB)

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(64 * 1024)  # the request (its content does not matter here)
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, serve, listeners)
            large = await _chunk_sizes(port, s3=True)
            small = await _chunk_sizes(port, s3=False)
            nursery.cancel_scope.cancel()
    assert sum(large) == sum(small) == len(body)
    assert max(small) <= HTTPCORE_READ_BYTES  # what the test tells apart
    assert HTTPCORE_READ_BYTES < max(large) <= S3_READ_BYTES, large


def _annotations(fn: object) -> dict[str, str]:
    """A function's annotations as written (this module's are strings: `from __future__ import annotations`)."""
    return {arg: str(hint) for arg, hint in getattr(fn, "__annotations__", {}).items()}


def test_the_public_api_takes_and_gives_no_httpx_types() -> None:
    """Callers of `nexa.s3` need no httpx: no public name of its client or credentials module is an
    httpx type, and no public function or method takes or returns one. The one exception is the
    fault-injection seam `S3Client(transport=…)` (`InjectedTransport`)."""
    seam = {"InjectedTransport", "transport"}
    found: list[str] = []
    public = [(module, name) for module in (s3_client, s3_credentials) for name in module.__all__]
    for module, name in public:
        if name in seam:
            continue
        obj = getattr(module, name)
        if getattr(obj, "__module__", "").startswith(("httpx", "httpcore")):
            found.append(name)
        members = (
            [m for attr, m in vars(obj).items() if attr == "__init__" or not attr.startswith("_")]
            if isinstance(obj, type)
            else [obj]
        )
        for member in members:
            fn = getattr(member, "__wrapped__", member)  # asynccontextmanager keeps the function here
            for arg, hint in _annotations(fn).items():
                if arg not in seam and ("httpx" in hint or "httpcore" in hint):
                    found.append(f"{name}: {arg}: {hint}")
    assert found == []
    assert {"ObjectStream", "S3Client", "object_url", "signed_headers_for"} <= set(s3_client.__all__)
