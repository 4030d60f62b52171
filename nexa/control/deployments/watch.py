"""Every change rolled out under watch: a new runtime (image) or settings (`change`), as a new
model version (`records.follow`), replaces the deployment's replicas one (or one group) at a time
(`reconciler`: surge-first when the fleet has room, else stop one and start its replacement
there), and each new replica soaks before the next is replaced.

`ChangeWatcher` looks every `interval_s`: a new replica that reports Ready starts its soak
(`Soak`, in the deployment's record, so a new leader carries on from the store); its requests
(those served on its nodes since it became Ready, attempts that failed there included) are held
against the deployment's `objectives` (`soak.breach`, from `min_requests` requests on). A breach
stops the rollout and reverts the changed replicas to the last good spec (`Rollout.good`),
audited as `deployment.rollout.revert` with the figures, counted in
`nexa_rollout_reverts_total` (alert rule `NexaRolloutReverted`); a version so reverted is held
(`Deployment.held_model`: its alias is not followed there again). A replica that soaked
`policy.soak_s` unbroken passes, and the reconciler takes the next step. A rollout without a
policy (a revert; a new version of a deployment with none set) is not held, but its new replicas
are still held to the objectives until it ends. A set of LoRA adapters a rollout reverted is held
the same way (`Deployment.held_loras`) while the aliases serve it.

A policy with a suite (`RolloutPolicy.suite`) holds a replica that soaked its time unbroken until
a measured run of the suite against the deployment is recorded since it became Ready
(`rolloutsuite`; the step `suite` and `rollout status` name the `nexa eval run` command): a run
below the gate reverts the rollout as a breach does (audited `deployment.rollout.revert` with the
run's pass rates), a run that meets it passes the replica. Its objectives are watched meanwhile.

Operators drive it (`RolloutControl`): `status`, `pause` (no further step; watching goes on),
`resume`, and `undo` (revert now, as a breach would). Bad input is a typed error that changes
nothing: no rollout (`NoRollout`), pausing a paused one (`RolloutAlreadyPaused`), resuming a
running one (`RolloutNotPaused`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

import attrs
import trio

from nexa.contracts.deployments import (
    CanarySuite,
    DeploymentChange,
    DeploymentCreate,
    DeploymentView,
    Replica,
    Rollout,
    RolloutPolicy,
    RolloutStatus,
    Soak,
    rollout_policy_problems,
)
from nexa.contracts.domain import SYSTEM, Actor, TenantId
from nexa.contracts.gateway import adapter_key
from nexa.contracts.usage import WatchStats
from nexa.control import store as st
from nexa.control.deployments import rolloutsuite
from nexa.control.deployments.canarysuite import waits_for
from nexa.control.deployments.checks import check_settings, check_shape, deployable_model, not_rolling, runtime_of
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import Entry, bump, is_current, lora_change, pin_specs, spec_now, unpinned
from nexa.control.deployments.soak import breach, figures, with_step
from nexa.control.deployments.views import view
from nexa.errors import ContractError, NoRollout, NotFound, RolloutAlreadyPaused, RolloutNotPaused
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: Audit actions of this module.
CHANGE: Final = "deployment.change"
WATCH: Final = "deployment.rollout.watch"
REVERT: Final = "deployment.rollout.revert"
UNDO: Final = "deployment.rollout.undo"
PAUSE: Final = "deployment.rollout.pause"
RESUME: Final = "deployment.rollout.resume"
POLICY: Final = "deployment.rollout_policy"
#: The policy of a change that names none on a deployment that has none.
DEFAULT_POLICY: Final = RolloutPolicy()


#: The soak of an adapter rollout in place: the new adapter versions, on every replica, as one.
ADAPTERS_SOAK: Final = "adapters"


class NodesWindow(Protocol):
    """Finished requests served on some nodes, or naming some adapter versions
    (`nexa.control.datapath.metering.Meter.nodes_window`, `.adapters_window`)."""

    def nodes_window(self, deployment: str, nodes: list[str], *, since: float, now: float) -> WatchStats: ...

    def adapters_window(self, deployment: str, adapters: list[str], *, since: float, now: float) -> WatchStats: ...


class RolloutControl:
    """Changes that start a watched rollout, and an operator's hand on it (see the module docstring)."""

    def __init__(
        self,
        desired: Desired,
        poke: Callable[[], None],
        metrics: Metrics,
        store: st.Store,
        tenant_exists: Callable[[TenantId], bool],
    ) -> None:
        self._desired = desired
        self._poke = poke
        self._metrics = metrics
        self._store = store
        self._tenant_exists = tenant_exists

    async def check_policy(self, policy: RolloutPolicy | None) -> None:
        """Refuse a policy out of range (400), or whose suite gate names a suite that is not
        registered or a tenant that does not exist (404)."""
        if policy is None:
            return
        if problems := rollout_policy_problems(policy):
            raise ContractError("invalid rollout policy: " + "; ".join(problems), problems=tuple(problems))
        if policy.suite is not None:
            await self.check_gate(policy.suite, "the rollout policy's gate")

    async def check_gate(self, gate: CanarySuite, whose: str) -> None:
        """Refuse a suite gate (of a policy or a canary, its shape checked) naming a suite that is
        not registered or a tenant that does not exist (404, naming what to do)."""
        if await self._store.read(st.get_suite, gate.suite, None) is None:
            raise NotFound(
                f"no suite {gate.suite} for {whose}: register it first with "
                f"`nexa eval register FILE --name {gate.suite}` (`nexa eval suites` lists them)"
            )
        if gate.tenant is not None and not self._tenant_exists(TenantId(gate.tenant)):
            raise NotFound(
                f"no tenant {gate.tenant} for {whose} (the tenant the controller runs the suite as): create it "
                f"with `nexa tenants create {gate.tenant}` (`nexa tenants list` shows them), or name another"
            )

    async def change(self, actor: Actor, name: str, req: DeploymentChange) -> DeploymentView:
        """Give the deployment a new runtime or settings, rolled out under watch; refused (and
        nothing changed) when it rolls out already, when nothing changes, or when the runtime is
        not registered or the settings are not the runtime's. A new rollout policy alone is set
        at once (nothing rolls out)."""
        await self.check_policy(req.rollout_policy)
        async with self._desired.lock:
            before = self._desired.entry(name)
            dep = before.deployment
            runtime_name = req.runtime if req.runtime is not None else dep.runtime
            options = req.options if req.options is not None else dep.options
            policy_was = dep.rollout_policy
            policy = req.rollout_policy or policy_was
            if runtime_name == dep.runtime and options == dep.options and req.rollout_policy not in (None, policy_was):
                # The policy alone: no replica changes, so nothing rolls out.
                after = Entry(
                    bump(attrs.evolve(dep, rollout_policy=req.rollout_policy)), before.decision, before.problem
                )
                await self._desired.commit(actor, POLICY, before, after, detail=f"rollout policy {req.rollout_policy}")
                return view(self._desired, after)
            if runtime_name == dep.runtime and options == dep.options:
                raise ContractError(
                    f"deployment {name} runs runtime {dep.runtime} with these settings already; give another "
                    "runtime or other settings",
                    problems=("runtime, options: nothing changes",),
                )
            not_rolling(dep)
            runtime = runtime_of(self._desired.models, runtime_name)
            model = deployable_model(self._desired.models, dep.model)
            shaped = DeploymentCreate(
                name=dep.name,
                runtime=runtime_name,
                model=dep.model,
                replicas=dep.replicas,
                resources=dep.resources,
                options=options,
                placement=dep.placement,
                nodes_per_replica=dep.nodes_per_replica,
            )
            check_shape(shaped)
            check_settings(shaped, runtime, model)
            what = []
            if runtime_name != dep.runtime:
                what.append(f"runtime {dep.runtime} -> {runtime_name} ({runtime.image})")
            if options != dep.options:
                what.append("settings changed")
            detail = "; ".join(what)
            rollout = Rollout(
                from_=dep.model,
                to=dep.model,
                reason="change",
                started_at=time.time(),
                policy=policy or DEFAULT_POLICY,
                good=spec_now(dep),
            )
            changed = attrs.evolve(
                dep,
                runtime=runtime_name,
                options=options,
                placed=pin_specs(dep),
                rollout=with_step(rollout, "started", detail),
                rollout_policy=req.rollout_policy or dep.rollout_policy,
            )
            after = Entry(bump(changed), before.decision, before.problem)
            await self._desired.commit(actor, CHANGE, before, after, detail=detail)
        self._poke()
        return view(self._desired, after)

    def status(self, name: str) -> RolloutStatus:
        dep = self._desired.entry(name).deployment
        new = sum(1 for r in dep.placed if is_current(dep, r)) if dep.rollout else 0
        return RolloutStatus(
            deployment=name,
            rollout=dep.rollout,
            new=new,
            old=len(dep.placed) - new if dep.rollout else 0,
            runtime=dep.runtime,
            held_model=dep.held_model,
            suite=suite_state(dep.name, dep.rollout),
        )

    async def pause(self, actor: Actor, name: str) -> RolloutStatus:
        """No further replica is replaced until `resume` (a new replica under watch is still watched)."""
        async with self._desired.lock:
            before = self._entry_rolling(name)
            rollout = before.deployment.rollout
            assert rollout is not None
            if rollout.paused:
                raise RolloutAlreadyPaused(f"the rollout of deployment {name} is paused already; resume it or undo it")
            paused = with_step(attrs.evolve(rollout, paused=True), "paused", f"by {_who(actor)}")
            await self._set(actor, PAUSE, before, paused)
        return self.status(name)

    async def resume(self, actor: Actor, name: str) -> RolloutStatus:
        async with self._desired.lock:
            before = self._entry_rolling(name)
            rollout = before.deployment.rollout
            assert rollout is not None
            if not rollout.paused:
                raise RolloutNotPaused(f"the rollout of deployment {name} is not paused; `pause` it first")
            resumed = with_step(attrs.evolve(rollout, paused=False), "resumed", f"by {_who(actor)}")
            await self._set(actor, RESUME, before, resumed)
        self._poke()
        return self.status(name)

    async def undo(self, actor: Actor, name: str) -> RolloutStatus:
        """Stop the rollout and return its changed replicas to the last good spec, now."""
        async with self._desired.lock:
            before = self._entry_rolling(name)
            rollout = before.deployment.rollout
            assert rollout is not None
            if rollout.good is None:
                raise NoRollout(
                    f"deployment {name} is returning to its last good spec already (a revert); wait for it to end"
                )
            await self._revert(actor, UNDO, before, f"undone by {_who(actor)}")
        self._poke()
        return self.status(name)

    async def revert(self, name: str, rollout: Rollout, why: str) -> bool:
        """Revert the rollout `rollout` of deployment `name` (a breach); False, changing nothing,
        when that rollout is no longer the deployment's (done, undone or replaced meanwhile)."""
        async with self._desired.lock:
            entry = self._desired.entries.get(name)
            now = entry.deployment.rollout if entry is not None else None
            if entry is None or now is None or now.started_at != rollout.started_at or now.good is None:
                return False
            await self._revert(SYSTEM, REVERT, entry, why)
        self._metrics.rollout_reverts.labels(name).inc()
        self._poke()
        return True

    async def soak(self, name: str, started_at: float, soak: Soak, *, passed: bool, detail: str) -> None:
        """Record that `soak` began (`passed` False), waits for its suite (`Soak.suite_wait`) or
        passed: a new replica's watch, in the store."""
        async with self._desired.lock:
            entry = self._desired.entries.get(name)
            rollout = entry.deployment.rollout if entry is not None else None
            if entry is None or rollout is None or rollout.started_at != started_at:
                return
            soaks = [s for s in rollout.soaks if s.replica_id != soak.replica_id]
            marked = attrs.evolve(soak, passed=passed)
            what = "passed" if passed else "suite" if soak.suite_wait else "soaking"
            updated = with_step(attrs.evolve(rollout, soaks=[*soaks, marked]), what, f"{soak.replica_id}: {detail}")
            await self._set(SYSTEM, WATCH, entry, updated, detail=f"{soak.replica_id} {what}: {detail}")
        if passed:
            self._poke()

    def _entry_rolling(self, name: str) -> Entry:
        entry = self._desired.entry(name)
        if entry.deployment.rollout is None:
            raise NoRollout(
                f"deployment {name} has no rollout in progress; change its runtime or settings to start one"
            )
        return entry

    async def _set(self, actor: Actor, action: str, before: Entry, rollout: Rollout, *, detail: str = "") -> None:
        after = Entry(bump(attrs.evolve(before.deployment, rollout=rollout)), before.decision, before.problem)
        await self._desired.commit(actor, action, before, after, detail=detail)

    async def _revert(self, actor: Actor, action: str, before: Entry, why: str) -> None:
        dep = before.deployment
        rollout = dep.rollout
        assert rollout is not None
        assert rollout.good is not None
        good = rollout.good
        if rollout.in_place:
            # Nothing was replaced: every request goes back to the earlier versions now, and the
            # replicas let the new ones go (`Assignment.loras`).
            detail = f"{why}; back to {lora_change(dep.loras, good.loras).removeprefix('adapters ')} in place"
            reverted = attrs.evolve(
                dep, placed=unpinned(dep), rollout=None, loras=dict(good.loras), held_loras=dep.loras
            )
            await self._desired.commit(
                actor, action, before, Entry(bump(reverted), before.decision, before.problem), detail=detail
            )
            log.warning("deployment %s: adapter rollout reverted: %s", dep.name, detail)
            return
        changed = [r.id for r in dep.placed if is_current(dep, r)]
        detail = (
            f"{why}; back to runtime {good.runtime}, {good.model.key}"
            + (", the earlier settings" if good.options != dep.options else "")
            + (f", {lora_change(dep.loras, good.loras)}" if good.loras != dep.loras else "")
            + f": {len(changed)} changed replica(s) replaced"
        )
        revert = Rollout(
            from_=dep.model,
            to=good.model,
            reason="revert" if action == REVERT else "undo",
            started_at=time.time(),
            steps=[*rollout.steps],
        )
        revert = with_step(revert, "breach" if action == REVERT else "undo", detail)
        held_model = dep.model if dep.model != good.model else dep.held_model
        held_loras = dep.loras if dep.loras != good.loras else dep.held_loras
        reverted = attrs.evolve(
            dep,
            runtime=good.runtime,
            options=good.options,
            model=good.model,
            placed=pin_specs(dep),
            rollout=revert,
            held_model=held_model,
            loras=dict(good.loras),
            held_loras=held_loras,
        )
        after = Entry(bump(reverted), before.decision, before.problem)
        await self._desired.commit(actor, action, before, after, detail=detail)
        log.warning("deployment %s: rollout reverted: %s", dep.name, detail)


