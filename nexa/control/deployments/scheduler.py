"""Placement: pure filter → score → select over a snapshot of the fleet. Never awaits, never does I/O.

`place` reads `PlacementNode` snapshots (it never imports the fleet or the store) and returns a
`PlacementDecision` that explains itself: every hard filter's verdict on every node, in the
order of `FILTERS`, and the named score terms of every node that passed them all. The same
snapshot and request give the same decision, byte for byte, whatever order the nodes come in.

Scoring. Every eligible node gets soft terms, each a value in 0..1 times a weight:
`artifact_cached`, `headroom` (the share of the node's GPUs, or of its unified or host memory
pool, left after placing the replica; in hundredths), `load` (1 / (1 + replicas running)) and
`reliability`. The policy terms then dominate them by construction (each
policy weight exceeds everything below it):

- spread: `policy` = minus the replicas of this deployment already on the node, so no node
  gets a second replica while an eligible node has fewer; among equals the emptiest wins.
- binpack: `fits_all` (the node alone could take every replica of this decision) outweighs
  `colocated` (the deployment already runs there), which outweighs `policy` (the node's
  fullness after placing), so one node takes all the replicas whenever one node can.

Ties are broken by node id. Replicas are placed one at a time, each on the best node given
the resources the previous ones took; fewer than requested means nothing is placed.

Groups. A request with `nodes_per_replica` above 1 places each replica as a group of that many
ranks on nodes sharing one fabric (`groups.place_groups`, which explains every fabric's
candidate set in `PlacementDecision.fabrics`): every node is filtered and scored as above, each
rank needing on its own node what one replica would.

Qualification. With `[placement] require_qualified = true` the request carries the (architecture,
GPU model) pairs on which its runtime image's digest passed `nexa runtimes qualify`
(`PlacementRequest.qualified`); a node whose pair is not among them fails the `qualified` filter,
which names the pair and the command that qualifies it. None: not required, every node passes.

Unified memory. On a node whose GPU shares the host's pool, a request with a `memory_limit`
(the runtime's memory setting) gets that limit worked out for the node's pool
(`MemoryLimit.on`): the derived fraction, or the operator's value checked. It is shown in the
node's explanation (`NodeExplanation.runtime_memory`), and a limit that would claim more than
the reservation fails the node's `memory` filter, saying by how much.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from nexa.contracts.domain import NodeState
from nexa.contracts.kvcache import CONTEXT_STEP
from nexa.contracts.placement import (
    FilterResult,
    MemoryShare,
    NodeExplanation,
    PlacementDecision,
    PlacementNode,
    PlacementPolicy,
    PlacementRequest,
    ReplicaPlacement,
    RuntimeMemory,
    ScoreTerm,
)
from nexa.control.deployments.groups import Rater, place_groups
from nexa.oci import normalise_arch

#: The hard filters, in the order they are evaluated and shown. The first six read only the
#: node's profile (`PlacementNode._profile`); the rest read its labels and free resources.
FILTERS: Final = (
    "state_ready",
    "not_cordoned_or_draining",
    "runtime_allowed",
    "architecture",
    "data_classes",
    "taints",
    "selector_labels",
    "license_allowance",
    "accelerators",
    "memory",
    "qualified",
)
_STATE, _CORDON, _RUNTIME, _ARCH, _DATA, _TAINTS, _SELECTOR, _LICENSE, _ACCELERATORS, _MEMORY, _QUALIFIED = range(
    len(FILTERS)
)

#: What a node under memory pressure is told in its explanation, after both figures.
PRESSURE_WAIT: Final = "nothing more is placed on this node until MemAvailable is back above the floor"

#: Soft score weights (each term's value lies in 0..1).
W_ARTIFACT_CACHED: Final = 3.0
W_HEADROOM: Final = 2.0
W_LOAD: Final = 2.0
W_RELIABILITY: Final = 2.0
_SOFT_MAX: Final = W_ARTIFACT_CACHED + W_HEADROOM + W_LOAD + W_RELIABILITY
#: Spread: per replica of this deployment already on the node (the term's value is minus that count).
W_SPREAD: Final = _SOFT_MAX + 1.0
#: Binpack: fullness after placing; the deployment already there; the node could take every replica.
W_FULLNESS: Final = _SOFT_MAX + 1.0
W_COLOCATED: Final = _SOFT_MAX + W_FULLNESS + 1.0
W_FITS_ALL: Final = _SOFT_MAX + W_FULLNESS + W_COLOCATED + 1.0

_NO_EXISTING: Final[Mapping[str, int]] = MappingProxyType({})
_PASSED: Final = tuple(FilterResult(name, True, "") for name in FILTERS)
#: The profile filters' and the other filters' passing verdicts.
_PASSED_HEAD: Final = _PASSED[:_SELECTOR]
_PASSED_TAIL: Final = _PASSED[_SELECTOR:]
_BY_ID: Final = operator.attrgetter("id")
#: The states that fail `state_ready` (the others but Ready fail `not_cordoned_or_draining`).
_NOT_READY: Final = frozenset({NodeState.UNREACHABLE, NodeState.REVOKED, NodeState.JOINING})
_GIB: Final = 1024**3
_UNSEEN: Final = ()
#: Holds an eligible node's place in the list until it is scored.
_PENDING: Final = NodeExplanation("", _PASSED, True, 0.0, (), 0)


def place(
    nodes: Sequence[PlacementNode],
    req: PlacementRequest,
    *,
    existing: Mapping[str, int] = _NO_EXISTING,
) -> PlacementDecision:
    """Place `req.replicas` replicas over `nodes`, all or nothing, and explain every node.

    `existing` counts replicas of this deployment already running, by node id: spread
    avoids those nodes, binpack prefers them. Raises ValueError if a node id repeats.
    """
    need = _Need(req, existing)
    ordered = sorted(nodes, key=_BY_ID)
    explanations, eligible = _filter(need, ordered)

    best, best_score = -1, float("-inf")
    for i, scored in zip(eligible, _score(need, [ordered[i] for i in eligible], 0), strict=True):
        explanations[i] = scored
        if scored.score > best_score:  # strictly: on a tie the earlier (smaller) id stays
            best, best_score = i, scored.score

    if req.nodes_per_replica > 1:
        return _place_groups(need, req, ordered, explanations)
    if req.replicas == 1 and best >= 0:
        chosen = ordered[best]
        placements = [ReplicaPlacement(node_id=chosen.id, replica=0, gpus=chosen.free_gpus[: req.accelerators])]
        counts = {best: 1}
    else:
        heap = [(-explanations[i].score, ordered[i].id, i) for i in eligible]
        placements, counts = _place_many(need, ordered, heap)

    if len(placements) < req.replicas:
        return PlacementDecision(
            request=req,
            placements=(),
            explanations=tuple(explanations),
            feasible=False,
            reason=_reason(req, explanations, len(eligible), len(placements)),
        )
    for i, count in counts.items():
        e = explanations[i]
        explanations[i] = NodeExplanation(e.node_id, e.filters, e.eligible, e.score, e.terms, count, e.runtime_memory)
    return PlacementDecision(
        request=req,
        placements=tuple(placements),
        explanations=tuple(explanations),
        feasible=True,
        reason=req.network if req.host_network else None,
    )


def _place_groups(
    need: _Need, req: PlacementRequest, ordered: list[PlacementNode], explanations: list[NodeExplanation]
) -> PlacementDecision:
    """Groups of `req.nodes_per_replica` nodes on one fabric each (`groups.place_groups`), every node
    filtered and scored as for a single-node replica (each rank needs what one replica would)."""

    def score(i: int, now: int) -> float:
        return _score(need, [ordered[i]], now)[0].score

    def gpus(i: int, now: int) -> tuple[str, ...]:
        return _gpus_of(need, ordered[i], now)

    grouped = place_groups(
        ordered,
        explanations,
        groups=req.replicas,
        size=req.nodes_per_replica,
        spread=not need.binpack,
        existing=need.existing,
        rate=Rater(score=score, room=lambda i: _room(need, ordered[i]), gpus=gpus),
    )
    for i, count in grouped.counts.items():
        e = explanations[i]
        explanations[i] = NodeExplanation(e.node_id, e.filters, e.eligible, e.score, e.terms, count, e.runtime_memory)
    reason = grouped.reason if grouped.reason is not None else req.network if req.host_network else None
    if grouped.reason is not None and req.host_network:
        reason = f"{reason}; {req.network}"
    return PlacementDecision(
        request=req,
        placements=grouped.placements,
        explanations=tuple(explanations),
        feasible=grouped.reason is None,
        reason=reason,
        fabrics=grouped.fabrics,
    )


def forecast(
    nodes: Sequence[PlacementNode],
    req: PlacementRequest,
    *,
    existing: Mapping[str, int] = _NO_EXISTING,
) -> PlacementDecision:
    """Would `req` fit, and where? `place` under the name the capacity API uses; it changes nothing."""
    return place(nodes, req, existing=existing)


def image_platform_warnings(image_archs: tuple[str, ...] | None, node_archs: Iterable[str]) -> list[str]:
    """What registering an image should warn about: no enrolled node has an architecture it offers.

    `node_archs` are the architectures enrolled nodes reported (`""` for none yet). Nothing is
    said when the image's platforms are unknown (None) or no node has reported an architecture.
    """
    reported = sorted({normalise_arch(a) for a in node_archs if a})
    if image_archs is None or not reported:
        return []
    offered = {normalise_arch(a) for a in image_archs}
    if offered & set(reported):
        return []
    has = ", ".join(f"linux/{a}" for a in sorted(offered)) or "no linux platform"
    return [
        f"no enrolled node can run this image: it has {has}; the nodes are "
        + ", ".join(f"linux/{a}" for a in reported)
        + f" (image has no linux/{reported[0]} variant)"
    ]


def _filter(need: _Need, ordered: list[PlacementNode]) -> tuple[list[NodeExplanation], list[int]]:
    """Run every filter on every node.

    Returns the explanations of the nodes that fail one (eligible nodes hold `_PENDING` until
    they are scored) and the positions of the eligible nodes.
    """
    explanations: list[NodeExplanation] = []
    eligible: list[int] = []  # positions in `ordered`

    # This loop runs once per node per decision: everything it touches is a local, and the
    # profile filters are decided once per distinct profile, not once per node. `profiles`
    # maps a profile to None (passes them all) or to the six profile verdicts.
    profiles: dict[str, tuple[FilterResult, ...] | None] = {}
    memo: dict[Hashable, FilterResult] = {}
    selector, license_, memory, accelerators = need.selector, need.license, need.memory, need.accelerators
    qualified = need.qualified
    append, mark, explain = explanations.append, eligible.append, NodeExplanation
    previous = None
    for i, node in enumerate(ordered):
        node_id = node.id
        if node_id == previous:
            raise ValueError(f"node {node_id} appears twice in the placement snapshot")
        previous = node_id
        failed = profiles.get(node._profile, _UNSEEN)
        if failed is _UNSEEN:
            failed = profiles[node._profile] = _profile_filters(node, need, memo)
        # What one replica could have: whole discrete GPUs, else the unified or host pool.
        unified = node.unified_memory
        free_gpus = node._free_gpu_count
        if unified:
            free_memory = node.accelerator_memory_free_bytes
        elif accelerators:
            # With no GPU free, the accelerators filter says so; memory is not judged twice.
            free_memory = accelerators * node._memory_per_free_gpu if free_gpus else memory
        else:
            free_memory = node.host_memory_free_bytes
        labels = node._label_items
        selector_ok = not selector or selector <= labels
        license_ok = license_ is None or license_ in labels
        gpus_ok = free_gpus >= accelerators
        memory_ok = free_memory >= memory and not node.memory_pressure
        # On a unified node the runtime's own memory setting must keep it within the reservation.
        limit = need.runtime_memory(node) if unified and need.limit is not None else None
        limit_ok = limit is None or limit.fits
        # `[placement] require_qualified`: the node's (arch, GPU model) passed a qualification.
        qualified_ok = qualified is None or (normalise_arch(node.arch), node.gpu_model) in qualified
        if selector_ok and license_ok and gpus_ok and memory_ok and limit_ok and qualified_ok:
            if failed is None:
                mark(i)
                append(_PENDING)
                continue
            filters = failed + _PASSED_TAIL
        else:
            memory_result = (
                _memory_result(node, need, free_memory, limit, memo)
                if not memory_ok or not limit_ok
                else _PASSED[_MEMORY]
            )
            filters = (failed or _PASSED_HEAD) + (
                _PASSED[_SELECTOR] if selector_ok else _selector_failed(node, need, memo),
                _PASSED[_LICENSE] if license_ok else _license_failed(node, need, memo),
                _PASSED[_ACCELERATORS] if gpus_ok else _gpus_failed(node, need, memo),
                memory_result,
                _PASSED[_QUALIFIED] if qualified_ok else _qualified_failed(node, need, memo),
            )
        append(explain(node_id, filters, False, 0.0, (), 0, limit))
    return explanations, eligible


class _Need:
    """The request, taken apart once per decision into what the per-node loops compare."""

    __slots__ = (
        "accelerators",
        "arch",
        "binpack",
        "data_classes",
        "existing",
        "image_archs",
        "image_digest",
        "license",
        "limit",
        "limits",
        "memory",
        "qualified",
        "replicas",
        "runtime",
        "selector",
        "sha",
        "share",
        "terms",
        "tolerated",
        "w_headroom",
    )

    def __init__(self, req: PlacementRequest, existing: Mapping[str, int]) -> None:
        self.runtime = req.runtime
        self.arch = req.arch
        self.image_archs = None if req.image_archs is None else frozenset(map(normalise_arch, req.image_archs))
        self.data_classes = frozenset(req.data_classes)
        self.selector = frozenset(req.node_selector.items())
        self.license = req.license_label
        self.tolerated = frozenset(req.tolerations)
        self.memory = req.reserved
        #: What the runtime's own memory setting is derived from (without its overhead).
        self.share = req.memory_bytes
        self.limit = req.memory_limit
        #: pool bytes → the runtime's limit on a unified node of that pool (nodes of one model share it).
        self.limits: dict[int, RuntimeMemory] = {}
        self.accelerators = req.accelerators
        self.sha = req.artifact_sha256
        self.replicas = req.replicas
        self.binpack = req.policy is PlacementPolicy.BINPACK
        # Under binpack, fullness (the `policy` term) ranks nodes; headroom is shown, not counted.
        self.w_headroom = 0.0 if self.binpack else W_HEADROOM
        self.existing = existing
        self.terms = _Terms(self.w_headroom, self.binpack)
        self.qualified = None if req.qualified is None else frozenset(req.qualified)
        self.image_digest = req.image_digest

    def runtime_memory(self, node: PlacementNode) -> RuntimeMemory:
        """The runtime's memory limit on a unified node (`limit` is set)."""
        pool = node.accelerator_memory_total_bytes
        found = self.limits.get(pool)
        if found is None:
            assert self.limit is not None
            found = self.limits[pool] = self.limit.on(self.share, pool)
        return found


