"""The checks a deployment change passes before anything is placed, and the explanation of a
placement that does not fit. Each refusal is a typed error (`nexa.errors`) and changes nothing."""

from __future__ import annotations

import time
from typing import Final

from nexa import adapters
from nexa.contracts.deployments import Deployment, DeploymentCreate, deployment_problems
from nexa.contracts.models import ModelRecord, ModelRef, ModelState, RuntimeRecord
from nexa.contracts.placement import MemoryShare, PlacementDecision
from nexa.control.deployments.scheduler import limit_detail
from nexa.control.registry.models import ModelRegistry
from nexa.errors import (
    ContractError,
    DeployLicenseInvalid,
    DeployModelNotApproved,
    DeployModelUnknown,
    DeployRuntimeUnknown,
    MemoryOverReservation,
    NotFound,
    RolloutInProgress,
    RuntimeFlagOwned,
)

#: How many nodes an Unplaceable message explains one by one.
_EXPLAIN_NODES: Final = 20


def check_shape(req: DeploymentCreate) -> None:
    problems = deployment_problems(req)
    if problems:
        raise ContractError("invalid deployment: " + "; ".join(problems), problems=tuple(problems))


def check_settings(req: DeploymentCreate, runtime: RuntimeRecord, model: ModelRecord | None = None) -> None:
    """Raise ContractError (400) listing every problem of the request's runtime settings for the
    runtime's adapter: an unknown option, a value of the wrong type or out of range, a GPU
    server without accelerators, extra_args of the wrong shape, a setting naming a file `model`
    does not have (a chat template of its directory); then RuntimeFlagOwned (422) naming each
    flag of `options.extra_args` that nexa owns."""
    options = req.options
    problems = adapters.settings_problems(
        runtime.kind,
        options.settings,
        accelerators=req.resources.accelerators,
        command=options.command,
        extra_args=options.extra_args,
        nodes=req.nodes_per_replica,
    )
    if not problems and model is not None:
        files = [f.path for f in model.artifact.files] if model.artifact.files else None
        problems = adapters.model_file_problems(runtime.kind, options.settings, files)
    if problems:
        raise ContractError(
            f"invalid runtime options for {runtime.name} ({runtime.kind}): " + "; ".join(problems),
            problems=tuple(problems),
        )
    refused = adapters.extra_args_refusals(runtime.kind, options.settings, options.extra_args)
    if refused:
        raise RuntimeFlagOwned(
            f"options.extra_args for {runtime.name} ({runtime.kind}) gives flags nexa owns: " + "; ".join(refused),
            flags=tuple(r.partition(":")[0] for r in refused),
        )


def check_memory_limits(req: DeploymentCreate, decision: PlacementDecision) -> None:
    """Raise MemoryOverReservation (422) when the operator set the runtime's memory setting and,
    on a unified-memory node that passes every other filter, it would claim more of the pool
    than the deployment reserves (such a node fails placement's memory filter for it; this
    refuses the setting outright instead of quietly placing around it)."""
    for e in decision.explanations:
        limit = e.runtime_memory
        if limit is None or limit.derived or limit.fits:
            continue
        if any(not f.passed and f.name != "memory" for f in e.filters):
            continue
        overhead = " plus the engine's overhead" if limit.share_of is MemoryShare.CONTEXT else ""
        raise MemoryOverReservation(
            f"deployment {req.name} cannot run on node {e.node_id}: {limit_detail(limit)} for each replica "
            f"({limit.claim_bytes} bytes > {limit.reserved_bytes}; the reservation is resources.memory_bytes, "
            f"else the model's memory_bytes{overhead}); lower settings.{limit.setting}, or leave it out to have it "
            "derived from the reservation",
            setting=limit.setting,
            node_id=e.node_id,
        )


def not_rolling(dep: Deployment) -> None:
    if dep.canary is not None:
        raise RolloutInProgress(f"deployment {dep.name} runs a canary of {dep.canary.model.key} already")
    if dep.rollout is not None:
        raise RolloutInProgress(
            f"deployment {dep.name} is rolling out {dep.rollout.from_.key} -> {dep.rollout.to.key}; wait for it"
        )


def explain(decision: PlacementDecision) -> str:
    """The decision's reason, then each node that failed a filter with what it failed."""
    lines = [decision.reason or "no placement fits"]
    failing = [e for e in decision.explanations if not e.eligible]
    for e in failing[:_EXPLAIN_NODES]:
        failed = "; ".join(f"{f.name}: {f.detail}" for f in e.filters if not f.passed)
        lines.append(f"{e.node_id}: {failed}")
    if len(failing) > _EXPLAIN_NODES:
        lines.append(f"... and {len(failing) - _EXPLAIN_NODES} more node(s)")
    return "\n".join(lines)


def runtime_of(models: ModelRegistry, name: str) -> RuntimeRecord:
    try:
        return models.runtime(name)
    except NotFound:
        raise DeployRuntimeUnknown(f"no runtime {name} is registered (with a checked digest)") from None


def deployable_model(models: ModelRegistry, ref: ModelRef) -> ModelRecord:
    """The model version if it may run now (Approved, licence valid), else a typed 422 naming why not."""
    try:
        model = models.model(ref.model, ref.version)
    except NotFound:
        raise DeployModelUnknown(f"no model {ref.model}@{ref.version}") from None
    if model.state is not ModelState.APPROVED:
        raise DeployModelNotApproved(f"model {model.key} is {model.state.value}; only Approved models are deployed")
    problem = "it has no licence record" if model.license is None else model.license.problem_at(time.time())
    if problem is not None:
        raise DeployLicenseInvalid(f"model {model.key} cannot be deployed: {problem}")
    return model


def deployable(
    models: ModelRegistry, req: DeploymentCreate | Deployment
) -> tuple[ModelRecord, RuntimeRecord, ModelRef]:
    """The model and runtime a deployment would run, or a typed 422 naming why not."""
    runtime = runtime_of(models, req.runtime)
    if isinstance(req, DeploymentCreate) and req.alias is not None:
        try:
            alias, _ = models.alias(req.alias)
        except NotFound:
            raise DeployModelUnknown(f"no alias {req.alias}") from None
        ref = alias.target
    else:
        assert req.model is not None
        ref = req.model
    return deployable_model(models, ref), runtime, ref
