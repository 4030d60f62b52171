"""The PostgreSQL backend (`[store] url`): `PgDb`, the adapter the transaction functions take as
their `db`, and `open_postgres`, what `open_store` does with a URL. The only psycopg importer, and
imported only when a URL is set: the SQLite store's start never loads psycopg.

`PgDb` gives the calls `sql.Db` names, as `sqlite.LiteDb` does: `?` placeholders (turned into
psycopg's `%s`, literal `%` escaped), `with db:` a transaction and a savepoint when nested,
`changes()` the rows of the last INSERT, UPDATE or DELETE. Transactions are READ COMMITTED; the
functions lock what they read to write (`sql.for_update`, the audit head) and ask for one snapshot
where they read in several statements (`sql.repeatable_read`). The reader lane's connection is read
only, REPEATABLE READ. The schema is SQLite's migrations, translated (`schema.postgresql`).

Failures speak nexa's errors (`translated`; psycopg's never leave this module): a violated
constraint is `StoreConflict`; a lock waited on past `lock_timeout` `StoreBusy`; a lost or refused
connection `StoreUnavailable` (retryable, 503), and the next transaction connects again; it never
ends the process, unlike a damaged SQLite file (StoreUnusable). A deadlock or serialization failure
is retried first, whole (`call`), then is `StoreBusy`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import psycopg
import psycopg.adapt
import psycopg.conninfo
import trio
from psycopg import errors as pgerrors

from nexa.config import StoreConfig
from nexa.control.store.connection import Store
from nexa.control.store.schema import migrate_pg
from nexa.control.store.sql import T, meta_int, txn
from nexa.errors import ConfigError, NexaError, StoreBusy, StoreConflict, StoreError, StoreUnavailable

#: Whole tries of a transaction that PostgreSQL aborted to break a deadlock or a serialization conflict.
TRIES: Final = 3
#: Session settings of every connection: a lock waited on longer than this fails (retryable) rather
#: than hold a request; a transaction left idle this long (a frozen controller) is ended by the server,
#: releasing the rows it locked for the other controllers.
_SESSION: Final = (
    "SET lock_timeout = '10s'",
    "SET idle_in_transaction_session_timeout = '30s'",
)
#: TCP keepalives and a send timeout (ms): a peer gone from the network is noticed in about 30 s.
_KEEPALIVE: Final = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30000,
}
_CHANGING: Final = ("INSERT", "UPDATE", "DELETE")


class _Aborted(StoreBusy):
    """PostgreSQL aborted the transaction to break a deadlock or a serialization conflict: `call`
    runs it again, whole, up to `TRIES` times."""


def translated(exc: psycopg.Error) -> NexaError:
    """psycopg's error in nexa's words (module docstring)."""
    if isinstance(exc, pgerrors.IntegrityError):
        # As SQLite's are named (`sqlite.constraint_named`): a unique or foreign key by its name.
        named = exc.sqlstate in ("23505", "23503") and exc.diag.constraint_name
        return StoreConflict(constraint=named or "constraint")
    if isinstance(exc, pgerrors.DeadlockDetected | pgerrors.SerializationFailure):
        return _Aborted(f"the PostgreSQL store aborted the transaction ({type(exc).__name__}); retry")
    if isinstance(exc, pgerrors.LockNotAvailable):
        return StoreBusy(
            "the PostgreSQL store's lock stayed taken past lock_timeout (another controller holds the rows); retry"
        )
    if isinstance(exc, psycopg.OperationalError):
        return StoreUnavailable(
            f"the PostgreSQL store cannot be reached or timed out ({type(exc).__name__}); retry: "
            "it is connected again at the next transaction"
        )
    return StoreError(f"store failure: {type(exc).__name__}")


class _NumericLoader(psycopg.adapt.Loader):
    """`sum()` over BIGINT columns answers NUMERIC: an int (a float if fractional), as SQLite gives."""

    def load(self, data: psycopg.abc.Buffer) -> int | float:
        text = bytes(data).decode()
        return int(text) if text.lstrip("-").isdigit() else float(text)


@functools.lru_cache(maxsize=2048)
def to_pyformat(sql: str) -> str:
    """`?` placeholders to psycopg's `%s`, and a literal `%` to `%%` (none inside quotes is a placeholder)."""
    out: list[str] = []
    quoted = False
    for ch in sql:
        if ch == "'":
            quoted = not quoted
        if ch == "%":
            out.append("%%")
        elif ch == "?" and not quoted:
            out.append("%s")
        else:
            out.append(ch)
    return "".join(out)


