"""Evaluation replicas: one short-lived replica of a model version, Approved or not, that clients
cannot reach (`contracts.deployments.EvalBinding` says how it is hidden; `views.serving` leaves it
out of every alias and pinned version, and `served_to` hands it only to its evaluation's key).

It is a deployment like any other on the nodes (placed, signed, reconciled, in `deployments list`),
named `EVAL_PREFIX` plus a random part, created and removed here under the deployments' lock, each
change audited (`eval.replica.start`, `eval.replica.stop`). The version must be Verified at least
(the controller checked its artifact) and its licence valid now; the replica runs like an existing
deployment (`like`) or on a runtime given.
"""

from __future__ import annotations

import secrets
import time

import attrs

from nexa.contracts.deployments import (
    CANARY_EVAL_PREFIX,
    EVAL_PREFIX,
    ROLLOUT_EVAL_PREFIX,
    Deployment,
    DeploymentCreate,
    EvalBinding,
)
from nexa.contracts.domain import Actor
from nexa.contracts.evals import EvalReplicaCreate
from nexa.contracts.models import ModelRecord, ModelRef, ModelState
from nexa.control.deployments.checks import check_memory_limits, check_settings, check_shape, explain, runtime_of
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import Entry, new_replicas
from nexa.control.deployments.scheduler import place
from nexa.errors import (
    ContractError,
    DeployLicenseInvalid,
    DeployModelUnknown,
    DeployModelUnverified,
    Forbidden,
    ModelNotServed,
    NotFound,
    Unplaceable,
)

#: The states a version may be evaluated in: its artifact checked by the controller.
_EVALUABLE = frozenset({ModelState.VERIFIED, ModelState.EVALUATED, ModelState.APPROVED})


def evaluable_model(desired: Desired, ref: ModelRef) -> ModelRecord:
    """The version if an evaluation replica of it may run now, else a typed 422 naming why not."""
    try:
        model = desired.models.model(ref.model, ref.version)
    except NotFound:
        raise DeployModelUnknown(
            f"no model {ref.model}@{ref.version}: `nexa models list` shows the registered versions"
        ) from None
    if model.state not in _EVALUABLE:
        raise DeployModelUnverified(
            f"model {model.key} is {model.state.value}: only a Verified, Evaluated or Approved version is "
            f"evaluated (run `nexa models verify {ref.model} {ref.version}` first)"
        )
    problem = "it has no licence record" if model.license is None else model.license.problem_at(time.time())
    if problem is not None:
        raise DeployLicenseInvalid(f"model {model.key} cannot run for an evaluation: {problem}")
    return model


def _spec(desired: Desired, name: str, req: EvalReplicaCreate) -> DeploymentCreate:
    """The deployment the replica is: like `req.like` (its runtime, resources, options, placement),
    else on `req.runtime`; one replica of `req.model`, no alias."""
    if (req.like is None) == (req.runtime is None):
        raise ContractError(
            "give exactly one of like (a deployment to run like) and runtime", problems=("like, runtime: one",)
        )
    if req.like is not None:
        try:
            like = desired.entry(req.like).deployment
        except NotFound:
            raise NotFound(f"no deployment {req.like} (like): `nexa deployments list` shows them") from None
        return DeploymentCreate(
            name=name,
            runtime=like.runtime,
            model=req.model,
            resources=like.resources,
            options=like.options,
            placement=like.placement,
            nodes_per_replica=like.nodes_per_replica,
        )
    assert req.runtime is not None
    return DeploymentCreate(
        name=name, runtime=req.runtime, model=req.model, resources=req.resources, options=req.options
    )


async def start(desired: Desired, actor: Actor, req: EvalReplicaCreate) -> Deployment:
    """Place one evaluation replica of `req.model` (see the module docstring), or refuse with a
    typed error changing nothing: 404 `like` unknown, 422 the version or runtime may not run, or
    it does not fit."""
    name = EVAL_PREFIX + secrets.token_hex(6)
    spec = _spec(desired, name, req)
    # `check_shape` without the reserved-name rule: the name is reserved for this very replica.
    check_shape(attrs.evolve(spec, name=spec.name.removeprefix(EVAL_PREFIX)))
    async with desired.lock:
        model = evaluable_model(desired, req.model)
        runtime = runtime_of(desired.models, spec.runtime)
        check_settings(spec, runtime, model)
        decision = place(desired.snapshot(), desired.request(spec, model, runtime, 1))
        check_memory_limits(spec, decision)
        if not decision.feasible:
            raise Unplaceable(f"the evaluation replica of {model.key} cannot be placed: " + explain(decision))
        now = time.time()
        binding = EvalBinding(job=req.job, key_id=req.key_id, suite=req.suite, expires_at=now + req.ttl_s)
        dep = Deployment(
            name=name,
            runtime=spec.runtime,
            alias=None,
            model=req.model,
            replicas=1,
            resources=spec.resources,
            options=spec.options,
            placement=spec.placement,
            created_at=now,
            created_by=actor.key_id,
            updated_at=now,
            placed=new_replicas(name, decision, req.model),
            nodes_per_replica=spec.nodes_per_replica,
            eval=binding,
        )
        detail = f"{model.key} for suite {req.suite}, job {req.job}, served only to key {req.key_id}"
        await desired.commit(actor, "eval.replica.start", None, Entry(dep, decision), detail=detail)
    return dep


async def stop(desired: Desired, actor: Actor, name: str, why: str) -> Deployment | None:
    """Remove evaluation replica `name`; None when it is gone already (or is not one)."""
    async with desired.lock:
        entry = desired.entries.get(name)
        if entry is None or entry.deployment.eval is None:
            return None
        await desired.commit(actor, "eval.replica.stop", entry, None, detail=f"{entry.deployment.model.key}: {why}")
    return entry.deployment


def bound(desired: Desired) -> list[Deployment]:
    """Every evaluation replica now."""
    return [e.deployment for _, e in sorted(desired.entries.items()) if e.deployment.eval is not None]


def served_to(desired: Desired, name: str, key_id: str) -> ModelRef:
    """The version evaluation replica `name` runs, for a request authenticated by `key_id`:
    404 when there is no such replica, 403 for any other key than its evaluation's.

    `CANARY_EVAL_PREFIX` + D names deployment D's canary replicas alone (a canary's suite run):
    the canary's version, for any key (an operator's run uses an inference key; a client that names
    it asks for the canary on purpose, also while a suite gate holds its share of the alias at 0).
    `ROLLOUT_EVAL_PREFIX` + D names the new replicas of D's rollout alone (a suite gate's run): the
    version D serves, for any key, while a rollout runs."""
    if name.startswith(ROLLOUT_EVAL_PREFIX):
        deployment = name.removeprefix(ROLLOUT_EVAL_PREFIX)
        found = desired.entries.get(deployment)
        if found is None or found.deployment.rollout is None:
            raise ModelNotServed(f"deployment {deployment!r} has no rollout in progress")
        return found.deployment.model
    if name.startswith(CANARY_EVAL_PREFIX):
        deployment = name.removeprefix(CANARY_EVAL_PREFIX)
        found = desired.entries.get(deployment)
        if found is None or found.deployment.canary is None:
            raise ModelNotServed(f"deployment {deployment!r} runs no canary")
        return found.deployment.canary.model
    entry = desired.entries.get(name)
    if entry is None or entry.deployment.eval is None:
        raise ModelNotServed(f"no evaluation replica {name!r} runs (its evaluation ended)")
    if entry.deployment.eval.key_id != key_id:
        raise Forbidden(f"{name!r} is an evaluation replica: only its evaluation's key may call it")
    return entry.deployment.model
