"""Replica groups at run time: started, watched and restarted as one (`GroupRuns`).

A group replica (`Replica.members`, `nodes_per_replica` above 1) runs one assignment per member,
each on its member's node: the head (rank 0) under the replica's own id (what the gateway routes
to and `Desired.ready` reads), every other rank under `member_id` (never routed to). Each carries
`RuntimeSpec.group` (`contracts.groups.GroupRole`): every member's fabric address and port.

Addresses: a member's node's discovered fabric address (`inventory.fabric.address`), with the
interface it sits on (`fabric_interface`: what NCCL and Gloo are pointed at); for a node whose
fabric is only the admin's `fabric` label, its `fabric-address` label (`FABRIC_ADDRESS_LABEL`, an
IPv4 address: label values take no colons), with no interface. Without either the group cannot start: it stays
`pending`, saying which node lacks one. Ports: each member's from the deployment's `options.port`
plus `GROUP_PORT_OFFSET`, the first one its node uses for nothing else (no other assignment's
port nor group port there, nor another group's being started), chosen once when the group is
first started and kept across its restarts.

The phases (`GroupPhase`): `starting` sends only the workers (ranks above 0); once every one
reports Ready the head is sent too (`starting-head`); the group is `ready` when the head's
readiness passes. If any member fails (Failed, Unhealthy or Stopped, or no longer Ready once it
was) or its node is Unreachable or Revoked, every member is withdrawn from its node's set at once
(`restarting`) and the whole group is sent again, workers first, after a backoff doubling from
`GROUP_BACKOFF_S` to `GROUP_BACKOFF_MAX_S` (reset once it is Ready), and only when every member's
node is reachable. So no node keeps half a group: a member whose peers are gone is withdrawn, and
an agent that restarts gets a set without it. A draining member's group is placed again whole on
other nodes by the reconciler (`reconciler.py`), as a lost member's is.

The leader keeps each run in the store (`contracts.groups.GroupRunRecord`: phase, members'
endpoints, failures in a row, restarts, when a restarting group is sent again), written in the
same transaction as the node sets a change touches (`Desired.commit`), or alone when only the
phase moved (the group became Ready). A controller that starts or takes the lead reads them back
(`resume`) and continues each group from what its record and the node sets say: a `ready` group
whose every member is in its node's set stays `ready` and serving (nothing is withdrawn; a member
that then fails restarts it as usual); a `restarting` one waits out what is left of its backoff;
one caught half started (`starting` or `starting-head`, or `ready` with a member missing from its
set) is restarted whole, as a failure: every member withdrawn, sent again after the backoff. A
controller that stops leading drops its runs (`stand_down`): the next leader's are the truth.
Groups with no record (a store from before records were kept) are found in the node sets: a group
whose head is there is `starting-head` (then `ready` at once if it is), one with only workers
`starting`; ports are read back from them.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

import attrs
import trio

from nexa.contracts.deployments import Deployment, Replica
from nexa.contracts.domain import NodeState
from nexa.contracts.groups import FabricAccess, GroupMember, GroupRole, GroupRunRecord
from nexa.contracts.node import LabelKey
from nexa.contracts.wire import Assignment, AssignmentStatus, RuntimeState
from nexa.control.deployments.records import all_replicas
from nexa.control.fleet import grants
from nexa.control.fleet.nodes import Fleet, NodeLive
from nexa.errors import NotFound
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: The node label giving the fabric address of a node whose fabric is the admin's label.
FABRIC_ADDRESS_LABEL: Final = "fabric-address"
#: A member's port is searched from the deployment's `options.port` plus this.
GROUP_PORT_OFFSET: Final = 1000
#: The first restart's wait (seconds); it doubles with each failure in a row up to the max.
GROUP_BACKOFF_S: Final = 1.0
GROUP_BACKOFF_MAX_S: Final = 60.0
#: States in which a member's runtime has failed (a member seen Ready and then anything else has too).
_FAILED: Final = frozenset({RuntimeState.FAILED, RuntimeState.UNHEALTHY, RuntimeState.STOPPED})
#: Node states in which a member's node has lost it.
_LOST: Final = frozenset({NodeState.UNREACHABLE, NodeState.REVOKED})


class GroupPhase(enum.StrEnum):
    """Where a group replica stands (`GroupStatus.state`)."""

    #: Cannot start (why in its detail): no member is sent.
    PENDING = "pending"
    #: The workers are sent; the head waits for every one to be Ready.
    STARTING = "starting"
    #: Every member is sent; the head's readiness is awaited.
    STARTING_HEAD = "starting-head"
    #: The head is Ready: the group serves (the gateway routes to the head only).
    READY = "ready"
    #: A member failed or was lost: every member is withdrawn until the group starts again.
    RESTARTING = "restarting"


def member_id(replica: Replica, rank: int) -> str:
    """The id of a rank's assignment: the replica's own for the head, `<replica>-rank<N>` otherwise."""
    return replica.id if rank == 0 else f"{replica.id}-rank{rank}"


@attrs.define
class GroupRun:
    """One group replica's run: its phase, its members' fabric endpoints and its failures in a row."""

    phase: GroupPhase
    detail: str = ""
    #: Its deployment's name (its metrics' label).
    deployment: str = ""
    #: Every member's address and port, by rank (empty while pending).
    members: list[GroupMember] = attrs.Factory(list)
    failures: int = 0
    #: When a restarting group is sent again (trio clock).
    restart_at: float = 0.0
    #: The ranks seen Ready since the last start.
    seen_ready: set[int] = attrs.Factory(set)
    #: Each rank's crash restarts as its node first reported them since the last start: a node
    #: that restarts a member by itself (its container died) has failed the group.
    restarts: dict[int, int] = attrs.Factory(dict)
    #: When a restarting group is sent again, as Unix time (what its record keeps; 0 otherwise).
    restart_wall: float = 0.0
    #: Every restart of the group since it was first started (kept across leaders).
    total_restarts: int = 0

    def released(self) -> list[int]:
        """The ranks whose assignments are in their nodes' sets now."""
        if self.phase is GroupPhase.STARTING:
            return list(range(1, len(self.members)))
        if self.phase in (GroupPhase.STARTING_HEAD, GroupPhase.READY):
            return list(range(len(self.members)))
        return []

    def role(self, rank: int, group: str, fabric: FabricAccess) -> GroupRole:
        return GroupRole(group=group, rank=rank, members=list(self.members), fabric=fabric)

    def record(self, replica_id: str) -> GroupRunRecord:
        """What the store keeps of this run (see the module)."""
        return GroupRunRecord(
            replica_id=replica_id,
            deployment=self.deployment,
            phase=str(self.phase),
            detail=self.detail,
            members=list(self.members),
            failures=self.failures,
            restarts=self.total_restarts,
            restart_at=self.restart_wall if self.phase is GroupPhase.RESTARTING else 0.0,
        )


