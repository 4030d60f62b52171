"""Rollout by operators: a canary beside a deployment, its promotion, and rollbacks.

A canary (`start_canary`) places extra replicas of another version beside the deployment's own
(they must fit, like a new deployment, and its model must be deployable); the gateway sends them
`weight` of the traffic (`views.serving`) and `rollout.RolloutWatcher` removes it
(`drop_canary`) when it breaks its objective. `promote` moves the deployment's alias to the
canary's version (`ModelRegistry.promote`; a pinned deployment has no alias to move), makes the
canary's replicas regular ones and starts a `Rollout`, which the reconciler steps; `rollback`
removes a canary, or after a promotion returns to the previous version (rolling its alias back)
the same way.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import attrs

from nexa.contracts.deployments import Canary, CanaryCreate, DeploymentView, RolloutResult, canary_problems
from nexa.contracts.domain import Actor
from nexa.contracts.models import AliasPromote
from nexa.control.deployments import canarysuite
from nexa.control.deployments.checks import deployable_model, explain, not_rolling, runtime_of
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import Entry, bump, follow, new_replicas, replica_nodes
from nexa.control.deployments.scheduler import place
from nexa.control.deployments.views import view
from nexa.errors import Conflict, ContractError, NoCanary, NothingToRollBack, Unplaceable


class Rollouts:
    """The canary, promote and rollback changes of `Deployments`; `poke` wakes the reconciler."""

    def __init__(self, desired: Desired, poke: Callable[[], None]) -> None:
        self._desired = desired
        self._poke = poke

    async def start_canary(self, actor: Actor, name: str, req: CanaryCreate) -> DeploymentView:
        """Place `req.replicas` extra replicas of `req.model` beside the deployment's own, or refuse.

        Refused: a bad request (400); a canary or rollout already running, or the version the
        deployment runs already (409); a model that may not be deployed, or replicas that do not
        fit (422, the typed code of a new deployment). A refusal places nothing.
        """
        problems = canary_problems(req)
        if problems:
            raise ContractError("invalid canary: " + "; ".join(problems), problems=tuple(problems))
        async with self._desired.lock:
            before = self._desired.entry(name)
            dep = before.deployment
            not_rolling(dep)
            if req.model == dep.model:
                raise Conflict(f"deployment {name} runs {dep.model.key} already; a canary runs another version")
            runtime = runtime_of(self._desired.models, dep.runtime)
            model = deployable_model(self._desired.models, req.model)
            existing = Counter(replica_nodes(dep.placed))
            decision = place(
                self._desired.snapshot(), self._desired.request(dep, model, runtime, req.replicas), existing=existing
            )
            if not decision.feasible:
                raise Unplaceable(f"the canary {model.key} of deployment {name} cannot be placed: " + explain(decision))
            canary = Canary(
                model=req.model,
                weight=req.weight,
                objective=req.objective,
                replicas=req.replicas,
                placed=new_replicas(name, decision, req.model),
                started_at=time.time(),
                started_by=actor.key_id,
                suite=req.suite,
            )
            after = Entry(bump(attrs.evolve(dep, canary=canary)), decision)
            detail = f"canary {model.key} beside {dep.model.key}: {req.replicas} replica(s), weight {req.weight:g}"
            await self._desired.commit(actor, "deployment.canary.start", before, after, detail=detail)
        return view(self._desired, after)

    async def promote(self, actor: Actor, name: str) -> RolloutResult:
        """Make the canary's version the deployment's: move its alias (with the receipt), keep the
        canary's replicas as regular ones, and replace the old version's one at a time."""
        async with self._desired.lock:
            before = self._desired.entry(name)
            dep = before.deployment
            canary = dep.canary
            if canary is None:
                raise NoCanary(f"deployment {name} runs no canary to promote")
            canarysuite.check(self._desired.models, name, canary)
            receipt = None
            if dep.alias is not None:
                promotion = AliasPromote(model=canary.model.model, version=canary.model.version)
                receipt = await self._desired.models.promote(actor, dep.alias, promotion)
            after = Entry(
                follow(dep, canary.model, "promote", self._desired.models.lora_set(canary.model)), before.decision
            )
            detail = f"{dep.model.key} -> {canary.model.key}" + (
                f"; alias {dep.alias} generation {receipt.generation}" if receipt else ""
            )
            await self._desired.commit(actor, "deployment.promote", before, after, detail=detail)
        self._poke()
        return RolloutResult(deployment=view(self._desired, after), alias=receipt)

    async def rollback(self, actor: Actor, name: str) -> RolloutResult:
        """Remove a running canary; else return to the version before the last promotion (its
        alias rolled back, with the receipt), replaced one at a time."""
        async with self._desired.lock:
            before = self._desired.entry(name)
            dep = before.deployment
            if dep.canary is not None:
                after = await self._drop_canary(actor, before, "deployment.canary.rollback", "removed by an operator")
                return RolloutResult(deployment=view(self._desired, after), alias=None)
            if dep.previous is None:
                raise NothingToRollBack(f"deployment {name} runs no canary and has no earlier version to return to")
            receipt = None
            if dep.alias is not None:
                receipt = await self._desired.models.rollback(actor, dep.alias)
                target = receipt.to
            else:
                target = dep.previous
                deployable_model(self._desired.models, target)
            after = before
            if target != dep.model:
                followed = follow(dep, target, "rollback", self._desired.models.lora_set(target))
                if dep.alias is None:
                    followed = attrs.evolve(followed, previous=None)  # a rollback is not itself undone
                after = Entry(followed, before.decision)
                detail = f"{dep.model.key} -> {target.key}" + (
                    f"; alias {dep.alias} generation {receipt.generation}" if receipt else ""
                )
                await self._desired.commit(actor, "deployment.rollback", before, after, detail=detail)
        self._poke()
        return RolloutResult(deployment=view(self._desired, after), alias=receipt)

    async def drop_canary(self, actor: Actor, name: str, canary: Canary, *, action: str, detail: str) -> bool:
        """Remove `canary` from deployment `name`, audited as `action` with `detail` (figures first).

        False, changing nothing, when the deployment is gone or no longer runs that very canary
        (promoted or replaced meanwhile).
        """
        async with self._desired.lock:
            entry = self._desired.entries.get(name)
            if entry is None or entry.deployment.canary != canary:
                return False
            await self._drop_canary(actor, entry, action, detail)
        return True

    async def _drop_canary(self, actor: Actor, before: Entry, action: str, detail: str) -> Entry:
        dep = before.deployment
        assert dep.canary is not None
        after = Entry(bump(attrs.evolve(dep, canary=None)), before.decision, before.problem)
        await self._desired.commit(actor, action, before, after, detail=f"canary {dep.canary.model.key}: {detail}")
        return after
