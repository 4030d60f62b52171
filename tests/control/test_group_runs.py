"""Group runs (`nexa.control.deployments.grouprun`): the pure lifecycle of a replica group, step by
step, from what its nodes report. The fleet here is a stand-in holding only what `GroupRuns` reads
(each node's state, labels, heartbeat statuses and desired set): the real fleet is exercised end to
end by tests/e2e/test_llama_rpc_group.py (a real llama.cpp RPC group on two `nexa node` agents).
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest

from nexa.contracts.deployments import Deployment, PlacementSpec, Replica, ReplicaMember, Resources, RuntimeOptions
from nexa.contracts.domain import NodeState
from nexa.contracts.fabric import Fabric, FabricInterface
from nexa.contracts.groups import FabricAccess, GroupRunRecord
from nexa.contracts.models import ModelRef
from nexa.contracts.node import NodeInventory
from nexa.contracts.wire import Assignment, AssignmentStatus, DesiredAssignments, RuntimeState
from nexa.control.deployments.grouprun import (
    GROUP_BACKOFF_S,
    GROUP_PORT_OFFSET,
    GroupPhase,
    GroupRuns,
    member_id,
)
from nexa.errors import NotFound
from nexa.telemetry import Metrics
from tests.conftest import gb10_inventory, sample_runtime

PORT = 18000


@attrs.define
class _Node:
    labels: dict[str, str]


@attrs.define
class _Live:
    """What `GroupRuns` reads of a node (`control.fleet.nodes.NodeLive`'s fields of those names)."""

    node: _Node
    desired: DesiredAssignments
    state: NodeState = NodeState.READY
    statuses: list[AssignmentStatus] = attrs.Factory(list)
    inventory: NodeInventory | None = None
    reported_generation: int = 1
    #: When this controller last heard it (None: not since it started).
    last_seen: float | None = 0.0


class _Fleet:
    def __init__(self, lives: dict[str, _Live]) -> None:
        self.lives = lives

    def get(self, node_id: str) -> _Live:
        if node_id not in self.lives:
            raise NotFound(node_id)
        return self.lives[node_id]


def fleet(*, address_b: bool = True) -> _Fleet:
    def live(name: str, address: str | None) -> _Live:
        labels = {"fabric": "ib0"} | ({"fabric-address": address} if address else {})
        return _Live(node=_Node(labels), desired=DesiredAssignments(node_id=name, generation=1))

    return _Fleet({"a": live("a", "10.0.0.1"), "b": live("b", "10.0.0.2" if address_b else None)})


def deployment(command: list[str] | None = None) -> Deployment:
    model = ModelRef(model="m", version="v1")
    replica = Replica(
        id="big-1",
        node_id="a",
        model=model,
        members=[ReplicaMember(rank=0, node_id="a"), ReplicaMember(rank=1, node_id="b")],
    )
    now = time.time()
    return Deployment(
        name="big",
        runtime="llama",
        alias=None,
        model=model,
        replicas=1,
        resources=Resources(),
        options=RuntimeOptions(port=PORT, command=command or []),
        placement=PlacementSpec(),
        created_at=now,
        created_by=None,
        updated_at=now,
        placed=[replica],
        nodes_per_replica=2,
    )


def report(f: _Fleet, node: str, aid: str, state: RuntimeState, restarts: int = 0) -> None:
    f.lives[node].statuses = [AssignmentStatus(assignment_id=aid, state=state, restarts=restarts)]


def runs_for(f: _Fleet, dep: Deployment) -> tuple[GroupRuns, Metrics]:
    metrics = Metrics()
    runs = GroupRuns(f, metrics)  # type: ignore[arg-type]
    assert runs.ensure(dep, command_given=bool(dep.options.command)) == ["group big-1 started (workers first)"]
    return runs, metrics


def sample(metrics: Metrics, name: str, **labels: str) -> Any:
    return metrics.registry.get_sample_value(name, labels)


def test_workers_start_first_the_head_once_they_are_ready_and_only_a_ready_group_serves() -> None:
    f, dep = fleet(), deployment()
    runs, metrics = runs_for(f, dep)
    [r] = dep.placed
    run = runs.get(r)
    assert run is not None and run.phase is GroupPhase.STARTING and run.released() == [1]
    # Ports: the deployment's plus the offset on each node; addresses: each node's fabric address.
    assert [(m.rank, m.node_id, m.address, m.port) for m in run.members] == [
        (0, "a", "10.0.0.1", PORT + GROUP_PORT_OFFSET),
        (1, "b", "10.0.0.2", PORT + GROUP_PORT_OFFSET),
    ]
    assert member_id(r, 0) == "big-1" and member_id(r, 1) == "big-1-rank1"
    assert runs.step(dep, 0.0)[0] == []  # the worker is not Ready yet: nothing changes
    report(f, "b", "big-1-rank1", RuntimeState.READY)
    assert runs.step(dep, 0.0)[0] == ["group big-1: every worker Ready; head started"]
    assert run.phase is GroupPhase.STARTING_HEAD and run.released() == [0, 1]
    assert not runs.serving(r)
    f.lives["a"].statuses = [AssignmentStatus(assignment_id="big-1", state=RuntimeState.READY)]
    assert runs.step(dep, 0.0)[0] == []
    assert run.phase is GroupPhase.READY and runs.serving(r)
    # A controller that runs no group (a follower) goes by the head's readiness alone.
    assert GroupRuns(f).serving(r)  # type: ignore[arg-type]
    assert sample(metrics, "nexa_group_ready", deployment="big", group="big-1") == 1
    assert runs.member_states(r) == {0: "Ready", 1: "Ready"}


def ready_group() -> tuple[_Fleet, Deployment, GroupRuns, Metrics]:
    f, dep = fleet(), deployment()
    runs, metrics = runs_for(f, dep)
    report(f, "b", "big-1-rank1", RuntimeState.READY)
    runs.step(dep, 0.0)
    report(f, "a", "big-1", RuntimeState.READY)
    runs.step(dep, 0.0)
    assert runs.get(dep.placed[0]).phase is GroupPhase.READY  # type: ignore[union-attr]
    return f, dep, runs, metrics


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        (lambda f: report(f, "b", "big-1-rank1", RuntimeState.FAILED), "rank 1 (big-1-rank1) is Failed"),
        (lambda f: report(f, "b", "big-1-rank1", RuntimeState.STARTING), "rank 1 (big-1-rank1) is Starting"),
        (
            lambda f: report(f, "b", "big-1-rank1", RuntimeState.READY, restarts=1),
            "rank 1 (big-1-rank1) was restarted by its node (its runtime ended)",
        ),
        (lambda f: setattr(f.lives["b"], "state", NodeState.UNREACHABLE), "rank 1's node b is Unreachable"),
        (lambda f: report(f, "a", "big-1", RuntimeState.UNHEALTHY), "rank 0 (big-1) is Unhealthy"),
    ],
)
def test_any_member_failing_or_lost_withdraws_the_whole_group_and_it_starts_again_after_a_backoff(
    fault: Any, why: str
) -> None:
    f, dep, runs, metrics = ready_group()
    [r] = dep.placed
    run = runs.get(r)
    assert run is not None
    fault(f)
    changed, next_at = runs.step(dep, 100.0)
    assert changed == [f"group big-1: {why}; every member withdrawn"]
    assert run.phase is GroupPhase.RESTARTING and run.released() == [] and not runs.serving(r)
    assert next_at == 100.0 + GROUP_BACKOFF_S
    assert sample(metrics, "nexa_group_ready", deployment="big", group="big-1") == 0
    assert sample(metrics, "nexa_group_restarts_total", deployment="big", group="big-1") == 1
    assert runs.step(dep, 100.5)[0] == []  # still backing off
    f.lives["b"].state = NodeState.UNREACHABLE
    assert runs.step(dep, 200.0)[0] == []  # not while a member's node is unreachable
    f.lives["b"].state = NodeState.READY
    assert runs.step(dep, 200.0)[0] == ["group big-1 started again (workers first)"]
    assert run.phase is GroupPhase.STARTING and run.released() == [1]
    assert [m.port for m in run.members] == [PORT + GROUP_PORT_OFFSET] * 2  # kept across restarts
    # Failing again before it is Ready doubles the wait.
    report(f, "b", "big-1-rank1", RuntimeState.FAILED)
    assert runs.step(dep, 300.0)[1] == 300.0 + 2 * GROUP_BACKOFF_S


