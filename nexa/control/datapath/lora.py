"""Requests for an alias that serves a LoRA adapter on its base (`AliasRecord.adapter`): they go to
Ready replicas of the base whose signed assignment gives them the adapter (`RuntimeSpec.loras`,
named by the alias), and the node's relay names the adapter to the runtime as that runtime expects
(`nexa.node.lora`). A replica placed before the alias served the adapter does not have it: while
no replica has it, the request is `NoReadyReplica` (503, retryable), saying so.
"""

from __future__ import annotations

import attrs

from nexa.contracts.deployments import ServingSet
from nexa.contracts.models import ModelRef
from nexa.control.deployments.desired import Desired
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


def with_lora(desired: Desired, serving: ServingSet, alias: str, asked: str) -> ServingSet:
    """The replicas of `serving` whose assignment loads the adapter `alias` serves; NoReadyReplica
    when none does (`asked`: the name the client used)."""
    have = []
    for replica in serving.replicas:
        try:
            assignments = desired.fleet.get(replica.node_id).desired.assignments
        except NexaError:
            continue
        spec = next((a.runtime for a in assignments if a.id == replica.replica_id), None)
        if spec is not None and any(lora.name == alias for lora in spec.loras):
            have.append(replica)
    if not have and serving.replicas:
        raise NoReadyReplica(
            f"no Ready replica of {serving.model.key} loads the LoRA adapter {asked!r} serves: replicas placed "
            "before the alias served it, or on a runtime that loads no adapters (llama-server, vLLM, SGLang and "
            "sim do); scale the deployment or create it again to give new replicas the adapter"
        )
    return attrs.evolve(serving, replicas=have)
