"""A real PostgreSQL for the store's tests: one server per test run, a fresh database per test.

The server is `nexa.localparts.postgres.LocalPostgres` (Debian's `postgresql` in a temporary
directory, on 127.0.0.1 at a free port, as the `postgres` user when run as root). Loopback
connections are trusted, but for `PASSWORD_USER`, which must give `PASSWORD` (scram): the tests of
`[store] password_file`. SQL goes through psycopg here (`PostgresServer.sql`).

It starts with the first test that asks for it (`postgres_server`, `pg_url`, or the `postgresql`
side of `store_cfg`) and stops when the run ends (`pg_ctl stop -m fast`, then the directory goes).
Without PostgreSQL installed, those tests fail when CI=true and are skipped otherwise.

Fixtures live here, not in a conftest: a test module imports all three under their module names
(`from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401`)
and asks for `store_cfg`, `pg_url` or `postgres_server`.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Final

import attrs
import pytest

from nexa.config import StoreConfig
from nexa.errors import ConfigError
from nexa.localparts.postgres import PG_START_TIMEOUT_S, LocalPostgres

IN_CI: Final = os.environ.get("CI") == "true"
#: A role that must authenticate with `PASSWORD` (scram-sha-256) from 127.0.0.1.
PASSWORD_USER: Final = "nexa_pw"
PASSWORD: Final = "s3cret-" + "pw-for-tests"
START_TIMEOUT_S: Final = PG_START_TIMEOUT_S
#: Both backends of the store, for `store_cfg`'s parametrization.
BACKENDS: Final = ("sqlite", "postgresql")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.define
class PostgresServer(LocalPostgres):
    """The run's server (`nexa.localparts.postgres`), with SQL through psycopg and a fresh database per test."""

    _databases: int = 0

    def sql(self, statement: str, database: str = "postgres") -> list[tuple[object, ...]]:
        """Run one statement as the superuser, outside any transaction (CREATE DATABASE)."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            cur = conn.execute(statement.encode())
            return cur.fetchall() if cur.description else []

    def create_database(self) -> str:
        self._databases += 1
        name = f"nexa_t{self._databases}_{secrets.token_hex(3)}"
        self.sql(f"CREATE DATABASE {name}")
        return name

    def drop_database(self, name: str) -> None:
        self.sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def start_server() -> PostgresServer:
    """A started server with the password role; the caller stops it. Without PostgreSQL installed the
    test fails in CI and is skipped elsewhere."""
    server = PostgresServer(hba=f"host all {PASSWORD_USER} 127.0.0.1/32 scram-sha-256\n")
    try:
        server.start()
    except ConfigError as exc:
        if IN_CI:
            pytest.fail(f"{exc.message} (required in CI)")
        pytest.skip(exc.message)
    try:
        _wait_ready(server)
        server.sql(f"CREATE ROLE {PASSWORD_USER} LOGIN CREATEDB PASSWORD '{PASSWORD}'")
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: PostgresServer) -> None:
    import psycopg

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            server.sql("SELECT 1")
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        else:
            return


_lock = threading.Lock()
_server: PostgresServer | None = None


@pytest.fixture(name="postgres_server")
def postgres_fixture(request: pytest.FixtureRequest) -> PostgresServer:
    """The run's PostgreSQL, started on first use and stopped when the run ends.

    One process-wide server (not a session fixture: each test module imports these fixtures, and
    a session fixture imported into several modules would start one server per module)."""
    global _server  # noqa: PLW0603 - one server per test run
    with _lock:
        if _server is None:
            _server = start_server()
            request.config.add_cleanup(_stop_server)
        return _server


def _stop_server() -> None:
    global _server  # noqa: PLW0603
    with _lock:
        if _server is not None:
            _server.stop()
            _server = None


@pytest.fixture(name="pg_url")
def pg_url_fixture(postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a fresh, empty database on the run's server (dropped after the test)."""
    name = postgres_server.create_database()
    try:
        yield postgres_server.url(name)
    finally:
        postgres_server.drop_database(name)


@pytest.fixture(name="store_cfg", params=BACKENDS)
def store_cfg_fixture(request: pytest.FixtureRequest) -> StoreConfig:
    """The store a test opens (`st.open_store(state_dir, store_cfg)`): SQLite in the state dir,
    then a fresh PostgreSQL database. The server starts only for the `postgresql` side."""
    if request.param == "sqlite":
        return StoreConfig()
    url: str = request.getfixturevalue("pg_url")
    return StoreConfig(url=url)


def psql(url: str, sql: str, *args: object) -> list[tuple[object, ...]]:
    """Run one statement (`?` placeholders, as the store writes them) on `url`, outside any transaction."""
    import psycopg

    from nexa.control.store.pg import to_pyformat

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(to_pyformat(sql).encode(), args)
        return cur.fetchall() if cur.description else []
