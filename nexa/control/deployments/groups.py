"""Group placement: replicas of several nodes each, all on one fabric, the whole group or nothing.

Pure, like the scheduler that calls it (`scheduler.place` with `nodes_per_replica` above 1): the
scheduler runs its filters and scores on every node, exactly as for single-node replicas (each
rank needs, on its own node, what one replica would: memory with the engine's overhead, the
unified-memory limit, GPUs, architecture, labels, taints, data classes, a Ready node that is not
cordoned or draining). This module then lays groups over the nodes that pass.

A group's nodes share one fabric (`PlacementNode.fabric`); a node without one is never grouped.
Groups are placed one at a time. For each, every fabric with at least `nodes_per_replica` nodes
that pass every filter and still have room offers its best set: under spread the nodes holding
the fewest replicas of this deployment (then the highest score), under binpack the highest
scores (fullness and colocation dominate them, as for single-node replicas); ties by node id.
The sets are then compared the same way (spread: fewest replicas of this deployment on the
set's nodes; then the sum of their scores; then the fabric's name), and the best is taken. Its
ranks follow node id (rank 0, the head, on the smallest). A node takes at most one rank of each
group, and a rank takes its share of the node's room, so a node is never over-committed.
Fewer groups than requested means nothing is placed.

Every fabric's candidate set is explained (`FabricCandidates`): its nodes, those that fit, and
why it was taken or refused, naming each node that does not fit and the first filter it fails.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import attrs

from nexa.contracts.placement import FabricCandidates, NodeExplanation, PlacementNode, ReplicaPlacement

#: How many nodes a fabric's refusal names one by one.
_NAMED_MAX: Final = 8
#: What the nodes without a fabric are told.
NO_FABRIC: Final = (
    "no fabric: never part of a group (a group's nodes share one fabric; set the node's `fabric` label, "
    "or link an RDMA port so the node discovers one)"
)


@attrs.frozen
class Rater:
    """What group placement asks the scheduler about node `i` (a position in the node list)."""

    #: Node i's score once it holds `now` ranks of this decision.
    score: Callable[[int, int], float]
    #: How many ranks of this decision node i could take in all.
    room: Callable[[int], int]
    #: The GPUs node i gives the rank it takes after `now` others of this decision.
    gpus: Callable[[int, int], tuple[str, ...]]


@attrs.frozen
class Grouped:
    """What `place_groups` settled: placements (one per rank, empty unless every group fits), ranks
    per node position, each fabric's candidate set, and why it does not fit (None when it does)."""

    placements: tuple[ReplicaPlacement, ...]
    counts: dict[int, int]
    fabrics: tuple[FabricCandidates, ...]
    reason: str | None


