"""The artifact cache against a real SeaweedFS S3 store on 127.0.0.1 (the `s3_store` fixture in `tests/realparts.py`).

Policy: loopback only; every I/O test runs under an absolute `trio.fail_after`; objects get
unique keys so tests share one store without seeing each other's data. httpx's MockTransport
appears only for faults a real server will not produce (a body without Content-Length, a
stalled stream, a store that must not be asked at all). The cache writes files in worker
threads, so these tests use real time, never the autojump clock (trio #456).
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import logging
import os
import stat
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa.config import ArtifactsConfig, Bytes
from nexa.contracts.runtime import ArtifactRef
from nexa.errors import ArtifactDigestMismatch, ArtifactError, ArtifactUnavailable, ConfigError
from nexa.node import cache_files
from nexa.node.artifacts import ArtifactCache, ArtifactStatistics
from nexa.node.cache_files import PARTIAL_PREFIX
from nexa.s3.credentials import load_s3_credentials, write_s3_credentials
from nexa.sigv4 import EMPTY_PAYLOAD_SHA256, S3Credentials, canonical_request, sign_v4
from tests.realparts import S3Store
from tests.support.artifacts import Chunks

TIMEOUT_S = 30


class CountingTransport(httpx.AsyncBaseTransport):
    """The real HTTP transport, counting the requests that go through it."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.requests: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def refuse_everything(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"no request expected, got {request.method} {request.url}")


def config(store: S3Store | None = None, **overrides: Any) -> ArtifactsConfig:
    cfg = ArtifactsConfig(s3_endpoint=store.endpoint if store else "http://s3.invalid", s3_region="us-east-1")
    return attrs.evolve(cfg, **overrides)


def ref_for(uri: str, data: bytes, **overrides: Any) -> ArtifactRef:
    ref = ArtifactRef(uri=uri, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    return attrs.evolve(ref, **overrides)


def unique(name: str) -> str:
    return f"{uuid.uuid4().hex[:12]}/{name}"


def cache_listing(state_dir: Path) -> list[str]:
    return sorted(p.name for p in (state_dir / "artifacts").iterdir())


def stats(
    *,
    hits: int = 0,
    downloads: int = 0,
    bytes_downloaded: int = 0,
    mismatches: int = 0,
    evictions: int = 0,
    cache_bytes: int = 0,
) -> ArtifactStatistics:
    return ArtifactStatistics(
        hits=hits,
        downloads=downloads,
        bytes_downloaded=bytes_downloaded,
        mismatches=mismatches,
        evictions=evictions,
        cache_bytes=cache_bytes,
    )


# --- the signer -----------------------------------------------------------------------------------


def test_sign_v4_matches_the_aws_get_object_example() -> None:
    # "Example: GET Object" of the AWS S3 docs (sig-v4-header-based-auth): the first 10 bytes of
    # examplebucket/test.txt, signed with the example key pair at 2013-05-24T00:00:00Z.
    creds = S3Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    headers = sign_v4(
        method="GET",
        host="examplebucket.s3.amazonaws.com",
        raw_path="/test.txt",
        headers={"Range": "bytes=0-9"},
        payload_sha256=EMPTY_PAYLOAD_SHA256,
        credentials=creds,
        region="us-east-1",
        now=datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC),
    )
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )
    assert headers["x-amz-date"] == "20130524T000000Z"
    assert headers["x-amz-content-sha256"] == EMPTY_PAYLOAD_SHA256
    # The intermediate value the example also documents: the hash of the canonical request.
    signed = {k: v for k, v in headers.items() if k != "authorization"}
    creq, signed_headers = canonical_request(
        method="GET", raw_path="/test.txt", headers=signed, payload_sha256=EMPTY_PAYLOAD_SHA256
    )
    assert signed_headers == "host;range;x-amz-content-sha256;x-amz-date"
    assert (
        hashlib.sha256(creq.encode()).hexdigest() == "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972"
    )


def test_credentials_repr_hides_the_secret() -> None:
    creds = S3Credentials("AKID", "very-secret-value")
    assert "very-secret-value" not in repr(creds)
    assert "AKID" in repr(creds)


