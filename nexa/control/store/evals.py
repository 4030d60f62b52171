"""Evaluation suites (each registered file by name and digest) and measured runs, newest first."""

from __future__ import annotations

from nexa.contracts import codec
from nexa.contracts.domain import AuditDraft, AuditEvent
from nexa.contracts.evals import EvalRun, Suite
from nexa.control.store.audit import append_audit
from nexa.control.store.records import RecordKey
from nexa.control.store.sql import Db, txn


def insert_suite(db: Db, suite: Suite, content: str, draft: AuditDraft) -> AuditEvent:
    """Keep a suite (the same name and digest again: registered anew, as the newest)."""
    with txn(db):
        db.execute("DELETE FROM eval_suite WHERE name = ? AND digest = ?", (suite.name, suite.digest))
        db.execute(
            "INSERT INTO eval_suite(name, digest, registered_at, body, content) VALUES (?,?,?,?,?)",
            (suite.name, suite.digest, suite.registered_at, codec.dumps(codec.store, suite), content),
        )
        event = append_audit(db, draft)
    return event


def get_suite(db: Db, name: str, digest: str | None) -> tuple[Suite, str] | None:
    """The suite `name` at `digest` (None: its newest) and its file's text. Read only."""
    with txn(db):
        if digest is None:
            rows = db.execute(
                "SELECT body, content FROM eval_suite WHERE name = ? ORDER BY registered_at DESC LIMIT 1", (name,)
            ).fetchall()
        else:
            rows = db.execute(
                "SELECT body, content FROM eval_suite WHERE name = ? AND digest = ?", (name, digest)
            ).fetchall()
    return (codec.loads(codec.store, str(rows[0][0]), Suite), str(rows[0][1])) if rows else None


def list_suites(db: Db) -> list[Suite]:
    """The newest of each name, by name. Read only."""
    with txn(db):
        rows = db.execute(
            "SELECT body FROM eval_suite s WHERE registered_at = (SELECT max(registered_at) FROM eval_suite t"
            " WHERE t.name = s.name) ORDER BY name"
        ).fetchall()
    return [codec.loads(codec.store, str(body), Suite) for (body,) in rows]


def insert_eval_run(db: Db, run: EvalRun, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "INSERT INTO eval_run(id, suite, deployment, recorded_at, body) VALUES (?,?,?,?,?)",
            (run.id, run.suite, run.deployment, run.recorded_at, codec.dumps(codec.store, run)),
        )
        event = append_audit(db, draft)
    return event


def get_eval_run(db: Db, run_id: str) -> EvalRun | None:
    with txn(db):
        rows = db.execute("SELECT body FROM eval_run WHERE id = ?", (run_id,)).fetchall()
    return codec.loads(codec.store, str(rows[0][0]), EvalRun) if rows else None


def list_eval_runs(db: Db, suite: str | None, after: RecordKey | None, limit: int) -> list[EvalRun]:
    """Runs newest first (of one suite, or all), at most `limit`, those before `after`. Read only."""
    conditions: list[str] = []
    params: list[object] = []
    if suite is not None:
        conditions.append("suite = ?")
        params.append(suite)
    if after is not None:
        conditions.append("(recorded_at < ? OR (recorded_at = ? AND id < ?))")
        params += [after[0], after[0], after[1]]
    where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
    with txn(db):
        rows = db.execute(
            f"SELECT body FROM eval_run {where} ORDER BY recorded_at DESC, id DESC LIMIT ?",  # noqa: S608
            (*params, limit),
        ).fetchall()
    return [codec.loads(codec.store, str(body), EvalRun) for (body,) in rows]
