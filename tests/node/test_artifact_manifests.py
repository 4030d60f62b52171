"""Manifests in the node's artifact cache, against a real SeaweedFS S3 store on 127.0.0.1.

Every file of a manifest is a blob in the content-addressed cache; `fetch` assembles the model
directory from hard links and the supervisor mounts it read-only. Policy as in `test_artifacts.py`:
loopback only, an absolute `trio.fail_after` around all I/O, unique keys per test, real time (the
cache works in threads). httpx's MockTransport appears only for answers SeaweedFS will not give
(a store that ignores or garbles a Range request, stalled bodies to count parallel downloads).
A small tmpfs (root only) is the full disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa.config import ArtifactsConfig, Bytes, NodeConfig, load
from nexa.contracts import wire
from nexa.contracts.manifest import ArtifactFile, Manifest
from nexa.contracts.runtime import ArtifactRef
from nexa.errors import ArtifactDigestMismatch, ConfigError, InsufficientDisk
from nexa.node.artifacts import ArtifactCache
from nexa.node.cache_files import MANIFESTS_DIR, PARTIAL_PREFIX
from nexa.node.supervisor import Supervisor
from tests.realparts import IN_CI, BuiltImages, FakeGpu, PodmanService, S3Store
from tests.support.agent_process import AgentProcess, beat_until, busybox_runtime, podman, state_is
from tests.support.artifacts import Chunks
from tests.support.nodes import FakeController, aset
from tests.support.supervisor import CFG, IMAGE, FakePodman, runtime

TIMEOUT_S = 60
RS = wire.RuntimeState
MiB = 1024 * 1024


# --- helpers --------------------------------------------------------------------------------------


@attrs.define
class Seen:
    path: str
    range: str | None
    status: int


class Recording(httpx.AsyncBaseTransport):
    """The real HTTP transport, recording each request; optionally stalling the first body of the
    object `stall` after `stall_after` bytes (as a connection that hangs midway would)."""

    def __init__(self, *, stall: str = "", stall_after: int | None = None) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.seen: list[Seen] = []
        self.stall, self.stall_after = stall, stall_after
        self.stalled = trio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        self.seen.append(Seen(request.url.path, request.headers.get("range"), response.status_code))
        if self.stall_after is None or not request.url.path.endswith(self.stall):
            return response
        limit, self.stall_after = self.stall_after, None
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Stalling(response.stream, limit, self.stalled),  # type: ignore[arg-type]
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Stalling(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, limit: int, stalled: trio.Event) -> None:
        self._inner, self._limit, self._stalled = inner, limit, stalled

    async def __aiter__(self) -> AsyncIterator[bytes]:
        sent = 0
        async for chunk in self._inner:
            yield chunk
            sent += len(chunk)
            if sent >= self._limit:
                self._stalled.set()
                await trio.sleep_forever()

    async def aclose(self) -> None:
        await self._inner.aclose()


def config(store: S3Store | None = None, **overrides: Any) -> ArtifactsConfig:
    cfg = ArtifactsConfig(s3_endpoint=store.endpoint if store else "http://s3.invalid", s3_region="us-east-1")
    return attrs.evolve(cfg, **overrides)


def prefix() -> str:
    return f"{uuid.uuid4().hex[:12]}/model/"


def manifest_ref(uri: str, files: dict[str, bytes], *, entry: str = ".", name: str = "tiny") -> ArtifactRef:
    listed = [ArtifactFile(path=p, size_bytes=len(d), sha256=hashlib.sha256(d).hexdigest()) for p, d in files.items()]
    manifest = Manifest(files=tuple(listed), entry=entry)
    return ArtifactRef(
        uri=uri,
        sha256=manifest.digest,
        size_bytes=manifest.size_bytes,
        files=listed,
        entry=entry,
        mount_path=f"/models/{name}",
    )


async def upload(store: S3Store, files: dict[str, bytes], *, at: str | None = None) -> ArtifactRef:
    at = at or prefix()
    for path, data in files.items():
        await store.put(at + path, data)
    return manifest_ref(store.uri(at), files)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def hf_model(shards: int = 3, shard_bytes: int = 300_000) -> dict[str, bytes]:
    files = {
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "tokenizer.json": os.urandom(5000),
        "tokenizer/special_tokens_map.json": b"{}",
    }
    for i in range(1, shards + 1):
        files[f"model-{i:05d}-of-{shards:05d}.safetensors"] = os.urandom(shard_bytes)
    return files


# --- fetch and assemble ---------------------------------------------------------------------------


async def test_a_manifest_is_fetched_into_blobs_and_assembled_with_hard_links(
    s3_store: S3Store, tmp_path: Path
) -> None:
    files = hf_model()
    files["copy-of-config.json"] = files["config.json"]  # two paths, one blob
    with trio.fail_after(TIMEOUT_S):
        ref = await upload(s3_store, files)
        transport = Recording()
        async with ArtifactCache(
            config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials, transport=transport
        ) as cache:
            path = await cache.fetch(ref)
            assert path == tmp_path / "models" / ref.sha256
            for rel, data in files.items():
                inside = path / rel
                assert inside.read_bytes() == data
                blob = tmp_path / "artifacts" / sha(data)
                assert inside.stat().st_ino == blob.stat().st_ino  # a hard link, not a copy
                assert stat.S_IMODE(inside.stat().st_mode) == 0o444
            assert (path / "tokenizer").is_dir()
            assert len(transport.seen) == len(files) - 1  # the duplicate is one download
            # The manifest is kept outside the mounted directory, as its canonical bytes.
            kept = tmp_path / "artifacts" / MANIFESTS_DIR / f"{ref.sha256}.json"
            assert kept.read_bytes() == ref.manifest().canonical_bytes()
            assert json.loads(kept.read_bytes())["schema"] == "nexa.manifest/v1"
            assert not any(p.name.startswith(".") for p in (tmp_path / "models").iterdir())
            assert await cache.fetch(ref) == path  # a hit: no request
        assert len(transport.seen) == len(files) - 1
        s = cache.statistics()
        assert (s.downloads, s.hits, s.manifests) == (len(files) - 1, 1, 1)
        assert s.cache_bytes == sum(ref.manifest().blobs().values()) == ref.size_bytes - len(files["config.json"])
        assert set(s.blob_downloads.values()) == {1}

        # A restarted agent finds the directory and its manifest, and asks the store nothing.
        async with ArtifactCache(
            config(s3_store), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(refuse)
        ) as restarted:
            assert restarted.statistics().manifests == 1
            assert await restarted.fetch(ref) == path


def refuse(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"no request expected, got {request.method} {request.url}")


async def test_two_manifests_sharing_a_shard_download_it_once(s3_store: S3Store, tmp_path: Path) -> None:
    shared = os.urandom(400_000)
    v1 = {"config.json": b'{"v": 1}', "shared.safetensors": shared, "head-v1.safetensors": os.urandom(1000)}
    v2 = {"config.json": b'{"v": 2}', "shared.safetensors": shared, "head-v2.safetensors": os.urandom(1000)}
    with trio.fail_after(TIMEOUT_S):
        ref1, ref2 = await upload(s3_store, v1), await upload(s3_store, v2)
        transport = Recording()
        async with (
            ArtifactCache(
                config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials, transport=transport
            ) as cache,
            trio.open_nursery() as nursery,
        ):
            # Both at once: the second waits for the first's download of the shard.
            nursery.start_soon(cache.fetch, ref1)
            nursery.start_soon(cache.fetch, ref2)
    assert cache.statistics().blob_downloads[sha(shared)] == 1
    assert sum(s.path.endswith("/shared.safetensors") for s in transport.seen) == 1  # either prefix
    assert len(transport.seen) == 5
    one = (tmp_path / "models" / ref1.sha256 / "shared.safetensors").stat()
    two = (tmp_path / "models" / ref2.sha256 / "shared.safetensors").stat()
    assert one.st_ino == two.st_ino
    assert cache.statistics().manifests == 2


async def test_at_most_parallel_downloads_run_at_once(tmp_path: Path) -> None:
    started: list[str] = []
    release = trio.Event()
    files = {f"shard-{i}.bin": os.urandom(1000) for i in range(5)}
    by_path = {f"/b/m/{p}": d for p, d in files.items()}

    async def body(data: bytes) -> AsyncIterator[bytes]:
        await release.wait()
        yield data

    def handler(request: httpx.Request) -> httpx.Response:
        started.append(request.url.path)
        data = by_path[request.url.path]
        return httpx.Response(200, headers={"content-length": str(len(data))}, content=body(data))

    ref = manifest_ref("s3://b/m/", files)
    with trio.fail_after(TIMEOUT_S):
        async with (
            ArtifactCache(
                config(parallel_downloads=2),
                state_dir=tmp_path,
                credentials=None,
                transport=httpx.MockTransport(handler),
            ) as cache,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(cache.fetch, ref)
            await trio.sleep(0.5)
            assert len(started) == 2
            release.set()
    assert len(started) == 5
    assert cache.statistics().downloads == 5


# --- resume ---------------------------------------------------------------------------------------


# Leaving a response stream early strands httpx's inner async generators, which trio then
# finalizes with a ResourceWarning (encode/httpx#3686); the cache itself closes its iterator.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx\\.:ResourceWarning")
@pytest.mark.filterwarnings("ignore:Async generator 'httpcore\\.:ResourceWarning")
async def test_a_download_cancelled_midway_resumes_with_a_range(
    s3_store: S3Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="nexa.node.artifacts")
    big = os.urandom(8 * MiB)
    files = {"config.json": b"{}", "weights.safetensors": big}
    with trio.fail_after(TIMEOUT_S):
        ref = await upload(s3_store, files)
        transport = Recording(stall="/weights.safetensors", stall_after=3 * MiB)
        cfg = config(s3_store)
        partial = tmp_path / "artifacts" / f"{PARTIAL_PREFIX}{sha(big)}"
        async with ArtifactCache(cfg, state_dir=tmp_path, credentials=s3_store.credentials, transport=transport) as c:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(c.fetch, ref)
                    await transport.stalled.wait()
                    while True:  # until the writer thread has landed some of the blocks received
                        if partial.exists() and partial.stat().st_size >= 2 * MiB:
                            break
                        await trio.sleep(0.01)
                    scope.cancel()
            kept = partial.stat().st_size
            assert 2 * MiB <= kept < len(big)
            assert not (tmp_path / "models").exists() or listing(tmp_path / "models") == []

            path = await c.fetch(ref)
        assert (path / "weights.safetensors").read_bytes() == big
        ranged = [s for s in transport.seen if s.range is not None]
        assert ranged == [Seen(ranged[0].path, f"bytes={kept}-", 206)]
        stats = c.statistics()
        assert stats.resumed == 1
        assert stats.bytes_downloaded < 2 * ref.size_bytes
        assert not partial.exists()
        assert f"resuming {sha(big)} at {kept} bytes" in caplog.text


async def test_a_partial_file_left_by_a_killed_agent_is_resumed(s3_store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(3 * MiB + 17)
    with trio.fail_after(TIMEOUT_S):
        ref = await upload(s3_store, {"model.gguf": data})
        cache_dir = tmp_path / "artifacts"
        cache_dir.mkdir()
        (cache_dir / f"{PARTIAL_PREFIX}{sha(data)}").write_bytes(data[: MiB + 5])  # what SIGKILL left
        transport = Recording()
        async with ArtifactCache(
            config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials, transport=transport
        ) as cache:
            path = await cache.fetch(ref)
    assert (path / "model.gguf").read_bytes() == data
    assert [(s.range, s.status) for s in transport.seen] == [(f"bytes={MiB + 5}-", 206)]
    assert cache.statistics().bytes_downloaded == len(data) - MiB - 5


async def test_a_corrupt_partial_file_fails_the_digest_and_leaves_nothing(s3_store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(2 * MiB)
    with trio.fail_after(TIMEOUT_S):
        ref = await upload(s3_store, {"model.gguf": data})
        cache_dir = tmp_path / "artifacts"
        cache_dir.mkdir()
        (cache_dir / f"{PARTIAL_PREFIX}{sha(data)}").write_bytes(os.urandom(1000))  # not the object's prefix
        async with ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials) as cache:
            with pytest.raises(ArtifactDigestMismatch, match=r"model\.gguf"):
                await cache.fetch(ref)
            assert listing(cache_dir) == []
            path = await cache.fetch(ref)  # the next attempt starts clean
    assert (path / "model.gguf").read_bytes() == data


@pytest.mark.filterwarnings("ignore:Async generator 'httpx\\.:ResourceWarning")  # as above
@pytest.mark.parametrize(
    ("status", "content_range"),
    [(200, None), (206, "bytes 0-99999/100000"), (416, None)],
    ids=["range-ignored", "range-mismatch", "range-refused"],
)
async def test_a_store_that_does_not_honour_the_range_gets_a_clean_restart(
    tmp_path: Path, status: int, content_range: str | None
) -> None:
    data = os.urandom(100_000)
    asked: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("range"))
        if request.headers.get("range") and status != 200:
            headers = {"content-range": content_range} if content_range else {}
            return httpx.Response(status, headers=headers, content=Chunks(data if status == 206 else b""))
        return httpx.Response(200, content=Chunks(data))

    cache_dir = tmp_path / "artifacts"
    cache_dir.mkdir()
    (cache_dir / f"{PARTIAL_PREFIX}{sha(data)}").write_bytes(data[:40_000])
    ref = ArtifactRef(uri="s3://b/model.gguf", sha256=sha(data), size_bytes=len(data))
    with trio.fail_after(TIMEOUT_S):
        async with ArtifactCache(
            config(), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(handler)
        ) as cache:
            path = await cache.fetch(ref)
    assert path.read_bytes() == data
    assert asked[0] == "bytes=40000-"
    assert asked[1:] == ([] if status == 200 else [None])
    assert cache.statistics().resumed == 0
    assert listing(cache_dir) == [sha(data)]


# --- refusals -------------------------------------------------------------------------------------


async def test_a_tampered_file_fails_naming_its_path_and_nothing_is_assembled(
    s3_store: S3Store, tmp_path: Path
) -> None:
    files = hf_model(shards=2)
    with trio.fail_after(TIMEOUT_S):
        at = prefix()
        ref = await upload(s3_store, files, at=at)
        tampered = bytearray(files["model-00002-of-00002.safetensors"])
        tampered[1234] ^= 0xFF
        await s3_store.put(at + "model-00002-of-00002.safetensors", bytes(tampered))
        async with ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials) as cache:
            with pytest.raises(ArtifactDigestMismatch) as info:
                await cache.fetch(ref)
    assert "'model-00002-of-00002.safetensors'" in info.value.message
    assert sha(bytes(tampered)) in info.value.message
    names = listing(tmp_path / "artifacts")
    # Nothing of the tampered file survives. (Files cancelled midway by its failure may keep
    # their partial downloads: those resume next time.)
    wanted = sha(files["model-00002-of-00002.safetensors"])
    assert wanted not in names
    assert PARTIAL_PREFIX + wanted not in names
    assert MANIFESTS_DIR not in names
    assert listing(tmp_path / "models") == []
    assert cache.statistics().manifests == 0


async def test_a_manifest_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    ref = manifest_ref("s3://b/m/", {"a.bin": b"a", "b.bin": b"b"})
    forged = attrs.evolve(ref, sha256="e" * 64)
    async with ArtifactCache(
        config(), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(refuse)
    ) as cache:
        with pytest.raises(ArtifactDigestMismatch, match=f"digest {ref.sha256}, the assignment pins e{{64}}"):
            await cache.fetch(forged)
    assert listing(tmp_path / "artifacts") == []


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a disk that is really full (root only; unmounted at teardown)."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("required in CI: mounting a tmpfs needs root", pytrace=False)
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


async def test_too_little_disk_is_refused_with_both_figures_and_changes_nothing(
    s3_store: S3Store, small_disk: Path, tmp_path: Path
) -> None:
    cfg = config(s3_store, cache_dir=str(small_disk / "artifacts"))
    with trio.fail_after(TIMEOUT_S):
        fits = await upload(s3_store, {"a.bin": os.urandom(2 * MiB), "b.json": b"{}"})
        big = await upload(s3_store, {"c.bin": os.urandom(3 * MiB), "d.json": b"[]"})
        transport = Recording()
        async with ArtifactCache(cfg, state_dir=tmp_path, credentials=s3_store.credentials, transport=transport) as c:
            kept = await c.fetch(fits)
            c.pin(fits.sha256)  # in use: eviction may not take it
            requests = len(transport.seen)
            with pytest.raises(InsufficientDisk) as info:
                await c.fetch(big)
            assert len(transport.seen) == requests  # not one request
            assert info.value.needed_bytes == big.size_bytes
            assert 0 < info.value.free_bytes < big.size_bytes
            assert f"{big.size_bytes} bytes are still to download" in info.value.message
            assert f"only {info.value.free_bytes} bytes are free" in info.value.message
            assert info.value.code == "insufficient_disk"
            assert (kept / "a.bin").exists()
            assert listing(small_disk / "artifacts") == sorted([MANIFESTS_DIR, *fits.manifest().blobs()])

            # Unpinned, the old model can make room: it is evicted and the new one fits.
            c.unpin(fits.sha256)
            path = await c.fetch(big)
            assert (path / "c.bin").stat().st_size == 3 * MiB
            assert not kept.exists()
            assert c.statistics().evictions == 1


# --- eviction -------------------------------------------------------------------------------------


async def test_eviction_keeps_a_running_manifest_and_the_blobs_it_shares(s3_store: S3Store, tmp_path: Path) -> None:
    shared = os.urandom(100_000)
    v1 = {"config.json": b'{"v": 1}', "shared.bin": shared, "own-1.bin": os.urandom(100_000)}
    v2 = {"config.json": b'{"v": 2}', "shared.bin": shared, "own-2.bin": os.urandom(100_000)}
    v3 = {"config.json": b'{"v": 3}', "own-3.bin": os.urandom(150_000)}
    cfg = config(s3_store, cache_max_bytes=Bytes(400_000))
    with trio.fail_after(TIMEOUT_S):
        ref1, ref2, ref3 = [await upload(s3_store, v) for v in (v1, v2, v3)]
        async with ArtifactCache(cfg, state_dir=tmp_path, credentials=s3_store.credentials) as cache:
            running = await cache.fetch(ref1)
            cache.pin(ref1.sha256)  # what the supervisor does for a running replica
            second = await cache.fetch(ref2)
            await cache.fetch(ref3)  # over the limit: v2 goes (v1 is older, but running)
            blobs = listing(tmp_path / "artifacts")
            assert running.is_dir()
            assert not second.exists()
            assert sha(shared) in blobs  # v2's shard is v1's too
            assert sha(v2["own-2.bin"]) not in blobs
            assert sha(v1["own-1.bin"]) in blobs
            assert (running / "shared.bin").read_bytes() == shared
            assert not (tmp_path / "artifacts" / MANIFESTS_DIR / f"{ref2.sha256}.json").exists()
            assert cache.statistics().evictions == 1

            cache.unpin(ref1.sha256)
            assert await cache.evict() == 0  # under the limit now: nothing to do
        # LRU across a restart: v1 (oldest) goes before v3.
        async with ArtifactCache(
            attrs.evolve(cfg, cache_max_bytes=Bytes(200_000)),
            state_dir=tmp_path,
            credentials=None,
            transport=httpx.MockTransport(refuse),
        ) as restarted:
            assert await restarted.evict() > 0
            assert not running.exists()
            assert (tmp_path / "models" / ref3.sha256).is_dir()
            assert listing(tmp_path / "artifacts") == sorted(
                [MANIFESTS_DIR, sha(v3["config.json"]), sha(v3["own-3.bin"])]
            )


async def test_leftovers_of_a_crash_are_removed_on_open(tmp_path: Path) -> None:
    cache_dir, models = tmp_path / "artifacts", tmp_path / "models"
    (cache_dir / MANIFESTS_DIR).mkdir(parents=True)
    data = b"weights" * 100
    (cache_dir / sha(data)).write_bytes(data)
    ref = manifest_ref("s3://b/m/", {"w.bin": data, "c.json": b"{}"})
    good = manifest_ref("s3://b/m/", {"w.bin": data})
    (cache_dir / sha(b"{}")).write_bytes(b"{}")
    # A complete one (manifest and directory), a directory whose manifest is gone (a crashed
    # eviction), a manifest without its directory (a crash before the rename), a half assembly.
    (cache_dir / MANIFESTS_DIR / f"{good.sha256}.json").write_bytes(good.manifest().canonical_bytes())
    (models / good.sha256).mkdir(parents=True)
    os.link(cache_dir / sha(data), models / good.sha256 / "w.bin")
    (models / ("d" * 64)).mkdir()
    (cache_dir / MANIFESTS_DIR / f"{ref.sha256}.json").write_bytes(ref.manifest().canonical_bytes())
    (models / f".tmp-{ref.sha256}-x1y2").mkdir()
    (models / f".tmp-{ref.sha256}-x1y2" / "c.json").write_bytes(b"{}")
    (models / "not-ours").mkdir()
    (cache_dir / f"{PARTIAL_PREFIX}{'9' * 16}-old-style").write_bytes(b"half")
    resumable = cache_dir / f"{PARTIAL_PREFIX}{'a' * 64}"
    resumable.write_bytes(b"resume me")
    async with ArtifactCache(
        config(), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(refuse)
    ) as cache:
        assert listing(models) == sorted([good.sha256, "not-ours"])
        assert listing(cache_dir / MANIFESTS_DIR) == [f"{good.sha256}.json"]
        assert resumable.exists()
        assert not (cache_dir / f"{PARTIAL_PREFIX}{'9' * 16}-old-style").exists()
        assert await cache.fetch(good) == models / good.sha256  # kept: a hit
        # The other is assembled again from its blobs, without a request.
        assert (await cache.fetch(ref) / "c.json").read_bytes() == b"{}"
    assert cache.statistics().hits == 2


async def test_a_directory_on_another_filesystem_is_copied_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    data = os.urandom(10_000)
    cache_dir = tmp_path / "artifacts"
    cache_dir.mkdir()
    (cache_dir / sha(data)).write_bytes(data)
    ref = manifest_ref("s3://b/m/", {"sub/w.bin": data, "x.bin": data})

    def cross_device(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")  # EXDEV

    monkeypatch.setattr(os, "link", cross_device)
    async with ArtifactCache(
        config(), state_dir=tmp_path, credentials=None, transport=httpx.MockTransport(refuse)
    ) as cache:
        path = await cache.fetch(ref)
    assert (path / "sub" / "w.bin").read_bytes() == data
    assert (path / "sub" / "w.bin").stat().st_ino != (cache_dir / sha(data)).stat().st_ino
    assert "2 file(s) were copied instead of hard-linked" in caplog.text


# --- the supervisor -------------------------------------------------------------------------------


async def wait_state(sup: Supervisor, state: wire.RuntimeState, reason: str | None = None) -> wire.AssignmentStatus:
    while True:
        (s,) = sup.statuses()
        if (s.state, s.reason) == (state, reason):
            return s
        await trio.sleep(0.05)


async def test_the_supervisor_mounts_the_assembled_directory_read_only(s3_store: S3Store, tmp_path: Path) -> None:
    files = {"config.json": b"{}", "model-00001-of-00002.gguf": os.urandom(5000), "model-00002-of-00002.gguf": b"2"}
    podman = FakePodman(registry={IMAGE})
    with trio.fail_after(TIMEOUT_S):
        ref = attrs.evolve(await upload(s3_store, files), entry="model-00001-of-00002.gguf")
        ref = attrs.evolve(ref, sha256=ref.manifest().digest)
        a = wire.Assignment(id="a1", deployment="d1", runtime=runtime(artifact=ref))
        async with (
            ArtifactCache(config(s3_store), state_dir=tmp_path, credentials=s3_store.credentials) as cache,
            trio.open_nursery() as nursery,
        ):
            sup = Supervisor(CFG, podman, cache, node_id="n1")
            sup.update(1, [a])
            await nursery.start(sup.run)
            await wait_state(sup, wire.RuntimeState.READY)
            (mount,) = podman.only().spec.ro_mounts
            assert mount == (str(tmp_path / "models" / ref.sha256), "/models/tiny")
            assert ref.model_path == "/models/tiny/model-00001-of-00002.gguf"
            assert (Path(mount[0]) / "model-00002-of-00002.gguf").read_bytes() == b"2"
            assert cache._pins[ref.sha256] == 1  # pinned while it runs
            sup.update(2, [])
            while True:
                if not podman.containers:
                    break
                await trio.sleep(0.05)
            assert not cache._pins
            nursery.cancel_scope.cancel()


async def test_the_supervisor_reports_insufficient_disk_and_never_creates_the_container(
    s3_store: S3Store, small_disk: Path, tmp_path: Path
) -> None:
    podman = FakePodman(registry={IMAGE})
    cfg = config(s3_store, cache_dir=str(small_disk / "artifacts"))
    with trio.fail_after(TIMEOUT_S):
        ref = await upload(s3_store, {"a.bin": os.urandom(5 * MiB), "b.json": b"{}"})
        a = wire.Assignment(id="a1", deployment="d1", runtime=runtime(artifact=ref))
        async with (
            ArtifactCache(cfg, state_dir=tmp_path, credentials=s3_store.credentials) as cache,
            trio.open_nursery() as nursery,
        ):
            sup = Supervisor(CFG, podman, cache, node_id="n1")
            sup.update(1, [a])
            await nursery.start(sup.run)
            status = await wait_state(sup, wire.RuntimeState.FAILED, "insufficient_disk")
            assert f"{ref.size_bytes} bytes are still to download" in status.detail
            assert podman.mutations("create", "start") == []
            nursery.cancel_scope.cancel()


# --- a real agent and podman ----------------------------------------------------------------------


@pytest.mark.slow
async def test_a_real_runtime_sees_the_model_directory_read_only(
    node: tuple[FakeController, AgentProcess],
    podman_service: PodmanService,
    test_images: BuiltImages,
    fake_gpu_cdi: FakeGpu,
    s3_store: S3Store,
) -> None:
    ctl, _ = node
    files = {"config.json": b'{"model_type": "llama"}', "shards/model-00001-of-00002.gguf": os.urandom(200_000)}
    files["shards/model-00002-of-00002.gguf"] = os.urandom(100_000)
    with trio.fail_after(TIMEOUT_S):
        ref = await upload(s3_store, files)
    ref = attrs.evolve(ref, mount_path="/models/tiny-llama")
    port = 19000 + os.getpid() % 1000
    spec = busybox_runtime(test_images.busybox, port, ref, fake_gpu_cdi.device)
    with trio.fail_after(TIMEOUT_S):
        await ctl.next(wire.Hello)
        assignment = wire.Assignment(id="a1", deployment="d1", runtime=spec)
        assert (await ctl.answer(aset(1, 1, assignments=[assignment]))).accepted
    await beat_until(ctl, state_is("a1", RS.READY), "a1 Ready")

    [info] = json.loads(podman(podman_service, "inspect", "nexa-a1"))
    [mount] = [m for m in info["Mounts"] if m["Destination"] == "/models/tiny-llama"]
    assert mount["RW"] is False
    assert mount["Source"].endswith(f"/models/{ref.sha256}")
    listed = podman(podman_service, "exec", "nexa-a1", "ls", "/models/tiny-llama", "/models/tiny-llama/shards")
    assert "config.json" in listed.split() and "model-00002-of-00002.gguf" in listed.split()
    inside = podman(podman_service, "exec", "nexa-a1", "cat", "/models/tiny-llama/config.json")
    assert inside == files["config.json"].decode()
    sums = podman(podman_service, "exec", "nexa-a1", "sha256sum", "/models/tiny-llama/shards/model-00001-of-00002.gguf")
    assert sums.split()[0] == sha(files["shards/model-00001-of-00002.gguf"])
    refused = podman_service.cli("exec", "nexa-a1", "touch", "/models/tiny-llama/new", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr


# --- memory ---------------------------------------------------------------------------------------

_FETCH_AND_MEASURE = """
import json, sys
from pathlib import Path
import trio
from nexa.config import ArtifactsConfig
from nexa.contracts.manifest import ArtifactFile
from nexa.contracts.runtime import ArtifactRef
from nexa.node.artifacts import ArtifactCache
from nexa.sigv4 import S3Credentials