# --- credentials files ----------------------------------------------------------------------------


def test_load_credentials_reads_a_good_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "s3.json"
    path.write_text(json.dumps({"access_key_id": "AKID", "secret_access_key": "s3cr3t"}))
    path.chmod(0o600)
    assert load_s3_credentials(path) == S3Credentials("AKID", "s3cr3t")
    assert not caplog.records


def test_written_credentials_are_owner_only_and_read_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_s3_credentials(tmp_path / "s3.json", S3Credentials("AKID", "s3cr3t"))
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_s3_credentials(path) == S3Credentials("AKID", "s3cr3t")
    assert not caplog.records


def test_load_credentials_warns_about_a_file_others_can_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "s3.json"
    path.write_text(json.dumps({"access_key_id": "AKID", "secret_access_key": "s3cr3t"}))
    path.chmod(0o644)
    load_s3_credentials(path)
    assert "readable by other users" in caplog.text
    assert "s3cr3t" not in caplog.text


def test_load_credentials_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read S3 credentials file .*missing\.json: No such file"):
        load_s3_credentials(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"access_key_id": "AKID", "secret_access_key": "s3cr3t-in-broken-json"', "not valid JSON (line 1"),
        ('["AKID", "s3cr3t-in-a-list"]', "must hold a JSON object"),
        ('{"access_key_id": "AKID"}', "secret_access_key is missing"),
        ('{"access_key_id": "", "secret_access_key": "s3cr3t-with-empty-id"}', "access_key_id must be a non-empty"),
        ('{"access_key_id": "AKID", "secret_access_key": 12345}', "secret_access_key must be a non-empty string"),
        ('{"access_key_id": "AKID", "secret_access_key": "s3cr3t-x", "token": "t"}', "unknown key 'token'"),
    ],
)
def test_load_credentials_rejects_a_malformed_file(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "s3.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_s3_credentials(path)
    assert problem in info.value.message
    assert str(path) in info.value.message
    assert "s3cr3t" not in info.value.message


# --- fetching from the real store -----------------------------------------------------------------


async def test_fetch_verifies_caches_and_shares_by_digest(s3_store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    with trio.fail_after(TIMEOUT_S):
        # A space and a '+' in the key: the signed path must be encoded exactly as it is sent.
        uri = await s3_store.put(unique("tiny model+v1/weights.gguf"), data)
        ref = ref_for(uri, data)
        transport = CountingTransport()
        async with ArtifactCache(
            config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials, transport=transport
        ) as cache:
            path = await cache.fetch(ref)
            assert path == tmp_path / "artifacts" / ref.sha256
            assert path.read_bytes() == data
            assert stat.S_IMODE(path.stat().st_mode) == 0o444
            assert await cache.fetch(ref) == path
            # Another deployment naming the same bytes (under a key that does not even exist)
            # gets the same file without a request: the cache is addressed by digest.
            other = attrs.evolve(ref, uri=s3_store.uri("never/uploaded"), mount_path="/models/other")
            assert await cache.fetch(other) == path
        assert len(transport.requests) == 1
        assert cache.statistics() == stats(hits=2, downloads=1, bytes_downloaded=len(data), cache_bytes=len(data))
        assert cache_listing(tmp_path) == [ref.sha256]

        # A restarted agent finds the verified file and asks the store nothing.
        async with ArtifactCache(
            config(s3_store), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(refuse_everything)
        ) as restarted:
            assert await restarted.fetch(ref) == path
        assert restarted.statistics() == stats(hits=1, cache_bytes=len(data))


async def test_a_tampered_object_is_rejected_and_leaves_nothing(s3_store: S3Store, tmp_path: Path) -> None:
    published = os.urandom(200_000)
    tampered = bytearray(published)
    tampered[100_000] ^= 0xFF
    with trio.fail_after(TIMEOUT_S):
        uri = await s3_store.put(unique("model.gguf"), bytes(tampered))
        ref = ref_for(uri, published)
        async with ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials) as cache:
            with pytest.raises(ArtifactDigestMismatch) as info:
                await cache.fetch(ref)
    assert info.value.code == "artifact_digest_mismatch"
    assert ref.sha256 in info.value.message
    assert hashlib.sha256(tampered).hexdigest() in info.value.message
    assert cache_listing(tmp_path) == []  # neither the artifact nor a partial file
    assert cache.statistics() == stats(mismatches=1, bytes_downloaded=len(tampered))


async def test_an_object_larger_than_declared_is_refused_before_its_body(s3_store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(1024 * 1024)
    with trio.fail_after(TIMEOUT_S):
        uri = await s3_store.put(unique("big.gguf"), data)
        ref = ref_for(uri, data[:1000])  # the declared size is smaller than the object
        async with ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials) as cache:
            with pytest.raises(ArtifactDigestMismatch, match="holds 1048576 bytes, the assignment declares 1000"):
                await cache.fetch(ref)
    # Content-Length already gave it away: not one body byte was read.
    assert cache.statistics() == stats(mismatches=1)
    assert cache_listing(tmp_path) == []


# Leaving a response stream early strands httpx's inner async generators, which trio then
# finalizes with a ResourceWarning (encode/httpx#3686); the cache itself closes its iterator.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx\\.:ResourceWarning")
async def test_a_stream_without_length_is_cut_off_at_the_first_extra_byte(tmp_path: Path) -> None:
    chunk = b"\x00" * 65536
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(1000):
            sent += 1
            yield chunk

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=endless())  # chunked: no Content-Length

    declared = 100_000
    ref = ArtifactRef(uri="s3://bucket/endless", sha256="0" * 64, size_bytes=declared)
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(
            config(), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(handler)
        ) as cache:
            with pytest.raises(ArtifactDigestMismatch, match="more than the declared 100000 bytes"):
                await cache.fetch(ref)
    assert sent == 2  # aborted on the chunk that crossed the declared size
    assert cache.statistics().bytes_downloaded == 2 * len(chunk)
    assert cache_listing(tmp_path) == []


