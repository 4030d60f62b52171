"""`nexa models push`: walk a local model directory, hash its files, upload them to the
S3-compatible store and write the manifest object. The CLI registers the result.

The walk is strict, so that what is registered is exactly what the directory holds:

- regular files are taken, in sorted order, under their POSIX path relative to the directory;
- a symlink to a regular file inside the directory is followed: the target's bytes are uploaded
  under the link's path (Hugging Face caches are trees of such links);
- refused, naming the file: a symlink that leaves the directory, dangles, or points at a
  directory (which could repeat paths or loop); a fifo, socket or device; a path a manifest may
  not hold (`nexa.contracts.manifest.path_problem`); more than `MAX_FILES` files; a directory
  with no files, or with nothing but empty files.

Empty sub-directories hold no file and are not part of the manifest; a top-level `.git/` and
`.cache/huggingface/` (`LEFT_OUT_DIRS`) are left out with a warning. A single file is a manifest
of one, named by its file name.

Every file is hashed in a worker thread, streamed (never read whole). A re-run HEADs each key and
skips a file the store holds with the same size and `x-amz-meta-sha256`. A push never breaks a
registered version: one that would put other bytes where a registered manifest names a file
(`held`, from the controller) is refused before anything is uploaded, naming the file and the version. Files of at least
`multipart_threshold` bytes go up as multipart uploads of `part_size` parts; `parallel` bounds
the requests in flight (whole files and parts together). Progress goes to stderr: bytes, rate
and ETA, rewritten in place on a terminal, one line every few seconds otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, TextIO

import attrs
import trio

from nexa.contracts.manifest import (
    MAX_FILES,
    ArtifactFile,
    Manifest,
    default_entry,
    manifest_problems,
    path_problem,
)
from nexa.errors import ArtifactInUse, ArtifactInvalid, ArtifactSizeMismatch, ConfigError
from nexa.s3.client import MIN_PART_BYTES, S3Client, split_s3_uri
from nexa.sigv4 import S3Credentials

log = logging.getLogger(__name__)

DEFAULT_MULTIPART_THRESHOLD: Final = 64 * 1024**2
DEFAULT_PART_SIZE: Final = 16 * 1024**2
DEFAULT_PARALLEL: Final = 4
MANIFEST_SUFFIX: Final = ".nexa-manifest.json"
#: Seconds between progress lines: rewritten in place on a terminal, appended otherwise.
TTY_INTERVAL_S: Final = 0.25
LOG_INTERVAL_S: Final = 5.0
_HASH_CHUNK: Final = 1024**2
#: Directories of a checkout that are not the model: left out of the walk, with a warning.
LEFT_OUT_DIRS: Final = {
    ".git": "git's metadata (a clone holds every file a second time in it)",
    ".cache/huggingface": "the download cache `huggingface-cli download --local-dir` writes",
}


@attrs.frozen
class LocalFile:
    """One file of the directory: its manifest path, where its bytes are read, and its size."""

    path: str
    source: Path
    size_bytes: int


# --- the walk -------------------------------------------------------------------------------------


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "a character device" if stat.S_ISCHR(mode) else "")


def _refuse(shown: str, why: str) -> ArtifactInvalid:
    return ArtifactInvalid(f"cannot push {shown}: {why}; nothing was uploaded")


def _regular(shown: str, path: Path, root: Path | None) -> os.stat_result:
    """The stat of a regular file, following a symlink only to a regular file inside `root`."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        target = Path(os.path.realpath(path))
        if root is not None and not target.is_relative_to(root):
            raise _refuse(shown, "it is a symlink that leaves the directory")
        try:
            st = target.stat()
        except OSError:
            raise _refuse(shown, "it is a symlink to nothing") from None
        if stat.S_ISDIR(st.st_mode):
            raise _refuse(shown, "it is a symlink to a directory (only symlinks to files are followed)")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(shown, f"it is {_kind(st.st_mode) or 'not a regular file'}")
    return st


