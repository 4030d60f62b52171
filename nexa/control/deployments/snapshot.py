"""The fleet as placement sees it: one `PlacementNode` per enrolled node, free resources being
what its inventory reports less what its desired set reserves."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from nexa.contracts.fabric import effective_fabric
from nexa.contracts.node import LabelKey, LabelValue
from nexa.contracts.placement import PlacementNode
from nexa.contracts.qualification import gpu_model
from nexa.contracts.wire import Assignment
from nexa.control.fleet import grants
from nexa.control.fleet.nodes import NodeLive


@attrs.frozen
class Hold:
    """What a placed replica holds on a node without being in its desired set (a group replica's
    member, while nodes cannot start groups): its reservation and its GPUs."""

    reserved_bytes: int
    gpus: tuple[str, ...] = ()


_NO_HOLDS: Mapping[str, Sequence[Hold]] = {}


def node_fabric(live: NodeLive) -> str | None:
    """The fabric the node's high-speed links sit on, which a group replica's nodes share: its
    `fabric` label (the admin's, else its inventory.json's), else the one it discovered
    (`contracts.fabric.effective_fabric`); None when it has neither."""
    inv = live.inventory
    labels = grants.labels(live.node.labels, inv.labels.items() if inv is not None else ())
    return effective_fabric(labels, inv.fabric if inv is not None else None)


def snapshot_from(
    fleet: Iterable[NodeLive],
    *,
    without: frozenset[str] = frozenset(),
    unified_headroom_bytes: int = 0,
    reservation: Callable[[Assignment], int] | None = None,
    held: Mapping[str, Sequence[Hold]] = _NO_HOLDS,
) -> list[PlacementNode]:
    """One `PlacementNode` per enrolled node, from its inventory and what its desired set reserves.

    Free resources are reservations, not measurements: what the node has minus what the
    replicas in its desired set were given (a replica just assigned holds its share before it
    starts, and a running one is not counted twice). Assignments whose id is in `without` are
    left out, as if already stopped (a rollout step frees one replica and places another).

    - labels and data classes: the admin's grant, narrowed by the inventory (`control.fleet.grants`);
      state, taints, runtimes, arch: as the node's inventory reports them. A node that never reported one has no
      runtimes and no resources, so every request fails on it, with the reason shown.
    - discrete GPUs: `free_gpus` are the CDI names no assignment holds; their memory is the
      sum of those GPUs' `memory_total_bytes`.
    - unified memory (any GPU reported `unified_memory`): every GPU stays free (shared); the
      pool is the inventory's `accelerator_memory_bytes`; what replicas may still reserve is
      that pool less `unified_headroom_bytes` (`placement.unified_host_headroom_bytes`: the
      OS, the agent and the container engine live in it too) less the memory of every
      assignment; the host pool is the same pool.
    - host memory: `memory_total_bytes` less the memory of CPU-only assignments.
    - load: assignments in the desired set; cached artifacts: none known yet (reliability 1).
    - what an assignment reserves: `reservation(assignment)` (the deployments add the engine's
      overhead and what replicas were measured to hold), else its `memory_bytes`.
    - a node reporting memory pressure keeps it in `memory_pressure` (its memory filter fails).
    - gpu_model: the GPUs' names as qualifications name them (`qualification.gpu_model`).
    - fabric: `node_fabric`.
    - `held`, by node id: what replicas placed there but not in its desired set hold (`Hold`),
      counted as assignments are.
    """
    reserve = reservation or _declared
    out = []
    for live in fleet:
        inv = live.inventory
        assignments = [a for a in live.desired.assignments if a.id not in without]
        holds = held.get(live.node.id, ())
        labels = {LabelKey(k): LabelValue(v) for k, v in live.node.labels.items()}
        if inv is None:
            load = len(assignments) + len(holds)
            out.append(PlacementNode(id=live.node.id, state=live.state, arch="", labels=labels, load=load))
            continue
        labels = grants.labels(live.node.labels, inv.labels.items())
        unified = any(g.unified_memory for g in inv.gpus)
        taken = {name for a in assignments for name in a.runtime.gpus} | {name for h in holds for name in h.gpus}
        reserved_all = sum(reserve(a) for a in assignments) + sum(h.reserved_bytes for h in holds)
        reserved_host = sum(reserve(a) for a in assignments if not a.runtime.gpus)
        reserved_host += sum(h.reserved_bytes for h in holds if not h.gpus)
        if unified:
            # One pool: every GPU is shared, and accelerator and host memory are the same bytes.
            free_gpus = tuple(g.cdi_device for g in inv.gpus)
            accel_total = host_total = inv.accelerator_memory_bytes
            accel_free = host_free = max(0, accel_total - unified_headroom_bytes - reserved_all)
        else:
            free = [g for g in inv.gpus if g.cdi_device not in taken]
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
            data_classes=grants.data_classes(live.node.labels, inv),
            runtimes=inv.runtimes,
            unified_memory=unified,
            gpu_count=len(inv.gpus),
            free_gpus=free_gpus,
            accelerator_memory_total_bytes=accel_total,
            accelerator_memory_free_bytes=accel_free,
            host_memory_total_bytes=host_total,
            host_memory_free_bytes=host_free,
            load=len(assignments) + len(holds),
            memory_pressure="" if live.memory_pressure is None else live.memory_pressure.describe(),
            gpu_model=gpu_model(inv.gpus),
            fabric=node_fabric(live),
        )
        out.append(node)
    return out


def _declared(assignment: Assignment) -> int:
    return assignment.runtime.memory_bytes


def unified_pool_bytes(live: NodeLive) -> int | None:
    """The node's unified memory pool (its GPU shares the host's memory), None when it has none."""
    inv = live.inventory
    if inv is None or not any(g.unified_memory for g in inv.gpus):
        return None
    return inv.accelerator_memory_bytes
