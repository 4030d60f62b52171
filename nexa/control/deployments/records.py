"""A deployment's record as it changes: its in-memory entry, new replicas, and the pure steps
(`follow` a new version, `bump` a generation) that every change is built from."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterable

import attrs

from nexa.contracts.deployments import (
    Deployment,
    Replica,
    ReplicaMember,
    ReplicaSpec,
    Rollout,
    RolloutPolicy,
    RolloutStep,
    RuntimeOptions,
)
from nexa.contracts.models import ModelRef
from nexa.contracts.placement import PlacementDecision


@attrs.define
class Entry:
    """One deployment in memory: its record, the placement decision kept for it, and why it is
    not fully placed (`DeploymentView.problem`), if it is not."""

    deployment: Deployment
    decision: PlacementDecision | None
    problem: str | None = None


def new_replica(deployment: str, node_id: str, gpus: Iterable[str], model: ModelRef) -> Replica:
    return Replica(id=f"{deployment}-{secrets.token_hex(4)}", node_id=node_id, gpus=list(gpus), model=model)


def new_replicas(deployment: str, decision: PlacementDecision, model: ModelRef) -> list[Replica]:
    """The replicas a feasible decision placed: one per placement, or for a group replica
    (placements sharing a `replica` index, one per rank) one whose `members` are its ranks,
    rank 0 (the head) giving its node and GPUs."""
    if decision.request.nodes_per_replica <= 1:
        return [new_replica(deployment, p.node_id, p.gpus, model) for p in decision.placements]
    ranks: dict[int, list[ReplicaMember]] = {}
    for p in decision.placements:
        ranks.setdefault(p.replica, []).append(ReplicaMember(rank=p.rank, node_id=p.node_id, gpus=list(p.gpus)))
    out = []
    for _, members in sorted(ranks.items()):
        members.sort(key=lambda m: m.rank)
        head = new_replica(deployment, members[0].node_id, members[0].gpus, model)
        out.append(attrs.evolve(head, members=members))
    return out


def replica_nodes(replicas: Iterable[Replica]) -> list[str]:
    """Every node the replicas run on, once per replica on it (what spread counts)."""
    return [n for r in replicas for n in r.node_ids]


def model_of(dep: Deployment, replica: Replica) -> ModelRef:
    return replica.model or dep.model


def canary_placed(dep: Deployment) -> list[Replica]:
    return list(dep.canary.placed) if dep.canary is not None else []


def all_replicas(dep: Deployment) -> list[Replica]:
    return dep.placed + canary_placed(dep)


def stamped(dep: Deployment) -> Deployment:
    """A record from before rollouts: each replica runs the deployment's model; say so."""
    if all(r.model is not None for r in dep.placed):
        return dep
    return attrs.evolve(dep, placed=[attrs.evolve(r, model=model_of(dep, r)) for r in dep.placed])


def follow(dep: Deployment, target: ModelRef, reason: str, loras: dict[str, ModelRef] | None = None) -> Deployment:
    """The deployment switched to `target`: a rollout from what it ran (a canary of `target` merged in),
    its replicas of `target` loading `loras` (the adapters the aliases serve on it; None: none)."""
    placed, canary = dep.placed, dep.canary
    if canary is not None and canary.model == target:
        placed, canary = placed + canary.placed, None
    rollout = Rollout(
        from_=dep.model,
        to=target,
        reason=reason,
        started_at=time.time(),
        policy=dep.rollout_policy,
        good=spec_now(dep),
    )
    followed = attrs.evolve(
        dep, model=target, placed=placed, canary=canary, rollout=rollout, previous=dep.model, loras=dict(loras or {})
    )
    return bump(followed)


def with_loras(
    dep: Deployment, loras: dict[str, ModelRef], policy: RolloutPolicy, *, in_place: bool = False
) -> Deployment:
    """The deployment's replicas to load another set of LoRA adapters: a rollout of the same model
    (reason `adapter`, its first step naming the change), each replica replaced under watch by one
    started with `loras`; `in_place` (`goes_in_place`): none replaced, they load the new versions
    beside the earlier ones without a restart (`Rollout.in_place`) and stay current, and the new
    versions soak as one (`watch`) on a share of the aliases' requests before the earlier ones go."""
    detail = lora_change(dep.loras, loras) + (", in place" if in_place else "")
    rollout = Rollout(
        from_=dep.model,
        to=dep.model,
        reason="adapter",
        started_at=time.time(),
        policy=policy,
        good=spec_now(dep),
        steps=[RolloutStep(at=time.time(), what="started", detail=detail)],
        in_place=in_place,
    )
    placed = unpinned(dep) if in_place else pin_specs(dep)
    return bump(attrs.evolve(dep, placed=placed, loras=dict(loras), rollout=rollout))