def test_a_group_without_a_fabric_address_or_with_a_full_command_stays_pending_and_says_why() -> None:
    f = fleet(address_b=False)
    dep = deployment()
    runs = GroupRuns(f)  # type: ignore[arg-type]
    assert runs.ensure(dep, command_given=False) == []
    run = runs.get(dep.placed[0])
    assert run is not None and run.phase is GroupPhase.PENDING and run.released() == []
    assert run.detail == (
        "node b has no fabric address: link its RDMA port so it discovers one, or set its fabric-address label"
    )
    assert runs.step(dep, 0.0) == ([], float("inf"))
    commanded = deployment(["llama-server"])
    runs = GroupRuns(fleet())  # type: ignore[arg-type]
    runs.ensure(commanded, command_given=True)
    pending = runs.get(commanded.placed[0])
    assert pending is not None and pending.phase is GroupPhase.PENDING and "options.command" in pending.detail


def test_member_ports_skip_what_the_node_uses_and_another_starting_group_holds() -> None:
    f, dep = fleet(), deployment()
    other = attrs.evolve(dep.placed[0], id="big-2")
    taken = PORT + GROUP_PORT_OFFSET
    runs = GroupRuns(f)  # type: ignore[arg-type]
    runs.ensure(attrs.evolve(dep, placed=[dep.placed[0], other]), command_given=False)
    first, second = runs.get(dep.placed[0]), runs.get(other)
    assert first is not None and second is not None
    assert [m.port for m in first.members] == [taken, taken]
    assert [m.port for m in second.members] == [taken + 1, taken + 1]
    assert runs.ports_on("a") == {taken, taken + 1}
    runs.forget({"big-1"})
    assert runs.ports_on("a") == {taken}