def walk(top: Path) -> list[LocalFile]:
    """The files to push from `top` (a directory, or one file), sorted by path; raises
    ArtifactInvalid naming the first file that cannot be pushed. Sync: call it in a thread."""
    try:
        top_stat = top.stat()
    except OSError as exc:
        raise _refuse(str(top), exc.strerror or "it cannot be read") from None
    if not stat.S_ISDIR(top_stat.st_mode):
        st = _regular(str(top), top, None)
        files = [LocalFile(path=top.name, source=top, size_bytes=st.st_size)]
    else:
        root = Path(os.path.realpath(top))
        files = []
        _walk_into(root, root, "", files)
    if not files:
        raise _refuse(str(top), "the directory holds no files")
    if not any(f.size_bytes for f in files):
        raise _refuse(str(top), "every file in it is empty")
    return files


def _walk_into(root: Path, here: Path, prefix: str, files: list[LocalFile]) -> None:
    try:
        names = sorted(os.listdir(here))
    except OSError as exc:
        raise _refuse(prefix.rstrip("/") or str(root), exc.strerror or "it cannot be listed") from None
    for name in names:
        rel = prefix + name
        path = here / name
        if rel in LEFT_OUT_DIRS and path.is_dir():
            log.warning("leaving out %s/: %s, not part of the model", rel, LEFT_OUT_DIRS[rel])
            continue
        if problem := path_problem(rel):
            raise _refuse(repr(rel), f"its path cannot be in a manifest ({problem})")
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode):
            _walk_into(root, path, rel + "/", files)
            continue
        st = _regular(rel, path, root)
        files.append(LocalFile(path=rel, source=path, size_bytes=st.st_size))
        if len(files) > MAX_FILES:
            raise _refuse(rel, f"a manifest holds at most {MAX_FILES} files")


def hash_file(file: LocalFile) -> ArtifactFile:
    """The file's manifest entry: stream it through sha256. Sync (run it in a worker thread);
    raises ArtifactSizeMismatch if the file changed size since the walk."""
    digest = hashlib.sha256()
    size = 0
    with file.source.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    if size != file.size_bytes:
        raise ArtifactSizeMismatch(f"{file.path} changed while it was read ({file.size_bytes} → {size} bytes)")
    return ArtifactFile(path=file.path, size_bytes=size, sha256=digest.hexdigest())


async def build_manifest(
    top: Path, *, entry: str | None = None, parallel: int = DEFAULT_PARALLEL
) -> tuple[Manifest, list[LocalFile]]:
    """Walk and hash `top` (in worker threads, `parallel` files at once); the manifest and its files.
    `entry` defaults to `default_entry` of the paths. Raises ArtifactInvalid naming the problem."""
    files = await trio.to_thread.run_sync(walk, top)
    limiter = trio.CapacityLimiter(max(1, parallel))
    hashed: list[ArtifactFile | None] = [None] * len(files)

    async def one(i: int) -> None:
        hashed[i] = await trio.to_thread.run_sync(hash_file, files[i], limiter=limiter)

    async with trio.open_nursery() as nursery:
        for i in range(len(files)):
            nursery.start_soon(one, i)
    entries = [h for h in hashed if h is not None]
    chosen = entry if entry is not None else default_entry([f.path for f in files])
    if problems := manifest_problems(entries, chosen, field="manifest"):
        raise _refuse(str(top), "; ".join(problems))
    return Manifest(files=tuple(entries), entry=chosen), files


# --- progress -------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB"


