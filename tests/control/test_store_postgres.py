"""The store on PostgreSQL (`[store] url`), what only that backend does: SQLite's migrations in
its words (the same tables, columns, types and indexes), its refusals at start, several controllers
(Store objects, each with its connections) on one database at once, a lost connection, a deadlock,
and the refusal of `nexa backup`. The behaviour both backends share runs parametrized in the other
store tests (`store_cfg`).

A real PostgreSQL (tests/support/postgres.py), one fresh database per test.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import pytest
import trio

from nexa.config import ControlConfig, StoreConfig, structure_config
from nexa.contracts.domain import AuditDraft, EnrollmentToken, KeyId, Node, NodeId, Role, Tenant, TenantId
from nexa.control import store as st
from nexa.control.store.pg import to_pyformat
from nexa.control.store.schema import SCHEMA_TABLE, postgresql
from nexa.control.store.snapshot import copy_database
from nexa.control.store.sql import txn
from nexa.errors import (
    BackupNotSupported,
    ConfigError,
    Conflict,
    StoreBusy,
    StoreError,
    StoreUnavailable,
    Unauthenticated,
)
from nexa.security import hash_token, new_enrollment_token
from tests.conftest import ControllerProcess
from tests.support.postgres import (  # noqa: F401 - fixtures
    PASSWORD,
    PASSWORD_USER,
    PostgresServer,
    free_port,
    pg_url_fixture,
    postgres_fixture,
    psql,
    store_cfg_fixture,
)


def draft(action: str, target: str = "t") -> AuditDraft:
    return AuditDraft(
        actor_key_id=KeyId("abc"),
        actor_role=Role.ADMIN,
        action=action,
        target=target,
        prior_sha256=None,
        next_sha256=None,
    )


def test_placeholders_become_psycopgs_and_a_literal_percent_stays_one() -> None:
    assert to_pyformat("SELECT ? WHERE a = ? AND b LIKE '%x?'") == "SELECT %s WHERE a = %s AND b LIKE '%%x?'"
    assert to_pyformat("SELECT 'it''s ?', ?") == "SELECT 'it''s ?', %s"


# ---- the schema: SQLite's migrations, translated: the same tables, columns, types and indexes ----------------

#: The class of each column type: SQLite's declared type, PostgreSQL's `data_type`. The meta table's
#: ANY value is text on PostgreSQL (`sql.meta_int` reads it).
LITE_CLASS = {"INTEGER": "integer", "REAL": "real", "TEXT": "text", "ANY": "text"}
PG_CLASS = {"bigint": "integer", "double precision": "real", "text": "text"}


def sqlite_schema(path: Path) -> tuple[dict[str, dict[str, str]], dict[str, tuple[str, tuple[str, ...]]]]:
    """{table: {column: type class}}, {index: (table, its columns)} from SQLite's pragmas."""
    lite = sqlite3.connect(path)
    try:
        tables = {
            name: {str(row[1]): LITE_CLASS[row[2]] for row in lite.execute(f"PRAGMA table_info({name})")}
            for (name,) in lite.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        indexes = {
            str(name): (str(table), tuple(str(row[2]) for row in lite.execute(f"PRAGMA index_info({name})")))
            for name, table in lite.execute(
                "SELECT name, tbl_name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            )
        }
    finally:
        lite.close()
    return tables, indexes


def postgres_schema(url: str) -> tuple[dict[str, dict[str, str]], dict[str, tuple[str, tuple[str, ...]]]]:
    """The same from PostgreSQL's information_schema and catalog."""
    tables: dict[str, dict[str, str]] = {}
    for table, column, data_type in psql(
        url,
        "SELECT table_name, column_name, data_type FROM information_schema.columns WHERE table_schema = 'public'",
    ):
        tables.setdefault(str(table), {})[str(column)] = PG_CLASS[str(data_type)]
    indexes: dict[str, list[tuple[int, str, str]]] = {}
    for index, table, position, column in psql(
        url,
        "SELECT i.relname, t.relname, k.n, a.attname FROM pg_index x"
        " JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid"
        " JOIN pg_namespace s ON s.oid = t.relnamespace AND s.nspname = 'public'"
        " CROSS JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)"
        " JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum",
    ):
        indexes.setdefault(str(index), []).append((int(str(position)), str(table), str(column)))
    return tables, {
        name: (columns[0][1], tuple(column for _, _, column in sorted(columns))) for name, columns in indexes.items()
    }


async def test_the_schema_has_the_tables_columns_types_and_indexes_of_sqlites(tmp_path: Path, pg_url: str) -> None:
    async with st.open_store(tmp_path / "sqlite"):
        pass
    lite_tables, lite_indexes = sqlite_schema(tmp_path / "sqlite" / st.DB_FILE)
    async with st.open_store(tmp_path / "pg", StoreConfig(url=pg_url)):
        pass
    pg_tables, pg_indexes = postgres_schema(pg_url)
    assert pg_tables.pop(SCHEMA_TABLE) == {"id": "integer", "application_id": "integer", "version": "integer"}
    assert pg_tables == lite_tables  # every table, column and its type class, and no other
    assert {name: pg_indexes.get(name) for name in lite_indexes} == lite_indexes  # each on the same columns
    assert psql(pg_url, f"SELECT version FROM {SCHEMA_TABLE}") == [(len(st.MIGRATIONS),)]
    # Text sorts bytewise, as in SQLite: keyset pages come in the same order on both.
    collations = psql(
        pg_url,
        "SELECT DISTINCT collation_name FROM information_schema.columns WHERE table_schema = 'public'"
        " AND data_type = 'text' AND table_name != ?",
        SCHEMA_TABLE,
    )
    assert collations == [("C",)]
    # The rows SQLite numbers itself (an insert leaves `seq` out) PostgreSQL numbers too; the audit
    # chain's seq nexa writes, as the schema before the one migration list made it.
    identities = psql(
        pg_url,
        "SELECT table_name, column_name FROM information_schema.columns"
        " WHERE table_schema = 'public' AND is_identity = 'YES'",
    )
    assert identities == [("usage", "seq")]


def test_sqlites_migrations_in_postgresqls_words() -> None:
    """The translation's rules (`schema.postgresql`), on migrations that use each of them."""
    first = postgresql(0)
    assert "STRICT" not in first and "ANY" not in first
    assert 'CREATE TABLE meta (key TEXT COLLATE "C" PRIMARY KEY, value TEXT COLLATE "C");' in first
    assert "seq BIGINT PRIMARY KEY," in first  # audit: nexa numbers the chain itself
    assert "time DOUBLE PRECISION NOT NULL" in first
    assert "seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY," in postgresql(4)  # usage
    moved = st.MIGRATIONS.index(next(m for m in st.MIGRATIONS if "previous_signing_public_key" in m))
    assert "json_extract" in st.MIGRATIONS[moved] and "json_extract" not in postgresql(moved)
    assert postgresql(moved).count("ALTER TABLE node ADD COLUMN") == 2
    assert [postgresql(n).count(";") for n in range(len(st.MIGRATIONS)) if n != moved] == [
        m.count(";") for n, m in enumerate(st.MIGRATIONS) if n != moved
    ]


async def test_a_store_an_older_nexa_left_migrates_on_to_the_schema_a_new_one_gets(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """Versions count the same list on PostgreSQL as on SQLite: one left at version 9 (before the
    node keys' columns) takes migrations 9 on, keeps its rows, and ends as a fresh store starts."""
    older, fresh = postgres_server.create_database(), postgres_server.create_database()
    older_url, fresh_url = postgres_server.url(older), postgres_server.url(fresh)
    try:
        psql(
            older_url,
            f"CREATE TABLE {SCHEMA_TABLE} (id BIGINT PRIMARY KEY CHECK (id = 1),"
            " application_id BIGINT NOT NULL, version BIGINT NOT NULL)",
        )
        psql(older_url, f"INSERT INTO {SCHEMA_TABLE} VALUES (1, ?, 9)", st.APPLICATION_ID)
        for number in range(9):
            psql(older_url, postgresql(number))
        psql(older_url, "INSERT INTO tenant(id, display_name, created_at) VALUES ('acme', 'Acme', 1.0)")
        async with st.open_store(tmp_path / "older", StoreConfig(url=older_url)) as store:
            assert [t.id for t in await store.run(st.load_tenants)] == ["acme"]
        async with st.open_store(tmp_path / "fresh", StoreConfig(url=fresh_url)):
            pass
        assert psql(older_url, f"SELECT version FROM {SCHEMA_TABLE}") == [(len(st.MIGRATIONS),)]
        assert postgres_schema(older_url) == postgres_schema(fresh_url)
    finally:
        postgres_server.drop_database(older)
        postgres_server.drop_database(fresh)


async def test_two_controllers_starting_at_once_migrate_once_and_take_no_epoch(tmp_path: Path, pg_url: str) -> None:
    cfg = StoreConfig(url=pg_url)
    epochs: list[int] = []

    async def start(name: str, opened: trio.Event, done: trio.Event) -> None:
        async with st.open_store(tmp_path / name, cfg) as store:
            epochs.append(store.epoch)
            opened.set()
            await done.wait()

    done = trio.Event()
    async with trio.open_nursery() as nursery:
        events = [trio.Event() for _ in range(3)]
        for i, event in enumerate(events):
            nursery.start_soon(start, f"c{i}", event, done)
        for event in events:
            await event.wait()
        done.set()
    # Opening a shared store takes no epoch: only a takeover of the lease does (`acquire_lease`),
    # so the next leader's epoch is the last one + 1 however many controllers started meanwhile.
    assert epochs == [0, 0, 0]
    assert psql(pg_url, f"SELECT count(*), max(version) FROM {SCHEMA_TABLE}") == [(1, len(st.MIGRATIONS))]
    assert not (tmp_path / "c0" / st.DB_FILE).exists()  # nothing of SQLite's, and no state-dir lock
    assert not (tmp_path / "c0" / st.LOCK_FILE).exists()


# ---- refusals at start ------------------------------------------------------------------------------------------


async def test_a_database_with_tables_but_no_nexa_schema_is_refused_and_left_alone(tmp_path: Path, pg_url: str) -> None:
    psql(pg_url, "CREATE TABLE orders (id BIGINT PRIMARY KEY)")
    with pytest.raises(StoreError, match="not a nexa database"):
        async with st.open_store(tmp_path, StoreConfig(url=pg_url)):
            pass
    tables = psql(pg_url, "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")
    assert tables == [("orders",)]


async def test_a_newer_schema_and_another_applications_marker_are_refused(tmp_path: Path, pg_url: str) -> None:
    cfg = StoreConfig(url=pg_url)
    async with st.open_store(tmp_path, cfg):
        pass
    psql(pg_url, f"UPDATE {SCHEMA_TABLE} SET version = ?", len(st.MIGRATIONS) + 1)
    with pytest.raises(StoreError, match="newer nexa"):
        async with st.open_store(tmp_path, cfg):
            pass
    psql(pg_url, f"UPDATE {SCHEMA_TABLE} SET version = ?, application_id = 42", len(st.MIGRATIONS))
    with pytest.raises(StoreError, match="does not belong to nexa"):
        async with st.open_store(tmp_path, cfg):
            pass
    assert psql(pg_url, "SELECT value FROM meta WHERE key = 'epoch'") == [("0",)]  # refused starts took nothing


async def test_an_unreachable_database_is_named_with_what_to_check(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    port = free_port()  # nothing listens there
    cfg = StoreConfig(url=f"postgresql://nexa@127.0.0.1:{port}/control", connect_timeout_s=2.0)
    with pytest.raises(StoreUnavailable) as caught:
        async with st.open_store(tmp_path, cfg):
            pass
    message = caught.value.message
    assert f"nexa@127.0.0.1:{port}/control" in message
    assert "store.url" in message and "pg_hba.conf" in message
    assert caught.value.retryable


async def test_the_password_comes_from_password_file_and_is_never_shown(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    name = postgres_server.create_database()
    postgres_server.sql(f"ALTER DATABASE {name} OWNER TO {PASSWORD_USER}")
    url = postgres_server.url(name, user=PASSWORD_USER)
    secret = tmp_path / "pgpass"
    try:
        secret.write_text(PASSWORD + "\n")
        async with st.open_store(tmp_path, StoreConfig(url=url, password_file=str(secret))) as store:
            assert await store.run(lambda db: db.execute("SELECT current_user").fetchall()) == [(PASSWORD_USER,)]
        wrong = "not-" + PASSWORD
        secret.write_text(wrong)
        with pytest.raises(StoreUnavailable) as caught:
            async with st.open_store(tmp_path, StoreConfig(url=url, password_file=str(secret))):
                pass
        assert "password authentication failed" in caught.value.message
        assert wrong not in caught.value.message and PASSWORD not in caught.value.message
        assert f"{PASSWORD_USER}@127.0.0.1:{postgres_server.port}/{name}" in caught.value.message
    finally:
        postgres_server.drop_database(name)


async def test_a_missing_or_empty_password_file_is_a_config_error(tmp_path: Path, pg_url: str) -> None:
    with pytest.raises(ConfigError, match=r"store.password_file .*cannot read"):
        async with st.open_store(tmp_path, StoreConfig(url=pg_url, password_file=str(tmp_path / "absent"))):
            pass
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"store.password_file .* is empty"):
        async with st.open_store(tmp_path, StoreConfig(url=pg_url, password_file=str(tmp_path / "empty"))):
            pass


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://nexa@db/nexa", "must be a postgresql://"),
        ("/var/lib/nexa/control.db", "must be a postgresql://"),
        ("postgresql://nexa:hunter2@db/nexa", "holds a password"),
        ("postgres://nexa@db/nexa?password=hunter2", "holds a password"),
    ],
)
def test_a_bad_store_url_is_refused_when_the_config_loads(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        structure_config({"store": {"url": url}}, ControlConfig)
    [problem] = caught.value.problems
    assert problem.startswith("store: 'url'") and says in problem
    assert "hunter2" not in str(caught.value)


def test_a_postgres_url_is_taken() -> None:
    cfg = structure_config({"store": {"url": "postgres://nexa@db:5433/nexa?sslmode=verify-full"}}, ControlConfig)
    assert cfg.store.url.startswith("postgres://") and cfg.store.password_file == ""
    assert ControlConfig().store == StoreConfig()  # unset: SQLite in state_dir


# ---- several controllers on one database -------------------------------------------------------------------------


async def test_two_controllers_appending_at_once_never_fork_the_audit_chain(tmp_path: Path, pg_url: str) -> None:
    cfg = StoreConfig(url=pg_url)
    per_store = 60
    async with st.open_store(tmp_path / "a", cfg) as a, st.open_store(tmp_path / "b", cfg) as b:
        seqs: list[int] = []

        async def append(store: st.Store, name: str) -> None:
            for i in range(per_store):
                seqs.append((await store.run(st.record_audit, draft(f"{name}.{i}"))).seq)

        async with trio.open_nursery() as nursery:  # each store's lane in its own thread: real contention
            for store, name in ((a, "a"), (b, "b"), (a, "a2"), (b, "b2")):
                nursery.start_soon(append, store, name)
        assert sorted(seqs) == list(range(1, 4 * per_store + 1))  # no gap, no seq given twice
        verdict = await a.read(st.verify_audit)
        assert verdict.ok and verdict.checked == 4 * per_store
        [last] = await a.run(st.list_audit, st.AuditQuery(after_seq=4 * per_store - 1))
        assert await b.run(st.audit_head) == (4 * per_store, last.sha256)


async def test_one_enrollment_token_enrolls_one_node_when_two_controllers_race(tmp_path: Path, pg_url: str) -> None:
    cfg = StoreConfig(url=pg_url)
    secret = new_enrollment_token()
    token = EnrollmentToken(
        id="et_1", token_sha256=hash_token(secret), labels={}, created_at=0, expires_at=2e9, created_by=None
    )
    outcomes: list[str] = []
    async with st.open_store(tmp_path / "a", cfg) as a, st.open_store(tmp_path / "b", cfg) as b:
        await a.run(st.insert_token, token, draft("token"))

        async def enroll(store: st.Store, n: int) -> None:
            node = Node(
                id=NodeId(f"n{n}"),
                hostname="h",
                signing_public_key=f"s{n}",
                curve_public_key=f"c{n}",
                labels={},
                enrolled_at=1.0,
            )
            try:
                await store.run(st.enroll_node, hash_token(secret), 1.0, node, draft("enroll"))
                outcomes.append("enrolled")
            except Unauthenticated as exc:
                outcomes.append(exc.message)

        async with trio.open_nursery() as nursery:
            for n in range(6):
                nursery.start_soon(enroll, (a, b)[n % 2], n)
        assert sorted(outcomes) == ["enrolled"] + ["this enrollment token was already used"] * 5
        assert len(await b.run(st.load_nodes)) == 1


async def test_a_unique_violation_is_a_conflict_and_writes_nothing(tmp_path: Path, pg_url: str) -> None:
    async with st.open_store(tmp_path, StoreConfig(url=pg_url)) as store:
        tenant = Tenant(id=TenantId("acme"), display_name="Acme", created_at=1.0)
        await store.run(st.insert_tenant, tenant, draft("tenant"))
        with pytest.raises(Conflict, match=r"conflicts with existing state \(tenant_pkey\)"):
            await store.run(st.insert_tenant, tenant, draft("tenant again"))
        assert await store.run(st.load_tenants) == [tenant]
        assert (await store.run(st.audit_head))[0] == 1  # the refused insert's event went with it


async def test_a_transaction_the_server_aborts_for_a_deadlock_runs_again_whole_then_is_store_busy(
    tmp_path: Path, pg_url: str
) -> None:
    """The server's own deadlock error (SQLSTATE 40P01, raised by PL/pgSQL where a deadlock would be)."""
    tries: list[int] = []

    def deadlocked_until(db: st.Db, ok_at: int) -> int:
        with txn(db):
            tries.append(1)
            st.append_audit(db, draft(f"try {len(tries)}"))
            if len(tries) < ok_at:
                db.execute("DO $$ BEGIN RAISE EXCEPTION 'deadlock' USING ERRCODE = '40P01'; END $$")
        return len(tries)

    async with st.open_store(tmp_path, StoreConfig(url=pg_url)) as store:
        assert await store.run(deadlocked_until, 3) == 3  # two aborted tries, then it commits
        assert (await store.run(st.audit_head))[0] == 1  # once: the aborted tries wrote nothing
        tries.clear()
        with pytest.raises(StoreBusy, match="aborted the transaction 3 times") as caught:
            await store.run(deadlocked_until, 99)
        assert len(tries) == 3 and caught.value.retryable and isinstance(caught.value, StoreUnavailable)
        assert (await store.run(st.audit_head))[0] == 1


async def test_a_lost_connection_is_retryable_and_the_next_transaction_reconnects(tmp_path: Path, pg_url: str) -> None:
    def kill_own_backend(db: st.Db) -> None:
        with txn(db):
            db.execute("SELECT pg_terminate_backend(pg_backend_pid())", ())

    async with st.open_store(tmp_path, StoreConfig(url=pg_url)) as store:
        await store.run(st.record_audit, draft("before"))
        with pytest.raises(StoreUnavailable) as caught:
            await store.run(kill_own_backend)
        assert caught.value.retryable and isinstance(caught.value, StoreError)
        assert (await store.run(st.record_audit, draft("after"))).seq == 2  # connected again
        # A connection the server dropped between two transactions is replaced before the next one.
        psql(
            pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE 'nexa control%'"
        )
        assert (await store.run(st.record_audit, draft("later"))).seq == 3
        assert (await store.read(st.verify_audit)).checked == 3


async def test_backups_are_refused_with_postgresqls_own_tools_named(tmp_path: Path, pg_url: str) -> None:
    async with st.open_store(tmp_path, StoreConfig(url=pg_url)) as store:
        with pytest.raises(BackupNotSupported, match="pg_dump"):
            await copy_database(store, tmp_path / "copy.db")
    assert not (tmp_path / "copy.db").exists()


# ---- through the real binary path: `nexa control` with `[store] url` --------------------------------------------


@pytest.mark.slow
def test_a_controller_process_on_postgresql_keeps_its_state_across_a_restart(tmp_path: Path, pg_url: str) -> None:
    config = tmp_path / "control.toml"
    config.write_text(f'[store]\nurl = "{pg_url}"\n')
    cp = ControllerProcess(state_dir=tmp_path / "state", port=free_port())
    try:
        cp.start("--config", str(config), timeout_s=60)
        admin = cp.admin_key
        assert admin is not None
        with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {admin}"}, timeout=20) as http:
            assert http.post("/api/v1/tenants", json={"id": "acme"}).status_code == 201
            made = http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme", "name": "acme app"})
            assert made.status_code == 201, made.text
            assert http.put("/api/v1/quotas/acme", json={"requests_per_minute": 7}).status_code == 200
            refused = http.post("/api/v1/backups")
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "backup_not_supported"
        assert cp.stop() == 0
        cp.start("--config", str(config), timeout_s=60)  # the same database: no new admin key
        with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {admin}"}, timeout=20) as http:
            assert [t["id"] for t in http.get("/api/v1/tenants").json()["tenants"]] == ["acme"]
            assert http.get("/api/v1/quotas/acme").json()["limits"]["requests_per_minute"] == 7
            keys = http.get("/api/v1/keys").json()["keys"]
            assert sorted(k["role"] for k in keys) == ["admin", "inference"]
            verdict = http.post("/api/v1/audit/verify").json()
            assert verdict["ok"] is True and verdict["checked"] >= 4, verdict
        app = made.json()["key"]
        with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {app}"}, timeout=20) as http:
            assert http.get("/v1/models").status_code == 200  # the key made before the restart still works
        assert cp.cli("audit", "verify", token=admin).returncode == 0
    finally:
        cp.kill()
    assert not (tmp_path / "state" / st.DB_FILE).exists()
    assert psql(pg_url, "SELECT count(*) FROM tenant") == [(1,)]
