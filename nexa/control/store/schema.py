"""The database schema of both backends: `MIGRATIONS` (append only), `migrate` (SQLite) and
`migrate_pg` (PostgreSQL), run when the store opens; `take_epoch`.

One list of migrations, written once in SQLite's words, which are the portable subset both backends
read, and given to PostgreSQL through `postgresql`, a small explicit translation:
- column types: SQLite's INTEGER is BIGINT, REAL is DOUBLE PRECISION, and TEXT is TEXT COLLATE "C"
  (text sorts bytewise, as in SQLite, so keyset pages and their order are the same on both
  backends whatever locale the database was created with); the meta table's ANY value is TEXT
  (`sql.meta_int` reads it), and `STRICT` goes (PostgreSQL's columns are strict already);
- `seq INTEGER PRIMARY KEY`, which SQLite numbers when an insert leaves it out, is an identity
  column in the tables whose inserts do (`_NUMBERED`);
- statements that only move data SQLite alone kept are SQLite's only (`_SQLITE_ONLY`).
A migration written in anything else (a BLOB, `INSERT OR IGNORE`, AUTOINCREMENT, a SQLite function)
needs its rule here; `tests/control/test_store_postgres.py` migrates both backends and compares
every table, column (its type class) and index.

The version: SQLite's `PRAGMA user_version` (and the file's `application_id`); PostgreSQL's one row
of `nexa_schema` (the application id and the version), its presence the mark of a nexa database.
Both count the same migrations, so version n is the same schema on either backend.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from nexa.contracts.bounds import MAX_EPOCH
from nexa.control.store.sql import Db, as_int, is_postgres, meta_int, pragma_int, txn
from nexa.errors import EpochExhausted, StoreError

#: "NEXA" — marks the file as ours for `file(1)` and for a sanity check at open.
APPLICATION_ID: Final = 0x4E455841

# Each entry moves the schema from version i to i+1 on either backend (`postgresql` translates it); never
# edit a released entry, append. Write what both read (the module docstring), or add its rule there.
MIGRATIONS: Final[tuple[str, ...]] = (
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value ANY) STRICT;
    INSERT INTO meta(key, value) VALUES ('epoch', 0), ('audit_head_seq', 0), ('audit_head_sha256', '');
    CREATE TABLE tenant (
        id TEXT PRIMARY KEY,
        display_name TEXT NOT NULL,
        created_at REAL NOT NULL
    ) STRICT;
    CREATE TABLE api_key (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        role TEXT NOT NULL,
        tenant TEXT REFERENCES tenant(id),
        secret_sha256 TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        created_by TEXT,
        revoked_at REAL
    ) STRICT;
    CREATE TABLE audit (
        seq INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        time REAL NOT NULL,
        actor_key_id TEXT,
        actor_role TEXT,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        prior_sha256 TEXT,
        next_sha256 TEXT,
        result TEXT NOT NULL,
        detail TEXT NOT NULL,
        prev_sha256 TEXT NOT NULL,
        sha256 TEXT NOT NULL
    ) STRICT;
    CREATE INDEX audit_action ON audit(action, seq);
    CREATE INDEX audit_actor ON audit(actor_key_id, seq);
    CREATE INDEX audit_target ON audit(target, seq);
    """,
    """
    CREATE TABLE enrollment_token (
        id TEXT PRIMARY KEY,
        token_sha256 TEXT NOT NULL UNIQUE,
        labels TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        created_by TEXT,
        used_at REAL,
        used_by_node TEXT
    ) STRICT;
    CREATE TABLE node (
        id TEXT PRIMARY KEY,
        hostname TEXT NOT NULL,
        signing_public_key TEXT NOT NULL UNIQUE,
        curve_public_key TEXT NOT NULL UNIQUE,
        labels TEXT NOT NULL,
        enrolled_at REAL NOT NULL,
        admin_state TEXT NOT NULL,
        revoked_at REAL
    ) STRICT;
    CREATE TABLE node_inventory (
        node_id TEXT PRIMARY KEY REFERENCES node(id),
        body TEXT NOT NULL,
        reported_at REAL NOT NULL
    ) STRICT;
    CREATE TABLE node_desired (
        node_id TEXT PRIMARY KEY REFERENCES node(id),
        body TEXT NOT NULL
    ) STRICT;
    """,
    """
    CREATE TABLE runtime (
        name TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        image TEXT NOT NULL,
        body TEXT NOT NULL
    ) STRICT;
    CREATE TABLE model (
        name TEXT NOT NULL,
        version TEXT NOT NULL,
        state TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (name, version)
    ) STRICT;
    CREATE INDEX model_sha256 ON model(sha256);
    CREATE TABLE evaluation (
        id TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        passed INTEGER NOT NULL,
        recorded_at REAL NOT NULL,
        body TEXT NOT NULL,
        FOREIGN KEY (model, version) REFERENCES model(name, version)
    ) STRICT;
    CREATE INDEX evaluation_model ON evaluation(model, version, recorded_at);
    CREATE TABLE alias (
        name TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        generation INTEGER NOT NULL,
        body TEXT NOT NULL,
        FOREIGN KEY (model, version) REFERENCES model(name, version)
    ) STRICT;
    CREATE TABLE alias_history (
        alias TEXT NOT NULL REFERENCES alias(name),
        generation INTEGER NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (alias, generation)
    ) STRICT;
    """,
    """
    CREATE TABLE deployment (
        name TEXT PRIMARY KEY,
        generation INTEGER NOT NULL,
        body TEXT NOT NULL,
        placement TEXT
    ) STRICT;
    """,
    # The gateway: tenant quotas, metered usage (metadata only, never payloads), canonical workloads.
    """
    CREATE TABLE quota (
        tenant TEXT PRIMARY KEY REFERENCES tenant(id),
        body TEXT NOT NULL,
        updated_at REAL NOT NULL,
        updated_by TEXT
    ) STRICT;
    CREATE TABLE usage (
        seq INTEGER PRIMARY KEY,
        request_id TEXT NOT NULL,
        workload_id TEXT,
        api TEXT NOT NULL,
        tenant TEXT NOT NULL,
        key_id TEXT NOT NULL,
        capability TEXT NOT NULL,
        alias TEXT NOT NULL,
        model TEXT NOT NULL,
        model_version TEXT NOT NULL,
        deployment TEXT NOT NULL,
        node_id TEXT NOT NULL,
        status TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        queue_ms REAL NOT NULL,
        ttft_ms REAL,
        duration_ms REAL NOT NULL,
        finished_at REAL NOT NULL,
        canary INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX usage_finished ON usage(finished_at);
    CREATE INDEX usage_tenant ON usage(tenant, finished_at);
    CREATE TABLE workload (
        tenant TEXT NOT NULL,
        workload_id TEXT NOT NULL,
        idempotency_key_sha256 TEXT NOT NULL,
        key_id TEXT NOT NULL,
        capability TEXT NOT NULL,
        alias TEXT NOT NULL,
        state TEXT NOT NULL,
        model TEXT NOT NULL,
        priority TEXT NOT NULL,
        accepted_at REAL NOT NULL,
        finished_at REAL,
        error TEXT,
        receipt TEXT,
        PRIMARY KEY (tenant, workload_id),
        UNIQUE (tenant, idempotency_key_sha256)
    ) STRICT;
    CREATE INDEX workload_unfinished ON workload(state) WHERE finished_at IS NULL;
    """,
    """
    CREATE INDEX workload_finished ON workload(finished_at) WHERE finished_at IS NOT NULL;
    """,
    # A digest of the envelope an idempotency key came with: a replay with another body is refused.
    """
    ALTER TABLE workload ADD COLUMN request_sha256 TEXT;
    """,
    # A tenant's workloads, paged in order of acceptance (`list_workloads`).
    """
    CREATE INDEX workload_tenant_accepted ON workload(tenant, accepted_at, workload_id);
    """,
    # API keys that expire (`nexa keys create --expires`), and the successor a rotation issued.
    """
    ALTER TABLE api_key ADD COLUMN expires_at REAL;
    ALTER TABLE api_key ADD COLUMN rotated_to TEXT;
    """,
    # A node's keys before it rotated them, admitted until it uses the new ones (both NULL outside
    # a rotation); they were kept in `meta` as `node_previous_keys/<id>` = [signing, curve] before.
    """
    ALTER TABLE node ADD COLUMN previous_signing_public_key TEXT;
    ALTER TABLE node ADD COLUMN previous_curve_public_key TEXT;
    UPDATE node SET
        previous_signing_public_key =
            (SELECT json_extract(m.value, '$[0]') FROM meta m WHERE m.key = 'node_previous_keys/' || node.id),
        previous_curve_public_key =
            (SELECT json_extract(m.value, '$[1]') FROM meta m WHERE m.key = 'node_previous_keys/' || node.id);
    DELETE FROM meta WHERE substr(key, 1, 19) = 'node_previous_keys/';
    """,
    # A node that said it pins only a retired controller key after the overlap ended: that key's
    # id; it is sent nothing until enrolled again (NULL: it follows the controller's keys).
    """
    ALTER TABLE node ADD COLUMN reenroll_key_id TEXT;
    """,
    # Benchmark runs (`nexa bench`, the last runs of each deployment kept) and the Jobs page's jobs:
    # `subject` names what a controller-run job is about (`deployment/<name>` for a rollout).
    """
    CREATE TABLE bench_run (
        id TEXT PRIMARY KEY,
        deployment TEXT NOT NULL,
        kind TEXT NOT NULL,
        recorded_at REAL NOT NULL,
        body TEXT NOT NULL
    ) STRICT;
    CREATE INDEX bench_run_deployment ON bench_run(deployment, recorded_at, id);
    CREATE INDEX bench_run_recorded ON bench_run(recorded_at, id);
    CREATE TABLE job (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        state TEXT NOT NULL,
        subject TEXT,
        started_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        body TEXT NOT NULL
    ) STRICT;
    CREATE INDEX job_started ON job(started_at, id);
    CREATE INDEX job_running ON job(updated_at) WHERE state = 'running';
    """,
    # Several controllers on one store (a PostgreSQL one): the leader's lease, one row, holding the
    # epoch it took (`meta.epoch` + 1 at each takeover) and the address followers forward writes to;
    # every controller's row for `GET /api/v1/cluster`; the fingerprint of the controller keys every
    # controller on this store must share ('' until the first one starts).
    """
    CREATE TABLE leader_lease (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        holder TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        address TEXT NOT NULL,
        acquired_at REAL NOT NULL,
        renewed_at REAL NOT NULL,
        expires_at REAL NOT NULL
    ) STRICT;
    CREATE TABLE controller (
        id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        role TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        started_at REAL NOT NULL,
        seen_at REAL NOT NULL
    ) STRICT;
    INSERT INTO meta(key, value) VALUES ('keys_fingerprint', '');
    """,
    # Which controller runs each workload and job (its `[cluster] controller_id`; NULL: the only
    # controller of an embedded store, and every row from before): at start a controller fails only
    # its own unfinished ones, and the leader those of a controller gone for good (`follow.Orphans`).
    """
    ALTER TABLE workload ADD COLUMN controller TEXT;
    ALTER TABLE job ADD COLUMN controller TEXT;
    """,
    # Runtime qualifications (`nexa runtimes qualify`): each signed record, by the runtime image's
    # digest and the (architecture, GPU model) pair it qualified; the newest of a triple decides.
    """
    CREATE TABLE qualification (
        id TEXT PRIMARY KEY,
        runtime TEXT NOT NULL,
        image_digest TEXT NOT NULL,
        arch TEXT NOT NULL,
        gpu_model TEXT NOT NULL,
        passed INTEGER NOT NULL,
        finished_at REAL NOT NULL,
        body TEXT NOT NULL
    ) STRICT;
    CREATE INDEX qualification_runtime ON qualification(runtime, finished_at, id);
    CREATE INDEX qualification_finished ON qualification(finished_at, id);
    """,
    # The priority classes a key may ask for, a JSON list (NULL: the default, standard and batch).
    """
    ALTER TABLE api_key ADD COLUMN priorities TEXT;
    """,
    # Payload retention (`control.datapath.retention`): the policies, each tenant's data key wrapped by the
    # `[retention] key_file` key, and what is kept where until when (never a payload: those are
    # sealed in the S3-compatible store).
    """
    CREATE TABLE retention_policy (
        name TEXT PRIMARY KEY,
        body TEXT NOT NULL,
        updated_at REAL NOT NULL,
        updated_by TEXT
    ) STRICT;
    CREATE TABLE retention_key (
        tenant TEXT PRIMARY KEY,
        wrapped TEXT NOT NULL,
        created_at REAL NOT NULL
    ) STRICT;
    CREATE TABLE retained (
        id TEXT PRIMARY KEY,
        request_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        policy TEXT NOT NULL,
        api TEXT NOT NULL,
        stored_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        request_bytes INTEGER NOT NULL,
        answer_bytes INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX retained_stored ON retained(stored_at, id);
    CREATE INDEX retained_expires ON retained(expires_at);
    CREATE INDEX retained_request ON retained(request_id);
    CREATE INDEX retained_tenant ON retained(tenant);
    CREATE INDEX retained_policy ON retained(policy);
    """,
    # Evaluation suites (`nexa eval register`: each file by name and sha256 digest, the newest of a
    # name is the one runs take) and measured runs (`nexa eval run`: each case's score, the summaries).
    """
    CREATE TABLE eval_suite (
        name TEXT NOT NULL,
        digest TEXT NOT NULL,
        registered_at REAL NOT NULL,
        body TEXT NOT NULL,
        content TEXT NOT NULL,
        PRIMARY KEY (name, digest)
    ) STRICT;
    CREATE INDEX eval_suite_newest ON eval_suite(name, registered_at);
    CREATE TABLE eval_run (
        id TEXT PRIMARY KEY,
        suite TEXT NOT NULL,
        deployment TEXT NOT NULL,
        recorded_at REAL NOT NULL,
        body TEXT NOT NULL
    ) STRICT;
    CREATE INDEX eval_run_recorded ON eval_run(recorded_at, id);
    """,
    # Replica groups' runs (`control.deployments.grouprun`): each group replica's phase, members'
    # endpoints and backoff, written by the leader with the node sets, read by one that takes over.
    """
    CREATE TABLE group_run (
        replica_id TEXT PRIMARY KEY,
        deployment TEXT NOT NULL,
        body TEXT NOT NULL
    ) STRICT;
    CREATE INDEX group_run_deployment ON group_run(deployment);
    """,
    # Media requests' use in their capability's unit (`contracts.gateway.MEDIA_UNITS`); 0 for text.
    """
    ALTER TABLE usage ADD COLUMN units REAL NOT NULL DEFAULT 0;
    """,
    # The LoRA adapter a request was served with on its model (`name:version`; '' for none).
    """
    ALTER TABLE usage ADD COLUMN adapter TEXT NOT NULL DEFAULT '';
    """,
    # Stored Responses API responses (`control.datapath.pins`): which replica keeps each, per tenant,
    # written by the controller (or gateway worker) that served it, read by every one; a day each,
    # at most `MAX_STORED_RESPONSES` a tenant (the leader's sweep). Never a payload.
    """
    CREATE TABLE stored_response (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        model TEXT NOT NULL,
        deployment TEXT NOT NULL,
        replica_id TEXT NOT NULL,
        made_at REAL NOT NULL,
        PRIMARY KEY (tenant, id)
    ) STRICT;
    CREATE INDEX stored_response_made ON stored_response(made_at);
    CREATE INDEX stored_response_tenant_made ON stored_response(tenant, made_at);
    """,
)


