"""Backups of the controller's state, and their restore onto a new state directory.

A backup file is one AES-256-GCM sealed archive:

    b"NXBACKUP"  u32 n  header (n bytes of canonical JSON, `BackupHeader`)  ciphertext+tag

The magic, the length and the header are the associated data: not secret (a listing reads them
without the key), never editable unseen. The plaintext is a sequence of parts, each
`u16 len, name, u64 len, bytes`: `manifest.json` (`BackupManifest`), `manifest.sig` (the
controller's Ed25519 signature over it), then each part the manifest names with its sha256: the
database (copied with SQLite's backup API while the controller serves, `store.snapshot`) and the
controller's key files (`keys/`). The backup key is 32 random bytes (`nexa keygen --backup`).

`restore` is offline (`nexa restore`): it writes into a temporary directory beside the target,
verifies everything there (the audit chain included) and renames it into place at the end, so a
refusal writes nothing. `Backups` makes them inside the controller: on `POST /api/v1/backups`
and every `[backup] interval_s`, into `[backup] dir`, keeping the newest `keep`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Final

import attrs
import trio

from nexa import __version__, security
from nexa.config import BackupConfig
from nexa.contracts import codec, pages
from nexa.contracts.backup import (
    BACKUP_FORMAT,
    BackupFailure,
    BackupHeader,
    BackupManifest,
    BackupPart,
    BackupView,
    RestoreResult,
)
from nexa.contracts.domain import SYSTEM, Actor
from nexa.contracts.evidence import JobKind, JobState
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.operations.jobs import Jobs
from nexa.control.store.snapshot import check_restored, copy_database
from nexa.errors import (
    BackupDamaged,
    BackupError,
    BackupKeyMismatch,
    BackupNotConfigured,
    BackupNotSupported,
    ConfigError,
    ContractError,
    NexaError,
    NotFound,
    RestoreTargetNotEmpty,
)
from nexa.security import PublicKey, SigningKey
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

MAGIC: Final = b"NXBACKUP"
#: The environment variable that may hold the backup key (base64 or hex), instead of a key file.
KEY_ENV: Final = "NEXA_BACKUP_KEY"
#: Where backups go when `[backup] dir` is empty: beside the state (copy them off the host!).
DEFAULT_DIR: Final = "backups"
SUFFIX: Final = ".nxbk"
_NAME_RE: Final = re.compile(r"^nexa-[0-9]{8}T[0-9]{6}\.[0-9]{3}Z-e[0-9]+\.nxbk$")
_MANIFEST: Final = "manifest.json"
_SIGNATURE: Final = "manifest.sig"
_SIGNATURE_KIND: Final = b"nexa.backup-manifest.v1"
_DB_PART: Final = st.DB_FILE
_KEYS_DIR: Final = "keys"
_HEADER_MAX: Final = 4096
_U32: Final = struct.Struct(">I")
_U16: Final = struct.Struct(">H")
_U64: Final = struct.Struct(">Q")
#: Bytes a download is sent in.
CHUNK_BYTES: Final = 1 << 20


def load_key(key_file: str, *, env: dict[str, str] | None = None) -> bytes | None:
    """The backup key from `key_file` (mode 0600, like any private key) or `$NEXA_BACKUP_KEY`; None if neither."""
    if key_file:
        raw = security.read_key_file(Path(key_file), private=True)
        return security.parse_backup_key(raw.decode("ascii", "replace"), source=key_file)
    text = (os.environ if env is None else env).get(KEY_ENV, "")
    return security.parse_backup_key(text, source=KEY_ENV) if text.strip() else None


# --- the file format ---------------------------------------------------------------------------


def _pack(parts: list[tuple[str, bytes]]) -> bytes:
    out = bytearray()
    for name, data in parts:
        encoded = name.encode()
        out += _U16.pack(len(encoded)) + encoded + _U64.pack(len(data)) + data
    return bytes(out)


def _unpack(data: bytes) -> Iterator[tuple[str, bytes]]:
    at = 0
    while at < len(data):
        try:
            (n,) = _U16.unpack_from(data, at)
            name = data[at + 2 : at + 2 + n].decode()
            (size,) = _U64.unpack_from(data, at + 2 + n)
        except (struct.error, UnicodeDecodeError):
            raise BackupDamaged("the backup's archive is cut short or malformed") from None
        start = at + 2 + n + _U64.size
        if start + size > len(data):
            raise BackupDamaged("the backup's archive is cut short")
        yield name, data[start : start + size]
        at = start + size


def _aad(header: BackupHeader) -> bytes:
    raw = codec.dumps(codec.api, header).encode()
    return MAGIC + _U32.pack(len(raw)) + raw


def read_header(data: bytes) -> tuple[BackupHeader, int]:
    """The cleartext header of a backup file and where its ciphertext starts; BackupDamaged if none."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _U32.size:
        raise BackupDamaged("not a nexa backup file (no NXBACKUP header): pass a file `nexa backup` wrote")
    (n,) = _U32.unpack_from(data, len(MAGIC))
    end = len(MAGIC) + _U32.size + n
    if n > _HEADER_MAX or end > len(data):
        raise BackupDamaged("the backup's header is cut short or too long (truncated or edited file)")
    try:
        header = codec.loads(codec.api, data[len(MAGIC) + _U32.size : end], BackupHeader)
    except ContractError as exc:
        raise BackupDamaged(f"the backup's header does not parse: {exc.message}") from None
    if header.format != BACKUP_FORMAT:
        raise BackupDamaged(f"backup format {header.format}; this nexa {__version__} reads format {BACKUP_FORMAT}")
    return header, end


