"""Placement properties over random fleets and requests (hypothesis).

The hard filters are checked against an oracle written here from their definitions, not from
the scheduler's code: the explanation must name exactly the filters the oracle says fail, and
no replica may land where the oracle says it cannot.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexa.contracts import codec
from nexa.contracts.domain import NodeState
from nexa.contracts.node import DataClassName, LabelKey, LabelValue, RuntimeKind, Taint, TaintEffect
from nexa.contracts.placement import PlacementDecision, PlacementNode, PlacementPolicy, PlacementRequest
from nexa.control.deployments.scheduler import FILTERS, place

GIB = 1024**3
SHAS = ("a" * 64, "b" * 64, "c" * 64)
LABELS = {"zone": ("a", "b"), "gpu": ("h100", "l40s", "gb10"), "lic": ("yes", "yes", "no")}
DATA_CLASSES = ("public", "internal", "confidential")
TAINT_KEYS = ("maintenance", "dedicated")
PROPERTY = settings(max_examples=200, deadline=None)


# Strategies are built once: hypothesis validates each new strategy object, which would
# otherwise cost more than the draws themselves.
_BOOL = st.booleans()
# Hypothesis leans towards the first choice: the common case goes first.
_MOSTLY = st.sampled_from((True, True, True, False))
_RARELY = st.sampled_from((False, False, False, True))
_SELDOM = st.sampled_from((False,) * 7 + (True,))
_LABEL_VALUES = {k: st.sampled_from(v) for k, v in LABELS.items()}
_EFFECT = st.sampled_from(TaintEffect)
_GIBS = st.integers(1, 512)
_GPU_COUNT = st.sampled_from((8, 1, 2, 4, 0))
_GPUS_BUSY = st.sampled_from((0, 0, 1, 2, 4, 8))
_PER_GPU_GIB = st.sampled_from((24, 48, 80))
_STATE = st.sampled_from(NodeState)
_ARCH = st.sampled_from(("amd64", "arm64"))
# Skewed towards nodes that can take work, so that most examples place something.
_NODE_DATA_CLASSES = st.sets(st.sampled_from(DATA_CLASSES[1:]))
_RUNTIMES_LEFT_OUT = st.sets(st.sampled_from(RuntimeKind), max_size=2)
_CACHED = st.sets(st.sampled_from(SHAS))
_LOAD = st.integers(0, 6)
_RELIABILITY = st.floats(0.0, 1.0)


@st.composite
def nodes(draw: st.DrawFn, node_id: str) -> PlacementNode:
    unified = draw(_BOOL)
    labels = {LabelKey(k): LabelValue(draw(values)) for k, values in _LABEL_VALUES.items() if draw(_MOSTLY)}
    taints = tuple(Taint(key=LabelKey(k), effect=draw(_EFFECT)) for k in TAINT_KEYS if draw(_RARELY))
    host_total = draw(_GIBS) * GIB
    host_free = draw(st.integers(0, host_total // GIB)) * GIB
    if unified:
        gpu_count, free_gpus = 1, ("nvidia.com/gpu=0",)
        accel_total, accel_free = host_total, host_free
    else:
        gpu_count = draw(_GPU_COUNT)
        n_free = max(0, gpu_count - draw(_GPUS_BUSY))
        per_gpu = draw(_PER_GPU_GIB) * GIB
        free_gpus = tuple(f"nvidia.com/gpu={i}" for i in range(gpu_count - n_free, gpu_count))
        accel_total, accel_free = gpu_count * per_gpu, n_free * per_gpu
    return PlacementNode(
        id=node_id,
        state=draw(_STATE),
        arch=draw(_ARCH),
        labels=labels,
        taints=taints,
        data_classes=tuple(DataClassName(d) for d in {"public", *draw(_NODE_DATA_CLASSES)}),
        runtimes=tuple(set(RuntimeKind) - draw(_RUNTIMES_LEFT_OUT)),
        unified_memory=unified,
        gpu_count=gpu_count,
        free_gpus=free_gpus,
        accelerator_memory_total_bytes=accel_total,
        accelerator_memory_free_bytes=accel_free,
        host_memory_total_bytes=host_total,
        host_memory_free_bytes=host_free,
        cached_artifacts=tuple(draw(_CACHED)),
        load=draw(_LOAD),
        reliability=draw(_RELIABILITY),
    )


_IDS = st.lists(st.integers(0, 99), unique=True, min_size=1, max_size=8)
_NODES = {i: nodes(f"n{i:02d}") for i in range(100)}


@st.composite
def fleets(draw: st.DrawFn) -> list[PlacementNode]:
    # Mostly Ready nodes, so that placements happen often enough to say something.
    fleet = [draw(_NODES[i]) for i in draw(_IDS)]
    return [attrs.evolve(n, state=NodeState.READY) if draw(_MOSTLY) else n for n in fleet]


@st.composite
def requests(draw: st.DrawFn) -> PlacementRequest:
    selector = {LabelKey(k): LabelValue(draw(v)) for k, v in _LABEL_VALUES.items() if draw(_SELDOM)}
    return PlacementRequest(
        deployment="d",
        replicas=draw(_REPLICAS),
        runtime=draw(_RUNTIME),
        arch=draw(_REQUEST_ARCH),
        memory_bytes=draw(_MEMORY_GIB) * GIB,
        accelerators=draw(_ACCELERATORS),
        artifact_sha256=draw(_SHA),
        data_classes=tuple(DataClassName(d) for d in draw(_REQUEST_DATA_CLASSES)),
        node_selector=selector,
        license_allowance=draw(_LICENSE),
        tolerations=tuple(LabelKey(k) for k in draw(_TOLERATIONS)),
        policy=draw(_POLICY),
    )


_REPLICAS = st.integers(1, 6)
_RUNTIME = st.sampled_from(RuntimeKind)
_REQUEST_ARCH = st.sampled_from((None, None, None, "amd64", "arm64"))
_MEMORY_GIB = st.sampled_from((0, 1, 8, 16, 40, 80, 100))
_ACCELERATORS = st.sampled_from((0, 1, 1, 2, 3))
_SHA = st.sampled_from((None, *SHAS))
_REQUEST_DATA_CLASSES = st.sets(st.sampled_from(DATA_CLASSES), max_size=1)
_LICENSE = st.sampled_from((None, None, "lic=yes"))
_TOLERATIONS = st.sets(st.sampled_from(TAINT_KEYS))
_POLICY = st.sampled_from(PlacementPolicy)
_EXISTING_IDS = st.sets(st.integers(0, 99), max_size=4)
_EXISTING_COUNT = st.integers(1, 2)


@st.composite
def existing_counts(draw: st.DrawFn) -> dict[str, int]:
    return {f"n{i:02d}": draw(_EXISTING_COUNT) for i in draw(_EXISTING_IDS)}


# --- the oracle -------------------------------------------------------------------------------


def oracle_failures(node: PlacementNode, req: PlacementRequest) -> set[str]:
    """Which hard filters the node fails for the request's first replica, from their definitions."""
    failed = set()
    if node.state in (NodeState.UNREACHABLE, NodeState.REVOKED, NodeState.JOINING):
        failed.add("state_ready")
    if node.state in (NodeState.CORDONED, NodeState.DRAINING):
        failed.add("not_cordoned_or_draining")
    if req.runtime not in node.runtimes:
        failed.add("runtime_allowed")
    if req.arch is not None and req.arch != node.arch:
        failed.add("architecture")
    if not set(req.data_classes) <= set(node.data_classes):
        failed.add("data_classes")
    if any(t.effect is TaintEffect.NO_SCHEDULE and t.key not in req.tolerations for t in node.taints):
        failed.add("taints")
    if any(node.labels.get(k) != v for k, v in req.node_selector.items()):
        failed.add("selector_labels")
    if req.license_allowance is not None:
        key, _, value = req.license_allowance.partition("=")
        if node.labels.get(LabelKey(key)) != value:
            failed.add("license_allowance")
    # Unified GPUs are shared (all listed as free); discrete ones go whole to one replica.
    if len(node.free_gpus) < req.accelerators:
        failed.add("accelerators")
    if node.unified_memory:
        available = node.accelerator_memory_free_bytes  # the shared pool
    elif req.accelerators:
        # Memory comes with the GPUs given; with none free there is nothing to judge.
        per_gpu = node.accelerator_memory_free_bytes // len(node.free_gpus) if node.free_gpus else None
        available = req.memory_bytes if per_gpu is None else req.accelerators * per_gpu
    else:
        available = node.host_memory_free_bytes
    if available < req.memory_bytes:
        failed.add("memory")
    return failed


