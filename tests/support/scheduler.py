"""The placement lab, built from the recorded hardware fixtures: four DGX Spark GB10 (unified memory),
one 8x H100 with four GPUs busy, one 2x L40S with one busy, one CPU-only host. Each node goes through
the real inventory path (nvidia-smi CSV and /proc/meminfo parsed, then merged with an inventory file)
and a small stand-in for the fleet adapter turns the merged inventory into a PlacementNode. Also the
requests and the readings of decisions the scheduler tests share."""

from __future__ import annotations

import attrs

from nexa.contracts.domain import NodeState
from nexa.contracts.node import (
    DEFAULT_RUNTIMES,
    DataClassName,
    DiscoveredHost,
    InventoryFile,
    LabelKey,
    LabelValue,
    NodeInventory,
    RuntimeKind,
    Taint,
)
from nexa.contracts.placement import NodeExplanation, PlacementDecision, PlacementNode, PlacementRequest
from nexa.contracts.qualification import gpu_model
from nexa.node.inventory import merge, parse_meminfo, parse_nvidia_smi_csv
from tests.conftest import FIXTURES

GIB = 1024**3
LICENSE = "license.nexa/llama3"
SPARKS = ("spark-1", "spark-2", "spark-3", "spark-4")


# --- the lab, from the hardware fixtures -----------------------------------------------------


def discovered(kind: str, hostname: str) -> DiscoveredHost:
    """A host as the agent discovers it, from the fixture named after its hardware."""
    smi = {"gb10": "gb10_dgx_spark.csv", "h100": "h100_80g_x8.csv", "l40s": "l40s_48g_x2.csv"}.get(kind)
    gpus = tuple(parse_nvidia_smi_csv((FIXTURES / "nvidia-smi" / smi).read_text())) if smi else ()
    if kind in ("gb10", "h100"):
        meminfo = "gb10_dgx_spark.meminfo" if kind == "gb10" else "h100_dgx_2t.meminfo"
        memory = parse_meminfo((FIXTURES / "meminfo" / meminfo).read_text())
        total, available = memory.total_bytes, memory.available_bytes
    else:  # no meminfo recorded for these hosts: round figures
        total, available = 256 * GIB, 200 * GIB
    return DiscoveredHost(
        hostname=hostname,
        arch="arm64" if kind == "gb10" else "amd64",
        cpu_count=20 if kind == "gb10" else 64,
        memory_total_bytes=total,
        memory_available_bytes=available,
        gpus=gpus,
        discovered_at=1_700_000_000.0,
    )


def to_placement(
    node_id: str, inv: NodeInventory, *, state: NodeState, cached: tuple[str, ...], load: int, reliability: float
) -> PlacementNode:
    """The test's stand-in for the fleet adapter: a discrete GPU is free when under 1 GiB of it is in use."""
    unified = [g for g in inv.gpus if g.unified_memory]
    if unified:
        free_gpus = tuple(g.cdi_device for g in inv.gpus)
        accelerator_free = max(g.memory_free_bytes or 0 for g in unified)
    else:
        free = [g for g in inv.gpus if (g.memory_used_bytes or 0) < GIB]
        free_gpus = tuple(g.cdi_device for g in free)
        accelerator_free = sum(g.memory_free_bytes or 0 for g in free)
    return PlacementNode(
        id=node_id,
        state=state,
        arch=inv.arch,
        labels=inv.labels,
        taints=inv.taints,
        data_classes=inv.data_classes,
        runtimes=inv.runtimes,
        unified_memory=bool(unified),
        gpu_count=len(inv.gpus),
        free_gpus=free_gpus,
        accelerator_memory_total_bytes=inv.accelerator_memory_bytes,
        accelerator_memory_free_bytes=accelerator_free,
        host_memory_total_bytes=inv.memory_total_bytes,
        host_memory_free_bytes=inv.memory_available_bytes,
        cached_artifacts=cached,
        load=load,
        reliability=reliability,
        gpu_model=gpu_model(inv.gpus),
    )


def node(
    node_id: str,
    kind: str,
    *,
    labels: dict[str, str] | None = None,
    data_classes: tuple[str, ...] = ("public", "internal"),
    runtimes: tuple[RuntimeKind, ...] = DEFAULT_RUNTIMES,
    taints: tuple[Taint, ...] = (),
    state: NodeState = NodeState.READY,
    cached: tuple[str, ...] = (),
    load: int = 0,
    reliability: float = 1.0,
) -> PlacementNode:
    file = InventoryFile(
        labels={LabelKey(k): LabelValue(v) for k, v in (labels or {}).items()},
        taints=taints,
        data_classes=tuple(DataClassName(d) for d in data_classes),
        runtimes=runtimes,
    )
    inv = merge(discovered(kind, node_id), file)
    return to_placement(node_id, inv, state=state, cached=cached, load=load, reliability=reliability)


def lab() -> list[PlacementNode]:
    sparks = [node(s, "gb10", labels={"zone": "a", LICENSE: "allowed"}) for s in SPARKS]
    return [
        *sparks,
        node(
            "h100-1",
            "h100",
            labels={"zone": "b", "gpu": "h100", LICENSE: "allowed"},
            data_classes=("public", "internal", "confidential"),
        ),
        node("l40s-1", "l40s", labels={"zone": "b", "gpu": "l40s"}, data_classes=("public",)),
        node("cpu-1", "cpu", labels={"zone": "c"}, runtimes=(RuntimeKind.LLAMACPP,)),
    ]


def by_id(nodes: list[PlacementNode], node_id: str) -> PlacementNode:
    [found] = [n for n in nodes if n.id == node_id]
    return found


def vllm(**changes: object) -> PlacementRequest:
    """One replica of an 8B model on vLLM: one GPU, 40 GiB."""
    base = PlacementRequest(deployment="llama3-8b", runtime=RuntimeKind.VLLM, memory_bytes=40 * GIB, accelerators=1)
    return attrs.evolve(base, **changes)


def explanation(decision: PlacementDecision, node_id: str) -> NodeExplanation:
    [found] = [e for e in decision.explanations if e.node_id == node_id]
    return found


def failures(e: NodeExplanation) -> list[tuple[str, str]]:
    return [(f.name, f.detail) for f in e.filters if not f.passed]


def where(decision: PlacementDecision) -> list[str]:
    return [p.node_id for p in decision.placements]
