"""Online copies of the database (SQLite's backup API) and the checks of a restored copy.

`copy_database` steps the backup on the store lane, a few pages per transaction slot: the writer
connection is the source, so the writes other tasks make between two steps go into the copy too
(SQLite updates a backup whose source is written through the same connection instead of
restarting it), and every other transaction waits at most one step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import apsw
import attrs

from nexa.contracts.api import AuditVerdict
from nexa.control.store.audit import audit_head, verify_audit
from nexa.control.store.connection import Store
from nexa.control.store.recovery import RECOVERY_MARKER
from nexa.control.store.sql import meta_int, txn
from nexa.control.store.sqlite import LiteDb
from nexa.errors import BackupNotSupported, StoreError

#: Pages copied per step (4 KiB each: 1 MiB), i.e. per turn on the store lane.
PAGES_PER_STEP: Final = 256


@attrs.frozen(kw_only=True)
class CopyInfo:
    """What the copy holds: its epoch and audit head, read from the copy itself."""

    epoch: int
    audit_head_seq: int
    audit_head_sha256: str
    steps: int


async def copy_database(store: Store, dest: Path, *, pages_per_step: int | None = None) -> CopyInfo:
    """Copy the live database into `dest` (a new file) while the controller serves; never a file copy.
    `pages_per_step`: default PAGES_PER_STEP. A PostgreSQL store is refused (BackupNotSupported)."""
    if store.backend != "sqlite":
        raise BackupNotSupported()
    pages_per_step = pages_per_step or PAGES_PER_STEP
    target = _open_dest(dest)
    try:
        backup = await store.run(_begin, target)
        steps = 0
        try:
            done = False
            while not done:
                done = await store.run(_step, backup, pages_per_step)
                steps += 1
        finally:
            await store.run(_finish, backup)
        return _info(target, steps)
    finally:
        target.close()


def _open_dest(dest: Path) -> apsw.Connection:
    if dest.exists():
        raise StoreError(f"{dest} exists already")
    return apsw.Connection(str(dest))


def _begin(db: LiteDb, target: apsw.Connection) -> apsw.Backup:
    return target.backup("main", db.connection, "main")  # the SQLite store's connection (`copy_database`)


def _step(_db: LiteDb, backup: apsw.Backup, pages: int) -> bool:
    backup.step(pages)
    return bool(backup.done)


def _finish(_db: LiteDb, backup: apsw.Backup) -> None:
    backup.finish()


def _info(db: apsw.Connection, steps: int) -> CopyInfo:
    seq, sha = audit_head(db)
    with txn(db):
        epoch = meta_int(db, "epoch")
    # Out of WAL mode: the copy is one self-contained file (no -wal or -shm beside it).
    db.execute("PRAGMA journal_mode=DELETE")
    return CopyInfo(epoch=epoch, audit_head_seq=seq, audit_head_sha256=sha, steps=steps)


def check_restored(path: Path, marker: str) -> tuple[AuditVerdict, tuple[int, str]]:
    """Verify the audit chain of a restored database and, when it holds, set the recovery marker.

    Returns the verdict and the chain's head; the marker is written only when the verdict is ok.
    StoreError when the file is not a database.
    """
    try:
        db = apsw.Connection(str(path))
    except apsw.Error as exc:
        raise StoreError(f"cannot open {path}: {type(exc).__name__}") from None
    try:
        verdict = verify_audit(db)
        head = audit_head(db)
        if verdict.ok:
            json.loads(marker)  # only JSON goes in
            with txn(db):
                db.execute(
                    "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (RECOVERY_MARKER, marker),
                )
            db.execute("PRAGMA journal_mode=DELETE")
    except apsw.Error as exc:
        raise StoreError(f"the restored database cannot be read: {type(exc).__name__}") from None
    else:
        return verdict, head
    finally:
        db.close()
