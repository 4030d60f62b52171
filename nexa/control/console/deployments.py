"""Deployments: desired against observed replicas, canaries against their objective, the placement
decision, and scale / delete behind a confirmation page."""

from __future__ import annotations

import time
from typing import Any

from quart import Blueprint, request

from nexa.contracts.domain import NodeState
from nexa.contracts.wire import RuntimeState
from nexa.control.console.pages import Console, Context, Refused, View, done, int_field
from nexa.control.console.rollouts import ROLLOUT_ACTIONS, rollout_act, rollout_effect
from nexa.control.console.sessions import Session
from nexa.control.deployments import canarysuite
from nexa.control.deployments.rollout import breach as rollout_breach

_ACTIONS = frozenset({"scale", "delete", *ROLLOUT_ACTIONS})


def register(bp: Blueprint, console: Console) -> None:
    state = console.state

    def detail(name: str, now: float) -> Context:
        view = state.deployments.show(name)
        d = view.deployment
        observed: dict[str, RuntimeState] = {}
        node_state: dict[str, NodeState] = {}
        for live in state.fleet:
            node_state[live.node.id] = live.state
            observed.update({s.assignment_id: s.state for s in live.statuses})
        replicas = [(r, False) for r in d.placed] + [(r, True) for r in (d.canary.placed if d.canary else [])]
        canary = None
        if d.canary is not None:
            o = d.canary.objective
            stats = state.meter.window(name, canary=True, seconds=o.window_s, now=now)
            gate = d.canary.suite
            suite = None
            if gate is not None:
                unmet = canarysuite.unmet(state.models, name, d.canary)
                suite = unmet or f"suite {gate.suite} passed (every pass rate >= {gate.min_pass_rate:g})"
            canary = {"c": d.canary, "stats": stats, "breach": rollout_breach(o, stats), "suite": suite}
        return {
            "view": view,
            "d": d,
            "replicas": [
                {"r": r, "canary": c, "observed": observed.get(r.id), "node_state": node_state.get(r.node_id)}
                for r, c in replicas
            ],
            "desired": RuntimeState.READY,
            "canary": canary,
            "rollout": state.deployments.rollout_status(name),
            "now": now,
        }

    async def context(session: Session, now: float) -> Context:
        return {"deployments": [detail(v.deployment.name, now) for v in state.deployments.all()]}

    console.add_view(bp, View("deployments", "Deployments", ("GET", "/api/v1/deployments"), context))

    @bp.get("/console/deployments/<name>")
    @console.handler
    async def deployment(name: str) -> Any:
        session = console.signed_in()
        console.view_allowed(session, "deployments")
        dep = detail(name, time.time())
        placement = state.deployments.placement(name)
        return await console.page(
            session, "deployments", "deployment.html", dep=dep, placement=placement.decision, title=name
        )

    @bp.get("/console/deployments/<name>/<action>")
    @console.handler
    async def deployment_confirm(name: str, action: str) -> Any:
        session = console.signed_in()
        if action not in _ACTIONS:
            raise Refused(404, "no such action")
        await console.require(session, action, f"deployment/{name}")
        d = state.deployments.show(name).deployment
        if action in ROLLOUT_ACTIONS:
            effect = rollout_effect(state.deployments.rollout_status(name), action)
        elif action == "delete":
            effect = (
                f"Deployment {name} and its {len(d.placed)} replica(s) stop; requests for "
                f"{d.alias or d.model.model} go to other deployments, or are refused when there are none."
            )
        else:
            wanted = int_field(request.args, "replicas")
            effect = f"Deployment {name} goes from {d.replicas} to {wanted} replica(s)."
        return await console.confirm(
            session,
            "deployments",
            action=action,
            scope=f"deployment {name}",
            effect=effect,
            post=request.full_path.rstrip("?"),
        )

    @bp.post("/console/deployments/<name>/<action>")
    @console.handler
    async def deployment_act(name: str, action: str) -> Any:
        if action not in _ACTIONS:
            raise Refused(404, "no such action")
        session = await console.confirmed(action, "deployment", name)
        if action in ROLLOUT_ACTIONS:
            said = await rollout_act(state.deployments, session.actor, name, action)
            return await done(session, said, f"/console/deployments/{name}")
        if action == "delete":
            await state.deployments.delete(session.actor, name)
            return await done(session, f"Deployment {name} deleted.", "/console/deployments")
        replicas = int_field(request.args, "replicas")
        assert replicas is not None
        view = await state.deployments.scale(session.actor, name, replicas)
        return await done(session, f"Deployment {name} scaled to {view.deployment.replicas}.", "/console/deployments")
