"""Canonical workloads: ids, state and the signed receipt once finished. Never payloads."""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

import attrs

from nexa.contracts import codec
from nexa.contracts.domain import TenantId
from nexa.contracts.gateway import AcceptedWorkload, SignedReceipt, WorkloadState
from nexa.control.store.sql import Db, delete_batch, txn
from nexa.errors import Conflict


@attrs.frozen(kw_only=True)
class WorkloadRow:
    """One canonical workload as stored: as accepted, its state, and its signed receipt once
    finished (the `finished_at` and `error` columns are the receipt's). Never payloads."""

    accepted: AcceptedWorkload
    state: WorkloadState
    receipt: SignedReceipt | None = None
    #: The controller that runs it (`[cluster] controller_id`); None: the only controller of an
    #: embedded store (and every row from before several controllers shared one).
    controller: str | None = None

    @property
    def finished_at(self) -> float | None:
        return None if self.receipt is None else self.receipt.receipt.finished_at

    @property
    def error(self) -> str | None:
        return None if self.receipt is None else self.receipt.receipt.error


#: The columns of `AcceptedWorkload`, one each, named as its fields.
_ACCEPTED: Final = tuple(f.name for f in attrs.fields(AcceptedWorkload))
_WORKLOAD_COLUMNS: Final = ", ".join((*_ACCEPTED, "state", "receipt", "controller"))


def _workload_from_row(row: tuple[object, ...]) -> WorkloadRow:
    *accepted, state, receipt, controller = row
    return WorkloadRow(
        accepted=codec.store.structure(dict(zip(_ACCEPTED, accepted, strict=True)), AcceptedWorkload),
        state=WorkloadState(str(state)),
        receipt=None if receipt is None else codec.loads(codec.store, str(receipt), SignedReceipt),
        controller=None if controller is None else str(controller),
    )


def insert_workload(db: Db, row: WorkloadRow) -> None:
    """Record an accepted workload. A workload id or idempotency key this tenant used before is a Conflict."""
    a = row.accepted
    with txn(db):
        for (key_sha,) in db.execute(
            "SELECT idempotency_key_sha256 FROM workload WHERE tenant = ? AND workload_id = ?",
            (a.tenant, a.workload_id),
        ):
            if key_sha == a.idempotency_key_sha256:
                raise Conflict(f"workload {a.workload_id} already ran with this idempotency key; fetch its receipt")
            raise Conflict(f"workload id {a.workload_id} was used before with another idempotency key")
        for (other,) in db.execute(
            "SELECT workload_id FROM workload WHERE tenant = ? AND idempotency_key_sha256 = ?",
            (a.tenant, a.idempotency_key_sha256),
        ):
            raise Conflict(f"this idempotency key was used before for workload {other}")
        accepted = codec.store.unstructure(a)
        columns = (*_ACCEPTED, "state", "finished_at", "error", "receipt", "controller")
        db.execute(
            f"INSERT INTO workload({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",  # noqa: S608
            (
                *(accepted[name] for name in _ACCEPTED),
                row.state.value,
                row.finished_at,
                row.error,
                None if row.receipt is None else codec.dumps(codec.store, row.receipt),
                row.controller,
            ),
        )


def finish_workloads(db: Db, signed: list[SignedReceipt], *, skip_finished: bool = False) -> int:
    """Write the terminal state and signed receipt of workloads, in one transaction; each once
    only: one finished already is a Conflict (nothing written), or with `skip_finished` keeps its
    own receipt (at start a controller and the leader may both fail a gone controller's
    leftovers, `follow.Orphans`: the first one's receipt stands). How many were written."""
    done = 0
    with txn(db):
        for one in signed:
            r = one.receipt
            if not r.state.terminal:
                raise Conflict(f"workload {r.workload_id} cannot finish as {r.state.value}")
            db.execute(
                "UPDATE workload SET state = ?, finished_at = ?, error = ?, receipt = ?"
                " WHERE tenant = ? AND workload_id = ? AND finished_at IS NULL",
                (r.state.value, r.finished_at, r.error, codec.dumps(codec.store, one), r.tenant, r.workload_id),
            )
            changed = db.changes()
            if changed != 1 and not skip_finished:
                raise Conflict(f"workload {r.workload_id} is not running")
            done += changed
    return done