def goes_in_place(dep: Deployment, loras: dict[str, ModelRef], policy: RolloutPolicy, *, live: bool) -> bool:
    """Whether the deployment goes to the adapter set `loras` on the same replicas (`with_loras`):
    its runtime loads adapters at run time (`live`; replicas on one node), the same aliases move
    to other versions (a new or a removed alias changes the runtime's flags: replaced), and its
    policy has no suite gate (a suite measures new replicas: replaced)."""
    return (
        live
        and dep.nodes_per_replica == 1
        and bool(loras)
        and loras.keys() == dep.loras.keys()
        and loras != dep.loras
        and policy.suite is None
    )


def unpinned(dep: Deployment) -> list[Replica]:
    """`dep.placed` with each current replica's spec left to the deployment's (it changes in place)."""
    return [attrs.evolve(r, spec=None) if r.spec is not None and is_current(dep, r) else r for r in dep.placed]


def given_loras(dep: Deployment) -> list[tuple[str, ModelRef]]:
    """The adapters the deployment's replicas are given, by alias: its set, and while an adapter
    rollout in place soaks, the earlier version of each moved alias too; sorted."""
    pairs = [*dep.loras.items(), *dep.moved_loras().items()]
    return sorted(pairs, key=lambda pair: (pair[0], pair[1].key))


def lora_change(before: dict[str, ModelRef], after: dict[str, ModelRef]) -> str:
    """What changes between two adapter sets, for the audit and the rollout's steps."""
    parts = []
    for alias in sorted(before.keys() | after.keys()):
        was, now = before.get(alias), after.get(alias)
        if was != now:
            parts.append(f"{alias}: {was.key if was else '-'} -> {now.key if now else '-'}")
    return "adapters " + ", ".join(parts) if parts else "adapters unchanged"


def bump(dep: Deployment) -> Deployment:
    """A changed record: one generation up, updated now."""
    return attrs.evolve(dep, generation=dep.generation + 1, updated_at=time.time())


def spec_key(runtime: str, options: RuntimeOptions, loras: dict[str, ModelRef] | None = None) -> str:
    """A replica's runtime, settings and LoRA adapters as one short digest (`Replica.spec`); without
    adapters, the digest replicas recorded before adapters were part of it."""
    what: dict[str, object] = {"runtime": runtime, "options": attrs.asdict(options)}
    if loras:
        what["loras"] = {alias: ref.key for alias, ref in loras.items()}
    text = json.dumps(what, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def spec_of(dep: Deployment, replica: Replica) -> str:
    """The runtime and settings `replica` runs (`spec_key`): its own record's, else the deployment's now."""
    return replica.spec if replica.spec is not None else spec_key(dep.runtime, dep.options, dep.loras)


def is_current(dep: Deployment, replica: Replica) -> bool:
    """Whether `replica` runs what the deployment asks now: its model version, runtime, settings and adapters."""
    return model_of(dep, replica) == dep.model and spec_of(dep, replica) == spec_key(
        dep.runtime, dep.options, dep.loras
    )


def spec_now(dep: Deployment) -> ReplicaSpec:
    """What the deployment's replicas are started with now."""
    return ReplicaSpec(runtime=dep.runtime, model=dep.model, options=dep.options, loras=dict(dep.loras))


def loras_of(dep: Deployment, replica: Replica) -> dict[str, ModelRef]:
    """The LoRA adapters `replica` was started with: the deployment's now when it is current, else
    (an old replica during a rollout) those of the rollout's last good spec."""
    if dep.rollout is None or is_current(dep, replica):  # no rollout: every replica runs the spec now
        return dep.loras
    good = dep.rollout.good if dep.rollout is not None else None
    if good is not None and model_of(dep, replica) == good.model:
        return good.loras
    return {}


def pin_specs(dep: Deployment) -> list[Replica]:
    """`dep.placed` with each replica's runtime and settings written down, before they change."""
    return [
        r if r.spec is not None else attrs.evolve(r, spec=spec_of(dep, r), model=model_of(dep, r)) for r in dep.placed
    ]
