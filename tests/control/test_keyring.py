"""The controller's key files across rotations (`control.fleet.keyring`): retired keys are kept, each
with its id, and a rotation a crash cut short is finished at the next start."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import trio
import trio.testing

from nexa import security
from nexa.contracts.domain import SYSTEM
from nexa.control.fleet import keyring


def test_a_rotation_retires_the_current_key_and_keeps_it(tmp_path: Path) -> None:
    first = keyring.load_or_create_keys(tmp_path)
    now = time.time()
    second = keyring.rotate(tmp_path, now=now, overlap_s=600.0)
    assert second.key_id != first.key_id and second.curve.public == first.curve.public  # the channel's key stays
    assert second.next_curve_public and second.next_curve_public != first.curve.public
    assert [(r.key_id, r.retired_at, r.overlap_until) for r in second.retired] == [(first.key_id, now, now + 600.0)]
    assert keyring.retired_signing_key(tmp_path, first.key_id).public == first.signing.public
    assert set(second.verifying_keys()) == {first.key_id, second.key_id}
    for name in (f"retired-{first.key_id}-signing.pem", keyring.SIGNING_FILE, f"{keyring.CURVE_NEXT_NAME}.key"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    again = keyring.load_or_create_keys(tmp_path)
    assert (again.key_id, again.retired, again.next_curve_public) == (
        second.key_id,
        second.retired,
        second.next_curve_public,
    )


def test_the_curve_switch_swaps_the_endpoints_and_keeps_the_old_key_to_refuse_with(tmp_path: Path) -> None:
    first = keyring.load_or_create_keys(tmp_path)
    rotated = keyring.rotate(tmp_path, now=time.time(), overlap_s=600.0)
    assert (rotated.slot, rotated.newest_slot, rotated.newest_curve) == (0, 1, rotated.next_curve)
    switched = keyring.switch_curve(tmp_path)
    assert switched.curve == rotated.next_curve and switched.next_curve is None and switched.slot == 1
    assert switched.retired_curve == first.curve and switched.newest_slot == 1
    assert not (tmp_path / f"{keyring.CURVE_NEXT_NAME}.key").exists()
    assert stat.S_IMODE((tmp_path / f"retired-{first.key_id}-curve.key").stat().st_mode) == 0o600
    again = keyring.load_or_create_keys(tmp_path)
    assert (again.key_id, again.curve, again.slot, again.retired_curve) == (
        switched.key_id,
        switched.curve,
        1,
        first.curve,
    )
    # The retired signing key's private half went with its overlap (issue 30 point 14); its public half stays.
    assert not (tmp_path / f"retired-{first.key_id}-signing.pem").exists()
    assert switched.verifying_keys()[first.key_id] == first.signing.public
    # The next rotation's new key goes on endpoint 0 again.
    third = keyring.rotate(tmp_path, now=time.time(), overlap_s=600.0)
    assert third.newest_slot == 0
    assert (tmp_path / f"retired-{switched.key_id}-signing.pem").exists()  # it signs the announcement meanwhile
    keyring.switch_curve(tmp_path)
    # After the second switch: no retired signing key, and only the newest retired Curve key's private half.
    assert not list(tmp_path.glob("retired-*-signing.pem"))
    assert not (tmp_path / f"retired-{first.key_id}-curve.key").exists()
    assert (tmp_path / f"retired-{switched.key_id}-curve.key").exists()


def test_a_switch_cut_short_is_finished_and_one_whose_overlap_ended_is_made_at_the_start(tmp_path: Path) -> None:
    keyring.load_or_create_keys(tmp_path)
    rotated = keyring.rotate(tmp_path, now=time.time(), overlap_s=600.0)
    assert rotated.next_curve is not None
    # The crash: keyring.json names the new key (the commit point), nothing else was done.
    record = json.loads((tmp_path / keyring.KEYRING_FILE).read_text())
    record.update(slot=1, curve_public_key=rotated.next_curve.public)
    (tmp_path / keyring.KEYRING_FILE).write_text(json.dumps(record))
    keys = keyring.load_or_create_keys(tmp_path)
    assert (keys.curve, keys.slot, keys.next_curve) == (rotated.next_curve, 1, None)

    other = tmp_path / "other"
    keyring.load_or_create_keys(other)
    old = keyring.rotate(other, now=time.time() - 10.0, overlap_s=1.0)
    assert keyring.load_or_create_keys(other).curve == old.next_curve  # switched at the start


def test_a_rotation_cut_short_is_finished_at_the_next_start(tmp_path: Path) -> None:
    first = keyring.load_or_create_keys(tmp_path)
    new = security.generate_signing_key()
    security.save_signing_key(new, tmp_path / "next-signing.pem")  # the crash: nothing else was done
    keys = keyring.load_or_create_keys(tmp_path, overlap_s=5.0)
    assert keys.signing.public == new.public and [r.key_id for r in keys.retired] == [first.key_id]
    assert not (tmp_path / "next-signing.pem").exists()


async def test_a_rotation_waits_for_a_backup_under_way(tmp_path: Path) -> None:
    """`KeyRotation` holds the backups' lock: no backup is made between the key files changing
    and its signer taking the new key."""
    keys = keyring.load_or_create_keys(tmp_path)
    lock = trio.Lock()

    async def announce(_keys: keyring.ControllerKeys, _old: security.SigningKey, _until: float) -> int:
        return 0

    rotation = keyring.KeyRotation(
        tmp_path,
        keys,
        overlap_s=60.0,
        accounts=_NoAudit(),
        announce=announce,
        lock=lock,  # type: ignore[arg-type]
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await lock.acquire()  # a backup is being made
            nursery.start_soon(rotation.rotate, SYSTEM)
            await trio.testing.wait_all_tasks_blocked()
            assert keyring.load_or_create_keys(tmp_path).key_id == keys.key_id  # nothing rotated yet
            lock.release()
    assert rotation.keys.key_id != keys.key_id == rotation.keys.previous.key_id  # type: ignore[union-attr]


class _NoAudit:
    async def record(self, *_args: object, **_kwargs: object) -> None:
        return None