def room(node: PlacementNode, req: PlacementRequest, taken: int) -> int:
    """For a node that passes every filter: how many more replicas fit once `taken` are on it."""
    if req.accelerators and not node.unified_memory:
        return (len(node.free_gpus) - taken * req.accelerators) // req.accelerators
    if not req.memory_bytes:
        return 10**9
    free = node.accelerator_memory_free_bytes if node.unified_memory else node.host_memory_free_bytes
    return free // req.memory_bytes - taken


def eligible(fleet: list[PlacementNode], req: PlacementRequest) -> list[PlacementNode]:
    return [n for n in fleet if not oracle_failures(n, req)]


# --- properties -------------------------------------------------------------------------------


@pytest.mark.slow
@PROPERTY
@given(fleet=fleets(), req=requests(), existing=existing_counts(), seed=st.integers(0, 2**32 - 1))
def test_same_snapshot_same_decision_byte_for_byte(
    fleet: list[PlacementNode], req: PlacementRequest, existing: dict[str, int], seed: int
) -> None:
    first = place(fleet, req, existing=existing)
    text = codec.dumps(codec.api, first)
    assert place(fleet, req, existing=existing) == first
    shuffled = list(fleet)
    random.Random(seed).shuffle(shuffled)
    rebuilt = [
        PlacementNode(**{f.name: getattr(n, f.name) for f in attrs.fields(PlacementNode) if f.init}) for n in shuffled
    ]
    assert codec.dumps(codec.api, place(rebuilt, req, existing=dict(reversed(existing.items())))) == text
    assert codec.loads(codec.api, text, PlacementDecision) == first


