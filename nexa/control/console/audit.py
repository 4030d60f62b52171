"""Audit: the chain, filtered and paged (`?cursor=`, `next_cursor`), and verifying it."""

from __future__ import annotations

from typing import Any, Final

from quart import Blueprint, render_template, request

from nexa.contracts.domain import AuditResult
from nexa.control import store as st
from nexa.control.console.pages import Console, Context, View, html_response
from nexa.control.console.sessions import Session

#: Audit events on one page.
PAGE_SIZE: Final = 100


def register(bp: Blueprint, console: Console) -> None:
    store = console.state.store

    async def context(session: Session, now: float) -> Context:
        args = request.args
        cursor = args.get("cursor", "0")
        q = st.AuditQuery(
            after_seq=int(cursor) if cursor.isdigit() else 0,
            limit=PAGE_SIZE,
            action=args.get("action") or None,
            actor_key_id=args.get("actor") or None,
            target=args.get("target") or None,
        )
        events = await store.read(st.list_audit, q)
        return {
            "events": events,
            "filters": {"action": q.action or "", "actor": q.actor_key_id or "", "target": q.target or ""},
            "next_cursor": events[-1].seq if len(events) == q.limit else None,
            "results": list(AuditResult),
        }

    console.add_view(bp, View("audit", "Audit", ("GET", "/api/v1/audit"), context))

    @bp.post("/console/audit/verify")
    @console.handler
    async def verify() -> Any:
        session = console.signed_in()
        await console.form(session)
        await console.require(session, "verify", "audit")
        verdict = await store.read(st.verify_audit)
        if request.headers.get("HX-Request") == "true":
            return html_response(await render_template("console/verdict.html", verdict=verdict))
        return await console.show("audit", verdict=verdict)
