"""A node's previous keys while its key rotation overlaps live in the `node` table's
`previous_*_public_key` columns; the migration moves the `meta` rows they were kept in before."""

from __future__ import annotations

import json
from pathlib import Path

import apsw

from nexa.contracts.domain import AuditDraft, KeyId, Role
from nexa.control import store as st
from nexa.control.store import schema

_NODE_SQL = (
    "INSERT INTO node(id, hostname, signing_public_key, curve_public_key, labels, enrolled_at, admin_state)"
    " VALUES (?, ?, ?, ?, '{}', 0, 'active')"
)


def _draft() -> AuditDraft:
    return AuditDraft(
        actor_key_id=KeyId("k"),
        actor_role=Role.ADMIN,
        action="node.keys_rotated",
        target="node/n1",
        prior_sha256=None,
        next_sha256=None,
    )


def test_the_migration_moves_previous_keys_out_of_meta(tmp_path: Path) -> None:
    # A database as the build before the columns left it: previous keys in `meta`.
    db = apsw.Connection(str(tmp_path / "nexa.db"))
    before = schema.MIGRATIONS.index(next(m for m in schema.MIGRATIONS if "previous_signing_public_key" in m))
    db.execute(f"PRAGMA application_id={schema.APPLICATION_ID}")
    for number in range(before):
        db.execute(schema.MIGRATIONS[number])
    db.execute(f"PRAGMA user_version={before}")
    db.execute(_NODE_SQL, ("n1", "h1", "sig-new-1", "curve-new-1"))
    db.execute(_NODE_SQL, ("n2", "h2", "sig-2", "curve-2"))
    db.execute("INSERT INTO meta(key, value) VALUES (?, ?)", ("node_previous_keys/n1", json.dumps(["sig-1", "c-1"])))
    db.execute("INSERT INTO meta(key, value) VALUES (?, ?)", ("node_previous_keys/gone", json.dumps(["s", "c"])))

    schema.migrate(db)

    assert st.load_previous_keys(db) == {"n1": ("sig-1", "c-1")}
    assert db.execute("SELECT count(*) FROM meta WHERE key LIKE 'node!_previous!_keys/%' ESCAPE '!'").fetchall() == [
        (0,)
    ]
    # The store functions read and write the columns.
    st.rotate_node_keys(db, "n2", ("sig-2b", "curve-2b"), ("sig-2", "curve-2"), _draft())
    assert st.load_previous_keys(db) == {"n1": ("sig-1", "c-1"), "n2": ("sig-2", "curve-2")}
    st.retire_previous_keys(db, "n1")
    assert st.load_previous_keys(db) == {"n2": ("sig-2", "curve-2")}
    row = db.execute("SELECT signing_public_key, curve_public_key FROM node WHERE id = 'n2'").fetchall()
    assert row == [("sig-2b", "curve-2b")]
    db.close()
