"""Model artifacts: streamed from an S3-compatible store into a content-addressed cache, and
assembled into model directories.

An assignment pins an artifact by `s3://` URI, sha256 and size: one object (no `files`, as
before manifests), or a manifest of files under a prefix (`nexa.contracts.manifest`). Every file
is a blob `<cache>/<sha256>`, shared by every manifest (and path) holding the same bytes. A cache
hit costs no request; a miss is one path-style GET, at most `parallel_downloads` of them at once,
streamed into `<cache>/.partial-<sha256>` while it is hashed and counted, fsynced and renamed to
`<cache>/<sha256>` only when both digest and size match. A mismatch leaves nothing behind and
raises `ArtifactDigestMismatch` naming the file (the supervisor reports
`Failed(artifact_digest_mismatch)` and never starts the runtime). A download that is cancelled,
cut off or killed keeps its partial file: the next fetch hashes it and asks for the rest with
`Range: bytes=N-`, or starts over when the store answers with the whole object.

`fetch` returns the blob itself for one object, and for a manifest the directory
`<models>/<manifest digest>/` (`<state>/models/`, beside the cache directory): hard links to the
blobs, built in a temporary directory and renamed into place, so that a crash never leaves a half
directory in use. The manifest's canonical bytes are kept in `<cache>/manifests/<digest>.json`,
outside the mounted directory, so that a restarted agent knows which blobs each directory uses.

Before downloading, the free disk is compared with the bytes still missing; when evicting every
unused artifact would not free enough, `InsufficientDisk` names both figures and nothing is
evicted or downloaded. Eviction is least-recently-used per manifest (or per single object) and
never removes a pinned manifest, nor a blob that a kept manifest uses.

Requests go through `nexa.s3.client.S3Client` (signed with AWS Signature Version 4, read 1 MiB at a
time). Credentials come from a file named in node config (re-read when it changes) or the AWS
environment variables, and are never logged; log lines carry
digests, sizes and durations only. This module words the store's refusals for an operator; the
files on disk (layout, partial files, assembly, recovery on open) are `nexa.node.cache_files`.
"""

from __future__ import annotations

import collections
import logging
import re
import time
import types
from collections.abc import Iterable, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Final

import attrs
import trio

from nexa.config import ArtifactsConfig
from nexa.contracts.bounds import declared_bytes
from nexa.contracts.manifest import ArtifactFile, Manifest
from nexa.contracts.runtime import ArtifactRef
from nexa.errors import (
    ArtifactDigestMismatch,
    ArtifactError,
    ArtifactRefused,
    ArtifactUnavailable,
    ConfigError,
    InsufficientDisk,
)
from nexa.node import cache_files
from nexa.s3.client import InjectedTransport, ObjectStream, S3Client, split_s3_uri
from nexa.s3.credentials import CredentialsSource
from nexa.supervision import all_or_first_failure

log = logging.getLogger(__name__)

#: Received bytes are hashed and written in a worker thread once this much has arrived, so the
#: event loop never hashes or writes a large block itself and pays one thread hop per block.
#: Small enough that 4 parallel downloads together hold about 8 MiB (measured in the tests).
WRITE_BLOCK_BYTES: Final = 512 * 1024
#: Blocks waiting for the writer while the next one is received (memory: about 3 blocks).
WRITE_QUEUE_BLOCKS: Final = 2
#: Bounds each socket operation; the caller's cancel scope bounds the whole fetch.
READ_TIMEOUT_S: Final = 60.0
#: Closing or discarding a partial download, shielded: a flush and a rename or unlink on local disk.
PART_CLOSE_TIMEOUT_S: Final = 5.0
_CONTENT_RANGE_RE: Final = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


