"""The supervisor's collaborators in memory, for virtual-time tests: podman (a registry, local images,
containers) and the artifact cache, each recording every call that changes something; plus a
runtime, its assignment and a supervisor started over them."""

from __future__ import annotations

import builtins
import itertools
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from nexa import container_spec
from nexa.config import Seconds, SupervisorConfig
from nexa.contracts import wire
from nexa.contracts.runtime import ArtifactRef, ContainerDriver, ContainerSpec, ContainerState, HealthProbe, RuntimeSpec
from nexa.errors import ArtifactDigestMismatch, ContainerNotFound, EngineError, EngineUnavailable, ImageNotFound
from nexa.node.firewall import FabricFirewall
from nexa.node.replicas import Artifacts
from nexa.node.supervisor import Supervisor
from tests.conftest import sample_runtime

NODE = "n1"


# --- fakes --------------------------------------------------------------------------------------


@attrs.define(eq=False)
class FakeContainer:
    id: str
    spec: ContainerSpec
    running: bool = False
    status: str = "created"
    exit_code: int | None = None
    started_at: float | None = None


class FakePodman:
    """podman in memory: a registry, local images, containers, and a log of mutating calls."""

    def __init__(self, registry: set[str]) -> None:
        self.registry = set(registry)
        self.images: set[str] = set()
        self.containers: dict[str, FakeContainer] = {}
        self.calls: list[tuple[object, ...]] = []
        #: Virtual time of every `start`.
        self.start_times: list[float] = []
        self.healthy = True
        self.crash_on_start = False
        #: (image_name, image_digest) that inspect reports instead of the truth.
        self.reported_image: tuple[str, str] | None = None
        self.unavailable = False
        self.pull_gate: trio.Event | None = None
        self.stop_delay_s = 0.0
        self.broken_inspect: Exception | None = None
        self._ids = itertools.count(1)

    # helpers for tests

    def add(self, spec: ContainerSpec, *, running: bool = True) -> FakeContainer:
        c = FakeContainer(
            id=f"c{next(self._ids)}", spec=spec, running=running, status="running" if running else "exited"
        )
        c.started_at = time.time() - 3600 if running else None
        self.containers[c.id] = c
        return c

    def crash(self, container_id: str, code: int = 137) -> None:
        c = self.containers[container_id]
        c.running, c.status, c.exit_code = False, "exited", code

    def mutations(self, *kinds: str) -> list[tuple[object, ...]]:
        kinds = kinds or ("pull", "create", "start", "stop", "remove")
        return [c for c in self.calls if c[0] in kinds]

    def only(self) -> FakeContainer:
        (c,) = self.containers.values()
        return c

    # the protocol

    async def _enter(self) -> None:
        await trio.lowlevel.checkpoint()
        if self.unavailable:
            raise EngineUnavailable("podman socket does not answer")

    def _get(self, ref: str) -> FakeContainer:
        for c in self.containers.values():
            if ref in (c.id, c.spec.name):
                return c
        raise ContainerNotFound(f"no container {ref}")

    async def pull(self, image: str) -> None:
        await self._enter()
        if self.pull_gate is not None:
            await self.pull_gate.wait()
        self.calls.append(("pull", image))
        if image not in self.registry:
            raise ImageNotFound(f"the registry has no {image}")
        self.images.add(image)

    async def image_exists(self, image: str) -> bool:
        await self._enter()
        return image in self.images

    async def create(self, spec: ContainerSpec) -> str:
        await self._enter()
        self.calls.append(("create", spec.name))
        if spec.image not in self.images:
            raise ImageNotFound(f"{spec.image}: image not known")
        if any(c.spec.name == spec.name for c in self.containers.values()):
            raise EngineError(f"the container name {spec.name} is already in use")
        return self.add(spec, running=False).id

    async def start(self, container_id: str) -> None:
        await self._enter()
        self.calls.append(("start", container_id))
        c = self._get(container_id)
        self.start_times.append(trio.current_time())
        c.started_at = time.time()
        if self.crash_on_start:
            c.running, c.status, c.exit_code = False, "exited", 1
        else:
            c.running, c.status, c.exit_code = True, "running", None

    async def inspect(self, container_id: str) -> ContainerState:
        await self._enter()
        if self.broken_inspect is not None:
            raise self.broken_inspect
        c = self._get(container_id)
        return self._state(c)

    def _state(self, c: FakeContainer) -> ContainerState:
        name, digest = self.reported_image or (c.spec.image, container_spec.image_digest(c.spec.image))
        return ContainerState(
            id=c.id,
            name=c.spec.name,
            image_name=name,
            image_digest=digest,
            labels=dict(c.spec.labels),
            running=c.running,
            status=c.status,
            exit_code=c.exit_code,
            started_at=c.started_at,
        )

    async def healthcheck(self, container_id: str) -> bool:
        await self._enter()
        return self._get(container_id).running and self.healthy

    async def stop(self, container_id: str, *, timeout_s: float) -> None:
        await self._enter()
        self.calls.append(("stop", container_id, timeout_s))
        c = self._get(container_id)
        await trio.sleep(self.stop_delay_s)
        c.running, c.status, c.exit_code = False, "exited", 0

    async def remove(self, container_id: str, *, force: bool = False) -> None:
        await self._enter()
        self.calls.append(("remove", container_id, force))
        c = self._get(container_id)
        if c.running and not force:
            raise EngineError(f"container {container_id} is running")
        del self.containers[c.id]

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[ContainerState]:
        await self._enter()
        want = dict(labels or {})
        return [
            self._state(c) for c in self.containers.values() if all(c.spec.labels.get(k) == v for k, v in want.items())
        ]


