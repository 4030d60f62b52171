"""Errors of the durable store, and of a backup or restore of it."""

from __future__ import annotations

from nexa.errors.base import Conflict, NexaError, Unavailable


class StoreError(NexaError):
    code = "store_error"


class StoreUnusable(StoreError):
    """The database cannot be used any more (corrupt, not a database, disk I/O failed, full, read-only).

    The one failure of a running loop that ends the process (`nexa.supervision`; exit code 3)."""

    code = "store_unusable"


class EpochExhausted(StoreError):
    """The store's epoch is at `bounds.MAX_EPOCH`: no controller can take a higher one."""

    code = "epoch_exhausted"

    def __init__(self, *, epoch: int) -> None:
        super().__init__(
            f"the store's epoch is {epoch}, the highest there is: no controller can take a new one. Start"
            " the controller on a new state directory (or database) and enroll the nodes again"
        )
        self.epoch = epoch


class StateDirLocked(StoreError):
    code = "state_dir_locked"

    def __init__(self, *, state_dir: str) -> None:
        super().__init__(
            f"state directory {state_dir} is in use by another nexa control process; "
            "stop it first or pass a different --state-dir"
        )
        self.state_dir = state_dir


class StoreUnavailable(Unavailable, StoreError):
    """The PostgreSQL store did not answer: the connection is lost or refused, or a lock wait or
    deadlock timed out. Retryable (503): the next transaction connects again, and the process goes
    on (a damaged SQLite file is StoreUnusable instead). At start, it names the database and what
    to check; never a password."""

    code = "store_unavailable"


class StoreBusy(StoreUnavailable):
    """The store's lock stayed taken past its wait: SQLite's busy timeout (another process writes
    the file), PostgreSQL's `lock_timeout`, or a deadlock or serialization conflict that tries did
    not resolve. Retryable (503); nothing of the transaction was written."""

    code = "store_busy"


class StoreConflict(Conflict):
    """A write the store refused by one of its constraints (a unique key, a foreign key, NOT NULL, a
    check), raised by either backend in the statement that violated it; the transaction is undone.
    `constraint`: the unique or foreign key by the database's name for it (`api_key.secret_sha256` on
    SQLite, `tenant_pkey` on PostgreSQL), else "constraint"."""

    def __init__(self, *, constraint: str) -> None:
        super().__init__(f"conflicts with existing state ({constraint})")
        self.constraint = constraint


class BackupError(NexaError):
    """A backup could not be made or restored; what was refused wrote nothing."""

    code = "backup_error"


class BackupNotConfigured(BackupError):
    code = "backup_not_configured"


class BackupNotSupported(BackupError):
    """`nexa backup` copies the embedded SQLite store; a controller on PostgreSQL refuses it and
    names PostgreSQL's own tools (pg_dump, continuous archiving), which see the shared database whole."""

    code = "backup_not_supported"

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "this controller's store is PostgreSQL ([store] url), which nexa does not back up: use "
            "PostgreSQL's own tools (pg_dump, or continuous archiving with pg_basebackup) on the database, "
            "and copy each controller's <state_dir>/keys with them"
        )


class BackupKeyMismatch(BackupError):
    code = "backup_key_mismatch"

    def __init__(self, *, expected_id: str, got_id: str) -> None:
        super().__init__(
            f"this backup was sealed with backup key {expected_id}, not with the key given ({got_id}):"
            " pass the key it was made with (--key-file or NEXA_BACKUP_KEY)"
        )
        self.expected_id = expected_id
        self.got_id = got_id


class BackupDamaged(BackupError):
    code = "backup_damaged"


class RestoreTargetNotEmpty(BackupError):
    code = "restore_target_not_empty"

    def __init__(self, *, target: str) -> None:
        super().__init__(f"{target} is not empty: restore into a new or empty directory (nothing was written)")
        self.target = target
