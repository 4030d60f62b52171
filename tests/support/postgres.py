"""A real PostgreSQL for the store's tests: one server per test run, a fresh database per test.

The server is Debian's `postgresql` (initdb and pg_ctl from PATH or /usr/lib/postgresql/*/bin), in a
temporary directory, listening on 127.0.0.1 at a free port with its unix socket in that directory.
Loopback connections are trusted, but for `PASSWORD_USER`, which must give `PASSWORD` (scram): the
tests of `[store] password_file`. initdb refuses to run as root, so as root the server runs as the
`postgres` user (`runuser -u postgres --`) in a directory given to it.

It starts with the first test that asks for it (`postgres_server`, `pg_url`, or the `postgresql`
side of `store_cfg`) and stops when the run ends (`pg_ctl stop -m fast`, then the directory goes).
Without PostgreSQL installed, those tests fail when CI=true and are skipped otherwise.

Fixtures live here, not in a conftest: a test module imports all three under their module names
(`from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401`)
and asks for `store_cfg`, `pg_url` or `postgres_server`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import attrs
import pytest

from nexa.config import StoreConfig

IN_CI: Final = os.environ.get("CI") == "true"
#: The superuser initdb creates, trusted on loopback.
SUPERUSER: Final = "nexa"
#: A role that must authenticate with `PASSWORD` (scram-sha-256) from 127.0.0.1.
PASSWORD_USER: Final = "nexa_pw"
PASSWORD: Final = "s3cret-" + "pw-for-tests"
START_TIMEOUT_S: Final = 30.0
#: Both backends of the store, for `store_cfg`'s parametrization.
BACKENDS: Final = ("sqlite", "postgresql")


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else None


def _need_tools() -> tuple[str, str]:
    initdb, pg_ctl = _tool("initdb"), _tool("pg_ctl")
    if initdb is None or pg_ctl is None:
        reason = "PostgreSQL (initdb, pg_ctl) is not installed: apt-get install postgresql"
        if IN_CI:
            pytest.fail(f"{reason} (required in CI)")
        pytest.skip(reason)
    return initdb, pg_ctl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.define
class PostgresServer:
    """A running PostgreSQL on 127.0.0.1:`port`, its data and socket in `root`."""

    root: Path
    port: int
    pg_ctl: str
    as_postgres: bool
    _databases: int = 0

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres", *, user: str = SUPERUSER) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_postgres else []
        return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=timeout, check=False)

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

    def stop(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self._run(self.pg_ctl, "stop", "-D", str(self.data), "-m", "fast", "-w", timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def start_server() -> PostgresServer:
    """initdb into a new temporary directory and start the server; the caller stops it."""
    initdb, pg_ctl = _need_tools()
    as_postgres = os.geteuid() == 0
    root = Path(tempfile.mkdtemp(prefix="nexa-pg-"))
    server = PostgresServer(root=root, port=free_port(), pg_ctl=pg_ctl, as_postgres=as_postgres)
    try:
        if as_postgres:
            shutil.chown(root, user="postgres", group="postgres")
        init = server._run(initdb, "-D", str(server.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-sync")
        if init.returncode != 0:
            raise AssertionError(f"initdb failed: {init.stderr[-2000:]}")
        (server.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            f"host all {PASSWORD_USER} 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\n"
        )
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={server.port} -c unix_socket_directories={root}"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        started = server._run(
            pg_ctl, "start", "-D", str(server.data), "-w", "-t", str(int(START_TIMEOUT_S)),
            "-l", str(root / "server.log"), "-o", options,
        )  # fmt: skip
        if started.returncode != 0:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            raise AssertionError(f"pg_ctl start failed: {started.stderr[-1000:]} {log[-2000:]}")
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