def unfinished_workloads(db: Db, controllers: Collection[str | None] | None = None) -> list[WorkloadRow]:
    """Workloads not finished, oldest accepted first: every one (`controllers` None: the only
    controller of its store), or only those the named controllers run (a None among them: those
    no controller is named on, written before controllers were). Read only."""
    where, args = "finished_at IS NULL", tuple[str, ...]()
    if controllers is not None:
        if not controllers:
            return []
        condition, args = run_by(controllers)
        where += f" AND {condition}"
    with txn(db):
        rows = db.execute(
            f"SELECT {_WORKLOAD_COLUMNS} FROM workload WHERE {where} ORDER BY accepted_at",  # noqa: S608
            args,
        ).fetchall()
    return [_workload_from_row(row) for row in rows]


def run_by(controllers: Collection[str | None]) -> tuple[str, tuple[str, ...]]:
    """The condition (and its arguments) on the `controller` column of workloads and jobs for the
    rows of these controllers, at least one; a None among them: the rows no controller is named on."""
    names = tuple(c for c in controllers if c is not None)
    either = [f"controller IN ({','.join('?' * len(names))})"] if names else []
    if None in controllers:
        either.append("controller IS NULL")
    return f"({' OR '.join(either)})", names


def get_workload(db: Db, tenant: TenantId, workload_id: str) -> WorkloadRow | None:
    with txn(db):
        rows = db.execute(
            f"SELECT {_WORKLOAD_COLUMNS} FROM workload WHERE tenant = ? AND workload_id = ?",  # noqa: S608
            (tenant, workload_id),
        ).fetchall()
    return _workload_from_row(rows[0]) if rows else None


#: Where a page of `list_workloads` continues: after the workload (accepted_at, workload_id).
WorkloadKey = tuple[float, str]


def list_workloads(db: Db, tenant: TenantId, after: WorkloadKey | None, limit: int) -> list[WorkloadRow]:
    """This tenant's workloads, finished or not, oldest accepted first (ties by id), at most `limit`;
    with `after`, only those after that one (keyset: stable while workloads are accepted). Read only."""
    where = "tenant = ?"
    args: list[object] = [tenant]
    if after is not None:
        where += " AND (accepted_at, workload_id) > (?, ?)"
        args.extend(after)
    with txn(db):
        rows = db.execute(
            f"SELECT {_WORKLOAD_COLUMNS} FROM workload WHERE {where}"  # noqa: S608
            " ORDER BY accepted_at, workload_id LIMIT ?",
            (*args, limit),
        ).fetchall()
    return [_workload_from_row(row) for row in rows]


def workload_by_key(db: Db, tenant: TenantId, key_sha256: str) -> WorkloadRow | None:
    """This tenant's workload with that idempotency key (sha256), finished or not, if any. Read only."""
    with txn(db):
        rows = db.execute(
            f"SELECT {_WORKLOAD_COLUMNS} FROM workload WHERE tenant = ? AND idempotency_key_sha256 = ?",  # noqa: S608
            (tenant, key_sha256),
        ).fetchall()
    return _workload_from_row(rows[0]) if rows else None


def workload_receipt_by_key(db: Db, tenant: TenantId, key_sha256: str) -> SignedReceipt | None:
    """The receipt of this tenant's finished workload with that idempotency key (None if none finished)."""
    with txn(db):
        rows = db.execute(
            "SELECT receipt FROM workload WHERE tenant = ? AND idempotency_key_sha256 = ? AND receipt IS NOT NULL",
            (tenant, key_sha256),
        ).fetchall()
    return codec.loads(codec.store, str(rows[0][0]), SignedReceipt) if rows else None


def prune_workloads(db: Db, before: float) -> int:
    """Delete up to PRUNE_BATCH finished workloads (and their receipts) older than `before`."""
    with txn(db):
        return delete_batch(
            db, "workload", "tenant, workload_id", "finished_at IS NOT NULL AND finished_at < ?", (before,)
        )
