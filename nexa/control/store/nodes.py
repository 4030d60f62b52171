"""Enrollment tokens, nodes, their reported inventory and their signed desired assignment sets."""

from __future__ import annotations

import json

import attrs

from nexa.contracts import codec
from nexa.contracts.domain import AuditDraft, AuditEvent, EnrollmentToken, Node
from nexa.contracts.node import NodeInventory
from nexa.contracts.wire import DesiredAssignments
from nexa.control.store.audit import append_audit
from nexa.control.store.sql import Db, for_update, is_postgres, txn
from nexa.errors import Conflict, NotFound, StoreConflict, Unauthenticated


def insert_token(db: Db, token: EnrollmentToken, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "INSERT INTO enrollment_token(id, token_sha256, labels, created_at, expires_at, created_by)"
            " VALUES (?,?,?,?,?,?)",
            (
                token.id,
                token.token_sha256,
                codec.canonical_json(token.labels),
                token.created_at,
                token.expires_at,
                token.created_by,
            ),
        )
        event = append_audit(db, draft)
    return event


def enroll_node(db: Db, token_sha256: str, now: float, node: Node, draft: AuditDraft) -> Node:
    """Spend a one-time token and create the node, in one transaction; refusals change nothing.

    The node takes the token's labels. Raises Unauthenticated for an unknown, used or expired token.
    """
    with txn(db):
        # Locked on PostgreSQL: another controller spending the same token waits, then finds it used.
        rows = db.execute(
            "SELECT labels, expires_at, used_at FROM enrollment_token WHERE token_sha256 = ?" + for_update(db),  # noqa: S608
            (token_sha256,),
        ).fetchall()
        if not rows:
            raise Unauthenticated("unknown enrollment token")
        labels_json, expires_at, used_at = rows[0]
        if used_at is not None:
            raise Unauthenticated("this enrollment token was already used")
        if not isinstance(expires_at, float) or expires_at <= now:
            raise Unauthenticated("this enrollment token has expired")
        labels = json.loads(str(labels_json))
        node = attrs.evolve(node, labels=labels)
        db.execute(
            "UPDATE enrollment_token SET used_at = ?, used_by_node = ? WHERE token_sha256 = ?",
            (now, node.id, token_sha256),
        )
        db.execute(
            "INSERT INTO node(id, hostname, signing_public_key, curve_public_key, labels, enrolled_at, admin_state,"
            " revoked_at) VALUES (?,?,?,?,?,?,?,?)",
            (
                node.id,
                node.hostname,
                node.signing_public_key,
                node.curve_public_key,
                codec.canonical_json(node.labels),
                node.enrolled_at,
                node.admin_state.value,
                node.revoked_at,
            ),
        )
        append_audit(db, attrs.evolve(draft, next_sha256=codec.sha256_of(codec.store, node)))
    return node


def load_nodes(db: Db) -> list[tuple[Node, NodeInventory | None, DesiredAssignments | None]]:
    with txn(db):
        rows = db.execute(
            "SELECT n.id, n.hostname, n.signing_public_key, n.curve_public_key, n.labels, n.enrolled_at,"
            " n.admin_state, n.revoked_at, i.body, d.body FROM node n"
            " LEFT JOIN node_inventory i ON i.node_id = n.id LEFT JOIN node_desired d ON d.node_id = n.id"
        ).fetchall()
    out = []
    for r in rows:
        node = codec.store.structure(
            {
                "id": r[0],
                "hostname": r[1],
                "signing_public_key": r[2],
                "curve_public_key": r[3],
                "labels": json.loads(str(r[4])),
                "enrolled_at": r[5],
                "admin_state": r[6],
                "revoked_at": r[7],
            },
            Node,
        )
        inventory = codec.loads(codec.store, str(r[8]), NodeInventory) if r[8] is not None else None
        desired = codec.loads(codec.store, str(r[9]), DesiredAssignments) if r[9] is not None else None
        out.append((node, inventory, desired))
    return out


def update_node(db: Db, node: Node, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "UPDATE node SET admin_state = ?, revoked_at = ?, labels = ? WHERE id = ?",
            (node.admin_state.value, node.revoked_at, codec.canonical_json(node.labels), node.id),
        )
        if db.changes() != 1:
            raise NotFound(f"no node {node.id}")
        event = append_audit(db, draft)
    return event


