"""`Accounts`: the API keys, their roles and tenants, and the audit records of what they did.

In-memory authoritative state, written through to the store.

Reads (authentication on every request, listings) never touch SQLite; writes commit to the store
first, with their audit event in the same transaction, and only then change the in-memory view.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Final

import attrs
import trio

from nexa.contracts import codec
from nexa.contracts.api import KeyCreate, KeyRotate, TenantCreate
from nexa.contracts.domain import (
    API_KEY_PREFIX,
    NAME_RE,
    SYSTEM,
    Actor,
    ApiKey,
    AuditDraft,
    AuditEvent,
    AuditResult,
    KeyId,
    Role,
    Tenant,
    TenantId,
    parse_api_key,
)
from nexa.control import store as st
from nexa.control.store.sql import Db, meta, txn
from nexa.errors import Conflict, ContractError, KeyExpired, NotFound, Unauthenticated
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: `nxk_` + 12 hex chars of public key id + `_` + 32 random bytes in unpadded base64url.
KEY_PREFIX: Final = API_KEY_PREFIX
#: A key denied a route is audited at most once per this many seconds per route; the denials in
#: between are counted (`nexa_audit_denied_suppressed`) and the next event written carries their number.
DENIED_AUDIT_WINDOW_S: Final = 5.0
#: A denied event's target (the request path, chosen by the caller) is cut to this many characters.
AUDIT_TARGET_MAX: Final = 256
#: The longest a key may live, or a rotated key's grace last (10 years).
MAX_KEY_LIFETIME_S: Final = 10 * 365 * 86400.0
#: (key, route) pairs whose last denial is remembered; past it, the stalest are forgotten.
_DENIED_TRACKED: Final = 10_000


@attrs.define
class _Denials:
    """The last denied event written for one (key, route), and the denials suppressed since."""

    written_at: float
    suppressed: int = 0


def new_api_key() -> tuple[KeyId, str]:
    key_id = KeyId(secrets.token_hex(6))
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    return key_id, f"{KEY_PREFIX}{key_id}_{secret}"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Accounts:
    """Keys and tenants (later: nodes, models, deployments)."""

    def __init__(self, store: st.Store, metrics: Metrics, keys: list[ApiKey], tenants: list[Tenant]) -> None:
        self._store = store
        self._metrics = metrics
        self._keys = {k.id: k for k in keys}
        self._tenants = {t.id: t for t in tenants}
        # Serialises revocations so two concurrent ones cannot both pass the last-admin check.
        self._revoke_lock = trio.Lock()
        self._denials: dict[tuple[KeyId | None, str], _Denials] = {}

    @classmethod
    async def load(cls, store: st.Store, metrics: Metrics) -> Accounts:
        keys = await store.run(st.load_keys)
        tenants = await store.run(st.load_tenants)
        return cls(store, metrics, keys, tenants)

    async def refresh(self) -> None:
        """Re-read keys and tenants that another controller on the store changed (`follow.ChangeFeed`).

        Under the revocation lock, so a rotation or revocation here is never undone by an older
        read. Keys and tenants are never deleted: one created here after the read began is kept."""
        async with self._revoke_lock:
            keys = await self._store.read(st.load_keys)
            tenants = await self._store.read(st.load_tenants)
            self._keys = self._keys | {k.id: k for k in keys}
            self._tenants = self._tenants | {t.id: t for t in tenants}

    async def _audited(self, fn: Callable[..., AuditEvent], *args: object) -> AuditEvent:
        """Run a mutating transaction (which appends its audit event) and count the event."""
        event = await self._store.run(fn, *args)
        self._metrics.audit_events.labels(event.result.value).inc()
        return event

    # ---- authentication ------------------------------------------------------------------------

    def authenticate(self, presented: str) -> ApiKey:
        """Map a presented secret to its active key. Constant-time on the secret's hash."""
        key_id = parse_api_key(presented)
        key = self._keys.get(key_id) if key_id else None
        # Compare even when the id is unknown so timing does not tell ids apart.
        stored = key.secret_sha256 if key else "0" * 64
        if not hmac.compare_digest(stored, _sha256(presented)) or key is None or not key.active:
            raise Unauthenticated("unknown or revoked API key")
        if key.expired(time.time()):
            assert key.expires_at is not None
            raise KeyExpired(
                f"API key {key.id} expired at {_utc(key.expires_at)}; ask an admin for a new key "
                "(`nexa keys create`), and rotate keys before they expire (`nexa keys rotate ID --grace 1d`)"
            )
        return key

    # ---- keys ----------------------------------------------------------------------------------

    def api_keys(self) -> list[ApiKey]:
        return sorted(self._keys.values(), key=lambda k: (k.created_at, k.id))

    def api_key(self, key_id: KeyId) -> ApiKey:
        key = self._keys.get(key_id)
        if key is None:
            raise NotFound(f"no key {key_id}")
        return key

    def active_keys_by_role(self) -> dict[Role, int]:
        """Keys that work now (neither revoked nor expired), by role."""
        now = time.time()
        counts = dict.fromkeys(Role, 0)
        for key in self._keys.values():
            if key.usable(now):
                counts[key.role] += 1
        return counts

    async def create_key(self, actor: Actor, req: KeyCreate, *, secret: str | None = None) -> tuple[str, ApiKey]:
        """Create a key; returns the secret (shown once) and the stored record."""
        secret, key = self._new_key(actor, req, secret=secret)
        await self._audited(st.insert_key, key, audit_draft(actor, "key.create", f"key/{key.id}", None, key))
        self._keys[key.id] = key
        return secret, key

    def _new_key(self, actor: Actor, req: KeyCreate, *, secret: str | None) -> tuple[str, ApiKey]:
        """The key `req` asks for (checked: ContractError, NotFound) and its secret; nothing stored."""
        if req.role is Role.INFERENCE:
            if req.tenant is None:
                raise ContractError("an inference key needs a tenant", problems=("tenant: required for inference",))
            if req.tenant not in self._tenants:
                raise NotFound(f"no tenant {req.tenant}")
        elif req.tenant is not None:
            raise ContractError("only inference keys belong to a tenant", problems=("tenant: only for role inference",))
        if len(req.name) > 128:
            raise ContractError("name is too long", problems=("name: at most 128 characters",))
        if req.priorities is not None and req.role is not Role.INFERENCE:
            raise ContractError(
                "priorities: only inference keys are granted priority classes; leave it out for this role",
                problems=("priorities: only for role inference",),
            )
        if req.priorities is not None and not req.priorities:
            raise ContractError(
                "priorities: a key needs at least one priority class; leave it out for standard and batch",
                problems=("priorities: at least one, or leave it out",),
            )
        now = time.time()
        expires_at = None if req.expires_in_s is None else now + _lifetime("expires_in_s", req.expires_in_s, 1.0)
        if secret is None:
            key_id, secret = new_api_key()
        else:
            parsed = parse_api_key(secret)
            if parsed is None:
                raise ContractError("the admin key file does not hold a key in nexa's format")
            key_id = parsed
        key = ApiKey(
            id=key_id,
            name=req.name,
            role=req.role,
            tenant=req.tenant,
            secret_sha256=_sha256(secret),
            created_at=now,
            created_by=actor.key_id,
            expires_at=expires_at,
            priorities=None if req.priorities is None else tuple(sorted(set(req.priorities), key=lambda p: p.rank)),
        )
        return secret, key

    async def rotate_key(self, actor: Actor, key_id: KeyId, req: KeyRotate) -> tuple[str, ApiKey, ApiKey]:
        """Issue a successor of `key_id` (same name, role and tenant) and let the old key work for
        `req.grace_s` more; returns the successor's secret (shown once), the successor and the old key."""
        grace_s = _lifetime("grace_s", req.grace_s, 0.0)
        async with self._revoke_lock:  # one rotation (or revocation) of a key at a time
            old = self._keys.get(key_id)
            now = time.time()
            if old is None or not old.active:
                raise NotFound(f"no active key {key_id}")
            if old.rotated_to is not None:
                raise Conflict(f"key {key_id} was rotated already; its successor is {old.rotated_to}")
            if old.expired(now):
                raise Conflict(f"key {key_id} has expired; create a new key with `nexa keys create`")
            if req.expires_in_s is not None:
                lifetime: float | None = _lifetime("expires_in_s", req.expires_in_s, 1.0)
            else:
                lifetime = None if old.expires_at is None else old.expires_at - old.created_at
            new_id, secret = new_api_key()
            successor = ApiKey(
                id=new_id,
                name=old.name,
                role=old.role,
                tenant=old.tenant,
                secret_sha256=_sha256(secret),
                created_at=now,
                created_by=actor.key_id,
                expires_at=None if lifetime is None else now + lifetime,
                priorities=old.priorities,
            )
            ends = now + grace_s if old.expires_at is None else min(old.expires_at, now + grace_s)
            rotated = attrs.evolve(old, expires_at=ends, rotated_to=new_id)
            events = await self._store.run(
                st.rotate_key,
                rotated,
                successor,
                audit_draft(actor, "key.rotate", f"key/{key_id}", old, rotated, detail=f"successor {new_id}"),
                audit_draft(actor, "key.create", f"key/{new_id}", None, successor, detail=f"rotated from {key_id}"),
            )
            for event in events:
                self._metrics.audit_events.labels(event.result.value).inc()
            self._keys[key_id] = rotated
            self._keys[new_id] = successor
        return secret, successor, rotated

    async def revoke_key(self, actor: Actor, key_id: KeyId) -> ApiKey:
        async with self._revoke_lock:
            return await self._revoke_key(actor, key_id)

    async def _revoke_key(self, actor: Actor, key_id: KeyId) -> ApiKey:
        key = self._keys.get(key_id)
        if key is None or not key.active:
            raise NotFound(f"no active key {key_id}")
        now = time.time()
        usable_admins = sum(1 for k in self._keys.values() if k.usable(now) and k.role is Role.ADMIN)
        if key.role is Role.ADMIN and key.usable(now) and usable_admins == 1:
            raise Conflict("refusing to revoke the last active admin key")
        revoked = attrs.evolve(key, revoked_at=now)
        assert revoked.revoked_at is not None
        await self._audited(
            st.revoke_key,
            key_id,
            revoked.revoked_at,
            audit_draft(actor, "key.revoke", f"key/{key_id}", key, revoked),
        )
        self._keys[key_id] = revoked
        return revoked

    async def ensure_admin_key(self, key_file: str | None) -> str | None:
        """On the very first start, create the admin key. Returns its secret if it was generated here.

        Created only while the store holds no key at all, checked in the insert's own transaction
        (`_insert_first_key`): of several controllers starting at once on an empty shared store,
        one creates it and the others find it (and then hold it in memory too)."""
        if self._keys:
            return None
        secret = None
        if key_file is not None:
            secret = (await trio.Path(key_file).read_text(encoding="utf-8")).strip()
        created, key = self._new_key(SYSTEM, KeyCreate(role=Role.ADMIN, name="bootstrap admin"), secret=secret)
        draft = audit_draft(SYSTEM, "key.create", f"key/{key.id}", None, key)
        event = await self._store.run(_insert_first_key, key, draft)
        if event is None:  # another controller on the store created the keys first
            self._keys = self._keys | {k.id: k for k in await self._store.run(st.load_keys)}
            return None
        self._metrics.audit_events.labels(event.result.value).inc()
        self._keys[key.id] = key
        log.info("created the bootstrap admin key", extra={"fields": {"from_file": key_file is not None}})
        return None if key_file is not None else created

    # ---- tenants -------------------------------------------------------------------------------

    def tenant_exists(self, tenant: TenantId) -> bool:
        return tenant in self._tenants

    def tenants(self) -> list[Tenant]:
        return sorted(self._tenants.values(), key=lambda t: t.id)

    async def create_tenant(self, actor: Actor, req: TenantCreate) -> Tenant:
        if not NAME_RE.match(req.id):
            raise ContractError(
                "invalid tenant id",
                problems=("id: 1-64 lower-case letters, digits, '.', '_' or '-', starting and ending alphanumeric",),
            )
        if req.id in self._tenants:
            raise Conflict(f"tenant {req.id} exists")
        tenant = Tenant(id=req.id, display_name=req.display_name or req.id, created_at=time.time())
        await self._audited(
            st.insert_tenant, tenant, audit_draft(actor, "tenant.create", f"tenant/{tenant.id}", None, tenant)
        )
        self._tenants[tenant.id] = tenant
        return tenant

    # ---- audit ---------------------------------------------------------------------------------

    async def record(self, actor: Actor, action: str, target: str, *, detail: str = "") -> AuditEvent:
        """Audit an event that changes no record (a console sign-in or sign-out)."""
        return await self._audited(
            st.record_audit, audit_draft(actor, action, target[:AUDIT_TARGET_MAX], detail=detail)
        )

    async def record_denied(self, actor: Actor, action: str, target: str, reason: str) -> AuditEvent | None:
        """Audit a refused request: at most one event per (key, route) each `DENIED_AUDIT_WINDOW_S`
        (each costs a FULL commit); None when this one was only counted."""
        now = trio.current_time()
        slot = (actor.key_id, action)
        last = self._denials.get(slot)
        if last is not None and now - last.written_at < DENIED_AUDIT_WINDOW_S:
            last.suppressed += 1
            self._metrics.audit_denied_suppressed.labels(action).inc()
            return None
        # Decided before the write: concurrent denials while it commits are counted, not written.
        self._denials.pop(slot, None)
        if len(self._denials) >= _DENIED_TRACKED:
            self._forget_denials(now)
        self._denials[slot] = _Denials(written_at=now)
        suppressed = last.suppressed if last is not None else 0
        detail = f"{reason}; {suppressed} more denied since the last such event" if suppressed else reason
        draft = audit_draft(actor, action, target[:AUDIT_TARGET_MAX], result=AuditResult.DENIED, detail=detail)
        return await self._audited(st.record_audit, draft)

    def _forget_denials(self, now: float) -> None:
        """Drop the pairs whose window has passed; if that is not enough, the least recently written."""
        for slot in [s for s, d in self._denials.items() if now - d.written_at >= DENIED_AUDIT_WINDOW_S]:
            del self._denials[slot]
        while len(self._denials) >= _DENIED_TRACKED:
            del self._denials[next(iter(self._denials))]


