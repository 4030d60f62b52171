"""The reconciler: keeps every deployment placed as the fleet changes, and steps its rollouts.

The reconciler (`Deployments.run`) wakes when the fleet changes (admin actions, reachability), when an
alias moves, at the moment an Unreachable node's grace period ends, and every `_RESYNC_S`. It
drops replicas on nodes that are Revoked, Draining (only once their replacements are Ready), or
Unreachable for longer than `nodes.replace_after_s` after their lease lapsed, and places
replacements on other nodes; a deployment it cannot fully place keeps what it has and says why
(`DeploymentView.problem`) until the fleet can take the rest.

Rollout. Every replica records the model version it runs. A canary (`start_canary`) places
extra replicas of another version beside the deployment's own (they must fit, like a new
deployment, and its model must be deployable); the gateway sends them `weight` of the traffic
(`serving`) and `rollout.RolloutWatcher` rolls it back when it breaks its objective. `promote`
moves the deployment's alias to the canary's version (`ModelRegistry.promote`; a pinned
deployment has no alias to move), makes the canary's replicas regular ones and starts a
`Rollout`; `rollback` removes a canary, or after a promotion returns to the previous version
(rolling its alias back) the same way. A rollout replaces the old version's replicas one at a
time and never needs a spare accelerator: once every new-version replica reports Ready, the
reconciler stops one old replica (one that is not Ready first) and, in the same change, places
one new-version replica where the freed resources allow (often the same node), then waits for
it to report Ready. Replicas beyond `replicas` are stopped without a replacement. So the
deployment never has fewer than `replicas - 1` Ready replicas because of a rollout, and none
fewer at all when the fleet has room for one more replica: then each new replica starts first
and an old one stops only once it is Ready (make before break). When no node can take the new
version, the old replica is kept and the rollout waits, saying why. Every rollout is watched
(`watch`): a replica runs a spec (model version, runtime, settings; `records.is_current`), a
step waits while the rollout is paused or a new replica has not passed its soak (`soak.held`),
and a replacement never takes the port of the replica it stops on that node.

Following the alias. A deployment created from an alias runs what the alias points at: when the
alias moves (`POST /api/v1/aliases/{name}/promote` or `/rollback`, or a deployment's promote or
rollback), every deployment created from it starts a rollout to the new target, replaced one
at a time as above (a canary of that very version is merged in first). The check compares
state, not events, so a move made while the controller was down is followed at the next start.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Final

import attrs
import trio

from nexa.adapters.lora import loads_at_run_time
from nexa.config import NodesConfig
from nexa.contracts.deployments import Deployment, Replica, RolloutPolicy
from nexa.contracts.domain import SYSTEM, NodeState
from nexa.contracts.models import ModelRecord, ModelRef, RuntimeRecord
from nexa.contracts.placement import PlacementDecision
from nexa.control.deployments.checks import deployable_model, explain, runtime_of
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import (
    Entry,
    bump,
    canary_placed,
    follow,
    goes_in_place,
    is_current,
    lora_change,
    model_of,
    new_replicas,
    replica_nodes,
    with_loras,
)
from nexa.control.deployments.scheduler import place
from nexa.control.deployments.soak import held, with_step
from nexa.control.fleet.nodes import NodeLive
from nexa.errors import NotDeployable, NotFound

log = logging.getLogger(__name__)

#: The reconciler looks again this often even when nothing woke it.
_RESYNC_S: Final = 10.0
#: The audit action of a rollout to another set of LoRA adapters.
ADAPTERS: Final = "deployment.adapters"
#: While a drain waits for replacements to become Ready, how often it looks.
_DRAIN_CHECK_S: Final = 1.0
#: While a group replica runs, how often its members' states are looked at (`grouprun`).
_GROUP_CHECK_S: Final = 0.5
#: While a rollout waits for a new replica to become Ready (or for room), how often it looks.
_ROLLOUT_CHECK_S: Final = 0.5


@attrs.frozen
class Healed:
    """What `Reconciler._heal` settled for one group of replicas (the deployment's own, or its canary's)."""

    placed: list[Replica]
    #: The placement decision taken, when one was.
    decision: PlacementDecision | None
    problem: str | None
    next_at: float


class Reconciler:
    """One pass over every deployment (`reconcile`), and the wait between passes (`wait`)."""

    def __init__(self, desired: Desired, cfg: NodesConfig) -> None:
        self._desired = desired
        self._cfg = cfg
        self._wake = trio.Event()
        self._started = 0.0

    def poke(self) -> None:
        """Ask the reconciler to look now."""
        self._wake.set()

    def start(self) -> None:
        """The reconciler starts now: a node never seen counts as lost from this moment."""
        self._started = trio.current_time()

    async def wait(self, next_at: float) -> None:
        """Until poked, `next_at` (trio clock), or `_RESYNC_S` from now, whichever comes first."""
        self._wake = trio.Event()
        with trio.move_on_at(min(next_at, trio.current_time() + _RESYNC_S)):
            await self._wake.wait()

    def _gone_at(self, live: NodeLive) -> float | None:
        """When the node's replicas must move (trio clock): now if Revoked, None if it is fine.

        Draining is not here: a draining node keeps its replicas until their replacements are
        Ready (make before break), see `_heal`.
        """
        state = live.state
        if state is NodeState.REVOKED:
            return float("-inf")
        if state is NodeState.UNREACHABLE:
            lost = (live.last_seen + self._cfg.lease_s) if live.last_seen is not None else self._started
            return lost + self._cfg.replace_after_s
        return None

    def _triage(self, group: list[Replica], now: float) -> tuple[list[Replica], list[Replica], float]:
        """Split replicas into those that stay and those on draining nodes (dropping lost ones);
        also the next time one of the kept replicas' nodes will count as lost. A group replica
        goes as a unit: lost when any member's node is, draining when any member's node drains."""
        kept: list[Replica] = []
        draining: list[Replica] = []
        next_at = float("inf")
        for r in group:
            lives = [self._desired.fleet.get(n) for n in r.node_ids]
            gone_at = [g for live in lives if (g := self._gone_at(live)) is not None]
            if any(g <= now for g in gone_at):
                continue
            if any(live.state is NodeState.DRAINING for live in lives):
                draining.append(r)
                continue
            next_at = min([next_at, *gone_at])
            kept.append(r)
        return kept, draining, next_at

    async def reconcile(self) -> float:
        """Follow moved aliases, move replicas off nodes that lost them, top every deployment (and
        canary) up, and take one step of each rollout; the next deadline to look again."""
        now = trio.current_time()
        next_at = float("inf")
        async with self._desired.lock:
            for name in sorted(self._desired.entries):
                next_at = min(next_at, await self._reconcile_one(name, now))
        return next_at

    async def _reconcile_one(self, name: str, now: float) -> float:
        entry = self._desired.entries[name]
        dep = entry.deployment
        if dep.asleep:
            return float("inf")  # no replicas while asleep, by design (`idle`): its wake places them
        target = self._alias_target(dep)
        if target is not None and target not in (dep.model, dep.held_model):
            loras = self._desired.models.lora_set(target)
            after = Entry(follow(dep, target, "alias", loras), entry.decision, entry.problem)
            detail = f"alias {dep.alias} points at {target.key}; rolling {dep.model.key} -> {target.key}"
            await self._desired.commit(SYSTEM, "deployment.follow", entry, after, detail=detail)
            entry, dep = after, after.deployment
        if dep.rollout is None and dep.canary is None and dep.eval is None:
            loras = self._desired.models.lora_set(dep.model)
            if loras not in (dep.loras, dep.held_loras):
                what = lora_change(dep.loras, loras)
                policy = dep.rollout_policy or RolloutPolicy()
                in_place = goes_in_place(dep, loras, policy, live=self._takes_adapters_at_run_time(dep))
                how = "in place on its replicas" if in_place else "rolling its replicas"
                after = Entry(with_loras(dep, loras, policy, in_place=in_place), entry.decision, entry.problem)
                await self._desired.commit(SYSTEM, ADAPTERS, entry, after, detail=f"{what}; {how}")
                entry, dep = after, after.deployment

        stable = self._heal(dep, dep.placed, wanted=dep.replicas, ref=dep.model, others=canary_placed(dep), now=now)
        next_at = stable.next_at
        decision = stable.decision or entry.decision
        problem = stable.problem
        canary = dep.canary
        if canary is not None:
            healed = self._heal(
                dep, canary.placed, wanted=canary.replicas, ref=canary.model, others=stable.placed, now=now
            )
            next_at = min(next_at, healed.next_at)
            decision = healed.decision or decision
            problem = problem or (f"canary: {healed.problem}" if healed.problem else None)
            if healed.placed != canary.placed:
                canary = attrs.evolve(canary, placed=healed.placed)
        if stable.placed != dep.placed or canary != dep.canary:
            after = Entry(bump(attrs.evolve(dep, placed=stable.placed, canary=canary)), decision, problem)
            await self._desired.commit(SYSTEM, "deployment.replace", entry, after)
            entry = after
        else:
            entry.problem = problem
        if entry.deployment.rollout is not None:
            next_at = min(next_at, await self._step(entry, now))
        return min(next_at, await self._groups(name, now))

    def _takes_adapters_at_run_time(self, dep: Deployment) -> bool:
        """Whether the deployment's runtime loads adapters at run time (`nexa.adapters.lora`) and
        each of its replicas was given them so (`RuntimeSpec.live_loras`: not one started by an
        earlier release with its adapters in its spec, which a rollout replaces)."""
        try:
            if not loads_at_run_time(self._desired.models.runtime(dep.runtime).kind, dep.options.settings):
                return False
            given = {
                a.id: a.runtime.live_loras
                for node_id in {r.node_id for r in dep.placed}
                for a in self._desired.fleet.get(node_id).desired.assignments
            }
        except NotFound:
            return False
        return all(given.get(r.id, False) for r in dep.placed)

    async def _groups(self, name: str, now: float) -> float:
        """Start, watch and restart the deployment's group replicas as one (`grouprun.GroupRuns.step`):
        commit the node sets their step changes; when to look again."""
        entry = self._desired.entries[name]
        dep = entry.deployment
        if dep.nodes_per_replica <= 1:
            return float("inf")
        runs = self._desired.groups
        fresh = runs.ensure(dep, command_given=bool(dep.options.command))
        changed, next_at = runs.step(dep, now)
        if fresh or changed:
            detail = "; ".join([*fresh, *changed])
            await self._desired.commit(SYSTEM, "deployment.group", entry, entry, detail=detail)
        elif (records := runs.unsaved(dep)) is not None:
            # A phase moved without a node set (the group became Ready): kept for a takeover.
            detail = "; ".join(f"group {rec.replica_id} {rec.phase}" for rec in records)
            await self._desired.save_groups(name, records, detail=detail)
        if runs.active(dep):
            next_at = min(next_at, now + _GROUP_CHECK_S)
        return next_at

    def _alias_target(self, dep: Deployment) -> ModelRef | None:
        if dep.alias is None:
            return None
        try:
            alias, _ = self._desired.models.alias(dep.alias)
        except NotFound:
            return None
        return alias.target

    def _heal(
        self, dep: Deployment, group: list[Replica], *, wanted: int, ref: ModelRef, others: list[Replica], now: float
    ) -> Healed:
        """Drop a group's lost replicas and place replacements of `ref` up to `wanted` (`others`:
        the deployment's other replicas, which spread avoids); draining nodes keep theirs until
        the group is whole and Ready. What runs stays when the model may no longer start."""
        kept, draining, next_at = self._triage(group, now)
        if not draining and len(kept) == len(group) and len(kept) >= wanted:
            return Healed(group, None, None, next_at)
        problem = None
        decision = None
        placed = kept
        try:
            model: ModelRecord | None = deployable_model(self._desired.models, ref)
            runtime: RuntimeRecord | None = runtime_of(self._desired.models, dep.runtime)
        except NotDeployable as exc:
            problem = exc.message  # keep what runs; nothing new starts
            model = runtime = None
            if len(kept) == len(group):
                return Healed(group, None, problem, next_at)
        if model is not None and runtime is not None and len(kept) < wanted:
            existing = Counter(replica_nodes(kept + others))
            request = self._desired.request(dep, model, runtime, wanted - len(kept))
            decision = place(self._desired.snapshot(), request, existing=existing)
            if decision.feasible:
                placed = kept + new_replicas(dep.name, decision, ref)
            else:
                problem = explain(decision)
        if draining:
            # Make before break: a draining node's replicas stop only once the others cover the
            # group and every one of them reports Ready. A group replica that is not Ready itself
            # serves nothing to keep: once its replacement is placed it goes at once, whole.
            if len(placed) >= wanted and all(self._desired.ready(r) for r in placed):
                log.info("deployment %s: replacements Ready; stopping %d on draining nodes", dep.name, len(draining))
            else:
                replaced = decision is not None and decision.feasible
                stay = [r for r in draining if not (replaced and r.members and not self._desired.ready(r))]
                if len(stay) < len(draining):
                    log.info("deployment %s: %d group(s) on draining nodes moved", dep.name, len(draining) - len(stay))
                placed = placed + stay
                if stay:
                    next_at = min(next_at, now + _DRAIN_CHECK_S)
        return Healed(placed, decision, problem, next_at)

    async def _step_in_place(self, entry: Entry, again: float) -> float:
        """An adapter rollout in place ends once its soak passed: the earlier versions are let go."""
        dep = entry.deployment
        rollout = dep.rollout
        assert rollout is not None
        if rollout.paused or not any(s.passed for s in rollout.soaks):
            return again  # soaking (`watch`), or paused
        after = Entry(bump(attrs.evolve(dep, rollout=None)), entry.decision, entry.problem)
        earlier = rollout.good.loras if rollout.good is not None else {}
        detail = f"{lora_change(earlier, dep.loras)} in place: passed; the earlier versions are unloaded"
        await self._desired.commit(SYSTEM, "deployment.rollout.done", entry, after, detail=detail)
        return float("inf")

    async def _step(self, entry: Entry, now: float) -> float:  # noqa: PLR0911 - one return per wait
        """One step of the deployment's rollout (see the module docstring); when to look again."""
        dep = entry.deployment
        rollout = dep.rollout
        assert rollout is not None
        again = now + _ROLLOUT_CHECK_S
        new = [r for r in dep.placed if is_current(dep, r)]
        old = [r for r in dep.placed if not is_current(dep, r)]
        if not all(self._desired.ready(r) for r in new):
            return again  # the last step's replica is not Ready yet
        if rollout.in_place:
            return await self._step_in_place(entry, again)
        if held(rollout, new):
            return again  # paused, or a new replica still soaks (`watch`)
        if not old:
            if len(new) < dep.replicas:
                return again  # lost meanwhile; `_heal` tops the deployment up first
            after = Entry(
                bump(attrs.evolve(dep, placed=new[: dep.replicas], rollout=None)), entry.decision, entry.problem
            )
            detail = f"{rollout.from_.key} -> {rollout.to.key} ({rollout.reason}): {dep.replicas} replica(s) Ready"
            await self._desired.commit(SYSTEM, "deployment.rollout.done", entry, after, detail=detail)
            return float("inf")
        victim = next((r for r in old if not self._desired.ready(r)), old[0])
        rest = [r for r in dep.placed if r.id != victim.id]
        stopped = f"stopped {victim.id} ({model_of(dep, victim).key}) on {victim.node_id}"
        decision = entry.decision
        if len(rest) >= dep.replicas:
            placed = rest
            detail = f"{rollout.from_.key} -> {rollout.to.key}: {stopped}"
        else:
            waits = f"rollout {rollout.from_.key} -> {rollout.to.key} waits: "
            try:
                model = deployable_model(self._desired.models, dep.model)
                runtime = runtime_of(self._desired.models, dep.runtime)
            except NotDeployable as exc:
                entry.problem = waits + exc.message
                return again
            # Make before break when the fleet has room for one more replica: the old one keeps
            # serving until its replacement is Ready (the next step then only stops it).
            surge = place(
                self._desired.snapshot(),
                self._desired.request(dep, model, runtime, 1),
                existing=Counter(replica_nodes(dep.placed + canary_placed(dep))),
            )
            if len(dep.placed) <= dep.replicas and surge.feasible:
                decision, rest, stopped = surge, dep.placed, "the old replica stays until it is Ready"
            else:
                # No room: stop one old replica and place its replacement where it was freed.
                existing = Counter(replica_nodes(rest + canary_placed(dep)))
                snapshot = self._desired.snapshot(without=frozenset({victim.id}))
                decision = place(snapshot, self._desired.request(dep, model, runtime, 1), existing=existing)
            if not decision.feasible:
                entry.problem = waits + explain(decision)
                return again
            [fresh] = new_replicas(dep.name, decision, dep.model)
            placed = [*rest, fresh]
            on = ", ".join(fresh.node_ids)
            detail = f"{rollout.from_.key} -> {rollout.to.key}: started {fresh.id} on {on}; {stopped}"
        after = Entry(bump(attrs.evolve(dep, placed=placed, rollout=with_step(rollout, "replaced", detail))), decision)
        await self._desired.commit(SYSTEM, "deployment.rollout.step", entry, after, detail=detail)
        return again