def save_inventory(db: Db, node_id: str, inventory: NodeInventory, at: float) -> None:
    """Inventory is telemetry reported by the node itself: kept, not audited."""
    with txn(db):
        db.execute(
            "INSERT INTO node_inventory(node_id, body, reported_at) VALUES (?,?,?)"
            " ON CONFLICT(node_id) DO UPDATE SET body = excluded.body, reported_at = excluded.reported_at",
            (node_id, codec.dumps(codec.store, inventory), at),
        )


def save_desired(db: Db, desired: DesiredAssignments, draft: AuditDraft | None) -> None:
    with txn(db):
        _upsert_desired(db, desired)
        if draft is not None:
            append_audit(db, draft)


def _upsert_desired(db: Db, desired: DesiredAssignments) -> None:
    # Never let an older generation overwrite a newer one: an ack recorded while a deployment
    # change for the same node is being committed may reach the store lane second.
    if is_postgres(db):  # the upsert locks the row it compares with: atomic across controllers too
        db.execute(
            "INSERT INTO node_desired(node_id, body) VALUES (?,?)"
            " ON CONFLICT(node_id) DO UPDATE SET body = excluded.body"
            " WHERE (node_desired.body::jsonb ->> 'generation')::bigint"
            " <= (excluded.body::jsonb ->> 'generation')::bigint",
            (desired.node_id, codec.dumps(codec.store, desired)),
        )
        return
    db.execute(
        "INSERT INTO node_desired(node_id, body) VALUES (?,?)"
        " ON CONFLICT(node_id) DO UPDATE SET body = excluded.body"
        " WHERE json_extract(node_desired.body, '$.generation') <= json_extract(excluded.body, '$.generation')",
        (desired.node_id, codec.dumps(codec.store, desired)),
    )


def rotate_node_keys(
    db: Db, node_id: str, keys: tuple[str, str], previous: tuple[str, str], draft: AuditDraft
) -> AuditEvent:
    """Give the node its new (signing, curve) public keys and keep `previous` admitted (the
    node's `previous_*_public_key` columns), in one transaction with its audit event. Raises
    Conflict when another node has one of the keys."""
    with txn(db):
        try:
            db.execute(
                "UPDATE node SET signing_public_key = ?, curve_public_key = ?, previous_signing_public_key = ?,"
                " previous_curve_public_key = ? WHERE id = ?",
                (*keys, *previous, node_id),
            )
        except StoreConflict:
            raise Conflict("another node is enrolled with one of these keys") from None
        if db.changes() != 1:
            raise NotFound(f"no node {node_id}")
        event = append_audit(db, draft)
    return event


def retire_previous_keys(db: Db, node_id: str) -> None:
    """The node uses its new keys: its previous ones are admitted no more."""
    with txn(db):
        db.execute(
            "UPDATE node SET previous_signing_public_key = NULL, previous_curve_public_key = NULL WHERE id = ?",
            (node_id,),
        )


def load_previous_keys(db: Db) -> dict[str, tuple[str, str]]:
    """node id → (signing, curve) public keys still admitted beside its new ones."""
    with txn(db):
        rows = db.execute(
            "SELECT id, previous_signing_public_key, previous_curve_public_key FROM node"
            " WHERE previous_signing_public_key IS NOT NULL AND previous_curve_public_key IS NOT NULL"
        ).fetchall()
    return {str(node_id): (str(signing), str(curve)) for node_id, signing, curve in rows}


def mark_needs_reenrollment(db: Db, node_id: str, key_id: str, draft: AuditDraft) -> AuditEvent | None:
    """Mark the node as needing re-enrollment (it pins only the retired controller key `key_id`),
    audited in the same transaction; None (nothing written) when it is marked already."""
    with txn(db):
        db.execute("UPDATE node SET reenroll_key_id = ? WHERE id = ? AND reenroll_key_id IS NULL", (key_id, node_id))
        if db.changes() != 1:
            return None
        event = append_audit(db, draft)
    return event


def load_reenrollment(db: Db) -> dict[str, str]:
    """node id → the retired controller key it pins, for the nodes that need re-enrollment."""
    with txn(db):
        rows = db.execute("SELECT id, reenroll_key_id FROM node WHERE reenroll_key_id IS NOT NULL").fetchall()
    return {str(node_id): str(key_id) for node_id, key_id in rows}