# --- the cache ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ArtifactStatistics:
    """A snapshot of the cache's counters (trio's `statistics()` convention)."""

    #: fetches answered from the cache without a download
    hits: int
    #: objects (files) downloaded, verified and stored
    downloads: int
    #: body bytes received, including those of downloads that were rejected or aborted
    bytes_downloaded: int
    #: downloads rejected because the sha256 or the size differed from the reference
    mismatches: int
    #: manifests and single objects removed to stay under `cache_max_bytes` or to make room
    evictions: int
    #: bytes of verified files in the cache now
    cache_bytes: int
    #: downloads continued from a partial file with an HTTP Range request
    resumed: int = 0
    #: model directories assembled and kept now
    manifests: int = 0
    #: sha256 → how often that blob was downloaded (not compared: a detail for tests and logs)
    blob_downloads: Mapping[str, int] = attrs.field(factory=dict, eq=False)


@attrs.define
class _Counters:
    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    mismatches: int = 0
    evictions: int = 0
    resumed: int = 0
    blob_downloads: collections.Counter[str] = attrs.field(factory=collections.Counter)


@attrs.define
class _Slot:
    """Serialises all work on one digest (download, hit, eviction); dropped when unused."""

    lock: trio.Lock = attrs.field(factory=trio.Lock)
    users: int = 0


@attrs.frozen
class _Blob:
    """One distinct file to provide: what it must be, where it is, and how errors name it."""

    file: ArtifactFile
    uri: str
    label: str


