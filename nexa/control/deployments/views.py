"""What the deployments look like from outside: an operator's `DeploymentView`, and the
`ServingSet` the gateway routes a model's requests over (read on every request: in memory, no I/O,
and made once per change: `ServingSets` keeps it until a deployment or the fleet changes)."""

from __future__ import annotations

from nexa import adapters
from nexa.contracts.deployments import (
    CANARY_EVAL_PREFIX,
    EVAL_PREFIX,
    GROUP_PENDING,
    ROLLOUT_EVAL_PREFIX,
    Canary,
    Deployment,
    DeploymentView,
    GroupMemberStatus,
    GroupStatus,
    Replica,
    ServingReplica,
    ServingSet,
)
from nexa.contracts.domain import NodeState
from nexa.contracts.gateway import Capability
from nexa.contracts.models import ModelRef
from nexa.control.deployments import canarysuite
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import Entry, is_current, model_of
from nexa.errors import NotFound


class ServingSets:
    """`serving` per (model, alias), made once per change rather than once per request.

    Each set is kept until `Desired.version` (a deployment changed), `Fleet.version` (a node's
    state, or which of its replicas are Ready, changed) or the registry's `evaluations_version` (a
    canary's suite gate may have passed) moves on; then every set is made again on
    its next request, so the answer is always the one `serving` would give now. The sets handed
    out are shared between requests: read them, never change them.
    """

    def __init__(self, desired: Desired) -> None:
        self._desired = desired
        self._versions = (-1, -1, -1)
        self._sets: dict[tuple[ModelRef, str | None], ServingSet] = {}

    def get(self, model: ModelRef, *, alias: str | None = None) -> ServingSet:
        versions = (self._desired.version, self._desired.fleet.version, self._desired.models.evaluations_version)
        if versions != self._versions:
            self._sets.clear()
            self._versions = versions
        key = (model, alias)
        found = self._sets.get(key)
        if found is None:
            found = self._sets[key] = serving(self._desired, model, alias=alias)
        return found


def serving(desired: Desired, model: ModelRef, *, alias: str | None = None) -> ServingSet:
    """The replicas the gateway may send requests for `model` to (kept by `ServingSets` until a change).

    Deployments of `model` (pinned, or following an alias that points there) and, when
    `alias` is given, every deployment created from it: all their replicas that their node
    reports Ready, on nodes that are Ready or Cordoned (never Unreachable or Revoked). During a
    rollout both versions' Ready replicas serve (one deployment); a deployment rolling away
    from `model` still serves its replicas of `model`. A running canary's Ready replicas come
    flagged `canary=True`, and `canary_weight` is its weight: 0 while no canary replica is Ready, and
    while its suite gate (`Canary.suite`) has no passing run against it (`canarysuite`): a canary with
    a suite takes client traffic only once its suite passed, the suite's own calls reaching it
    meanwhile (`CANARY_EVAL_PREFIX`), and clients only when no stable replica is left to try.

    A Draining node takes no new requests while any other Ready replica serves the model. Only
    when none does (its replacements, started before it stops, are not Ready yet) do its Ready
    replicas keep serving: a drain never causes a moment without a replica that answers.

    An evaluation replica (`evalreplica`) serves only when `alias` is its name, and then alone; an
    `alias` of `CANARY_EVAL_PREFIX` + D: D's Ready canary replicas alone; of `ROLLOUT_EVAL_PREFIX`
    + D: the Ready new replicas of D's rollout alone (those that run its spec now).
    """
    if alias is not None and alias.startswith(CANARY_EVAL_PREFIX):
        return _canary_alone(desired, model, alias.removeprefix(CANARY_EVAL_PREFIX))
    if alias is not None and alias.startswith(ROLLOUT_EVAL_PREFIX):
        return _rollout_alone(desired, model, alias.removeprefix(ROLLOUT_EVAL_PREFIX))
    replicas: list[ServingReplica] = []
    draining: list[ServingReplica] = []
    names: list[str] = []
    weight = 0.0
    hidden = alias is not None and alias.startswith(EVAL_PREFIX)
    for name, entry in desired.entries.items():
        dep = entry.deployment
        if (hidden or dep.eval is not None) and name != alias:
            continue
        mine = dep.model == model or (alias is not None and dep.alias == alias)
        leaving = dep.rollout is not None and dep.rollout.from_ == model
        if not (mine or leaving):
            continue
        names.append(name)
        if dep.asleep:
            continue  # its replicas sleep (the runtime's own sleep): a request wakes it first (`idle`)
        served = _served(desired, dep)
        keeps = _keeps_responses(desired, dep)
        for r in dep.placed:
            ref = model_of(dep, r)
            if not (mine or ref == model):
                continue
            serving = ServingReplica(
                replica_id=r.id,
                node_id=r.node_id,
                deployment=name,
                model=ref,
                routing=dep.routing,
                serves=served,
                keeps_responses=keeps,
            )
            if desired.routable(r):
                replicas.append(serving)
            elif desired.fleet.get(r.node_id).state is NodeState.DRAINING and desired.ready(r):
                draining.append(serving)
        canary = dep.canary
        if canary is None or not mine:
            continue
        ready = [r for r in canary.placed if desired.routable(r)]
        replicas += [
            ServingReplica(
                replica_id=r.id,
                node_id=r.node_id,
                deployment=name,
                model=canary.model,
                canary=True,
                routing=dep.routing,
                serves=served,
                keeps_responses=keeps,
            )
            for r in ready
        ]
        if ready and _gate_passed(desired, name, canary):
            weight = max(weight, canary.weight)
    return ServingSet(model=model, replicas=replicas or draining, canary_weight=weight, deployments=names)


