"""Model artifacts: streamed from an S3-compatible store into a local cache named by sha256.

An assignment pins an artifact by `s3://bucket/key`, sha256 and size. `ArtifactCache.fetch`
returns the path of a verified file: a cache hit costs no request; a miss is one path-style GET,
streamed into a temporary file in the cache directory while it is hashed and counted, fsynced
and renamed to `<cache>/<sha256>` only when both digest and size match. A mismatch leaves
nothing behind and raises `ArtifactDigestMismatch` (the supervisor reports
`Failed(artifact_digest_mismatch)` and never starts the runtime).

Requests are signed with AWS Signature Version 4 (`nexa.s3`). Credentials come from a file named
in node config and are never logged; log lines carry digests, sizes and durations only.

This module owns httpx for the S3 store and translates its failures into `nexa.errors`.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from contextlib import aclosing
from pathlib import Path
from typing import Final

import attrs
import httpx
import trio

from nexa.config import ArtifactsConfig
from nexa.contracts.runtime import SHA256_RE, ArtifactRef
from nexa.errors import ArtifactDigestMismatch, ArtifactError, ArtifactUnavailable, ConfigError
from nexa.s3 import (
    S3Credentials,
    error_code,
    object_url,
    raw_chunks,
    signed_headers_for,
    split_s3_uri,
)

log = logging.getLogger(__name__)

#: Temporary download files start with this; any left by a crash are removed on open.
PARTIAL_PREFIX: Final = ".partial-"
#: Received bytes are hashed and written in a worker thread once this much has arrived, so the
#: event loop never hashes or writes a large block itself and pays one thread hop per block.
WRITE_BLOCK_BYTES: Final = 4 * 1024 * 1024
#: Blocks waiting for the writer while the next one is received (memory: about 3 blocks).
WRITE_QUEUE_BLOCKS: Final = 2
#: httpx guards single socket operations; the caller's cancel scope bounds the whole fetch.
CONNECT_TIMEOUT_S: Final = 10.0
READ_TIMEOUT_S: Final = 60.0


# --- the cache ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ArtifactStatistics:
    """A snapshot of the cache's counters (trio's `statistics()` convention)."""

    #: fetches answered from the cache without a request
    hits: int
    #: objects downloaded, verified and stored
    downloads: int
    #: body bytes received, including those of downloads that were rejected or aborted
    bytes_downloaded: int
    #: downloads rejected because the sha256 or the size differed from the reference
    mismatches: int
    #: cached files removed to stay under `cache_max_bytes`
    evictions: int
    #: bytes of verified files in the cache now
    cache_bytes: int


@attrs.define
class _Counters:
    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    mismatches: int = 0
    evictions: int = 0


@attrs.define
class _Slot:
    """Serialises all work on one digest (download, hit, eviction); dropped when unused."""

    lock: trio.Lock = attrs.field(factory=trio.Lock)
    users: int = 0


class ArtifactCache:
    """Verified model artifacts on local disk, shared by digest between deployments.

    Use as `async with ArtifactCache(cfg, state_dir=…, credentials=…) as cache:` (it owns an
    httpx client and starts no tasks). Concurrent fetches of one digest share one download.
    Pinned digests are never evicted; pin before (or right after) `fetch` and unpin when the
    runtime using the file is gone. LRU order is kept in memory and in the files' mtimes, so a
    restarted agent evicts in the same order.
    """

    def __init__(
        self,
        cfg: ArtifactsConfig,
        *,
        state_dir: Path,
        credentials: S3Credentials | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._cfg = cfg
        self.directory = Path(cfg.cache_dir) if cfg.cache_dir else Path(state_dir) / "artifacts"
        self._credentials = credentials
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        #: sha256 → size of verified files, least recently used first.
        self._entries: dict[str, int] = {}
        self._slots: dict[str, _Slot] = {}
        self._pins: collections.Counter[str] = collections.Counter()
        #: Bytes of downloads in flight: eviction makes room for them before they land.
        self._reserved_bytes = 0
        self._counters = _Counters()

    async def __aenter__(self) -> ArtifactCache:
        try:
            entries, removed = await trio.to_thread.run_sync(_open_cache_dir, self.directory)
        except OSError as exc:
            raise ConfigError(f"cannot use artifact cache directory {self.directory}: {exc.strerror or exc}") from None
        self._entries = dict(entries)
        if removed:
            log.info("removed %d partial download(s) left in %s", removed, self.directory)
        log.info(
            "artifact cache %s: %d artifact(s), %d bytes (limit %d)",
            self.directory,
            len(self._entries),
            self._cache_bytes(),
            self._cfg.cache_max_bytes,
        )
        self._client = httpx.AsyncClient(
            transport=self._transport,
            verify=self._cfg.s3_tls_verify,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            follow_redirects=False,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def path_of(self, sha256: str) -> Path:
        """Where the verified file for `sha256` lives (whether or not it is cached now)."""
        return self.directory / sha256

    def statistics(self) -> ArtifactStatistics:
        c = self._counters
        return ArtifactStatistics(
            hits=c.hits,
            downloads=c.downloads,
            bytes_downloaded=c.bytes_downloaded,
            mismatches=c.mismatches,
            evictions=c.evictions,
            cache_bytes=self._cache_bytes(),
        )

    def pin(self, sha256: str) -> None:
        """Mark a digest in use (counted: pin twice, unpin twice). Pinned files are never evicted."""
        self._pins[sha256] += 1

    def unpin(self, sha256: str) -> None:
        """Release one pin. Unpinning a digest that is not pinned is a no-op."""
        if self._pins[sha256] <= 1:
            del self._pins[sha256]
        else:
            self._pins[sha256] -= 1

    async def fetch(self, ref: ArtifactRef) -> Path:
        """The path of the verified artifact, downloading it on a miss.

        Raises ArtifactDigestMismatch when the object's sha256 or size differs from `ref`
        (nothing is left in the cache), ArtifactUnavailable when the store cannot be reached,
        refuses the request or has no such object, and ArtifactError when the cache directory
        cannot be written (a full disk, say).
        """
        if self._client is None:
            raise RuntimeError("ArtifactCache is not open: use `async with`")
        async with self._slot(ref.sha256):
            if ref.sha256 in self._entries:
                path = await self._hit(ref)
                if path is not None:
                    return path
            return await self._download(ref, self._client)

    async def evict(self) -> int:
        """Remove least-recently-used unpinned files while the cache is above its limit; bytes freed."""
        return await self._evict()

    # --- internals --------------------------------------------------------------------------------

    def _cache_bytes(self) -> int:
        return sum(self._entries.values())

    def _slot(self, sha256: str) -> _SlotGuard:
        return _SlotGuard(self._slots, sha256)

    async def _hit(self, ref: ArtifactRef) -> Path | None:
        size = self._entries[ref.sha256]
        if size != ref.size_bytes:
            # The file was verified against this digest when it was stored, so the reference
            # is the inconsistent part; keep the file (other deployments may use it).
            self._counters.mismatches += 1
            raise ArtifactDigestMismatch(
                f"{ref.uri}: declared size {ref.size_bytes} bytes, but the verified artifact with "
                f"sha256 {ref.sha256} is {size} bytes"
            )
        path = self.path_of(ref.sha256)
        if not await trio.to_thread.run_sync(_touch, path):
            log.warning("cached artifact %s disappeared from %s; downloading it again", ref.sha256, self.directory)
            del self._entries[ref.sha256]
            return None
        self._entries[ref.sha256] = self._entries.pop(ref.sha256)  # most recently used last
        self._counters.hits += 1
        log.debug("artifact %s: cache hit (%d bytes)", ref.sha256, size)
        return path

    async def _download(self, ref: ArtifactRef, client: httpx.AsyncClient) -> Path:
        if not self._cfg.s3_endpoint:
            raise ArtifactUnavailable(f"cannot fetch {ref.uri}: no S3 endpoint is configured (artifacts.s3_endpoint)")
        bucket, key = split_s3_uri(ref.uri)
        url = object_url(self._cfg.s3_endpoint, bucket, key)
        self._reserved_bytes += ref.size_bytes
        try:
            # Make room before the bytes arrive, so a large download does not overfill the disk.
            await self._evict(keep=ref.sha256)
            # identity: the digest is over the stored bytes, so nothing may decode them on the way.
            headers = {"accept-encoding": "identity"}
            if self._credentials is not None:
                headers = signed_headers_for(
                    "GET", url, credentials=self._credentials, region=self._cfg.s3_region, headers=headers
                )
            started = time.monotonic()
            log.info("fetching artifact %s (%d bytes, sha256 %s)", ref.uri, ref.size_bytes, ref.sha256)
            try:
                async with client.stream("GET", url, headers=headers) as response:
                    if response.status_code != 200:
                        raise await _refusal(response, ref, anonymous=self._credentials is None)
                    await self._receive(response, ref)
            except httpx.HTTPError as exc:
                raise ArtifactUnavailable(f"the S3 store did not answer for {ref.uri} ({type(exc).__name__})") from exc
        finally:
            self._reserved_bytes -= ref.size_bytes
        elapsed = time.monotonic() - started
        self._entries[ref.sha256] = ref.size_bytes
        self._counters.downloads += 1
        log.info(
            "artifact %s verified: %d bytes in %.2f s (%.1f MB/s)",
            ref.sha256,
            ref.size_bytes,
            elapsed,
            ref.size_bytes / max(elapsed, 1e-6) / 1e6,
        )
        return self.path_of(ref.sha256)

    async def _receive(self, response: httpx.Response, ref: ArtifactRef) -> None:
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) != ref.size_bytes:
            self._counters.mismatches += 1
            raise ArtifactDigestMismatch(
                f"{ref.uri}: the store holds {int(declared)} bytes, the assignment declares {ref.size_bytes}"
            )
        try:
            part = await trio.to_thread.run_sync(_PartFile, self.directory, ref.sha256)
        except OSError as exc:
            raise ArtifactError(f"cannot write to the artifact cache: {exc.strerror or exc}") from exc
        try:
            received = await self._pipe(response, ref, part)
            digest = part.hexdigest()
            if received != ref.size_bytes or digest != ref.sha256:
                self._counters.mismatches += 1
                raise ArtifactDigestMismatch(
                    f"{ref.uri}: expected sha256 {ref.sha256} ({ref.size_bytes} bytes), "
                    f"got sha256 {digest} ({received} bytes)"
                )
            await trio.to_thread.run_sync(part.commit, self.path_of(ref.sha256))
        except OSError as exc:
            raise ArtifactError(f"cannot store {ref.uri} in the artifact cache: {exc.strerror or exc}") from exc
        finally:
            # Runs on mismatch, on failure and on cancellation alike: no partial file survives.
            with trio.move_on_after(5, shield=True):
                await trio.to_thread.run_sync(part.discard)

    async def _pipe(self, response: httpx.Response, ref: ArtifactRef, part: _PartFile) -> int:
        """Move the body into `part`; the number of bytes received.

        This task reads while a second one hashes and writes the previous block in a worker
        thread, so network and disk overlap. Each side catches its own failure, records it and
        cancels the other; it is raised here after both stopped (no exception group escapes).
        """
        blocks_tx, blocks_rx = trio.open_memory_channel[list[bytes]](WRITE_QUEUE_BLOCKS)
        failures: list[Exception] = []
        received = 0

        async def write_blocks() -> None:
            async with blocks_rx:
                async for block in blocks_rx:
                    try:
                        await trio.to_thread.run_sync(part.write, block)
                    except OSError as exc:
                        failures.append(exc)
                        nursery.cancel_scope.cancel()
                        return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_blocks)
            async with blocks_tx:
                try:
                    received = await self._read_blocks(response, ref, blocks_tx)
                except (ArtifactError, httpx.HTTPError) as exc:
                    failures.append(exc)
                    nursery.cancel_scope.cancel()
        if failures:
            raise failures[0]
        return received

    async def _read_blocks(
        self, response: httpx.Response, ref: ArtifactRef, blocks: trio.MemorySendChannel[list[bytes]]
    ) -> int:
        received = 0
        block: list[bytes] = []
        block_bytes = 0
        # aclosing: an abort closes the iterator at once. (httpx's inner stream layers are async
        # generators too and are left for trio to finalize: encode/httpx#3686.)
        async with aclosing(raw_chunks(response)) as chunks:
            async for chunk in chunks:
                received += len(chunk)
                self._counters.bytes_downloaded += len(chunk)
                if received > ref.size_bytes:
                    self._counters.mismatches += 1
                    raise ArtifactDigestMismatch(
                        f"{ref.uri}: the store sent more than the declared {ref.size_bytes} bytes; aborted"
                    )
                block.append(chunk)
                block_bytes += len(chunk)
                if block_bytes >= WRITE_BLOCK_BYTES:
                    await blocks.send(block)
                    block, block_bytes = [], 0
        if block:
            await blocks.send(block)
        return received

    async def _evict(self, *, keep: str | None = None) -> int:
        limit = self._cfg.cache_max_bytes
        freed = 0
        for sha256 in list(self._entries):  # least recently used first
            if self._cache_bytes() + self._reserved_bytes <= limit:
                break
            if sha256 == keep or self._pins[sha256] or sha256 in self._slots or sha256 not in self._entries:
                continue
            async with self._slot(sha256):
                size = self._entries.pop(sha256)
                await trio.to_thread.run_sync(_remove, self.path_of(sha256))
            freed += size
            self._counters.evictions += 1
            log.info("evicted artifact %s (%d bytes, least recently used)", sha256, size)
        over = self._cache_bytes() + self._reserved_bytes - limit
        if over > 0:
            log.warning(
                "artifact cache is %d bytes over its limit of %d: the rest is in use or being fetched", over, limit
            )
        return freed


class _SlotGuard:
    """`async with` holding the per-digest lock; the slot is dropped once nobody uses it."""

    def __init__(self, slots: dict[str, _Slot], sha256: str) -> None:
        self._slots = slots
        self._sha256 = sha256

    async def __aenter__(self) -> None:
        slot = self._slots.setdefault(self._sha256, _Slot())
        slot.users += 1
        try:
            await slot.lock.acquire()
        except BaseException:
            self._leave(slot)
            raise

    async def __aexit__(self, *exc: object) -> None:
        slot = self._slots[self._sha256]
        slot.lock.release()
        self._leave(slot)

    def _leave(self, slot: _Slot) -> None:
        slot.users -= 1
        if slot.users == 0:
            del self._slots[self._sha256]


async def _refusal(response: httpx.Response, ref: ArtifactRef, *, anonymous: bool) -> ArtifactUnavailable:
    """Turn a non-200 answer into ArtifactUnavailable naming the S3 error code, never a credential."""
    code = await error_code(response)
    status = f"{response.status_code} {code}"
    log.warning("S3 store answered %s for %s", status, ref.uri)
    if code == "SignatureDoesNotMatch":
        return ArtifactUnavailable(
            f"the S3 store refused the request signature for {ref.uri} ({status}): "
            "check the secret access key in the S3 credentials file"
        )
    if code == "InvalidAccessKeyId":
        return ArtifactUnavailable(f"the S3 store does not know the configured access key id ({status})")
    if code in {"NoSuchKey", "NoSuchBucket"} or response.status_code == 404:
        return ArtifactUnavailable(f"{ref.uri} does not exist in the S3 store ({status})")
    if response.status_code == 403:
        hint = ": no S3 credentials are configured (artifacts.s3_credentials_file)" if anonymous else ""
        return ArtifactUnavailable(f"the S3 store denied access to {ref.uri} ({status}){hint}")
    return ArtifactUnavailable(f"the S3 store failed to serve {ref.uri} ({status})")


# --- sync file work, run in worker threads ----------------------------------------------------------


class _PartFile:
    """A temporary file in the cache directory that hashes what is written to it."""

    def __init__(self, directory: Path, sha256: str) -> None:
        fd, name = tempfile.mkstemp(prefix=f"{PARTIAL_PREFIX}{sha256[:16]}-", dir=directory)
        self.path = Path(name)
        self._file = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()

    def write(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self._hash.update(chunk)  # releases the GIL for large buffers
            self._file.write(chunk)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def commit(self, final: Path) -> None:
        """fsync, make read-only and rename into place atomically, then fsync the directory."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.path.chmod(0o444)
        _touch(self.path)
        self.path.replace(final)
        _fsync_dir(final.parent)

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_cache_dir(directory: Path) -> tuple[list[tuple[str, int]], int]:
    """Create the directory if needed, drop partial downloads, list verified files LRU first."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    found: list[tuple[int, str, int]] = []
    removed = 0
    for entry in os.scandir(directory):
        if entry.name.startswith(PARTIAL_PREFIX):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
        elif SHA256_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            found.append((st.st_mtime_ns, entry.name, st.st_size))
    found.sort()
    return [(name, size) for _, name, size in found], removed


def _touch(path: Path) -> bool:
    """Record a use in the file's times (the LRU order a restart reads back); False if it is gone.

    The time is given explicitly: the kernel's own file timestamps tick only every few
    milliseconds, which would tie uses that follow each other closely.
    """
    now_ns = time.time_ns()
    try:
        os.utime(path, ns=(now_ns, now_ns))
    except FileNotFoundError:
        return False
    return True


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