@pytest.mark.slow
@PROPERTY
@given(fleet=fleets(), req=requests(), existing=existing_counts())
def test_explanations_match_the_filters_definitions(
    fleet: list[PlacementNode], req: PlacementRequest, existing: dict[str, int]
) -> None:
    decision = place(fleet, req, existing=existing)
    assert [e.node_id for e in decision.explanations] == sorted(n.id for n in fleet)
    nodes = {n.id: n for n in fleet}
    for e in decision.explanations:
        assert [f.name for f in e.filters] == list(FILTERS)
        failed = {f.name for f in e.filters if not f.passed}
        assert failed == oracle_failures(nodes[e.node_id], req)
        assert all(f.detail for f in e.filters if not f.passed)
        assert e.eligible == (not failed)
        if e.eligible:
            assert math.isclose(e.score, sum(t.value * t.weight for t in e.terms), abs_tol=1e-9)
        else:
            assert (e.score, e.terms, e.replicas_placed) == (0.0, (), 0)


@pytest.mark.slow
@PROPERTY
@given(fleet=fleets(), req=requests(), existing=existing_counts())
def test_placement_never_breaks_a_hard_filter_nor_overcommits(
    fleet: list[PlacementNode], req: PlacementRequest, existing: dict[str, int]
) -> None:
    decision = place(fleet, req, existing=existing)
    nodes = {n.id: n for n in fleet}
    # All or nothing, and exactly when the eligible nodes together have room.
    capacity = sum(min(room(n, req, 0), req.replicas) for n in eligible(fleet, req))
    assert decision.feasible == (capacity >= req.replicas)
    if not decision.feasible:
        assert decision.placements == ()
        assert decision.reason
        return
    assert decision.reason is None
    assert [p.replica for p in decision.placements] == list(range(req.replicas))
    per_node = Counter(p.node_id for p in decision.placements)
    for node_id, count in per_node.items():
        node = nodes[node_id]
        assert not oracle_failures(node, req)
        assert room(node, req, 0) >= count  # the node's free resources cover everything placed on it
        gpus = [g for p in decision.placements if p.node_id == node_id for g in p.gpus]
        assert set(gpus) <= set(node.free_gpus)
        if node.unified_memory:
            assert all(len(p.gpus) == req.accelerators for p in decision.placements if p.node_id == node_id)
        else:
            assert len(gpus) == len(set(gpus)) == count * req.accelerators  # discrete GPUs are never shared
    assert {e.node_id: e.replicas_placed for e in decision.explanations if e.replicas_placed} == dict(per_node)


@PROPERTY
@given(fleet=fleets(), req=requests(), existing=existing_counts())
def test_spread_puts_each_replica_where_the_deployment_has_fewest(
    fleet: list[PlacementNode], req: PlacementRequest, existing: dict[str, int]
) -> None:
    req = attrs.evolve(req, policy=PlacementPolicy.SPREAD)
    decision = place(fleet, req, existing=existing)
    taken: Counter[str] = Counter()
    for p in decision.placements:
        open_nodes = [n for n in eligible(fleet, req) if room(n, req, taken[n.id]) >= 1]
        fewest = min(existing.get(n.id, 0) + taken[n.id] for n in open_nodes)
        assert existing.get(p.node_id, 0) + taken[p.node_id] == fewest
        taken[p.node_id] += 1


@PROPERTY
@given(fleet=fleets(), req=requests(), existing=existing_counts())
def test_binpack_uses_one_node_when_one_node_can_take_them_all(
    fleet: list[PlacementNode], req: PlacementRequest, existing: dict[str, int]
) -> None:
    req = attrs.evolve(req, policy=PlacementPolicy.BINPACK)
    decision = place(fleet, req, existing=existing)
    if any(room(n, req, 0) >= req.replicas for n in eligible(fleet, req)):
        assert decision.feasible
        assert len({p.node_id for p in decision.placements}) == 1
    if decision.feasible:
        # Never more nodes than spread would use.
        spread = place(fleet, attrs.evolve(req, policy=PlacementPolicy.SPREAD), existing=existing)
        assert len({p.node_id for p in decision.placements}) <= len({p.node_id for p in spread.placements})


