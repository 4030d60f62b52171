"""The model registry: runtimes, model versions, evaluations, aliases and their history."""

from __future__ import annotations

import attrs

from nexa.contracts import codec
from nexa.contracts.domain import AuditDraft, AuditEvent
from nexa.contracts.models import AliasReceipt, AliasRecord, EvaluationRecord, ModelRecord, ModelState, RuntimeRecord
from nexa.control.store.audit import append_audit
from nexa.control.store.sql import Db, txn
from nexa.errors import Conflict


def insert_runtime(db: Db, runtime: RuntimeRecord, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "INSERT INTO runtime(name, kind, image, body) VALUES (?,?,?,?)",
            (runtime.name, runtime.kind.value, runtime.image, codec.dumps(codec.store, runtime)),
        )
        event = append_audit(db, draft)
    return event


def load_runtimes(db: Db) -> list[RuntimeRecord]:
    with txn(db):
        rows = db.execute("SELECT body FROM runtime ORDER BY name").fetchall()
    return [codec.loads(codec.store, str(body), RuntimeRecord) for (body,) in rows]


def insert_model(db: Db, model: ModelRecord, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "INSERT INTO model(name, version, state, sha256, body) VALUES (?,?,?,?,?)",
            (model.name, model.version, model.state.value, model.artifact.sha256, codec.dumps(codec.store, model)),
        )
        event = append_audit(db, draft)
    return event


def _update_model(db: Db, model: ModelRecord, expected: ModelState) -> None:
    """Compare-and-set on the state: a model changed by someone else meanwhile is a Conflict."""
    db.execute(
        "UPDATE model SET state = ?, body = ? WHERE name = ? AND version = ? AND state = ?",
        (model.state.value, codec.dumps(codec.store, model), model.name, model.version, expected.value),
    )
    if db.changes() != 1:
        raise Conflict(f"model {model.key} changed meanwhile; try again")


def update_model(db: Db, model: ModelRecord, expected: ModelState, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        _update_model(db, model, expected)
        event = append_audit(db, draft)
    return event


def insert_evaluation(
    db: Db, evaluation: EvaluationRecord, model: ModelRecord, expected: ModelState, draft: AuditDraft
) -> AuditEvent:
    """Record an evaluation and the model state it leads to, in one transaction."""
    with txn(db):
        db.execute(
            "INSERT INTO evaluation(id, model, version, passed, recorded_at, body) VALUES (?,?,?,?,?,?)",
            (
                evaluation.id,
                evaluation.model,
                evaluation.version,
                int(evaluation.passed),
                evaluation.recorded_at,
                codec.dumps(codec.store, evaluation),
            ),
        )
        _update_model(db, model, expected)
        event = append_audit(db, draft)
    return event


def load_models(db: Db) -> tuple[list[ModelRecord], list[EvaluationRecord]]:
    with txn(db):
        models = db.execute("SELECT body FROM model ORDER BY name, version").fetchall()
        evaluations = db.execute("SELECT body FROM evaluation ORDER BY recorded_at, id").fetchall()
    return (
        [codec.loads(codec.store, str(body), ModelRecord) for (body,) in models],
        [codec.loads(codec.store, str(body), EvaluationRecord) for (body,) in evaluations],
    )


def save_alias(
    db: Db, alias: AliasRecord, expected_generation: int, receipt: AliasReceipt, draft: AuditDraft
) -> AliasReceipt:
    """Move an alias to its next generation and keep the receipt; the receipt gets the audit event's id.

    `expected_generation` is the generation the caller read (0: the alias must not exist yet).
    """
    with txn(db):
        if expected_generation == 0:
            db.execute(
                "INSERT INTO alias(name, model, version, generation, body) VALUES (?,?,?,?,?)",
                (
                    alias.name,
                    alias.target.model,
                    alias.target.version,
                    alias.generation,
                    codec.dumps(codec.store, alias),
                ),
            )
        else:
            db.execute(
                "UPDATE alias SET model = ?, version = ?, generation = ?, body = ? WHERE name = ? AND generation = ?",
                (
                    alias.target.model,
                    alias.target.version,
                    alias.generation,
                    codec.dumps(codec.store, alias),
                    alias.name,
                    expected_generation,
                ),
            )
            if db.changes() != 1:
                raise Conflict(f"alias {alias.name} changed meanwhile; try again")
        event = append_audit(db, draft)
        receipt = attrs.evolve(receipt, event_id=event.id)
        db.execute(
            "INSERT INTO alias_history(alias, generation, body) VALUES (?,?,?)",
            (alias.name, alias.generation, codec.dumps(codec.store, receipt)),
        )
    return receipt


def load_aliases(db: Db) -> tuple[list[AliasRecord], list[AliasReceipt]]:
    with txn(db):
        aliases = db.execute("SELECT body FROM alias ORDER BY name").fetchall()
        history = db.execute("SELECT body FROM alias_history ORDER BY alias, generation").fetchall()
    return (
        [codec.loads(codec.store, str(body), AliasRecord) for (body,) in aliases],
        [codec.loads(codec.store, str(body), AliasReceipt) for (body,) in history],
    )
