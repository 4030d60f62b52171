"""Backups (`nexa.control.operations.backup`): the sealed format, its refusals, the online copy while writes go on."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import apsw
import attrs
import pytest
import trio

from nexa import security
from nexa.config import BackupConfig
from nexa.contracts.backup import BackupManifest
from nexa.contracts.domain import SYSTEM, AuditDraft, AuditResult
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.operations import backup
from nexa.control.service import KEYS_DIR, load_or_create_keys
from nexa.control.store.recovery import RECOVERY_MARKER
from nexa.control.store.snapshot import copy_database
from nexa.errors import BackupDamaged, BackupKeyMismatch, ConfigError, RestoreTargetNotEmpty
from nexa.telemetry import Metrics

KEY = bytes(range(32))


def _draft(i: int, pad: int = 0) -> AuditDraft:
    return AuditDraft(
        actor_key_id=None,
        actor_role=None,
        action="test.write",
        target=f"t{i}",
        prior_sha256=None,
        next_sha256=None,
        result=AuditResult.OK,
        detail="x" * pad,
    )


async def _backup_of(state: Path, events: int = 3) -> tuple[bytes, BackupManifest, security.SigningKey]:
    keys = load_or_create_keys(state / KEYS_DIR)
    async with st.open_store(state) as store:
        for i in range(events):
            await store.run(st.record_audit, _draft(i))
        sealed, manifest = await backup.make(store, state, keys.signing, KEY)
    return sealed, manifest, keys.signing


def _meta(db_path: Path, key: str) -> object:
    db = apsw.Connection(str(db_path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        rows = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchall()
    finally:
        db.close()
    return rows[0][0] if rows else None


async def test_a_backup_restores_the_database_and_keys_and_marks_the_recovery(tmp_path: Path) -> None:
    sealed, manifest, signing = await _backup_of(tmp_path / "state")
    assert manifest.audit_head_seq == 3 and manifest.epoch == 1
    assert {p.name for p in manifest.parts} >= {
        "control.db",
        "keys/controller-signing.pem",
        "keys/controller-curve.key",
    }
    assert b"PRIVATE KEY" not in sealed  # the keys are inside the ciphertext only

    target = tmp_path / "restored"
    result = backup.restore(sealed, target, KEY)
    assert result.audit_events_verified == 3
    assert (target / "keys" / "controller-signing.pem").read_bytes() == (
        tmp_path / "state" / "keys" / "controller-signing.pem"
    ).read_bytes()
    assert (target / "control.db").stat().st_mode & 0o077 == 0
    marker = _meta(target / "control.db", RECOVERY_MARKER)
    assert isinstance(marker, str) and json.loads(marker)["audit_head_seq"] == 3
    # A controller opens it: same keys, same chain.
    async with st.open_store(target) as store:
        assert await store.read(st.audit_head) == (manifest.audit_head_seq, manifest.audit_head_sha256)
        assert (await store.read(st.verify_audit)).ok
    assert security.load_signing_key(target / "keys" / "controller-signing.pem").public == signing.public

    # The controller's key pinned by the operator: accepted; another one: refused.
    empty = tmp_path / "empty"
    empty.mkdir()
    backup.restore(sealed, empty, KEY, trusted=signing.public)
    with pytest.raises(BackupDamaged, match="made by controller key"):
        backup.restore(sealed, tmp_path / "other", KEY, trusted=security.generate_signing_key().public)
    assert not (tmp_path / "other").exists()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".restore-" in p.name)


async def test_every_refusal_names_its_cause_and_writes_nothing(tmp_path: Path) -> None:
    sealed, manifest, signing = await _backup_of(tmp_path / "state")
    target = tmp_path / "new"

    with pytest.raises(BackupKeyMismatch, match="sealed with backup key"):
        backup.restore(sealed, target, bytes(32))
    with pytest.raises(BackupDamaged, match="truncated"):
        backup.restore(sealed[:-1], target, KEY)
    with pytest.raises(BackupDamaged):
        backup.restore(sealed[:20], target, KEY)
    with pytest.raises(BackupDamaged, match="not a nexa backup"):
        backup.restore(b"PK\x03\x04" + sealed, target, KEY)
    _, start = backup.read_header(sealed)
    for at in (len(backup.MAGIC) + 6, start - 2, start, start + len(sealed[start:]) // 2, len(sealed) - 1):
        flipped = bytearray(sealed)
        flipped[at] ^= 0x01
        with pytest.raises((BackupDamaged, BackupKeyMismatch)):
            backup.restore(bytes(flipped), target, KEY)
    assert not target.exists() and _leftovers(tmp_path) == []

    # Sealed with the right key, but a part's digest or the manifest's signature does not hold.
    _, files = backup.open_sealed(sealed, KEY)
    bad_digest = attrs.evolve(
        manifest, parts=tuple(attrs.evolve(p, sha256="0" * 64) if p.name == "control.db" else p for p in manifest.parts)
    )
    with pytest.raises(BackupDamaged, match="does not match its size and sha256"):
        backup.restore(backup.seal(bad_digest, signing, files, KEY), target, KEY)
    impostor = security.generate_signing_key()
    with pytest.raises(BackupDamaged, match="signature does not verify"):
        backup.restore(backup.seal(manifest, impostor, files, KEY), target, KEY)
    assert not target.exists() and _leftovers(tmp_path) == []

    # A target that holds anything is refused, and left as it was.
    target.mkdir()
    (target / "control.db").write_bytes(b"precious")
    with pytest.raises(RestoreTargetNotEmpty, match="not empty"):
        backup.restore(sealed, target, KEY)
    assert [p.name for p in target.iterdir()] == ["control.db"]
    assert (target / "control.db").read_bytes() == b"precious"
    assert _leftovers(tmp_path) == []


async def test_a_broken_audit_chain_in_the_backup_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    sealed, manifest, signing = await _backup_of(state)
    restored = tmp_path / "r"
    backup.restore(sealed, restored, KEY)
    db = apsw.Connection(str(restored / "control.db"))
    db.execute("UPDATE audit SET target = 'edited' WHERE seq = 2")
    db.close()
    files = {p.name: (restored / p.name).read_bytes() for p in manifest.parts}
    forged = attrs.evolve(
        manifest,
        parts=tuple(
            attrs.evolve(p, size=len(files[p.name]), sha256=hashlib.sha256(files[p.name]).hexdigest())
            for p in manifest.parts
        ),
    )
    with pytest.raises(BackupDamaged, match="audit chain is broken at event seq 2"):
        backup.restore(backup.seal(forged, signing, files, KEY), tmp_path / "t", KEY)
    assert not (tmp_path / "t").exists() and _leftovers(tmp_path) == []


def test_backup_keys_are_base64_or_hex_and_come_from_a_private_file_or_the_environment(tmp_path: Path) -> None:
    key = security.new_backup_key()
    raw = base64.b64decode(key)
    assert len(raw) == 32
    assert security.parse_backup_key(raw.hex(), source="x") == raw
    with pytest.raises(ConfigError, match="nexa keygen --backup"):
        security.parse_backup_key("c2hvcnQ=", source="x")
    assert backup.load_key("", env={"NEXA_BACKUP_KEY": key}) == raw
    assert backup.load_key("", env={}) is None
    path = tmp_path / "backup.key"
    path.write_text(key)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        backup.load_key(str(path))
    path.chmod(0o600)
    assert backup.load_key(str(path)) == raw
    assert security.backup_key_id(raw) not in key


async def test_writes_go_on_while_the_copy_steps_and_the_copy_is_consistent(tmp_path: Path) -> None:
    """The copy takes many steps; a writer commits between them (the store lane is fair), and the
    copy holds a consistent database whose chain verifies."""
    state = tmp_path / "state"
    async with st.open_store(state) as store:
        for i in range(0, 2000, 100):
            await store.run(_many, i, 100)
        copied = tmp_path / "copy.db"
        writes_during = 0
        done = trio.Event()

        async def writer() -> None:
            nonlocal writes_during
            i = 10_000
            while not done.is_set():
                await store.run(st.record_audit, _draft(i))
                writes_during += 1
                i += 1

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                info = await copy_database(store, copied, pages_per_step=4)
                done.set()
        assert info.steps > 50
        assert writes_during > 0
        live_head = await store.read(st.audit_head)
    copy = apsw.Connection(str(copied))
    try:
        verdict = st.verify_audit(copy)
        head = st.audit_head(copy)
    finally:
        copy.close()
    assert verdict.ok, verdict
    assert head == (info.audit_head_seq, info.audit_head_sha256)
    # The copy has every write committed before its last step: at least the 2000 made before it.
    assert 2000 < info.audit_head_seq <= live_head[0]


def _many(db: apsw.Connection, start: int, n: int) -> None:
    with db:
        for i in range(start, start + n):
            st.append_audit(db, _draft(i, pad=2000))


def test_a_failure_is_recorded_as_its_code_and_message_never_a_path() -> None:
    failure = backup.failure_of(NotADirectoryError(20, "Not a directory", "/srv/keys/backup.key"))
    assert (failure.code, failure.message) == ("os_error.ENOTDIR", "Not a directory")
    failure = backup.failure_of(OSError("no errno"))
    assert failure.code == "os_error.EIO" and failure.message == "OSError"
    failure = backup.failure_of(BackupDamaged("the database is larger than one backup file holds"))
    assert (failure.code, failure.message) == ("backup_damaged", "the database is larger than one backup file holds")


async def test_the_listing_pages_past_an_unreadable_file_and_create_prunes_to_keep(tmp_path: Path) -> None:
    state = tmp_path / "state"
    keys = load_or_create_keys(state / KEYS_DIR)
    async with st.open_store(state) as store:
        metrics = Metrics()
        backups = backup.Backups(
            cfg=BackupConfig(keep=3),
            state_dir=state,
            store=store,
            accounts=Accounts(store, metrics, [], []),
            metrics=metrics,
            signing_key=keys.signing,
            key=KEY,
        )
        made = [(await backups.create(SYSTEM)).name for _ in range(4)]
        assert [v.name for v in backups.list_page(None, 10)[0]] == made[1:]  # keep = 3
        # A file named like a backup that is none: skipped, and the page still fills.
        bogus = backup.backup_name(0.0, 1)
        (backups.directory / bogus).write_bytes(b"not a backup")
        page, last = backups.list_page(None, 2)
        assert [v.name for v in page] == made[1:3] and last == (made[2],)
        page, last = backups.list_page(last, 2)
        assert [v.name for v in page] == made[3:] and last is None
