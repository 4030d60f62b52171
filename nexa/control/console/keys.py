"""Keys and quotas: API keys (a new one shown once), revoking one, and each tenant's quotas."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, request

from nexa.contracts.api import KeyCreate
from nexa.contracts.domain import KeyId, Role, TenantId
from nexa.contracts.usage import QuotaLimits
from nexa.control.console.pages import Console, Context, Refused, View, done, int_field
from nexa.control.console.sessions import Session
from nexa.errors import ContractError


def register(bp: Blueprint, console: Console) -> None:
    state = console.state

    async def context(session: Session, now: float) -> Context:
        return {
            "keys": state.accounts.api_keys(),
            "tenants": state.accounts.tenants(),
            "quotas": {q.tenant: q for q in state.quotas.all(now).quotas},
            "roles": list(Role),
        }

    console.add_view(bp, View("keys", "Keys and quotas", ("GET", "/api/v1/keys"), context))

    @bp.post("/console/keys")
    @console.handler
    async def key_create() -> Any:
        session = console.signed_in()
        form = await console.form(session)
        await console.require(session, "key_create", "keys")
        try:
            role = Role(form.get("role", ""))
        except ValueError:
            raise ContractError("role: unknown", problems=("role: unknown",)) from None
        tenant = (form.get("tenant") or "").strip() or None
        req = KeyCreate(role=role, name=(form.get("name") or "").strip(), tenant=TenantId(tenant) if tenant else None)
        secret, key = await state.accounts.create_key(session.actor, req)
        return await console.show("keys", created=(secret, key))

    @bp.get("/console/keys/<key_id>/revoke")
    @console.handler
    async def key_revoke_confirm(key_id: str) -> Any:
        session = console.signed_in()
        await console.require(session, "key_revoke", f"key/{key_id}")
        key = next((k for k in state.accounts.api_keys() if k.id == key_id), None)
        if key is None:
            raise Refused(404, f"no key {key_id}")
        named = f", {key.name}" if key.name else ""
        effect = f"Key {key_id} ({key.role}{named}) stops working at once, and so do its console sessions."
        return await console.confirm(
            session, "keys", action="revoke", scope=f"key {key_id}", effect=effect, post=request.path
        )

    @bp.post("/console/keys/<key_id>/revoke")
    @console.handler
    async def key_revoke(key_id: str) -> Any:
        session = await console.confirmed("key_revoke", "key", key_id)
        await state.accounts.revoke_key(session.actor, KeyId(key_id))
        return await done(session, f"Key {key_id} revoked.", "/console/keys")

    @bp.post("/console/quotas/<tenant>")
    @console.handler
    async def quota_set(tenant: str) -> Any:
        session = console.signed_in()
        form = await console.form(session)
        await console.require(session, "quota_set", f"quota/{tenant}")
        limits = QuotaLimits(
            concurrent_requests=int_field(form, "concurrent_requests", optional=True),
            requests_per_minute=int_field(form, "requests_per_minute", optional=True),
            tokens_per_minute=int_field(form, "tokens_per_minute", optional=True),
            tokens_per_day=int_field(form, "tokens_per_day", optional=True),
            audio_seconds_per_day=int_field(form, "audio_seconds_per_day", optional=True),
            speech_characters_per_day=int_field(form, "speech_characters_per_day", optional=True),
            images_per_day=int_field(form, "images_per_day", optional=True),
            adapter_tokens_per_day=_adapter_limits(form.get("adapter_tokens_per_day") or ""),
        )
        await state.quotas.set(session.actor, TenantId(tenant), limits)
        return await done(session, f"Quotas of {tenant} saved.", "/console/keys")


def _adapter_limits(text: str) -> dict[str, int]:
    """The form's per-adapter limits, `ner=50000, tone=0` (commas or spaces between); `Quotas.set`
    checks the names and counts."""
    limits: dict[str, int] = {}
    for item in text.replace(",", " ").split():
        name, eq, count = item.partition("=")
        if not eq or not count.isdecimal() or name in limits:
            problem = (
                f"adapter_tokens_per_day: {item!r} is not NAME=N (the adapter's model name and a whole number"
                " of tokens per day, each adapter once, e.g. ner=50000)"
            )
            raise ContractError(problem, problems=(problem,))
        limits[name] = int(count)
    return limits
