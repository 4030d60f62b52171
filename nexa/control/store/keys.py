"""API keys and tenants."""

from __future__ import annotations

import json

import attrs

from nexa.contracts import codec
from nexa.contracts.domain import ApiKey, AuditDraft, AuditEvent, KeyId, Tenant
from nexa.control.store.audit import append_audit
from nexa.control.store.sql import Db, load_all, txn
from nexa.errors import NotFound

_KEY_COLUMNS = tuple(f.name for f in attrs.fields(ApiKey))


def load_keys(db: Db) -> list[ApiKey]:
    with txn(db):
        rows = db.execute(f"SELECT {', '.join(_KEY_COLUMNS)} FROM api_key").fetchall()  # noqa: S608
    keys = []
    for row in rows:
        fields = dict(zip(_KEY_COLUMNS, row, strict=True))
        # The grant is a JSON list in its column (NULL: the default).
        fields["priorities"] = None if fields["priorities"] is None else json.loads(str(fields["priorities"]))
        keys.append(codec.store.structure(fields, ApiKey))
    return keys


def insert_key(db: Db, key: ApiKey, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        _insert_key_row(db, key)
        event = append_audit(db, draft)
    return event


def _insert_key_row(db: Db, key: ApiKey) -> None:
    db.execute(
        "INSERT INTO api_key(id, name, role, tenant, secret_sha256, created_at, created_by, revoked_at, expires_at,"
        " rotated_to, priorities) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (
            key.id,
            key.name,
            key.role.value,
            key.tenant,
            key.secret_sha256,
            key.created_at,
            key.created_by,
            key.revoked_at,
            key.expires_at,
            key.rotated_to,
            None if key.priorities is None else json.dumps([p.value for p in key.priorities]),
        ),
    )


def rotate_key(
    db: Db, rotated: ApiKey, successor: ApiKey, rotate_draft: AuditDraft, create_draft: AuditDraft
) -> tuple[AuditEvent, AuditEvent]:
    """Insert `successor` and store `rotated` (the old key with its new expiry and successor), with
    both audit events, in one transaction. NotFound when the old key was revoked or rotated meanwhile."""
    with txn(db):
        db.execute(
            "UPDATE api_key SET expires_at = ?, rotated_to = ? WHERE id = ? AND revoked_at IS NULL"
            " AND rotated_to IS NULL",
            (rotated.expires_at, successor.id, rotated.id),
        )
        if db.changes() != 1:
            raise NotFound(f"no active key {rotated.id} that was not rotated already")
        _insert_key_row(db, successor)
        rotated_event = append_audit(db, rotate_draft)
        created_event = append_audit(db, create_draft)
    return rotated_event, created_event


def revoke_key(db: Db, key_id: KeyId, at: float, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute("UPDATE api_key SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (at, key_id))
        if db.changes() != 1:
            raise NotFound(f"no active key {key_id}")
        event = append_audit(db, draft)
    return event


def load_tenants(db: Db) -> list[Tenant]:
    return load_all(db, Tenant, "tenant")


def insert_tenant(db: Db, tenant: Tenant, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "INSERT INTO tenant(id, display_name, created_at) VALUES (?,?,?)",
            (tenant.id, tenant.display_name, tenant.created_at),
        )
        event = append_audit(db, draft)
    return event