Connector = Callable[[], "psycopg.Connection[tuple[Any, ...]]"]


class PgDb:
    """One psycopg connection, in autocommit mode, behind the calls the store's functions make.

    Used by one thread at a time (its Store lane). A connection found broken at the start of a
    transaction is replaced (`connect`) before the transaction begins.
    """

    dialect: Final = "postgresql"

    def __init__(self, connect: Connector) -> None:
        self._connect = connect
        self._conn = connect()
        self._stack: list[contextlib.AbstractContextManager[psycopg.Transaction]] = []
        self._fresh = False
        self._changes = 0

    def execute(self, statements: str, bindings: Sequence[Any] | None = None, /) -> psycopg.Cursor[tuple[Any, ...]]:
        """One statement with `?` bindings; without bindings, the text as it is (a migration's script)."""
        self._fresh = False
        try:
            if bindings is None:
                cur = self._conn.execute(statements.encode())
            else:
                cur = self._conn.execute(to_pyformat(statements).encode(), tuple(bindings))
        except psycopg.Error as exc:
            raise translated(exc) from exc
        if (cur.statusmessage or "").startswith(_CHANGING):
            self._changes = cur.rowcount
        return cur

    def executemany(self, statements: str, sequenceofbindings: Iterable[Sequence[Any]], /) -> None:
        self._fresh = False
        with self._conn.cursor() as cur:
            try:
                cur.executemany(to_pyformat(statements).encode(), [tuple(b) for b in sequenceofbindings])
            except psycopg.Error as exc:
                raise translated(exc) from exc
            self._changes = cur.rowcount

    def changes(self) -> int:
        return self._changes

    def repeatable_read(self) -> None:
        """Make the transaction just begun REPEATABLE READ (`sql.repeatable_read`); nothing once it
        has run a statement, or inside a savepoint (the outer transaction decides)."""
        if self._fresh and len(self._stack) == 1:
            self._conn.execute(b"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            self._fresh = False

    def __enter__(self) -> PgDb:
        try:
            self._begin()
        except psycopg.Error as exc:
            raise translated(exc) from exc
        return self

    def _begin(self) -> None:
        if not self._stack:
            if self._conn.closed or self._conn.broken:
                self._reconnect()
            try:
                tx = self._conn.transaction()
                tx.__enter__()
            except psycopg.OperationalError:
                # Found dead at BEGIN (a restarted server, a dropped link): nothing ran yet, so
                # connect again and begin there; a second failure is the caller's StoreUnavailable.
                self._reconnect()
                tx = self._conn.transaction()
                tx.__enter__()
            self._fresh = True
        else:
            tx = self._conn.transaction()
            tx.__enter__()
        self._stack.append(tx)

    def __exit__(
        self, etype: type[BaseException] | None, evalue: BaseException | None, etraceback: TracebackType | None, /
    ) -> bool:
        tx = self._stack.pop()
        self._fresh = False
        try:
            return bool(tx.__exit__(etype, evalue, etraceback))
        except psycopg.Error as exc:
            if evalue is not None and isinstance(exc, psycopg.OperationalError):
                return False  # the transaction's own error says more than the failed ROLLBACK
            raise translated(exc) from exc

    def _reconnect(self) -> None:
        self._stack.clear()
        with contextlib.suppress(psycopg.Error):
            self._conn.close()
        self._conn = self._connect()

    def close(self) -> None:
        self._conn.close()


def call(fn: Callable[..., T], db: PgDb, *args: object) -> T:
    """`Store`'s lane on PostgreSQL: run a transaction function, again whole where the server
    aborted it to break a deadlock (`_Aborted`), at most `TRIES` times; then StoreBusy."""
    for attempt in range(1, TRIES + 1):
        try:
            return fn(db, *args)
        except _Aborted as exc:
            if attempt == TRIES:
                cause = type(exc.__cause__).__name__
                raise StoreBusy(f"the PostgreSQL store aborted the transaction {TRIES} times ({cause}); retry") from exc
        except psycopg.Error as exc:  # not from a PgDb call: a psycopg object the function used itself
            raise translated(exc) from exc
    raise AssertionError("unreachable")


# --- opening ------------------------------------------------------------------------------------


def describe(url: str) -> str:
    """`user@host:port/database` of a libpq URL, for messages (never a password: none is in the URL)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"store.url is not a URL libpq reads: {str(exc).splitlines()[0]}") from None
    host = str(info.get("host") or "localhost")
    port = str(info.get("port") or "5432")
    user = str(info.get("user") or "")
    database = str(info.get("dbname") or user or "")
    return f"{user + '@' if user else ''}{host}:{port}/{database}"


def read_password(path: str) -> str | None:
    """The password in `store.password_file` (its first line), None where none is configured."""
    if not path:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"store.password_file {path}: cannot read it ({reason})") from None
    password = text.splitlines()[0].strip() if text.strip() else ""
    if not password:
        raise ConfigError(f"store.password_file {path} is empty: write the database user's password in it")
    return password


def _connector(cfg: StoreConfig, password: str | None, *, reader: bool) -> Connector:
    extra: dict[str, Any] = {**_KEEPALIVE, "connect_timeout": max(1, round(cfg.connect_timeout_s))}
    if password is not None:
        extra["password"] = password
    role = "reader" if reader else "writer"

    def connect() -> psycopg.Connection[tuple[Any, ...]]:
        conn = psycopg.connect(cfg.url, autocommit=True, application_name=f"nexa control ({role})", **extra)
        try:
            conn.adapters.register_loader("numeric", _NumericLoader)
            for statement in _SESSION:
                conn.execute(statement.encode())
            if reader:
                conn.read_only = True
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            else:
                conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        except BaseException:
            conn.close()
            raise
        return conn

    return connect


def _unreachable(where: str, exc: psycopg.Error) -> StoreUnavailable:
    reason = " ".join(str(exc).split())  # libpq's own words: the host, the port, what failed
    return StoreUnavailable(
        f"cannot use the PostgreSQL store {where} (store.url): {reason}; check that PostgreSQL runs there "
        "and takes connections from this host (listen_addresses, pg_hba.conf), that the database exists, "
        "and the user and its password (store.password_file)"
    )


def _open(cfg: StoreConfig, where: str) -> tuple[PgDb, int]:
    password = read_password(cfg.password_file)
    try:
        db = PgDb(_connector(cfg, password, reader=False))
    except psycopg.Error as exc:
        raise _unreachable(where, exc) from None
    try:
        migrate_pg(db, where)
        # Several controllers share this store: the epoch moves only when a leader takes the lease
        # (`acquire_lease`), so a takeover is the last epoch + 1 however many controllers started.
        with txn(db):
            return db, meta_int(db, "epoch")
    except StoreError as exc:
        db.close()
        cause = exc.__cause__
        if type(exc) is StoreError and isinstance(cause, psycopg.Error):  # a statement failed: the server's words
            raise StoreError(f"cannot prepare the PostgreSQL store {where}: {type(cause).__name__}: {cause}") from None
        raise
    except BaseException:
        db.close()
        raise


def _open_reader(cfg: StoreConfig, where: str) -> PgDb:
    try:
        return PgDb(_connector(cfg, read_password(cfg.password_file), reader=True))
    except psycopg.Error as exc:
        raise _unreachable(where, exc) from None


@contextlib.asynccontextmanager
async def open_postgres(cfg: StoreConfig, *, inline: bool = False) -> AsyncIterator[Store]:
    """Connect (a writer and a reader connection), migrate, take an epoch; close on exit.

    No lock beside it: several controllers share one database. Refusals are ConfigError (a bad
    url or password file) or StoreError (unreachable: StoreUnavailable; not nexa's; newer)."""
    where = describe(cfg.url)
    db, epoch = await trio.to_thread.run_sync(_open, cfg, where)
    try:
        reader = await trio.to_thread.run_sync(_open_reader, cfg, where)
        try:
            yield Store(db, epoch=epoch, inline=inline, reader=reader, backend="postgresql", call=call)
        finally:
            reader.close()
    finally:
        db.close()
