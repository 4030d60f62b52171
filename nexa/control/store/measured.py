"""What replicas were measured to hold, by (runtime, model, settings): rows of the `meta` table
under `MEASURED_PREFIX`, so both backends keep them without a migration (and backups carry them)."""

from __future__ import annotations

from typing import Final

from nexa.control.store.sql import Db, txn

#: The `meta` keys of measured memory: this prefix, then the key `deployments.measured` makes.
MEASURED_PREFIX: Final = "memory_measured/"


def save_measured_memory(db: Db, key: str, measured_bytes: int) -> None:
    """Keep `measured_bytes` for `key` (the largest measured so far: the caller only raises it)."""
    with txn(db):
        db.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (MEASURED_PREFIX + key, str(measured_bytes)),
        )


def load_measured_memory(db: Db) -> dict[str, int]:
    """Every measured figure, by key."""
    with txn(db):
        rows = db.execute("SELECT key, value FROM meta WHERE key LIKE ?", (MEASURED_PREFIX + "%",)).fetchall()
    out: dict[str, int] = {}
    for key, value in rows:
        text = str(value)
        if text.isdigit():
            out[str(key).removeprefix(MEASURED_PREFIX)] = int(text)
    return out
