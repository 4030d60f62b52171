"""Deployments and their last placement decision, written with the node sets they change (and
their group replicas' runs, `GroupRunRecord`, which a controller taking over continues)."""

from __future__ import annotations

from nexa.contracts import codec
from nexa.contracts.deployments import Deployment
from nexa.contracts.domain import AuditDraft, AuditEvent
from nexa.contracts.groups import GroupRunRecord
from nexa.contracts.placement import PlacementDecision
from nexa.contracts.wire import DesiredAssignments
from nexa.control.store.audit import append_audit
from nexa.control.store.nodes import save_desired
from nexa.control.store.sql import Db, txn


def save_deployment(  # noqa: PLR0917 - one transaction function, called through Store.run(fn, *args)
    db: Db,
    name: str,
    deployment: Deployment | None,
    placement: PlacementDecision | None,
    desired: list[DesiredAssignments],
    draft: AuditDraft,
    groups: list[GroupRunRecord] | None = None,
) -> AuditEvent:
    """Write a deployment (None: delete it), its last placement decision and the node sets it changed, audited.

    One transaction: a node's signed set never names a replica the deployment record does not.
    A `placement` of None keeps the decision stored before. `groups`: its group replicas' runs
    now (`_replace_group_runs`); None keeps those stored (a deleted deployment's go).
    """
    with txn(db):
        if deployment is None:
            _replace_group_runs(db, name, [])
        elif groups is not None:
            _replace_group_runs(db, name, groups)
        if deployment is None:
            db.execute("DELETE FROM deployment WHERE name = ?", (name,))
        else:
            db.execute(
                "INSERT INTO deployment(name, generation, body, placement) VALUES (?,?,?,?)"
                " ON CONFLICT(name) DO UPDATE SET generation = excluded.generation, body = excluded.body,"
                " placement = COALESCE(excluded.placement, deployment.placement)",
                (
                    name,
                    deployment.generation,
                    codec.dumps(codec.store, deployment),
                    None if placement is None else codec.dumps(codec.store, placement),
                ),
            )
        for one in desired:
            save_desired(db, one, None)
        event = append_audit(db, draft)
    return event


def load_deployments(db: Db) -> list[tuple[Deployment, PlacementDecision | None]]:
    with txn(db):
        rows = db.execute("SELECT body, placement FROM deployment ORDER BY name").fetchall()
    return [
        (
            codec.loads(codec.store, str(body), Deployment),
            None if placement is None else codec.loads(codec.store, str(placement), PlacementDecision),
        )
        for body, placement in rows
    ]


def save_group_runs(db: Db, name: str, groups: list[GroupRunRecord], draft: AuditDraft) -> AuditEvent:
    """Replace deployment `name`'s group runs with `groups` (a run's phase moved without changing
    any node set: the group became Ready), audited (the other controllers' change feeds re-read
    them). Fenced by `Leadership.write` like every leader write."""
    with txn(db):
        _replace_group_runs(db, name, groups)
        return append_audit(db, draft)


def _replace_group_runs(db: Db, name: str, groups: list[GroupRunRecord]) -> None:
    db.execute("DELETE FROM group_run WHERE deployment = ?", (name,))
    for g in groups:
        db.execute(
            "INSERT INTO group_run(replica_id, deployment, body) VALUES (?,?,?)",
            (g.replica_id, name, codec.dumps(codec.store, g)),
        )


def load_group_runs(db: Db) -> list[GroupRunRecord]:
    """Every group replica's run as the leader last wrote it, by replica id."""
    with txn(db):
        rows = db.execute("SELECT body FROM group_run ORDER BY replica_id").fetchall()
    return [codec.loads(codec.store, str(body), GroupRunRecord) for (body,) in rows]
