"""Group replicas (`nodes_per_replica` above 1), placed: the whole group on nodes that share a
fabric, or nothing, with every fabric's candidate set explained.

The nodes are the lab's four DGX Spark GB10s (tests/support/scheduler.py: the recorded
nvidia-smi and meminfo fixtures through the real inventory path), two on fabric ib0 and two on
ib1; the unified-memory case goes through the fleet side (`snapshot_from` over `NodeLive`s
holding the recorded GB10 inventory, `placement_request` from a deployment record).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import attrs

from nexa.adapters.base import ENGINE_OVERHEAD_BYTES
from nexa.config import PlacementConfig
from nexa.contracts.deployments import Deployment, PlacementSpec, Resources, RuntimeOptions
from nexa.contracts.domain import Node, NodeId, NodeState
from nexa.contracts.fabric import Fabric
from nexa.contracts.models import ModelRef, RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.contracts.placement import (
    FabricCandidates,
    PlacementDecision,
    PlacementNode,
    PlacementPolicy,
    PlacementRequest,
    ReplicaPlacement,
)
from nexa.contracts.wire import DesiredAssignments
from nexa.control.deployments import placement_request, snapshot_from
from nexa.control.deployments.groups import NO_FABRIC
from nexa.control.deployments.records import new_replicas
from nexa.control.deployments.scheduler import place
from nexa.control.deployments.snapshot import Hold, node_fabric
from nexa.control.fleet.nodes import NodeLive
from nexa.security import ReplayWindow
from tests.conftest import gb10_inventory
from tests.support.adapters import IMAGES
from tests.support.adapters import model as adapter_model
from tests.support.scheduler import GIB, SPARKS, by_id, lab, vllm

FABRICS = {"spark-1": "ib0", "spark-2": "ib0", "spark-3": "ib1", "spark-4": "ib1"}


def sparks(**changes: Mapping[str, Any]) -> list[PlacementNode]:
    """The four sparks on their fabrics; `changes`: per node id, fields to change."""
    nodes = [attrs.evolve(by_id(lab(), s), fabric=FABRICS[s]) for s in SPARKS]
    return [attrs.evolve(n, **changes.get(n.id.replace("-", "_"), {})) for n in nodes]


def pair(**changes: object) -> PlacementRequest:
    """A group of two ranks, 60 GiB of unified memory and the shared GPU each."""
    return vllm(**{"nodes_per_replica": 2, "memory_bytes": 60 * GIB, **changes})


def members(decision: PlacementDecision) -> list[tuple[int, int, str]]:
    return [(p.replica, p.rank, p.node_id) for p in decision.placements]


def fabric(decision: PlacementDecision, name: str | None) -> FabricCandidates:
    [found] = [f for f in decision.fabrics if f.fabric == name]
    return found


def test_a_group_of_two_over_four_nodes_on_two_fabrics_takes_one_fabric_whole() -> None:
    decision = place(sparks(), pair())
    assert decision.feasible and decision.reason is None
    # Spread, all alike: the first fabric by name; ranks follow node id (rank 0 is the head).
    assert decision.placements == (
        ReplicaPlacement(node_id="spark-1", replica=0, gpus=("nvidia.com/gpu=0",), rank=0),
        ReplicaPlacement(node_id="spark-2", replica=0, gpus=("nvidia.com/gpu=0",), rank=1),
    )
    assert decision.fabrics == (
        FabricCandidates(
            fabric="ib0",
            nodes=("spark-1", "spark-2"),
            fit=("spark-1", "spark-2"),
            groups_placed=1,
            detail="fabric ib0: 2 of 2 node(s) fit, took group(s) 0",
        ),
        FabricCandidates(
            fabric="ib1",
            nodes=("spark-3", "spark-4"),
            fit=("spark-3", "spark-4"),
            groups_placed=0,
            detail="fabric ib1: 2 of 2 node(s) fit, not taken: another fabric's set came first",
        ),
    )
    # Every node is explained as for a single-node replica, with the ranks it took.
    assert [(e.node_id, e.eligible, e.replicas_placed) for e in decision.explanations] == [
        ("spark-1", True, 1),
        ("spark-2", True, 1),
        ("spark-3", True, 0),
        ("spark-4", True, 0),
    ]


def test_spread_puts_the_next_group_where_the_deployment_has_fewest_and_binpack_packs() -> None:
    assert {n for _, _, n in members(place(sparks(), pair(), existing={"spark-1": 1}))} == {"spark-3", "spark-4"}
    two = place(sparks(), pair(replicas=2))
    assert members(two) == [(0, 0, "spark-1"), (0, 1, "spark-2"), (1, 0, "spark-3"), (1, 1, "spark-4")]
    assert [f.groups_placed for f in two.fabrics] == [1, 1]
    # Binpack: both groups on one fabric while its nodes have room (2 x 40 GiB of ~113 GiB each).
    packed = place(
        sparks(), vllm(nodes_per_replica=2, memory_bytes=40 * GIB, replicas=2, policy=PlacementPolicy.BINPACK)
    )
    assert members(packed) == [(0, 0, "spark-1"), (0, 1, "spark-2"), (1, 0, "spark-1"), (1, 1, "spark-2")]
    assert fabric(packed, "ib0").detail == "fabric ib0: 2 of 2 node(s) fit, took group(s) 0, 1"


def test_a_cordoned_node_takes_its_fabric_out_and_the_group_goes_to_the_other() -> None:
    decision = place(sparks(spark_1={"state": NodeState.CORDONED}), pair())
    assert decision.feasible
    assert members(decision) == [(0, 0, "spark-3"), (0, 1, "spark-4")]
    ib0 = fabric(decision, "ib0")
    assert (ib0.fit, ib0.groups_placed) == (("spark-2",), 0)
    assert ib0.detail == "fabric ib0: 1 of 2 node(s) fit, a group needs 2 (spark-1: node is Cordoned)"
    assert fabric(decision, "ib1").detail == "fabric ib1: 2 of 2 node(s) fit, took group(s) 0"


def test_too_little_memory_on_one_node_refuses_its_fabric_and_both_refused_place_nothing() -> None:
    low = {"accelerator_memory_free_bytes": 30 * GIB, "host_memory_free_bytes": 30 * GIB}
    decision = place(sparks(spark_4=low), pair())
    assert members(decision) == [(0, 0, "spark-1"), (0, 1, "spark-2")]
    assert fabric(decision, "ib1").detail == (
        "fabric ib1: 1 of 2 node(s) fit, a group needs 2 (spark-4: needs 60.0 GiB of unified memory, 30.0 GiB free)"
    )
    # Both fabrics refused: never half a group, and the reason names each fabric's refusal.
    neither = place(sparks(spark_1={"state": NodeState.CORDONED}, spark_4=low), pair())
    assert not neither.feasible and neither.placements == ()
    assert neither.reason == (
        "no fabric has 2 nodes that fit a group; "
        "fabric ib0: 1 of 2 node(s) fit, a group needs 2 (spark-1: node is Cordoned); "
        "fabric ib1: 1 of 2 node(s) fit, a group needs 2 (spark-4: needs 60.0 GiB of unified memory, 30.0 GiB free)"
    )
    assert all(e.replicas_placed == 0 for e in neither.explanations)


def test_nodes_without_a_fabric_are_never_grouped() -> None:
    bare = [attrs.evolve(n, fabric=None) for n in sparks()]
    decision = place(bare, pair())
    assert not decision.feasible and decision.placements == ()
    assert decision.fabrics == (FabricCandidates(fabric=None, nodes=SPARKS, fit=SPARKS, detail=NO_FABRIC),)
    assert decision.reason == (
        "no fabric has 2 nodes that fit a group; "
        "4 node(s) without a fabric (spark-1, spark-2, spark-3, spark-4): never grouped"
    )
    # One node of three with a fabric of its own cannot make a group either; the same request on
    # one node each (no group) fits anywhere.
    mixed = [attrs.evolve(n, fabric="ib0" if n.id == "spark-1" else None) for n in sparks()]
    assert "fabric ib0: 1 of 1 node(s) fit, a group needs 2" in str(place(mixed, pair()).reason)
    assert place(bare, vllm(memory_bytes=60 * GIB)).feasible


def test_a_group_needs_every_rank_on_its_own_node_and_the_other_filters_per_rank() -> None:
    # Three nodes per group over fabrics of two: nothing; a selector one rank's node fails refuses its fabric.
    assert not place(sparks(), pair(nodes_per_replica=3)).feasible
    labelled = sparks(spark_3={"labels": {"zone": "b"}})
    decision = place(labelled, pair(node_selector={"zone": "a"}))
    assert members(decision) == [(0, 0, "spark-1"), (0, 1, "spark-2")]
    assert "spark-3: needs zone=a (node has zone=b)" in fabric(decision, "ib1").detail


# --- through the fleet side: the fabric label, held members, unified memory per rank -------------


def live_spark(node_id: str, labels: dict[str, str], fabric: Fabric | None = None) -> NodeLive:
    node = Node(
        id=NodeId(node_id), hostname=node_id, signing_public_key="", curve_public_key="", labels=labels, enrolled_at=0
    )
    inventory = gb10_inventory(node_id)
    return NodeLive(
        node=node,
        inventory=inventory if fabric is None else attrs.evolve(inventory, fabric=fabric),
        desired=DesiredAssignments(node_id=node_id, generation=1),
        window=ReplayWindow(),
        reachable=True,
    )


def test_the_fabric_is_the_nodes_fabric_label_else_the_one_it_discovered() -> None:
    discovered = Fabric(name="ipv4:192.168.100.0/24", address="192.168.100.11")
    fleet = [
        live_spark("spark-1", {"fabric": "ib0"}),
        live_spark("spark-2", {}),
        live_spark("spark-3", {}, discovered),
        live_spark("spark-4", {"fabric": "ib1"}, discovered),  # the admin's label wins
    ]
    assert [node_fabric(live) for live in fleet] == ["ib0", None, "ipv4:192.168.100.0/24", "ib1"]
    assert [n.fabric for n in snapshot_from(fleet)] == ["ib0", None, "ipv4:192.168.100.0/24", "ib1"]


def test_members_held_back_from_node_sets_still_take_their_nodes_resources() -> None:
    fleet = [live_spark("spark-1", {"fabric": "ib0"})]
    [free] = snapshot_from(fleet)
    [held] = snapshot_from(fleet, held={"spark-1": [Hold(50 * GIB, ("nvidia.com/gpu=0",))]})
    assert held.accelerator_memory_free_bytes == free.accelerator_memory_free_bytes - 50 * GIB
    assert (held.load, held.free_gpus) == (1, ("nvidia.com/gpu=0",))  # a unified GPU stays shared


MODEL = "gpt-oss-120b"


def big_deployment(nodes_per_replica: int) -> Deployment:
    """A 120B model at 160 GiB: more than one Spark's pool holds, half of it on each of two."""
    return Deployment(
        name="big",
        runtime="vllm",
        alias=None,
        model=ModelRef(model=MODEL, version="v1"),
        replicas=1,
        resources=Resources(accelerators=1, memory_bytes=160 * GIB),
        options=RuntimeOptions(),
        placement=PlacementSpec(),
        created_at=0,
        created_by=None,
        updated_at=0,
        nodes_per_replica=nodes_per_replica,
    )