async def test_a_download_cancelled_before_any_write_leaves_no_partial_file(tmp_path: Path) -> None:
    # Less than one write block arrived, so nothing reached the disk; a partial file with bytes in
    # it is kept for the next attempt to resume (test_artifact_manifests.py).
    async def stalls() -> AsyncIterator[bytes]:
        yield b"\x00" * 1000
        await trio.sleep_forever()

    requests = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal requests
        requests += 1
        return httpx.Response(200, content=stalls())

    ref = ArtifactRef(uri="s3://bucket/stalls", sha256="0" * 64, size_bytes=10_000)
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(
            config(), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(handler)
        ) as cache:
            with trio.move_on_after(0.5) as scope:
                await cache.fetch(ref)
            assert scope.cancelled_caught
            assert cache_listing(tmp_path) == []
            # The digest's slot was released: a second attempt gets as far as the store again.
            with trio.move_on_after(0.2):
                await cache.fetch(ref)
    assert requests == 2
    assert cache_listing(tmp_path) == []


@pytest.mark.filterwarnings("ignore:Async generator 'httpx\\.:ResourceWarning")  # as above
async def test_a_full_disk_is_an_artifact_error_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(10 * 1024 * 1024)  # several write blocks

    def full_disk(self: object, chunks: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cache_files.PartFile, "write", full_disk)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=Chunks(data)))
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(config(), state_dir=tmp_path, credentials=None, transport=transport) as cache:
            with pytest.raises(ArtifactError, match="cannot store s3://b/k in the artifact cache: No space left"):
                await cache.fetch(ref_for("s3://b/k", data))
    assert cache_listing(tmp_path) == []
    assert cache.statistics().downloads == 0


