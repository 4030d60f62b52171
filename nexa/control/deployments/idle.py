"""Sleep when idle, wake on demand, and swap on demand (`Idle`, held by `Deployments.idle`).

A deployment with `idle_after_s` and `min_replicas` 0 sleeps once it has had no request for that
long and none is in flight: one audited change (`deployment.sleep`) takes its replicas out of
every node's signed set, so each node stops their containers while the verified artifact and the
runtime cache stay on the node (the artifact cache evicts only above its limit). Its record keeps
`asleep` and no replicas; the memory they held counts as free for placement from that change on.

A request for a sleeping deployment (`Gateway` calls `wait_awake`) starts its wake and waits, within
its deadline: the wake places the deployment's replicas again (a node that still holds the
artifact scores best) in one audited change (`deployment.wake`), and ends when one reports Ready.
Every request for it waits on that one wake; its wait counts in its overhead figure
(`x-nexa-overhead-ms`) and in `nexa_wake_seconds`. A request whose deadline ends first gets
`deadline_exceeded` (504) and is charged nothing; one whose deadline is shorter than the
deployment's last wake gets it at once (the wake still runs).

Swap on demand: when no node has room for the waking deployment, the least recently used idle
replica set of another deployment marked `evictable` is put to sleep (`deployment.sleep` with the
reason in the audit), then placement is tried again; never a deployment with a request in
flight, one that may not sleep (`min_replicas` null: pinned awake), one waking, or one with a
canary or a rollout. The wake's placement decision lists each swap (`PlacementDecision.swaps`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

import attrs
import trio

from nexa.adapters import native_sleep_for
from nexa.contracts.deployments import ASLEEP, AWAKE, WAKING, Deployment, DeploymentSleep, IdleSettings, idle_problems
from nexa.contracts.domain import SYSTEM, Actor
from nexa.contracts.models import ModelRecord, RuntimeRecord
from nexa.contracts.placement import PlacementDecision
from nexa.contracts.wire import SLEEP_FAILED
from nexa.control.deployments.checks import deployable, explain, runtime_of
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import Entry, all_replicas, bump, new_replicas
from nexa.control.deployments.scheduler import place
from nexa.errors import (
    Conflict,
    ContractError,
    DeadlineExceeded,
    NexaError,
    NoReadyReplica,
    NotFound,
    Unplaceable,
)
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: How often the idle keeper looks for deployments to put to sleep at most (seconds); it looks
#: sooner when a deployment's `idle_after_s` is shorter (a quarter of it).
_LOOK_S: Final = 5.0
#: The shortest pause between two looks (seconds).
_MIN_LOOK_S: Final = 0.05
#: While a wake waits for a Ready replica, how often it looks (seconds).
_READY_POLL_S: Final = 0.05
#: A wake that has no Ready replica after this long gives up (its replicas stay placed: the
#: reconciler keeps them; requests then get `no_ready_replica`).
WAKE_TIMEOUT_S: Final = 900.0
_SWAP: Final = "swap"


@attrs.define
class _Wake:
    """One wake in progress: its waiters wait on `done`; `error` says why it failed, if it did."""

    started: float
    done: trio.Event = attrs.Factory(trio.Event)
    error: str | None = None


class Idle:
    """Last requests, sleeps and wakes of every deployment (in memory; the `asleep` flag is in the record)."""

    def __init__(self, desired: Desired, metrics: Metrics, outstanding: Callable[[str], int]) -> None:
        self._desired = desired
        self._metrics = metrics
        #: The gateway's requests in flight to a replica (`Router.outstanding`).
        self._outstanding = outstanding
        #: By deployment: its last activity (trio clock: a request, its wake, or the keeper first
        #: seeing it), which its idle time counts from; and its last request (Unix time, for the view).
        self._last: dict[str, float] = {}
        self._last_wall: dict[str, float] = {}
        self._last_wake_s: dict[str, float] = {}
        self._wakes: dict[str, _Wake] = {}
        self._nursery: trio.Nursery | None = None
        self._poke = trio.Event()
        self._started = 0.0

    # ---- what the gateway calls on every request ---------------------------------------------------

    def touch(self, names: Iterable[str]) -> None:
        """Requests for these deployments arrived now (no I/O)."""
        now, wall = trio.current_time(), time.time()
        for name in names:
            self._last[name] = now
            self._last_wall[name] = wall

    def sleeping(self, names: Iterable[str]) -> list[str]:
        """Of these deployments, those asleep or waking now."""
        entries = self._desired.entries
        return [n for n in names if ((e := entries.get(n)) is not None and e.deployment.asleep) or n in self._wakes]

    async def wait_awake(self, names: list[str], deadline: float) -> float:
        """Wake every one of `names` that sleeps and wait (trio clock `deadline`) until one is
        awake with a Ready replica; the seconds waited. DeadlineExceeded when the deadline comes
        first, or at once when the time left is shorter than the last wake of each; NoReadyReplica
        when every wake failed (no room, the model no longer deployable)."""
        started = trio.current_time()
        wakes = [self._start_wake(n) for n in names]
        expected = [self._last_wake_s.get(n) for n in names]
        if all(e is not None and started + e > deadline for e in expected):
            for n in names:
                self._metrics.wake_refused.labels(n).inc()
            slowest = min(e for e in expected if e is not None)
            raise DeadlineExceeded(
                f"{', '.join(names)} sleeps and takes about {slowest:.1f} s to wake, more than the request's"
                " deadline leaves: the wake has started; retry shortly, or give the request a longer deadline"
            )
        with trio.move_on_at(deadline):
            while True:
                if any(w.done.is_set() and w.error is None for w in wakes):
                    return trio.current_time() - started
                if all(w.done.is_set() for w in wakes):
                    errors = "; ".join(w.error or "" for w in wakes)
                    raise NoReadyReplica(f"{', '.join(names)} could not wake: {errors}")
                async with trio.open_nursery() as nursery:
                    for w in wakes:
                        nursery.start_soon(_wait_then_cancel, w.done, nursery.cancel_scope)
        for n in names:
            self._metrics.wake_refused.labels(n).inc()
        raise DeadlineExceeded(
            f"{', '.join(names)} was asleep and is not awake yet: its wake goes on; retry shortly, or give"
            " the request a longer deadline"
        )

    # ---- what operators see and do ----------------------------------------------------------------

    def status(self, dep: Deployment) -> DeploymentSleep:
        """Where `dep` stands with sleep when idle (`DeploymentView.sleep`)."""
        name = dep.name
        state = WAKING if name in self._wakes else ASLEEP if dep.asleep else AWAKE
        sleeps_in = None
        if state == AWAKE and dep.idle_after_s is not None and dep.min_replicas == 0:
            idle_for = trio.current_time() - self._last.get(name, trio.current_time())
            sleeps_in = max(0.0, dep.idle_after_s - idle_for)
        return DeploymentSleep(
            state=state,
            last_request_at=self._last_wall.get(name),
            last_wake_s=self._last_wake_s.get(name),
            sleeps_in_s=sleeps_in,
        )

    async def sleep(self, actor: Actor, name: str) -> None:
        """Put `name` to sleep by hand (`nexa deployments sleep`); Conflict while it serves a request,
        waits for a wake, or runs a canary or a rollout. Asleep already: nothing changes."""
        async with self._desired.lock:
            entry = self._desired.entry(name)
            if entry.deployment.asleep:
                return
            if problem := self._cannot_sleep(entry.deployment):
                raise Conflict(f"deployment {name} cannot sleep now: {problem}")
            await self._put_to_sleep(actor, entry, "operator", "put to sleep by hand")

    async def wake(self, name: str) -> None:
        """Wake `name` by hand (`nexa deployments wake`): starts its wake and returns (it runs on)."""
        self._desired.entry(name)  # NotFound
        self._start_wake(name)

    async def set_idle(self, actor: Actor, name: str, settings: IdleSettings) -> Entry:
        """Change when `name` sleeps and whether swap on demand may put it to sleep; an asleep
        deployment that may no longer sleep is woken."""
        if problems := idle_problems(settings):
            raise ContractError("invalid idle settings: " + "; ".join(problems), problems=tuple(problems))
        async with self._desired.lock:
            before = self._desired.entry(name)
            if settings.idle_after_s is not None and before.deployment.nodes_per_replica > 1:
                problem = "idle_after_s: a deployment whose replicas span nodes never sleeps"
                raise ContractError(problem, problems=(problem,))
            dep = attrs.evolve(
                before.deployment,
                idle_after_s=settings.idle_after_s,
                min_replicas=settings.min_replicas,
                evictable=settings.evictable,
            )
            after = Entry(bump(dep), before.decision, before.problem)
            await self._desired.commit(actor, "deployment.idle", before, after)
        if after.deployment.asleep and after.deployment.min_replicas is None:
            self._start_wake(name)
        self._poke.set()
        return after

    # ---- the keeper's loop -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Put idle deployments to sleep, and run wakes: until cancelled."""
        self._started = trio.current_time()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                next_at = await self._sleep_idle()
                self._poke = trio.Event()
                with trio.move_on_at(max(next_at, trio.current_time() + _MIN_LOOK_S)):
                    await self._poke.wait()

    async def _sleep_idle(self) -> float:
        """Put every deployment idle for its `idle_after_s` to sleep; when to look again (trio clock)."""
        now = trio.current_time()
        next_at = now + _LOOK_S
        if self._desired.recovering:
            return next_at
        for name, entry in sorted(self._desired.entries.items()):
            dep = entry.deployment
            if dep.asleep and dep.placed and (why := self._sleep_failed(dep)):
                await self._fall_back(name, why)
                continue
            if dep.asleep or dep.idle_after_s is None or dep.min_replicas != 0:
                continue
            if not self._any_ready(dep):
                self._last[name] = now  # starting, or its node lost: not idle, its idle time starts once Ready
            due = self._last.setdefault(name, now) + dep.idle_after_s
            next_at = min(next_at, now + min(_LOOK_S, dep.idle_after_s / 4))
            if due > now or self._cannot_sleep(dep):
                continue
            async with self._desired.lock:
                current = self._desired.entries.get(name)
                if current is None or current.deployment.asleep or self._cannot_sleep(current.deployment):
                    continue
                await self._put_to_sleep(
                    SYSTEM, current, "idle", f"idle: no request for {dep.idle_after_s:g} s (idle_after_s)"
                )
        return next_at

    def _any_ready(self, dep: Deployment) -> bool:
        try:
            return any(self._desired.routable(r) for r in dep.placed)
        except NotFound:  # a node forgotten meanwhile
            return False

    def _cannot_sleep(self, dep: Deployment) -> str | None:
        """Why `dep` may not be put to sleep now; None: it may."""
        if dep.nodes_per_replica > 1:
            return "its replicas span nodes"
        if dep.name in self._wakes:
            return "it is waking"
        if dep.canary is not None or dep.rollout is not None:
            return "a canary or a rollout runs"
        if busy := sum(self._outstanding(r.id) for r in all_replicas(dep)):
            return f"{busy} request(s) in flight"
        return None

    async def _put_to_sleep(self, actor: Actor, entry: Entry, reason: str, detail: str) -> None:
        """One audited change: `asleep`, and either its replicas kept with their runtimes put to
        sleep by their own sleep (`native`), or no replicas (each node stops their containers; always
        for a swap, which must free memory). Under the lock."""
        dep = entry.deployment
        if reason != _SWAP and self._native(dep):
            after = Entry(bump(attrs.evolve(dep, asleep=True)), entry.decision, None)
            detail += "; the runtime's own sleep (its containers keep running)"
        else:
            after = Entry(bump(attrs.evolve(dep, asleep=True, placed=[])), entry.decision, None)
        await self._desired.commit(actor, "deployment.sleep", entry, after, detail=detail)
        self._metrics.deployment_sleeps.labels(dep.name, reason).inc()

    def _native(self, dep: Deployment) -> bool:
        """Whether `dep`'s runtime has its own sleep, enabled (`adapters.native_sleep_for`)."""
        try:
            kind = runtime_of(self._desired.models, dep.runtime).kind
        except NexaError:
            return False
        return bool(dep.placed) and native_sleep_for(kind, [*dep.options.command, *dep.options.extra_args]) is not None

    def _sleep_failed(self, dep: Deployment) -> str | None:
        """Why a replica's runtime did not go to sleep by its own sleep (its node says so); None: none failed."""
        for r in dep.placed:
            try:
                statuses = self._desired.fleet.get(r.node_id).statuses
            except NotFound:
                continue
            for st in statuses:
                if st.assignment_id == r.id and st.reason == SLEEP_FAILED:
                    return st.detail or SLEEP_FAILED
        return None

    async def _fall_back(self, name: str, why: str) -> None:
        """A runtime's own sleep failed: stop the sleeping deployment's containers instead (audited)."""
        async with self._desired.lock:
            entry = self._desired.entries.get(name)
            if entry is None or not entry.deployment.asleep or not entry.deployment.placed:
                return
            after = Entry(bump(attrs.evolve(entry.deployment, placed=[])), entry.decision, None)
            detail = f"{why}: its containers are stopped instead"
            await self._desired.commit(SYSTEM, "deployment.sleep", entry, after, detail=detail)
        log.warning("deployment %s: %s", name, detail)

    # ---- waking ------------------------------------------------------------------------------------

    def _start_wake(self, name: str) -> _Wake:
        wake = self._wakes.get(name)
        if wake is not None:
            return wake
        wake = _Wake(started=trio.current_time())
        entry = self._desired.entries.get(name)
        if entry is None or not entry.deployment.asleep:
            wake.done.set()  # awake already (or gone): nothing to wait for
            if entry is None:
                wake.error = f"no deployment {name}"
            return wake
        if self._nursery is None:
            wake.error = "the controller is not running its idle keeper"
            wake.done.set()
            return wake
        self._wakes[name] = wake
        self._nursery.start_soon(self._wake, name, wake)
        return wake

    async def _wake(self, name: str, wake: _Wake) -> None:
        try:
            wake.error = await self._place_awake(name)
            if wake.error is None:
                wake.error = await self._until_ready(name, wake.started)
        except Exception as exc:  # a wake that fails tells its waiters (logged below); the keeper goes on
            wake.error = str(exc)
        finally:
            self._wakes.pop(name, None)
            wake.done.set()
            self._poke.set()
        if wake.error is None:
            took = trio.current_time() - wake.started
            self._last_wake_s[name] = took
            self._metrics.wake_seconds.labels(name).observe(took)
            # Its idle time starts now (not from before it slept).
            self._last[name] = trio.current_time()
            log.info("deployment %s awake in %.2f s", name, took)
        else:
            log.warning("deployment %s could not wake: %s", name, wake.error)

    async def _place_awake(self, name: str) -> str | None:
        """Place the sleeping deployment's replicas again, putting evictable idle deployments to
        sleep while no node has room (swap on demand); one audited change. Why not, or None."""
        async with self._desired.lock:
            entry = self._desired.entries.get(name)
            if entry is None:
                return f"no deployment {name}"
            dep = entry.deployment
            if not dep.asleep:
                return None
            if dep.placed:  # asleep by the runtime's own sleep: its nodes wake it (`/wake_up`)
                after = Entry(bump(attrs.evolve(dep, asleep=False)), entry.decision, None)
                await self._desired.commit(
                    SYSTEM, "deployment.wake", entry, after, detail="woken on demand (the runtime's own wake)"
                )
                return None
            model, runtime, _ = deployable(self._desired.models, dep)
            decision = self._try_place(dep, model, runtime)
            swaps: list[str] = []
            while not decision.feasible:
                victim = self._victim(exclude=name)
                if victim is None:
                    break
                idle_for = trio.current_time() - self._last.get(victim.deployment.name, self._started)
                why = (
                    f"swap on demand: {victim.deployment.name} (evictable, idle {idle_for:.1f} s, the least"
                    f" recently used) put to sleep to make room for {name}"
                )
                await self._put_to_sleep(SYSTEM, victim, _SWAP, why)
                swaps.append(why)
                decision = self._try_place(dep, model, runtime)
            if not decision.feasible:
                problem = "no node has room to wake it: " + explain(decision)
                entry.problem = problem
                raise Unplaceable(problem)
            decision = attrs.evolve(decision, swaps=tuple(swaps))
            placed = new_replicas(name, decision, dep.model)
            after = Entry(bump(attrs.evolve(dep, asleep=False, placed=placed)), decision, None)
            detail = "woken on demand" + (f"; {'; '.join(swaps)}" if swaps else "")
            await self._desired.commit(SYSTEM, "deployment.wake", entry, after, detail=detail)
        return None

    def _try_place(self, dep: Deployment, model: ModelRecord, runtime: RuntimeRecord) -> PlacementDecision:
        return place(self._desired.snapshot(), self._desired.request(dep, model, runtime, dep.replicas))

    def _victim(self, *, exclude: str) -> Entry | None:
        """The least recently used awake, idle, evictable deployment (not `exclude`); None: none."""
        candidates = [
            e
            for n, e in self._desired.entries.items()
            if n != exclude
            and e.deployment.evictable
            and e.deployment.min_replicas == 0
            and e.deployment.placed  # awake, or asleep by its runtime's own sleep (still holding its memory)
            and self._cannot_sleep(e.deployment) is None
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda e: (self._last.get(e.deployment.name, self._started), e.deployment.name))

    async def _until_ready(self, name: str, started: float) -> str | None:
        """Wait until one of the woken deployment's replicas reports Ready; why not, or None."""
        with trio.move_on_at(started + WAKE_TIMEOUT_S):
            while True:
                entry = self._desired.entries.get(name)
                if entry is None:
                    return f"deployment {name} was deleted while it woke"
                if entry.deployment.asleep:
                    return f"deployment {name} was put to sleep again while it woke"
                if self._any_ready(entry.deployment):
                    return None
                await trio.sleep(_READY_POLL_S)
        return f"no replica of {name} was Ready within {WAKE_TIMEOUT_S:g} s"


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
