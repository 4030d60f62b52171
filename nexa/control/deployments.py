"""Deployments: desired state, placement over a snapshot of the fleet, and the reconciler.

A deployment is checked against the model registry when it is created (its model Approved with
a licence valid now, its runtime registered, which means its digest was checked at the
registry), then placed with `scheduler.place` over `snapshot_from(fleet)`. A placement that
cannot take every replica is refused (422, `Unplaceable`, the message explaining each node)
and nothing starts. The decision is kept, so `GET /deployments/{id}/placement` shows it.

Each replica is one `wire.Assignment` in its node's desired set (`assignment_for` documents the
mapping). On a unified-memory node (a DGX Spark) the replica's reservation becomes the runtime's
own memory limit, and replicas there reserve together at most the pool less the configured host
headroom (`placement.unified_host_headroom_bytes`); an operator-set memory setting that would
claim more than the reservation on such a node is refused at creation (422,
`MemoryOverReservation`). A change writes the deployment, its decision and every node set it touched (each one
generation up) in one audited transaction, then pushes those sets through the node channel.

The reconciler (`run`) wakes when the fleet changes (admin actions, reachability), when an
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
version, the old replica is kept and the rollout waits, saying why.

Following the alias. A deployment created from an alias runs what the alias points at: when the
alias moves (`POST /api/v1/aliases/{name}/promote` or `/rollback`, or a deployment's promote or
rollback), every deployment created from it starts a rollout to the new target, replaced one
at a time as above (a canary of that very version is merged in first). The check compares
state, not events, so a move made while the controller was down is followed at the next start.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Final

import attrs
import trio

from nexa import adapters
from nexa.config import NodesConfig, PlacementConfig
from nexa.contracts.deployments import (
    Canary,
    CanaryCreate,
    Deployment,
    DeploymentCreate,
    DeploymentView,
    PlacementView,
    Replica,
    Rollout,
    RolloutResult,
    ServingReplica,
    ServingSet,
    canary_problems,
    deployment_problems,
)
from nexa.contracts.domain import NodeState
from nexa.contracts.models import AliasPromote, AliasReceipt, ModelRecord, ModelRef, ModelState, RuntimeRecord
from nexa.contracts.node import LabelKey, LabelValue
from nexa.contracts.placement import MemoryLimit, PlacementDecision, PlacementNode, PlacementRequest
from nexa.contracts.runtime import ArtifactRef, HealthProbe, RuntimeSpec
from nexa.contracts.wire import Assignment, DesiredAssignments, RuntimeState
from nexa.control import store as st
from nexa.control.fleet import Fleet, NodeLive
from nexa.control.models import ModelRegistry
from nexa.control.registry import SYSTEM, Actor, audit_draft
from nexa.control.scheduler import limit_detail, place
from nexa.control.southbound import Southbound
from nexa.errors import (
    AlreadyExists,
    Conflict,
    ContractError,
    DeployLicenseInvalid,
    DeployModelNotApproved,
    DeployModelUnknown,
    DeployRuntimeUnknown,
    MemoryOverReservation,
    NoCanary,
    NotDeployable,
    NotFound,
    NothingToRollBack,
    RolloutInProgress,
    Unplaceable,
)
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: The reconciler looks again this often even when nothing woke it.
_RESYNC_S: Final = 10.0
#: While a drain waits for replacements to become Ready, how often it looks.
_DRAIN_CHECK_S: Final = 1.0
#: While a rollout waits for a new replica to become Ready (or for room), how often it looks.
_ROLLOUT_CHECK_S: Final = 0.5
#: The longest audit detail a deployment change writes (figures first, node sets after).
_DETAIL_MAX: Final = 600
#: Node states whose Ready replicas take requests (cordoning stops new placements, not traffic).
_ROUTABLE: Final = frozenset({NodeState.READY, NodeState.CORDONED})
#: How many nodes an Unplaceable message explains one by one.
_EXPLAIN_NODES: Final = 20


# ---- the fleet as placement sees it -------------------------------------------------------------


def snapshot_from(
    fleet: Iterable[NodeLive], *, without: frozenset[str] = frozenset(), unified_headroom_bytes: int = 0
) -> list[PlacementNode]:
    """One `PlacementNode` per enrolled node, from its inventory and what its desired set reserves.

    Free resources are reservations, not measurements: what the node has minus what the
    replicas in its desired set were given (a replica just assigned holds its share before it
    starts, and a running one is not counted twice). Assignments whose id is in `without` are
    left out, as if already stopped (a rollout step frees one replica and places another).

    - state, labels (enrollment labels, then the inventory's), taints, data classes, runtimes,
      arch: as the node's inventory reports them. A node that never reported one has no
      runtimes and no resources, so every request fails on it, with the reason shown.
    - discrete GPUs: `free_gpus` are the CDI names no assignment holds; their memory is the
      sum of those GPUs' `memory_total_bytes`.
    - unified memory (any GPU reported `unified_memory`): every GPU stays free (shared); the
      pool is the inventory's `accelerator_memory_bytes`; what replicas may still reserve is
      that pool less `unified_headroom_bytes` (`placement.unified_host_headroom_bytes`: the
      OS, the agent and the container engine live in it too) less the memory of every
      assignment; the host pool is the same pool.
    - host memory: `memory_total_bytes` less the memory of CPU-only assignments.
    - load: assignments in the desired set; cached artifacts: none known yet (reliability 1).
    """
    out = []
    for live in fleet:
        inv = live.inventory
        assignments = [a for a in live.desired.assignments if a.id not in without]
        labels = {LabelKey(k): LabelValue(v) for k, v in live.node.labels.items()}
        if inv is None:
            out.append(PlacementNode(id=live.node.id, state=live.state, arch="", labels=labels, load=len(assignments)))
            continue
        labels.update(inv.labels)
        unified = any(g.unified_memory for g in inv.gpus)
        held = {name for a in assignments for name in a.runtime.gpus}
        reserved_all = sum(a.runtime.memory_bytes for a in assignments)
        reserved_host = sum(a.runtime.memory_bytes for a in assignments if not a.runtime.gpus)
        if unified:
            # One pool: every GPU is shared, and accelerator and host memory are the same bytes.
            free_gpus = tuple(g.cdi_device for g in inv.gpus)
            accel_total = host_total = inv.accelerator_memory_bytes
            accel_free = host_free = max(0, accel_total - unified_headroom_bytes - reserved_all)
        else:
            free = [g for g in inv.gpus if g.cdi_device not in held]
            free_gpus = tuple(g.cdi_device for g in free)
            accel_total = sum(g.memory_total_bytes or 0 for g in inv.gpus)
            accel_free = sum(g.memory_total_bytes or 0 for g in free)
            host_total = inv.memory_total_bytes
            host_free = max(0, host_total - reserved_host)
        node = PlacementNode(
            id=live.node.id,
            state=live.state,
            arch=inv.arch,
            labels=labels,
            taints=inv.taints,
            data_classes=inv.data_classes,
            runtimes=inv.runtimes,
            unified_memory=unified,
            gpu_count=len(inv.gpus),
            free_gpus=free_gpus,
            accelerator_memory_total_bytes=accel_total,
            accelerator_memory_free_bytes=accel_free,
            host_memory_total_bytes=host_total,
            host_memory_free_bytes=host_free,
            load=len(assignments),
        )
        out.append(node)
    return out


def unified_pool_bytes(live: NodeLive) -> int | None:
    """The node's unified memory pool (its GPU shares the host's memory), None when it has none."""
    inv = live.inventory
    if inv is None or not any(g.unified_memory for g in inv.gpus):
        return None
    return inv.accelerator_memory_bytes


def artifact_ref(model: ModelRecord) -> ArtifactRef:
    """What a node fetches and mounts for `model`: a manifest's files, assembled as a directory
    at `/models/<name>`; an artifact registered as one object, that object at `/models/model`
    (the reference assignments have had since the first release, so their spec hash holds)."""
    artifact = model.artifact
    if not artifact.files:
        return ArtifactRef(uri=artifact.uri, sha256=artifact.sha256, size_bytes=artifact.size_bytes)
    manifest = artifact.manifest()
    return ArtifactRef(
        uri=artifact.uri,
        sha256=artifact.sha256 or manifest.digest,
        size_bytes=artifact.size_bytes or manifest.size_bytes,
        files=list(manifest.files),
        entry=manifest.entry,
        mount_path=f"/models/{model.name}",
    )


def assignment_for(
    dep: Deployment,
    replica: Replica,
    model: ModelRecord,
    runtime: RuntimeRecord,
    port: int,
    *,
    unified_pool_bytes: int | None = None,
) -> Assignment:
    """The signed unit a node runs for one replica.

    Image and kind from the runtime record (pinned by digest); the model artifact
    (`artifact_ref`: a manifest's directory at `/models/<name>`, or one object at
    `/models/model`); memory from the deployment's resources (else the model's own figure);
    the replica's GPUs; `port` is the loopback port chosen for it on its node. The runtime
    kind's adapter (`nexa.adapters`) builds the command (the model's path, serving it under
    its registered name, bound to `{runtime_host}`), the readiness probe and /dev/shm from the
    deployment's settings; a non-empty `options.command` replaces the adapter's command and a
    non-empty `options.health_command` its probe. `sim` runs `options.command` as its flags,
    probed by `true`. The options' env is added to the adapter's.

    On a unified-memory node (`unified_pool_bytes`: its pool) the replica's memory becomes the
    runtime's own limit: the adapter's memory setting derived from the reservation and the
    pool (`_runtime_memory`), unless the operator set it.
    """
    options = dep.options
    command = list(options.command)
    env = dict(options.env)
    health = HealthProbe(command=list(options.health_command) or ["true"])
    shm_bytes = 0
    artifact = artifact_ref(model)
    if adapters.has_adapter(runtime.kind):
        adapter = adapters.adapter_for(runtime.kind, options.settings)
        limit = _memory_limit(dep, model, runtime)
        memory = None
        if limit is not None and unified_pool_bytes is not None:
            memory = limit.on(_memory(dep, model), unified_pool_bytes)
        launch = adapter.launch(
            model.name, options.settings, replica.gpus, port, model_path=artifact.model_path, memory=memory
        )
        command = command or launch.command
        env = {**launch.env, **env}
        health = HealthProbe(command=list(options.health_command)) if options.health_command else launch.health
        shm_bytes = launch.shm_bytes
    return Assignment(
        id=replica.id,
        deployment=dep.name,
        runtime=RuntimeSpec(
            kind=runtime.kind,
            image=runtime.image,
            command=command,
            env=env,
            port=port,
            artifact=artifact,
            gpus=list(replica.gpus),
            memory_bytes=_memory(dep, model),
            cpus=dep.resources.cpus,
            shm_bytes=shm_bytes,
            health=health,
            host_network=runtime.host_network,
        ),
    )


def check_settings(req: DeploymentCreate, runtime: RuntimeRecord) -> None:
    """Raise ContractError (400) listing every problem of the request's runtime settings for the
    runtime's adapter: an unknown option, a value of the wrong type or out of range, a GPU
    server without accelerators."""
    problems = adapters.settings_problems(
        runtime.kind, req.options.settings, accelerators=req.resources.accelerators, command=req.options.command
    )
    if problems:
        raise ContractError(
            f"invalid runtime options for {runtime.name} ({runtime.kind}): " + "; ".join(problems),
            problems=tuple(problems),
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
        raise MemoryOverReservation(
            f"deployment {req.name} cannot run on node {e.node_id}: {limit_detail(limit)} for each replica "
            f"({limit.claim_bytes} bytes > {limit.reserved_bytes}; the reservation is resources.memory_bytes, "
            f"else the model's memory_bytes); lower settings.{limit.setting}, or leave it out to have it "
            "derived from the reservation",
            setting=limit.setting,
            node_id=e.node_id,
        )


def _memory(dep: Deployment | DeploymentCreate, model: ModelRecord) -> int:
    return dep.resources.memory_bytes or model.memory_bytes


def _memory_limit(dep: Deployment | DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord) -> MemoryLimit | None:
    """The runtime's memory setting on unified-memory nodes; None without an adapter, or with a
    full `options.command` (the operator owns that command line, flags and all)."""
    if not adapters.has_adapter(runtime.kind) or dep.options.command:
        return None
    adapter = adapters.adapter_for(runtime.kind, dep.options.settings)
    return adapter.memory_limit(dep.options.settings, weights_bytes=model.artifact.size_bytes)


def _request(
    dep: Deployment | DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord, replicas: int
) -> PlacementRequest:
    spec = dep.placement
    return PlacementRequest(
        deployment=dep.name,
        replicas=replicas,
        runtime=runtime.kind,
        arch=spec.arch,
        image_archs=runtime.image_archs,
        memory_bytes=_memory(dep, model),
        accelerators=dep.resources.accelerators,
        artifact_sha256=model.artifact.sha256,
        data_classes=tuple(spec.data_classes),
        node_selector=dict(spec.node_selector),
        tolerations=tuple(spec.tolerations),
        policy=spec.policy,
        host_network=runtime.host_network,
        memory_limit=_memory_limit(dep, model, runtime),
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


@attrs.define
class _Entry:
    deployment: Deployment
    decision: PlacementDecision | None
    problem: str | None = None


@attrs.frozen
class _Healed:
    """What `_heal` settled for one group of replicas (the deployment's own, or its canary's)."""

    placed: list[Replica]
    #: The placement decision taken, when one was.
    decision: PlacementDecision | None
    problem: str | None
    next_at: float


class Deployments:
    """Deployments in memory (written through to the store) and the reconciler that keeps them placed."""

    def __init__(
        self,
        cfg: NodesConfig,
        store: st.Store,
        metrics: Metrics,
        fleet: Fleet,
        *,
        models: ModelRegistry,
        southbound: Southbound,
        placement: PlacementConfig | None = None,
    ) -> None:
        self._cfg = cfg
        self._placement = placement or PlacementConfig()
        self._store = store
        self._metrics = metrics
        self._fleet = fleet
        self._models = models
        self._southbound = southbound
        self._entries: dict[str, _Entry] = {}
        self._lock = trio.Lock()  # every change to deployments and node sets goes through it
        self._wake = trio.Event()
        self._started = 0.0
        fleet.on_change(self.poke)
        models.on_alias_change(self._alias_moved)

    async def load(self) -> None:
        for dep, decision in await self._store.run(st.load_deployments):
            self._entries[dep.name] = _Entry(_stamped(dep), decision)

    def poke(self) -> None:
        """Ask the reconciler to look now."""
        self._wake.set()

    def _snapshot(self, *, without: frozenset[str] = frozenset()) -> list[PlacementNode]:
        """The fleet as placement sees it now (`snapshot_from`, with the configured host headroom)."""
        return snapshot_from(
            self._fleet, without=without, unified_headroom_bytes=self._placement.unified_host_headroom_bytes
        )

    def _alias_moved(self, receipt: AliasReceipt) -> None:
        # Deployments created from the alias follow it; the reconciler compares and rolls.
        self.poke()

    # ---- queries -----------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"no deployment {name}")
        return entry

    def all(self) -> list[DeploymentView]:
        return [self._view(e) for _, e in sorted(self._entries.items())]

    def show(self, name: str) -> DeploymentView:
        return self._view(self._entry(name))

    def placement(self, name: str) -> PlacementView:
        return PlacementView(deployment=name, decision=self._entry(name).decision)

    def canaries(self) -> list[tuple[str, Canary]]:
        """Every running canary, by deployment name (what `rollout.RolloutWatcher` checks)."""
        return [(n, e.deployment.canary) for n, e in sorted(self._entries.items()) if e.deployment.canary is not None]

    def node_data_classes(self, node_id: str) -> tuple[str, ...]:
        """The data classes a node's inventory allows (`data_classes` of its inventory.json); none
        for a node that has not reported an inventory. In memory, for the gateway's routing."""
        try:
            inventory = self._fleet.get(node_id).inventory
        except NotFound:
            return ()
        return inventory.data_classes if inventory is not None else ()

    def serving(self, model: ModelRef, *, alias: str | None = None) -> ServingSet:
        """The replicas the gateway may send requests for `model` to. Read on every request: in memory, no I/O.

        Deployments of `model` (pinned, or following an alias that points there) and, when
        `alias` is given, every deployment created from it: all their replicas that their node
        reports Ready, on nodes that are Ready or Cordoned (never Unreachable or Revoked). During a
        rollout both versions' Ready replicas serve (one deployment); a deployment rolling away
        from `model` still serves its replicas of `model`. A running canary's Ready replicas come
        flagged `canary=True`, and `canary_weight` is its weight (0 while no canary replica is Ready).

        A Draining node takes no new requests while any other Ready replica serves the model. Only
        when none does (its replacements, started before it stops, are not Ready yet) do its Ready
        replicas keep serving: a drain never causes a moment without a replica that answers.
        """
        replicas: list[ServingReplica] = []
        draining: list[ServingReplica] = []
        names: list[str] = []
        weight = 0.0
        for name, entry in self._entries.items():
            dep = entry.deployment
            mine = dep.model == model or (alias is not None and dep.alias == alias)
            leaving = dep.rollout is not None and dep.rollout.from_ == model
            if not (mine or leaving):
                continue
            names.append(name)
            for r in dep.placed:
                ref = _model_of(dep, r)
                if not (mine or ref == model):
                    continue
                if self._routable(r):
                    replicas.append(ServingReplica(replica_id=r.id, node_id=r.node_id, deployment=name, model=ref))
                elif self._fleet.get(r.node_id).state is NodeState.DRAINING and self._ready(r):
                    draining.append(ServingReplica(replica_id=r.id, node_id=r.node_id, deployment=name, model=ref))
            canary = dep.canary
            if canary is None or not mine:
                continue
            ready = [r for r in canary.placed if self._routable(r)]
            replicas += [
                ServingReplica(replica_id=r.id, node_id=r.node_id, deployment=name, model=canary.model, canary=True)
                for r in ready
            ]
            if ready:
                weight = max(weight, canary.weight)
        return ServingSet(model=model, replicas=replicas or draining, canary_weight=weight, deployments=names)

    def _view(self, e: _Entry) -> DeploymentView:
        dep = e.deployment
        new = sum(1 for r in dep.placed if _model_of(dep, r) == dep.model) if dep.rollout else 0
        return DeploymentView(
            deployment=dep,
            ready_to_run=len(dep.placed),
            problem=e.problem,
            ready=sum(1 for r in dep.placed if self._ready(r)),
            canary_ready=sum(1 for r in dep.canary.placed if self._ready(r)) if dep.canary else 0,
            rollout_new=new,
            rollout_old=len(dep.placed) - new if dep.rollout else 0,
        )

    # ---- checks ------------------------------------------------------------------------------------

    def _runtime(self, name: str) -> RuntimeRecord:
        try:
            return self._models.runtime(name)
        except NotFound:
            raise DeployRuntimeUnknown(f"no runtime {name} is registered (with a checked digest)") from None

    def _deployable_model(self, ref: ModelRef) -> ModelRecord:
        """The model version if it may run now (Approved, licence valid), else a typed 422 naming why not."""
        try:
            model = self._models.model(ref.model, ref.version)
        except NotFound:
            raise DeployModelUnknown(f"no model {ref.model}@{ref.version}") from None
        if model.state is not ModelState.APPROVED:
            raise DeployModelNotApproved(f"model {model.key} is {model.state.value}; only Approved models are deployed")
        problem = "it has no licence record" if model.license is None else model.license.problem_at(time.time())
        if problem is not None:
            raise DeployLicenseInvalid(f"model {model.key} cannot be deployed: {problem}")
        return model

    def _deployable(self, req: DeploymentCreate | Deployment) -> tuple[ModelRecord, RuntimeRecord, ModelRef]:
        """The model and runtime a deployment would run, or a typed 422 naming why not."""
        runtime = self._runtime(req.runtime)
        if isinstance(req, DeploymentCreate) and req.alias is not None:
            try:
                alias, _ = self._models.alias(req.alias)
            except NotFound:
                raise DeployModelUnknown(f"no alias {req.alias}") from None
            ref = alias.target
        else:
            assert req.model is not None
            ref = req.model
        return self._deployable_model(ref), runtime, ref

    def forecast(self, req: DeploymentCreate) -> PlacementDecision:
        """Whether a hypothetical deployment fits now, and where; changes nothing."""
        _check_shape(req)
        model, runtime, _ = self._deployable(req)
        check_settings(req, runtime)
        return place(self._snapshot(), _request(req, model, runtime, req.replicas))

    # ---- changes -----------------------------------------------------------------------------------

    async def create(self, actor: Actor, req: DeploymentCreate) -> DeploymentView:
        _check_shape(req)
        async with self._lock:
            if req.name in self._entries:
                raise AlreadyExists(f"deployment {req.name} exists")
            model, runtime, ref = self._deployable(req)
            check_settings(req, runtime)
            decision = place(self._snapshot(), _request(req, model, runtime, req.replicas))
            check_memory_limits(req, decision)
            if not decision.feasible:
                raise Unplaceable(f"deployment {req.name} cannot be placed: " + explain(decision))
            now = time.time()
            dep = Deployment(
                name=req.name,
                runtime=req.runtime,
                alias=req.alias,
                model=ref,
                replicas=req.replicas,
                resources=req.resources,
                options=req.options,
                placement=req.placement,
                created_at=now,
                created_by=actor.key_id,
                updated_at=now,
                placed=[_replica(req.name, p.node_id, p.gpus, ref) for p in decision.placements],
            )
            entry = _Entry(dep, decision)
            await self._commit(actor, "deployment.create", None, entry)
        return self._view(entry)

    async def scale(self, actor: Actor, name: str, replicas: int) -> DeploymentView:
        if not 1 <= replicas <= 256:
            raise ContractError("replicas: from 1 to 256", problems=("replicas: from 1 to 256",))
        async with self._lock:
            before = self._entry(name)
            dep = before.deployment
            model, runtime, _ = self._deployable(dep)
            # The current version's replicas first, so scaling down during a rollout keeps them.
            placed = sorted(dep.placed, key=lambda r: _model_of(dep, r) != dep.model)
            decision = before.decision
            if replicas < len(placed):
                placed = placed[:replicas]
            elif replicas > len(placed):
                decision = self._place_more(dep, placed, replicas - len(placed), model, runtime)
                if not decision.feasible:
                    raise Unplaceable(f"deployment {name} cannot grow to {replicas} replicas: " + explain(decision))
                placed += [_replica(name, p.node_id, p.gpus, dep.model) for p in decision.placements]
            after = _Entry(_bump(attrs.evolve(dep, replicas=replicas, placed=placed)), decision)
            await self._commit(actor, "deployment.scale", before, after)
        return self._view(after)

    async def delete(self, actor: Actor, name: str) -> DeploymentView:
        """Remove the deployment and its replicas (a canary's too) from every node set; answers what was deleted."""
        async with self._lock:
            before = self._entry(name)
            await self._commit(actor, "deployment.delete", before, None)
        return self._view(before)

    def _place_more(
        self, dep: Deployment, kept: list[Replica], count: int, model: ModelRecord, runtime: RuntimeRecord
    ) -> PlacementDecision:
        existing = Counter(r.node_id for r in kept)
        if dep.canary is not None:
            existing.update(r.node_id for r in dep.canary.placed)
        return place(self._snapshot(), _request(dep, model, runtime, count), existing=existing)

    # ---- rollout: canary, promote, rollback --------------------------------------------------------

    async def start_canary(self, actor: Actor, name: str, req: CanaryCreate) -> DeploymentView:
        """Place `req.replicas` extra replicas of `req.model` beside the deployment's own, or refuse.

        Refused: a bad request (400); a canary or rollout already running, or the version the
        deployment runs already (409); a model that may not be deployed, or replicas that do not
        fit (422, the typed code of a new deployment). A refusal places nothing.
        """
        problems = canary_problems(req)
        if problems:
            raise ContractError("invalid canary: " + "; ".join(problems), problems=tuple(problems))
        async with self._lock:
            before = self._entry(name)
            dep = before.deployment
            _not_rolling(dep)
            if req.model == dep.model:
                raise Conflict(f"deployment {name} runs {dep.model.key} already; a canary runs another version")
            runtime = self._runtime(dep.runtime)
            model = self._deployable_model(req.model)
            existing = Counter(r.node_id for r in dep.placed)
            decision = place(self._snapshot(), _request(dep, model, runtime, req.replicas), existing=existing)
            if not decision.feasible:
                raise Unplaceable(f"the canary {model.key} of deployment {name} cannot be placed: " + explain(decision))
            canary = Canary(
                model=req.model,
                weight=req.weight,
                objective=req.objective,
                replicas=req.replicas,
                placed=[_replica(name, p.node_id, p.gpus, req.model) for p in decision.placements],
                started_at=time.time(),
                started_by=actor.key_id,
            )
            after = _Entry(_bump(attrs.evolve(dep, canary=canary)), decision)
            detail = f"canary {model.key} beside {dep.model.key}: {req.replicas} replica(s), weight {req.weight:g}"
            await self._commit(actor, "deployment.canary.start", before, after, detail=detail)
        return self._view(after)

    async def promote(self, actor: Actor, name: str) -> RolloutResult:
        """Make the canary's version the deployment's: move its alias (with the receipt), keep the
        canary's replicas as regular ones, and replace the old version's one at a time."""
        async with self._lock:
            before = self._entry(name)
            dep = before.deployment
            canary = dep.canary
            if canary is None:
                raise NoCanary(f"deployment {name} runs no canary to promote")
            receipt = None
            if dep.alias is not None:
                promotion = AliasPromote(model=canary.model.model, version=canary.model.version)
                receipt = await self._models.promote(actor, dep.alias, promotion)
            after = _Entry(_follow(dep, canary.model, "promote"), before.decision)
            detail = f"{dep.model.key} -> {canary.model.key}" + (
                f"; alias {dep.alias} generation {receipt.generation}" if receipt else ""
            )
            await self._commit(actor, "deployment.promote", before, after, detail=detail)
        self.poke()
        return RolloutResult(deployment=self._view(after), alias=receipt)

    async def rollback(self, actor: Actor, name: str) -> RolloutResult:
        """Remove a running canary; else return to the version before the last promotion (its
        alias rolled back, with the receipt), replaced one at a time."""
        async with self._lock:
            before = self._entry(name)
            dep = before.deployment
            if dep.canary is not None:
                after = await self._drop_canary(actor, before, "deployment.canary.rollback", "removed by an operator")
                return RolloutResult(deployment=self._view(after), alias=None)
            if dep.previous is None:
                raise NothingToRollBack(f"deployment {name} runs no canary and has no earlier version to return to")
            receipt = None
            if dep.alias is not None:
                receipt = await self._models.rollback(actor, dep.alias)
                target = receipt.to
            else:
                target = dep.previous
                self._deployable_model(target)
            after = before
            if target != dep.model:
                followed = _follow(dep, target, "rollback")
                if dep.alias is None:
                    followed = attrs.evolve(followed, previous=None)  # a rollback is not itself undone
                after = _Entry(followed, before.decision)
                detail = f"{dep.model.key} -> {target.key}" + (
                    f"; alias {dep.alias} generation {receipt.generation}" if receipt else ""
                )
                await self._commit(actor, "deployment.rollback", before, after, detail=detail)
        self.poke()
        return RolloutResult(deployment=self._view(after), alias=receipt)

    async def drop_canary(self, actor: Actor, name: str, canary: Canary, *, action: str, detail: str) -> bool:
        """Remove `canary` from deployment `name`, audited as `action` with `detail` (figures first).

        False, changing nothing, when the deployment is gone or no longer runs that very canary
        (promoted or replaced meanwhile).
        """
        async with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.deployment.canary != canary:
                return False
            await self._drop_canary(actor, entry, action, detail)
        return True

    async def _drop_canary(self, actor: Actor, before: _Entry, action: str, detail: str) -> _Entry:
        dep = before.deployment
        assert dep.canary is not None
        after = _Entry(_bump(attrs.evolve(dep, canary=None)), before.decision, before.problem)
        await self._commit(actor, action, before, after, detail=f"canary {dep.canary.model.key}: {detail}")
        return after

    # ---- writing -----------------------------------------------------------------------------------

    async def _commit(
        self, actor: Actor, action: str, before: _Entry | None, after: _Entry | None, *, detail: str = ""
    ) -> None:
        """Write the deployment and every node set it changes in one audited transaction, then push.

        A replica new to its node gets the assignment of its own model version (callers checked
        that it may run, and placed it).
        """
        name = (after or before).deployment.name  # type: ignore[union-attr]
        old = _all_replicas(before.deployment) if before else []
        new = _all_replicas(after.deployment) if after else []
        changed: dict[str, DesiredAssignments] = {}
        by_node: defaultdict[str, list[Replica]] = defaultdict(list)
        for r in new:
            by_node[r.node_id].append(r)
        for node_id in sorted({r.node_id for r in old} | set(by_node)):
            live = self._fleet.get(node_id)
            current = live.desired
            others = [a for a in current.assignments if a.deployment != name]
            mine = {a.id: a for a in current.assignments if a.deployment == name}
            wanted = []
            used_ports = {a.runtime.port for a in others}
            for r in by_node.get(node_id, []):
                if r.id in mine:
                    wanted.append(mine[r.id])  # unchanged replicas keep their spec
                    used_ports.add(mine[r.id].runtime.port)
            for r in by_node.get(node_id, []):
                if r.id not in mine:
                    assert after is not None
                    dep = after.deployment
                    ref = _model_of(dep, r)
                    model = self._models.model(ref.model, ref.version)
                    runtime = self._models.runtime(dep.runtime)
                    port = dep.options.port
                    while port in used_ports:
                        port += 1
                    used_ports.add(port)
                    wanted.append(
                        assignment_for(dep, r, model, runtime, port, unified_pool_bytes=unified_pool_bytes(live))
                    )
            if {a.id for a in wanted} == set(mine):
                continue
            changed[node_id] = attrs.evolve(current, generation=current.generation + 1, assignments=others + wanted)
        sets = ", ".join(f"{n} generation {d.generation}" for n, d in changed.items()) or "no node set changed"
        detail = f"{detail}; {sets}" if detail else sets
        draft = audit_draft(
            actor,
            action,
            f"deployment/{name}",
            before.deployment if before else None,
            after.deployment if after else None,
            detail=detail[:_DETAIL_MAX],
        )
        event = await self._store.run(
            st.save_deployment,
            name,
            after.deployment if after else None,
            after.decision if after and (before is None or after.decision is not before.decision) else None,
            list(changed.values()),
            draft,
        )
        self._metrics.audit_events.labels(event.result.value).inc()
        if after is None:
            self._entries.pop(name, None)
        else:
            self._entries[name] = after
        for node_id, desired in changed.items():
            live = self._fleet.get(node_id)
            # Keep any acknowledgement recorded meanwhile; the set itself is ours.
            live.desired = attrs.evolve(live.desired, generation=desired.generation, assignments=desired.assignments)
        for node_id in changed:
            await self._southbound.push_now(node_id)
        log.info("%s %s: %s", action, name, detail)

    # ---- the reconciler ----------------------------------------------------------------------------

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
        also the next time one of the kept replicas' nodes will count as lost."""
        kept: list[Replica] = []
        draining: list[Replica] = []
        next_at = float("inf")
        for r in group:
            live = self._fleet.get(r.node_id)
            if live.state is NodeState.DRAINING:
                draining.append(r)
                continue
            gone = self._gone_at(live)
            if gone is not None and gone <= now:
                continue
            if gone is not None:
                next_at = min(next_at, gone)
            kept.append(r)
        return kept, draining, next_at

    def _ready(self, replica: Replica) -> bool:
        """Whether the replica's node reports its runtime Ready in its latest heartbeat."""
        live = self._fleet.get(replica.node_id)
        return any(s.assignment_id == replica.id and s.state is RuntimeState.READY for s in live.statuses)

    def _routable(self, replica: Replica) -> bool:
        return self._fleet.get(replica.node_id).state in _ROUTABLE and self._ready(replica)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._started = trio.current_time()
        task_status.started()
        while True:
            next_at = await self.reconcile()
            self._wake = trio.Event()
            with trio.move_on_at(min(next_at, trio.current_time() + _RESYNC_S)):
                await self._wake.wait()

    async def reconcile(self) -> float:
        """Follow moved aliases, move replicas off nodes that lost them, top every deployment (and
        canary) up, and take one step of each rollout; the next deadline to look again."""
        now = trio.current_time()
        next_at = float("inf")
        async with self._lock:
            for name in sorted(self._entries):
                next_at = min(next_at, await self._reconcile_one(name, now))
        return next_at

    async def _reconcile_one(self, name: str, now: float) -> float:
        entry = self._entries[name]
        dep = entry.deployment
        target = self._alias_target(dep)
        if target is not None and target != dep.model:
            after = _Entry(_follow(dep, target, "alias"), entry.decision, entry.problem)
            detail = f"alias {dep.alias} points at {target.key}; rolling {dep.model.key} -> {target.key}"
            await self._commit(SYSTEM, "deployment.follow", entry, after, detail=detail)
            entry, dep = after, after.deployment

        stable = self._heal(dep, dep.placed, wanted=dep.replicas, ref=dep.model, others=_canary_placed(dep), now=now)
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
            after = _Entry(_bump(attrs.evolve(dep, placed=stable.placed, canary=canary)), decision, problem)
            await self._commit(SYSTEM, "deployment.replace", entry, after)
            entry = after
        else:
            entry.problem = problem
        if entry.deployment.rollout is not None:
            next_at = min(next_at, await self._step(entry, now))
        return next_at

    def _alias_target(self, dep: Deployment) -> ModelRef | None:
        if dep.alias is None:
            return None
        try:
            alias, _ = self._models.alias(dep.alias)
        except NotFound:
            return None
        return alias.target

    def _heal(
        self, dep: Deployment, group: list[Replica], *, wanted: int, ref: ModelRef, others: list[Replica], now: float
    ) -> _Healed:
        """Drop a group's lost replicas and place replacements of `ref` up to `wanted` (`others`:
        the deployment's other replicas, which spread avoids); draining nodes keep theirs until
        the group is whole and Ready. What runs stays when the model may no longer start."""
        kept, draining, next_at = self._triage(group, now)
        if not draining and len(kept) == len(group) and len(kept) >= wanted:
            return _Healed(group, None, None, next_at)
        problem = None
        decision = None
        placed = kept
        try:
            model: ModelRecord | None = self._deployable_model(ref)
            runtime: RuntimeRecord | None = self._runtime(dep.runtime)
        except NotDeployable as exc:
            problem = exc.message  # keep what runs; nothing new starts
            model = runtime = None
            if len(kept) == len(group):
                return _Healed(group, None, problem, next_at)
        if model is not None and runtime is not None and len(kept) < wanted:
            existing = Counter(r.node_id for r in kept + others)
            request = _request(dep, model, runtime, wanted - len(kept))
            decision = place(self._snapshot(), request, existing=existing)
            if decision.feasible:
                placed = kept + [_replica(dep.name, p.node_id, p.gpus, ref) for p in decision.placements]
            else:
                problem = explain(decision)
        if draining:
            # Make before break: a draining node's replicas stop only once the others cover the
            # group and every one of them reports Ready.
            if len(placed) >= wanted and all(self._ready(r) for r in placed):
                log.info("deployment %s: replacements Ready; stopping %d on draining nodes", dep.name, len(draining))
            else:
                placed = placed + draining
                next_at = min(next_at, now + _DRAIN_CHECK_S)
        return _Healed(placed, decision, problem, next_at)

    async def _step(self, entry: _Entry, now: float) -> float:
        """One step of the deployment's rollout (see the module docstring); when to look again."""
        dep = entry.deployment
        rollout = dep.rollout
        assert rollout is not None
        again = now + _ROLLOUT_CHECK_S
        new = [r for r in dep.placed if _model_of(dep, r) == dep.model]
        old = [r for r in dep.placed if _model_of(dep, r) != dep.model]
        if not all(self._ready(r) for r in new):
            return again  # the last step's replica is not Ready yet
        if not old:
            if len(new) < dep.replicas:
                return again  # lost meanwhile; `_heal` tops the deployment up first
            after = _Entry(
                _bump(attrs.evolve(dep, placed=new[: dep.replicas], rollout=None)), entry.decision, entry.problem
            )
            detail = f"{rollout.from_.key} -> {rollout.to.key} ({rollout.reason}): {dep.replicas} replica(s) Ready"
            await self._commit(SYSTEM, "deployment.rollout.done", entry, after, detail=detail)
            return float("inf")
        victim = next((r for r in old if not self._ready(r)), old[0])
        rest = [r for r in dep.placed if r.id != victim.id]
        stopped = f"stopped {victim.id} ({_model_of(dep, victim).key}) on {victim.node_id}"
        decision = entry.decision
        if len(rest) >= dep.replicas:
            placed = rest
            detail = f"{rollout.from_.key} -> {rollout.to.key}: {stopped}"
        else:
            waits = f"rollout {rollout.from_.key} -> {rollout.to.key} waits: "
            try:
                model = self._deployable_model(dep.model)
                runtime = self._runtime(dep.runtime)
            except NotDeployable as exc:
                entry.problem = waits + exc.message
                return again
            # Make before break when the fleet has room for one more replica: the old one keeps
            # serving until its replacement is Ready (the next step then only stops it).
            surge = place(
                self._snapshot(),
                _request(dep, model, runtime, 1),
                existing=Counter(r.node_id for r in dep.placed + _canary_placed(dep)),
            )
            if len(dep.placed) <= dep.replicas and surge.feasible:
                decision, rest, stopped = surge, dep.placed, "the old replica stays until it is Ready"
            else:
                # No room: stop one old replica and place its replacement where it was freed.
                existing = Counter(r.node_id for r in rest + _canary_placed(dep))
                snapshot = self._snapshot(without=frozenset({victim.id}))
                decision = place(snapshot, _request(dep, model, runtime, 1), existing=existing)
            if not decision.feasible:
                entry.problem = waits + explain(decision)
                return again
            [p] = decision.placements
            fresh = _replica(dep.name, p.node_id, p.gpus, dep.model)
            placed = [*rest, fresh]
            detail = f"{rollout.from_.key} -> {rollout.to.key}: started {fresh.id} on {fresh.node_id}; {stopped}"
        after = _Entry(_bump(attrs.evolve(dep, placed=placed)), decision)
        await self._commit(SYSTEM, "deployment.rollout.step", entry, after, detail=detail)
        return again


