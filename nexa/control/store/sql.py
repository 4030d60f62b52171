"""What every transaction function of the store shares: `Db`, `txn`, the meta table, column checks.

The seam between the two backends: a transaction function takes a `Db`, `sqlite.LiteDb` (over an
apsw.Connection) or `pg.PgDb` (over a psycopg one), writes `?` placeholders, and asks
`is_postgres(db)` where the two dialects differ (a row lock, a date format, a JSON field). It sees
only nexa's errors: each backend translates its library's at home (`StoreConflict` for a violated
constraint, `StoreBusy`, `StoreUnavailable`, `StoreUnusable`, `StoreError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, Final, Protocol, TypeVar, cast

import attrs

from nexa.contracts import codec
from nexa.errors import StoreError

T = TypeVar("T")

#: Rows one pruning transaction deletes at most, so the store lane is never held for long.
PRUNE_BATCH: Final = 5000


class Rows(Protocol):
    """What `execute` returns: iterable rows (tuples), or all of them at once."""

    def __iter__(self) -> Iterator[Any]: ...

    def fetchall(self) -> list[Any]: ...


class Db(Protocol):
    """A connection as the transaction functions use it; `sqlite.LiteDb` and `pg.PgDb` are both one
    (and so is a bare apsw.Connection, which tools and tests on a copy of the file pass).

    `with db:` is a transaction (a savepoint when nested); `changes()` counts the rows the last
    INSERT, UPDATE or DELETE touched; a violated constraint raises `nexa.errors.StoreConflict`."""

    def execute(self, statements: str, bindings: Any = None, /) -> Rows: ...

    def executemany(self, statements: str, sequenceofbindings: Iterable[Any], /) -> object: ...

    def changes(self) -> int: ...

    def __enter__(self) -> object: ...

    def __exit__(
        self, etype: type[BaseException] | None, evalue: BaseException | None, etraceback: TracebackType | None, /
    ) -> bool | None: ...


class _Snapshots(Protocol):
    def repeatable_read(self) -> None: ...


@contextlib.contextmanager
def txn(db: Db) -> Iterator[None]:
    """BEGIN … COMMIT, or ROLLBACK on error (apsw's `with db:`, typed as not swallowing errors)."""
    with db:
        yield


def is_postgres(db: object) -> bool:
    """Whether `db` is the PostgreSQL adapter (its `dialect`), for the few statements whose SQL differs."""
    return getattr(db, "dialect", "sqlite") == "postgresql"


def for_update(db: Db) -> str:
    """` FOR UPDATE` on PostgreSQL, to append to a SELECT whose rows this transaction then writes
    (several controllers share the database, READ COMMITTED); nothing on SQLite, whose one writer
    at a time holds the whole database."""
    return " FOR UPDATE" if is_postgres(db) else ""


def repeatable_read(db: Db) -> None:
    """Call first in a transaction that reads in several statements and needs them to agree (the
    audit head and the chain): on PostgreSQL the transaction becomes REPEATABLE READ, one snapshot,
    as every SQLite transaction is already. Nothing on SQLite, nor inside a started transaction."""
    if is_postgres(db):
        cast("_Snapshots", db).repeatable_read()


def meta_int(db: Db, key: str, *, lock: bool = False) -> int:
    value = meta(db, key, lock=lock)
    if isinstance(value, str) and is_postgres(db):  # PostgreSQL keeps meta values as text
        value = int(value) if value.lstrip("-").isdigit() else value
    if not isinstance(value, int):
        raise StoreError(f"meta key {key} is not an integer")
    return value


def meta(db: Db, key: str, *, lock: bool = False) -> object:
    """The meta value at `key` (StoreError when missing); `lock`: locked for this transaction's
    write of it (`for_update`). PostgreSQL gives text where SQLite gives an integer (`meta_int`)."""
    sql = "SELECT value FROM meta WHERE key = ?"
    if lock:
        sql += for_update(db)
    for (value,) in db.execute(sql, (key,)):
        return value
    raise StoreError(f"meta key {key} is missing")


def pragma_int(db: Db, name: str) -> int:
    value = db.execute(f"PRAGMA {name}").fetchall()[0][0]
    assert isinstance(value, int)
    return value


def delete_batch(db: Db, table: str, key: str, where: str, args: tuple[object, ...]) -> int:
    """Delete up to PRUNE_BATCH rows of `table` matching `where` (with `args`), in the caller's
    transaction; how many went. `key`: the primary key's columns, which PostgreSQL names them by
    (SQLite's rowid there). Names are the caller's constants, never input."""
    row = key if is_postgres(db) else "rowid"
    db.execute(
        f"DELETE FROM {table} WHERE ({row}) IN (SELECT {row} FROM {table} WHERE {where} LIMIT ?)",  # noqa: S608
        (*args, PRUNE_BATCH),
    )
    return db.changes()


def as_int(value: object) -> int:
    if not isinstance(value, int):
        raise StoreError(f"expected an integer column, got {type(value).__name__}")
    return value


def as_float(value: object) -> float:
    if not isinstance(value, int | float):
        raise StoreError(f"expected a number column, got {type(value).__name__}")
    return float(value)


def load_all(db: Db, cls: type[T], table: str) -> list[T]:
    names = [f.name for f in attrs.fields(cls)]  # type: ignore[arg-type]
    with txn(db):
        rows = db.execute(f"SELECT {', '.join(names)} FROM {table}").fetchall()  # noqa: S608
    return [codec.store.structure(dict(zip(names, row, strict=True)), cls) for row in rows]
