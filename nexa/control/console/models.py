"""Runtimes, models and aliases: runtime images with their newest qualifications (`nexa runtimes
qualify`); model versions with their evaluations and licences; approve, promote, roll back."""

from __future__ import annotations

import math
from typing import Any, Final

from quart import Blueprint, request

from nexa.contracts.models import AliasPromote, LicenseRecord, ModelState
from nexa.contracts.qualification import Qualification
from nexa.control.console.pages import Console, Context, View, done
from nexa.control.console.sessions import Session
from nexa.control.registry.models import ALLOWED_FROM

#: Licences expiring within this many seconds are flagged.
LICENSE_WARN_S: Final = 30 * 86400.0
#: Alias changes shown per alias, newest first.
ALIAS_HISTORY: Final = 10
#: Qualifications read for the runtimes' table (newest first), and shown per runtime.
QUALIFICATIONS_READ: Final = 200
QUALIFICATIONS_SHOWN: Final = 5


def license_warning(lic: LicenseRecord | None, now: float) -> str | None:
    if lic is None:
        return "no licence recorded"
    if lic.expires_at is not None and lic.expires_at <= now:
        return "licence expired"
    if lic.expires_at is not None and lic.expires_at - now <= LICENSE_WARN_S:
        return f"licence expires in {math.ceil((lic.expires_at - now) / 86400)} days"
    return None


def register(bp: Blueprint, console: Console) -> None:
    models = console.state.models

    async def context(session: Session, now: float) -> Context:
        rows = [
            {
                "m": m,
                "evaluations": models.evaluations(m.name, m.version),
                "aliases": models.aliases_of(m.name, m.version),
                "license_warning": license_warning(m.license, now),
                "may_approve": m.state in ALLOWED_FROM["approve"],
                "may_promote": m.state is ModelState.APPROVED,
            }
            for m in models.models()
        ]
        aliases = [{"a": a, "history": models.alias(a.name)[1][-ALIAS_HISTORY:][::-1]} for a in models.aliases()]
        return {"models": rows, "aliases": aliases, "runtimes": await runtimes()}

    async def runtimes() -> list[dict[str, Any]]:
        qualifications = console.state.qualifications
        found = [] if qualifications is None else (await qualifications.page(None, None, QUALIFICATIONS_READ))[0]
        by_runtime: dict[str, list[Qualification]] = {}
        for signed in found:
            by_runtime.setdefault(signed.qualification.runtime, []).append(signed.qualification)
        return [
            {"r": r, "qualifications": by_runtime.get(r.name, [])[:QUALIFICATIONS_SHOWN]} for r in models.runtimes()
        ]

    console.add_view(bp, View("models", "Models", ("GET", "/api/v1/models"), context))

    @bp.post("/console/models/<name>/<version>/approve")
    @console.handler
    async def approve(name: str, version: str) -> Any:
        session = console.signed_in()
        await console.form(session)
        await console.require(session, "approve", f"model/{name}/{version}")
        model = await models.approve(session.actor, name, version)
        return await done(session, f"{name} {version} is now {model.state.value}.", "/console/models")

    @bp.post("/console/aliases/<name>/promote")
    @console.handler
    async def promote(name: str) -> Any:
        session = console.signed_in()
        form = await console.form(session)
        alias = (form.get("alias") or name).strip()
        await console.require(session, "promote", f"alias/{alias}")
        req = AliasPromote(model=form.get("model", ""), version=form.get("version", ""))
        receipt = await models.promote(session.actor, alias, req)
        to = f"{receipt.to.model} {receipt.to.version}"
        return await done(
            session, f"Alias {alias} now points at {to} (generation {receipt.generation}).", "/console/models"
        )

    @bp.get("/console/aliases/<name>/rollback")
    @console.handler
    async def rollback_confirm(name: str) -> Any:
        session = console.signed_in()
        await console.require(session, "rollback", f"alias/{name}")
        alias, history = models.alias(name)
        prior = history[-1].from_ if history else None
        effect = f"Alias {name} points at {alias.target.model} {alias.target.version}; it returns to " + (
            f"{prior.model} {prior.version}." if prior else "its previous target."
        )
        return await console.confirm(
            session, "models", action="rollback", scope=f"alias {name}", effect=effect, post=request.path
        )

    @bp.post("/console/aliases/<name>/rollback")
    @console.handler
    async def rollback(name: str) -> Any:
        session = await console.confirmed("rollback", "alias", name)
        receipt = await models.rollback(session.actor, name)
        return await done(
            session, f"Alias {name} rolled back to {receipt.to.model} {receipt.to.version}.", "/console/models"
        )