def _check_shape(req: DeploymentCreate) -> None:
    problems = deployment_problems(req)
    if problems:
        raise ContractError("invalid deployment: " + "; ".join(problems), problems=tuple(problems))


def _not_rolling(dep: Deployment) -> None:
    if dep.canary is not None:
        raise RolloutInProgress(f"deployment {dep.name} runs a canary of {dep.canary.model.key} already")
    if dep.rollout is not None:
        raise RolloutInProgress(
            f"deployment {dep.name} is rolling out {dep.rollout.from_.key} -> {dep.rollout.to.key}; wait for it"
        )


def _replica(deployment: str, node_id: str, gpus: Iterable[str], model: ModelRef) -> Replica:
    return Replica(id=f"{deployment}-{secrets.token_hex(4)}", node_id=node_id, gpus=list(gpus), model=model)


def _model_of(dep: Deployment, replica: Replica) -> ModelRef:
    return replica.model or dep.model


def _canary_placed(dep: Deployment) -> list[Replica]:
    return list(dep.canary.placed) if dep.canary is not None else []


def _all_replicas(dep: Deployment) -> list[Replica]:
    return dep.placed + _canary_placed(dep)


def _stamped(dep: Deployment) -> Deployment:
    """A record from before rollouts: each replica runs the deployment's model; say so."""
    if all(r.model is not None for r in dep.placed):
        return dep
    return attrs.evolve(dep, placed=[attrs.evolve(r, model=_model_of(dep, r)) for r in dep.placed])


def _follow(dep: Deployment, target: ModelRef, reason: str) -> Deployment:
    """The deployment switched to `target`: a rollout from what it ran (a canary of `target` merged in)."""
    placed, canary = dep.placed, dep.canary
    if canary is not None and canary.model == target:
        placed, canary = placed + canary.placed, None
    rollout = Rollout(from_=dep.model, to=target, reason=reason, started_at=time.time())
    return _bump(attrs.evolve(dep, model=target, placed=placed, canary=canary, rollout=rollout, previous=dep.model))


def _bump(dep: Deployment) -> Deployment:
    """A changed record: one generation up, updated now."""
    return attrs.evolve(dep, generation=dep.generation + 1, updated_at=time.time())
