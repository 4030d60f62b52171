"""Payload retention: the policies, each tenant's wrapped data key and the records of what is kept.

Never a payload: a retained request and its answer live sealed in the S3-compatible store
(`control.datapath.retention`); these rows say whose they are, under which policy and until when.
"""

from __future__ import annotations

from typing import Final

from nexa.contracts import codec
from nexa.contracts.domain import AuditDraft, AuditEvent, KeyId, TenantId
from nexa.contracts.retention import RetainedRecord, RetentionPolicy, RetentionPolicySet
from nexa.control.store.audit import append_audit
from nexa.control.store.sql import Db, as_float, as_int, txn

_RECORD_COLUMNS: Final = "id, request_id, tenant, policy, api, stored_at, expires_at, request_bytes, answer_bytes"


def load_retention_policies(db: Db) -> list[RetentionPolicy]:
    with txn(db):
        rows = db.execute("SELECT name, body, updated_at, updated_by FROM retention_policy ORDER BY name").fetchall()
    policies = []
    for name, body, updated_at, updated_by in rows:
        spec = codec.loads(codec.store, str(body), RetentionPolicySet)
        policies.append(
            RetentionPolicy(
                name=str(name),
                ttl_s=spec.ttl_s,
                tenants=spec.tenants,
                updated_at=as_float(updated_at),
                updated_by=None if updated_by is None else KeyId(str(updated_by)),
            )
        )
    return policies


def save_retention_policy(db: Db, policy: RetentionPolicy, draft: AuditDraft) -> AuditEvent:
    spec = RetentionPolicySet(ttl_s=policy.ttl_s, tenants=policy.tenants)
    with txn(db):
        db.execute(
            "INSERT INTO retention_policy(name, body, updated_at, updated_by) VALUES (?,?,?,?)"
            " ON CONFLICT(name) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at,"
            " updated_by = excluded.updated_by",
            (policy.name, codec.dumps(codec.store, spec), policy.updated_at, policy.updated_by),
        )
        event = append_audit(db, draft)
    return event


def delete_retention_policy(db: Db, name: str, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute("DELETE FROM retention_policy WHERE name = ?", (name,))
        event = append_audit(db, draft)
    return event


def tenant_data_key(db: Db, tenant: TenantId, wrapped: str, now: float) -> str:
    """The tenant's wrapped data key: the stored one, else `wrapped`, stored now (the first
    controller to store one wins; the others read it)."""
    with txn(db):
        db.execute(
            "INSERT INTO retention_key(tenant, wrapped, created_at) VALUES (?,?,?) ON CONFLICT(tenant) DO NOTHING",
            (tenant, wrapped, now),
        )
        rows = db.execute("SELECT wrapped FROM retention_key WHERE tenant = ?", (tenant,)).fetchall()
    return str(rows[0][0])


def _record(row: tuple[object, ...]) -> RetainedRecord:
    rid, request_id, tenant, policy, api, stored_at, expires_at, request_bytes, answer_bytes = row
    return RetainedRecord(
        id=str(rid),
        request_id=str(request_id),
        tenant=TenantId(str(tenant)),
        policy=str(policy),
        api=str(api),
        stored_at=as_float(stored_at),
        expires_at=as_float(expires_at),
        request_bytes=as_int(request_bytes),
        answer_bytes=as_int(answer_bytes),
    )


def insert_retained(db: Db, record: RetainedRecord) -> None:
    with txn(db):
        db.execute(
            f"INSERT INTO retained({_RECORD_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",  # noqa: S608 - constant columns
            (
                record.id,
                record.request_id,
                record.tenant,
                record.policy,
                record.api,
                record.stored_at,
                record.expires_at,
                record.request_bytes,
                record.answer_bytes,
            ),
        )


def get_retained(db: Db, record_id: str) -> RetainedRecord | None:
    with txn(db):
        rows = db.execute(
            f"SELECT {_RECORD_COLUMNS} FROM retained WHERE id = ?",  # noqa: S608 - constant columns
            (record_id,),
        ).fetchall()
    return _record(rows[0]) if rows else None


def select_retained(
    db: Db,
    *,
    request_id: str | None = None,
    tenant: str | None = None,
    policy: str | None = None,
    expired_at: float | None = None,
    after: tuple[float, str] | None = None,
    limit: int = 1000,
) -> list[RetainedRecord]:
    """Records matching every filter given (`expired_at`: those expiring at or before it), by
    (stored_at, id) after `after`; at most `limit`."""
    where: list[str] = ["1 = 1"]
    args: list[object] = []
    for column, value in (("request_id", request_id), ("tenant", tenant), ("policy", policy)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if expired_at is not None:
        where.append("expires_at <= ?")
        args.append(expired_at)
    if after is not None:
        where.append("(stored_at > ? OR (stored_at = ? AND id > ?))")
        args += [after[0], after[0], after[1]]
    with txn(db):
        rows = db.execute(
            f"SELECT {_RECORD_COLUMNS} FROM retained WHERE {' AND '.join(where)}"  # noqa: S608 - constant columns
            " ORDER BY stored_at, id LIMIT ?",
            (*args, limit),
        ).fetchall()
    return [_record(row) for row in rows]


def delete_retained(db: Db, ids: list[str], draft: AuditDraft) -> tuple[int, AuditEvent]:
    """Delete the records `ids` (their objects are gone already) and audit it, in one transaction."""
    deleted = 0
    with txn(db):
        for record_id in ids:
            db.execute("DELETE FROM retained WHERE id = ?", (record_id,))
            deleted += db.changes()
        event = append_audit(db, draft)
    return deleted, event