job = json.loads(sys.argv[1])
ref = ArtifactRef(uri=job["uri"], sha256=job["sha256"], size_bytes=job["size_bytes"], entry=".",
                  files=[ArtifactFile(**f) for f in job["files"]])
cfg = ArtifactsConfig(s3_endpoint=job["endpoint"], parallel_downloads=4)

def peak_kib():  # VmHWM: the peak RSS of this process image (ru_maxrss would include pytest's, by fork)
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))

async def main():
    async with ArtifactCache(cfg, state_dir=Path(job["state"]), credentials=S3Credentials(*job["creds"])) as cache:
        before = peak_kib()
        await cache.fetch(ref)
        print(json.dumps({"before_kib": before, "after_kib": peak_kib(), "downloads": cache.statistics().downloads}))

trio.run(main)
"""


@pytest.mark.slow
async def test_four_parallel_downloads_stream_to_disk_in_little_memory(s3_store: S3Store, tmp_path: Path) -> None:
    files = {f"model-{i:05d}-of-00004.safetensors": os.urandom(16 * MiB) for i in range(1, 5)}
    with trio.fail_after(TIMEOUT_S):
        ref = await upload(s3_store, files)
    job = {
        "uri": ref.uri,
        "sha256": ref.sha256,
        "size_bytes": ref.size_bytes,
        "files": [attrs.asdict(f) for f in ref.files],
        "endpoint": s3_store.endpoint,
        "creds": [s3_store.credentials.access_key_id, s3_store.credentials.secret_access_key],
        "state": str(tmp_path),
    }
    result = await trio.run_process(
        [sys.executable, "-c", _FETCH_AND_MEASURE, json.dumps(job)], capture_stdout=True, capture_stderr=True
    )
    measured = json.loads(result.stdout)
    assert measured["downloads"] == 4
    grown_mib = (measured["after_kib"] - measured["before_kib"]) / 1024
    peak_mib = measured["after_kib"] / 1024
    # 64 MiB went through; what stayed in memory at once is a few 512 KiB blocks per download.
    assert grown_mib < 16, measured
    assert peak_mib < 80, measured
    print(f"node fetch: peak RSS {peak_mib:.1f} MiB, grown {grown_mib:.1f} MiB")


@pytest.mark.parametrize("value", [0, 65, "4"])
def test_parallel_downloads_out_of_range_is_a_config_error(tmp_path: Path, value: object) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f"[artifacts]\nparallel_downloads = {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match="parallel_downloads"):
        load(path, NodeConfig)
    assert ArtifactsConfig().parallel_downloads == 4
