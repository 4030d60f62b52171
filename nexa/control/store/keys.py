"""API keys and tenants."""

from __future__ import annotations

import apsw

from nexa.contracts.domain import ApiKey, AuditDraft, AuditEvent, KeyId, Tenant
from nexa.control.store.audit import append_audit
from nexa.control.store.sql import load_all, txn
from nexa.errors import NotFound


def load_keys(db: apsw.Connection) -> list[ApiKey]:
    return load_all(db, ApiKey, "api_key")


def insert_key(db: apsw.Connection, key: ApiKey, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "INSERT INTO api_key(id, name, role, tenant, secret_sha256, created_at, created_by, revoked_at)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (
                key.id,
                key.name,
                key.role.value,
                key.tenant,
                key.secret_sha256,
                key.created_at,
                key.created_by,
                key.revoked_at,
            ),
        )
        event = append_audit(db, draft)
    return event


def revoke_key(db: apsw.Connection, key_id: KeyId, at: float, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute("UPDATE api_key SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (at, key_id))
        if db.changes() != 1:
            raise NotFound(f"no active key {key_id}")
        event = append_audit(db, draft)
    return event


def load_tenants(db: apsw.Connection) -> list[Tenant]:
    return load_all(db, Tenant, "tenant")


def insert_tenant(db: apsw.Connection, tenant: Tenant, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "INSERT INTO tenant(id, display_name, created_at) VALUES (?,?,?)",
            (tenant.id, tenant.display_name, tenant.created_at),
        )
        event = append_audit(db, draft)
    return event
