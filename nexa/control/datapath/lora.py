"""Requests for an alias that serves a LoRA adapter on its base (`AliasRecord.adapter`): they go to
Ready replicas of the base whose signed assignment gives them the adapter (`RuntimeSpec.loras`,
named by the alias), and the node's relay names the adapter to the runtime as that runtime expects
(`nexa.node.lora`).

A new adapter, or a new version of one, reaches a deployment's replicas by a rollout under watch
(`reconciler`, reason `adapter`): while it rolls, the replicas already started with the alias's
adapter version take its requests, and until one of them is Ready the replicas still loading the
earlier version do, so no request fails for the change; each request is metered as the version
that answered it. A rollout that breaks the objectives is reverted (the earlier version serves on).
While no replica loads the adapter at all, the request is `NoReadyReplica` (503, retryable).
"""

from __future__ import annotations

import attrs

from nexa.contracts.deployments import ServingReplica, ServingSet
from nexa.contracts.models import ModelRef
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import all_replicas, loras_of
from nexa.control.registry.models import ModelRegistry
from nexa.errors import NexaError, NoReadyReplica


def adapter_of(models: ModelRegistry, alias: str) -> ModelRef | None:
    """The LoRA adapter alias `alias` serves on its model now; None for none (or no alias)."""
    if not alias:
        return None
    try:
        record, _ = models.alias(alias)
    except NexaError:
        return None
    return record.adapter


def with_lora(
    desired: Desired, serving: ServingSet, alias: str, asked: str, adapter: ModelRef
) -> tuple[ServingSet, dict[str, ModelRef]]:
    """The replicas of `serving` whose assignment loads the adapter `alias` serves, and by replica id
    the adapter version each loads (`adapter`, the alias's now, unless the replica was started with
    another: an old replica while its deployment rolls to `adapter`, or all of them after a revert);
    NoReadyReplica when none loads it (`asked`: the name the client used)."""
    have: list[ServingReplica] = []
    versions: dict[str, ModelRef] = {}
    for replica in serving.replicas:
        try:
            node = desired.fleet.get(replica.node_id)
            entry = desired.entry(replica.deployment)
        except NexaError:
            continue
        spec = next((a.runtime for a in node.desired.assignments if a.id == replica.replica_id), None)
        if spec is None or not any(lora.name == alias for lora in spec.loras):
            continue
        dep = entry.deployment
        record = next((r for r in all_replicas(dep) if r.id == replica.replica_id), None)
        # A canary's replicas load what the registry served when they started: the alias's now.
        pinned = loras_of(dep, record) if record is not None and not replica.canary else {}
        versions[replica.replica_id] = pinned.get(alias, adapter)
        have.append(replica)
    if not have and serving.replicas:
        raise NoReadyReplica(
            f"no Ready replica of {serving.model.key} loads the LoRA adapter {asked!r} serves: its deployments "
            "are rolling their replicas to it, or run a runtime that loads no adapters (llama-server, vLLM, "
            "SGLang and sim do); see `nexa deployments rollout status`"
        )
    return attrs.evolve(serving, replicas=have), versions
