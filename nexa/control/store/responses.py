"""Stored Responses API responses: which replica keeps each, per tenant (`control.datapath.pins`).

A row is written by the controller (or gateway worker) that served the response, read by any of
them, and lives a day at most: a read past `made_after` does not find it, and the leader's sweep
deletes what expired (`prune_stored_responses`) and each tenant's oldest past its cap
(`cap_stored_responses`). Never a payload: the ids, the model named and the replica.
"""

from __future__ import annotations

import attrs

from nexa.control.store.sql import Db, as_float, delete_batch, txn


@attrs.frozen(kw_only=True)
class Pin:
    """Where one stored response lives: its replica, the model the request named (an alias, or
    `name:version`), and when it was made (Unix seconds)."""

    model: str
    deployment: str
    replica_id: str
    made_at: float


def save_stored_response(db: Db, tenant: str, response_id: str, pin: Pin) -> None:
    """Record that `tenant`'s response `response_id` is kept by `pin`'s replica (again: replaced)."""
    with txn(db):
        db.execute(
            "INSERT INTO stored_response(tenant, id, model, deployment, replica_id, made_at)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(tenant, id) DO UPDATE SET model = excluded.model,"
            " deployment = excluded.deployment, replica_id = excluded.replica_id, made_at = excluded.made_at",
            (tenant, response_id, pin.model, pin.deployment, pin.replica_id, pin.made_at),
        )


def get_stored_response(db: Db, tenant: str, response_id: str, made_after: float) -> Pin | None:
    """Where `tenant`'s response `response_id` is kept; None: not one of its, or made before
    `made_after` (expired, whether the sweep deleted it yet or not). Read only."""
    with txn(db):
        rows = db.execute(
            "SELECT model, deployment, replica_id, made_at FROM stored_response"
            " WHERE tenant = ? AND id = ? AND made_at >= ?",
            (tenant, response_id, made_after),
        ).fetchall()
    if not rows:
        return None
    model, deployment, replica_id, made_at = rows[0]
    return Pin(model=str(model), deployment=str(deployment), replica_id=str(replica_id), made_at=as_float(made_at))


def delete_stored_response(db: Db, tenant: str, response_id: str) -> bool:
    """Forget `tenant`'s response `response_id`; whether there was one."""
    with txn(db):
        db.execute("DELETE FROM stored_response WHERE tenant = ? AND id = ?", (tenant, response_id))
        return db.changes() > 0


def prune_stored_responses(db: Db, before: float) -> int:
    """Delete up to PRUNE_BATCH stored responses made before `before`; how many went."""
    with txn(db):
        return delete_batch(db, "stored_response", "tenant, id", "made_at < ?", (before,))


def cap_stored_responses(db: Db, cap: int) -> int:
    """Keep at most `cap` stored responses a tenant: each tenant's oldest beyond it go (those made
    at the same instant as its `cap`-th newest stay); how many went."""
    deleted = 0
    with txn(db):
        over = db.execute("SELECT tenant FROM stored_response GROUP BY tenant HAVING count(*) > ?", (cap,)).fetchall()
        for (tenant,) in over:
            (kept_from,) = db.execute(
                "SELECT made_at FROM stored_response WHERE tenant = ? ORDER BY made_at DESC LIMIT 1 OFFSET ?",
                (tenant, cap - 1),
            ).fetchall()[0]
            db.execute("DELETE FROM stored_response WHERE tenant = ? AND made_at < ?", (tenant, kept_from))
            deleted += db.changes()
    return deleted
