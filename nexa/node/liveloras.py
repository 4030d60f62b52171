"""LoRA adapters loaded at run time (`RuntimeSpec.live_loras`): the node's side of `Assignment.loras`.

Per assignment, each given adapter's artifact is pinned in the artifact cache while it is given,
fetched (verified, by the cache) in the background, and linked into the assignment's own adapter
directory, `<root>/<directory_name(id)>/<name>`: a manifest's files as a directory, one object as a
file, hard links to the cache's verified files (a copy where the filesystem refuses a link). The
container mounts that directory read-only at `/models/lora`, so `/models/lora/<name>` (plus the
artifact's entry) is what the runtime loads. A change of the adapters never touches the runtime:
the relay (`nexa.node.lora`) loads what a request names once it lies here, and unloads what is no
longer given. Entries no longer given are removed, and a directory goes with its assignment; what
an earlier agent left of assignments no longer present is removed at the first pass.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Mapping, Set
from pathlib import Path
from typing import Final, NoReturn

import attrs
import trio

from nexa import container_spec
from nexa.contracts import wire
from nexa.contracts.runtime import ArtifactRef, LoraSpec
from nexa.errors import ArtifactError, ContractError
from nexa.node.lora import LiveLora
from nexa.node.replicas import Artifacts

log = logging.getLogger(__name__)

#: The folder of the adapter directories, beside the artifact cache's (`<state_dir>/loras/`).
LIVE_LORAS_DIR: Final = "loras"
#: The longest adapter name kept (bytes of UTF-8): one file name, with room below the usual 255.
MAX_NAME_BYTES: Final = 200
#: An entry being linked in is built under this name first, then renamed into place.
PARTIAL_PREFIX: Final = ".partial-"
#: A failed fetch is tried again after this long, doubling up to the maximum.
FETCH_RETRY_INITIAL_S: Final = 1.0
FETCH_RETRY_MAX_S: Final = 60.0
#: Bound on one artifact-cache eviction after adapters are no longer given.
EVICT_TIMEOUT_S: Final = 60.0
# A link the filesystem refuses: across filesystems, or where links are not allowed.
_NO_LINK: Final = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP})


def name_problem(name: str) -> str | None:
    """Why `name` cannot be an entry of an adapter directory (one safe path component), or None."""
    if not name or name.startswith("."):
        return "empty, or starts with '.'"
    if "/" in name or "\\" in name or "\x00" in name or not name.isprintable():
        return "holds '/', '\\', NUL or a control character"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"longer than {MAX_NAME_BYTES} bytes"
    return None


def directory_name(assignment_id: str) -> str:
    """The adapter directory's name for an assignment: its container's name (always one safe component)."""
    return container_spec.container_name(assignment_id)


@attrs.frozen(kw_only=True)
class LiveLoraStatistics:
    """A snapshot of the adapters kept (trio's `statistics()` convention)."""

    #: Adapters given now, over every assignment, and those of them lying ready.
    given: int
    ready: int
    #: Entries linked in, and entries or directories removed, since the agent started.
    placed: int
    removed: int
    #: Names refused (not one safe path component).
    refused: int


class LiveLoras:
    """Every assignment's adapter directory under `root` (beside the artifact cache, on its filesystem).

    The supervisor calls `update()` with each desired set, `open_directory()` before it creates a
    container that mounts it, `view()` for the relay and `wake()` when a worker is gone, and runs
    `run()`. `in_use()` names the assignments that still have a worker (desired, or tearing down):
    their directories stay. `root` None: this node keeps none (a runtime asking fails to start).
    """

    def __init__(self, root: Path | None, artifacts: Artifacts, *, in_use: Callable[[], Set[str]]) -> None:
        self.root = root
        self._artifacts = artifacts
        self._in_use = in_use
        #: assignment id → name → the adapter given now (live_loras runtimes only; safe names only).
        self._given: dict[str, dict[str, LoraSpec]] = {}
        #: assignment id → name → (adapter, where it lies): what is in the directories now.
        self._ready: dict[str, dict[str, tuple[LoraSpec, Path]]] = {}
        #: (assignment id, name) → the artifact digest pinned for it.
        self._pins: dict[tuple[str, str], str] = {}
        self._fetching: set[tuple[str, str, str]] = set()
        self._refused: set[tuple[str, str]] = set()
        self._known = self._unpinned = False
        self._changed = trio.Event()
        #: Every change to the directories happens under it (a placement never races a removal).
        self._lock = trio.Lock()
        self._placed = self._removed = 0

    # --- what the supervisor calls

    def update(self, assignments: Iterable[wire.Assignment]) -> None:
        """The adapters the desired set gives: pin what is newly given, unpin what is not any more."""
        given: dict[str, dict[str, LoraSpec]] = {}
        for a in assignments:
            if not a.runtime.live_loras:
                continue
            names = given[a.id] = {}
            for lora in a.loras:
                problem = name_problem(lora.name)
                if problem is None:
                    names[lora.name] = lora
                elif (a.id, lora.name) not in self._refused:
                    self._refused.add((a.id, lora.name))
                    log.warning("assignment %s: LoRA adapter name %r refused (%s); skipped", a.id, lora.name, problem)
        pins = {(aid, name): lora.artifact.sha256 for aid, names in given.items() for name, lora in names.items()}
        for key, sha256 in self._pins.items():
            if pins.get(key) != sha256:
                self._artifacts.unpin(sha256)
                self._unpinned = True
        for key, sha256 in pins.items():
            if self._pins.get(key) != sha256:
                self._artifacts.pin(sha256)
        self._pins = pins
        self._given = given
        self._known = True
        self.wake()

    def wake(self) -> None:
        """Something changed (the desired set, a worker gone): reconcile the directories."""
        self._changed.set()
        self._changed = trio.Event()

    def directory(self, assignment_id: str) -> Path:
        """The assignment's adapter directory on the node; ContractError when the node keeps none."""
        if self.root is None:
            raise ContractError("runtime.live_loras: this node has no directory for LoRA adapters loaded at run time")
        return self.root / directory_name(assignment_id)

    async def open_directory(self, assignment_id: str) -> Path:
        """The assignment's adapter directory, made (maybe empty) if it is not there yet."""
        path = self.directory(assignment_id)
        async with self._lock:
            await trio.to_thread.run_sync(lambda: path.mkdir(parents=True, exist_ok=True))
        return path

    def view(self, assignment_id: str) -> dict[str, LiveLora]:
        """The adapters given to that assignment now, by name, each with where it lies once it does."""
        ready = self._ready.get(assignment_id, {})
        out = {}
        for name, lora in self._given.get(assignment_id, {}).items():
            held = ready.get(name)
            path = held[1] if held is not None and held[0].artifact.sha256 == lora.artifact.sha256 else None
            out[name] = LiveLora(lora=lora, path=path)
        return out

    def statistics(self) -> LiveLoraStatistics:
        views = [self.view(aid) for aid in self._given]
        return LiveLoraStatistics(
            given=sum(len(v) for v in views),
            ready=sum(1 for v in views for live in v.values() if live.path is not None),
            placed=self._placed,
            removed=self._removed,
            refused=len(self._refused),
        )

    async def run(self) -> NoReturn:
        """Fetch and place what is given, remove what is not, until cancelled."""
        async with trio.open_nursery() as nursery:
            while True:
                changed = self._changed
                if self._known and self.root is not None:
                    await self._reconcile(nursery, self.root)
                await changed.wait()
        raise AssertionError("unreachable")  # pragma: no cover

    # --- internals

    async def _reconcile(self, nursery: trio.Nursery, root: Path) -> None:
        for aid, names in self._given.items():
            for name, lora in names.items():
                key = (aid, name, lora.artifact.sha256)
                if self.view(aid)[name].path is None and key not in self._fetching:
                    self._fetching.add(key)
                    nursery.start_soon(self._fetch, aid, lora)
        async with self._lock:
            keep = {directory_name(aid): set(names) for aid, names in self._given.items()}
            for aid in self._in_use():
                keep.setdefault(directory_name(aid), set())
            removed = await trio.to_thread.run_sync(_sweep, root, keep)
        self._removed += len(removed)
        for path in removed:
            log.info("LoRA adapter entry %s removed: no longer given", path)
        for aid in list(self._ready):
            kept = keep.get(directory_name(aid), set())
            ready = {name: held for name, held in self._ready[aid].items() if name in kept}
            if ready:
                self._ready[aid] = ready
            else:
                del self._ready[aid]
        if self._unpinned:
            self._unpinned = False
            with trio.move_on_after(EVICT_TIMEOUT_S):
                try:
                    await self._artifacts.evict()
                except ArtifactError as exc:
                    log.warning("artifact cache eviction failed: %s", exc)

    async def _place(self, aid: str, lora: LoraSpec) -> Path | None:
        """Fetch the adapter and link it into the directory; where, or None when no longer given."""
        source = await self._artifacts.fetch(lora.artifact)
        async with self._lock:
            if not self._wants(aid, lora):
                return None
            target = self.directory(aid) / lora.name
            await trio.to_thread.run_sync(_link_in, source, lora.artifact, target)
            self._ready.setdefault(aid, {})[lora.name] = (lora, target)
        return target

    def _wants(self, aid: str, lora: LoraSpec) -> bool:
        return self._given.get(aid, {}).get(lora.name) == lora

    async def _fetch(self, aid: str, lora: LoraSpec) -> None:
        """Fetch one adapter (retried with backoff while it is given) and place it in the directory."""
        delay = FETCH_RETRY_INITIAL_S
        try:
            while self._wants(aid, lora):
                try:
                    placed = await self._place(aid, lora)
                except (ArtifactError, OSError) as exc:
                    log.warning(
                        "assignment %s: LoRA adapter %s not ready: %s; retrying in %g s", aid, lora.name, exc, delay
                    )
                else:
                    if placed is not None:
                        self._placed += 1
                        log.info("assignment %s: LoRA adapter %s ready at %s", aid, lora.name, placed)
                    return
                await trio.sleep(delay)
                delay = min(delay * 2, FETCH_RETRY_MAX_S)
        finally:
            self._fetching.discard((aid, lora.name, lora.artifact.sha256))


def _link_in(source: Path, ref: ArtifactRef, target: Path) -> None:
    """Link the fetched artifact at `target`: a manifest's files below a directory, one object as a
    file. Built beside it under a partial name and renamed into place (replacing what was there)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f"{PARTIAL_PREFIX}{secrets.token_hex(8)}"
    try:
        if ref.files:
            partial.mkdir()
            for f in ref.files:
                (partial / f.path).parent.mkdir(parents=True, exist_ok=True)
                _link(source / f.path, partial / f.path)
        else:
            _link(source, partial)
        _remove(target)
        partial.rename(target)
    except BaseException:
        _remove(partial)
        raise


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        shutil.copyfile(source, target)


def _remove(path: Path) -> bool:
    """Remove a file or a directory tree (never following a link out of it); whether there was one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
        return True
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _sweep(root: Path, keep: Mapping[str, Set[str]]) -> list[Path]:
    """Remove every directory under `root` not in `keep`, and every entry of a kept one not named
    there (partial entries included); the paths removed."""
    if not root.is_dir():
        return []
    removed = []
    for directory in root.iterdir():
        names = keep.get(directory.name)
        if names is None or not directory.is_dir() or directory.is_symlink():
            if _remove(directory):
                removed.append(directory)
            continue
        for entry in directory.iterdir():
            if entry.name not in names and _remove(entry):
                removed.append(entry)
    return removed
