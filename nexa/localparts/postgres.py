"""A local PostgreSQL: Debian's `postgresql` (initdb, pg_ctl, createdb) on 127.0.0.1 at a free port,
for the store's tests and `perf/failover.py`.

The server's data and its unix socket live in a directory of the system's temporary folder made at
`start` (not under the caller's folder: as root the server runs as the `postgres` user, since initdb
refuses root, and a caller's private temporary folder is closed to that user). Durability is off
(fsync, synchronous_commit, full_page_writes): the data is disposable. Loopback and local
connections are trusted but for the `hba` lines the caller puts first. `stop` is `pg_ctl stop -m
fast` (by the postmaster's PID file), then the directory goes. Nothing here speaks SQL: psycopg
lives in `control.store`, so databases are made with `createdb`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Final

import attrs

from nexa.errors import ConfigError, Unavailable
from nexa.localparts.children import free_ports, tail

#: The superuser initdb creates, trusted on loopback.
SUPERUSER: Final = "nexa"
PG_START_TIMEOUT_S: Final = 30.0
PG_STOP_TIMEOUT_S: Final = 60.0
#: Durability off (disposable data) and room for the pools of several controllers and a test run.
SERVER_SETTINGS: Final = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
#: What to install when the tools are missing.
POSTGRES_HINT: Final = "PostgreSQL (initdb, pg_ctl) is not installed: apt-get install postgresql"


def find_pg_tool(name: str) -> str | None:
    """A PostgreSQL program: on PATH, else the newest Debian server's (/usr/lib/postgresql/*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else None


def postgres_missing() -> str:
    """Empty when the server's tools are here, else what to install."""
    return "" if find_pg_tool("initdb") and find_pg_tool("pg_ctl") else POSTGRES_HINT


@attrs.define
class LocalPostgres:
    """A PostgreSQL server on 127.0.0.1:`port` once `start` returned; its data and socket in `root`."""

    #: pg_hba.conf lines placed before the loopback trust (e.g. a role that must give a password).
    hba: str = ""
    root: Path = Path()
    port: int = 0
    pg_ctl: str = ""
    #: As root, the server's programs run as the `postgres` user.
    as_postgres: bool = False

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str = "postgres", *, user: str = SUPERUSER) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = PG_START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_postgres else []
        return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=timeout, check=False)

    def start(self) -> None:
        """initdb into a fresh directory and start the server (`pg_ctl start -w`: it accepts
        connections when this returns). ConfigError without the tools; Unavailable, with the
        server's log, when it does not start. On failure nothing is left running."""
        initdb, pg_ctl = find_pg_tool("initdb"), find_pg_tool("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise ConfigError(POSTGRES_HINT)
        self.pg_ctl, self.as_postgres = pg_ctl, os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="nexa-pg-"))
        self.port = free_ports(1)[0]
        try:
            self._init_and_start(initdb)
        except BaseException:
            self.stop()
            raise

    def _init_and_start(self, initdb: str) -> None:
        if self.as_postgres:
            shutil.chown(self.root, user="postgres", group="postgres")
        init = self._run(initdb, "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-sync")
        if init.returncode != 0:
            raise Unavailable(f"initdb failed: {init.stderr[-2000:]}")
        (self.data / "pg_hba.conf").write_text(f"{self.hba}local all all trust\nhost all all 127.0.0.1/32 trust\n")
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root} "
            + SERVER_SETTINGS
        )
        started = self._run(
            self.pg_ctl, "start", "-D", str(self.data), "-w", "-t", str(int(PG_START_TIMEOUT_S)),
            "-l", str(self.log), "-o", options,
            timeout=PG_START_TIMEOUT_S + 10,
        )  # fmt: skip
        if started.returncode != 0:
            raise Unavailable(f"pg_ctl start failed: {started.stderr[-1000:]}\n{tail(self.log)}")

    def createdb(self, name: str) -> str:
        """A new, empty database `name` owned by the superuser; its URL."""
        createdb = find_pg_tool("createdb")
        if createdb is None:
            raise ConfigError(POSTGRES_HINT)
        argv = [createdb, "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, name]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PG_START_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise Unavailable(f"createdb {name} failed: {done.stderr[-1000:]}")
        return self.url(name)

    def stop(self) -> None:
        """Stop the server (fast: sessions are disconnected) and remove its directory."""
        if self.root == Path():
            return
        if self.pg_ctl and (self.data / "postmaster.pid").exists():
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self._run(self.pg_ctl, "stop", "-D", str(self.data), "-m", "fast", "-w", timeout=PG_STOP_TIMEOUT_S)
        shutil.rmtree(self.root, ignore_errors=True)
