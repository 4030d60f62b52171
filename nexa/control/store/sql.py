"""What every transaction function of the store shares: `txn`, the meta table, column checks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final, TypeVar

import apsw
import attrs

from nexa.contracts import codec
from nexa.errors import StoreError

T = TypeVar("T")

#: Rows one pruning transaction deletes at most, so the store lane is never held for long.
PRUNE_BATCH: Final = 5000


@contextlib.contextmanager
def txn(db: apsw.Connection) -> Iterator[None]:
    """BEGIN … COMMIT, or ROLLBACK on error (apsw's `with db:`, typed as not swallowing errors)."""
    with db:
        yield


def meta_int(db: apsw.Connection, key: str) -> int:
    value = meta(db, key)
    if not isinstance(value, int):
        raise StoreError(f"meta key {key} is not an integer")
    return value


def meta(db: apsw.Connection, key: str) -> object:
    for (value,) in db.execute("SELECT value FROM meta WHERE key = ?", (key,)):
        return value
    raise StoreError(f"meta key {key} is missing")


def pragma_int(db: apsw.Connection, name: str) -> int:
    value = db.execute(f"PRAGMA {name}").fetchall()[0][0]
    assert isinstance(value, int)
    return value


def as_int(value: object) -> int:
    if not isinstance(value, int):
        raise StoreError(f"expected an integer column, got {type(value).__name__}")
    return value


def as_float(value: object) -> float:
    if not isinstance(value, int | float):
        raise StoreError(f"expected a number column, got {type(value).__name__}")
    return float(value)


def load_all(db: apsw.Connection, cls: type[T], table: str) -> list[T]:
    names = [f.name for f in attrs.fields(cls)]  # type: ignore[arg-type]
    with txn(db):
        rows = db.execute(f"SELECT {', '.join(names)} FROM {table}").fetchall()  # noqa: S608
    return [codec.store.structure(dict(zip(names, row, strict=True)), cls) for row in rows]
