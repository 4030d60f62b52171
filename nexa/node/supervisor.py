"""Runtime supervision: desired assignments against the node's nexa-labelled podman containers.

One task, in its own cancel scope, per assignment drives Pending → Pulling → Fetching → Starting →
Ready/Unhealthy, probes health itself, and restarts crashed runtimes with capped exponential
backoff; a reconcile loop starts what is missing, replaces what changed and removes orphans.
Expected failures become `Failed(reason)` states; programming errors propagate. Cancelling the
supervisor (the agent stopping) leaves containers running for the next agent to adopt.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn

import trio

from nexa import container_spec
from nexa.config import SupervisorConfig
from nexa.contracts import wire
from nexa.contracts.groups import FabricAccess
from nexa.contracts.runtime import (
    LABEL_ASSIGNMENT,
    LABEL_SPEC,
    ContainerDriver,
    ContainerState,
    HealthProbe,
)
from nexa.errors import (
    ArtifactDigestMismatch,
    ArtifactError,
    ArtifactUnavailable,
    ContainerNotFound,
    ContractError,
    EngineError,
    EngineUnavailable,
    ImageNotFound,
    InsufficientDisk,
    RuntimeCacheNoRoom,
    SimulationDisabled,
)
from nexa.node.firewall import FabricFirewall, FirewallError, in_host_network
from nexa.node.liveloras import LiveLoras
from nexa.node.lora import LoraView
from nexa.node.rdma import rdma_device_nodes
from nexa.node.replicas import (
    EXIT_PROGRAM_MISSING,
    PROGRAM_NOT_FOUND,
    Artifacts,
    Backoff,
    Desired,
    Mismatch,
    ProgramMissing,
    Replica,
    RuntimeCaches,
    SupervisorStatistics,
    Worker,
    adopted_start_deadline,
    program_missing,
)
from nexa.node.sleeper import SleepKeeper
from nexa.supervision import supervised

log = logging.getLogger(__name__)

State = wire.RuntimeState

#: Beyond a runtime's own stop timeout (after which podman kills it), time left for the stop call
#: to return and for the remove; the whole removal is bounded by the sum.
TEARDOWN_GRACE_S: Final = 10.0
#: Stop timeout for orphans: their spec is unknown, so RuntimeSpec's default.
ORPHAN_STOP_TIMEOUT_S: Final = 30.0
#: Bound on one artifact-cache eviction after an assignment is removed.
EVICT_TIMEOUT_S: Final = 60.0
#: Longest pause between two inspects of a container that is between states (e.g. `stopping`).
SETTLE_POLL_S: Final = 0.5

# Failures that another attempt soon will not fix (the registry or the store must change first):
# retried at the maximum backoff rather than from the initial delay.
_SLOW_FAILURES: Final = (ImageNotFound, ArtifactDigestMismatch, InsufficientDisk, RuntimeCacheNoRoom)
# Failures foreseen by the container engine (`node.engines`) and the artifact cache; other
# EngineError/ArtifactError instances are still handled, but logged with their traceback.
_KNOWN_FAILURES: Final = (
    *_SLOW_FAILURES,
    EngineUnavailable,
    ContainerNotFound,
    ArtifactUnavailable,
    SimulationDisabled,
)


class Supervisor:
    """Keeps the node's runtime containers equal to its verified assignments, and reports their states.

    The agent calls `update()` with every accepted assignment set (the first call, with the set
    accepted before a restart, must come before orphans can be told apart: until then nothing is
    removed), reads `statuses()` for its heartbeats, and runs `run()` in its nursery.
    """

    def __init__(
        self,
        cfg: SupervisorConfig,
        podman: ContainerDriver,
        artifacts: Artifacts,
        *,
        node_id: str,
        runtime_host: str = "127.0.0.1",
        caches: RuntimeCaches | None = None,
        on_start: Callable[[str], None] | None = None,
        live_loras_dir: Path | None = None,
        firewall: FabricFirewall | None = None,
    ) -> None:
        self._cfg = cfg
        self._firewall = firewall  # None: closing a group's ports is the host firewall's job
        self._caches = caches
        self._holds = itertools.count(1)
        #: Told each assignment id just before its container starts (the memory meter's baseline).
        self._on_start = on_start
        self._runtime_host = runtime_host
        self._podman = podman
        self._artifacts = artifacts
        self._node_id = node_id
        self._generation = 0
        self._desired: dict[str, Desired] = {}
        self._desired_known = False
        self._changed = trio.Event()
        self._workers: dict[str, Worker] = {}
        #: Removed or replaced workers still tearing down.
        self._retiring: set[Worker] = set()
        #: The newest retiring worker of each assignment id (each one waits for its predecessor).
        self._last_retired: dict[str, Worker] = {}
        self._orphans_removing: set[str] = set()
        self._pins: collections.Counter[str] = collections.Counter()
        self._list_failed = False
        self._created = self._adopted = self._restarts = self._pulls = self._probes_failed = 0
        self._removed = self._orphans_removed = self._passes = 0
        #: Each assignment's `asleep` (not in its spec: changing it keeps the container).
        self._asleep: dict[str, bool] = {}
        self._sleeper = SleepKeeper(runtime_host, self._restart_awake)
        #: The adapters loaded at run time, in each assignment's directory under `live_loras_dir`.
        self.live_loras = LiveLoras(live_loras_dir, artifacts, in_use=lambda: {*self._workers, *self._last_retired})

    # --- what the agent calls

    def update(self, generation: int, assignments: Sequence[wire.Assignment]) -> None:
        """Replace the desired set (a newly accepted assignment set) and wake the reconcile loop."""
        self._generation = generation
        previous = self._desired
        desired: dict[str, Desired] = {}
        for a in assignments:
            sha = container_spec.spec_sha256(a.runtime)
            old = previous.get(a.id)
            # An unchanged assignment keeps the generation its container was created at.
            desired[a.id] = old if old is not None and old.spec_sha256 == sha else Desired(a, generation, sha)
        self._desired = desired
        self._asleep = {a.id: a.asleep for a in assignments}
        self.live_loras.update(assignments)
        self._desired_known = True
        self._changed.set()
        self._changed = trio.Event()

    def statuses(self) -> list[wire.AssignmentStatus]:
        """One status per desired assignment (in the assigned order), then `Stopped` for removed
        assignments whose containers are still being stopped."""
        out: list[wire.AssignmentStatus] = []
        for aid, d in self._desired.items():
            w = self._workers.get(aid)
            if w is not None and w.desired is d:
                out.append(w.status())
            else:
                # Not started yet, or its replacement not started yet.
                out.append(wire.AssignmentStatus(assignment_id=aid, state=State.PENDING))
        # Removed: its worker is about to be retired, or still tearing down (a chain of replaced
        # workers may share one id).
        gone = {w.id: w for w in [*self._retiring, *self._workers.values()] if w.id not in self._desired}
        out.extend(
            wire.AssignmentStatus(assignment_id=aid, state=State.STOPPED, detail="stopping", restarts=w.restarts)
            for aid, w in gone.items()
        )
        return out

    def endpoint(self, assignment_id: str) -> int | None:
        """The loopback port of that assignment's runtime while it is Ready; None otherwise, and
        always for a group's rank other than the head: it serves no API (its port is a worker's,
        which a request or a metrics scrape must never reach)."""
        w = self._workers.get(assignment_id)
        if w is None or w.removing or w.state is not State.READY or w.desired is not self._desired.get(assignment_id):
            return None
        group = w.runtime.group
        return w.runtime.port if group is None or group.is_head else None

    def lora_view(self, assignment_id: str) -> LoraView | None:
        """What the relay needs to name that Ready assignment's LoRA adapters to its runtime
        (`nexa.node.lora`): its spec, where the node holds each adapter, when it started."""
        if self.endpoint(assignment_id) is None:
            return None
        w = self._workers[assignment_id]
        live = self.live_loras.view(assignment_id) if w.runtime.live_loras else {}
        return LoraView(runtime=w.runtime, paths=list(w.lora_paths or ()), started_at=w.started_at, live=live)

    def replicas(self) -> list[Replica]:
        """The desired assignments' containers as last inspected (the memory meter's view)."""
        return [
            Replica(assignment_id=w.id, state=w.state, pid=w.pid, started_at=w.started_at, held=w.held is not None)
            for aid, w in self._workers.items()
            if not w.removing and w.desired is self._desired.get(aid)
        ]

    async def stop_held(self, assignment_id: str, reason: str, detail: str) -> bool:
        """Stop that assignment's runtime and keep it stopped, `Failed(reason)` with `detail`, until
        the assignment is replaced or removed (the memory guard). False when there is none to stop."""
        w = self._workers.get(assignment_id)
        if w is None or w.removing or w.held is not None or w.container_id is None:
            return False
        self._set(w, State.FAILED, reason=reason, detail=detail)
        w.held = reason
        with contextlib.suppress(ContainerNotFound):
            await self._podman.stop(w.container_id, timeout_s=w.runtime.stop_timeout_s)
        return True

    def statistics(self) -> SupervisorStatistics:
        counts = collections.Counter(s.state for s in self.statuses() if s.assignment_id in self._desired)
        return SupervisorStatistics(
            generation=self._generation,
            assignments=len(self._desired),
            states=types.MappingProxyType({state: counts[state] for state in State}),
            stopping=len(self._retiring),
            created=self._created,
            adopted=self._adopted,
            restarts=self._restarts,
            pulls=self._pulls,
            probes_failed=self._probes_failed,
            removed=self._removed,
            orphans_removed=self._orphans_removed,
            reconcile_passes=self._passes,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Reconcile until cancelled. The first pass lists this node's containers (to adopt what
        still matches) and starts one task per assignment before `started()`."""
        # A restart (nexa.supervision) starts every worker again; running containers are adopted.
        self._workers.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                supervised, "supervisor.sleep", self._sleeper.run, self._sleep_wanted, self._changed_event
            )
            nursery.start_soon(supervised, "supervisor.live_loras", self.live_loras.run)
            started = False
            while True:
                # Taken before the pass: an update() during the pass makes the wait return at once.
                changed = self._changed
                await self._reconcile(nursery)
                if not started:
                    task_status.started()
                    started = True
                with trio.move_on_after(self._cfg.reconcile_interval_s):
                    await changed.wait()
        raise AssertionError("unreachable")  # pragma: no cover

    def _sleep_wanted(self) -> list[tuple[Worker, bool]]:
        return [
            (w, self._asleep.get(aid, False)) for aid, w in self._workers.items() if w.desired is self._desired.get(aid)
        ]

    def _changed_event(self) -> trio.Event:
        return self._changed

    async def _restart_awake(self, w: Worker) -> None:
        """Stop the container of a runtime that does not wake (`sleeper`): it restarts, awake."""
        if w.container_id is not None:
            with contextlib.suppress(EngineError):
                await self._podman.stop(w.container_id, timeout_s=w.runtime.stop_timeout_s)

    # --- reconciliation

    async def _reconcile(self, nursery: trio.Nursery) -> None:
        self._passes += 1
        desired = self._desired
        fresh: list[Worker] = []
        for aid, d in desired.items():
            current = self._workers.get(aid)
            if current is not None and current.desired.spec_sha256 == d.spec_sha256:
                if current.desired is not d:
                    current.desired = d  # same spec: nothing to do for the container
                continue
            if current is not None:
                log.info("assignment %s changed; replacing its runtime", aid)
                self._retire(current)
            # Its container must be gone before ours is created (same name, same port): wait for
            # the last worker of this id still tearing down, if any.
            previous = self._last_retired.get(aid)
            worker = Worker(desired=d, previous=previous, setup_backoff=self._backoff(), crash_backoff=self._backoff())
            self._workers[aid] = worker
            # Every artifact the desired set uses is pinned before any worker starts: a fetch by
            # one worker (which may evict) can never take what another, adopting a runtime
            # that is still running after an agent restart, has not fetched yet.
            if d.assignment.runtime.artifact is not None:
                self._pin(worker, d.assignment.runtime.artifact.sha256)
            self._pin_loras(worker)
            fresh.append(worker)
        if self._firewall is not None:  # every new member's port in one write, before any of them runs
            with contextlib.suppress(FirewallError):  # (each one's bring-up writes again, and reports)
                await self._firewall.close(*[(w, m) for w in fresh if (m := in_host_network(w.runtime))])
        for worker in fresh:
            worker.scope = await nursery.start(self._supervise, worker)
        for aid in [aid for aid in self._workers if aid not in desired]:
            log.info("assignment %s removed; stopping its runtime", aid)
            self._retire(self._workers.pop(aid))
        await self._remove_orphans(nursery)

    def _retire(self, worker: Worker) -> None:
        self._set(worker, State.STOPPED, detail="stopping")
        worker.removing = True
        self._retiring.add(worker)
        self._last_retired[worker.id] = worker
        assert worker.scope is not None
        worker.scope.cancel()

    async def _remove_orphans(self, nursery: trio.Nursery) -> None:
        if not self._desired_known:
            return  # before the first update(), every container would look like an orphan
        try:
            actual = await self._podman.list({container_spec.LABEL_NODE: self._node_id})
        except EngineError as exc:
            if not self._list_failed:
                log.warning(
                    "cannot list this node's containers: %s", exc, exc_info=not isinstance(exc, _KNOWN_FAILURES)
                )
            self._list_failed = True
            return
        self._list_failed = False
        live = set(self._desired) | set(self._workers) | {w.id for w in self._retiring}
        for state in actual:
            if state.labels.get(LABEL_ASSIGNMENT) in live or state.id in self._orphans_removing:
                continue
            self._orphans_removing.add(state.id)
            nursery.start_soon(self._remove_orphan, state)

    async def _remove_orphan(self, state: ContainerState) -> None:
        try:
            log.info(
                "removing container %s: no live assignment (was %s)", state.name, state.labels.get(LABEL_ASSIGNMENT)
            )
            await self._stop_and_remove(state.id, ORPHAN_STOP_TIMEOUT_S, running=state.running)
            self._orphans_removed += 1
        except EngineError as exc:
            log.warning("could not remove orphan container %s: %s", state.name, exc)
        finally:
            self._orphans_removing.discard(state.id)

    async def _stop_and_remove(self, container_id: str, timeout_s: float, *, running: bool = True) -> None:
        try:
            if running:
                await self._podman.stop(container_id, timeout_s=timeout_s)
            # Forced only in case something restarted it since: the graceful stop has happened.
            await self._podman.remove(container_id, force=True)
        except ContainerNotFound:
            pass

    # --- one assignment

    async def _supervise(self, worker: Worker, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        try:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                await supervised("supervisor.runtime", self._lifecycle, worker)
        finally:
            try:
                if worker.removing:
                    await self._teardown(worker)
            finally:
                if self._firewall is not None and worker.container_id is None:
                    with trio.CancelScope(shield=True):  # its container is gone: its port may open
                        await self._firewall.release(worker)
                if self._caches is not None and worker.cache_hold is not None:
                    # Held until the container is gone (or the supervisor stops): then evictable.
                    self._caches.release(worker.cache_hold)
                    worker.cache_hold = None
                self._retiring.discard(worker)
                if self._last_retired.get(worker.id) is worker:
                    del self._last_retired[worker.id]
                worker.done.set()
                self.live_loras.wake()  # its adapter directory may go now

    async def _lifecycle(self, w: Worker) -> NoReturn:
        try:
            container_spec.check_env(w.runtime.env)
        except ContractError as exc:
            # The spec is signed and cannot change without a replacement: never retried.
            self._set(w, State.FAILED, reason="secret_in_env", detail=exc.message)
            await trio.sleep_forever()
        while True:
            try:
                container_id, start_deadline = await self._bring_up(w)
                exited = await self._watch(w, container_id, start_deadline)
                if w.held is not None:
                    w.pid = None
                    await trio.sleep_forever()  # stopped on purpose: until replaced or removed
            except Mismatch as exc:
                await self._discard_container(w)
                self._set(w, State.FAILED, reason=exc.reason, detail=f"{exc.detail}; container removed")
                await trio.sleep(self._cfg.restart_backoff_max_s)
            except ProgramMissing as exc:
                # The image is pinned and the spec signed: starting it again would fail the same way.
                self._set(w, State.FAILED, reason="runtime_program_missing", detail=exc.detail)
                await trio.sleep_forever()
            except (ContractError, FirewallError) as exc:
                # This node cannot give what the signed spec asks (a group's RDMA devices it lacks, its port
                # closed but on the fabric): asked again after the longest backoff (a driver loaded, nft).
                why = "fabric_firewall" if isinstance(exc, FirewallError) else "spec_refused"
                self._set(w, State.FAILED, reason=why, detail=exc.message)
                await trio.sleep(self._cfg.restart_backoff_max_s)
            except (EngineError, ArtifactError) as exc:
                await trio.sleep(self._on_failure(w, exc))
            else:
                if exited is not None and exited.exit_code == EXIT_PROGRAM_MISSING and w.state is State.STARTING:
                    # 127 before it was ever Ready: the program (behind an exec wrapper) was not found, or
                    # the dynamic loader found no shared library it needs (ld.so exits 127 too: a server
                    # whose RUNPATH does not reach its libraries in the image).
                    missing = program_missing(
                        w.runtime,
                        f"exited with code {EXIT_PROGRAM_MISSING}: command not found, or a shared library it needs "
                        "is missing (see the container's log)",
                    )
                    self._set(w, State.FAILED, reason="runtime_program_missing", detail=missing.detail)
                    await trio.sleep_forever()
                await trio.sleep(self._on_exit(w, exited))
                w.restarts += 1
                self._restarts += 1

    def _on_failure(self, w: Worker, exc: EngineError | ArtifactError) -> float:
        """Report a failed step; the delay before trying again."""
        if isinstance(exc, ImageNotFound):
            w.image_ready = False
        if isinstance(exc, ContainerNotFound):
            w.container_id = None
        if isinstance(exc, _SLOW_FAILURES):
            delay: float = self._cfg.restart_backoff_max_s
        else:
            delay, w.setup_backoff = w.setup_backoff.delay_s, w.setup_backoff.next()
        self._set(w, State.FAILED, reason=exc.code, detail=f"{exc.message}; retrying in {delay:g} s", exc=exc)
        return delay

    def _on_exit(self, w: Worker, exited: ContainerState | None) -> float:
        """Count a crash (the runtime exited, or its container vanished); the delay before restarting."""
        cfg = self._cfg
        now = trio.current_time()
        crashes = w.crashes
        while crashes and crashes[0] <= now - cfg.crash_loop_window_s:
            crashes.popleft()
        # The backoff grows while crashes follow each other within the window, and starts over after.
        w.crash_backoff = w.crash_backoff.next() if crashes else self._backoff()
        crashes.append(now)
        w.crash_loop = len(crashes) >= cfg.crash_loop_restarts
        delay: float = cfg.restart_backoff_max_s if w.crash_loop else w.crash_backoff.delay_s
        if exited is None:
            w.container_id = None
            what = "its container disappeared"
        else:
            what = f"exited with code {exited.exit_code}"
        if w.crash_loop:
            detail = f"{len(crashes)} crashes in {cfg.crash_loop_window_s:g} s; {what}; restarting in {delay:g} s"
            self._set(w, State.FAILED, reason="crash_loop", detail=detail)
        else:
            log.info("assignment %s: the runtime %s; restarting in %g s", w.id, what, delay)
            self._set(w, State.STARTING, detail=f"{what}; restarting in {delay:g} s")
        return delay

    def _backoff(self) -> Backoff:
        return Backoff(initial_s=self._cfg.restart_backoff_initial_s, max_s=self._cfg.restart_backoff_max_s)

    async def _bring_up(self, w: Worker) -> tuple[str, float]:
        """Pull, fetch, then adopt or create and start the container; its id and the start-period end."""
        runtime = w.runtime
        if not w.image_ready:
            # A simulated runtime is a local process: it has no image to pull.
            if not container_spec.is_simulated(runtime) and not await self._podman.image_exists(runtime.image):
                self._set(w, State.PULLING)
                await self._podman.pull(runtime.image)
                self._pulls += 1
            w.image_ready = True
        if runtime.artifact is not None and w.artifact_path is None:
            self._set(w, State.FETCHING)
            # Pinned since the worker was made (`_reconcile`), until it is gone.
            w.artifact_path = await self._artifacts.fetch(runtime.artifact)
        if runtime.loras and w.lora_paths is None:
            self._set(w, State.FETCHING)
            w.lora_paths = [await self._artifacts.fetch(lora.artifact) for lora in runtime.loras]
        if self._caches is not None and w.cache_hold is None and self._caches.wants(runtime):
            hold = f"{w.id}#{next(self._holds)}"
            w.cache_dir = await self._caches.acquire(hold, runtime)
            w.cache_hold = hold
        if w.previous is not None:
            self._set_starting(w, "waiting for the replaced runtime to stop")
            await w.previous.done.wait()
            w.previous = None
        self._set_starting(w, "")
        if self._firewall is not None and (member := in_host_network(runtime)) is not None:
            await self._firewall.close((w, member))  # before it runs (FirewallError: it does not)
        return await self._adopt_or_start(w)

    async def _adopt_or_start(self, w: Worker) -> tuple[str, float]:
        """Adopt the assignment's container or create one, and start it unless it runs (or is paused).

        Only a created or exited container is started; one between states is waited out first.
        """
        runtime = w.runtime
        state: ContainerState | None = None
        if w.container_id is not None:
            # Ours already (a restart after a crash, or a retry after podman failed us).
            try:
                state = await self._settled(w, w.container_id)
            except ContainerNotFound:
                w.container_id = None
        if w.container_id is None:
            found = await self._find_container(w)
            if found is not None and found.between_states:
                found = await self._settled(w, found.id)
            if found is not None and (found.running or found.paused):
                w.container_id = found.id
                w.start_deadline = adopted_start_deadline(found, runtime.health)
                self._adopted += 1
                w.started_at = found.started_at or time.time()
                log.info("adopted running container %s for assignment %s", found.name, w.id)
                return found.id, w.start_deadline
            if found is not None:
                w.container_id, state = found.id, found
            else:
                d = w.desired
                group = d.assignment.runtime.group
                spec = container_spec.container_spec(
                    self._node_id,
                    d.assignment,
                    d.generation,
                    w.artifact_path,
                    host=self._runtime_host,
                    cache_dir=w.cache_dir,
                    rdma_devices=rdma_device_nodes() if group is not None and group.fabric is FabricAccess.RDMA else (),
                    lora_paths=w.lora_paths or (),
                    live_lora_dir=await self.live_loras.open_directory(w.id) if runtime.live_loras else None,
                )
                w.container_id = await self._podman.create(spec)
                self._created += 1
                return await self._start(w, w.container_id)
        assert state is not None  # set on every path that reaches here
        if state.running or state.paused:
            return w.container_id, w.start_deadline
        if not state.startable:
            # podman would refuse with 500 "container state improper"; a later attempt inspects again.
            raise EngineError(f"container {w.container_id[:12]} is {state.status or 'in an unknown state'}")
        return await self._start(w, w.container_id)

    async def _start(self, w: Worker, container_id: str) -> tuple[str, float]:
        if self._on_start is not None:
            self._on_start(w.id)
        w.started_at = time.time()
        try:
            await self._podman.start(container_id)
        except EngineError as exc:
            if isinstance(exc, EngineUnavailable | ContainerNotFound):
                raise
            state = None
            with contextlib.suppress(EngineError):
                state = await self._podman.inspect(container_id)
            if PROGRAM_NOT_FOUND.search(exc.message) or (state is not None and state.exit_code == EXIT_PROGRAM_MISSING):
                raise program_missing(
                    w.runtime, f"the container engine could not start it: {exc.message[:300]}"
                ) from exc
            raise
        w.start_deadline = trio.current_time() + w.runtime.health.start_period_s
        return container_id, w.start_deadline

    async def _settled(self, w: Worker, container_id: str) -> ContainerState:
        """Inspect until the container is no longer between states (`stopping`, `removing`, …).

        podman shows `stopping` for as long as a runtime takes to exit (up to its stop timeout, then
        SIGKILL); that is neither a crash nor a container that can be started. Bounded by the stop
        timeout plus TEARDOWN_GRACE_S; then EngineError, retried with the setup backoff.
        """
        deadline = trio.current_time() + w.runtime.stop_timeout_s + TEARDOWN_GRACE_S
        while True:
            state = await self._podman.inspect(container_id)
            if not state.between_states:
                return state
            if trio.current_time() >= deadline:
                raise EngineError(f"container {container_id[:12]} stayed {state.status or 'in an unknown state'}")
            self._set_starting(w, f"waiting for the container to finish {state.status or 'its transition'}")
            await trio.sleep(min(w.runtime.health.interval_s, SETTLE_POLL_S))

    async def _find_container(self, w: Worker) -> ContainerState | None:
        """This assignment's container with the current spec, if any; stale ones are removed."""
        labels = {container_spec.LABEL_NODE: self._node_id, LABEL_ASSIGNMENT: w.id}
        found: ContainerState | None = None
        for state in await self._podman.list(labels):
            if found is None and state.labels.get(LABEL_SPEC) == w.desired.spec_sha256:
                found = state
            else:
                # Left by an agent that stopped mid-replacement, or a spec changed while it was down.
                log.info("removing stale container %s of assignment %s", state.name, w.id)
                await self._stop_and_remove(state.id, w.runtime.stop_timeout_s, running=state.running)
                self._removed += 1
        return found

    async def _watch(self, w: Worker, container_id: str, start_deadline: float) -> ContainerState | None:
        """Inspect and probe every `interval_s` until the container stops running; return its
        last state (None if it disappeared). Raises Mismatch when it is not the assigned one."""
        probe = w.runtime.health
        failures = 0
        started = False  # the start period ends early at the first passing probe
        next_at = trio.current_time()
        while True:
            try:
                state = await self._podman.inspect(container_id)
            except ContainerNotFound:
                return None
            if state.exited or state.startable:
                return state
            self._check_identity(w, state)
            w.pid = state.pid
            if state.paused:
                # Paused from outside nexa (an operator, a checkpoint): not a crash, and not ours to undo.
                self._set(w, State.UNHEALTHY, detail="the container is paused; waiting for it to be unpaused")
                failures = 0
            elif not state.running:
                # `stopping` (a `podman stop` or a host shutdown under way) and other states in between:
                # wait it out; it ends as exited (restarted then) or vanished.
                self._set(w, State.STARTING, detail=f"the container is {state.status or 'between states'}")
                next_at = trio.current_time() + min(probe.interval_s, SETTLE_POLL_S)
                await trio.sleep_until(next_at)
                continue
            elif await self._probe(container_id, probe):
                failures, started = 0, True
                w.crash_loop = False
                w.setup_backoff = self._backoff()
                self._set(w, State.READY)
            else:
                self._probes_failed += 1
                if started or trio.current_time() >= start_deadline:
                    failures += 1
                    if failures >= probe.retries:
                        self._set(w, State.UNHEALTHY, detail=f"{failures} consecutive failed health probes")
            next_at = max(next_at + probe.interval_s, trio.current_time())
            await trio.sleep_until(next_at)

    def _check_identity(self, w: Worker, state: ContainerState) -> None:
        image = w.runtime.image
        if not container_spec.image_matches(state, image):
            raise Mismatch(
                "digest_mismatch",
                f"container runs {state.image_name} ({state.image_digest or 'digest unknown'}), "
                f"assigned {container_spec.image_digest(image)}",
            )
        if state.labels.get(LABEL_ASSIGNMENT) != w.id or state.labels.get(LABEL_SPEC) != w.desired.spec_sha256:
            raise Mismatch("label_mismatch", "container labels do not name this assignment and spec")

    async def _probe(self, container_id: str, probe: HealthProbe) -> bool:
        with trio.move_on_after(probe.timeout_s):
            try:
                return await self._podman.healthcheck(container_id)
            except EngineError as exc:
                # Counts as a failed probe; a vanished container shows at the next inspect.
                log.debug("health probe of %s failed: %s", container_id, exc)
                return False
        return False

    async def _discard_container(self, w: Worker) -> None:
        if w.container_id is None:
            return
        container_id, w.container_id = w.container_id, None
        try:
            await self._podman.remove(container_id, force=True)
        except ContainerNotFound:
            pass
        except EngineError as exc:
            log.warning("could not remove container %s of assignment %s: %s", container_id, w.id, exc)

    async def _teardown(self, w: Worker) -> None:
        """Stop gracefully, then remove, the removed (or replaced) assignment's container; release
        its artifact. Shielded and bounded: it also runs while the supervisor is cancelled."""
        stop_timeout_s = w.runtime.stop_timeout_s
        with trio.move_on_after(stop_timeout_s + TEARDOWN_GRACE_S, shield=True) as scope:
            if w.previous is not None:
                await w.previous.done.wait()
            try:
                if w.container_id is not None:
                    ids = [w.container_id]
                else:
                    labels = {container_spec.LABEL_NODE: self._node_id, LABEL_ASSIGNMENT: w.id}
                    mine = await self._podman.list(labels)
                    ids = [s.id for s in mine if s.labels.get(LABEL_SPEC) == w.desired.spec_sha256]
                for container_id in ids:
                    await self._stop_and_remove(container_id, stop_timeout_s)
                    self._removed += 1
                    log.info("assignment %s: container %s stopped and removed", w.id, container_id)
                w.container_id = None
            except EngineError as exc:
                # Left behind, it is an orphan (or a stale container) for a later pass.
                log.warning("could not stop and remove the runtime of assignment %s: %s", w.id, exc)
        if scope.cancelled_caught:
            log.warning("the runtime of assignment %s did not stop within %g s", w.id, stop_timeout_s)
        if self._unpin(w):
            with trio.move_on_after(EVICT_TIMEOUT_S, shield=True):
                try:
                    await self._artifacts.evict()
                except ArtifactError as exc:
                    log.warning("artifact cache eviction failed: %s", exc)

    # --- artifacts are pinned once per sha256, however many assignments share them

    def _pin(self, w: Worker, sha256: str) -> None:
        if self._pins[sha256] == 0:
            self._artifacts.pin(sha256)
        self._pins[sha256] += 1
        w.pinned = sha256

    def _pin_loras(self, w: Worker) -> None:
        """Pin the worker's LoRA adapters' artifacts as its model's (dropped again by `_unpin`)."""
        for lora in w.runtime.loras:
            if self._pins[lora.artifact.sha256] == 0:
                self._artifacts.pin(lora.artifact.sha256)
            self._pins[lora.artifact.sha256] += 1
            w.lora_pins.append(lora.artifact.sha256)

    def _unpin(self, w: Worker) -> bool:
        """Drop the worker's pins; True when an artifact is no longer pinned at all."""
        freed = False
        for sha256 in w.lora_pins:
            self._pins[sha256] -= 1
            if self._pins[sha256] == 0:
                del self._pins[sha256]
                self._artifacts.unpin(sha256)
                freed = True
        w.lora_pins = []
        return self._unpin_model(w) or freed

    def _unpin_model(self, w: Worker) -> bool:
        sha256, w.pinned = w.pinned, None
        if sha256 is None:
            return False
        self._pins[sha256] -= 1
        if self._pins[sha256] > 0:
            return False
        del self._pins[sha256]
        self._artifacts.unpin(sha256)
        return True

    # --- state

    def _set_starting(self, w: Worker, detail: str) -> None:
        if w.crash_loop:
            # Keep reporting the crash loop through the restart, until the runtime is Ready again.
            w.detail = "restarting" + (f": {detail}" if detail else "")
            return
        self._set(w, State.STARTING, detail=detail)

    def _set(
        self,
        w: Worker,
        state: wire.RuntimeState,
        *,
        reason: str | None = None,
        detail: str = "",
        exc: BaseException | None = None,
    ) -> None:
        """Record a state. A problem is logged once until the runtime is Ready again (retries
        pass through the progress states without repeating it); progress is logged at debug."""
        if w.removing:
            return  # Stopped until torn down, whatever a last probe still reports
        if w.held is not None and reason != w.held:
            return  # stopped on purpose: what a last probe or the stop itself shows is not news
        changed = (w.state, w.reason) != (state, reason)
        w.state, w.reason, w.detail = state, reason, detail
        if state is not State.READY:
            w.asleep = False  # a runtime (re)starting starts awake
        if state in (State.FAILED, State.UNHEALTHY):
            if w.logged_problem == (state, reason):
                return
            w.logged_problem = (state, reason)
            unexpected = exc is not None and not isinstance(exc, _KNOWN_FAILURES)
            log.warning(
                "assignment %s: %s%s: %s",
                w.id,
                state,
                f" ({reason})" if reason else "",
                detail,
                exc_info=exc if unexpected else None,
            )
        elif state in (State.READY, State.STOPPED):
            if changed:
                w.logged_problem = None
                log.info("assignment %s: %s%s", w.id, state, f": {detail}" if detail else "")
        elif changed:
            log.debug("assignment %s: %s%s", w.id, state, f": {detail}" if detail else "")
