"""Deployment records: what an operator asks to run, what the controller keeps, what the API shows.

Pure data and validation; no I/O. A deployment's name is its id. It names its model either by
alias (resolved once, when the deployment is created) or by a pinned version, and its runtime by
the name it was registered under. `control/deployments.py` validates a request against the model
registry and the fleet, places it (`control/scheduler.py`) and keeps the result.
"""

from __future__ import annotations

from typing import Final

import attrs

from nexa.contracts.models import ModelRef, name_problem, version_problem
from nexa.contracts.node import DataClassName, LabelKey, LabelValue, data_class_problem
from nexa.contracts.placement import PlacementDecision, PlacementPolicy

#: The most replicas one deployment may ask for.
MAX_REPLICAS: Final = 256


@attrs.frozen(kw_only=True)
class Resources:
    """What each replica is given."""

    #: Discrete GPUs (exclusive) or shared unified-memory GPUs; 0 runs on the host's memory.
    accelerators: int = 0
    #: Memory reserved per replica; None: the model's own `memory_bytes`.
    memory_bytes: int | None = None
    cpus: float = 1.0


@attrs.frozen(kw_only=True)
class RuntimeOptions:
    """How each replica's container is started (the runtime adapters of a later issue refine this)."""

    #: The first loopback port to try; each replica on a node gets the lowest port from here not in use there.
    port: int = 18000
    command: list[str] = attrs.Factory(list)
    #: Plain settings only, never secrets (the node agent refuses known secret names).
    env: dict[str, str] = attrs.Factory(dict)
    #: The node agent's readiness probe, run inside the container; empty: `true`.
    health_command: list[str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class PlacementSpec:
    policy: PlacementPolicy = PlacementPolicy.SPREAD
    #: Labels every chosen node must carry with exactly these values.
    node_selector: dict[LabelKey, LabelValue] = attrs.Factory(dict)
    #: Data classes every chosen node must be allowed to process.
    data_classes: list[DataClassName] = attrs.Factory(list)
    #: `amd64` or `arm64`; None: any.
    arch: str | None = None
    #: Taint keys tolerated.
    tolerations: list[LabelKey] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class DeploymentCreate:
    """A deployment to create, or (for `POST /api/v1/capacity/forecast`) one to try."""

    name: str
    runtime: str
    #: Exactly one of `alias` and `model`.
    alias: str | None = None
    model: ModelRef | None = None
    replicas: int = 1
    resources: Resources = Resources()
    options: RuntimeOptions = RuntimeOptions()
    placement: PlacementSpec = PlacementSpec()


@attrs.frozen(kw_only=True)
class ScaleRequest:
    replicas: int


@attrs.frozen(kw_only=True)
class Replica:
    """One replica of a deployment on one node: the id of its assignment there, and its GPUs."""

    id: str
    node_id: str
    gpus: list[str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class Deployment:
    """A deployment as the controller keeps it (desired state plus where its replicas are)."""

    name: str
    runtime: str
    #: The alias it was created from, if any; `model` is what that alias pointed at then.
    alias: str | None
    model: ModelRef
    replicas: int
    resources: Resources
    options: RuntimeOptions
    placement: PlacementSpec
    created_at: float
    created_by: str | None
    updated_at: float
    #: Bumped on every change of the record (scale, re-placement).
    generation: int = 1
    placed: list[Replica] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class ServingReplica:
    """One replica the gateway may route to: Ready on a Ready node (see `Deployments.serving`)."""

    replica_id: str
    node_id: str
    deployment: str
    model: ModelRef
    #: Serves the deployment's canary version (gets the canary's share of traffic).
    canary: bool = False


@attrs.frozen(kw_only=True)
class ServingSet:
    """Where requests for one alias (or pinned version) may go now."""

    #: The model version the alias points at (what stable replicas serve).
    model: ModelRef
    replicas: list[ServingReplica]
    #: Share of requests (0..1) for canary replicas while a canary runs; 0 otherwise.
    canary_weight: float = 0.0
    #: Deployments serving it, Ready or not (empty: nothing deployed at all).
    deployments: list[str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class DeploymentView:
    deployment: Deployment
    #: Replicas placed now; fewer than `deployment.replicas` while nodes cannot take the rest.
    ready_to_run: int
    #: Why the last placement attempt fell short; None when every replica is placed.
    problem: str | None = None


@attrs.frozen(kw_only=True)
class DeploymentList:
    deployments: list[DeploymentView]


@attrs.frozen(kw_only=True)
class PlacementView:
    """`GET /api/v1/deployments/{id}/placement`: the last decision taken for the deployment."""

    deployment: str
    decision: PlacementDecision | None


def deployment_problems(req: DeploymentCreate) -> list[str]:
    """Everything wrong with a request's shape (not whether the registry or the fleet allow it)."""
    problems = [p for p in (name_problem("name", req.name), name_problem("runtime", req.runtime)) if p]
    if (req.alias is None) == (req.model is None):
        problems.append("alias, model: give exactly one (an alias, or a pinned model version)")
    if req.alias is not None and (p := name_problem("alias", req.alias)):
        problems.append(p)
    if req.model is not None:
        problems += [
            p
            for p in (name_problem("model.model", req.model.model), version_problem("model.version", req.model.version))
            if p
        ]
    if not 1 <= req.replicas <= MAX_REPLICAS:
        problems.append(f"replicas: from 1 to {MAX_REPLICAS}")
    r = req.resources
    if r.accelerators < 0:
        problems.append("resources.accelerators: 0 or more")
    if r.memory_bytes is not None and r.memory_bytes <= 0:
        problems.append("resources.memory_bytes: a positive number of bytes")
    if not r.cpus > 0:
        problems.append("resources.cpus: more than 0")
    if not 1 <= req.options.port <= 65535:
        problems.append("options.port: from 1 to 65535")
    problems += [f"placement.data_classes: {p}" for d in req.placement.data_classes if (p := data_class_problem(d))]
    return problems