def test_a_node_that_has_not_applied_its_newest_set_says_nothing_of_its_member_yet() -> None:
    f, dep, runs, _ = ready_group()
    run = runs.get(dep.placed[0])
    assert run is not None
    b = f.lives["b"]
    b.desired = attrs.evolve(b.desired, generation=2)  # a newer set is on its way to b
    report(f, "b", "big-1-rank1", RuntimeState.FAILED)  # what b said of the set before it
    assert runs.step(dep, 0.0)[0] == [] and run.phase is GroupPhase.READY
    b.reported_generation = 2
    assert runs.step(dep, 0.0)[0] == ["group big-1: rank 1 (big-1-rank1) is Failed; every member withdrawn"]


# ---- a controller that takes the lead continues each group from its stored record ---------------


def set_holds(f: _Fleet, dep: Deployment, runs: GroupRuns, ranks: list[int]) -> None:
    """Each node's desired set holds these ranks' assignments, as a leader's commit wrote them."""
    [r] = dep.placed
    run = runs.get(r)
    assert run is not None
    for m in r.members:
        spec = attrs.evolve(sample_runtime(PORT), group=run.role(m.rank, r.id, FabricAccess.TCP))
        held = [Assignment(id=member_id(r, m.rank), deployment="big", runtime=spec)] if m.rank in ranks else []
        live = f.lives[m.node_id]
        live.desired = attrs.evolve(live.desired, assignments=held)


def new_leader(f: _Fleet, records: list[GroupRunRecord], *, at: float = 50.0, wall: float = 1000.0) -> GroupRuns:
    """The runs of a controller that takes the lead at trio time `at`, Unix time `wall`."""
    metrics = Metrics()
    runs = GroupRuns(f, metrics, now=lambda: at, wall=lambda: wall)  # type: ignore[arg-type]
    runs.resume(records)
    return runs


def test_a_ready_group_stays_ready_and_serving_when_another_controller_takes_the_lead() -> None:
    f, dep, old, _ = ready_group()
    set_holds(f, dep, old, [0, 1])
    records = old.records(dep)
    assert [(r.replica_id, r.phase, r.failures, r.restart_at) for r in records] == [("big-1", "ready", 0, 0.0)]
    runs = new_leader(f, records)
    [r] = dep.placed
    assert runs.ensure(dep, command_given=False) == []  # nothing withdrawn, nothing sent again
    run = runs.get(r)
    assert run is not None and run.phase is GroupPhase.READY and runs.serving(r)
    assert run.members == old.get(r).members  # type: ignore[union-attr]
    assert runs.unsaved(dep) is None  # the store holds what it runs
    assert runs.step(dep, 60.0)[0] == [] and run.phase is GroupPhase.READY
    # A member's node this controller has not heard yet (it just took the lead) is not lost: the
    # group waits for it (the reconciler places it again if it never comes).
    f.lives["b"].state, f.lives["b"].last_seen = NodeState.UNREACHABLE, None
    assert runs.step(dep, 60.5)[0] == [] and run.phase is GroupPhase.READY
    f.lives["b"].state, f.lives["b"].last_seen = NodeState.READY, 60.6
    # A member failing after the takeover restarts the group as usual.
    report(f, "b", "big-1-rank1", RuntimeState.FAILED)
    assert runs.step(dep, 61.0)[0] == ["group big-1: rank 1 (big-1-rank1) is Failed; every member withdrawn"]