class ArtifactCache:
    """Verified model artifacts on local disk, shared by digest between deployments.

    Use as `async with ArtifactCache(cfg, state_dir=…, credentials=…) as cache:` (it owns an
    `S3Client` and starts no tasks; `transport` replaces its HTTP transport in tests).
    Concurrent fetches of one blob share one download. Pins are per artifact digest (a
    manifest's, or a single object's): pinned ones are never evicted, nor any blob they use; pin
    before (or right after) `fetch` and unpin when the runtime using it is gone. LRU order is
    kept in memory and in the files' mtimes (blobs, and the kept manifests' JSON), so a
    restarted agent evicts in the same order.
    """

    def __init__(
        self,
        cfg: ArtifactsConfig,
        *,
        state_dir: Path,
        credentials: CredentialsSource | None,
        transport: InjectedTransport | None = None,
    ) -> None:
        self._cfg = cfg
        self.directory = Path(cfg.cache_dir) if cfg.cache_dir else Path(state_dir) / "artifacts"
        #: Beside the cache directory, so that hard links to its blobs work (same filesystem).
        self.models_directory = self.directory.parent / "models"
        self._credentials = credentials
        self._transport = transport
        self._client: S3Client | None = None
        self._limiter = trio.CapacityLimiter(cfg.parallel_downloads)
        #: sha256 → size of verified blobs.
        self._entries: dict[str, int] = {}
        #: digest → manifest of the assembled (kept) model directories.
        self._manifests: dict[str, Manifest] = {}
        #: blob sha256 or manifest digest → time of last use (ns; the file times a restart reads).
        self._used_ns: dict[str, int] = {}
        self._slots: dict[str, _Slot] = {}
        self._pins: collections.Counter[str] = collections.Counter()
        #: Digests and blobs of fetches under way: never evicted from under them.
        self._busy: collections.Counter[str] = collections.Counter()
        #: Bytes of downloads in flight: eviction makes room for them before they land.
        self._reserved_bytes = 0
        self._counters = _Counters()

    async def __aenter__(self) -> ArtifactCache:
        try:
            opened = await trio.to_thread.run_sync(cache_files.open_cache_dir, self.directory, self.models_directory)
        except OSError as exc:
            raise ConfigError(f"cannot use artifact cache directory {self.directory}: {exc.strerror or exc}") from None
        for sha256, size, used_ns in opened.blobs:
            self._entries[sha256] = size
            self._used_ns[sha256] = used_ns
        for digest, manifest, used_ns in opened.manifests:
            self._manifests[digest] = manifest
            self._used_ns[digest] = used_ns
        if opened.removed:
            log.info("removed %d leftover(s) of interrupted downloads or assemblies", opened.removed)
        log.info(
            "artifact cache %s: %d file(s), %d model directory(ies), %d bytes (limit %d)",
            self.directory,
            len(self._entries),
            len(self._manifests),
            self._cache_bytes(),
            self._cfg.cache_max_bytes,
        )
        client = S3Client(
            self._cfg.s3_endpoint,
            region=self._cfg.s3_region,
            credentials=self._credentials,
            tls_verify=self._cfg.s3_tls_verify,
            timeout_s=READ_TIMEOUT_S,
            transport=self._transport,
        )
        self._client = await client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.__aexit__(*exc)
            self._client = None

    def path_of(self, sha256: str) -> Path:
        """Where the verified blob for `sha256` lives (whether or not it is cached now)."""
        return self.directory / sha256

    def directory_of(self, digest: str) -> Path:
        """Where the model directory of the manifest `digest` is assembled."""
        return self.models_directory / digest

    def statistics(self) -> ArtifactStatistics:
        c = self._counters
        return ArtifactStatistics(
            hits=c.hits,
            downloads=c.downloads,
            bytes_downloaded=c.bytes_downloaded,
            mismatches=c.mismatches,
            evictions=c.evictions,
            cache_bytes=self._cache_bytes(),
            resumed=c.resumed,
            manifests=len(self._manifests),
            blob_downloads=types.MappingProxyType(dict(c.blob_downloads)),
        )

    def pin(self, sha256: str) -> None:
        """Mark an artifact digest in use (counted: pin twice, unpin twice). A pinned manifest's
        directory and blobs, or a pinned single object, are never evicted."""
        self._pins[sha256] += 1

    def unpin(self, sha256: str) -> None:
        """Release one pin. Unpinning a digest that is not pinned is a no-op."""
        if self._pins[sha256] <= 1:
            del self._pins[sha256]
        else:
            self._pins[sha256] -= 1

    async def fetch(self, ref: ArtifactRef) -> Path:
        """The path of the verified artifact, downloading what is missing: for one object its
        blob, for a manifest its assembled model directory.

        Raises ArtifactDigestMismatch when a file's sha256 or size differs from the manifest (or
        the manifest from `ref.sha256`; nothing is left in the cache), InsufficientDisk when the
        files still missing do not fit on the disk, ArtifactUnavailable when the store cannot be
        reached, refuses the request or has no such object, and ArtifactError when the cache
        cannot be written (a full disk, say).
        """
        if self._client is None:
            raise RuntimeError("ArtifactCache is not open: use `async with`")
        manifest = ref.manifest()
        if ref.files and manifest.digest != ref.sha256:
            self._counters.mismatches += 1
            raise ArtifactDigestMismatch(
                f"{ref.uri}: the manifest's files and entry have digest {manifest.digest}, "
                f"the assignment pins {ref.sha256}"
            )
        blobs = _blobs_of(ref, manifest)
        busy = [ref.sha256, *(b.file.sha256 for b in blobs)]
        self._busy.update(busy)
        try:
            if not ref.files:
                if not await self._provide(ref, blobs, self._client):
                    self._counters.hits += 1
                return self.path_of(ref.sha256)
            async with self._slot(ref.sha256):
                path = await self._manifest_hit(ref.sha256)
                if path is not None:
                    self._counters.hits += 1
                    return path
                if not await self._provide(ref, blobs, self._client):
                    self._counters.hits += 1
                return await self._assemble(ref, manifest)
        finally:
            self._busy.subtract(busy)
            for key in busy:
                if self._busy[key] <= 0:
                    del self._busy[key]

    async def evict(self) -> int:
        """Remove least-recently-used unpinned artifacts while the cache is above its limit; bytes freed."""
        plan, _ = self._plan(self._cache_bytes() + self._reserved_bytes - self._cfg.cache_max_bytes)
        freed = await self._evict(plan)
        self._warn_if_over_limit()
        return freed

    # --- internals --------------------------------------------------------------------------------

    def _cache_bytes(self) -> int:
        return sum(self._entries.values())

    def _slot(self, key: str) -> _SlotGuard:
        return _SlotGuard(self._slots, key)

    def _protected(self, key: str) -> bool:
        return bool(self._pins[key] or self._busy[key]) or key in self._slots

    def _references(self) -> collections.Counter[str]:
        """blob sha256 → how many kept manifests use it."""
        return collections.Counter(sha for m in self._manifests.values() for sha in m.blobs())

    async def _provide(self, ref: ArtifactRef, blobs: Sequence[_Blob], client: S3Client) -> int:
        """Make every blob present and verified, at most `parallel_downloads` downloads at once
        (across all fetches); the number downloaded. The first failure cancels the others, whose
        partial files are kept for the next attempt."""
        missing = [b for b in blobs if b.file.sha256 not in self._entries]
        reserved = sum(b.file.size_bytes for b in missing)
        self._reserved_bytes += reserved
        try:
            if missing:
                partial = await trio.to_thread.run_sync(
                    cache_files.partial_sizes, self.directory, [b.file.sha256 for b in missing]
                )
                needed = sum(max(0, b.file.size_bytes - partial.get(b.file.sha256, 0)) for b in missing)
                await self._make_room(ref.uri, needed)
            if len(blobs) == 1:
                return int(await self._blob(blobs[0], client))
            downloaded = 0

            async def provide(blob: _Blob) -> None:
                nonlocal downloaded
                downloaded += await self._blob(blob, client)

            await all_or_first_failure(blobs, provide, catch=(ArtifactError,))
            return downloaded
        finally:
            self._reserved_bytes -= reserved

    async def _make_room(self, uri: str, needed: int) -> None:
        """Evict for the bytes about to arrive: to stay under `cache_max_bytes`, and to have
        `needed` bytes free on the disk. InsufficientDisk, with nothing evicted, when even every
        unused artifact would not free enough."""
        free = await trio.to_thread.run_sync(cache_files.free_bytes, self.directory)
        over_limit = self._cache_bytes() + self._reserved_bytes - self._cfg.cache_max_bytes
        short = needed - free
        plan, freeable = self._plan(max(over_limit, short))
        if short > 0 and freeable < short:
            raise InsufficientDisk(
                f"{uri}: {needed} bytes are still to download, but only {free} bytes are free in "
                f"{self.directory} (evicting every unused artifact would free {freeable} more)",
                needed_bytes=needed,
                free_bytes=free,
            )
        await self._evict(plan)
        self._warn_if_over_limit()

    def _plan(self, need: int) -> tuple[list[str], int]:
        """The least recently used unprotected artifacts (manifests, and blobs no kept manifest
        uses) whose removal frees at least `need` bytes, or all there are; and what they free."""
        if need <= 0:
            return [], 0
        refs = self._references()
        units = [*self._manifests, *(s for s in self._entries if not refs[s])]
        units.sort(key=lambda key: self._used_ns.get(key, 0))
        plan: list[str] = []
        freed = 0
        for key in units:
            if freed >= need:
                break
            if self._protected(key):
                continue
            if key in self._manifests:
                for sha in self._manifests[key].blobs():
                    refs[sha] -= 1
                    if refs[sha] == 0 and sha in self._entries and not self._protected(sha):
                        freed += self._entries[sha]
            else:
                freed += self._entries[key]
            plan.append(key)
        return plan, freed

    async def _evict(self, plan: Iterable[str]) -> int:
        """Remove the planned artifacts that are still unprotected; bytes freed."""
        freed = 0
        for key in plan:
            if self._protected(key):
                continue
            manifest = self._manifests.get(key)
            if manifest is None:
                if key in self._entries and not self._references()[key]:
                    freed += await self._remove_blob(key)
                    self._counters.evictions += 1
                    log.info("evicted artifact %s (least recently used)", key)
                continue
            async with self._slot(key):
                if self._manifests.pop(key, None) is None:
                    continue
                self._used_ns.pop(key, None)
                await trio.to_thread.run_sync(
                    cache_files.remove_manifest, self.directory / cache_files.MANIFESTS_DIR, self.directory_of(key)
                )
            refs = self._references()
            for sha in manifest.blobs():
                if not refs[sha] and sha in self._entries and not self._protected(sha):
                    freed += await self._remove_blob(sha)
            self._counters.evictions += 1
            log.info("evicted model directory %s (least recently used)", key)
        return freed

    async def _remove_blob(self, sha256: str) -> int:
        async with self._slot(sha256):
            size = self._entries.pop(sha256, 0)
            self._used_ns.pop(sha256, None)
            await trio.to_thread.run_sync(cache_files.remove, self.path_of(sha256))
        return size

    def _warn_if_over_limit(self) -> None:
        over = self._cache_bytes() + self._reserved_bytes - self._cfg.cache_max_bytes
        if over > 0:
            log.warning(
                "artifact cache is %d bytes over its limit of %d: the rest is in use or being fetched",
                over,
                self._cfg.cache_max_bytes,
            )

    async def _blob(self, blob: _Blob, client: S3Client) -> bool:
        """Make one blob present; True if it was downloaded."""
        f = blob.file
        async with self._slot(f.sha256):
            if f.sha256 in self._entries and await self._blob_hit(blob):
                return False
            async with self._limiter:
                await self._download(blob, client)
            return True

    async def _blob_hit(self, blob: _Blob) -> bool:
        f = blob.file
        size = self._entries[f.sha256]
        if size != f.size_bytes:
            # The file was verified against this digest when it was stored, so the reference
            # is the inconsistent part; keep the file (other deployments may use it).
            self._counters.mismatches += 1
            raise ArtifactDigestMismatch(
                f"{blob.label}: declared size {f.size_bytes} bytes, but the verified artifact with "
                f"sha256 {f.sha256} is {size} bytes"
            )
        used_ns = await trio.to_thread.run_sync(cache_files.touch, self.path_of(f.sha256))
        if used_ns is None:
            log.warning("cached artifact %s disappeared from %s; downloading it again", f.sha256, self.directory)
            del self._entries[f.sha256]
            return False
        self._used_ns[f.sha256] = used_ns
        log.debug("artifact %s: cache hit (%d bytes)", f.sha256, size)
        return True

    async def _manifest_hit(self, digest: str) -> Path | None:
        if digest not in self._manifests:
            return None
        manifests = self.directory / cache_files.MANIFESTS_DIR
        used_ns = await trio.to_thread.run_sync(cache_files.touch_manifest, manifests, self.directory_of(digest))
        if used_ns is None:
            log.warning("model directory %s disappeared; assembling it again", digest)
            del self._manifests[digest]
            self._used_ns.pop(digest, None)
            await trio.to_thread.run_sync(cache_files.remove_manifest, manifests, self.directory_of(digest))
            return None
        self._used_ns[digest] = used_ns
        log.debug("model directory %s: cache hit", digest)
        return self.directory_of(digest)

    async def _assemble(self, ref: ArtifactRef, manifest: Manifest) -> Path:
        digest = ref.sha256
        try:
            copied = await trio.to_thread.run_sync(
                cache_files.assemble_directory, self.directory, self.models_directory, digest, manifest
            )
        except OSError as exc:
            raise ArtifactError(f"cannot assemble {ref.uri} in {self.models_directory}: {exc.strerror or exc}") from exc
        if copied:
            log.warning(
                "model directory %s: %s is not on the filesystem of the artifact cache %s, so %d file(s) "
                "were copied instead of hard-linked (twice the disk); put both on one filesystem",
                digest,
                self.models_directory,
                self.directory,
                copied,
            )
        self._manifests[digest] = manifest
        self._used_ns[digest] = time.time_ns()
        log.info("model directory %s assembled: %d file(s), %d bytes", digest, len(manifest.files), manifest.size_bytes)
        return self.directory_of(digest)

    async def _download(self, blob: _Blob, client: S3Client) -> None:
        f = blob.file
        if not self._cfg.s3_endpoint:
            raise ArtifactUnavailable(f"cannot fetch {blob.uri}: no S3 endpoint is configured (artifacts.s3_endpoint)")
        try:
            part = await trio.to_thread.run_sync(cache_files.PartFile, self.directory, f.sha256, f.size_bytes)
        except OSError as exc:
            raise ArtifactError(f"cannot write to the artifact cache: {exc.strerror or exc}") from exc
        discard = False
        try:
            started = time.monotonic()
            if part.size:
                log.info("resuming %s at %d bytes", f.sha256, part.size)
            else:
                log.info("fetching artifact %s (%d bytes, sha256 %s)", blob.uri, f.size_bytes, f.sha256)
            # Twice at most: a range the store answers wrongly is asked for again from zero.
            if not await self._request(blob, part, client):
                await trio.to_thread.run_sync(part.restart)
                await self._request(blob, part, client)
            self._verify(blob, part)
            await trio.to_thread.run_sync(part.commit, self.path_of(f.sha256))
        except ArtifactDigestMismatch:
            discard = True
            raise
        except OSError as exc:
            discard = True
            raise ArtifactError(f"cannot store {blob.uri} in the artifact cache: {exc.strerror or exc}") from exc
        finally:
            # A mismatch or a write failure leaves nothing behind; a cancelled or cut-off download
            # keeps what arrived, under its deterministic name, for the next attempt to resume.
            with trio.move_on_after(PART_CLOSE_TIMEOUT_S, shield=True):
                await trio.to_thread.run_sync(part.discard if discard else part.close)
        elapsed = time.monotonic() - started
        self._entries[f.sha256] = f.size_bytes
        self._used_ns[f.sha256] = time.time_ns()
        self._counters.downloads += 1
        self._counters.blob_downloads[f.sha256] += 1
        log.info(
            "artifact %s verified: %d bytes in %.2f s (%.1f MB/s)",
            f.sha256,
            f.size_bytes,
            elapsed,
            f.size_bytes / max(elapsed, 1e-6) / 1e6,
        )

    def _verify(self, blob: _Blob, part: cache_files.PartFile) -> None:
        f = blob.file
        digest = part.hexdigest()
        if part.size != f.size_bytes or digest != f.sha256:
            self._counters.mismatches += 1
            raise ArtifactDigestMismatch(
                f"{blob.label}: expected sha256 {f.sha256} ({f.size_bytes} bytes), "
                f"got sha256 {digest} ({part.size} bytes)"
            )

    async def _request(self, blob: _Blob, part: cache_files.PartFile, client: S3Client) -> bool:
        """One GET into `part`, from `part.size` on; False when a ranged answer does not fit (start over)."""
        offset = part.size
        bucket, key = split_s3_uri(blob.uri)
        try:
            async with client.stream(bucket, key, start=offset) as response:
                return await self._receive(blob, part, response)
        except (ArtifactRefused, ArtifactUnavailable) as exc:
            if exc.status is None:  # no answer, or it broke off: already names the object
                raise
            if offset and exc.status == 416:
                log.warning("S3 store refused range bytes=%d- for %s: downloading it from the start", offset, blob.uri)
                return False
            raise _refusal(exc.status, exc.s3_code, blob.uri, anonymous=client.anonymous) from None

    async def _receive(self, blob: _Blob, part: cache_files.PartFile, response: ObjectStream) -> bool:
        f = blob.file
        offset = part.size
        status = response.status
        if offset and status == 206:
            if not _range_fits(response.headers.get("content-range"), offset, f.size_bytes):
                log.warning(
                    "S3 store answered range %s for %s, not bytes %d-: downloading it from the start",
                    response.headers.get("content-range"),
                    blob.uri,
                    offset,
                )
                return False
            self._counters.resumed += 1
        elif status == 206:
            raise _refusal(status, response.reason, blob.uri, anonymous=False)
        elif offset:
            log.info("S3 store sent all of %s instead of the range: downloading it from the start", blob.uri)
            await trio.to_thread.run_sync(part.restart)
        declared = declared_bytes(response.headers.get("content-length"))
        if declared is not None and part.size + declared != f.size_bytes:
            self._counters.mismatches += 1
            raise ArtifactDigestMismatch(
                f"{blob.label}: the store holds {part.size + int(declared)} bytes, "
                f"the assignment declares {f.size_bytes}"
            )
        await self._pipe(response, blob, part)
        return True

    async def _pipe(self, response: ObjectStream, blob: _Blob, part: cache_files.PartFile) -> None:
        """Move the body into `part`.

        This task reads while a second one hashes and writes the previous block in a worker
        thread, so network and disk overlap. Each side catches its own failure, records it and
        cancels the other; it is raised here after both stopped (no exception group escapes).
        """
        blocks_tx, blocks_rx = trio.open_memory_channel[list[bytes]](WRITE_QUEUE_BLOCKS)
        failures: list[Exception] = []

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
                    await self._read_blocks(response, blob, part.size, blocks_tx)
                except ArtifactError as exc:
                    failures.append(exc)
                    nursery.cancel_scope.cancel()
        if failures:
            raise failures[0]

    async def _read_blocks(
        self, response: ObjectStream, blob: _Blob, offset: int, blocks: trio.MemorySendChannel[list[bytes]]
    ) -> None:
        size = blob.file.size_bytes
        received = offset
        block: list[bytes] = []
        block_bytes = 0
        # aclosing: an abort closes the iterator at once. (httpx's inner stream layers are async
        # generators too and are left for trio to finalize: encode/httpx#3686.)
        async with aclosing(response.chunks()) as chunks:
            async for chunk in chunks:
                received += len(chunk)
                self._counters.bytes_downloaded += len(chunk)
                if received > size:
                    self._counters.mismatches += 1
                    raise ArtifactDigestMismatch(
                        f"{blob.label}: the store sent more than the declared {size} bytes; aborted"
                    )
                block.append(chunk)
                block_bytes += len(chunk)
                if block_bytes >= WRITE_BLOCK_BYTES:
                    await blocks.send(block)
                    block, block_bytes = [], 0
        if block:
            await blocks.send(block)


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