class _Terms:
    """The interned ScoreTerms one decision reads: nodes with equal values share one object."""

    __slots__ = ("cached", "colocated", "fits_all", "headroom", "load", "policy", "reliability")

    def __init__(self, w_headroom: float, binpack: bool) -> None:
        self.cached = _CACHED
        self.colocated = _COLOCATED
        self.fits_all = _FITS_ALL
        self.headroom = _HEADROOM if w_headroom else _HEADROOM_SHOWN
        self.load = _LOAD
        self.reliability = _RELIABILITY
        self.policy = _FULLNESS if binpack else _SPREAD


class _Interned(dict[float, ScoreTerm]):
    """ScoreTerms of one name and weight by value, kept from one decision to the next.

    A ScoreTerm is immutable and equal to any other of the same value, so sharing one changes
    no decision; keeping them saves building a few hundred per decision over 1,000 nodes (one
    per distinct headroom, load and reliability). At most `_INTERNED_MAX` are kept per name.
    The values looked up are never -0.0 (it is a key equal to 0.0 but is written `-0.0`):
    headroom, load and policy values cannot be, and a 0 reliability is not looked up here.
    """

    __slots__ = ("name", "weight")

    def __init__(self, name: str, weight: float) -> None:
        super().__init__()
        self.name = name
        self.weight = weight

    def __missing__(self, value: float) -> ScoreTerm:
        if len(self) >= _INTERNED_MAX:
            self.clear()
        term = self[value] = ScoreTerm(self.name, value, self.weight)
        return term