def place_groups(
    nodes: Sequence[PlacementNode],
    explanations: Sequence[NodeExplanation],
    *,
    groups: int,
    size: int,
    spread: bool,
    existing: Mapping[str, int],
    rate: Rater,
) -> Grouped:
    """Place `groups` groups of `size` nodes each over `nodes` (sorted by id, each explained by
    the scheduler: the eligible ones scored), all or nothing."""
    on: defaultdict[str, list[int]] = defaultdict(list)
    unfabriced: list[int] = []
    for i, node in enumerate(nodes):
        if node.fabric:
            on[node.fabric].append(i)
        else:
            unfabriced.append(i)
    fabrics = sorted(on)
    fit = {f: [i for i in on[f] if explanations[i].eligible] for f in fabrics}
    score = {i: explanations[i].score for f in fabrics for i in fit[f]}
    room = {i: rate.room(i) for i in score}
    now: defaultdict[int, int] = defaultdict(int)
    taken: defaultdict[str, list[int]] = defaultdict(list)  # fabric → the groups placed on it
    placements: list[ReplicaPlacement] = []

    def here(i: int) -> int:
        return existing.get(nodes[i].id, 0) + now[i]

    def node_key(i: int) -> tuple[float, ...]:
        return (here(i), -score[i]) if spread else (-score[i],)

    for group in range(groups):
        best: tuple[tuple[object, ...], str, list[int]] | None = None
        for f in fabrics:
            open_ = [i for i in fit[f] if room[i] > now[i]]
            if len(open_) < size:
                continue
            chosen = heapq.nsmallest(size, open_, key=lambda i: (*node_key(i), nodes[i].id))
            key = (sum(here(i) for i in chosen) if spread else 0, -sum(score[i] for i in chosen), f)
            if best is None or key < best[0]:
                best = (key, f, chosen)
        if best is None:
            break
        _, f, chosen = best
        for rank, i in enumerate(sorted(chosen, key=lambda i: nodes[i].id)):
            gpus = rate.gpus(i, now[i])
            placements.append(ReplicaPlacement(node_id=nodes[i].id, replica=group, gpus=gpus, rank=rank))
            now[i] += 1
            score[i] = rate.score(i, now[i])
        taken[f].append(group)

    feasible = len(placements) == groups * size
    explained = [
        FabricCandidates(
            fabric=f,
            nodes=tuple(nodes[i].id for i in on[f]),
            fit=tuple(nodes[i].id for i in fit[f]),
            groups_placed=len(taken[f]) if feasible else 0,
            detail=_fabric_detail(
                f, on[f], fit[f], taken[f], nodes=nodes, explanations=explanations, size=size, feasible=feasible
            ),
        )
        for f in fabrics
    ]
    if unfabriced:
        eligible = tuple(nodes[i].id for i in unfabriced if explanations[i].eligible)
        explained.append(
            FabricCandidates(fabric=None, nodes=tuple(nodes[i].id for i in unfabriced), fit=eligible, detail=NO_FABRIC)
        )
    if feasible:
        return Grouped(tuple(placements), dict(now), tuple(explained), None)
    return Grouped((), {}, tuple(explained), _reason(groups, size, len(placements) // size, explained))


def _fabric_detail(
    fabric: str,
    members: list[int],
    fit: list[int],
    taken: list[int],
    *,
    nodes: Sequence[PlacementNode],
    explanations: Sequence[NodeExplanation],
    size: int,
    feasible: bool,
) -> str:
    """Why a fabric's set was taken or refused: how many of its nodes fit, and what each other one fails."""
    head = f"fabric {fabric}: {len(fit)} of {len(members)} node(s) fit"
    failing = [i for i in members if not explanations[i].eligible]
    why = "; ".join(f"{nodes[i].id}: {_first_failure(explanations[i])}" for i in failing[:_NAMED_MAX])
    if len(failing) > _NAMED_MAX:
        why += f"; and {len(failing) - _NAMED_MAX} more"
    if len(fit) < size:
        verdict = f"a group needs {size}"
    elif taken and feasible:
        verdict = f"took group(s) {', '.join(map(str, taken))}"
    elif taken:
        verdict = f"room for group(s) {', '.join(map(str, taken))} only"
    elif feasible:
        verdict = "not taken: another fabric's set came first"
    else:
        verdict = f"no room left for another group of {size} on its nodes"
    return f"{head}, {verdict}" + (f" ({why})" if why else "")


def _first_failure(e: NodeExplanation) -> str:
    failed = next(f for f in e.filters if not f.passed)
    return failed.detail or failed.name


def _reason(groups: int, size: int, placed: int, explained: list[FabricCandidates]) -> str:
    if not explained:
        return "no nodes to place on"
    head = (
        f"only {placed} of {groups} group(s) of {size} nodes fit on a fabric"
        if placed
        else f"no fabric has {size} nodes that fit a group"
    )
    return head + "; " + "; ".join(e.detail if e.fabric is not None else _unfabriced(e) for e in explained)


def _unfabriced(e: FabricCandidates) -> str:
    return f"{len(e.nodes)} node(s) without a fabric ({', '.join(e.nodes[:_NAMED_MAX])}): never grouped"
