"""The artifact cache's files on disk: blobs, partial downloads, kept manifests and assembled model
directories. Sync and blocking: `nexa.node.artifacts` runs every function here in a worker thread.

Layout, for a cache directory `<cache>` (default `<state>/artifacts`) and `<models>` beside it:

    <cache>/<sha256>                      a verified blob, read-only (0444)
    <cache>/.partial-<sha256>             a download under way or interrupted (kept to resume)
    <cache>/manifests/<digest>.json       the canonical bytes of each assembled manifest
    <models>/<digest>/…                   hard links to the blobs, as the manifest's paths
    <models>/.tmp-<digest>-…              a directory being assembled (removed on open)

A model directory is valid only while its manifest file exists: the manifest is written before
the directory is renamed into place, and removed before the directory is. `open_cache_dir` removes
whatever a crash left in between.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path
from typing import Final

import attrs

from nexa.contracts.manifest import MANIFEST_SCHEMA, ArtifactFile, Manifest, manifest_problems
from nexa.contracts.runtime import SHA256_RE
from nexa.security import fsync_dir

#: Download files are `<cache>/.partial-<sha256>` (kept to resume); older names are removed on open.
PARTIAL_PREFIX: Final = ".partial-"
_RESUMABLE_RE: Final = re.compile(rf"^{re.escape(PARTIAL_PREFIX)}[0-9a-f]{{64}}$")
#: A partial download nobody resumed for this long is removed when the cache is opened.
PARTIAL_MAX_AGE_S: Final = 7 * 24 * 3600
#: The kept manifests, `<digest>.json`, below the cache directory.
MANIFESTS_DIR: Final = "manifests"
#: Model directories being assembled (and manifest files being written) start with this.
ASSEMBLY_PREFIX: Final = ".tmp-"
#: How much of a partial file is read at once to hash it before resuming.
HASH_READ_BYTES: Final = 1024 * 1024


class PartFile:
    """`<cache>/.partial-<sha256>`: a download that hashes what is written to it. A partial file
    left by an earlier attempt is hashed and continued (`size` is where the next byte goes)."""

    def __init__(self, directory: Path, sha256: str, expected_size: int) -> None:
        self.path = directory / f"{PARTIAL_PREFIX}{sha256}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "r+b")
        self._hash = hashlib.sha256()
        self.size = 0
        try:
            existing = os.fstat(fd).st_size
            if 0 < existing < expected_size:
                while block := self._file.read(HASH_READ_BYTES):
                    self._hash.update(block)
                    self.size += len(block)
            else:
                self._file.truncate(0)
        except BaseException:
            self._file.close()
            raise

    def restart(self) -> None:
        """Drop what is there and start from byte 0."""
        self._file.seek(0)
        self._file.truncate(0)
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self._hash.update(chunk)  # releases the GIL for large buffers
            self._file.write(chunk)
            self.size += len(chunk)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def commit(self, final: Path) -> None:
        """fsync, make read-only and rename into place atomically, then fsync the directory."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.path.chmod(0o444)
        touch(self.path)
        self.path.replace(final)
        fsync_dir(final.parent)

    def close(self) -> None:
        """Keep what arrived for a later attempt (nothing at all is not worth keeping)."""
        if self._file.closed:
            return
        self._file.close()
        if self.size == 0:
            self.path.unlink(missing_ok=True)

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def partial_sizes(directory: Path, sha256s: Iterable[str]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for sha256 in sha256s:
        with suppress(FileNotFoundError):
            sizes[sha256] = (directory / f"{PARTIAL_PREFIX}{sha256}").stat().st_size
    return sizes


def assemble_directory(cache: Path, models: Path, digest: str, manifest: Manifest) -> int:
    """Build `<models>/<digest>/` of hard links to the blobs (a copy across filesystems) in a
    temporary directory, keep the manifest in `<cache>/manifests/`, then rename the directory into
    place. The number of files copied rather than linked."""
    models.mkdir(mode=0o755, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{ASSEMBLY_PREFIX}{digest}-", dir=models))
    try:
        tmp.chmod(0o755)
        made: set[Path] = {tmp}
        copied = 0
        for f in manifest.files:
            # Paths were checked with the ArtifactRef (relative, no `..`): they stay inside `tmp`.
            target = tmp / f.path
            if target.parent not in made:
                target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                made.update(p for p in target.parents if p.is_relative_to(tmp))
            blob = cache / f.sha256
            try:
                os.link(blob, target)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                shutil.copyfile(blob, target)
                target.chmod(0o444)
                with target.open("rb") as copy:
                    os.fsync(copy.fileno())
                copied += 1
        for directory in sorted(made, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(directory)
        # The manifest first: a directory without its manifest is a leftover, removed on open.
        _write_atomically(cache / MANIFESTS_DIR, f"{digest}.json", manifest.canonical_bytes())
        final = models / digest
        if final.exists():
            shutil.rmtree(final)  # assembled before, but never recorded (cancelled in between)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(models)
    return copied


def _write_atomically(directory: Path, name: str, data: bytes) -> None:
    directory.mkdir(mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=ASSEMBLY_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def remove_manifest(manifests: Path, model_dir: Path) -> None:
    """The manifest first, then its directory: a crash in between leaves a leftover for `open`."""
    (manifests / f"{model_dir.name}.json").unlink(missing_ok=True)
    shutil.rmtree(model_dir, ignore_errors=True)


def touch_manifest(manifests: Path, model_dir: Path) -> int | None:
    if not model_dir.is_dir():
        return None
    return touch(manifests / f"{model_dir.name}.json")


def parse_manifest(raw: bytes) -> Manifest | None:
    """A kept manifest's canonical bytes, read back; None when they are not a valid manifest."""
    try:
        return _manifest_from_json(json.loads(raw))
    except (ValueError, UnicodeDecodeError):
        return None


def _manifest_from_json(body: object) -> Manifest:
    if not isinstance(body, dict) or body.get("schema") != MANIFEST_SCHEMA:
        raise ValueError("not a manifest")
    entry, listed = body.get("entry"), body.get("files")
    if not isinstance(entry, str) or not isinstance(listed, list):
        raise ValueError("no entry or files")
    files: list[ArtifactFile] = []
    for item in listed:
        if not isinstance(item, dict):
            raise ValueError("a file that is not an object")
        path, size, sha256 = item.get("path"), item.get("size_bytes"), item.get("sha256")
        if not isinstance(path, str) or not isinstance(size, int) or not isinstance(sha256, str):
            raise ValueError("a file without path, size or sha256")
        files.append(ArtifactFile(path=path, size_bytes=size, sha256=sha256))
    if manifest_problems(files, entry):
        raise ValueError("an invalid manifest")
    return Manifest(files=tuple(files), entry=entry)


@attrs.frozen
class OpenedCache:
    #: (sha256, size, last use ns) of verified blobs
    blobs: list[tuple[str, int, int]]
    #: (digest, manifest, last use ns) of assembled model directories
    manifests: list[tuple[str, Manifest, int]]
    #: leftovers removed: old partial files, half-assembled or unrecorded directories, bad manifests
    removed: int


def open_cache_dir(directory: Path, models: Path) -> OpenedCache:
    """Create the directory if needed, drop leftovers, list verified blobs and kept manifests."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    blobs: dict[str, tuple[int, int]] = {}
    removed = 0
    stale_ns = time.time_ns() - PARTIAL_MAX_AGE_S * 10**9
    for entry in os.scandir(directory):
        if entry.name.startswith(PARTIAL_PREFIX):
            # Kept to resume, unless from an older release (random names) or abandoned long ago.
            if not _RESUMABLE_RE.match(entry.name) or entry.stat(follow_symlinks=False).st_mtime_ns < stale_ns:
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
        elif SHA256_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            blobs[entry.name] = (st.st_size, st.st_mtime_ns)
    manifests: list[tuple[str, Manifest, int]] = []
    kept: set[str] = set()
    manifests_dir = directory / MANIFESTS_DIR
    if manifests_dir.is_dir():
        for entry in os.scandir(manifests_dir):
            digest = entry.name.removesuffix(".json")
            if entry.name.startswith(ASSEMBLY_PREFIX):
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
                continue
            if not entry.name.endswith(".json") or not SHA256_RE.match(digest):
                continue
            manifest = parse_manifest(Path(entry.path).read_bytes())
            usable = (
                manifest is not None
                and manifest.digest == digest
                and all(sha in blobs for sha in manifest.blobs())
                and (models / digest).is_dir()
            )
            if manifest is None or not usable:
                remove_manifest(manifests_dir, models / digest)
                removed += 1
                continue
            manifests.append((digest, manifest, entry.stat().st_mtime_ns))
            kept.add(digest)
    if models.is_dir():
        for entry in os.scandir(models):
            name = entry.name
            ours = name.startswith(ASSEMBLY_PREFIX) or SHA256_RE.match(name)
            if ours and name not in kept and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    found = sorted((used, sha, size) for sha, (size, used) in blobs.items())
    manifests.sort(key=lambda m: m[2])
    return OpenedCache(blobs=[(sha, size, used) for used, sha, size in found], manifests=manifests, removed=removed)


def touch(path: Path) -> int | None:
    """Record a use in the file's times (the LRU order a restart reads back): the time given, in
    ns; None if the file is gone.

    The time is given explicitly: the kernel's own file timestamps tick only every few
    milliseconds, which would tie uses that follow each other closely.
    """
    now_ns = time.time_ns()
    try:
        os.utime(path, ns=(now_ns, now_ns))
    except FileNotFoundError:
        return None
    return now_ns


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