def _gate_passed(desired: Desired, name: str, canary: Canary) -> bool:
    """Whether deployment `name`'s canary has no suite gate or passed it (False once its version is gone)."""
    try:
        return canarysuite.unmet(desired.models, name, canary) is None
    except NotFound:
        return False


def _canary_alone(desired: Desired, model: ModelRef, name: str) -> ServingSet:
    """Deployment `name`'s Ready canary replicas of `model`, as the only ones (a canary's suite run)."""
    entry = desired.entries.get(name)
    canary = entry.deployment.canary if entry is not None else None
    if entry is None or canary is None or canary.model != model:
        return ServingSet(model=model, replicas=[])
    replicas = [
        ServingReplica(
            replica_id=r.id,
            node_id=r.node_id,
            deployment=name,
            model=model,
            canary=True,  # metered as the canary's (its watcher counts them); the only ones, so always chosen
            routing=entry.deployment.routing,
        )
        for r in canary.placed
        if desired.routable(r)
    ]
    return ServingSet(model=model, replicas=replicas, deployments=[name])


def _rollout_alone(desired: Desired, model: ModelRef, name: str) -> ServingSet:
    """The Ready new replicas of deployment `name`'s rollout, as the only ones (a suite gate's run)."""
    entry = desired.entries.get(name)
    dep = entry.deployment if entry is not None else None
    if dep is None or dep.rollout is None or dep.model != model:
        return ServingSet(model=model, replicas=[])
    served = _served(desired, dep)
    replicas = [
        ServingReplica(
            replica_id=r.id, node_id=r.node_id, deployment=name, model=model, routing=dep.routing, serves=served
        )
        for r in dep.placed
        if is_current(dep, r) and desired.routable(r)
    ]
    return ServingSet(model=model, replicas=replicas, deployments=[name])


def _served(desired: Desired, dep: Deployment) -> frozenset[Capability]:
    """The gated capabilities `dep`'s runtime serves, as its adapter records them (none when the
    runtime is no longer registered)."""
    try:
        runtime = desired.models.runtime(dep.runtime)
    except NotFound:
        return frozenset()
    options = dep.options
    return frozenset(
        c
        for c in Capability
        if c.gated
        and adapters.serves(runtime.kind, options.settings, c, command=options.command, version=runtime.version)
    )


def _keeps_responses(desired: Desired, dep: Deployment) -> bool:
    """Whether `dep`'s runtime keeps Responses API responses (its settings or env; none when the
    runtime is no longer registered)."""
    try:
        runtime = desired.models.runtime(dep.runtime)
    except NotFound:
        return False
    return adapters.keeps_responses(runtime.kind, dep.options.settings, env=dep.options.env)


def view(desired: Desired, e: Entry) -> DeploymentView:
    dep = e.deployment
    new = sum(1 for r in dep.placed if is_current(dep, r)) if dep.rollout else 0
    return DeploymentView(
        deployment=dep,
        ready_to_run=len(dep.placed),
        problem=e.problem,
        ready=sum(1 for r in dep.placed if desired.ready(r)),
        canary_ready=sum(1 for r in dep.canary.placed if desired.ready(r)) if dep.canary else 0,
        rollout_new=new,
        rollout_old=len(dep.placed) - new if dep.rollout else 0,
        groups=[
            group_status(desired, r, canary)
            for replicas, canary in ((dep.placed, False), (dep.canary.placed if dep.canary else [], True))
            for r in replicas
            if r.members
        ],
    )


def group_status(desired: Desired, r: Replica, canary: bool) -> GroupStatus:
    """Where a group replica stands: its run's phase (`grouprun`; on a controller that does not
    lead, the leader's as the store holds it) and each member's reported state."""
    shown = desired.groups.shown(r)
    states = desired.groups.member_states(r)
    return GroupStatus(
        replica_id=r.id,
        state=shown[0] if shown is not None else GROUP_PENDING,
        detail=shown[1] if shown is not None else "",
        canary=canary,
        members=[GroupMemberStatus(rank=m.rank, node_id=m.node_id, state=states[m.rank]) for m in r.members],
    )
