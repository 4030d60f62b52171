"""Requests for an alias that serves a LoRA adapter on its base (`AliasRecord.adapter`): they go to
Ready replicas of the base whose signed assignment gives them the adapter, and the node's relay
names the adapter to the runtime as that runtime expects (`nexa.node.lora`).

A runtime that loads adapters at start (llama-server, SGLang) has them in its spec
(`RuntimeSpec.loras`, named by the alias): a new version reaches a deployment's replicas by a
rollout under watch that replaces them (`reconciler`, reason `adapter`). While it rolls, the
replicas already started with the alias's adapter version take its requests, and until one of
them is Ready the replicas still loading the earlier version do, so no request fails for the
change; each request is metered as the version that answered it.

A runtime that loads them at run time (vLLM, sim, SGLang with its pool's shape set) has them in the
assignment (`Assignment.loras`, named `<alias>@<version>`), and a new version is a canary on the
same replicas (`Rollout.in_place`): they are given both versions, and each request for a moved
alias draws the new one with the policy's `adapter_weight`, the earlier one otherwise; an attempt
on the new version that failed before any output is retried on the earlier one. A breach gives
every request back to the earlier version; a pass lets it go.

While no replica loads the adapter at all, the request is `NoReadyReplica` (503, retryable).
"""

from __future__ import annotations

import attrs

from nexa.contracts.deployments import Deployment, RolloutPolicy, ServingReplica, ServingSet
from nexa.contracts.models import ModelRef
from nexa.contracts.wire import Assignment
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import all_replicas, loras_of
from nexa.control.registry.models import ModelRegistry
from nexa.errors import NexaError, NoReadyReplica


@attrs.frozen(kw_only=True)
class LoraRoute:
    """How one replica serves an alias's adapter: the version (and the name the runtime knows it
    by) a request gets, and while an adapter rollout in place soaks, the new version it may draw."""

    version: ModelRef
    name: str
    #: The new version and its name, drawn with `weight` (`Rollout.in_place`); None: none.
    canary: tuple[ModelRef, str] | None = None
    weight: float = 0.0

    def pick(self, draw: float, *, canary_failed: bool) -> tuple[ModelRef, str, bool]:
        """The version, its name and whether it is the new one, for a request's `draw` in [0, 1)."""
        if self.canary is not None and not canary_failed and draw < self.weight:
            return self.canary[0], self.canary[1], True
        return self.version, self.name, False


def adapter_of(models: ModelRegistry, alias: str) -> ModelRef | None:
    """The LoRA adapter alias `alias` serves on its model now; None for none (or no alias)."""
    if not alias:
        return None
    try:
        record, _ = models.alias(alias)
    except NexaError:
        return None
    return record.adapter


def live_name(alias: str, ref: ModelRef) -> str:
    """The name a runtime that loads adapters at run time knows an alias's adapter version by."""
    return f"{alias}@{ref.version}"


def with_lora(
    desired: Desired, serving: ServingSet, alias: str, asked: str, adapter: ModelRef
) -> tuple[ServingSet, dict[str, LoraRoute]]:
    """The replicas of `serving` whose assignment gives them the adapter `alias` serves, and by
    replica id how each serves it (`adapter`, the alias's now, unless the replica was started with
    another: an old replica while its deployment rolls to `adapter`, or all of them after a revert;
    on replicas that load at run time, both versions while an adapter rollout in place soaks);
    NoReadyReplica when none has it (`asked`: the name the client used)."""
    have: list[ServingReplica] = []
    routes: dict[str, LoraRoute] = {}
    for replica in serving.replicas:
        try:
            node = desired.fleet.get(replica.node_id)
            entry = desired.entry(replica.deployment)
        except NexaError:
            continue
        given = next((a for a in node.desired.assignments if a.id == replica.replica_id), None)
        if given is None:
            continue
        dep = entry.deployment
        if given.runtime.live_loras:
            route = _live_route(given, dep, alias, adapter, canary_replica=replica.canary)
        elif any(lora.name == alias for lora in given.runtime.loras):
            record = next((r for r in all_replicas(dep) if r.id == replica.replica_id), None)
            # A canary's replicas load what the registry served when they started: the alias's now.
            pinned = loras_of(dep, record) if record is not None and not replica.canary else {}
            route = LoraRoute(version=pinned.get(alias, adapter), name=alias)
        else:
            route = None
        if route is not None:
            routes[replica.replica_id] = route
            have.append(replica)
    if not have and serving.replicas:
        raise NoReadyReplica(
            f"no Ready replica of {serving.model.key} loads the LoRA adapter {asked!r} serves: its deployments "
            "are rolling their replicas to it, or run a runtime that loads no adapters (llama-server, vLLM, "
            "SGLang and sim do); see `nexa deployments rollout status`"
        )
    return attrs.evolve(serving, replicas=have), routes


def _live_route(
    given: Assignment, dep: Deployment, alias: str, adapter: ModelRef, *, canary_replica: bool
) -> LoraRoute | None:
    """How a replica that loads adapters at run time serves `alias`: the deployment's version (a
    canary replica's: the alias's now), and while an adapter rollout in place soaks, the earlier
    version with the new one drawn beside it; None when its assignment gives it neither."""
    names = {lora.name for lora in given.loras}
    now = adapter if canary_replica else dep.loras.get(alias, adapter)
    earlier = None if canary_replica else dep.moved_loras().get(alias)
    if earlier is not None and dep.rollout is not None and live_name(alias, earlier) in names:
        weight = (dep.rollout.policy or RolloutPolicy()).adapter_weight
        new = (now, live_name(alias, now)) if live_name(alias, now) in names else None
        return LoraRoute(version=earlier, name=live_name(alias, earlier), canary=new, weight=weight)
    if live_name(alias, now) in names:
        return LoraRoute(version=now, name=live_name(alias, now))
    return None
