"""The SQLite backend (the default, in the state dir): `LiteDb`, the adapter the transaction functions
take as their `db`, `call`, the lane's translation, and opening the file. With `snapshot` (SQLite's
backup API), the only apsw importer.

`LiteDb` gives the calls `sql.Db` names over an apsw.Connection and speaks nexa's errors there: a
violated constraint is `StoreConflict`, a lock held past the busy timeout (another process writes
the file) `StoreBusy`, a damaged or vanished file `StoreUnusable` (the process ends, exit 3), any
other failure `StoreError`. apsw's own errors never leave this module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import apsw
import apsw.bestpractice

from nexa.control.store.schema import migrate, take_epoch
from nexa.control.store.sql import T
from nexa.errors import NexaError, StoreBusy, StoreConflict, StoreError, StoreUnusable

#: apsw's errors that mean the database itself is gone or damaged: retrying cannot help.
_UNUSABLE: Final = (
    apsw.CorruptError,
    apsw.NotADBError,
    apsw.IOError,
    apsw.CantOpenError,
    apsw.ReadOnlyError,
    apsw.ConnectionClosedError,
)


def translated(exc: apsw.Error) -> NexaError:
    """apsw's error in nexa's words (module docstring)."""
    if isinstance(exc, apsw.ConstraintError):
        return StoreConflict(constraint=constraint_named(exc))
    if isinstance(exc, apsw.BusyError | apsw.LockedError):
        return StoreBusy(
            f"the SQLite store stayed locked past its busy timeout ({type(exc).__name__}: another process "
            "writes the state directory's database); retry"
        )
    if isinstance(exc, _UNUSABLE):
        return StoreUnusable(f"the store is unusable: {type(exc).__name__}")
    return StoreError(f"store failure: {type(exc).__name__}")


def constraint_named(exc: apsw.ConstraintError) -> str:
    """The unique or foreign key a StoreConflict names (`api_key.secret_sha256`), or "constraint"."""
    text = str(exc)
    return text.split(":", 1)[-1].strip() if "UNIQUE" in text or "FOREIGN" in text else "constraint"


class LiteDb:
    """One apsw.Connection behind the calls the store's functions make (`sql.Db`), its failures
    translated (`translated`). `connection`: the apsw.Connection itself, for `snapshot`'s backup.

    `immediate` (the file shared by gateway worker processes): every outermost transaction begins
    with BEGIN IMMEDIATE, so it takes the write lock first, waiting up to the busy timeout. A
    deferred one that read and then wrote while another process committed would fail at once
    (SQLITE_BUSY_SNAPSHOT, which waits for nothing)."""

    __slots__ = ("_began", "connection", "immediate")

    dialect: Final = "sqlite"

    def __init__(self, connection: apsw.Connection, *, immediate: bool = False) -> None:
        self.connection = connection
        self.immediate = immediate
        self._began: list[bool] = []  # per open `with`: whether it issued the BEGIN IMMEDIATE

    def execute(self, statements: str, bindings: Any = None, /) -> apsw.Cursor:
        try:
            return self.connection.execute(statements, bindings)
        except apsw.Error as exc:
            raise translated(exc) from exc

    def executemany(self, statements: str, sequenceofbindings: Iterable[Any], /) -> apsw.Cursor:
        try:
            return self.connection.executemany(statements, sequenceofbindings)
        except apsw.Error as exc:
            raise translated(exc) from exc

    def changes(self) -> int:
        return self.connection.changes()

    def __enter__(self) -> LiteDb:
        began = self.immediate and self.connection.get_autocommit()
        try:
            if began:
                self.connection.execute("BEGIN IMMEDIATE")
            self.connection.__enter__()  # a savepoint inside it
        except apsw.Error as exc:
            if began and not self.connection.get_autocommit():
                self.connection.execute("ROLLBACK")
            raise translated(exc) from exc
        self._began.append(began)
        return self

    def __exit__(
        self, etype: type[BaseException] | None, evalue: BaseException | None, etraceback: TracebackType | None, /
    ) -> bool | None:
        began = self._began.pop()
        try:
            result = self.connection.__exit__(etype, evalue, etraceback)
            if began:
                self.connection.execute("COMMIT" if etype is None else "ROLLBACK")
        except apsw.Error as exc:
            if began and not self.connection.get_autocommit():
                self.connection.execute("ROLLBACK")
            raise translated(exc) from exc
        return result

    def close(self) -> None:
        self.connection.close()


def call(fn: Callable[..., T], db: LiteDb, *args: object) -> T:
    """`Store`'s lane on SQLite: run a transaction function; an apsw error raised outside `LiteDb`'s
    calls (while rows are read from a cursor) is translated here."""
    try:
        return fn(db, *args)
    except apsw.Error as exc:
        raise translated(exc) from exc


_best_practice_lock: Final = threading.Lock()
_best_practice_applied = False


def apply_best_practice() -> None:
    """apsw's recommended settings, once per process and before the first Connection: they register
    connection hooks (WAL, busy timeout, foreign keys, no double-quoted strings) and send SQLite's
    log into `logging`. Run from `open_store`, not at import, so importing the store changes nothing."""
    global _best_practice_applied  # noqa: PLW0603 - a process-wide, once-only registration
    with _best_practice_lock:
        if not _best_practice_applied:
            apsw.bestpractice.apply(apsw.bestpractice.recommended)
            _best_practice_applied = True


#: The busy timeout of a file shared by gateway worker processes: another worker's transaction
#: (a usage batch, a lease round, a management write) is waited for this long before StoreBusy.
SHARED_BUSY_TIMEOUT_MS: Final = 5000


def open_db(path: Path, *, shared: bool = False) -> tuple[LiteDb, int]:
    """The writer connection, its schema migrated (`schema.migrate`), and the new epoch it took.
    `shared`: other processes write the file too (`LiteDb.immediate`, a longer busy timeout)."""
    try:
        db = apsw.Connection(str(path))
    except apsw.Error as exc:
        raise StoreError(f"cannot open {path}: {exc}") from None
    try:
        db.execute("PRAGMA synchronous=FULL")
        if shared:
            db.set_busy_timeout(SHARED_BUSY_TIMEOUT_MS)
        migrate(db)
        lite = LiteDb(db, immediate=shared)
        return lite, take_epoch(lite)
    except apsw.Error as exc:
        db.close()
        raise StoreError(f"cannot prepare {path}: {type(exc).__name__}: {exc}") from None
    except BaseException:
        db.close()
        raise


def open_reader(path: Path, *, shared: bool = False) -> LiteDb:
    """The read-only second connection; opened after `open_db` migrated the schema and set WAL."""
    try:
        connection = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
        if shared:
            connection.set_busy_timeout(SHARED_BUSY_TIMEOUT_MS)
        return LiteDb(connection)
    except apsw.Error as exc:
        raise StoreError(f"cannot open {path} for reading: {type(exc).__name__}") from None
