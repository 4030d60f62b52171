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
from pathlib import Path
from typing import Final, NoReturn

import attrs
import trio

from nexa.contracts import wire
from nexa.contracts.runtime import RuntimeSpec
from nexa.errors import RuntimeCacheNoRoom
from nexa.runtimes import image_digest, is_simulated

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

    async def acquire(self, assignment_id: str, runtime: RuntimeSpec) -> Path:
        """The replica's cache directory, created if new and marked in use; older unused
        directories are evicted to keep the cache within its bound. Raises RuntimeCacheNoRoom
        (and holds nothing) when the filesystem has less than `start_free_bytes` free even then."""
        key = cache_key(runtime)
        async with self._lock:
            self._holders[assignment_id] = key
            try:
                path = await trio.to_thread.run_sync(self._make, key)
                await trio.to_thread.run_sync(self._evict_for_start)
            except BaseException:
                del self._holders[assignment_id]
                raise
        return path

    def release(self, assignment_id: str) -> None:
        """The replica is gone: its directory stays (for the next replica of the same thing), unused."""
        key = self._holders.pop(assignment_id, None)
        if key is not None:
            _touch(self._root / key)

    async def measure(self) -> None:
        """Sizes of every directory and the filesystem's free and total bytes; evicts above the bound."""
        async with self._lock:
            await trio.to_thread.run_sync(self._measure_and_evict)

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
        in_use = set(self._holders.values())
        return wire.RuntimeCacheDisk(
            used_bytes=sum(self._sizes.values()),
            max_bytes=self._max_bytes,
            directories=len(self._sizes),
            in_use=len(in_use),
            free_bytes=free,
            total_bytes=total,
        )

    def statistics(self) -> RuntimeCacheStatistics:
        return RuntimeCacheStatistics(
            directories=len(self._sizes),
            in_use=len(set(self._holders.values())),
            used_bytes=sum(self._sizes.values()),
            evicted=self._evicted,
            evict_failures=self._evict_failures,
        )

    # --- in a worker thread

    def _make(self, key: str) -> Path:
        self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self._root / key
        path.mkdir(exist_ok=True)
        # Writable by the image's user, whoever it is; the 0700 root keeps other host users out.
        path.chmod(0o777)
        _touch(path)
        self._sizes.setdefault(key, 0)
        return path

    def _evict_for_start(self) -> int:
        """Evict down to the bound, then (if the disk is short) every unused directory; the free bytes."""
        self._measure_and_evict()
        free = self._free()
        if free < self._start_free_bytes:
            self._evict(target_bytes=0)
            free = self._free()
        if free < self._start_free_bytes:
            raise RuntimeCacheNoRoom(
                f"the runtime cache's disk ({self._root}) has {free} bytes free, less than the "
                f"{self._start_free_bytes} a start needs ([cache] runtime_cache_start_free_bytes), even "
                "with every unused runtime cache removed; free disk there or lower the setting",
                needed_bytes=self._start_free_bytes,
                free_bytes=free,
            )
        return free

    def _measure_and_evict(self) -> None:
        self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._sizes = {key: _du(self._root / key) for key in self._keys()}
        self._evict(target_bytes=self._max_bytes)
        try:
            st = os.statvfs(self._root)
        except OSError:
            self._disk = None
        else:
            self._disk = (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)

    def _evict(self, *, target_bytes: int) -> None:
        """Remove the least recently used directories no replica holds until at most `target_bytes` remain."""
        in_use = set(self._holders.values())
        total = sum(self._sizes.values())
        for key in sorted((k for k in self._sizes if k not in in_use), key=lambda k: _mtime(self._root / k)):
            if total <= target_bytes:
                break
            size = self._sizes[key]
            try:
                shutil.rmtree(self._root / key)
            except OSError as exc:
                self._evict_failures += 1
                log.warning("runtime cache %s could not be removed: %s", key[:12], exc)
                continue
            self._evicted += 1
            total -= size
            del self._sizes[key]
            log.info("runtime cache %s evicted (%d bytes, least recently used)", key[:12], size)

    def _keys(self) -> Iterator[str]:
        try:
            names = os.listdir(self._root)
        except FileNotFoundError:
            return
        for name in names:
            if len(name) == 64 and set(name) <= _KEY_CHARS and (self._root / name).is_dir():
                yield name

    def _free(self) -> int:
        try:
            st = os.statvfs(self._root)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize


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