def backoff_s(failures: int) -> float:
    """The wait before a group's restart after `failures` failures in a row before this one."""
    return min(GROUP_BACKOFF_MAX_S, GROUP_BACKOFF_S * 2.0**failures)


def fabric_address(live: NodeLive) -> str | None:
    """A node's fabric address: the one it discovered, else its `fabric-address` label (see the module)."""
    found = live.inventory.fabric.address if live.inventory is not None else None
    if found:
        return found
    inv = live.inventory
    labelled = grants.labels(live.node.labels, inv.labels.items() if inv is not None else ()).get(
        LabelKey(FABRIC_ADDRESS_LABEL)
    )
    if not labelled:
        return None
    try:
        return str(ipaddress.ip_address(labelled))
    except ValueError:
        return None


def fabric_interface(live: NodeLive, address: str) -> str:
    """The interface of `live`'s discovered fabric that holds `address` ("" when none does)."""
    fabric = live.inventory.fabric if live.inventory is not None else None
    if fabric is None:
        return ""
    wanted = ipaddress.ip_address(address)
    for interface in fabric.interfaces:
        for cidr in interface.addresses:
            with contextlib.suppress(ValueError):
                if ipaddress.ip_interface(cidr).ip == wanted:
                    return interface.name
    return ""


def ports_in_use(assignments: Iterable[Assignment]) -> set[int]:
    """Every port a node's assignments use: their runtimes' and their group members' own."""
    used = set()
    for a in assignments:
        used.add(a.runtime.port)
        if a.runtime.group is not None:
            used.add(a.runtime.group.me.port)
    return used