def seal(manifest: BackupManifest, signing_key: SigningKey, files: dict[str, bytes], key: bytes) -> bytes:
    """The backup file: the manifest, its signature and the files, sealed under `key`."""
    body = codec.dumps(codec.api, manifest).encode()
    signature = security.sign(signing_key, _SIGNATURE_KIND, body)
    plaintext = _pack([(_MANIFEST, body), (_SIGNATURE, signature), *((p.name, files[p.name]) for p in manifest.parts)])
    nonce = security.backup_nonce()
    header = BackupHeader(
        format=BACKUP_FORMAT,
        key_id=security.backup_key_id(key),
        nonce=nonce.hex(),
        epoch=manifest.epoch,
        audit_head_seq=manifest.audit_head_seq,
        audit_head_sha256=manifest.audit_head_sha256,
        created_at=manifest.created_at,
    )
    aad = _aad(header)
    ciphertext = security.seal(key, aad, nonce, plaintext)
    return aad + ciphertext


def open_sealed(
    data: bytes, key: bytes, *, trusted: PublicKey | None = None
) -> tuple[BackupManifest, dict[str, bytes]]:
    """The manifest and files of a backup file, every check passed; BackupKeyMismatch, BackupDamaged.

    The manifest's signature is checked with `trusted` (the controller key an operator pinned) when
    given, else with the public half of the signing key inside the backup, which must be the key the
    manifest names.
    """
    header, start = read_header(data)
    key_id = security.backup_key_id(key)
    plaintext = security.unseal(key, data[:start], bytes.fromhex(header.nonce), data[start:])
    if plaintext is None:
        if header.key_id != key_id:
            raise BackupKeyMismatch(expected_id=header.key_id, got_id=key_id)
        raise BackupDamaged("the backup does not authenticate under its key: the file was truncated or edited")
    parts = dict(_unpack(plaintext))
    try:
        manifest = codec.loads(codec.api, parts[_MANIFEST], BackupManifest)
        signature = parts[_SIGNATURE]
    except (KeyError, ContractError):
        raise BackupDamaged("the backup holds no readable manifest") from None
    files = _checked_parts(manifest, parts)
    _check_signature(manifest, parts[_MANIFEST], signature, files, trusted)
    summary = (manifest.epoch, manifest.audit_head_seq, manifest.audit_head_sha256, manifest.created_at)
    if summary != (header.epoch, header.audit_head_seq, header.audit_head_sha256, header.created_at):
        raise BackupDamaged("the backup's header does not match its signed manifest")
    return manifest, files


