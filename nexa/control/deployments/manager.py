"""`Deployments`: the one object the rest of the controller holds (the API, the console, the
gateway, the rollout watcher, the composition root). Its queries, its operator changes (create,
scale, delete; canaries through `canary.Rollouts`) and the reconciler's loop (`run`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable

import attrs
import trio

from nexa.config import NodesConfig, PlacementConfig
from nexa.contracts.deployments import (
    Canary,
    CanaryCreate,
    Deployment,
    DeploymentChange,
    DeploymentCreate,
    DeploymentView,
    PlacementView,
    Replica,
    RolloutResult,
    RolloutStatus,
    RoutingWeights,
    ServingSet,
    canary_problems,
    routing_problems,
)
from nexa.contracts.domain import Actor, TenantId
from nexa.contracts.evals import EvalReplicaCreate
from nexa.contracts.evidence import ServiceObjectives
from nexa.contracts.models import AliasReceipt, ModelRecord, ModelRef, RuntimeRecord
from nexa.contracts.placement import PlacementDecision
from nexa.control import store as st
from nexa.control.cluster.leadership import Leadership
from nexa.control.datapath.routing import Router
from nexa.control.deployments import evalreplica, views
from nexa.control.deployments.canary import Rollouts
from nexa.control.deployments.checks import check_memory_limits, check_settings, check_shape, deployable, explain
from nexa.control.deployments.desired import CommitObserver, Desired
from nexa.control.deployments.idle import Idle
from nexa.control.deployments.reconciler import Reconciler
from nexa.control.deployments.records import Entry, bump, is_current, new_replicas, replica_nodes
from nexa.control.deployments.scheduler import place
from nexa.control.deployments.watch import ChangeWatcher, NodesWindow, RolloutControl
from nexa.control.fleet import grants
from nexa.control.fleet.nodes import Fleet
from nexa.control.fleet.southbound import Southbound
from nexa.control.registry.models import ModelRegistry
from nexa.errors import AlreadyExists, ContractError, NotFound, Unplaceable
from nexa.telemetry import Metrics


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
        router: Router | None = None,
        leadership: Leadership | None = None,
        tenant_exists: Callable[[TenantId], bool] = lambda _tenant: False,
    ) -> None:
        """`tenant_exists`: whether a tenant a suite gate names exists (`Accounts.tenant_exists`;
        by default none does)."""
        self._fleet = fleet
        self._router = router
        self._desired = Desired(
            store,
            metrics,
            fleet,
            models=models,
            southbound=southbound,
            placement=placement or PlacementConfig(),
            leadership=leadership,
        )
        self._reconciler = Reconciler(self._desired, cfg)
        self._serving = views.ServingSets(self._desired)
        self._rollouts = Rollouts(self._desired, self.poke)
        self._control = RolloutControl(self._desired, self.poke, metrics, store, tenant_exists)
        #: Sleep when idle, wake on demand, swap on demand (`idle`); its loop runs beside the reconciler's.
        self.idle = Idle(self._desired, metrics, router.outstanding if router is not None else _none_outstanding)
        fleet.on_change(self.poke)
        models.on_alias_change(self._alias_moved)

    async def load(self) -> None:
        await self._desired.load()

    async def refresh(self) -> None:
        """Re-read the deployments another controller changed (`Desired.refresh`); nothing is placed."""
        await self._desired.refresh()

    def poke(self) -> None:
        """Ask the reconciler to look now."""
        self._reconciler.poke()

    def _alias_moved(self, receipt: AliasReceipt) -> None:
        # Deployments created from the alias follow it; the reconciler compares and rolls.
        self.poke()

    # ---- the reconciler ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The reconciler's loop (`reconciler` says what one pass does): until cancelled. It runs
        while this controller leads: group runs are continued from the store when it starts and
        dropped when it ends (`grouprun`)."""
        self._reconciler.start()
        await self._desired.resume_groups()
        task_status.started()
        try:
            while True:
                next_at = await self.reconcile()
                await self._reconciler.wait(next_at)
        finally:
            self._desired.groups.stand_down()

    async def reconcile(self) -> float:
        """Follow moved aliases, move replicas off nodes that lost them, top every deployment (and
        canary) up, and take one step of each rollout; the next deadline to look again.

        While the controller recovers, nothing is re-placed: no pass runs until the end of recovery pokes."""
        if self._desired.recovering:
            return math.inf
        return await self._reconciler.reconcile()

    @property
    def recovering(self) -> bool:
        """Whether the controller recovers (`control.operations.recovery`): every change is refused meanwhile."""
        return self._desired.recovering

    # ---- queries -----------------------------------------------------------------------------------

    def all(self) -> list[DeploymentView]:
        return [self._view(e) for _, e in sorted(self._desired.entries.items())]

    def _view(self, e: Entry) -> DeploymentView:
        """`views.view` with where it stands with sleep when idle (`Idle.status`)."""
        return attrs.evolve(views.view(self._desired, e), sleep=self.idle.status(e.deployment))

    def show(self, name: str) -> DeploymentView:
        """The deployment's view with its memory, declared against measured, and each replica's
        routing score terms now (`Router.terms`)."""
        view = self._view(self._desired.entry(name))
        view = attrs.evolve(view, memory=self._desired.memory_of(view.deployment))
        if self._router is None:
            return view
        dep, terms = view.deployment, self._router.terms
        scores = [terms(r.id, r.node_id, dep.routing) for r in dep.placed]
        if dep.canary is not None:
            scores += [terms(r.id, r.node_id, dep.routing, canary=True) for r in dep.canary.placed]
        return attrs.evolve(view, replica_scores=scores)

    def placement(self, name: str) -> PlacementView:
        entry = self._desired.entry(name)
        process: list[str] = []
        for replica in entry.deployment.placed[:1]:
            with contextlib.suppress(NotFound):
                signed = self._fleet.get(replica.node_id).desired.assignments
                process = next((a.runtime.process for a in signed if a.id == replica.id), [])
        return PlacementView(deployment=name, decision=entry.decision, process=process)

    def canaries(self) -> list[tuple[str, Canary]]:
        """Every running canary, by deployment name (what `rollout.RolloutWatcher` checks)."""
        entries = sorted(self._desired.entries.items())
        return [(n, e.deployment.canary) for n, e in entries if e.deployment.canary is not None]

    def node_data_classes(self, node_id: str) -> tuple[str, ...]:
        """The data classes a node may process: those of its inventory.json the admin granted
        (`control.fleet.grants`); none for a node that has not reported an inventory. In memory, for the
        gateway's routing."""
        try:
            live = self._fleet.get(node_id)
        except NotFound:
            return ()
        return grants.data_classes(live.node.labels, live.inventory)

    def serving(self, model: ModelRef, *, alias: str | None = None) -> ServingSet:
        """The replicas the gateway may send requests for `model` to (`views.serving`, made once per change)."""
        return self._serving.get(model, alias=alias)

    def forecast(self, req: DeploymentCreate) -> PlacementDecision:
        """Whether a hypothetical deployment fits now, and where; changes nothing."""
        check_shape(req)
        model, runtime, _ = deployable(self._desired.models, req)
        check_settings(req, runtime, model)
        return place(self._desired.snapshot(), self._desired.request(req, model, runtime, req.replicas))

    async def create(self, actor: Actor, req: DeploymentCreate) -> DeploymentView:
        check_shape(req)
        await self._control.check_policy(req.rollout_policy)  # its suite is registered
        async with self._desired.lock:
            if req.name in self._desired.entries:
                raise AlreadyExists(f"deployment {req.name} exists")
            model, runtime, ref = deployable(self._desired.models, req)
            check_settings(req, runtime, model)
            decision = place(self._desired.snapshot(), self._desired.request(req, model, runtime, req.replicas))
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
                routing=req.routing,
                objectives=req.objectives,
                created_at=now,
                created_by=actor.key_id,
                updated_at=now,
                placed=new_replicas(req.name, decision, ref),
                nodes_per_replica=req.nodes_per_replica,
                rollout_policy=req.rollout_policy,
                idle_after_s=req.idle_after_s,
                min_replicas=req.min_replicas,
                evictable=req.evictable,
                loras=self._desired.models.lora_set(ref),
            )
            entry = Entry(dep, decision)
            await self._desired.commit(actor, "deployment.create", None, entry)
        return self._view(entry)

    async def scale(self, actor: Actor, name: str, replicas: int) -> DeploymentView:
        if not 1 <= replicas <= 256:
            raise ContractError("replicas: from 1 to 256", problems=("replicas: from 1 to 256",))
        async with self._desired.lock:
            before = self._desired.entry(name)
            dep = before.deployment
            if dep.asleep:  # its wake places the new count
                after = Entry(bump(attrs.evolve(dep, replicas=replicas)), before.decision)
                await self._desired.commit(actor, "deployment.scale", before, after)
                return self._view(after)
            model, runtime, _ = deployable(self._desired.models, dep)
            # The current version's replicas first, so scaling down during a rollout keeps them.
            placed = sorted(dep.placed, key=lambda r: not is_current(dep, r))
            decision = before.decision
            if replicas < len(placed):
                placed = placed[:replicas]
            elif replicas > len(placed):
                decision = self._place_more(dep, placed, replicas - len(placed), model, runtime)
                if not decision.feasible:
                    raise Unplaceable(f"deployment {name} cannot grow to {replicas} replicas: " + explain(decision))
                placed += new_replicas(name, decision, dep.model)
            after = Entry(bump(attrs.evolve(dep, replicas=replicas, placed=placed)), decision)
            await self._desired.commit(actor, "deployment.scale", before, after)
        return views.view(self._desired, after)

    async def set_routing(self, actor: Actor, name: str, weights: RoutingWeights) -> DeploymentView:
        """Set the deployment's routing weights (the router uses them from its next request)."""
        if problems := routing_problems(weights):
            raise ContractError("invalid routing weights: " + "; ".join(problems), problems=tuple(problems))
        async with self._desired.lock:
            before = self._desired.entry(name)
            after = Entry(bump(attrs.evolve(before.deployment, routing=weights)), before.decision)
            await self._desired.commit(actor, "deployment.routing", before, after)
        return views.view(self._desired, after)

    async def set_objectives(self, actor: Actor, name: str, objectives: ServiceObjectives) -> DeploymentView:
        """Set the service objectives `nexa bench` runs of the deployment are judged against."""
        async with self._desired.lock:
            before = self._desired.entry(name)
            after = Entry(bump(attrs.evolve(before.deployment, objectives=objectives)), before.decision, before.problem)
            await self._desired.commit(actor, "deployment.objectives", before, after)
        return views.view(self._desired, after)

    @property
    def desired(self) -> Desired:
        """The deployments' desired state: what a runtime qualification (`control.operations.qualification`)
        places through, writes its replica's node set with (`Desired.change_node_set`), and tells
        placement which pairs are qualified (`Desired.qualified`)."""
        return self._desired

    def on_commit(self, observer: CommitObserver) -> None:
        """Call `observer(action, before, after)` after every committed change (`Desired.commit`)."""
        self._desired.observers.append(observer)

    async def delete(self, actor: Actor, name: str) -> DeploymentView:
        """Remove the deployment and its replicas (a canary's too) from every node set; answers what was deleted."""
        async with self._desired.lock:
            before = self._desired.entry(name)
            await self._desired.commit(actor, "deployment.delete", before, None)
        return views.view(self._desired, before)

    def _place_more(
        self, dep: Deployment, kept: list[Replica], count: int, model: ModelRecord, runtime: RuntimeRecord
    ) -> PlacementDecision:
        existing = Counter(replica_nodes(kept))
        if dep.canary is not None:
            existing.update(replica_nodes(dep.canary.placed))
        return place(self._desired.snapshot(), self._desired.request(dep, model, runtime, count), existing=existing)

    # ---- rollout: canary, promote, rollback (`canary.Rollouts`) ------------------------------------

    async def start_canary(self, actor: Actor, name: str, req: CanaryCreate) -> DeploymentView:
        """Place `req.replicas` extra replicas of `req.model` beside the deployment's own, or refuse
        (`Rollouts.start_canary` says when)."""
        if req.suite is not None and not canary_problems(req):  # a bad shape is Rollouts' 400
            await self._control.check_gate(req.suite, f"the canary's gate on deployment {name}")
        return await self._rollouts.start_canary(actor, name, req)

    async def promote(self, actor: Actor, name: str) -> RolloutResult:
        """Make the canary's version the deployment's (`Rollouts.promote`)."""
        return await self._rollouts.promote(actor, name)

    async def rollback(self, actor: Actor, name: str) -> RolloutResult:
        """Remove a running canary, else return to the version before the last promotion (`Rollouts.rollback`)."""
        return await self._rollouts.rollback(actor, name)

    async def drop_canary(self, actor: Actor, name: str, canary: Canary, *, action: str, detail: str) -> bool:
        """Remove `canary` from deployment `name`; False, changing nothing, when it no longer runs
        that very canary (`Rollouts.drop_canary`)."""
        return await self._rollouts.drop_canary(actor, name, canary, action=action, detail=detail)

    # ---- every change under watch (`watch`) ----------------------------------------------------------

    async def change(self, actor: Actor, name: str, req: DeploymentChange) -> DeploymentView:
        """A new runtime or settings, rolled out under watch (`RolloutControl.change`)."""
        return await self._control.change(actor, name, req)

    def rollout_status(self, name: str) -> RolloutStatus:
        return self._control.status(name)

    async def pause_rollout(self, actor: Actor, name: str) -> RolloutStatus:
        return await self._control.pause(actor, name)

    async def resume_rollout(self, actor: Actor, name: str) -> RolloutStatus:
        return await self._control.resume(actor, name)

    async def undo_rollout(self, actor: Actor, name: str) -> RolloutStatus:
        return await self._control.undo(actor, name)

    def change_watcher(self, meter: NodesWindow, *, interval_s: float = 0.5) -> ChangeWatcher:
        """The loop that watches each rollout's new replicas against `meter` (`watch.ChangeWatcher`)."""
        return ChangeWatcher(self._desired, self._control, meter, interval_s=interval_s)

    # ---- evaluation replicas (`evalreplica`) -------------------------------------------------------

    async def start_eval_replica(self, actor: Actor, req: EvalReplicaCreate) -> DeploymentView:
        """Place one replica of `req.model` that only the evaluation's key may call (`evalreplica.start`)."""
        dep = await evalreplica.start(self._desired, actor, req)
        return views.view(self._desired, self._desired.entry(dep.name))

    async def stop_eval_replica(self, actor: Actor, name: str, why: str) -> bool:
        """Remove evaluation replica `name`; False when it was gone already (`evalreplica.stop`)."""
        return await evalreplica.stop(self._desired, actor, name, why) is not None

    def eval_replicas(self) -> list[Deployment]:
        return evalreplica.bound(self._desired)

    def eval_model(self, name: str, key_id: str) -> ModelRef:
        """The version evaluation replica `name` serves to `key_id` (`evalreplica.served_to`: 404, 403)."""
        return evalreplica.served_to(self._desired, name, key_id)


def _none_outstanding(_replica_id: str) -> int:
    """Without a router (tests of deployments alone), no request is ever in flight."""
    return 0
