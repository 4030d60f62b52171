"""Backups: the manifest sealed inside each backup file, and the `/api/v1/backups` answers."""

from __future__ import annotations

import attrs

#: The backup file format this version writes and reads (`BackupManifest.format`, the file header).
BACKUP_FORMAT = 1


@attrs.frozen(kw_only=True)
class BackupPart:
    """One file in the archive: its path under the state directory, size and sha256 (hex)."""

    name: str
    size: int
    sha256: str


@attrs.frozen(kw_only=True)
class BackupManifest:
    """What a backup holds, signed by the controller that made it (Ed25519 over its canonical JSON)."""

    format: int
    nexa_version: str
    #: The controller's epoch when the backup was taken (the database's `meta.epoch`).
    epoch: int
    #: The audit chain's head inside the backed-up database.
    audit_head_seq: int
    audit_head_sha256: str
    #: Unix seconds.
    created_at: float
    #: The controller's Ed25519 public key (base64): the key that signed this manifest.
    controller_signing_public_key: str
    parts: tuple[BackupPart, ...]


@attrs.frozen(kw_only=True)
class BackupHeader:
    """The file's cleartext header (authenticated as AES-GCM associated data, so never edited unseen):
    enough to list a backup, and to tell a wrong key from a damaged file, without decrypting it."""

    format: int
    #: `security.backup_key_id` of the key it was sealed with.
    key_id: str
    #: AES-GCM nonce, hex.
    nonce: str
    epoch: int
    audit_head_seq: int
    audit_head_sha256: str
    created_at: float


@attrs.frozen(kw_only=True)
class BackupView:
    """One backup file in `[backup] dir`: its name, size and sha256 (of the encrypted file), and what it holds."""

    name: str
    size: int
    sha256: str
    epoch: int
    audit_head_seq: int
    audit_head_sha256: str
    created_at: float


@attrs.frozen(kw_only=True)
class BackupList:
    backups: list[BackupView]
    next_cursor: str | None = None


@attrs.frozen(kw_only=True)
class BackupFailure:
    """The detail of a `backup.failed` audit event (a scheduled backup that failed)."""

    #: The error's code (`nexa.errors`), or `os_error.<ERRNO>` for a file-system failure.
    code: str
    message: str


@attrs.frozen(kw_only=True)
class RestoreResult:
    """What `nexa restore` wrote (`--json`)."""

    state_dir: str
    manifest: BackupManifest
    audit_events_verified: int