def _lifetime(field: str, seconds: float, lowest: float) -> float:
    """A key lifetime or grace period from a request, checked: finite, from `lowest` to 10 years."""
    if not (math.isfinite(seconds) and lowest <= seconds <= MAX_KEY_LIFETIME_S):
        problem = f"{field}: must be from {lowest:g} to {MAX_KEY_LIFETIME_S:g} seconds"
        raise ContractError(f"invalid {field}", problems=(problem,))
    return seconds


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def audit_draft(
    actor: Actor,
    action: str,
    target: str,
    prior: object | None = None,
    after: object | None = None,
    *,
    result: AuditResult = AuditResult.OK,
    detail: str = "",
) -> AuditDraft:
    """The audit event a mutation (or refusal) writes; `prior`/`after` are digested, never stored."""
    return AuditDraft(
        actor_key_id=actor.key_id,
        actor_role=actor.role,
        action=action,
        target=target,
        prior_sha256=codec.sha256_of(codec.store, prior),
        next_sha256=codec.sha256_of(codec.store, after),
        result=result,
        detail=detail,
    )


def _insert_first_key(db: Db, key: ApiKey, draft: AuditDraft) -> AuditEvent | None:
    """Insert `key` (and its audit event) only while the store holds no key; None when it holds one.

    On PostgreSQL the audit head's row is locked first (`FOR UPDATE`, as every audited write locks
    it): a second controller's transaction waits there until the first commits, and then reads
    the key the first inserted. SQLite has one writer at a time."""
    with txn(db):
        meta(db, "audit_head_seq", lock=True)
        if st.load_keys(db):
            return None
        return st.insert_key(db, key, draft)
