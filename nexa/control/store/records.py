"""Benchmark runs and jobs: the records `nexa bench`, `nexa sim`, backups and rollouts leave.

Both list newest first, keyset-paged on (time, id). A deployment keeps its last
`RUNS_KEPT_PER_DEPLOYMENT` runs; older ones are deleted as new ones are recorded.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

from nexa.contracts import codec
from nexa.contracts.domain import AuditDraft, AuditEvent
from nexa.contracts.evidence import BenchRun, Job, JobKind, JobState
from nexa.control.store.audit import append_audit
from nexa.control.store.sql import Db, txn
from nexa.control.store.workloads import run_by
from nexa.errors import Conflict

#: The runs of one deployment kept at least; the oldest beyond it go as new ones come.
RUNS_KEPT_PER_DEPLOYMENT: Final = 1000

#: Where a newest-first page continues: before the record (time, id).
RecordKey = tuple[float, str]


def insert_bench_run(db: Db, run: BenchRun, draft: AuditDraft) -> AuditEvent:
    """Keep a run (and drop its deployment's runs beyond the newest `RUNS_KEPT_PER_DEPLOYMENT`)."""
    with txn(db):
        db.execute(
            "INSERT INTO bench_run(id, deployment, kind, recorded_at, body) VALUES (?,?,?,?,?)",
            (run.id, run.run.deployment, run.run.kind.value, run.recorded_at, codec.dumps(codec.store, run)),
        )
        db.execute(
            "DELETE FROM bench_run WHERE deployment = ? AND id NOT IN (SELECT id FROM bench_run"
            " WHERE deployment = ? ORDER BY recorded_at DESC, id DESC LIMIT ?)",
            (run.run.deployment, run.run.deployment, RUNS_KEPT_PER_DEPLOYMENT),
        )
        event = append_audit(db, draft)
    return event


def get_bench_run(db: Db, run_id: str) -> BenchRun | None:
    with txn(db):
        rows = db.execute("SELECT body FROM bench_run WHERE id = ?", (run_id,)).fetchall()
    return codec.loads(codec.store, str(rows[0][0]), BenchRun) if rows else None


def list_bench_runs(db: Db, deployment: str | None, after: RecordKey | None, limit: int) -> list[BenchRun]:
    """Runs newest first (of one deployment, or all), at most `limit`, those before `after`. Read only."""
    where, args = _newest_first(["deployment = ?"] if deployment is not None else [], after, "recorded_at")
    params: list[object] = [deployment] if deployment is not None else []
    with txn(db):
        rows = db.execute(
            f"SELECT body FROM bench_run {where} ORDER BY recorded_at DESC, id DESC LIMIT ?",  # noqa: S608
            (*params, *args, limit),
        ).fetchall()
    return [codec.loads(codec.store, str(body), BenchRun) for (body,) in rows]


def latest_bench_runs(db: Db) -> list[BenchRun]:
    """The newest run of each (deployment, kind). Read only."""
    with txn(db):
        rows = db.execute(
            "SELECT body FROM bench_run b WHERE id = (SELECT id FROM bench_run c WHERE c.deployment = b.deployment"
            " AND c.kind = b.kind ORDER BY recorded_at DESC, id DESC LIMIT 1) ORDER BY deployment, kind"
        ).fetchall()
    return [codec.loads(codec.store, str(body), BenchRun) for (body,) in rows]


def insert_job(
    db: Db, job: Job, subject: str | None, draft: AuditDraft | None, controller: str | None = None
) -> AuditEvent | None:
    """Keep a new job; audited when `draft` is given (client jobs). `controller`: the one that
    took it (None: the only controller of an embedded store)."""
    with txn(db):
        db.execute(
            "INSERT INTO job(id, kind, state, subject, started_at, updated_at, body, controller)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (job.id, job.kind.value, job.state.value, subject, job.started_at, job.updated_at, _body(job), controller),
        )
        event = append_audit(db, draft) if draft is not None else None
    return event


def update_job(db: Db, job: Job) -> None:
    """Write a running job's next state; Conflict when it finished meanwhile."""
    with txn(db):
        db.execute(
            "UPDATE job SET state = ?, updated_at = ?, body = ? WHERE id = ? AND state = ?",
            (job.state.value, job.updated_at, _body(job), job.id, JobState.RUNNING.value),
        )
        if db.changes() != 1:
            raise Conflict(f"job {job.id} has finished; a finished job takes no update")


def get_job(db: Db, job_id: str) -> Job | None:
    with txn(db):
        rows = db.execute("SELECT body FROM job WHERE id = ?", (job_id,)).fetchall()
    return codec.loads(codec.store, str(rows[0][0]), Job) if rows else None


def running_job_of(db: Db, kind: JobKind, subject: str) -> Job | None:
    """The running job of `kind` about `subject` (a controller-run job), if any."""
    with txn(db):
        rows = db.execute(
            "SELECT body FROM job WHERE kind = ? AND subject = ? AND state = ? ORDER BY started_at DESC LIMIT 1",
            (kind.value, subject, JobState.RUNNING.value),
        ).fetchall()
    return codec.loads(codec.store, str(rows[0][0]), Job) if rows else None


def list_jobs(db: Db, kind: JobKind | None, state: JobState | None, after: RecordKey | None, limit: int) -> list[Job]:
    """Jobs newest first, of `kind` and in `state` when given, at most `limit`, those before `after`."""
    conditions, params = [], []
    if kind is not None:
        conditions.append("kind = ?")
        params.append(kind.value)
    if state is not None:
        conditions.append("state = ?")
        params.append(state.value)
    where, args = _newest_first(conditions, after, "started_at")
    with txn(db):
        rows = db.execute(
            f"SELECT body FROM job {where} ORDER BY started_at DESC, id DESC LIMIT ?",  # noqa: S608
            (*params, *args, limit),
        ).fetchall()
    return [codec.loads(codec.store, str(body), Job) for (body,) in rows]


def stale_jobs(
    db: Db, kinds: tuple[JobKind, ...], updated_before: float, controllers: Collection[str | None] | None = None
) -> list[Job]:
    """Running jobs of `kinds` last updated before `updated_before`: of any controller
    (`controllers` None), or only of the named ones (a None among them: of no controller named)."""
    marks = ",".join("?" * len(kinds))
    where, names = f"state = ? AND updated_at < ? AND kind IN ({marks})", tuple[str, ...]()
    if controllers is not None:
        if not controllers:
            return []
        condition, names = run_by(controllers)
        where += f" AND {condition}"
    with txn(db):
        rows = db.execute(
            f"SELECT body FROM job WHERE {where}",  # noqa: S608
            (JobState.RUNNING.value, updated_before, *(k.value for k in kinds), *names),
        ).fetchall()
    return [codec.loads(codec.store, str(body), Job) for (body,) in rows]


def _newest_first(conditions: list[str], after: RecordKey | None, column: str) -> tuple[str, tuple[object, ...]]:
    if after is None:
        return ("WHERE " + " AND ".join(conditions)) if conditions else "", ()
    return "WHERE " + " AND ".join([*conditions, f"({column}, id) < (?, ?)"]), after


def _body(job: Job) -> str:
    return codec.dumps(codec.store, job)
