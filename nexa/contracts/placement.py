"""Placement records: the fleet snapshot the scheduler reads, the request, and the explained decision.

Pure data. `control/deployments/scheduler.py` turns a `PlacementRequest` and a sequence of `PlacementNode`
snapshots into a `PlacementDecision`; the API shows the decision as it is (`codec.api`).
Collections that are sets in meaning are stored as sorted tuples, so equal inputs compare
equal and encode to the same bytes whatever order they were given in.
"""

from __future__ import annotations

import enum
import math
import re
import sys
from collections.abc import Iterable
from typing import Final

import attrs

from nexa.contracts.domain import NodeState
from nexa.contracts.memory import FRACTION_DECIMALS as FRACTION_DECIMALS  # noqa: PLC0414 - re-exported
from nexa.contracts.memory import MemoryLimit as MemoryLimit  # noqa: PLC0414 - re-exported
from nexa.contracts.memory import MemoryShare as MemoryShare  # noqa: PLC0414 - re-exported
from nexa.contracts.memory import RuntimeMemory as RuntimeMemory  # noqa: PLC0414 - re-exported
from nexa.contracts.node import DataClassName, LabelKey, LabelValue, RuntimeKind, Taint, TaintEffect

_DIGITS: Final = re.compile(r"(\d+)")


class PlacementPolicy(enum.StrEnum):
    """How replicas of one deployment are laid over the nodes that pass every filter."""

    #: One replica per node before any node gets a second; the emptiest node first.
    SPREAD = "spread"
    #: As few nodes as possible; the fullest node that still fits first.
    BINPACK = "binpack"


def _sorted_unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(items)))


def _sorted_pairs(items: Iterable[tuple[str, str]] | None) -> tuple[tuple[str, str], ...] | None:
    return None if items is None else tuple(sorted({(a, b) for a, b in items}))


def _sorted_runtimes(items: Iterable[RuntimeKind]) -> tuple[RuntimeKind, ...]:
    return tuple(sorted(set(items)))


def _sorted_taints(items: Iterable[Taint]) -> tuple[Taint, ...]:
    return tuple(sorted(set(items), key=lambda t: (t.key, t.effect.value, t.value)))


def _natural(name: str) -> tuple[str | int, ...]:
    # nvidia.com/gpu=2 before nvidia.com/gpu=10
    return tuple(int(part) if part.isdigit() else part for part in _DIGITS.split(name))


def _sorted_devices(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(items), key=_natural))


def _non_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be 0 or more")


@attrs.frozen(kw_only=True)
class PlacementNode:
    """One node as placement sees it: a frozen snapshot taken from the fleet.

    Where a replica's memory comes from: on discrete GPUs, from the whole GPUs it is given
    (each holds one replica at most, and its memory goes with it); with unified memory, from the
    shared pool (the host's free memory), the GPU being shared too, so its CDI names stay in
    `free_gpus` however many replicas use it; for a CPU runtime elsewhere, from host memory.
    """

    id: str
    state: NodeState
    #: `amd64` or `arm64`, as the node's inventory reports it.
    arch: str
    labels: dict[LabelKey, LabelValue] = attrs.Factory(dict)
    taints: tuple[Taint, ...] = attrs.field(default=(), converter=_sorted_taints)
    data_classes: tuple[DataClassName, ...] = attrs.field(default=(), converter=_sorted_unique)
    runtimes: tuple[RuntimeKind, ...] = attrs.field(default=(), converter=_sorted_runtimes)
    unified_memory: bool = False
    #: GPUs the node has, in use or not.
    gpu_count: int = attrs.field(default=0, validator=_non_negative)
    #: CDI names of GPUs no replica holds (for unified memory: every GPU, since they are shared).
    free_gpus: tuple[str, ...] = attrs.field(default=(), converter=_sorted_devices)
    accelerator_memory_total_bytes: int = attrs.field(default=0, validator=_non_negative)
    #: Free accelerator memory: for discrete GPUs the sum over `free_gpus` (placement takes a
    #: node's free GPUs as alike: each offers an equal share); for unified memory the host's free pool.
    accelerator_memory_free_bytes: int = attrs.field(default=0, validator=_non_negative)
    host_memory_total_bytes: int = attrs.field(default=0, validator=_non_negative)
    host_memory_free_bytes: int = attrs.field(default=0, validator=_non_negative)
    #: sha256 of the model artifacts already in the node's cache.
    cached_artifacts: tuple[str, ...] = attrs.field(default=(), converter=_sorted_unique)
    #: Replicas running on the node now, of any deployment.
    load: int = attrs.field(default=0, validator=_non_negative)
    #: 0..1, for example the share of the last day the node was Ready.
    reliability: float = attrs.field(default=1.0, converter=float)
    #: Set (both figures, in words) while the node reports memory pressure: its memory filter fails.
    memory_pressure: str = ""
    #: The node's GPU model as qualifications name it (`qualification.gpu_model`; `none`: no GPU).
    gpu_model: str = ""
    #: The fabric its high-speed links sit on (`snapshot.node_fabric`); None: none, so it is never
    #: part of a group replica.
    fabric: str | None = None

    # Set views of the tuples above, built once per snapshot so that placing over a thousand
    # nodes does set algebra in C instead of scanning tuples. Not part of equality or JSON.
    _data_class_set: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    _runtime_set: frozenset[RuntimeKind] = attrs.field(init=False, eq=False, repr=False)
    _cached_set: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    _no_schedule: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    #: The labels as (key, value) pairs: a selector or a license label is a subset or member test.
    _label_items: frozenset[tuple[LabelKey, LabelValue]] = attrs.field(init=False, eq=False, repr=False)
    _free_gpu_count: int = attrs.field(init=False, eq=False, repr=False)
    #: What the request-independent filters read (state, arch, runtimes, data classes,
    #: NoSchedule taint keys) as one interned string: nodes that share it share those verdicts.
    _profile: str = attrs.field(init=False, eq=False, repr=False)
    #: Discrete GPUs: the free memory each free GPU offers.
    _memory_per_free_gpu: int = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.id:
            raise ValueError("id must not be empty")
        if not (math.isfinite(self.reliability) and 0.0 <= self.reliability <= 1.0):
            raise ValueError("reliability must be between 0 and 1")
        for name in ("accelerator_memory", "host_memory"):
            if getattr(self, f"{name}_free_bytes") > getattr(self, f"{name}_total_bytes"):
                raise ValueError(f"{name}_free_bytes must not exceed {name}_total_bytes")
        if not self.unified_memory and len(self.free_gpus) > self.gpu_count:
            raise ValueError("free_gpus lists more GPUs than gpu_count")
        set_ = object.__setattr__
        set_(self, "_data_class_set", frozenset(self.data_classes))
        set_(self, "_runtime_set", frozenset(self.runtimes))
        set_(self, "_cached_set", frozenset(self.cached_artifacts))
        no_schedule = frozenset(t.key for t in self.taints if t.effect is TaintEffect.NO_SCHEDULE)
        set_(self, "_no_schedule", no_schedule)
        set_(self, "_label_items", frozenset(self.labels.items()))
        set_(self, "_free_gpu_count", len(self.free_gpus))
        # repr() keeps the parts apart whatever characters they hold.
        runtimes = tuple(r.value for r in self.runtimes)
        parts = (self.state.value, self.arch, runtimes, self.data_classes, tuple(sorted(no_schedule)))
        set_(self, "_profile", sys.intern(repr(parts)))
        each = self.accelerator_memory_free_bytes // len(self.free_gpus) if self.free_gpus else 0
        set_(self, "_memory_per_free_gpu", each)


