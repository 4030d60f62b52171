"""What the supervisor (`node.supervisor`) keeps of each replica: the desired assignment, its worker's
record (container, backoff, state it reports), the replica as others see it, and the supervisor's
statistics; the parts it needs from the artifact and runtime caches; the failures a start can meet
that are not the engine's own. Pure data; the supervisor's task drives them."""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Protocol

import attrs
import trio

from nexa.adapters import entrypoints
from nexa.contracts import wire
from nexa.contracts.runtime import ArtifactRef, ContainerState, HealthProbe, RuntimeSpec


class Artifacts(Protocol):
    """The node's verified artifact cache (`nexa.node.artifacts.ArtifactCache`): `fetch` gives a
    verified file, or a manifest's assembled model directory, mounted read-only at the ref's
    `mount_path`; pins are per artifact digest (`ArtifactRef.sha256`, a manifest's digest)."""

    async def fetch(self, ref: ArtifactRef) -> Path: ...
    def pin(self, sha256: str) -> None: ...
    def unpin(self, sha256: str) -> None: ...
    async def evict(self) -> int: ...


class RuntimeCaches(Protocol):
    """Each replica's writable cache (`nexa.node.runtime_cache.RuntimeCaches`): a directory per
    (image, model, settings), held by each worker from before its container is created until it is
    torn down."""

    def wants(self, runtime: RuntimeSpec) -> bool: ...
    async def acquire(self, holder: str, runtime: RuntimeSpec) -> Path: ...
    def release(self, holder: str) -> None: ...


@attrs.frozen(kw_only=True)
class Backoff:
    """Capped exponential delay as an immutable value: `next()` returns the following step."""

    initial_s: float
    max_s: float
    attempt: int = 0

    @property
    def delay_s(self) -> float:
        return min(self.initial_s * 2.0**self.attempt, self.max_s)

    def next(self) -> Backoff:
        if self.delay_s >= self.max_s:
            return self  # capped: stop counting, so the exponent never overflows
        return attrs.evolve(self, attempt=self.attempt + 1)


@attrs.frozen(kw_only=True)
class Replica:
    """One assignment's runtime as the supervisor last saw it (`Supervisor.replicas`)."""

    assignment_id: str
    state: wire.RuntimeState
    #: Its container's main process on the host, while it runs.
    pid: int | None
    #: When its container started (Unix seconds); 0 before it has.
    started_at: float
    #: Stopped and kept stopped by the node (`stop_held`).
    held: bool


@attrs.frozen(kw_only=True)
class SupervisorStatistics:
    """A snapshot of the supervisor (trio's `statistics()` convention)."""

    generation: int
    #: Assignments currently desired.
    assignments: int
    #: Desired assignments by observed state; every state is present.
    states: Mapping[wire.RuntimeState, int]
    #: Removed or replaced assignments whose containers are still being stopped.
    stopping: int
    created: int
    adopted: int
    restarts: int
    pulls: int
    probes_failed: int
    #: Containers stopped and removed because their assignment was removed or replaced.
    removed: int
    orphans_removed: int
    reconcile_passes: int


class Mismatch(Exception):
    """Inspect shows a container that is not exactly the assigned one."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class ProgramMissing(Exception):
    """The runtime's program is not where its command names it in the image: the OCI runtime could not
    exec it (podman/docker start fails, exit code 127), or the image's exec wrapper could not."""

    def __init__(self, program: str, detail: str) -> None:
        super().__init__(detail)
        self.program = program
        self.detail = detail


def program_missing(runtime: RuntimeSpec, what: str) -> ProgramMissing:
    """The runtime's program is not in its image (`what`: how that showed)."""
    program = entrypoints.program_of(runtime.entrypoint, runtime.command)
    return ProgramMissing(
        program,
        f"the runtime's program {program} is not in the image {runtime.image} ({what}); register an image "
        "that has it where the adapter runs it (on PATH, or at the path the image's entrypoint names)",
    )