async def test_a_wrong_secret_is_reported_without_the_secret(
    s3_store: S3Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    data = os.urandom(10_000)
    wrong = S3Credentials(s3_store.credentials.access_key_id, "not-the-secret-but-still-a-secret-4711")
    with trio.fail_after(TIMEOUT_S):
        uri = await s3_store.put(unique("model.gguf"), data)
        async with ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=wrong) as cache:
            with pytest.raises(ArtifactUnavailable) as info:
                await cache.fetch(ref_for(uri, data))
    message = info.value.message
    assert "refused the request signature" in message
    assert "SignatureDoesNotMatch" in message
    assert info.value.retryable
    for secret in (wrong.secret_access_key, s3_store.credentials.secret_access_key):
        assert secret not in message
        assert secret not in repr(info.value)
        assert secret not in caplog.text
    assert "authorization" not in caplog.text.lower()
    assert cache_listing(tmp_path) == []


async def test_an_unknown_access_key_is_named_as_such(s3_store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(1000)
    with trio.fail_after(TIMEOUT_S):
        uri = await s3_store.put(unique("model.gguf"), data)
        creds = S3Credentials("nobody-knows-this-key", "whatever-secret")
        async with ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=creds) as cache:
            with pytest.raises(ArtifactUnavailable, match="does not know the configured access key id"):
                await cache.fetch(ref_for(uri, data))


@pytest.mark.parametrize(("bucket", "code"), [("nexa-models", "NoSuchKey"), ("no-such-bucket", "NoSuchBucket")])
async def test_a_missing_object_is_unavailable(s3_store: S3Store, tmp_path: Path, bucket: str, code: str) -> None:
    ref = ref_for(f"s3://{bucket}/{unique('never-uploaded.gguf')}", b"anything")
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials) as cache:
            with pytest.raises(ArtifactUnavailable) as info:
                await cache.fetch(ref)
    assert info.value.message == f"{ref.uri} does not exist in the S3 store (404 {code})"
    assert cache_listing(tmp_path) == []
    assert cache.statistics() == stats()


async def test_anonymous_access_is_denied_with_a_hint(s3_store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(1000)
    with trio.fail_after(TIMEOUT_S):
        uri = await s3_store.put(unique("model.gguf"), data)
        async with ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=None) as cache:
            with pytest.raises(ArtifactUnavailable, match=r"denied access .* no S3 credentials are configured"):
                await cache.fetch(ref_for(uri, data))


async def test_an_unreachable_store_is_unavailable(tmp_path: Path) -> None:
    # A port nothing listens on: bind one, note it, close it.
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = config(s3_endpoint=f"http://127.0.0.1:{port}")
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(cfg, state_dir=tmp_path, credentials=None) as cache:
            with pytest.raises(ArtifactUnavailable, match=r"did not answer for s3://b/k \(ConnectError\)"):
                await cache.fetch(ref_for("s3://b/k", b"x"))