# --- PostgreSQL's translation -------------------------------------------------------------------

#: Tables whose `seq INTEGER PRIMARY KEY` the database numbers (their inserts leave it out):
#: PostgreSQL's identity column. Where nexa writes the number itself (`audit.seq`), a plain BIGINT.
_NUMBERED: Final = frozenset({"usage"})
_IDENTITY: Final = "seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"
#: By migration: the first words of its statements that only SQLite runs. The node keys moved out of
#: `meta` (migration 9): no PostgreSQL store ever kept them there, and json_extract is SQLite's.
_SQLITE_ONLY: Final[Mapping[int, tuple[str, ...]]] = {9: ("UPDATE node SET", "DELETE FROM meta")}
#: Column types, in the statements that declare columns (CREATE TABLE, ALTER TABLE).
_PG_TYPES: Final = (
    (re.compile(r"\bANY\b"), "TEXT"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bTEXT\b"), 'TEXT COLLATE "C"'),
)
_STRICT: Final = re.compile(r"\)\s*STRICT\s*$")
_CREATE_TABLE: Final = re.compile(r"CREATE TABLE (\w+)")


def postgresql(number: int) -> str:
    """`MIGRATIONS[number]` in PostgreSQL's words (the module docstring's rules)."""
    statements = [part.strip() for part in MIGRATIONS[number].split(";") if part.strip()]
    skipped = _SQLITE_ONLY.get(number, ())
    for first_words in skipped:
        matching = [s for s in statements if s.startswith(first_words)]
        assert len(matching) == 1, f"migration {number}: {first_words!r} starts {len(matching)} statements"
    return "\n".join(_pg_statement(s) + ";" for s in statements if not s.startswith(skipped))


def _pg_statement(statement: str) -> str:
    table = _CREATE_TABLE.match(statement)
    if table is None and not statement.startswith("ALTER TABLE"):
        return statement  # declares no column: the same words on both
    if table is not None and table[1] in _NUMBERED:
        assert "seq INTEGER PRIMARY KEY" in statement, f"table {table[1]} numbers no seq"
        statement = statement.replace("seq INTEGER PRIMARY KEY", _IDENTITY)
    statement = _STRICT.sub(")", statement)
    for pattern, pg_type in _PG_TYPES:
        statement = pattern.sub(pg_type, statement)
    return statement


# --- migrating --------------------------------------------------------------------------------------


def migrate(db: Db) -> None:
    """Create or migrate a SQLite store's schema, in one transaction."""
    with txn(db):
        app_id = pragma_int(db, "application_id")
        version = pragma_int(db, "user_version")
        if version == 0 and app_id == 0:
            db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        elif app_id != APPLICATION_ID:
            raise StoreError("the database in the state directory does not belong to nexa")
        if version > len(MIGRATIONS):
            raise StoreError(
                f"the state directory was written by a newer nexa (schema {version}, this build knows "
                f"{len(MIGRATIONS)}); refusing to downgrade"
            )
        for number in range(version, len(MIGRATIONS)):
            db.execute(MIGRATIONS[number])
            db.execute(f"PRAGMA user_version={number + 1}")


def take_epoch(db: Db) -> int:
    """The next epoch, stored: strictly above every one taken before on this store (the UPDATE
    locks the row until the transaction ends, so two controllers never take the same one).
    EpochExhausted, nothing written, when the stored one is `MAX_EPOCH` already."""
    with txn(db):
        current = meta_int(db, "epoch", lock=True)
        if current >= MAX_EPOCH:
            raise EpochExhausted(epoch=current)
        if is_postgres(db):  # meta values are text there
            db.execute("UPDATE meta SET value = (value::bigint + 1)::text WHERE key = 'epoch'")
        else:
            db.execute("UPDATE meta SET value = value + 1 WHERE key = 'epoch'")
        epoch = meta_int(db, "epoch")
    return epoch


#: PostgreSQL's table whose one row says this is a nexa database, and at which schema version.
SCHEMA_TABLE: Final = "nexa_schema"


def migrate_pg(db: Db, where: str) -> None:
    """Create or migrate a PostgreSQL store's schema (`postgresql`), one transaction under an
    advisory lock, so of two controllers starting at once one migrates and the other then finds it
    done; `where` names the database in refusals. A database with tables but no `nexa_schema`,
    another application's, or one a newer nexa migrated is refused (StoreError) and left as it was."""
    with txn(db):
        db.execute("SELECT pg_advisory_xact_lock(?)", (APPLICATION_ID,))
        (marked,) = db.execute("SELECT to_regclass(?) IS NOT NULL", (SCHEMA_TABLE,)).fetchall()[0]
        if not marked:
            (tables,) = db.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()"
            ).fetchall()[0]
            if as_int(tables):
                raise StoreError(
                    f"the PostgreSQL database {where} is not a nexa database: it has tables but no "
                    f"{SCHEMA_TABLE}; give [store] url an empty database (createdb) or one nexa created"
                )
            db.execute(
                f"CREATE TABLE {SCHEMA_TABLE} (id BIGINT PRIMARY KEY CHECK (id = 1),"
                " application_id BIGINT NOT NULL, version BIGINT NOT NULL)"
            )
            db.execute(
                f"INSERT INTO {SCHEMA_TABLE}(id, application_id, version) VALUES (1, ?, 0)",  # noqa: S608
                (APPLICATION_ID,),
            )
        rows = db.execute(f"SELECT application_id, version FROM {SCHEMA_TABLE} WHERE id = 1").fetchall()  # noqa: S608
        if not rows or as_int(rows[0][0]) != APPLICATION_ID:
            raise StoreError(f"the PostgreSQL database {where} does not belong to nexa ({SCHEMA_TABLE} is another's)")
        version = as_int(rows[0][1])
        if version > len(MIGRATIONS):
            raise StoreError(
                f"the PostgreSQL database {where} was written by a newer nexa (schema {version}, this build "
                f"knows {len(MIGRATIONS)}); refusing to downgrade"
            )
        for number in range(version, len(MIGRATIONS)):
            db.execute(postgresql(number))
            db.execute(f"UPDATE {SCHEMA_TABLE} SET version = ? WHERE id = 1", (number + 1,))  # noqa: S608