# --- group replicas (`nodes_per_replica` above 1) --------------------------------------------------

_FABRIC = st.sampled_from(("ib0", "ib0", "ib1", None))
_GROUP_SIZE = st.integers(2, 3)
_GROUPS = st.integers(1, 3)


_GROUP_IDS = st.lists(st.integers(0, 99), unique=True, min_size=3, max_size=10)


@st.composite
def group_fleets(draw: st.DrawFn) -> list[PlacementNode]:
    # Bigger than `fleets`, mostly Ready: a group needs several nodes that fit on one fabric.
    fleet = [draw(_NODES[i]) for i in draw(_GROUP_IDS)]
    return [attrs.evolve(n, fabric=draw(_FABRIC), state=NodeState.READY if draw(_MOSTLY) else n.state) for n in fleet]


@st.composite
def group_requests(draw: st.DrawFn) -> PlacementRequest:
    # Mostly without the rarer constraints, so that enough examples place a group.
    req = draw(requests())
    if draw(_MOSTLY):
        req = attrs.evolve(req, arch=None, node_selector={}, license_allowance=None, data_classes=())
    return attrs.evolve(req, replicas=draw(_GROUPS), nodes_per_replica=draw(_GROUP_SIZE))


@pytest.mark.slow
@PROPERTY
@given(fleet=group_fleets(), req=group_requests(), existing=existing_counts())
def test_a_group_is_whole_on_one_fabric_and_never_overcommits(
    fleet: list[PlacementNode], req: PlacementRequest, existing: dict[str, int]
) -> None:
    decision = place(fleet, req, existing=existing)
    nodes = {n.id: n for n in fleet}
    size = req.nodes_per_replica
    # Every node is explained as for a single-node replica: the filters are each rank's.
    for e in decision.explanations:
        assert {f.name for f in e.filters if not f.passed} == oracle_failures(nodes[e.node_id], req)
    # One fabric's candidate set per fabric (by name), then the nodes without one.
    named = sorted({n.fabric for n in fleet if n.fabric})
    assert [f.fabric for f in decision.fabrics] == named + ([None] if any(not n.fabric for n in fleet) else [])
    if not decision.feasible:
        assert decision.placements == () and decision.reason  # never half a group
        assert all(e.replicas_placed == 0 for e in decision.explanations)
        if req.replicas == 1:  # one group: refused only when no fabric has `size` nodes that fit
            fit = Counter(n.fabric for n in eligible(fleet, req) if n.fabric)
            assert all(count < size for count in fit.values())
        return
    assert len(decision.placements) == req.replicas * size
    for group in range(req.replicas):
        ranks = [p for p in decision.placements if p.replica == group]
        assert [p.rank for p in ranks] == list(range(size))
        ids = [p.node_id for p in ranks]
        assert ids == sorted(set(ids))  # distinct nodes, rank 0 on the smallest id
        assert len({nodes[i].fabric for i in ids}) == 1 and nodes[ids[0]].fabric  # one fabric, a named one
    per_node = Counter(p.node_id for p in decision.placements)
    for node_id, count in per_node.items():
        node = nodes[node_id]
        assert not oracle_failures(node, req)
        assert room(node, req, 0) >= count
        gpus = [g for p in decision.placements if p.node_id == node_id for g in p.gpus]
        if not node.unified_memory:
            assert len(gpus) == len(set(gpus)) == count * req.accelerators
    assert {e.node_id: e.replicas_placed for e in decision.explanations if e.replicas_placed} == dict(per_node)
    assert sum(f.groups_placed for f in decision.fabrics) == req.replicas


@pytest.mark.slow
@PROPERTY
@given(fleet=group_fleets(), req=group_requests(), existing=existing_counts(), seed=st.integers(0, 2**32 - 1))
def test_a_group_decision_is_the_same_for_the_same_input(
    fleet: list[PlacementNode], req: PlacementRequest, existing: dict[str, int], seed: int
) -> None:
    text = codec.dumps(codec.api, place(fleet, req, existing=existing))
    shuffled = list(fleet)
    random.Random(seed).shuffle(shuffled)
    assert codec.dumps(codec.api, place(shuffled, req, existing=dict(reversed(existing.items())))) == text
    assert codec.loads(codec.api, text, PlacementDecision) == place(fleet, req, existing=existing)