_INTERNED_MAX: Final = 4096
_CACHED: Final = {v: ScoreTerm("artifact_cached", v, W_ARTIFACT_CACHED) for v in (0.0, 1.0)}
_COLOCATED: Final = {v: ScoreTerm("colocated", v, W_COLOCATED) for v in (0.0, 1.0)}
_FITS_ALL: Final = {v: ScoreTerm("fits_all", v, W_FITS_ALL) for v in (0.0, 1.0)}
_HEADROOM: Final = _Interned("headroom", W_HEADROOM)
#: Under binpack headroom is shown with weight 0.
_HEADROOM_SHOWN: Final = _Interned("headroom", 0.0)
_LOAD: Final = _Interned("load", W_LOAD)
_RELIABILITY: Final = _Interned("reliability", W_RELIABILITY)
_FULLNESS: Final = _Interned("policy", W_FULLNESS)
_SPREAD: Final = _Interned("policy", W_SPREAD)


# ---------------------------------------------------------------------------------------------
# Scores and selection. `now` is how many replicas this decision has already put on a node:
# the node's free resources, load and replica count follow from the snapshot and `now`.


def _room(need: _Need, node: PlacementNode) -> int:
    """How many replicas of this decision the snapshot node could take (capped at the number asked for).

    Only for nodes that pass every filter. Discrete GPUs go whole to one replica (their memory
    with them); the unified or host pool is shared out by `memory_bytes`.
    """
    if need.accelerators and not node.unified_memory:
        return min(need.replicas, node._free_gpu_count // need.accelerators)
    if not need.memory:
        return need.replicas
    free = node.accelerator_memory_free_bytes if node.unified_memory else node.host_memory_free_bytes
    return min(need.replicas, free // need.memory)


def _score(need: _Need, nodes: list[PlacementNode], now: int) -> list[NodeExplanation]:
    """Score eligible nodes that each hold `now` replicas of this decision; the one scoring function."""
    memory, accelerators, replicas, sha, binpack = need.memory, need.accelerators, need.replicas, need.sha, need.binpack
    existing, w_headroom = need.existing, need.w_headroom
    terms = need.terms
    t_cached, t_headroom, t_load, t_reliability, t_policy = (
        terms.cached,
        terms.headroom,
        terms.load,
        terms.reliability,
        terms.policy,
    )
    t_colocated, t_fits_all = terms.colocated, terms.fits_all
    limited = need.limit is not None
    used_memory = (now + 1) * memory
    used_gpus = (now + 1) * accelerators
    out: list[NodeExplanation] = []
    append = out.append
    for node in nodes:
        # Headroom: the share of what the replica uses (whole GPUs, or pool memory) left after it.
        if node.unified_memory:
            total = node.accelerator_memory_total_bytes
            headroom = (node.accelerator_memory_free_bytes - used_memory) / total if total else 0.0
        elif accelerators:
            headroom = (node._free_gpu_count - used_gpus) / node.gpu_count
        else:
            total = node.host_memory_total_bytes
            headroom = (node.host_memory_free_bytes - used_memory) / total if total else 0.0
        # In hundredths (headroom >= 0 here): 1 % is finer than any preference it expresses, and
        # few distinct values mean mostly shared ScoreTerms instead of one new object per node.
        hundredths = int(headroom * 100.0 + 0.5)
        headroom = hundredths / 100
        cached = 1.0 if sha in node._cached_set else 0.0
        load = 1.0 / (1 + node.load + now)
        reliability = node.reliability
        score = cached * W_ARTIFACT_CACHED + headroom * w_headroom + load * W_LOAD + reliability * W_RELIABILITY
        here = now + existing.get(node.id, 0) if existing else now
        # A 0 reliability may be -0.0, which the kept terms must not meet (see `_Interned`).
        reliability_term = (
            t_reliability[reliability] if reliability else ScoreTerm("reliability", reliability, W_RELIABILITY)
        )
        node_terms: tuple[ScoreTerm, ...]
        if binpack:
            fullness = (100 - hundredths) / 100
            colocated = 1.0 if here else 0.0
            fits_all = 1.0 if _room(need, node) >= replicas else 0.0
            score += fullness * W_FULLNESS + colocated * W_COLOCATED + fits_all * W_FITS_ALL
            node_terms = (
                t_cached[cached],
                t_headroom[headroom],
                t_load[load],
                reliability_term,
                t_policy[fullness],
                t_colocated[colocated],
                t_fits_all[fits_all],
            )
        else:
            spread = float(-here)  # -0 is 0: keeps `-0.0` out of the JSON
            score += spread * W_SPREAD
            node_terms = (
                t_cached[cached],
                t_headroom[headroom],
                t_load[load],
                reliability_term,
                t_policy[spread],
            )
        limit = need.runtime_memory(node) if limited and node.unified_memory else None
        append(NodeExplanation(node.id, _PASSED, True, score, node_terms, 0, limit))
    return out


def _place_many(
    need: _Need, ordered: list[PlacementNode], heap: list[tuple[float, str, int]]
) -> tuple[list[ReplicaPlacement], dict[int, int]]:
    """Place replicas one at a time, each on the best node; only the node that took one is scored again.

    `heap` holds (-score, node id, position) for every eligible node.
    """
    heapq.heapify(heap)
    placements: list[ReplicaPlacement] = []
    counts: dict[int, int] = {}
    accelerators = need.accelerators
    while heap and len(placements) < need.replicas:
        _, node_id, i = heapq.heappop(heap)
        node = ordered[i]
        now = counts.get(i, 0)
        if node.unified_memory:
            gpus = node.free_gpus[:accelerators]  # shared, never used up
        else:
            gpus = node.free_gpus[now * accelerators : (now + 1) * accelerators]
        placements.append(ReplicaPlacement(node_id=node_id, replica=len(placements), gpus=gpus))
        now = counts[i] = now + 1
        if _room(need, node) > now:
            [again] = _score(need, [node], now)
            heapq.heappush(heap, (-again.score, node_id, i))
    return placements, counts


def _gpus_of(need: _Need, node: PlacementNode, now: int) -> tuple[str, ...]:
    """The GPUs `node` gives the replica it takes after `now` others of this decision (as `_place_many` does)."""
    accelerators = need.accelerators
    if node.unified_memory:
        return node.free_gpus[:accelerators]  # shared, never used up
    return node.free_gpus[now * accelerators : (now + 1) * accelerators]


# ---------------------------------------------------------------------------------------------
# Filters, for nodes that fail at least one (every other node shares `_PASSED`). A detail is
# written the first time a (filter, cause) pair is seen in a decision, then shared via `memo`.


def _profile_filters(
    node: PlacementNode, need: _Need, memo: dict[Hashable, FilterResult]
) -> tuple[FilterResult, ...] | None:
    """None when a node passes the six profile filters, else their six verdicts."""
    results = list(_PASSED_HEAD)
    state = node.state
    if state is not NodeState.READY:
        index = _STATE if state in _NOT_READY else _CORDON
        results[index] = _failed(memo, index, state, f"node is {state}")
    if need.runtime not in node._runtime_set:
        allowed = ", ".join(node.runtimes) or "none"
        results[_RUNTIME] = _failed(
            memo, _RUNTIME, node.runtimes, f"{need.runtime} is not allowed (allowed: {allowed})"
        )
    if need.arch is not None and node.arch != need.arch:
        results[_ARCH] = _failed(memo, _ARCH, node.arch, f"needs {need.arch}, node is {node.arch}")
    elif need.image_archs is not None and normalise_arch(node.arch) not in need.image_archs:
        # The image would not start there (`exec format error`). The cause is the node's arch:
        # the image's set is the same for every node of one decision.
        arch = normalise_arch(node.arch) or "(unreported)"
        results[_ARCH] = _failed(memo, _ARCH, ("image", arch), f"image has no linux/{arch} variant")
    missing = need.data_classes - node._data_class_set
    if missing:
        results[_DATA] = _failed(memo, _DATA, missing, "node may not process " + ", ".join(sorted(missing)))
    untolerated = node._no_schedule - need.tolerated
    if untolerated:
        names = ", ".join(sorted(untolerated))
        results[_TAINTS] = _failed(memo, _TAINTS, untolerated, f"NoSchedule taint not tolerated: {names}")
    return None if all(r.passed for r in results) else tuple(results)


def _selector_failed(node: PlacementNode, need: _Need, memo: dict[Hashable, FilterResult]) -> FilterResult:
    wrong = tuple(sorted((k, v, node.labels.get(k)) for k, v in need.selector if node.labels.get(k) != v))
    found = memo.get((_SELECTOR, wrong))
    if found is None:
        detail = "; ".join(
            f"needs {k}={v} (node has {'no ' + k if has is None else f'{k}={has}'})" for k, v, has in wrong
        )
        found = _failed(memo, _SELECTOR, wrong, detail)
    return found


def _license_failed(node: PlacementNode, need: _Need, memo: dict[Hashable, FilterResult]) -> FilterResult:
    assert need.license is not None
    key, value = need.license
    has = node.labels.get(key)
    found = memo.get((_LICENSE, has))
    if found is None:
        found = _failed(
            memo, _LICENSE, has, f"needs label {key}={value} (node has {'none' if has is None else f'{key}={has}'})"
        )
    return found


def _qualified_failed(node: PlacementNode, need: _Need, memo: dict[Hashable, FilterResult]) -> FilterResult:
    pair = (normalise_arch(node.arch) or "(unreported)", node.gpu_model or "(unreported)")
    found = memo.get((_QUALIFIED, pair))
    if found is None:
        digest = need.image_digest or "(no digest)"
        found = _failed(
            memo,
            _QUALIFIED,
            pair,
            f"{need.runtime} image {digest[:19]} is not qualified on {pair[0]} with GPU {pair[1]} "
            f"([placement] require_qualified): run `nexa runtimes qualify RUNTIME --node {node.id}`",
        )
    return found


def _gpus_failed(node: PlacementNode, need: _Need, memo: dict[Hashable, FilterResult]) -> FilterResult:
    have = len(node.free_gpus)
    cause = (node.unified_memory, have)
    found = memo.get((_ACCELERATORS, cause))  # the detail is formatted once per cause, not per node
    if found is not None:
        return found
    if node.unified_memory:
        return _failed(memo, _ACCELERATORS, cause, f"needs {need.accelerators} shared GPU(s), node has {have}")
    return _failed(memo, _ACCELERATORS, cause, f"needs {need.accelerators} GPU(s), {have} free")


def _memory_result(
    node: PlacementNode, need: _Need, free_memory: int, limit: RuntimeMemory | None, memo: dict[Hashable, FilterResult]
) -> FilterResult:
    """The memory filter's verdict on a node that fails it: pressure, then the runtime's limit, then room."""
    if node.memory_pressure:
        cause = ("pressure", node.memory_pressure)
        return memo.get((_MEMORY, cause)) or _failed(memo, _MEMORY, cause, f"{node.memory_pressure}; {PRESSURE_WAIT}")
    if limit is not None and not limit.fits:
        return _limit_failed(limit, memo)
    return _memory_failed(node, need, free_memory, memo)


def _memory_failed(
    node: PlacementNode, need: _Need, free_memory: int, memo: dict[Hashable, FilterResult]
) -> FilterResult:
    pool = "unified" if node.unified_memory else "gpu" if need.accelerators else "host"
    cause = (pool, free_memory)
    found = memo.get((_MEMORY, cause))
    if found is not None:
        return found
    if pool == "unified":
        detail = f"needs {_gib(need.memory)} of unified memory, {_gib(free_memory)} free"
    elif pool == "gpu":
        detail = f"needs {_gib(need.memory)} on {need.accelerators} GPU(s), they have {_gib(free_memory)} free"
    else:
        detail = f"needs {_gib(need.memory)} of host memory, {_gib(free_memory)} free"
    return _failed(memo, _MEMORY, cause, detail)


def _limit_failed(limit: RuntimeMemory, memo: dict[Hashable, FilterResult]) -> FilterResult:
    found = memo.get((_MEMORY, limit))
    if found is not None:
        return found
    return _failed(memo, _MEMORY, limit, limit_detail(limit))


def limit_detail(limit: RuntimeMemory) -> str:
    """Why a runtime's memory setting does not fit its reservation on a unified node, in words."""
    pool = f"the {_gib(limit.pool_bytes)} unified pool"
    if limit.share_of is MemoryShare.CONTEXT:
        if limit.value is None or limit.claim_bytes is None:
            return (
                f"settings.{limit.setting}: no context keeps llama.cpp within the {_gib(limit.reserved_bytes)} "
                f"reserved on {pool} (the model's weights and the engine's overhead leave no room for "
                f"{CONTEXT_STEP} tokens of KV cache)"
            )
        kv = limit.kv_cache_bytes or 0
        room = limit.reserved_bytes - (limit.claim_bytes - kv)
        return (
            f"settings.{limit.setting} {limit.value} needs a {_amount(kv)} KV cache, more than the "
            f"{_amount(max(room, 0))} that the {_gib(limit.reserved_bytes)} reserved on {pool} leaves beside "
            "the weights and the engine's overhead"
        )
    if limit.value is None or limit.claim_bytes is None:
        return (
            f"settings.{limit.setting}: no value keeps the runtime within the {_gib(limit.reserved_bytes)} "
            f"reserved on {pool} (the model's weights alone fill it)"
        )
    return (
        f"settings.{limit.setting} {limit.value:g} claims {_gib(limit.claim_bytes)} of {pool}, "
        f"above the {_gib(limit.reserved_bytes)} reserved"
    )


def _failed(memo: dict[Hashable, FilterResult], index: int, cause: Hashable, detail: str) -> FilterResult:
    """The failed FilterResult for (filter, cause), made once per decision."""
    found = memo.get((index, cause))
    if found is None:
        found = memo[(index, cause)] = FilterResult(FILTERS[index], False, detail)
    return found


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


def _amount(n: int) -> str:
    """GiB, or MiB or KiB below it (a small model's KV cache)."""
    if n >= _GIB:
        return _gib(n)
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _reason(req: PlacementRequest, explanations: list[NodeExplanation], eligible: int, placed: int) -> str:
    if not explanations:
        return "no nodes to place on"
    counts = [0] * len(FILTERS)
    example: list[str | None] = [None] * len(FILTERS)
    for e in explanations:
        if e.eligible:
            continue
        for i, result in enumerate(e.filters):
            if not result.passed:
                counts[i] += 1
                if example[i] is None:
                    example[i] = f"{e.node_id}: {result.detail}"
    if eligible:
        head = f"only {placed} of {req.replicas} replicas fit on the {eligible} node(s) that pass every filter"
    else:
        head = "no node passes every filter"
    most = max(range(len(FILTERS)), key=lambda i: (counts[i], -i))
    network = f"; {req.network}" if req.host_network else ""
    if not counts[most]:
        return head + network
    return (
        f"{head}; most often failed: {FILTERS[most]} on {counts[most]} of {len(explanations)} nodes "
        f"({example[most]}){network}"
    )