class FakeArtifacts:
    """The artifact cache in memory: paths under a fake cache dir, and a log of calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.mismatch: set[str] = set()
        self.fetch_gate: trio.Event | None = None

    async def fetch(self, ref: ArtifactRef) -> Path:
        await trio.lowlevel.checkpoint()
        if self.fetch_gate is not None:
            await self.fetch_gate.wait()
        self.calls.append(("fetch", ref.sha256))
        if ref.sha256 in self.mismatch:
            raise ArtifactDigestMismatch(f"{ref.uri} does not match sha256 {ref.sha256[:12]}…")
        return Path("/var/cache/nexa/artifacts") / ref.sha256

    def pin(self, sha256: str) -> None:
        self.calls.append(("pin", sha256))

    def unpin(self, sha256: str) -> None:
        self.calls.append(("unpin", sha256))

    async def evict(self) -> int:
        await trio.lowlevel.checkpoint()
        self.calls.append(("evict",))
        return 0


# The fakes fit the protocols the real classes must fit (checked by mypy on this module).
_podman_fits: Callable[[FakePodman], ContainerDriver] = lambda p: p  # noqa: E731
_artifacts_fit: Callable[[FakeArtifacts], Artifacts] = lambda a: a  # noqa: E731


# --- helpers ------------------------------------------------------------------------------------

PROBE = HealthProbe(command=["true"], interval_s=2.0, timeout_s=1.0, start_period_s=10.0, retries=2)
CFG = SupervisorConfig(
    restart_backoff_initial_s=Seconds(1.0),
    restart_backoff_max_s=Seconds(60.0),
    crash_loop_restarts=5,
    crash_loop_window_s=Seconds(300.0),
    reconcile_interval_s=Seconds(5.0),
)


def runtime(**changes: Any) -> RuntimeSpec:
    return attrs.evolve(sample_runtime(), health=PROBE, **changes)


IMAGE = runtime().image
SHA = runtime().artifact.sha256  # type: ignore[union-attr]


def assignment(aid: str = "a1", **changes: Any) -> wire.Assignment:
    return wire.Assignment(id=aid, deployment="d1", runtime=runtime(**changes))


def status(sup: Supervisor, aid: str = "a1") -> wire.AssignmentStatus:
    (found,) = [s for s in sup.statuses() if s.assignment_id == aid]
    return found


async def start(
    nursery: trio.Nursery,
    podman: FakePodman,
    artifacts: FakeArtifacts,
    *assignments: wire.Assignment,
    cfg: SupervisorConfig = CFG,
    firewall: FabricFirewall | None = None,
) -> Supervisor:
    sup = Supervisor(cfg, podman, artifacts, node_id=NODE, firewall=firewall)
    sup.update(1, list(assignments))
    await nursery.start(sup.run)
    return sup


async def wait_for(sup: Supervisor, state: wire.RuntimeState, reason: str | None = None, aid: str = "a1") -> float:
    """Poll (in virtual time) until the assignment reaches `state`; the virtual time it did."""
    with trio.fail_after(1000):
        while True:
            s = status(sup, aid)
            if (s.state, s.reason) == (state, reason):
                return trio.current_time()
            await trio.sleep(0.05)


def small_spec(
    image: str, *, command: list[str], labels: dict[str, str], env: dict[str, str] | None = None, **changes: Any
) -> ContainerSpec:
    """A small container spec a test runs on a real engine: a fresh name, 64 MiB, half a CPU, 64
    pids, no devices or mounts, a probe that always passes, a 1 s stop; `changes` override fields."""
    spec = ContainerSpec(
        name=f"nexa-test-{uuid.uuid4().hex[:12]}",
        image=image,
        command=command,
        env=env or {},
        labels=labels,
        memory_bytes=64 * 1024 * 1024,
        cpus=0.5,
        pids_limit=64,
        shm_bytes=0,
        devices=[],
        ro_mounts=[],
        health=HealthProbe(command=["true"], timeout_s=5, start_period_s=0, retries=1),
        stop_timeout_s=1.0,
    )
    return attrs.evolve(spec, **changes)
