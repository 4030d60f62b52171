"""The audit chain: every mutation appends its event in its own transaction (`append_audit`),
each event hashing the one before it; `verify_audit` names the first event that was tampered with."""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Final

import attrs

from nexa.contracts import codec
from nexa.contracts.api import AuditCheckpoint, AuditVerdict
from nexa.contracts.domain import AuditDraft, AuditEvent, EventId
from nexa.control.store.sql import Db, is_postgres, meta, meta_int, repeatable_read, txn

GENESIS_SHA256: Final = "0" * 64


def event_sha256(event: AuditEvent) -> str:
    """SHA-256 over every field but `sha256` itself, in canonical JSON."""
    data = codec.store.unstructure(event)
    del data["sha256"]
    return hashlib.sha256(codec.canonical_json(data).encode()).hexdigest()


def append_audit(db: Db, draft: AuditDraft) -> AuditEvent:
    """Append one event. Must be called inside the caller's `with txn(db):` transaction.

    On PostgreSQL the head's rows are locked (FOR UPDATE) until the transaction ends: another
    controller's append waits for this one and then links to it, so the chain never forks."""
    if is_postgres(db):
        head = dict(
            db.execute(
                "SELECT key, value FROM meta WHERE key IN ('audit_head_seq', 'audit_head_sha256') FOR UPDATE"
            ).fetchall()
        )
        seq = int(head["audit_head_seq"]) + 1
        prev = str(head["audit_head_sha256"]) or GENESIS_SHA256
    else:
        seq = meta_int(db, "audit_head_seq") + 1
        prev = str(meta(db, "audit_head_sha256")) or GENESIS_SHA256
    unsigned = AuditEvent(
        seq=seq,
        id=EventId("ev_" + secrets.token_hex(8)),
        time=time.time(),
        actor_key_id=draft.actor_key_id,
        actor_role=draft.actor_role,
        action=draft.action,
        target=draft.target,
        prior_sha256=draft.prior_sha256,
        next_sha256=draft.next_sha256,
        result=draft.result,
        detail=draft.detail,
        prev_sha256=prev,
        sha256="",
    )
    event = attrs.evolve(unsigned, sha256=event_sha256(unsigned))
    db.execute(
        "INSERT INTO audit(seq, id, time, actor_key_id, actor_role, action, target, prior_sha256,"
        " next_sha256, result, detail, prev_sha256, sha256) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            event.seq,
            event.id,
            event.time,
            event.actor_key_id,
            event.actor_role,
            event.action,
            event.target,
            event.prior_sha256,
            event.next_sha256,
            event.result,
            event.detail,
            event.prev_sha256,
            event.sha256,
        ),
    )
    db.execute("UPDATE meta SET value = ? WHERE key = 'audit_head_seq'", (seq,))
    db.execute("UPDATE meta SET value = ? WHERE key = 'audit_head_sha256'", (event.sha256,))
    return event


_AUDIT_COLUMNS: Final = (
    "seq, id, time, actor_key_id, actor_role, action, target, prior_sha256, next_sha256, result, detail,"
    " prev_sha256, sha256"
)


def _event_from_row(row: tuple[object, ...]) -> AuditEvent:
    names = [f.name for f in attrs.fields(AuditEvent)]
    return codec.store.structure(dict(zip(names, row, strict=True)), AuditEvent)


def record_audit(db: Db, draft: AuditDraft) -> AuditEvent:
    """A transaction that only appends an event (refusals, transitions without other state)."""
    with txn(db):
        event = append_audit(db, draft)
    return event


@attrs.frozen(kw_only=True)
class AuditQuery:
    after_seq: int = 0
    limit: int = 100
    action: str | None = None
    actor_key_id: str | None = None
    target: str | None = None
    since: float | None = None
    until: float | None = None


def list_audit(db: Db, q: AuditQuery) -> list[AuditEvent]:
    where: list[str] = ["seq > ?"]
    args: list[str | float] = [q.after_seq]
    for column, value in (("action", q.action), ("actor_key_id", q.actor_key_id), ("target", q.target)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if q.since is not None:
        where.append("time >= ?")
        args.append(q.since)
    if q.until is not None:
        where.append("time < ?")
        args.append(q.until)
    sql = f"SELECT {_AUDIT_COLUMNS} FROM audit WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"  # noqa: S608
    with txn(db):
        rows = db.execute(sql, (*args, q.limit)).fetchall()
    return [_event_from_row(row) for row in rows]


def audit_head(db: Db) -> tuple[int, str]:
    """The chain's head: the last event's seq and sha256 (0 and the genesis hash when empty)."""
    with txn(db):
        repeatable_read(db)  # both rows of one commit
        seq = meta_int(db, "audit_head_seq")
        sha = str(meta(db, "audit_head_sha256"))
    return seq, sha or GENESIS_SHA256


def verify_audit(  # noqa: PLR0911 - one return per way the chain can be broken
    db: Db, against: AuditCheckpoint | None = None
) -> AuditVerdict:
    """Recompute the chain; name the first event that was edited, deleted, inserted or reordered.

    With `against` (a checkpoint whose signature the caller checked), the event at its seq must
    still have its sha256: a chain rewritten after the checkpoint, hashes recomputed, fails here.
    """
    if against is not None and against.seq == 0 and against.sha256 != GENESIS_SHA256:
        return AuditVerdict(ok=False, checked=0, first_bad_seq=0, reason="the checkpoint's genesis hash is wrong")
    with txn(db):
        repeatable_read(db)  # the head and the chain as of one commit, whatever others append meanwhile
        head_seq = meta_int(db, "audit_head_seq")
        head_sha = str(meta(db, "audit_head_sha256"))
        prev, expected_seq, checked = GENESIS_SHA256, 1, 0
        for row in db.execute(f"SELECT {_AUDIT_COLUMNS} FROM audit ORDER BY seq"):  # noqa: S608
            try:
                event = _event_from_row(row)
            except Exception:
                return _bad(checked, row, "event does not parse (edited by hand?)")
            if event.seq != expected_seq:
                return _bad(checked, row, f"sequence gap: expected {expected_seq} (an event was deleted)")
            if event.prev_sha256 != prev:
                return _bad(checked, row, "prev_sha256 does not match the event before it")
            if event_sha256(event) != event.sha256:
                return _bad(checked, row, "content does not match its sha256 (edited)")
            if against is not None and event.seq == against.seq and event.sha256 != against.sha256:
                return _bad(
                    checked, row, "the event at the signed checkpoint has another sha256 (chain rewritten after it)"
                )
            prev, expected_seq, checked = event.sha256, expected_seq + 1, checked + 1
        if checked != head_seq or (checked and prev != head_sha):
            return AuditVerdict(
                ok=False,
                checked=checked,
                first_bad_seq=checked + 1,
                reason=f"chain ends at {checked} but the head records {head_seq} (tail deleted or head edited)",
            )
        if against is not None and against.seq > checked:
            return AuditVerdict(
                ok=False,
                checked=checked,
                first_bad_seq=checked + 1,
                reason=f"the chain ends at {checked} but the signed checkpoint records {against.seq} (events deleted)",
            )
        return AuditVerdict(ok=True, checked=checked)


def _bad(checked: int, row: tuple[object, ...], reason: str) -> AuditVerdict:
    seq, event_id = row[0], row[1]
    return AuditVerdict(
        ok=False,
        checked=checked,
        first_bad_seq=seq if isinstance(seq, int) else None,
        first_bad_id=str(event_id),
        reason=reason,
    )
