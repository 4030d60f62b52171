"""`nexa nodes`: the fleet (operator; revoke: admin)."""

from __future__ import annotations

import argparse
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import gib, print_json
from nexa.cli.tables import NODE, NODES, accelerators
from nexa.contracts.api import NodeView
from nexa.contracts.node import NodeInventory

EXIT_OK: Final = 0


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    nodes = sub.add_parser("nodes", help="the fleet (operator; revoke: admin)").add_subparsers(
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
        *(_inventory_lines(inv, n.free_memory_bytes) if inv else _NO_INVENTORY),
        f"assignments  generation {n.acked_generation} acked of {n.desired_generation} desired{ack}",
    ]
    lines += [
        f"  {a.assignment_id}: {a.state}{'(' + a.reason + ')' if a.reason else ''} "
        f"restarts {a.restarts} {a.detail}".rstrip()
        for a in n.assignments
    ]
    lines += [f"problem      {p}" for p in (inv.problems if inv else ())]
    return "\n".join(lines)


_NO_INVENTORY: Final = (
    "taints       -",
    "data         -",
    "runtimes     -",
    "host         -, - CPUs, memory - (free -)",
    "accelerators -; pool -",
    "engine       - -, GPUs by -",
)


def _inventory_lines(inv: NodeInventory, free_memory_bytes: int) -> list[str]:
    taints = ", ".join(f"{t.key}={t.value}:{t.effect}" for t in inv.taints)
    return [
        f"taints       {taints or '-'}",
        f"data         {', '.join(inv.data_classes) or '-'}",
        f"runtimes     {', '.join(inv.runtimes) or '-'}",
        f"host         {inv.arch}, {inv.cpu_count} CPUs, "
        f"memory {gib(inv.memory_total_bytes)} (free {gib(free_memory_bytes)})",
        f"accelerators {accelerators(inv)}; pool {gib(inv.accelerator_memory_bytes)}",
        f"engine       {inv.container_engine or '-'} {inv.container_engine_version or '-'}, "
        f"GPUs by {inv.gpu_method or '-'}",
    ]


def _nodes_action(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        n = c.post(f"/api/v1/nodes/{args.node_id}/{args.verb}", NodeView)
    if args.json:
        print_json(n)
    else:
        print(f"node {n.id}: {n.state} (admin: {n.admin_state})")
    return EXIT_OK