class GroupRuns:
    """Every group replica's run (in memory, kept in the store by the leader; see the module)."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics | None = None,
        *,
        now: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`now`: the clock `restart_at` and `step` are in (trio's); `wall`: the records' (Unix time)."""
        self._fleet = fleet
        self._metrics = metrics
        self._now = now
        self._wall = wall
        self.runs: dict[str, GroupRun] = {}
        #: The stored records not continued yet (`resume`), by replica id.
        self._resume: dict[str, GroupRunRecord] = {}
        #: What the store holds of each run, as last written or read.
        self._saved: dict[str, GroupRunRecord] = {}

    def resume(self, records: Iterable[GroupRunRecord]) -> None:
        """This controller (re)starts leading: forget every run it held (a former term's may be stale)
        and continue each group from its stored record at its next `ensure` (see the module)."""
        self.stand_down()
        self._resume = {rec.replica_id: rec for rec in records}
        self._saved = dict(self._resume)

    def follow(self, records: Iterable[GroupRunRecord]) -> None:
        """A controller that does not lead shows the leader's runs as the store holds them (`shown`)."""
        self._saved = {rec.replica_id: rec for rec in records}

    def shown(self, replica: Replica) -> tuple[str, str] | None:
        """(state, detail) of a group replica's run: this controller's own while it leads, else the
        leader's as last read from the store; None when neither knows it."""
        run = self.runs.get(replica.id)
        if run is not None:
            return str(run.phase), run.detail
        record = self._saved.get(replica.id)
        return (record.phase, record.detail) if record is not None else None

    def stand_down(self) -> None:
        """This controller stops leading: it runs no group (the leader's records are the truth)."""
        self.forget(set())
        self._resume.clear()
        self._saved.clear()

    def records(self, dep: Deployment) -> list[GroupRunRecord]:
        """The records of `dep`'s group replicas' runs now (what `Desired.commit` writes)."""
        return [run.record(r.id) for r in all_replicas(dep) if r.members and (run := self.runs.get(r.id)) is not None]

    def unsaved(self, dep: Deployment) -> list[GroupRunRecord] | None:
        """`dep`'s records when the store holds other ones (a phase moved without a commit), else None."""
        now = self.records(dep)
        held = {rid: rec for rid, rec in self._saved.items() if rec.deployment == dep.name}
        return None if held == {rec.replica_id: rec for rec in now} else now

    def saved(self, name: str, records: list[GroupRunRecord]) -> None:
        """The store now holds `records` as deployment `name`'s group runs."""
        for rid in [rid for rid, rec in self._saved.items() if rec.deployment == name]:
            del self._saved[rid]
        self._saved.update((rec.replica_id, rec) for rec in records)

    def get(self, replica: Replica) -> GroupRun | None:
        return self.runs.get(replica.id)

    def serving(self, replica: Replica) -> bool:
        """Whether a replica may be routed to as far as its group goes: a plain replica always, a
        group while its run is `ready`. A controller that runs no group (a follower: the leader
        starts and watches them) has no run for it, and goes by its head's readiness alone."""
        if not replica.members:
            return True
        run = self.runs.get(replica.id)
        return run is None or run.phase is GroupPhase.READY

    def ports_on(self, node_id: str, *, but: str = "") -> set[int]:
        """The member ports the groups being run hold on a node (`but`: leave that replica's out)."""
        return {m.port for rid, run in self.runs.items() if rid != but for m in run.members if m.node_id == node_id}

    def ensure(self, dep: Deployment, command_given: bool) -> list[str]:
        """A run for each of `dep`'s group replicas that has none: continued from its stored record
        (`resume`), else recovered from the node sets when they hold its assignments, else a new
        one that starts its workers (or pending, and why). What changes the node sets, in words
        (a commit is due when not empty): the groups that start, those withdrawn to restart whole."""
        changed = []
        for r in all_replicas(dep):
            if not r.members or r.id in self.runs:
                continue
            record = self._resume.pop(r.id, None)
            if record is not None and record.phase != GroupPhase.PENDING:
                run, why = self._resumed(r, record)
                self.runs[r.id] = run
                run.deployment = dep.name
                self._ready(run, r.id, run.phase is GroupPhase.READY)
                if why:
                    changed.append(why)
                continue
            recovered = self._recovered(r)
            self.runs[r.id] = run = recovered or self._new(dep, r, command_given)
            run.deployment = dep.name
            self._ready(run, r.id, False)
            if recovered is None and run.phase is GroupPhase.STARTING:
                changed.append(f"group {r.id} started (workers first)")
        return changed

    def _resumed(self, r: Replica, record: GroupRunRecord) -> tuple[GroupRun, str]:
        """A stored run continued (see the module), and what that changes in the node sets, in words."""
        held = set(self._in_sets(r))
        run = GroupRun(
            phase=GroupPhase(record.phase),
            detail=record.detail,
            deployment=record.deployment,
            members=list(record.members),
            failures=record.failures,
            total_restarts=record.restarts,
        )
        if self._metrics is not None and record.restarts:
            self._metrics.group_restarts.labels(record.deployment, r.id).inc(record.restarts)
        whole = held == {m.rank for m in r.members}
        if run.phase is GroupPhase.READY and whole:
            return run, ""
        if run.phase is GroupPhase.RESTARTING:
            run.restart_wall = record.restart_at
            run.restart_at = self._now() + max(0.0, record.restart_at - self._wall())
            return run, f"group {r.id}: still restarting; every member withdrawn" if held else ""
        state = "Ready but not every member in its node's set" if run.phase is GroupPhase.READY else str(run.phase)
        self._restart(run, r.id, f"the leading controller changed while the group was {state}", self._now())
        return run, f"group {r.id}: caught {state} at a change of leader; every member withdrawn"

    def _restart(self, run: GroupRun, replica_id: str, why: str, now: float) -> float:
        """Withdraw every member of `run` and send them again after the backoff; the wait."""
        wait = backoff_s(run.failures)
        run.failures += 1
        run.total_restarts += 1
        self._ready(run, replica_id, False)
        if self._metrics is not None:
            self._metrics.group_restarts.labels(run.deployment, replica_id).inc()
        run.phase, run.restart_at, run.seen_ready, run.restarts = GroupPhase.RESTARTING, now + wait, set(), {}
        run.restart_wall = self._wall() + wait
        run.detail = f"{why}; every member stopped, started again in {wait:g} s"
        log.warning("deployment %s: group %s %s", run.deployment, replica_id, run.detail)
        return wait

    def active(self, dep: Deployment) -> bool:
        """Whether any group replica of `dep` is started (its members are watched)."""
        return any(
            (run := self.runs.get(r.id)) is not None and run.phase is not GroupPhase.PENDING for r in all_replicas(dep)
        )

    def forget(self, live_ids: set[str]) -> None:
        """Drop the runs of replicas no deployment has any more."""
        for rid in [rid for rid in self._resume if rid not in live_ids]:
            del self._resume[rid]
        for rid in [rid for rid in self.runs if rid not in live_ids]:
            run = self.runs.pop(rid)
            if self._metrics is not None:
                with contextlib.suppress(KeyError):
                    self._metrics.group_ready.remove(run.deployment, rid)
                with contextlib.suppress(KeyError):
                    self._metrics.group_restarts.remove(run.deployment, rid)

    def _ready(self, run: GroupRun, replica_id: str, ready: bool) -> None:
        if self._metrics is not None:
            self._metrics.group_ready.labels(run.deployment, replica_id).set(1 if ready else 0)

    def _in_sets(self, r: Replica) -> dict[int, Assignment]:
        """By rank, the members' assignments their nodes' desired sets hold."""
        found: dict[int, Assignment] = {}
        for m in r.members:
            try:
                live = self._fleet.get(m.node_id)
            except NotFound:
                continue
            for a in live.desired.assignments:
                if a.id == member_id(r, m.rank) and a.runtime.group is not None:
                    found[m.rank] = a
        return found

    def _recovered(self, r: Replica) -> GroupRun | None:
        found = self._in_sets(r)
        if not found:
            return None
        members = next(iter(found.values())).runtime.group.members  # type: ignore[union-attr]
        phase = GroupPhase.STARTING_HEAD if 0 in found else GroupPhase.STARTING
        return GroupRun(phase=phase, members=list(members))

    def _new(self, dep: Deployment, r: Replica, command_given: bool) -> GroupRun:
        if command_given:
            return GroupRun(
                phase=GroupPhase.PENDING,
                detail="a full options.command gives no rank its part in the group: use settings and extra_args",
            )
        members: list[GroupMember] = []
        for m in r.members:
            live = self._fleet.get(m.node_id)
            address = fabric_address(live)
            if address is None:
                return GroupRun(
                    phase=GroupPhase.PENDING,
                    detail=(
                        f"node {m.node_id} has no fabric address: link its RDMA port so it discovers one, "
                        f"or set its {FABRIC_ADDRESS_LABEL} label"
                    ),
                )
            used = ports_in_use(live.desired.assignments) | self.ports_on(m.node_id, but=r.id)
            port = dep.options.port + GROUP_PORT_OFFSET
            while port in used:
                port += 1
            interface = fabric_interface(live, address)
            members.append(GroupMember(rank=m.rank, node_id=m.node_id, address=address, port=port, interface=interface))
        return GroupRun(phase=GroupPhase.STARTING, members=members)

    def step(self, dep: Deployment, now: float) -> tuple[list[str], float]:
        """Advance every group replica of `dep` one step from what its nodes report (see the module):
        what changed, in words (a commit is due when not empty), and when to look again."""
        changed: list[str] = []
        next_at = float("inf")
        for r in all_replicas(dep):
            run = self.runs.get(r.id)
            if run is None or run.phase is GroupPhase.PENDING:
                continue
            if run.phase is GroupPhase.RESTARTING:
                if now < run.restart_at:
                    next_at = min(next_at, run.restart_at)
                elif all(self._node_state(m.node_id) not in _LOST for m in r.members):
                    run.phase, run.detail, run.seen_ready, run.restarts = GroupPhase.STARTING, "", set(), {}
                    run.restart_wall = 0.0
                    changed.append(f"group {r.id} started again (workers first)")
                continue
            why = self._failure(r, run)
            if why is not None:
                self._restart(run, r.id, why, now)
                changed.append(f"group {r.id}: {why}; every member withdrawn")
                next_at = min(next_at, run.restart_at)
                continue
            states = self._states(r)
            run.seen_ready |= {rank for rank, s in states.items() if s.state is RuntimeState.READY}
            for rank, s in states.items():
                run.restarts.setdefault(rank, s.restarts)
            if run.phase is GroupPhase.STARTING and all(rank in run.seen_ready for rank in run.released()):
                run.phase = GroupPhase.STARTING_HEAD
                changed.append(f"group {r.id}: every worker Ready; head started")
            elif run.phase is GroupPhase.STARTING_HEAD and 0 in run.seen_ready:
                run.phase, run.failures, run.detail = GroupPhase.READY, 0, ""
                self._ready(run, r.id, True)
                log.info("deployment %s: group %s Ready", dep.name, r.id)
        return changed, next_at

    def member_states(self, r: Replica) -> dict[int, str]:
        """Each member's runtime state as its node reports it ("" when it reports none)."""
        states = self._states(r)
        return {m.rank: str(states[m.rank].state) if m.rank in states else "" for m in r.members}

    def _node_state(self, node_id: str) -> NodeState | None:
        try:
            return self._fleet.get(node_id).state
        except NotFound:
            return None

    def _heard(self, node_id: str) -> bool:
        """Whether this controller has heard the node since it started: one that has not yet (it
        just started or took the lead, the node has not reached it) is not lost for its group
        (the reconciler places the group again if the node never comes, `Reconciler._gone_at`)."""
        return self._fleet.get(node_id).last_seen is not None

    def _caught_up(self, node_id: str) -> bool:
        live = self._fleet.get(node_id)
        return live.reported_generation >= live.desired.generation

    def _states(self, r: Replica) -> dict[int, AssignmentStatus]:
        """Each member's status, from the nodes that report on their current set: a node that has
        not applied its newest set yet (its heartbeat names an older generation) says nothing of
        its member until it has (a withdrawn member's old Failed is no failure of the new start)."""
        out: dict[int, AssignmentStatus] = {}
        for m in r.members:
            try:
                live = self._fleet.get(m.node_id)
            except NotFound:
                continue
            if live.reported_generation < live.desired.generation:
                continue
            statuses = live.statuses
            aid = member_id(r, m.rank)
            found = next((s for s in statuses if s.assignment_id == aid), None)
            if found is not None:
                out[m.rank] = found
        return out

    def _failure(self, r: Replica, run: GroupRun) -> str | None:
        """Why the group must stop now, or None."""
        for m in r.members:
            state = self._node_state(m.node_id)
            if state is None or state is NodeState.REVOKED or (state in _LOST and self._heard(m.node_id)):
                return f"rank {m.rank}'s node {m.node_id} is {state or 'gone'}"
        states = self._states(r)
        for rank in run.released():
            if not self._caught_up(r.members[rank].node_id):
                continue  # its node has not applied its newest set: nothing known yet
            status = states.get(rank)
            got = status.state if status is not None else None
            if got in _FAILED or (rank in run.seen_ready and got is not RuntimeState.READY):
                return f"rank {rank} ({member_id(r, rank)}) is {got or 'not reported'}"
            if status is not None and status.restarts > run.restarts.get(rank, status.restarts):
                return f"rank {rank} ({member_id(r, rank)}) was restarted by its node (its runtime ended)"
        return None