def _blobs_of(ref: ArtifactRef, manifest: Manifest) -> list[_Blob]:
    """The distinct blobs of a manifest (two paths with the same bytes are one download)."""
    if not ref.files:
        return [_Blob(file=manifest.files[0], uri=ref.uri, label=ref.uri)]
    blobs: dict[str, _Blob] = {}
    for f in manifest.files:
        uri = ref.object_uri(f.path)
        blobs.setdefault(f.sha256, _Blob(file=f, uri=uri, label=f"{uri} (file {f.path!r})"))
    return list(blobs.values())


def _range_fits(content_range: str | None, offset: int, size: int) -> bool:
    """Whether a 206's `Content-Range` is exactly the rest of the object, from `offset`."""
    match = _CONTENT_RANGE_RE.match(content_range or "")
    if match is None:
        return False
    first, last, total = match.groups()
    return int(first) == offset and int(last) == size - 1 and total in ("*", str(size))


def _refusal(http_status: int, code: str, uri: str, *, anonymous: bool) -> ArtifactUnavailable:
    """Turn a refused GET into ArtifactUnavailable naming the S3 error code, never a credential."""
    status = f"{http_status} {code}"
    log.warning("S3 store answered %s for %s", status, uri)
    if code == "SignatureDoesNotMatch":
        return ArtifactUnavailable(
            f"the S3 store refused the request signature for {uri} ({status}): "
            "check the secret access key in the S3 credentials file"
        )
    if code == "InvalidAccessKeyId":
        return ArtifactUnavailable(f"the S3 store does not know the configured access key id ({status})")
    if code in {"NoSuchKey", "NoSuchBucket"} or http_status == 404:
        return ArtifactUnavailable(f"{uri} does not exist in the S3 store ({status})")
    if http_status == 403:
        hint = ": no S3 credentials are configured (artifacts.s3_credentials_file)" if anonymous else ""
        return ArtifactUnavailable(f"the S3 store denied access to {uri} ({status}){hint}")
    return ArtifactUnavailable(f"the S3 store failed to serve {uri} ({status})")
