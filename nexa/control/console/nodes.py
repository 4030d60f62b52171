"""Nodes: the fleet, cordon / uncordon / drain behind a confirmation page, and the fleet charts' series."""

from __future__ import annotations

from typing import Any, Final

import trio
from quart import Blueprint, request

from nexa.contracts.fabric import effective_fabric
from nexa.control.console.fleet_charts import FleetCharts
from nexa.control.console.pages import Console, Context, Refused, View, done
from nexa.control.console.sessions import Session
from nexa.control.fleet import grants
from nexa.control.fleet.nodes import NodeLive

#: The node actions and what each does, as the confirmation page says it.
NODE_ACTIONS: Final = {
    "cordon": "no new replicas are placed on it; the ones it runs stay",
    "uncordon": "it takes new replicas again",
    "drain": "its replicas are moved to other nodes and it takes no new ones",
}


def node_age(live: NodeLive) -> float | None:
    """Seconds since the node was last heard from (a template global)."""
    return None if live.last_seen is None else max(0.0, trio.current_time() - live.last_seen)


def node_fabric(live: NodeLive) -> str | None:
    """The fabric the node is on: its `fabric` label, else the discovered one (a template global)."""
    inventory = live.inventory
    labels = grants.labels(live.node.labels, inventory.labels.items() if inventory else ())
    return effective_fabric(labels, inventory.fabric if inventory else None)


def register(bp: Blueprint, console: Console, charts: FleetCharts) -> None:
    state = console.state

    async def context(session: Session, now: float) -> Context:
        return {"nodes": list(state.fleet), "now": now}

    console.add_view(bp, View("nodes", "Nodes", ("GET", "/api/v1/nodes"), context))

    @bp.get("/console/fleet/series")
    @console.handler
    async def fleet_series() -> Any:
        """The GPU and runtime charts of the overview and nodes pages (`?node=` one node's)."""
        session = console.signed_in()
        console.view_allowed(session, "nodes")
        return charts.series(request.args.get("node") or None)

    @bp.get("/console/nodes/<node_id>/<action>")
    @console.handler
    async def node_confirm(node_id: str, action: str) -> Any:
        session = console.signed_in()
        if action not in NODE_ACTIONS:
            raise Refused(404, "no such action")
        await console.require(session, action, f"node/{node_id}")
        live = state.fleet.get(node_id)
        effect = f"Node {node_id}: {NODE_ACTIONS[action]}. It runs {len(live.statuses)} replica(s) now."
        return await console.confirm(
            session, "nodes", action=action, scope=f"node {node_id}", effect=effect, post=request.path
        )

    @bp.post("/console/nodes/<node_id>/<action>")
    @console.handler
    async def node_act(node_id: str, action: str) -> Any:
        if action not in NODE_ACTIONS:
            raise Refused(404, "no such action")
        session = await console.confirmed(action, "node", node_id)
        live = await state.fleet.act(session.actor, node_id, action)
        return await done(session, f"Node {node_id} is now {live.state.value}.", "/console/nodes")
