"""A recovery start's durable state: the restore marker in `meta` and the epoch taken at its end."""

from __future__ import annotations

from typing import Final

from nexa.contracts.bounds import MAX_EPOCH
from nexa.contracts.domain import AuditDraft, AuditEvent
from nexa.control.store.audit import append_audit
from nexa.control.store.sql import Db, meta_int, txn
from nexa.errors import EpochExhausted

#: The `meta` key `nexa restore` writes into a restored database (its value says what was restored):
#: a controller that opens a store holding it starts in recovery. `end_recovery` deletes it.
#: The meta key `nexa restore` sets in a restored database: the backup's manifest, as JSON. A
#: controller that finds it starts in reconciliation-only mode (nexa.control.operations.recovery).
RECOVERY_MARKER: Final = "recovery_from_backup"


def recovery_marker(db: Db) -> str | None:
    """The restore marker's value (what was restored, as `nexa restore` wrote it), None without one."""
    with txn(db):
        for (value,) in db.execute("SELECT value FROM meta WHERE key = ?", (RECOVERY_MARKER,)):
            return str(value)
    return None


def end_recovery(db: Db, above: int, draft: AuditDraft) -> tuple[int, AuditEvent]:
    """End a recovery in one transaction: take an epoch above `above` (and above the stored one),
    delete the restore marker and append `draft`; the new epoch and the event. EpochExhausted,
    nothing written, when that would pass `MAX_EPOCH` (`above` is what nodes proved they hold)."""
    with txn(db):
        highest = max(meta_int(db, "epoch", lock=True), above)
        if highest >= MAX_EPOCH:
            raise EpochExhausted(epoch=highest)
        epoch = highest + 1
        db.execute("UPDATE meta SET value = ? WHERE key = 'epoch'", (epoch,))
        db.execute("DELETE FROM meta WHERE key = ?", (RECOVERY_MARKER,))
        event = append_audit(db, draft)
    return epoch, event