async def test_no_endpoint_configured_is_unavailable(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(config(s3_endpoint=""), state_dir=tmp_path, credentials=None) as cache:
            with pytest.raises(ArtifactUnavailable, match=r"artifacts\.s3_endpoint"):
                await cache.fetch(ref_for("s3://b/k", b"x"))


async def test_concurrent_fetches_of_one_digest_share_one_download(s3_store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(8 * 1024 * 1024)
    with trio.fail_after(TIMEOUT_S):
        uri = await s3_store.put(unique("shared.gguf"), data)
        ref = ref_for(uri, data)
        transport = CountingTransport()
        paths: list[Path] = []

        async def fetch() -> None:
            paths.append(await cache.fetch(ref))

        async with (
            ArtifactCache(
                config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials, transport=transport
            ) as cache,
            trio.open_nursery() as nursery,
        ):
            for _ in range(3):
                nursery.start_soon(fetch)
    assert len(transport.requests) == 1
    assert paths == [tmp_path / "artifacts" / ref.sha256] * 3
    assert cache.statistics() == stats(hits=2, downloads=1, bytes_downloaded=len(data), cache_bytes=len(data))


# --- eviction -------------------------------------------------------------------------------------


async def upload_three(store: S3Store) -> list[tuple[ArtifactRef, bytes]]:
    out = []
    for name in ("a", "b", "c"):
        data = os.urandom(1000)
        out.append((ref_for(await store.put(unique(f"{name}.gguf"), data), data), data))
    return out


async def test_eviction_drops_the_least_recently_used_but_never_a_pinned_one(s3_store: S3Store, tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        (a, _), (b, _), (c, _) = await upload_three(s3_store)
        cfg = config(s3_store, cache_max_bytes=Bytes(2500))
        async with ArtifactCache(cfg, state_dir=tmp_path, credentials=s3_store.credentials) as cache:
            cache.pin(a.sha256)  # pinned before its fetch, so there is no window to evict it in
            await cache.fetch(a)
            await cache.fetch(b)
            await cache.fetch(c)  # A is the oldest, but pinned: B makes room
            assert cache_listing(tmp_path) == sorted([a.sha256, c.sha256])
            assert cache.statistics().evictions == 1

            cache.unpin(a.sha256)
            await cache.fetch(b)  # downloaded again; now A is the least recently used unpinned one
            assert cache_listing(tmp_path) == sorted([b.sha256, c.sha256])
            assert cache.statistics() == stats(downloads=4, bytes_downloaded=4000, evictions=2, cache_bytes=2000)


async def test_a_cache_hit_counts_as_a_use(s3_store: S3Store, tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        (a, _), (b, _), (c, _) = await upload_three(s3_store)
        cfg = config(s3_store, cache_max_bytes=Bytes(2500))
        async with ArtifactCache(cfg, state_dir=tmp_path, credentials=s3_store.credentials) as cache:
            await cache.fetch(a)
            await cache.fetch(b)
            await cache.fetch(a)  # hit: A is now more recent than B
            await cache.fetch(c)
    assert cache_listing(tmp_path) == sorted([a.sha256, c.sha256])


def place(cache_dir: Path, data: bytes, *, mtime_s: float) -> str:
    """Put a verified file in a cache directory as a previous run would have left it."""
    sha = hashlib.sha256(data).hexdigest()
    (cache_dir / sha).write_bytes(data)
    os.utime(cache_dir / sha, (mtime_s, mtime_s))
    return sha


async def test_a_restarted_cache_evicts_in_the_order_of_the_file_times(tmp_path: Path) -> None:
    cache_dir = tmp_path / "shared-cache"
    cache_dir.mkdir()
    oldest = place(cache_dir, b"1" * 1000, mtime_s=1_000_000)
    newest = place(cache_dir, b"2" * 1000, mtime_s=3_000_000)
    middle = place(cache_dir, b"3" * 1000, mtime_s=2_000_000)
    (cache_dir / f"{PARTIAL_PREFIX}{'9' * 16}-crashed").write_bytes(b"half")
    (cache_dir / "README").write_text("not ours")
    cfg = config(cache_dir=str(cache_dir), cache_max_bytes=Bytes(2500))
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(
            cfg, state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(refuse_everything)
        ) as cache:
            assert not (cache_dir / f"{PARTIAL_PREFIX}{'9' * 16}-crashed").exists()
            assert cache.statistics().cache_bytes == 3000
            cache.pin(oldest)
            cache.pin(oldest)
            cache.unpin(oldest)  # pins are counted: still pinned once
            cache.unpin(middle)  # never pinned: a no-op
            assert await cache.evict() == 1000  # the oldest unpinned one is enough
            assert await cache.evict() == 0
    assert middle not in {p.name for p in cache_dir.iterdir()}
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted(["README", oldest, newest])
    assert cache.statistics() == stats(evictions=1, cache_bytes=2000)


async def test_a_size_that_contradicts_the_cached_file_is_a_mismatch(tmp_path: Path) -> None:
    cache_dir = tmp_path / "artifacts"
    cache_dir.mkdir()
    data = b"model bytes" * 100
    sha = place(cache_dir, data, mtime_s=1_000_000)
    ref = ArtifactRef(uri="s3://b/k", sha256=sha, size_bytes=len(data) + 1)
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(
            config(), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(refuse_everything)
        ) as cache:
            with pytest.raises(ArtifactDigestMismatch, match="declared size"):
                await cache.fetch(ref)
    assert (cache_dir / sha).read_bytes() == data  # the verified file stays for whoever uses it