def test_each_rank_reserves_its_share_and_gets_its_own_memory_flag_on_its_own_node() -> None:
    fleet = [live_spark(s, {"fabric": FABRICS[s]}) for s in SPARKS]
    headroom = PlacementConfig().unified_host_headroom_bytes
    snapshot = snapshot_from(fleet, unified_headroom_bytes=headroom)
    mod = adapter_model(MODEL, memory=160 * GIB)
    rt = RuntimeRecord(
        name="vllm", kind=RuntimeKind.VLLM, version="1", image=IMAGES[RuntimeKind.VLLM], media_type="",
        registered_at=0, registered_by=None,
    )  # fmt: skip
    one = place(snapshot, placement_request(big_deployment(1), mod, rt, 1))
    assert not one.feasible  # 160 GiB does not fit one node
    req = placement_request(big_deployment(2), mod, rt, 1)
    overhead = ENGINE_OVERHEAD_BYTES["vllm"]
    assert (req.memory_bytes, req.reserved, req.nodes_per_replica) == (80 * GIB, 80 * GIB + overhead, 2)
    decision = place(snapshot, req, existing=Counter())
    assert decision.feasible
    pool = gb10_inventory().accelerator_memory_bytes
    for p in decision.placements:
        [e] = [e for e in decision.explanations if e.node_id == p.node_id]
        limit = e.runtime_memory
        assert limit is not None
        # Each rank's own flag, from its share on its own node's pool.
        assert (limit.flag, limit.reserved_bytes, limit.pool_bytes) == ("--gpu-memory-utilization", 80 * GIB, pool)
        assert limit.value == int(80 * GIB * 1000 // pool) / 1000
    [replica] = new_replicas("big", decision, ModelRef(model=MODEL, version="v1"))
    assert [(m.rank, m.node_id) for m in replica.members] == [(0, "spark-1"), (1, "spark-2")]
    assert (replica.node_id, replica.gpus, replica.node_ids) == (
        "spark-1",
        ["nvidia.com/gpu=0"],
        ["spark-1", "spark-2"],
    )
    # Held back from node sets, the group's ranks still take their share: a second group fits
    # only on the other fabric, and a third nowhere.
    held = {p.node_id: [Hold(req.reserved, p.gpus)] for p in decision.placements}
    second = place(snapshot_from(fleet, unified_headroom_bytes=headroom, held=held), req)
    assert [p.node_id for p in second.placements] == ["spark-3", "spark-4"]
    held |= {p.node_id: [Hold(req.reserved, p.gpus)] for p in second.placements}
    third = place(snapshot_from(fleet, unified_headroom_bytes=headroom, held=held), req)
    assert not third.feasible
    assert "fabric ib0: 0 of 2 node(s) fit, a group needs 2" in str(third.reason)