@pytest.mark.parametrize(("ranks", "phase"), [([1], "starting"), ([0, 1], "starting-head")])
def test_a_group_caught_half_started_at_a_takeover_is_restarted_whole(ranks: list[int], phase: str) -> None:
    f, dep = fleet(), deployment()
    old, _ = runs_for(f, dep)
    if phase == "starting-head":
        report(f, "b", "big-1-rank1", RuntimeState.READY)
        old.step(dep, 0.0)
    set_holds(f, dep, old, ranks)
    [record] = old.records(dep)
    assert record.phase == phase
    runs = new_leader(f, [record], at=50.0, wall=1000.0)
    changed = runs.ensure(dep, command_given=False)
    assert changed == [f"group big-1: caught {phase} at a change of leader; every member withdrawn"]
    run = runs.get(dep.placed[0])
    assert run is not None and run.phase is GroupPhase.RESTARTING and run.released() == []
    assert run.restart_at == 50.0 + GROUP_BACKOFF_S and not runs.serving(dep.placed[0])
    [saved] = runs.unsaved(dep) or []  # due in the store (with the withdrawal's commit)
    assert (saved.phase, saved.failures, saved.restarts, saved.restart_at) == ("restarting", 1, 1, 1000.0 + 1)
    # Then started again, workers first, on the ports it had.
    assert runs.step(dep, 51.0)[0] == ["group big-1 started again (workers first)"]
    assert run.released() == [1] and run.members == record.members


def test_a_restarting_group_waits_out_its_backoff_across_a_takeover_and_stale_runs_are_dropped() -> None:
    f, dep, old, _ = ready_group()
    report(f, "b", "big-1-rank1", RuntimeState.FAILED)
    old.step(dep, 100.0)
    [record] = old.records(dep)
    assert record.phase == "restarting" and record.failures == 1 and record.restarts == 1
    restart_wall = record.restart_at
    # Taken over 0.4 s (Unix time) later: 0.6 s of the first backoff is left.
    runs = new_leader(f, [record], at=7.0, wall=restart_wall - 0.6)
    assert runs.ensure(dep, command_given=False) == []  # no member in any set: nothing to withdraw
    run = runs.get(dep.placed[0])
    assert run is not None and run.phase is GroupPhase.RESTARTING
    assert run.restart_at == pytest.approx(7.6)
    assert runs.step(dep, 7.5)[0] == []
    assert runs.step(dep, 7.6)[0] == ["group big-1 started again (workers first)"]
    # A failure now doubles the wait: the failures in a row came along.
    report(f, "b", "big-1-rank1", RuntimeState.FAILED)
    assert runs.step(dep, 8.0)[1] == 8.0 + 2 * GROUP_BACKOFF_S
    # A controller that stops leading runs no group; taking the lead again, it reads the store anew.
    old.stand_down()
    assert old.get(dep.placed[0]) is None and old.serving(dep.placed[0])


def test_a_member_discovered_on_its_fabric_interface_names_it_for_nccl_and_gloo() -> None:
    f, dep = fleet(address_b=False), deployment()
    discovered = Fabric(
        interfaces=[
            FabricInterface(name="enP2p1s0f0np0", addresses=["fd10::2/64"]),
            FabricInterface(name="enp1s0f0np0", addresses=["10.0.0.2/24"]),
        ],
        address="10.0.0.2",
    )
    f.lives["b"].inventory = attrs.evolve(gb10_inventory("b"), fabric=discovered)
    runs = GroupRuns(f)  # type: ignore[arg-type]
    runs.ensure(dep, command_given=False)
    run = runs.get(dep.placed[0])
    assert run is not None
    # Node a's address is its fabric-address label's: no interface known, none named.
    assert [(m.address, m.interface) for m in run.members] == [("10.0.0.1", ""), ("10.0.0.2", "enp1s0f0np0")]
    assert run.role(1, "big-1", FabricAccess.RDMA).me.interface == "enp1s0f0np0"
