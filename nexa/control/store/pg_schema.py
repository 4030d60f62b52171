"""The PostgreSQL schema: `PG_MIGRATIONS` (append only, one per SQLite migration) and `migrate_pg`.

Entry i moves a PostgreSQL store from version i to i+1, as `schema.MIGRATIONS[i]` moves a SQLite
one: the same tables, columns, keys and indexes, in PostgreSQL's types (SQLite's INTEGER is BIGINT,
REAL is DOUBLE PRECISION, the meta table's ANY value is TEXT: `sql.meta_int` reads it). Every TEXT
column sorts bytewise (`COLLATE "C"`, added by `_pg`), as SQLite's do, so keyset pages and their
order are the same on both backends whatever locale the database was created with. A migration
that only moved data SQLite held elsewhere has nothing to move here and keeps only its DDL.
Append a new entry to both tuples at once (`tests/control/test_store_postgres.py` compares them).

The version lives in the table `nexa_schema` (one row: the application id and the version), its
presence the mark of a nexa database. `migrate_pg` runs under a transaction-scoped advisory lock,
so of two controllers starting at once one migrates and the other then finds it done.
"""

from __future__ import annotations

import re
from typing import Final

from nexa.control.store.schema import APPLICATION_ID, MIGRATIONS
from nexa.control.store.sql import Db, as_int, txn
from nexa.errors import StoreError

_TEXT: Final = re.compile(r"\bTEXT\b")


def _pg(ddl: str) -> str:
    return _TEXT.sub('TEXT COLLATE "C"', ddl)