class Progress:
    """Bytes done of a total, with rate and ETA, for stderr. On a terminal one line is
    rewritten in place (`\\r`); otherwise a line is appended every `interval_s`. Notes (a file
    uploaded or skipped) are printed on their own lines. Never prints keys or credentials."""

    def __init__(
        self,
        total_bytes: int,
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty() if tty is None else tty
        self.interval_s = interval_s if interval_s is not None else (TTY_INTERVAL_S if self._tty else LOG_INTERVAL_S)
        self._clock = clock
        self._started = clock()
        self._open_line = False

    def add(self, n: int) -> None:
        self.done_bytes += n

    def line(self) -> str:
        elapsed = max(self._clock() - self._started, 1e-9)
        rate = self.done_bytes / elapsed
        left = self.total_bytes - self.done_bytes
        eta = f"{left / rate:.0f} s" if rate > 0 else "-"
        share = 100 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        return (
            f"uploaded {_mib(self.done_bytes)} of {_mib(self.total_bytes)} ({share:.0f}%), "
            f"{rate / 1e6:.1f} MB/s, ETA {eta}"
        )

    def show(self) -> None:
        if self._tty:
            self._stream.write("\r" + self.line() + "\x1b[K")
            self._open_line = True
        else:
            self._stream.write(self.line() + "\n")
        self._stream.flush()

    def note(self, text: str) -> None:
        if self._open_line:
            self._stream.write("\r\x1b[K")
            self._open_line = False
        self._stream.write(text + "\n")
        self._stream.flush()

    def finish(self) -> None:
        elapsed = self._clock() - self._started
        self.note(f"{self.line().replace(', ETA 0 s', '')} in {elapsed:.1f} s")

    async def run(self) -> None:
        """Show the progress every `interval_s` until cancelled."""
        while True:
            await trio.sleep(self.interval_s)
            self.show()


# --- the upload -----------------------------------------------------------------------------------


@attrs.frozen
class PushOptions:
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD
    part_size: int = DEFAULT_PART_SIZE
    parallel: int = DEFAULT_PARALLEL


@attrs.frozen
class PushResult:
    manifest: Manifest
    #: `s3://bucket/prefix/`: the artifact's `uri`.
    prefix_uri: str
    manifest_uri: str
    uploaded: tuple[str, ...]
    skipped: tuple[str, ...]
    #: path → number of parts, for the files that went up as multipart uploads.
    multipart: dict[str, int]


def options_problems(options: PushOptions) -> list[str]:
    problems = []
    if options.part_size < MIN_PART_BYTES:
        problems.append(f"--part-size: at least 5MiB ({MIN_PART_BYTES} bytes): S3 refuses smaller parts but the last")
    if options.multipart_threshold < 1:
        problems.append("--multipart-threshold: at least 1 byte")
    if not 1 <= options.parallel <= 64:
        problems.append("--parallel: 1 to 64")
    return problems


def prefix_problem(uri: str) -> str | None:
    if not uri.startswith("s3://"):
        return f"--to must be an s3://bucket/prefix/ URI, not {uri[:80]!r}"
    bucket, key = split_s3_uri(uri)
    if not bucket or not key.endswith("/"):
        return f"--to must name a bucket and a prefix ending in '/': s3://bucket/models/name/version/, not {uri[:80]!r}"
    return None


@attrs.frozen
class Held:
    """An object a registered model version's manifest names: the sha256 it must keep, and whose it is."""

    sha256: str
    version: str


def check_overwrites(manifest: Manifest, prefix_uri: str, held: Mapping[str, Held]) -> None:
    """Raise ArtifactInUse when a file of `manifest` would go, with other bytes, where `held` (the
    `s3://bucket/key` of every file a registered version names) says a version's file is."""
    bucket, prefix = split_s3_uri(prefix_uri)
    for entry in manifest.files:
        uri = f"s3://{bucket}/{prefix}{entry.path}"
        holder = held.get(uri)
        if holder is not None and holder.sha256 != entry.sha256:
            raise ArtifactInUse(
                f"cannot push {entry.path} to {uri}: model {holder.version} holds other bytes there, and"
                " overwriting them would break it; push this version under a prefix of its own (--to"
                " s3://BUCKET/models/NAME/VERSION/, the default with --bucket). Nothing was uploaded"
            )


async def push(
    s3: S3Client,
    manifest: Manifest,
    files: Sequence[LocalFile],
    prefix_uri: str,
    *,
    options: PushOptions = PushOptions(),
    progress: Progress | None = None,
    held: Mapping[str, Held] | None = None,
) -> PushResult:
    """Upload every file of `manifest` under `prefix_uri` (skipping those the store holds with the
    same size and sha256), then the manifest object beside the prefix. Refused, before any upload,
    when it would overwrite a file `held` says a registered version names (`check_overwrites`)."""
    if problem := prefix_problem(prefix_uri):
        raise ConfigError(problem)
    if problems := options_problems(options):
        raise ConfigError("; ".join(problems), problems=tuple(problems))
    check_overwrites(manifest, prefix_uri, held or {})
    bucket, prefix = split_s3_uri(prefix_uri)
    by_path = {f.path: f for f in files}
    progress = progress or Progress(manifest.size_bytes, tty=False)
    limiter = trio.CapacityLimiter(options.parallel)
    uploaded: list[str] = []
    skipped: list[str] = []
    multipart: dict[str, int] = {}

    async def one(entry: ArtifactFile) -> None:
        local, key = by_path[entry.path], prefix + entry.path
        async with limiter:
            held = await s3.head(bucket, key)
        if held and held.size_bytes == entry.size_bytes and held.metadata.get("sha256") == entry.sha256:
            progress.add(entry.size_bytes)
            skipped.append(entry.path)
            progress.note(f"skipped {entry.path} (the store holds it with the same sha256)")
            return
        if entry.size_bytes >= options.multipart_threshold:
            _, parts = await s3.put_file_multipart(
                bucket, key, local.source, size_bytes=entry.size_bytes, sha256=entry.sha256,
                part_size=options.part_size, limiter=limiter, on_bytes=progress.add,
            )  # fmt: skip
            multipart[entry.path] = parts
            how = f" ({parts} parts)"
        else:
            async with limiter:
                await s3.put_file(
                    bucket, key, local.source, size_bytes=entry.size_bytes, sha256=entry.sha256,
                    on_bytes=progress.add,
                )  # fmt: skip
            how = ""
        uploaded.append(entry.path)
        progress.note(f"uploaded {entry.path}, {_mib(entry.size_bytes)}{how}")

    async with trio.open_nursery() as outer:
        outer.start_soon(progress.run)
        async with trio.open_nursery() as nursery:
            for entry in manifest.files:
                nursery.start_soon(one, entry)
        outer.cancel_scope.cancel()
    progress.finish()
    manifest_key = prefix.rstrip("/") + MANIFEST_SUFFIX
    await s3.put_bytes(bucket, manifest_key, manifest.canonical_bytes(), content_type="application/json")
    return PushResult(
        manifest=manifest,
        prefix_uri=prefix_uri,
        manifest_uri=f"s3://{bucket}/{manifest_key}",
        uploaded=tuple(sorted(uploaded)),
        skipped=tuple(sorted(skipped)),
        multipart=multipart,
    )


async def push_directory(
    top: Path,
    prefix_uri: str,
    *,
    endpoint: str,
    region: str,
    credentials: S3Credentials | None,
    tls_verify: bool = True,
    entry: str | None = None,
    options: PushOptions = PushOptions(),
    progress_interval_s: float | None = None,
    stream: TextIO | None = None,
    held: Mapping[str, Held] | None = None,
) -> PushResult:
    """Walk, hash and upload `top` (the whole of `nexa models push` but the registration)."""
    if problem := prefix_problem(prefix_uri):
        raise ConfigError(problem)
    if problems := options_problems(options):
        raise ConfigError("; ".join(problems), problems=tuple(problems))
    manifest, files = await build_manifest(top, entry=entry, parallel=options.parallel)
    progress = Progress(manifest.size_bytes, stream=stream, interval_s=progress_interval_s)
    async with S3Client(endpoint, region=region, credentials=credentials, tls_verify=tls_verify) as s3:
        return await push(s3, manifest, files, prefix_uri, options=options, progress=progress, held=held)
