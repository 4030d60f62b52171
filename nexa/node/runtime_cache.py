"""Each replica's writable cache: a directory on the node's disk, mounted read-write (nosuid, nodev)
at `RUNTIME_CACHE_PATH` in its container, kept across restarts, bounded and evicted least recently
used, never while a replica uses it.

The runtime's root stays read-only and /tmp is a small tmpfs charged to its memory limit, so the
adapters (`nexa.adapters`) point every cache a runtime writes at warm-up there (`HOME`,
`XDG_CACHE_HOME`, Triton's, Inductor's, FlashInfer's, CUDA's, vLLM's, SGLang's). The directory is
keyed by what the runtime compiles for (`cache_key`): the image digest, the model digest and the
settings (the signed command and env, less the replica's port), so a restart, a replacement or a
second replica of the same thing on this node warms from what the first one wrote.

Each directory is `<root>/<key>`, mode 0777 so that the image's user (root or not) can write, under
a root that stays 0700. A directory's last use is its modification time, touched when a replica
takes it and when it gives it back. Above `max_bytes` the least recently used directories no
replica holds are removed; before a replica takes one, the cache's filesystem must have
`start_free_bytes` free (after eviction), else the start fails with `RuntimeCacheNoRoom`. A `sim`
runtime is a local process, not a container: it gets no cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Final, NoReturn

import attrs
import trio

from nexa.container_spec import image_digest, is_simulated
from nexa.contracts import wire
from nexa.contracts.runtime import RuntimeSpec
from nexa.errors import RuntimeCacheNoRoom

log = logging.getLogger(__name__)

#: The directories' names: 64 hex digits (sha256 of the key's parts).
_KEY_CHARS: Final = frozenset("0123456789abcdef")
#: Where the replica's port stands in the key, so that two replicas of one thing share a directory.
_PORT: Final = "{port}"


def cache_key(runtime: RuntimeSpec) -> str:
    """What a replica's caches are valid for: sha256 over the image digest, the model digest, the
    kind and the settings (command and env, the replica's own port left out)."""
    port = str(runtime.port)
    parts = {
        "kind": str(runtime.kind),
        "image": image_digest(runtime.image),
        "model": runtime.artifact.sha256 if runtime.artifact is not None else "",
        "command": [_PORT if arg == port else arg for arg in runtime.command],
        "env": dict(sorted(runtime.env.items())),
        "gpus": len(runtime.gpus),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@attrs.frozen(kw_only=True)
class RuntimeCacheStatistics:
    directories: int
    in_use: int
    used_bytes: int
    evicted: int
    evict_failures: int


class RuntimeCaches:
    """The node's replica caches under `root`; `acquire` and `release` per assignment, `run` measures."""

    def __init__(self, root: Path, *, max_bytes: int, start_free_bytes: int) -> None:
        self._root = root
        self._max_bytes = max_bytes
        self._start_free_bytes = start_free_bytes
        #: assignment id -> the key of the directory it holds.
        self._holders: dict[str, str] = {}
        #: key -> bytes on disk (last measured).
        self._sizes: dict[str, int] = {}
        self._disk: tuple[int, int] | None = None
        self._evicted = self._evict_failures = 0
        self._lock = trio.Lock()

    @property
    def root(self) -> Path:
        return self._root

    def wants(self, runtime: RuntimeSpec) -> bool:
        """Whether a replica of `runtime` gets a cache directory (a container does; `sim` does not)."""
        return not is_simulated(runtime)

    async def acquire(self, holder: str, runtime: RuntimeSpec) -> Path:
        """The replica's cache directory, created if new and marked held by `holder`; older unused
        directories are evicted to keep the cache within its bound. Raises RuntimeCacheNoRoom
        (and holds nothing) when the filesystem has less than `start_free_bytes` free even then."""
        key = cache_key(runtime)
        async with self._lock:
            self._holders[holder] = key
            try:
                path = await trio.to_thread.run_sync(_make, self._root, key)
                start_free = self._start_free_bytes
                self._take(
                    await trio.to_thread.run_sync(
                        partial(_measure, self._root, self._max_bytes, self._in_use(), start_free_bytes=start_free)
                    )
                )
                self._check_room()
            except BaseException:
                del self._holders[holder]
                raise
        return path

    def release(self, holder: str) -> None:
        """The replica is gone: its directory stays (for the next replica of the same thing), unused."""
        key = self._holders.pop(holder, None)
        if key is not None:
            _touch(self._root / key)

    async def measure(self) -> None:
        """Sizes of every directory and the filesystem's free and total bytes; evicts above the bound."""
        async with self._lock:
            self._take(await trio.to_thread.run_sync(_measure, self._root, self._max_bytes, self._in_use()))

    async def run(
        self, interval_s: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        task_status.started()
        while True:
            await self.measure()
            await trio.sleep(interval_s)

    def disk(self) -> wire.RuntimeCacheDisk | None:
        """What the heartbeat reports (None until first measured)."""
        if self._disk is None:
            return None
        free, total = self._disk
        return wire.RuntimeCacheDisk(
            used_bytes=sum(self._sizes.values()),
            max_bytes=self._max_bytes,
            directories=len(self._sizes),
            in_use=len(self._in_use()),
            free_bytes=free,
            total_bytes=total,
        )

    def statistics(self) -> RuntimeCacheStatistics:
        return RuntimeCacheStatistics(
            directories=len(self._sizes),
            in_use=len(self._in_use()),
            used_bytes=sum(self._sizes.values()),
            evicted=self._evicted,
            evict_failures=self._evict_failures,
        )

    def _check_room(self) -> None:
        free = self._disk[0] if self._disk is not None else 0
        if free < self._start_free_bytes:
            raise RuntimeCacheNoRoom(
                f"the runtime cache's disk ({self._root}) has {free} bytes free, less than the "
                f"{self._start_free_bytes} a start needs ([cache] runtime_cache_start_free_bytes), "
                "even with every unused runtime cache removed; free disk there or lower the setting",
                needed_bytes=self._start_free_bytes,
                free_bytes=free,
            )

    def _in_use(self) -> frozenset[str]:
        return frozenset(self._holders.values())

    def _take(self, measured: _Measured) -> None:
        """A worker thread's figures, taken on the trio thread (the thread touches no attribute)."""
        self._sizes, self._disk = measured.sizes, measured.disk
        self._evicted += measured.evicted
        self._evict_failures += measured.failures


@attrs.frozen(kw_only=True)
class _Measured:
    #: key -> bytes on disk, after eviction.
    sizes: dict[str, int]
    #: (free, total) bytes of the filesystem; None when it cannot be read.
    disk: tuple[int, int] | None
    evicted: int
    failures: int


# --- in a worker thread: the file system only, never the cache object's attributes


def _make(root: Path, key: str) -> Path:
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / key
    path.mkdir(exist_ok=True)
    # Writable by the image's user, whoever it is; the 0700 root keeps other host users out.
    path.chmod(0o777)
    _touch(path)
    return path


def _measure(root: Path, max_bytes: int, in_use: frozenset[str], *, start_free_bytes: int = 0) -> _Measured:
    """Every directory's size, eviction down to `max_bytes` (least recently used first, none in
    `in_use`) and, when the filesystem then has less than `start_free_bytes` free, of every unused one."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    sizes = {key: _du(root / key) for key in _keys(root)}
    evicted, failures = _evict(root, sizes, in_use, target_bytes=max_bytes)
    disk = _statvfs(root)
    if start_free_bytes and (disk is None or disk[0] < start_free_bytes):
        more, more_failures = _evict(root, sizes, in_use, target_bytes=0)
        evicted, failures, disk = evicted + more, failures + more_failures, _statvfs(root)
    return _Measured(sizes=sizes, disk=disk, evicted=evicted, failures=failures)


def _evict(root: Path, sizes: dict[str, int], in_use: frozenset[str], *, target_bytes: int) -> tuple[int, int]:
    """Remove the least recently used directories not `in_use` until at most `target_bytes`
    remain (`sizes` is updated); (removed, failed)."""
    total = sum(sizes.values())
    removed = failed = 0
    for key in sorted((k for k in sizes if k not in in_use), key=lambda k: _mtime(root / k)):
        if total <= target_bytes:
            break
        size = sizes[key]
        try:
            shutil.rmtree(root / key)
        except OSError as exc:
            failed += 1
            log.warning("runtime cache %s could not be removed: %s", key[:12], exc)
            continue
        removed += 1
        total -= size
        del sizes[key]
        log.info("runtime cache %s evicted (%d bytes, least recently used)", key[:12], size)
    return removed, failed


def _keys(root: Path) -> Iterator[str]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        if len(name) == 64 and set(name) <= _KEY_CHARS and (root / name).is_dir():
            yield name


def _statvfs(root: Path) -> tuple[int, int] | None:
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _du(path: Path) -> int:
    """Bytes the files under `path` take on disk (symbolic links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)