def adopted_start_deadline(state: ContainerState, probe: HealthProbe) -> float:
    """When failing probes of an adopted container start to count (trio clock): what is left of the
    start period, from the container's own (wall-clock) start time."""
    if state.started_at is None:
        return trio.current_time()
    left = state.started_at + probe.start_period_s - time.time()
    return trio.current_time() + max(0.0, left)


#: The exit code for "command not found": the OCI runtimes' (crun, runc) when exec finds no such
#: program, and a shell's (an exec wrapper's) when `exec "$@"` cannot.
EXIT_PROGRAM_MISSING: Final = 127
#: How the container engines word a start whose program could not be found (crun, runc, Docker).
PROGRAM_NOT_FOUND: Final = re.compile(
    r"executable file .{0,300}not found|command that was not found|exec: .{0,300}no such file or directory", re.I
)


@attrs.frozen
class Desired:
    assignment: wire.Assignment
    generation: int
    spec_sha256: str


@attrs.define(eq=False)
class Worker:
    """One assignment's task: what it knows of its container and what it reports."""

    desired: Desired
    #: The worker this one replaces: its container must be gone before ours is created.
    previous: Worker | None
    #: Delay between attempts after failed steps (pull, fetch, create, …); reset when Ready.
    setup_backoff: Backoff
    #: The restart delay reached by crashes that follow each other within the crash-loop window.
    crash_backoff: Backoff
    scope: trio.CancelScope | None = None
    done: trio.Event = attrs.field(factory=trio.Event)
    #: Set before the scope is cancelled when the assignment was removed or replaced: tear down.
    removing: bool = False
    container_id: str | None = None
    #: When failing probes start to count (trio clock), for the container in `container_id`.
    start_deadline: float = 0.0
    image_ready: bool = False
    artifact_path: Path | None = None
    pinned: str | None = None
    #: The replica's cache directory and this worker's hold on it (`RuntimeCaches`).
    cache_dir: Path | None = None
    cache_hold: str | None = None
    state: wire.RuntimeState = wire.RuntimeState.PENDING
    reason: str | None = None
    detail: str = ""
    restarts: int = 0
    crash_loop: bool = False
    #: Crash times (trio clock) within the crash-loop window.
    crashes: collections.deque[float] = attrs.field(factory=collections.deque)
    #: The last problem logged, so a retried failure is logged once, not once per attempt.
    logged_problem: tuple[wire.RuntimeState, str | None] | None = None
    #: Its container's main process (host pid) at the last inspect, while it runs.
    pid: int | None = None
    #: When its container was started (Unix seconds; an adopted one: as the engine says).
    started_at: float = 0.0
    #: Why the node stopped it and keeps it stopped (the memory guard), None otherwise.
    held: str | None = None
    #: The fetched artifact of each of its LoRA adapters (`RuntimeSpec.loras`, in order), once
    #: fetched, and the sha256 of each it pins in the artifact cache.
    lora_paths: list[Path] | None = None
    lora_pins: list[str] = attrs.Factory(list)
    #: Its runtime's own sleep (`sleeper`): it said it sleeps; its last sleep failed (not tried
    #: again until woken); wakes failed in a row; what went wrong last.
    asleep: bool = False
    sleep_refused: bool = False
    wake_failures: int = 0
    sleep_problem: str | None = None

    @property
    def id(self) -> str:
        return self.desired.assignment.id

    @property
    def runtime(self) -> RuntimeSpec:
        return self.desired.assignment.runtime

    def status(self) -> wire.AssignmentStatus:
        reason, detail = self.reason, self.detail
        if self.state is wire.RuntimeState.READY and self.sleep_problem is not None:
            reason, detail = (wire.SLEEP_FAILED if self.sleep_refused else None), self.sleep_problem
        return wire.AssignmentStatus(
            assignment_id=self.id,
            state=self.state,
            detail=detail,
            reason=reason,
            restarts=self.restarts,
            asleep=self.asleep and self.state is wire.RuntimeState.READY,
        )