def suite_state(name: str, rollout: Rollout | None) -> str | None:
    """What the rollout's suite gate waits for now, and who runs it (`RolloutStatus.suite`); None
    without one."""
    gate = rollout.policy.suite if rollout is not None and rollout.policy is not None else None
    if rollout is None or gate is None:
        return None
    what = f"suite {gate.suite} (every pass rate >= {gate.min_pass_rate:g})"
    who = waits_for(gate, name, "rollout")
    waiting = [s.replica_id for s in rollout.soaks if s.suite_wait and not s.passed]
    if waiting:
        return f"replica(s) {', '.join(waiting)} soaked unbroken and wait for {what}: {who}"
    return f"each new replica, once it soaked unbroken, waits for {what}: {who}"


def _who(actor: Actor) -> str:
    return f"key {actor.key_id}" if actor.key_id else "the controller"


class ChangeWatcher:
    """Starts, judges and passes each new replica's soak (see the module docstring)."""

    def __init__(
        self, desired: Desired, control: RolloutControl, meter: NodesWindow, *, interval_s: float = 0.5
    ) -> None:
        self._desired = desired
        self._control = control
        self._meter = meter
        self._interval_s = interval_s

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.check()
            await trio.sleep(self._interval_s)

    async def check(self) -> list[str]:
        """One look at every rollout; the deployments whose rollout was reverted."""
        reverted: list[str] = []
        if self._desired.recovering:
            return reverted
        for name, entry in sorted(self._desired.entries.items()):
            rollout = entry.deployment.rollout
            if rollout is None or rollout.good is None:
                continue
            check = self._check_in_place if rollout.in_place else self._check_one
            if await check(name, rollout):
                reverted.append(name)
        return reverted

    async def _check_one(self, name: str, rollout: Rollout) -> bool:
        dep = self._desired.entries[name].deployment
        policy = rollout.policy or dep.rollout_policy or attrs.evolve(DEFAULT_POLICY, soak_s=0.0)
        soaks = {s.replica_id: s for s in rollout.soaks}
        now = time.time()
        for r in dep.placed:
            try:
                if not is_current(dep, r) or not self._desired.ready(r):
                    continue
            except NotFound:
                continue  # its node is gone: the reconciler replaces it
            soak = soaks.get(r.id)
            if soak is None:
                if rollout.policy is not None:
                    fresh = Soak(replica_id=r.id, node_ids=list(r.node_ids), ready_at=now)
                    await self._control.soak(name, rollout.started_at, fresh, passed=False, detail="Ready")
                    return False
                soak = Soak(replica_id=r.id, node_ids=list(r.node_ids), ready_at=rollout.started_at)
            stats = self._meter.nodes_window(name, soak.node_ids, since=soak.ready_at, now=now)
            seconds = now - soak.ready_at
            why = breach(dep.objectives, policy, stats)
            if why is not None:
                where = f"replica {r.id} on {', '.join(r.node_ids)}"
                detail = f"{where} broke the objectives ({why}) {figures(stats, seconds)}"
                return await self._control.revert(name, rollout, detail)
            if rollout.policy is not None and not soak.passed and seconds >= rollout.policy.soak_s:
                detail = figures(stats, seconds)
                gate = rollout.policy.suite
                if gate is not None:
                    try:
                        runs = self._desired.models.evaluations(dep.model.model, dep.model.version)
                    except NotFound:
                        runs = []  # the version is gone from the registry: no run can pass it
                    said = rolloutsuite.verdict(runs, name, gate, since=soak.ready_at)
                    if said.passed is None:
                        if not soak.suite_wait:
                            waits = attrs.evolve(soak, suite_wait=True)
                            await self._control.soak(
                                name,
                                rollout.started_at,
                                waits,
                                passed=False,
                                detail=f"{detail}; waits for {said.detail}",
                            )
                        continue  # held until a run decides; its objectives are still watched
                    if not said.passed:
                        where = f"replica {r.id} on {', '.join(r.node_ids)}"
                        return await self._control.revert(name, rollout, f"{where} failed {said.detail}")
                    detail = f"{detail}; {said.detail}"
                await self._control.soak(name, rollout.started_at, soak, passed=True, detail=detail)
                return False
        return False

    async def _check_in_place(self, name: str, rollout: Rollout) -> bool:
        """An adapter rollout in place: its soak starts once a replica is Ready; the requests that
        named the new versions since then are held to the objectives (a breach reverts it), and
        `soak_s` unbroken with at least `min_requests` of them passes it."""
        dep = self._desired.entries[name].deployment
        policy = rollout.policy or dep.rollout_policy or DEFAULT_POLICY
        moved = sorted(adapter_key(dep.loras[alias]) for alias in dep.moved_loras())
        shown = ", ".join(m.replace(":", "@") for m in moved)
        soak = next((s for s in rollout.soaks if s.replica_id == ADAPTERS_SOAK), None)
        now = time.time()
        if soak is None:
            if not any(self._ready(r) for r in dep.placed):
                return False
            fresh = Soak(replica_id=ADAPTERS_SOAK, node_ids=sorted({r.node_id for r in dep.placed}), ready_at=now)
            detail = f"{shown} take {policy.adapter_weight:.0%} of their aliases' requests on every replica"
            await self._control.soak(name, rollout.started_at, fresh, passed=False, detail=detail)
            return False
        if soak.passed:
            return False
        stats = self._meter.adapters_window(name, moved, since=soak.ready_at, now=now)
        seconds = now - soak.ready_at
        why = breach(dep.objectives, policy, stats)
        if why is not None:
            detail = f"adapter {shown} broke the objectives ({why}) {figures(stats, seconds)}"
            return await self._control.revert(name, rollout, detail)
        if seconds >= policy.soak_s and stats.requests >= policy.min_requests:
            await self._control.soak(name, rollout.started_at, soak, passed=True, detail=figures(stats, seconds))
        return False

    def _ready(self, replica: Replica) -> bool:
        try:
            return self._desired.ready(replica)
        except NotFound:
            return False
