"""`nexa nodes`: the fleet (operator; revoke, rotate: admin). `nexa node rotate-keys`, on the node, is in `roles`."""

from __future__ import annotations

import argparse
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import gib, print_json, size_text
from nexa.cli.tables import NODE, NODES, accelerators
from nexa.contracts.api import NodeView
from nexa.contracts.fabric import FABRIC_LABEL, Fabric
from nexa.contracts.node import Gpu, NodeInventory
from nexa.contracts.wire import CacheDisk, ReplicaMemory, RuntimeCacheDisk, RuntimeLoad

EXIT_OK: Final = 0


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    nodes = sub.add_parser("nodes", help="the fleet (operator; revoke, rotate: admin)").add_subparsers(
        metavar="VERB", required=True
    )
    NODES.add(nodes, common_flags)
    s = nodes.add_parser("show", parents=[common_flags])
    s.add_argument("node_id")
    s.set_defaults(handler=_nodes_show)
    for verb in ("cordon", "uncordon", "drain", "revoke"):
        s = nodes.add_parser(verb, parents=[common_flags])
        s.add_argument("node_id")
        s.set_defaults(handler=_nodes_action, verb=verb)
    s = nodes.add_parser("rotate", parents=[common_flags], help="ask a node over its channel to rotate its keys")
    s.add_argument("node_id")
    s.set_defaults(handler=_nodes_rotate)


