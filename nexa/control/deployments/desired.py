"""The deployments in memory and the one way they change.

`Desired` holds every deployment's `Entry` and the lock that every change to deployments and
node sets takes. `commit` writes a change: the deployment, its decision and every node set it
touched (each one generation up) in one audited transaction, then pushes those sets through the
node channel. It also answers what the fleet reports of a replica (`ready`, `routable`) and the
fleet as placement sees it now (`snapshot`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Final, TypeAlias

import attrs
import trio

from nexa.config import PlacementConfig
from nexa.contracts.deployments import Deployment, DeploymentCreate, DeploymentMemory, Replica, ReplicaMeasured
from nexa.contracts.domain import SYSTEM, Actor, NodeState
from nexa.contracts.groups import GroupRunRecord
from nexa.contracts.models import ModelRecord, ModelRef, RuntimeRecord
from nexa.contracts.placement import PlacementNode, PlacementRequest
from nexa.contracts.wire import LIVE_LORAS_PROTOCOL, Assignment, DesiredAssignments, RuntimeState
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.cluster.leadership import Leadership
from nexa.control.deployments.assignment import (
    assignment_for,
    declared_bytes,
    live_lora_specs,
    overhead_bytes,
    placement_request,
    reservation_bytes,
)
from nexa.control.deployments.grouprun import GroupRuns, member_id, ports_in_use
from nexa.control.deployments.measured import MeasuredMemory
from nexa.control.deployments.records import Entry, all_replicas, given_loras, model_of, stamped
from nexa.control.deployments.snapshot import Hold, snapshot_from, unified_pool_bytes
from nexa.control.fleet.nodes import Fleet, NodeLive
from nexa.control.fleet.southbound import Southbound
from nexa.control.registry.models import ModelRegistry
from nexa.errors import NotFound, Recovering
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: The longest audit detail a deployment change writes (figures first, node sets after).
_DETAIL_MAX: Final = 600
#: Node states whose Ready replicas take requests (cordoning stops new placements, not traffic).
_ROUTABLE: Final = frozenset({NodeState.READY, NodeState.CORDONED})

#: Told of every committed change: (audit action, the record before, after); None: created or deleted.
CommitObserver: TypeAlias = Callable[[str, Deployment | None, Deployment | None], Awaitable[None]]


class Desired:
    """Every deployment's entry (written through to the store), and what a change reads and writes."""

    def __init__(
        self,
        store: st.Store,
        metrics: Metrics,
        fleet: Fleet,
        *,
        models: ModelRegistry,
        southbound: Southbound,
        placement: PlacementConfig,
        leadership: Leadership | None = None,
    ) -> None:
        self._store = store
        #: Deployments and the node sets they change are leader-only writes (`Leadership.write`),
        #: fenced in their own transaction; None: the only controller.
        self._leadership = leadership or Leadership.solo(store)
        self._metrics = metrics
        self.fleet = fleet
        self.models = models
        self._southbound = southbound
        self._placement = placement
        self.entries: dict[str, Entry] = {}
        #: One up whenever `entries` changes (the gateway's serving sets are cached against it).
        self.version = 0
        self.lock = trio.Lock()  # every change to deployments and node sets goes through it
        #: Told of each change once it is committed (the rollout jobs, `control.operations.jobs`); they must not raise.
        self.observers: list[CommitObserver] = []
        #: What replicas of each (runtime, model, settings) were measured to hold.
        self.measured = MeasuredMemory(store)
        fleet.on_measured(self._measured)
        #: The (arch, GPU model) pairs a runtime's image passed a qualification on
        #: (`control.operations.qualification`); read only with `[placement] require_qualified`.
        self.qualified: Callable[[RuntimeRecord], frozenset[tuple[str, str]]] | None = None
        #: Each group replica's run: which of its members the node sets hold (`grouprun`).
        self.groups = GroupRuns(fleet, metrics)

    async def load(self) -> None:
        await self.measured.load()
        for dep, decision in await self._store.run(st.load_deployments):
            self.entries[dep.name] = Entry(stamped(dep), decision)
        self.version += 1

    async def refresh(self) -> None:
        """Re-read the deployments another controller on the store changed (`follow.ChangeFeed`):
        their records and placement decisions as stored, never placed here. Under `lock`, so no
        change made here is undone by an older read; an unchanged deployment keeps its entry (and
        the reconciler's `problem`). The gateway's serving sets are made again after a change."""
        async with self.lock:
            if not self._leadership.is_leader:
                # What the leader runs, for this controller's views (`GroupRuns.follow`).
                self.groups.follow(await self._store.read(st.load_group_runs))
            stored: dict[str, Entry] = {}
            for record, decision in await self._store.read(st.load_deployments):
                dep, current = stamped(record), self.entries.get(record.name)
                unchanged = current is not None and current.deployment == dep
                stored[dep.name] = current if current is not None and unchanged else Entry(dep, decision)
            if stored.keys() != self.entries.keys() or any(e is not self.entries[n] for n, e in stored.items()):
                self.entries.clear()
                self.entries.update(stored)
                self.version += 1

    def entry(self, name: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"no deployment {name}")
        return entry

    def snapshot(self, *, without: frozenset[str] = frozenset()) -> list[PlacementNode]:
        """The fleet as placement sees it now (`snapshot_from`, with the configured host headroom
        and what the group replicas held back from the node sets reserve, `group_holds`)."""
        return snapshot_from(
            self.fleet,
            without=without,
            unified_headroom_bytes=self._placement.unified_host_headroom_bytes,
            reservation=self.reservation,
            held=self.group_holds(without),
        )

    def group_holds(self, without: frozenset[str] = frozenset()) -> dict[str, list[Hold]]:
        """By node id, what the members of group replicas hold there (each rank its reservation and
        GPUs) while they are in no node's desired set (not started yet, restarting, or pending: see
        `grouprun`), yet their resources are taken. Replicas whose id is in `without` are left out."""
        out: defaultdict[str, list[Hold]] = defaultdict(list)
        for entry in self.entries.values():
            dep = entry.deployment
            if dep.nodes_per_replica <= 1:
                continue
            for r in all_replicas(dep):
                if not r.members or r.id in without:
                    continue
                reserved = self._rank_reservation(dep, r)
                for m in r.members:
                    if not self._in_set(m.node_id, member_id(r, m.rank)):
                        out[m.node_id].append(Hold(reserved, tuple(m.gpus)))
        return out

    def _in_set(self, node_id: str, assignment_id: str) -> bool:
        try:
            return any(a.id == assignment_id for a in self.fleet.get(node_id).desired.assignments)
        except NotFound:
            return False

    def _rank_reservation(self, dep: Deployment, replica: Replica) -> int:
        """What each rank of a group replica reserves on its node (`reservation_bytes`)."""
        ref = model_of(dep, replica)
        try:
            model = self.models.model(ref.model, ref.version)
            runtime = self.models.runtime(dep.runtime)
        except NotFound:
            return dep.resources.memory_bytes or 0
        return reservation_bytes(dep, model, runtime, self.measured.of(dep, ref))

    def request(
        self, dep: Deployment | DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord, replicas: int
    ) -> PlacementRequest:
        """What placement is asked for `replicas` of `dep` (`placement_request`), with what a replica
        of its runtime, model and settings was measured to hold; with `[placement] require_qualified`,
        only on the pairs its runtime's image qualified on (none known: none)."""
        ref = ModelRef(model=model.name, version=model.version)
        measured = self.measured.get(dep.runtime, ref, dep.options.settings)
        qualified = None
        if self._placement.require_qualified:
            qualified = self.qualified(runtime) if self.qualified is not None else frozenset()
        return placement_request(dep, model, runtime, replicas, measured=measured, qualified=qualified)

    def memory_of(self, dep: Deployment) -> DeploymentMemory | None:
        """`dep`'s memory, declared against measured (None while its model or runtime is unknown)."""
        try:
            model = self.models.model(dep.model.model, dep.model.version)
            runtime = self.models.runtime(dep.runtime)
        except NotFound:
            return None
        measured = self.measured.of(dep)
        replicas = [
            ReplicaMeasured(replica_id=r.id, node_id=r.node_id, measured_bytes=got)
            for r in all_replicas(dep)
            if (got := self._measured_now(r)) is not None
        ]
        return DeploymentMemory(
            declared_bytes=declared_bytes(dep, model),
            overhead_bytes=overhead_bytes(dep, runtime),
            measured_bytes=measured,
            reserved_bytes=reservation_bytes(dep, model, runtime, measured),
            replicas=replicas,
        )

    def _measured_now(self, replica: Replica) -> int | None:
        try:
            return self.fleet.get(replica.node_id).measured.get(replica.id)
        except NotFound:
            return None

    def reservation(self, assignment: Assignment) -> int:
        """What one assigned replica holds for placement: its memory plus its engine's overhead, or
        what a replica of its runtime, model and settings was measured to hold, whichever is larger."""
        entry = self.entries.get(assignment.deployment)
        declared = assignment.runtime.memory_bytes
        if entry is None:
            return declared
        dep = entry.deployment
        replica = next((r for r in all_replicas(dep) if r.id == assignment.id), None)
        measured = self.measured.of(dep, None if replica is None else model_of(dep, replica))
        try:
            runtime = self.models.runtime(dep.runtime)
        except NotFound:
            return max(declared, measured or 0)
        return max(declared + overhead_bytes(dep, runtime), measured or 0)

    async def _measured(self, live: NodeLive, measured: dict[str, int]) -> None:
        by_id = {a.id: a.deployment for a in live.desired.assignments}
        for assignment_id, measured_bytes in measured.items():
            entry = self.entries.get(by_id.get(assignment_id, ""))
            if entry is not None:
                await self.measured.observe(entry.deployment, assignment_id, measured_bytes)

    @property
    def recovering(self) -> bool:
        """While the controller recovers, nothing here changes (`commit` refuses; no pass runs)."""
        return self._southbound.recovering

    def _refuse_while_recovering(self) -> None:
        if self.recovering:
            raise Recovering()

    def ready(self, replica: Replica) -> bool:
        """Whether the replica's node reports its runtime Ready in its latest heartbeat (a group
        replica's: its head's, while its run is `ready`: `grouprun`)."""
        if not self.groups.serving(replica):
            return False
        live = self.fleet.get(replica.node_id)
        return any(
            s.assignment_id == replica.id and s.state is RuntimeState.READY and not s.asleep for s in live.statuses
        )

    def routable(self, replica: Replica) -> bool:
        return self.fleet.get(replica.node_id).state in _ROUTABLE and self.ready(replica)

    async def commit(
        self, actor: Actor, action: str, before: Entry | None, after: Entry | None, *, detail: str = ""
    ) -> None:
        """Write the deployment and every node set it changes in one audited transaction, then push.

        A replica new to its node gets the assignment of its own model version (callers checked
        that it may run, and placed it).
        """
        self._refuse_while_recovering()  # before anything is computed: a refusal changes nothing
        name = (after or before).deployment.name  # type: ignore[union-attr]
        # A group replica's members are in their nodes' sets as its run says (`grouprun`: workers
        # first, the head once they are Ready, none while it restarts or cannot start).
        old_nodes = {n for r in all_replicas(before.deployment) for n in r.node_ids} if before else set()
        changed: dict[str, DesiredAssignments] = {}
        by_node = self._units(after.deployment) if after else {}
        for node_id in sorted(old_nodes | set(by_node)):
            live = self.fleet.get(node_id)
            current = live.desired
            others = [a for a in current.assignments if a.deployment != name]
            mine = {a.id: a for a in current.assignments if a.deployment == name}
            wanted = []
            # A replacement never takes the port of a replica this change stops there: that runtime
            # may still answer on it (the new replica's probe would pass against the old process).
            used_ports = ports_in_use(others) | ports_in_use(mine.values()) | self.groups.ports_on(node_id)
            for r, rank in by_node.get(node_id, []):
                aid = member_id(r, rank or 0)
                if aid in mine:
                    # Unchanged replicas keep their spec; a sleep or a wake by the runtime's own
                    # sleep (`idle`) changes only their `asleep`.
                    asleep = after is not None and after.deployment.asleep
                    kept = mine[aid] if mine[aid].asleep is asleep else attrs.evolve(mine[aid], asleep=asleep)
                    if kept.runtime.live_loras and after is not None:
                        # Adapters loaded at run time: their versions move without a restart.
                        given = live_lora_specs(self._loras_of(after.deployment, model_of(after.deployment, r)))
                        kept = kept if kept.loras == given else attrs.evolve(kept, loras=given)
                    wanted.append(kept)
                    used_ports |= ports_in_use([mine[aid]])
            for r, rank in by_node.get(node_id, []):
                if member_id(r, rank or 0) not in mine:
                    assert after is not None
                    wanted.append(self._assignment(after.deployment, r, rank, live, used_ports))
            if {a.id: (a.asleep, a.loras) for a in wanted} == {aid: (a.asleep, a.loras) for aid, a in mine.items()}:
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
        # The group runs as they are now, with the node sets they explain (`grouprun`'s records).
        groups = self.groups.records(after.deployment) if after else []
        event = await self._leadership.write(
            st.save_deployment,
            name,
            after.deployment if after else None,
            after.decision if after and (before is None or after.decision is not before.decision) else None,
            list(changed.values()),
            draft,
            groups,
        )
        self.groups.saved(name, groups)
        self._metrics.audit_events.labels(event.result.value).inc()
        if after is None:
            self.entries.pop(name, None)
        else:
            self.entries[name] = after
        self.groups.forget({r.id for e in self.entries.values() for r in all_replicas(e.deployment)})
        self.version += 1
        for node_id, desired in changed.items():
            live = self.fleet.get(node_id)
            # Keep any acknowledgement recorded meanwhile; the set itself is ours.
            live.desired = attrs.evolve(live.desired, generation=desired.generation, assignments=desired.assignments)
        for node_id in changed:
            await self._southbound.push_now(node_id)
        log.info("%s %s: %s", action, name, detail)
        await self._tell(action, before, after)

    async def save_groups(self, name: str, records: list[GroupRunRecord], *, detail: str) -> None:
        """Write deployment `name`'s group runs alone (a phase moved, no node set: `grouprun`),
        audited as `deployment.group` by the system."""
        draft = audit_draft(SYSTEM, "deployment.group", f"deployment/{name}", None, None, detail=detail[:_DETAIL_MAX])
        event = await self._leadership.write(st.save_group_runs, name, records, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        self.groups.saved(name, records)

    async def resume_groups(self) -> None:
        """This controller starts leading: continue every group run from the store (`GroupRuns.resume`)."""
        records = await self._store.run(st.load_group_runs)
        async with self.lock:
            self.groups.resume(records)

    def _units(self, dep: Deployment) -> dict[str, list[tuple[Replica, int | None]]]:
        """By node id, what of `dep` its set holds: each replica on one node, and each released
        rank of each group replica (`grouprun.GroupRun.released`)."""
        self.groups.ensure(dep, command_given=bool(dep.options.command))
        by_node: defaultdict[str, list[tuple[Replica, int | None]]] = defaultdict(list)
        for r in all_replicas(dep):
            run = self.groups.get(r) if r.members else None
            if not r.members:
                by_node[r.node_id].append((r, None))
            elif run is not None:
                for rank in run.released():
                    by_node[r.members[rank].node_id].append((r, rank))
        return by_node

    def _loras_of(self, dep: Deployment, ref: ModelRef, *, live: bool = True) -> list[tuple[str, ModelRecord]]:
        """The adapters a replica of `ref` is given: the deployment's pinned set for its model (rolled
        out under watch when the aliases change it: `reconciler`), and while an adapter rollout in
        place soaks the earlier versions too (not on a node that takes no adapters at run time:
        `live` False); the registry's now for a canary's version."""
        if ref != dep.model:
            return list(self.models.loras_on(ref))
        pairs = given_loras(dep) if live else sorted(dep.loras.items())
        return [(alias, self.models.model(a.model, a.version)) for alias, a in pairs]

    def _assignment(
        self, dep: Deployment, r: Replica, rank: int | None, live: NodeLive, used_ports: set[int]
    ) -> Assignment:
        """The assignment of replica `r` (with `rank`: of that rank of the group) new to its node,
        on the lowest free port from the deployment's (a worker rank: its member port)."""
        ref = model_of(dep, r)
        model = self.models.model(ref.model, ref.version)
        runtime = self.models.runtime(dep.runtime)
        arch = live.inventory.arch if live.inventory is not None else None
        role = None
        port = dep.options.port
        if rank is not None:
            run = self.groups.get(r)
            assert run is not None
            role = run.role(rank, r.id, runtime.fabric)
            member = r.members[rank]
            r = attrs.evolve(r, id=member_id(r, rank), node_id=member.node_id, gpus=list(member.gpus))
            if rank > 0:
                port = role.me.port
        while port in used_ports and (role is None or role.is_head):
            port += 1
        used_ports.add(port)
        pool = unified_pool_bytes(live)
        live_ok = live.protocol >= LIVE_LORAS_PROTOCOL  # an earlier release's node: its adapters in the spec
        loras = self._loras_of(dep, ref, live=live_ok)
        made = assignment_for(
            dep, r, model, runtime, port, unified_pool_bytes=pool, arch=arch, role=role, loras=loras, live_loras=live_ok
        )
        return attrs.evolve(made, asleep=True) if dep.asleep else made

    async def change_node_set(
        self,
        actor: Actor,
        action: str,
        target: str,
        node_id: str,
        change: Callable[[list[Assignment]], list[Assignment]],
        *,
        detail: str,
    ) -> DesiredAssignments:
        """Give one node the set `change(its assignments)`, outside any deployment (a runtime
        qualification's replica, `control.operations.qualification`): one generation up, audited, pushed.
        Takes `lock`; a deployment's commit keeps assignments that are not its own."""
        async with self.lock:
            self._refuse_while_recovering()
            live = self.fleet.get(node_id)
            before = live.desired
            after = attrs.evolve(before, generation=before.generation + 1, assignments=change(list(before.assignments)))
            detail = f"{detail}; {node_id} generation {after.generation}"
            draft = audit_draft(actor, action, target, before, after, detail=detail[:_DETAIL_MAX])
            await self._leadership.write(st.save_desired, after, draft)
            live.desired = attrs.evolve(live.desired, generation=after.generation, assignments=after.assignments)
            self.version += 1
            log.info("%s %s: %s", action, target, detail)
        await self._southbound.push_now(node_id)
        return after

    async def _tell(self, action: str, before: Entry | None, after: Entry | None) -> None:
        for observer in self.observers:
            await observer(action, before.deployment if before else None, after.deployment if after else None)