def _checked_parts(manifest: BackupManifest, parts: dict[str, bytes]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for part in manifest.parts:
        if not _safe_name(part.name):
            raise BackupDamaged(f"the manifest names a part outside the state directory: {part.name!r}")
        data = parts.get(part.name)
        if data is None:
            raise BackupDamaged(f"the backup lacks the part {part.name} its manifest names")
        if len(data) != part.size or hashlib.sha256(data).hexdigest() != part.sha256:
            raise BackupDamaged(f"part {part.name} does not match its size and sha256 in the manifest")
        files[part.name] = data
    if _DB_PART not in files:
        raise BackupDamaged("the backup holds no database")
    return files


def _safe_name(name: str) -> bool:
    return name == _DB_PART or bool(re.fullmatch(rf"{_KEYS_DIR}/[A-Za-z0-9][A-Za-z0-9._-]*", name))


def _check_signature(
    manifest: BackupManifest, body: bytes, signature: bytes, files: dict[str, bytes], trusted: PublicKey | None
) -> None:
    try:
        named = PublicKey.from_b64(manifest.controller_signing_public_key)
    except ContractError:
        raise BackupDamaged("the manifest names no valid controller key") from None
    signing_pem = files.get(f"{_KEYS_DIR}/{_SIGNING_FILE}")
    if trusted is None:
        try:
            held = None if signing_pem is None else security.signing_key_from_pem(signing_pem, source=_SIGNING_FILE)
        except ConfigError:
            held = None
        if held is None or held.public != named:
            raise BackupDamaged("the manifest's controller key is not the signing key the backup holds")
        trusted = named
    elif trusted != named:
        raise BackupDamaged(
            f"the backup was made by controller key {named.fingerprint}, not by the key given ({trusted.fingerprint})"
        )
    try:
        security.verify(trusted, signature, _SIGNATURE_KIND, body)
    except NexaError:
        raise BackupDamaged("the manifest's signature does not verify with the controller's key") from None


# --- making one (inside the controller) ---------------------------------------------------------

_SIGNING_FILE: Final = "controller-signing.pem"


async def make(store: st.Store, state_dir: Path, signing_key: SigningKey, key: bytes) -> tuple[bytes, BackupManifest]:
    """A backup of the live store and the key files: (the sealed file's bytes, its manifest)."""
    with tempfile.TemporaryDirectory(prefix="nexa-backup-") as scratch:
        copy = Path(scratch) / _DB_PART
        info = await copy_database(store, copy)
        files = await trio.to_thread.run_sync(_read_files, copy, state_dir / _KEYS_DIR)
    manifest = BackupManifest(
        format=BACKUP_FORMAT,
        nexa_version=__version__,
        epoch=info.epoch,
        audit_head_seq=info.audit_head_seq,
        audit_head_sha256=info.audit_head_sha256,
        created_at=time.time(),
        controller_signing_public_key=signing_key.public.b64,
        parts=tuple(
            BackupPart(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
            for name, data in files.items()
        ),
    )
    sealed = await trio.to_thread.run_sync(seal, manifest, signing_key, files, key)
    return sealed, manifest


def _read_files(db_copy: Path, keys_dir: Path) -> dict[str, bytes]:
    files = {_DB_PART: db_copy.read_bytes()}
    for path in sorted(keys_dir.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            files[f"{_KEYS_DIR}/{path.name}"] = security.read_key_file(path, private=False)
    if sum(len(v) for v in files.values()) > security.BACKUP_MAX_BYTES - CHUNK_BYTES:
        raise BackupError(
            "the database is larger than one backup file holds (2 GiB): shorten gateway.usage_retention_s"
            " or gateway.workload_retention_s, or copy the volume under state_dir with the controller stopped"
        )
    return files


# --- restoring one (offline, `nexa restore`) ----------------------------------------------------


def restore(data: bytes, target: Path, key: bytes, *, trusted: PublicKey | None = None) -> RestoreResult:
    """Restore a backup file's bytes into `target` (absent or empty); nothing is written on a refusal."""
    _check_empty(target)
    manifest, files = open_sealed(data, key, trusted=trusted)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.restore-"))
    try:
        checked = _fill(scratch, manifest, files)
        _check_empty(target)
        # rename(2) replaces an empty directory atomically, or creates the target.
        scratch.replace(target)
        security.fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return RestoreResult(state_dir=str(target), manifest=manifest, audit_events_verified=checked)


def _fill(scratch: Path, manifest: BackupManifest, files: dict[str, bytes]) -> int:
    """Write the parts into `scratch`, verify the audit chain there and set the recovery marker;
    the number of events verified."""
    (scratch / _KEYS_DIR).mkdir(mode=0o700)
    for name, content in files.items():
        security.write_key_file(scratch / name, content, private=not name.endswith(".pub"))
    verdict, head = check_restored(scratch / _DB_PART, codec.dumps(codec.api, manifest))
    if not verdict.ok:
        raise BackupDamaged(
            f"the restored audit chain is broken at event seq {verdict.first_bad_seq}: {verdict.reason}"
        )
    if head != (manifest.audit_head_seq, manifest.audit_head_sha256):
        raise BackupDamaged("the restored audit head is not the one the manifest records")
    return verdict.checked


def _check_empty(target: Path) -> None:
    if target.is_dir():
        if any(target.iterdir()):
            raise RestoreTargetNotEmpty(target=str(target))
    elif target.exists() or target.is_symlink():
        raise RestoreTargetNotEmpty(target=str(target))


# --- the controller's backups: on request and on a schedule -------------------------------------


def backup_name(created_at: float, epoch: int) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(created_at))
    return f"nexa-{stamp}.{int(created_at * 1000) % 1000:03d}Z-e{epoch}{SUFFIX}"


@attrs.define(kw_only=True)
class Backups:
    """Makes backups into `[backup] dir`, lists them and hands them out; the scheduled loop (`run`)."""

    cfg: BackupConfig
    state_dir: Path
    store: st.Store
    accounts: Accounts
    metrics: Metrics
    signing_key: SigningKey
    key: bytes | None
    #: Where each backup is recorded as a `backup` job (`control.operations.jobs`); None: not recorded.
    jobs: Jobs | None = None
    _lock: trio.Lock = attrs.field(factory=trio.Lock)

    @staticmethod
    def of(backups: Backups | None) -> Backups:
        """`backups`, or BackupNotConfigured where the controller runs without (a test's app)."""
        if backups is None:
            raise BackupNotConfigured("this controller makes no backups")
        return backups

    @property
    def lock(self) -> trio.Lock:
        """Held while a backup is made; a controller key rotation holds it too (`KeyRotation`), so a
        backup never signs with one key while taking the key files of another."""
        return self._lock

    @property
    def directory(self) -> Path:
        return Path(self.cfg.dir) if self.cfg.dir else self.state_dir / DEFAULT_DIR

    async def create(self, actor: Actor) -> BackupView:
        """Make one backup into the directory, audited (`backup.created`); older ones past `keep` go.
        BackupNotSupported on a PostgreSQL store (its own tools back it up)."""
        if self.store.backend != "sqlite":
            raise BackupNotSupported()
        if self.key is None:
            raise BackupNotConfigured(
                f"no backup key: set [backup] key_file (or {KEY_ENV}) on the controller;"
                " make one with `nexa keygen --backup --out FILE`"
            )
        async with self._lock:
            job = None if self.jobs is None else await self.jobs.record(JobKind.BACKUP, "backup", progress=0.0)
            try:
                view = await self._make(actor, self.key)
            except (NexaError, OSError) as exc:
                if job is not None and self.jobs is not None:
                    await self.jobs.finish(job, JobState.FAILED, getattr(exc, "message", None) or type(exc).__name__)
                raise
            if job is not None and self.jobs is not None:
                summary = f"{view.name}: {view.size} bytes, audit head {view.audit_head_seq}"
                await self.jobs.finish(job, JobState.SUCCEEDED, summary, link=f"/api/v1/backups/{view.name}")
        log.info("backup written", extra={"fields": {"name": view.name, "bytes": view.size, "epoch": view.epoch}})
        return view

    async def _make(self, actor: Actor, key: bytes) -> BackupView:
        sealed, manifest = await make(self.store, self.state_dir, self.signing_key, key)
        name = backup_name(manifest.created_at, manifest.epoch)
        await trio.to_thread.run_sync(self._write, name, sealed)
        view = _view(name, sealed, manifest)
        await self.accounts.record(actor, "backup.created", name, detail=codec.dumps(codec.api, view))
        self.metrics.backup_last_success.set(manifest.created_at)
        self.metrics.backup_size.set(len(sealed))
        await trio.to_thread.run_sync(self._prune)
        return view

    def _write(self, name: str, sealed: bytes) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        security.write_key_file(self.directory / name, sealed, private=True)

    def _names(self) -> list[str]:
        try:
            return sorted(p.name for p in self.directory.iterdir() if _NAME_RE.match(p.name))
        except (FileNotFoundError, NotADirectoryError):  # none yet (a write says why it cannot make one)
            return []

    def _prune(self) -> None:
        for name in self._names()[: -self.cfg.keep]:
            (self.directory / name).unlink(missing_ok=True)
            log.info("old backup deleted", extra={"fields": {"name": name}})

    def list_page(self, after: pages.Key | None, limit: int) -> tuple[list[BackupView], pages.Key | None]:
        """A page of the backups in the directory, oldest first (a file whose header is unreadable is skipped)."""
        views: list[BackupView] = []
        for name in (n for n in self._names() if after is None or (n,) > after):
            if len(views) > limit:
                break
            try:
                views.append(self.view(name))
            except (BackupDamaged, NotFound):
                log.warning("unreadable backup file skipped", extra={"fields": {"name": name}})
        return pages.cut(views, limit, lambda v: (v.name,))

    def path(self, name: str) -> Path:
        """The file of backup `name`; NotFound for another name or a missing file."""
        path = self.directory / name
        if not _NAME_RE.match(name) or not path.is_file():
            raise NotFound(f"no backup named {name!r}: `nexa backup list` names them")
        return path

    async def download(self, name: str) -> AsyncIterator[bytes]:
        """The bytes of backup `name`, in chunks (NotFound raised here, before the first chunk)."""
        fh = await trio.to_thread.run_sync(self.path(name).open, "rb")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while chunk := await trio.to_thread.run_sync(fh.read, CHUNK_BYTES):
                    yield chunk
            finally:
                fh.close()

        return chunks()

    def view(self, name: str) -> BackupView:
        path = self.path(name)
        with path.open("rb") as fh:
            head = fh.read(len(MAGIC) + _U32.size + _HEADER_MAX)
            size = os.fstat(fh.fileno()).st_size
        header, _ = read_header(head)
        digest = _file_sha256(path)
        return BackupView(
            name=name,
            size=size,
            sha256=digest,
            epoch=header.epoch,
            audit_head_seq=header.audit_head_seq,
            audit_head_sha256=header.audit_head_sha256,
            created_at=header.created_at,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every `interval_s` (0: never), a backup; the first when the newest one is that old."""
        self.metrics.backup_interval.set(self.cfg.interval_s)
        newest = await trio.to_thread.run_sync(self._newest_created_at)
        if newest is not None:
            self.metrics.backup_last_success.set(newest)
        task_status.started()
        if not self.cfg.interval_s or self.key is None or self.store.backend != "sqlite":
            if self.cfg.interval_s and self.store.backend != "sqlite":
                log.warning("backup.interval_s is set but the store is PostgreSQL: back it up with its own tools")
            elif self.cfg.interval_s:
                log.warning("backup.interval_s is set but no backup key is configured: no scheduled backups")
            await trio.sleep_forever()
        due = (newest or 0.0) + self.cfg.interval_s
        while True:
            await trio.sleep(max(0.0, due - time.time()))
            try:
                await self.create(SYSTEM)
            except (NexaError, OSError) as exc:
                await self._failed(exc)
            due = time.time() + self.cfg.interval_s

    async def _failed(self, exc: NexaError | OSError) -> None:
        """A scheduled backup failed: counted, logged and audited (`backup.failed`, its error code)."""
        self.metrics.backup_failures.inc()
        failure = failure_of(exc)
        log.warning("scheduled backup failed", extra={"fields": {"code": failure.code, "error": failure.message}})
        try:
            await self.accounts.record(
                SYSTEM, "backup.failed", str(self.directory), detail=codec.dumps(codec.api, failure)
            )
        except NexaError as audit_exc:  # the store itself failing is its own alert
            log.warning("backup.failed not audited", extra={"fields": {"error": audit_exc.message}})

    def _newest_created_at(self) -> float | None:
        for name in reversed(self._names()):
            try:
                return self.view(name).created_at
            except (BackupDamaged, NotFound):
                continue
        return None


def failure_of(exc: NexaError | OSError) -> BackupFailure:
    """What `backup.failed` records: the error's code and message; of an OSError, its errno's name
    and text without the path (a message never holds a secret: keys are only ever in files)."""
    if isinstance(exc, NexaError):
        return BackupFailure(code=exc.code, message=exc.message)
    name = errno.errorcode.get(exc.errno or 0, "EIO")
    return BackupFailure(code=f"os_error.{name}", message=exc.strerror or type(exc).__name__)


def _view(name: str, sealed: bytes, manifest: BackupManifest) -> BackupView:
    return BackupView(
        name=name,
        size=len(sealed),
        sha256=hashlib.sha256(sealed).hexdigest(),
        epoch=manifest.epoch,
        audit_head_seq=manifest.audit_head_seq,
        audit_head_sha256=manifest.audit_head_sha256,
        created_at=manifest.created_at,
    )


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def check_key_source(key_file: str | None) -> bytes:
    """The key `nexa restore` opens a backup with: `--key-file`, else `$NEXA_BACKUP_KEY`; ConfigError if none."""
    key = load_key(key_file or "")
    if key is None:
        raise ConfigError(f"no backup key: pass --key-file FILE or set {KEY_ENV}")
    return key