PG_MIGRATIONS: Final[tuple[str, ...]] = tuple(
    _pg(ddl)
    for ddl in (
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
        INSERT INTO meta(key, value) VALUES ('epoch', '0'), ('audit_head_seq', '0'), ('audit_head_sha256', '');
        CREATE TABLE tenant (
            id TEXT PRIMARY KEY,
            display_name TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE api_key (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            role TEXT NOT NULL,
            tenant TEXT REFERENCES tenant(id),
            secret_sha256 TEXT NOT NULL UNIQUE,
            created_at DOUBLE PRECISION NOT NULL,
            created_by TEXT,
            revoked_at DOUBLE PRECISION
        );
        CREATE TABLE audit (
            seq BIGINT PRIMARY KEY,
            id TEXT NOT NULL UNIQUE,
            time DOUBLE PRECISION NOT NULL,
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
        );
        CREATE INDEX audit_action ON audit(action, seq);
        CREATE INDEX audit_actor ON audit(actor_key_id, seq);
        CREATE INDEX audit_target ON audit(target, seq);
        """,
        """
        CREATE TABLE enrollment_token (
            id TEXT PRIMARY KEY,
            token_sha256 TEXT NOT NULL UNIQUE,
            labels TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL,
            created_by TEXT,
            used_at DOUBLE PRECISION,
            used_by_node TEXT
        );
        CREATE TABLE node (
            id TEXT PRIMARY KEY,
            hostname TEXT NOT NULL,
            signing_public_key TEXT NOT NULL UNIQUE,
            curve_public_key TEXT NOT NULL UNIQUE,
            labels TEXT NOT NULL,
            enrolled_at DOUBLE PRECISION NOT NULL,
            admin_state TEXT NOT NULL,
            revoked_at DOUBLE PRECISION
        );
        CREATE TABLE node_inventory (
            node_id TEXT PRIMARY KEY REFERENCES node(id),
            body TEXT NOT NULL,
            reported_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE node_desired (
            node_id TEXT PRIMARY KEY REFERENCES node(id),
            body TEXT NOT NULL
        );
        """,
        """
        CREATE TABLE runtime (
            name TEXT PRIMARY KEY,
            kind TEXT NOT NULL,
            image TEXT NOT NULL,
            body TEXT NOT NULL
        );
        CREATE TABLE model (
            name TEXT NOT NULL,
            version TEXT NOT NULL,
            state TEXT NOT NULL,
            sha256 TEXT NOT NULL,
            body TEXT NOT NULL,
            PRIMARY KEY (name, version)
        );
        CREATE INDEX model_sha256 ON model(sha256);
        CREATE TABLE evaluation (
            id TEXT PRIMARY KEY,
            model TEXT NOT NULL,
            version TEXT NOT NULL,
            passed BIGINT NOT NULL,
            recorded_at DOUBLE PRECISION NOT NULL,
            body TEXT NOT NULL,
            FOREIGN KEY (model, version) REFERENCES model(name, version)
        );
        CREATE INDEX evaluation_model ON evaluation(model, version, recorded_at);
        CREATE TABLE alias (
            name TEXT PRIMARY KEY,
            model TEXT NOT NULL,
            version TEXT NOT NULL,
            generation BIGINT NOT NULL,
            body TEXT NOT NULL,
            FOREIGN KEY (model, version) REFERENCES model(name, version)
        );
        CREATE TABLE alias_history (
            alias TEXT NOT NULL REFERENCES alias(name),
            generation BIGINT NOT NULL,
            body TEXT NOT NULL,
            PRIMARY KEY (alias, generation)
        );
        """,
        """
        CREATE TABLE deployment (
            name TEXT PRIMARY KEY,
            generation BIGINT NOT NULL,
            body TEXT NOT NULL,
            placement TEXT
        );
        """,
        # SQLite's `seq INTEGER PRIMARY KEY` numbers inserted rows itself: here an identity column.
        """
        CREATE TABLE quota (
            tenant TEXT PRIMARY KEY REFERENCES tenant(id),
            body TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            updated_by TEXT
        );
        CREATE TABLE usage (
            seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
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
            prompt_tokens BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL,
            queue_ms DOUBLE PRECISION NOT NULL,
            ttft_ms DOUBLE PRECISION,
            duration_ms DOUBLE PRECISION NOT NULL,
            finished_at DOUBLE PRECISION NOT NULL,
            canary BIGINT NOT NULL
        );
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
            accepted_at DOUBLE PRECISION NOT NULL,
            finished_at DOUBLE PRECISION,
            error TEXT,
            receipt TEXT,
            PRIMARY KEY (tenant, workload_id),
            UNIQUE (tenant, idempotency_key_sha256)
        );
        CREATE INDEX workload_unfinished ON workload(state) WHERE finished_at IS NULL;
        """,
        """
        CREATE INDEX workload_finished ON workload(finished_at) WHERE finished_at IS NOT NULL;
        """,
        """
        ALTER TABLE workload ADD COLUMN request_sha256 TEXT;
        """,
        """
        CREATE INDEX workload_tenant_accepted ON workload(tenant, accepted_at, workload_id);
        """,
        """
        ALTER TABLE api_key ADD COLUMN expires_at DOUBLE PRECISION;
        ALTER TABLE api_key ADD COLUMN rotated_to TEXT;
        """,
        # SQLite also moved the previous keys out of `meta`: no PostgreSQL store ever kept them there.
        """
        ALTER TABLE node ADD COLUMN previous_signing_public_key TEXT;
        ALTER TABLE node ADD COLUMN previous_curve_public_key TEXT;
        """,
        """
        ALTER TABLE node ADD COLUMN reenroll_key_id TEXT;
        """,
        """
        CREATE TABLE bench_run (
            id TEXT PRIMARY KEY,
            deployment TEXT NOT NULL,
            kind TEXT NOT NULL,
            recorded_at DOUBLE PRECISION NOT NULL,
            body TEXT NOT NULL
        );
        CREATE INDEX bench_run_deployment ON bench_run(deployment, recorded_at, id);
        CREATE INDEX bench_run_recorded ON bench_run(recorded_at, id);
        CREATE TABLE job (
            id TEXT PRIMARY KEY,
            kind TEXT NOT NULL,
            state TEXT NOT NULL,
            subject TEXT,
            started_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            body TEXT NOT NULL
        );
        CREATE INDEX job_started ON job(started_at, id);
        CREATE INDEX job_running ON job(updated_at) WHERE state = 'running';
        """,
        """
        CREATE TABLE leader_lease (
            id BIGINT PRIMARY KEY CHECK (id = 1),
            holder TEXT NOT NULL,
            epoch BIGINT NOT NULL,
            address TEXT NOT NULL,
            acquired_at DOUBLE PRECISION NOT NULL,
            renewed_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE controller (
            id TEXT PRIMARY KEY,
            address TEXT NOT NULL,
            role TEXT NOT NULL,
            epoch BIGINT NOT NULL,
            started_at DOUBLE PRECISION NOT NULL,
            seen_at DOUBLE PRECISION NOT NULL
        );
        INSERT INTO meta(key, value) VALUES ('keys_fingerprint', '');
        """,
        """
        ALTER TABLE workload ADD COLUMN controller TEXT;
        ALTER TABLE job ADD COLUMN controller TEXT;
        """,
        """
        CREATE TABLE qualification (
            id TEXT PRIMARY KEY,
            runtime TEXT NOT NULL,
            image_digest TEXT NOT NULL,
            arch TEXT NOT NULL,
            gpu_model TEXT NOT NULL,
            passed BIGINT NOT NULL,
            finished_at DOUBLE PRECISION NOT NULL,
            body TEXT NOT NULL
        );
        CREATE INDEX qualification_runtime ON qualification(runtime, finished_at, id);
        CREATE INDEX qualification_finished ON qualification(finished_at, id);
        """,
        """
        ALTER TABLE api_key ADD COLUMN priorities TEXT;
        """,
        """
        CREATE TABLE retention_policy (
            name TEXT PRIMARY KEY,
            body TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            updated_by TEXT
        );
        CREATE TABLE retention_key (
            tenant TEXT PRIMARY KEY,
            wrapped TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE retained (
            id TEXT PRIMARY KEY,
            request_id TEXT NOT NULL,
            tenant TEXT NOT NULL,
            policy TEXT NOT NULL,
            api TEXT NOT NULL,
            stored_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL,
            request_bytes BIGINT NOT NULL,
            answer_bytes BIGINT NOT NULL
        );
        CREATE INDEX retained_stored ON retained(stored_at, id);
        CREATE INDEX retained_expires ON retained(expires_at);
        CREATE INDEX retained_request ON retained(request_id);
        CREATE INDEX retained_tenant ON retained(tenant);
        CREATE INDEX retained_policy ON retained(policy);
        """,
    )
)

assert len(PG_MIGRATIONS) == len(MIGRATIONS), "each SQLite migration needs its PostgreSQL twin"

#: The table whose one row says this is a nexa database, and at which schema version.
SCHEMA_TABLE: Final = "nexa_schema"


def migrate_pg(db: Db, where: str) -> None:
    """Create or migrate the schema, one transaction under an advisory lock; `where` names the
    database in refusals. A database with tables but no `nexa_schema`, another application's, or
    one a newer nexa migrated is refused (StoreError) and left as it was."""
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
        if version > len(PG_MIGRATIONS):
            raise StoreError(
                f"the PostgreSQL database {where} was written by a newer nexa (schema {version}, this build "
                f"knows {len(PG_MIGRATIONS)}); refusing to downgrade"
            )
        for number in range(version, len(PG_MIGRATIONS)):
            db.execute(PG_MIGRATIONS[number])
            db.execute(f"UPDATE {SCHEMA_TABLE} SET version = ? WHERE id = 1", (number + 1,))  # noqa: S608