def _nodes_show(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        n = c.get(f"/api/v1/nodes/{args.node_id}", NodeView)
    if args.json:
        print_json(n)
    else:
        print(render_node(n))
    return EXIT_OK


def render_node(n: NodeView) -> str:
    row = NODE.row(n)
    inv = n.inventory
    ack = f"; last refusal: {n.ack_reason}" if n.ack_reason else ""
    lines = [
        f"node         {n.id} ({n.hostname})",
        f"state        {n.state} (admin: {n.admin_state})",
        f"heartbeat    {row['heartbeat']}; agent {n.agent_version or '-'}",
        f"labels       {row['labels']}",
        *(_inventory_lines(inv, n.free_memory_bytes, n.data_classes) if inv else _NO_INVENTORY),
        f"cache disk   {cache_disk_text(n.cache_disk)}",
        f"channel      {channel_text(n.channel)}",
        f"runtime cache {runtime_cache_text(n.runtime_cache)}",
        f"assignments  generation {n.acked_generation} acked of {n.desired_generation} desired{ack}",
    ]
    for a in n.assignments:
        lines.append(
            f"  {a.assignment_id}: {a.state}{'(' + a.reason + ')' if a.reason else ''} "
            f"restarts {a.restarts} {a.detail}".rstrip()
        )
        if a.load is not None:
            lines.append(f"    load: {load_text(a.load)}")
        if a.memory is not None:
            lines.append(f"    memory: {replica_memory_text(a.memory)}")
    if n.memory_pressure is not None:
        lines.append(f"pressure     {n.memory_pressure.describe()}; nothing more is placed here until it is gone")
    if inv is not None and inv.gpus_stale:
        lines.append(
            f"gpus         figures are stale: nvidia-smi stopped answering ({inv.nvidia_smi_timeouts} runs killed)"
        )
    lines += fabric_lines(inv.fabric if inv else Fabric(), n.fabric)
    lines += [f"problem      {p}" for p in (inv.problems if inv else ())]
    if n.needs_reenrollment:
        lines.append(f"hint         {n.hint}")
    return "\n".join(lines)


_NO_INVENTORY: Final = (
    "taints       -",
    "data         -",
    "runtimes     -",
    "host         -, - CPUs, memory - (free -)",
    "accelerators -; pool -",
    "engine       - -, GPUs by -",
)


def _inventory_lines(inv: NodeInventory, free_memory_bytes: int, granted: list[str]) -> list[str]:
    taints = ", ".join(f"{t.key}={t.value}:{t.effect}" for t in inv.taints)
    ungranted = [c for c in inv.data_classes if c not in granted]
    refused = f" (listed by the node, not granted: {', '.join(ungranted)})" if ungranted else ""
    return [
        f"taints       {taints or '-'}",
        f"data         {', '.join(granted) or '-'}{refused}",
        f"runtimes     {', '.join(inv.runtimes) or '-'}",
        f"host         {inv.arch}, {inv.cpu_count} CPUs, "
        f"memory {gib(inv.memory_total_bytes)} (free {gib(free_memory_bytes)})",
        f"accelerators {accelerators(inv)}; pool {gib(inv.accelerator_memory_bytes)}",
        *(f"  gpu {g.index}: {gpu_figures(g)}" for g in inv.gpus),
        f"engine       {inv.container_engine or '-'} {inv.container_engine_version or '-'}, "
        f"GPUs by {inv.gpu_method or '-'}",
    ]


def fabric_lines(fabric: Fabric, effective: str | None) -> list[str]:
    """The fabric a node is on (`effective`: its label's, else the discovered one), its RDMA
    devices' ports and the interfaces they sit on."""
    discovered = f"{fabric.name} at {fabric.address}" if fabric.name else "none discovered"
    if effective is not None and effective != fabric.name:
        head = f"{effective} (label {FABRIC_LABEL}; discovered: {discovered})"
    elif fabric.name:
        head = discovered
    else:
        head = (
            "- (no RDMA devices)" if not fabric.devices else "- (no ACTIVE RDMA port on an interface with an address)"
        )
    lines = [f"fabric       {head}"]
    for d in fabric.devices:
        on = f"; on {', '.join(d.netdevs)}" if d.netdevs else "; no network interface"
        for p in d.ports:
            lines.append(
                f"  rdma {d.name} port {p.number}: {p.state or '-'} ({p.physical_state or '-'}), "
                f"{p.rate or 'rate -'}, {p.link_layer or '-'}{on}"
            )
        if not d.ports:
            lines.append(f"  rdma {d.name}: no ports{on}")
    for i in fabric.interfaces:
        speed = f"{i.speed_mbps} Mb/s" if i.speed_mbps is not None else "speed -"
        lines.append(
            f"  interface {i.name}: {i.operstate}, {speed}, mtu {i.mtu if i.mtu is not None else '-'}, "
            f"{' '.join(i.addresses) or 'no address'}"
        )
    return lines


def _nodes_action(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        n = c.post(f"/api/v1/nodes/{args.node_id}/{args.verb}", NodeView)
    if args.json:
        print_json(n)
    else:
        print(f"node {n.id}: {n.state} (admin: {n.admin_state})")
    return EXIT_OK


def _nodes_rotate(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        n = c.post(f"/api/v1/nodes/{args.node_id}/rotate-keys", NodeView)
    if args.json:
        print_json(n)
    else:
        print(f"node {n.id}: asked to rotate its keys; `node.keys_rotated` in `nexa audit list` shows when it has")
    return EXIT_OK


def _shown(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else fmt.format(value * scale)


def gpu_figures(g: Gpu) -> str:
    """A GPU's live figures as its node last reported them ("-" for what the driver does not say)."""
    pool = " (unified pool)" if g.unified_memory else ""
    return (
        f"{g.name}, utilization {_shown(g.utilization_pct, '{:.0f} %')}, "
        f"memory {gib(g.memory_used_bytes)} of {gib(g.memory_total_bytes)}{pool}, "
        f"{_shown(g.temperature_c, '{:.0f} °C')}, {_shown(g.power_draw_w, '{:.1f} W')}"
    )


def channel_text(counts: dict[str, int]) -> str:
    """A node channel's refusals and disconnects since the controller started, or that there were none."""
    if not counts:
        return "no refusals or disconnects"
    return ", ".join(f"{what} {n}" for what, n in sorted(counts.items()))


def replica_memory_text(m: ReplicaMemory) -> str:
    """A replica's measured memory and where the figure came from."""
    parts = [
        f"{name} {size_text(value)}"
        for name, value in (
            ("cgroup", m.cgroup_bytes),
            ("GPU processes", m.gpu_bytes),
            ("MemAvailable drop", m.available_drop_bytes),
        )
        if value is not None
    ]
    return f"{size_text(m.measured_bytes)} measured" + (f" ({', '.join(parts)})" if parts else "")


def cache_disk_text(disk: CacheDisk | None) -> str:
    if disk is None:
        return "-"
    return f"{gib(disk.used_bytes)} held, {gib(disk.free_bytes)} free of {gib(disk.total_bytes)}"


def runtime_cache_text(cache: RuntimeCacheDisk | None) -> str:
    """The replicas' writable caches: what they take of their bound, how many, and the disk's room."""
    if cache is None:
        return "-"
    return (
        f"{gib(cache.used_bytes)} of {gib(cache.max_bytes)} ({cache.directories} directories, "
        f"{cache.in_use} in use), {gib(cache.free_bytes)} free of {gib(cache.total_bytes)}"
    )


def load_text(load: RuntimeLoad) -> str:
    """What a replica's runtime last said about its load, or why its metrics could not be read."""
    if not load.ok:
        return f"metrics failing: {load.error or 'no reason given'}"
    return (
        f"queue {_shown(load.queue_depth, '{:g}')}, running {_shown(load.running, '{:g}')}, "
        f"kv cache {_shown(load.kv_cache_ratio, '{:.0f} %', 100)}, "
        f"prefix hits {_shown(load.prefix_cache_hit_ratio, '{:.0f} %', 100)} ({load.age_s:.1f} s old)"
    )