@attrs.frozen(kw_only=True)
class PlacementRequest:
    """What one deployment needs from the nodes its replicas run on."""

    deployment: str
    #: How many replicas this decision places (on top of any already running).
    replicas: int = 1
    runtime: RuntimeKind
    #: None: any architecture.
    arch: str | None = None
    #: The architectures the runtime image offers for linux (`amd64`, `arm64`); None: unknown,
    #: no filter. An empty tuple (an image with no linux platform) fits no node.
    image_archs: tuple[str, ...] | None = None
    #: Per replica: held by the `accelerators` discrete GPUs it is given together, or taken from
    #: a unified-memory pool, or (no GPUs, not unified) from host memory.
    memory_bytes: int = attrs.field(default=0, validator=_non_negative)
    #: Per replica: GPUs (exclusive when discrete, shared when unified).
    accelerators: int = attrs.field(default=0, validator=_non_negative)
    artifact_sha256: str | None = None
    #: Data classes every chosen node must be allowed to process.
    data_classes: tuple[DataClassName, ...] = attrs.field(default=(), converter=_sorted_unique)
    #: Labels every chosen node must carry with exactly these values.
    node_selector: dict[LabelKey, LabelValue] = attrs.Factory(dict)
    #: `key=value`: the label a node carries when the model's license allows running it there.
    license_allowance: str | None = None
    #: Taint keys this deployment tolerates (any value, any effect).
    tolerations: tuple[LabelKey, ...] = attrs.field(default=(), converter=_sorted_unique)
    policy: PlacementPolicy = PlacementPolicy.SPREAD
    #: The runtime's registration opted in to the node's network namespace (shown in every
    #: explanation; by default a replica gets a namespace of its own and a port on `runtime_host`).
    host_network: bool = False
    #: On unified-memory nodes, the runtime setting that holds it to `memory_bytes` (derived per
    #: node, or the operator's value checked); None: not limited (a CPU runtime, a full command).
    memory_limit: MemoryLimit | None = None
    #: Per replica, what the memory filter reserves when more than `memory_bytes`: the runtime's
    #: share plus the engine's own overhead, or what a replica of the same runtime, model and
    #: settings was measured to hold, whichever is larger. None: `memory_bytes`. The runtime's own
    #: memory setting (`memory_limit`) is still derived from `memory_bytes`.
    reserve_bytes: int | None = None

    @property
    def reserved(self) -> int:
        """What each replica reserves (`reserve_bytes`, else `memory_bytes`)."""
        return self.memory_bytes if self.reserve_bytes is None else max(self.memory_bytes, self.reserve_bytes)

    #: `[placement] require_qualified`: the (architecture, GPU model) pairs the runtime's image
    #: digest passed a qualification on (`nexa runtimes qualify`); None: qualification not required.
    qualified: tuple[tuple[str, str], ...] | None = attrs.field(default=None, converter=_sorted_pairs)
    #: The runtime image's digest, named by the `qualified` filter's explanation.
    image_digest: str = ""
    #: The nodes each replica spans: above 1, each replica is a group of that many ranks, one per
    #: node, on nodes that share one fabric; `memory_bytes`, `reserve_bytes` and `accelerators`
    #: are then each rank's, on its own node.
    nodes_per_replica: int = 1

    @property
    def network(self) -> str:
        """How the replicas are networked, in words, for explanations."""
        if self.host_network:
            return "host network (the runtime's opt-in: it shares the node's network namespace)"
        return "private network namespace (port published on the node's runtime address only)"

    def __attrs_post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be 1 or more")
        if self.nodes_per_replica < 1:
            raise ValueError("nodes_per_replica must be 1 or more")
        if self.license_allowance is not None:
            key, eq, _ = self.license_allowance.partition("=")
            if not key or not eq:
                raise ValueError("license_allowance must be KEY=VALUE")

    @property
    def license_label(self) -> tuple[LabelKey, LabelValue] | None:
        """`license_allowance` split into (key, value)."""
        if self.license_allowance is None:
            return None
        key, _, value = self.license_allowance.partition("=")
        return LabelKey(key), LabelValue(value)


