"""Runtime qualifications (`nexa runtimes qualify`): each signed record kept, newest first, keyset-paged
on (finished_at, id); the newest record of each (image digest, arch, GPU model) decides placement."""

from __future__ import annotations

from nexa.contracts import codec
from nexa.contracts.domain import AuditDraft, AuditEvent
from nexa.contracts.qualification import SignedQualification
from nexa.control.store.audit import append_audit
from nexa.control.store.records import RecordKey
from nexa.control.store.sql import Db, txn


def insert_qualification(db: Db, signed: SignedQualification, draft: AuditDraft) -> AuditEvent:
    """Keep a signed qualification, audited."""
    q = signed.qualification
    with txn(db):
        db.execute(
            "INSERT INTO qualification(id, runtime, image_digest, arch, gpu_model, passed, finished_at, body)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (
                q.id,
                q.runtime,
                q.image_digest,
                q.arch,
                q.gpu_model,
                int(q.passed),
                q.finished_at,
                codec.dumps(codec.store, signed),
            ),
        )
        event = append_audit(db, draft)
    return event


def get_qualification(db: Db, qualification_id: str) -> SignedQualification | None:
    with txn(db):
        rows = db.execute("SELECT body FROM qualification WHERE id = ?", (qualification_id,)).fetchall()
    return codec.loads(codec.store, str(rows[0][0]), SignedQualification) if rows else None


def list_qualifications(db: Db, runtime: str | None, after: RecordKey | None, limit: int) -> list[SignedQualification]:
    """Qualifications newest first (of one runtime, or all), at most `limit`, those before `after`. Read only."""
    conditions: list[str] = []
    params: list[object] = []
    if runtime is not None:
        conditions.append("runtime = ?")
        params.append(runtime)
    if after is not None:
        conditions.append("(finished_at, id) < (?, ?)")
        params.extend(after)
    where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
    with txn(db):
        rows = db.execute(
            f"SELECT body FROM qualification {where} ORDER BY finished_at DESC, id DESC LIMIT ?",  # noqa: S608
            (*params, limit),
        ).fetchall()
    return [codec.loads(codec.store, str(body), SignedQualification) for (body,) in rows]


def latest_qualifications(db: Db) -> list[SignedQualification]:
    """The newest qualification of each (image digest, arch, GPU model). Read only."""
    with txn(db):
        rows = db.execute(
            "SELECT body FROM qualification q WHERE id = (SELECT id FROM qualification r"
            " WHERE r.image_digest = q.image_digest AND r.arch = q.arch AND r.gpu_model = q.gpu_model"
            " ORDER BY finished_at DESC, id DESC LIMIT 1) ORDER BY image_digest, arch, gpu_model"
        ).fetchall()
    return [codec.loads(codec.store, str(body), SignedQualification) for (body,) in rows]
