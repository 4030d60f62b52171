"""Deployments: desired state, placement over a snapshot of the fleet, and the reconciler.

A deployment is checked against the model registry when it is created (its model Approved with
a licence valid now, its runtime registered, which means its digest was checked at the
registry), then placed with `scheduler.place` over `snapshot_from(fleet)`. A placement that
cannot take every replica is refused (422, `Unplaceable`, the message explaining each node)
and nothing starts. The decision is kept, so `GET /deployments/{id}/placement` shows it.

Each replica is one `wire.Assignment` in its node's desired set (`assignment_for` documents the
mapping). A change writes the deployment, its decision and every node set it touched (each one
generation up) in one audited transaction, then pushes those sets through the node channel.

The reconciler (`run`) wakes when the fleet changes (admin actions, reachability), at the
moment an Unreachable node's grace period ends, and every `_RESYNC_S`. It drops replicas on
nodes that are Revoked, Draining (only once their replacements are Ready), or Unreachable for
longer than `nodes.replace_after_s` after
their lease lapsed, and places replacements on other nodes; a deployment it cannot fully place
keeps what it has and says why (`DeploymentView.problem`) until the fleet can take the rest.

Known limit: an alias is resolved once, at creation; rolling a deployment to a newly promoted
version is the rollout work of a later issue.
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

from nexa.config import NodesConfig
from nexa.contracts.deployments import (
    Deployment,
    DeploymentCreate,
    DeploymentView,
    PlacementView,
    Replica,
    ServingReplica,
    ServingSet,
    deployment_problems,
)
from nexa.contracts.domain import NodeState
from nexa.contracts.models import ModelRecord, ModelRef, ModelState, RuntimeRecord
from nexa.contracts.node import LabelKey, LabelValue
from nexa.contracts.placement import PlacementDecision, PlacementNode, PlacementRequest
from nexa.contracts.runtime import ArtifactRef, HealthProbe, RuntimeSpec
from nexa.contracts.wire import Assignment, DesiredAssignments, RuntimeState
from nexa.control import store as st
from nexa.control.fleet import Fleet, NodeLive
from nexa.control.models import ModelRegistry
from nexa.control.registry import SYSTEM, Actor, audit_draft
from nexa.control.scheduler import place
from nexa.control.southbound import Southbound
from nexa.errors import (
    AlreadyExists,
    ContractError,
    DeployLicenseInvalid,
    DeployModelNotApproved,
    DeployModelUnknown,
    DeployRuntimeUnknown,
    NotFound,
    Unplaceable,
)
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: The reconciler looks again this often even when nothing woke it.
_RESYNC_S: Final = 10.0
#: While a drain waits for replacements to become Ready, how often it looks.
_DRAIN_CHECK_S: Final = 1.0
#: Node states whose Ready replicas take requests (cordoning stops new placements, not traffic).
_ROUTABLE: Final = frozenset({NodeState.READY, NodeState.CORDONED})
#: How many nodes an Unplaceable message explains one by one.
_EXPLAIN_NODES: Final = 20


# ---- the fleet as placement sees it -------------------------------------------------------------


def snapshot_from(fleet: Iterable[NodeLive]) -> list[PlacementNode]:
    """One `PlacementNode` per enrolled node, from its inventory and what its desired set reserves.

    Free resources are reservations, not measurements: what the node has minus what the
    replicas in its desired set were given (a replica just assigned holds its share before it
    starts, and a running one is not counted twice).

    - state, labels (enrollment labels, then the inventory's), taints, data classes, runtimes,
      arch: as the node's inventory reports them. A node that never reported one has no
      runtimes and no resources, so every request fails on it, with the reason shown.
    - discrete GPUs: `free_gpus` are the CDI names no assignment holds; their memory is the
      sum of those GPUs' `memory_total_bytes`.
    - unified memory (any GPU reported `unified_memory`): every GPU stays free (shared); the
      pool is the inventory's `accelerator_memory_bytes`, less the memory of every assignment,
      and the host pool is the same pool.
    - host memory: `memory_total_bytes` less the memory of CPU-only assignments.
    - load: assignments in the desired set; cached artifacts: none known yet (reliability 1).
    """
    out = []
    for live in fleet:
        inv = live.inventory
        assignments = live.desired.assignments
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
            accel_free = host_free = max(0, accel_total - reserved_all)
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


def assignment_for(
    dep: Deployment, replica: Replica, model: ModelRecord, runtime: RuntimeRecord, port: int
) -> Assignment:
    """The signed unit a node runs for one replica (kept simple until the runtime adapters land).

    Image and kind from the runtime record (pinned by digest); the model artifact by uri,
    sha256 and size; memory from the deployment's resources (else the model's own figure);
    the replica's GPUs; command, env and health probe from the runtime options; `port` is the
    loopback port chosen for it on its node.
    """
    options = dep.options
    return Assignment(
        id=replica.id,
        deployment=dep.name,
        runtime=RuntimeSpec(
            kind=runtime.kind,
            image=runtime.image,
            command=list(options.command),
            env=dict(options.env),
            port=port,
            artifact=ArtifactRef(
                uri=model.artifact.uri, sha256=model.artifact.sha256, size_bytes=model.artifact.size_bytes
            ),
            gpus=list(replica.gpus),
            memory_bytes=_memory(dep, model),
            cpus=dep.resources.cpus,
            health=HealthProbe(command=list(options.health_command) or ["true"]),
        ),
    )


def _memory(dep: Deployment | DeploymentCreate, model: ModelRecord) -> int:
    return dep.resources.memory_bytes or model.memory_bytes


def _request(
    dep: Deployment | DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord, replicas: int
) -> PlacementRequest:
    spec = dep.placement
    return PlacementRequest(
        deployment=dep.name,
        replicas=replicas,
        runtime=runtime.kind,
        arch=spec.arch,
        memory_bytes=_memory(dep, model),
        accelerators=dep.resources.accelerators,
        artifact_sha256=model.artifact.sha256,
        data_classes=tuple(spec.data_classes),
        node_selector=dict(spec.node_selector),
        tolerations=tuple(spec.tolerations),
        policy=spec.policy,
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
    ) -> None:
        self._cfg = cfg
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

    async def load(self) -> None:
        for dep, decision in await self._store.run(st.load_deployments):
            self._entries[dep.name] = _Entry(dep, decision)

    def poke(self) -> None:
        """Ask the reconciler to look now."""
        self._wake.set()

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

    def serving(self, model: ModelRef, *, alias: str | None = None) -> ServingSet:
        """The replicas the gateway may send requests for `model` to: those of deployments of it
        (pinned, or created from `alias` while it pointed there) that their node reports Ready,
        on nodes that are Ready or Cordoned (never Unreachable, Draining or Revoked). Read on every
        request: in memory, no I/O."""
        replicas: list[ServingReplica] = []
        names: list[str] = []
        for name, entry in self._entries.items():
            dep = entry.deployment
            if dep.model != model:
                continue
            names.append(name)
            for r in dep.placed:
                live = self._fleet.get(r.node_id)
                if live.state in _ROUTABLE and self._ready(r):
                    replicas.append(
                        ServingReplica(replica_id=r.id, node_id=r.node_id, deployment=name, model=dep.model)
                    )
        return ServingSet(model=model, replicas=replicas, deployments=names)

    @staticmethod
    def _view(e: _Entry) -> DeploymentView:
        return DeploymentView(deployment=e.deployment, ready_to_run=len(e.deployment.placed), problem=e.problem)

    # ---- checks ------------------------------------------------------------------------------------

    def _deployable(self, req: DeploymentCreate | Deployment) -> tuple[ModelRecord, RuntimeRecord, ModelRef]:
        """The model and runtime a deployment would run, or a typed 422 naming why not."""
        try:
            runtime = self._models.runtime(req.runtime)
        except NotFound:
            raise DeployRuntimeUnknown(f"no runtime {req.runtime} is registered (with a checked digest)") from None
        if isinstance(req, DeploymentCreate) and req.alias is not None:
            try:
                alias, _ = self._models.alias(req.alias)
            except NotFound:
                raise DeployModelUnknown(f"no alias {req.alias}") from None
            ref = alias.target
        else:
            assert req.model is not None
            ref = req.model
        try:
            model = self._models.model(ref.model, ref.version)
        except NotFound:
            raise DeployModelUnknown(f"no model {ref.model}@{ref.version}") from None
        if model.state is not ModelState.APPROVED:
            raise DeployModelNotApproved(f"model {model.key} is {model.state.value}; only Approved models are deployed")
        problem = "it has no licence record" if model.license is None else model.license.problem_at(time.time())
        if problem is not None:
            raise DeployLicenseInvalid(f"model {model.key} cannot be deployed: {problem}")
        return model, runtime, ref

    def forecast(self, req: DeploymentCreate) -> PlacementDecision:
        """Whether a hypothetical deployment fits now, and where; changes nothing."""
        _check_shape(req)
        model, runtime, _ = self._deployable(req)
        return place(snapshot_from(self._fleet), _request(req, model, runtime, req.replicas))

    # ---- changes -----------------------------------------------------------------------------------

    async def create(self, actor: Actor, req: DeploymentCreate) -> DeploymentView:
        _check_shape(req)
        async with self._lock:
            if req.name in self._entries:
                raise AlreadyExists(f"deployment {req.name} exists")
            model, runtime, ref = self._deployable(req)
            decision = place(snapshot_from(self._fleet), _request(req, model, runtime, req.replicas))
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
                placed=[_replica(req.name, p.node_id, p.gpus) for p in decision.placements],
            )
            entry = _Entry(dep, decision)
            await self._commit(actor, "deployment.create", None, entry, model=model, runtime=runtime)
        return self._view(entry)

    async def scale(self, actor: Actor, name: str, replicas: int) -> DeploymentView:
        if not 1 <= replicas <= 256:
            raise ContractError("replicas: from 1 to 256", problems=("replicas: from 1 to 256",))
        async with self._lock:
            before = self._entry(name)
            dep = before.deployment
            model, runtime, _ = self._deployable(dep)
            placed = list(dep.placed)
            decision = before.decision
            if replicas < len(placed):
                placed = placed[:replicas]
            elif replicas > len(placed):
                decision = self._place_more(dep, placed, replicas - len(placed), model, runtime)
                if not decision.feasible:
                    raise Unplaceable(f"deployment {name} cannot grow to {replicas} replicas: " + explain(decision))
                placed += [_replica(name, p.node_id, p.gpus) for p in decision.placements]
            after = _Entry(_evolve(dep, replicas=replicas, placed=placed), decision)
            await self._commit(actor, "deployment.scale", before, after, model=model, runtime=runtime)
        return self._view(after)

    async def delete(self, actor: Actor, name: str) -> DeploymentView:
        """Remove the deployment and its replicas from every node set; answers what was deleted."""
        async with self._lock:
            before = self._entry(name)
            await self._commit(actor, "deployment.delete", before, None, model=None, runtime=None)
        return self._view(before)

    def _place_more(
        self, dep: Deployment, kept: list[Replica], count: int, model: ModelRecord, runtime: RuntimeRecord
    ) -> PlacementDecision:
        existing = Counter(r.node_id for r in kept)
        return place(snapshot_from(self._fleet), _request(dep, model, runtime, count), existing=existing)

    async def _commit(
        self,
        actor: Actor,
        action: str,
        before: _Entry | None,
        after: _Entry | None,
        *,
        model: ModelRecord | None,
        runtime: RuntimeRecord | None,
    ) -> None:
        """Write the deployment and every node set it changes in one audited transaction, then push."""
        name = (after or before).deployment.name  # type: ignore[union-attr]
        old = before.deployment.placed if before else []
        new = after.deployment.placed if after else []
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
                    assert model is not None
                    assert runtime is not None
                    port = after.deployment.options.port
                    while port in used_ports:
                        port += 1
                    used_ports.add(port)
                    wanted.append(assignment_for(after.deployment, r, model, runtime, port))
            if {a.id for a in wanted} == set(mine):
                continue
            changed[node_id] = attrs.evolve(current, generation=current.generation + 1, assignments=others + wanted)
        detail = ", ".join(f"{n} generation {d.generation}" for n, d in changed.items()) or "no node set changed"
        draft = audit_draft(
            actor,
            action,
            f"deployment/{name}",
            before.deployment if before else None,
            after.deployment if after else None,
            detail=detail[:300],
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
        Ready (make before break), see `reconcile`.
        """
        state = live.state
        if state is NodeState.REVOKED:
            return float("-inf")
        if state is NodeState.UNREACHABLE:
            lost = (live.last_seen + self._cfg.lease_s) if live.last_seen is not None else self._started
            return lost + self._cfg.replace_after_s
        return None

    def _triage(self, dep: Deployment, now: float) -> tuple[list[Replica], list[Replica], float]:
        """Split replicas into those that stay and those on draining nodes (dropping lost ones);
        also the next time one of the kept replicas' nodes will count as lost."""
        kept: list[Replica] = []
        draining: list[Replica] = []
        next_at = float("inf")
        for r in dep.placed:
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

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._started = trio.current_time()
        task_status.started()
        while True:
            next_at = await self.reconcile()
            self._wake = trio.Event()
            with trio.move_on_at(min(next_at, trio.current_time() + _RESYNC_S)):
                await self._wake.wait()

    async def reconcile(self) -> float:
        """Move replicas off nodes that lost them and top every deployment up; the next deadline to look again."""
        now = trio.current_time()
        next_at = float("inf")
        async with self._lock:
            for name in sorted(self._entries):
                entry = self._entries[name]
                dep = entry.deployment
                kept, draining, look_again = self._triage(dep, now)
                next_at = min(next_at, look_again)
                if not draining and len(kept) == len(dep.placed) == dep.replicas:
                    continue
                model: ModelRecord | None
                runtime: RuntimeRecord | None
                try:
                    model, runtime, _ = self._deployable(dep)
                except (DeployModelNotApproved, DeployLicenseInvalid, DeployModelUnknown, DeployRuntimeUnknown) as exc:
                    entry.problem = exc.message  # keep what runs; nothing new starts
                    if len(kept) == len(dep.placed):
                        continue
                    model = runtime = None
                decision = entry.decision
                placed = kept
                problem = entry.problem
                if model is not None and runtime is not None and len(kept) < dep.replicas:
                    decision = self._place_more(dep, kept, dep.replicas - len(kept), model, runtime)
                    if decision.feasible:
                        placed = kept + [_replica(name, p.node_id, p.gpus) for p in decision.placements]
                        problem = None
                    else:
                        problem = explain(decision)
                if draining:
                    # Make before break: a draining node's replicas stop only once the others
                    # cover the deployment and every one of them reports Ready.
                    if len(placed) >= dep.replicas and all(self._ready(r) for r in placed):
                        log.info(
                            "deployment %s: replacements Ready; stopping %d on draining nodes", name, len(draining)
                        )
                    else:
                        placed = placed + draining
                        next_at = min(next_at, now + _DRAIN_CHECK_S)
                if placed == dep.placed:
                    entry.problem = problem
                    continue
                after = _Entry(_evolve(dep, placed=placed), decision, problem)
                await self._commit(SYSTEM, "deployment.replace", entry, after, model=model, runtime=runtime)
        return next_at


def _check_shape(req: DeploymentCreate) -> None:
    problems = deployment_problems(req)
    if problems:
        raise ContractError("invalid deployment: " + "; ".join(problems), problems=tuple(problems))


def _replica(deployment: str, node_id: str, gpus: Iterable[str]) -> Replica:
    return Replica(id=f"{deployment}-{secrets.token_hex(4)}", node_id=node_id, gpus=list(gpus))


def _evolve(dep: Deployment, *, placed: list[Replica], replicas: int | None = None) -> Deployment:
    return attrs.evolve(
        dep,
        generation=dep.generation + 1,
        updated_at=time.time(),
        placed=placed,
        replicas=dep.replicas if replicas is None else replicas,
    )