# The per-node records below are positional (not kw_only): the scheduler builds one
# NodeExplanation per node per decision, and keyword calls cost a third more. For the same
# reason NodeExplanation is slotted but not frozen: a frozen attrs class sets each field through
# object.__setattr__, which makes it 2.3 times as slow to build (0.39 against 0.17 us; a decision
# over 1,000 nodes builds 1,000). It is hashable and compares by value as a frozen one does, and
# nothing assigns to it once built (the decision that holds it is frozen). ScoreTerm keeps a
# __dict__ (slots=False): its few instances are shared within a decision.


@attrs.frozen
class FilterResult:
    """One hard filter's verdict on one node. `detail` says why it failed (empty when it passed)."""

    name: str
    passed: bool
    detail: str = ""


@attrs.frozen(slots=False)
class ScoreTerm:
    """One named part of a node's score: the node's score is the sum of `value * weight`."""

    name: str
    value: float
    weight: float


@attrs.define(unsafe_hash=True)
class NodeExplanation:
    """Why a node was or was not chosen: every filter in order, then (if eligible) the score.

    `score` and `terms` describe the snapshot before this decision placed anything; a node
    that fails a filter has no terms and a score of 0.
    """

    node_id: str
    filters: tuple[FilterResult, ...]
    eligible: bool
    score: float
    terms: tuple[ScoreTerm, ...]
    replicas_placed: int = 0
    #: On a unified-memory node with a limited runtime: the limit a replica there runs under (its
    #: memory filter fails when that limit would claim more than the reservation).
    runtime_memory: RuntimeMemory | None = None


@attrs.frozen(kw_only=True)
class ReplicaPlacement:
    """One replica of the deployment on one node, with the GPUs it is given."""

    node_id: str
    #: 0-based position of the replica in this decision.
    replica: int
    #: CDI device names (shared ones for unified memory); empty for CPU replicas.
    gpus: tuple[str, ...] = ()
    #: A group replica's rank on this node (0: the head); a group has one placement per rank.
    rank: int = 0


@attrs.frozen(kw_only=True)
class FabricCandidates:
    """A group placement's candidate set on one fabric: its nodes, those that pass every filter,
    and why the set was taken or refused."""

    #: None: the nodes that name no fabric (never grouped).
    fabric: str | None
    #: Every node on the fabric, by id.
    nodes: tuple[str, ...]
    #: Of `nodes`, those that pass every filter.
    fit: tuple[str, ...]
    #: Groups this decision placed on it.
    groups_placed: int = 0
    #: Why it was taken or refused, in words.
    detail: str = ""


@attrs.frozen(kw_only=True)
class PlacementDecision:
    """All or nothing: `feasible` with every replica placed, or not feasible, nothing placed and a reason."""

    request: PlacementRequest
    placements: tuple[ReplicaPlacement, ...]
    #: One per node, in node-id order.
    explanations: tuple[NodeExplanation, ...]
    feasible: bool
    #: Why it does not fit; on a feasible decision None, or the note that the runtime uses the
    #: node's network namespace (`request.network`), which every explanation shows.
    reason: str | None = None
    #: For group replicas (`request.nodes_per_replica` above 1): each fabric's candidate set, by
    #: name, then the nodes with none. Empty otherwise.
    fabrics: tuple[FabricCandidates, ...] = ()
    #: Swap on demand (`control.deployments.idle`): each idle deployment put to sleep to make room
    #: for this one, and why it was chosen. Empty otherwise.
    swaps: tuple[str, ...] = ()
