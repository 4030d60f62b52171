"""The node's on-disk identity and fence: key files, enrollment.json, fence.json (sync, real files)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nexa import security
from nexa.channel import links
from nexa.contracts import wire
from nexa.contracts.api import EnrollResponse
from nexa.errors import ConfigError
from nexa.node import identity
from nexa.node.identity import (
    NOT_ENROLLED,
    Fence,
    create_keys,
    enroll_request,
    load_fence,
    load_identity,
    save_enrollment,
    save_fence,
)
from tests.conftest import sample_runtime

CONTROLLER_KEY = security.generate_signing_key()
CONTROLLER_CURVE = links.generate_curve_keypair()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def response(node_id: str = "n-7f3a", **overrides: str) -> EnrollResponse:
    fields = {
        "controller_signing_public_key": CONTROLLER_KEY.public.b64,
        "controller_curve_public_key": CONTROLLER_CURVE.public,
        "channel_endpoint": "tcp://127.0.0.1:8471",
        **overrides,
    }
    return EnrollResponse(node_id=node_id, labels={"rack": "r07"}, **fields)


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


# --- keys and enrollment ------------------------------------------------------------------------


def test_create_keys_writes_private_files_0600(tmp_path: Path) -> None:
    state = tmp_path / "state"
    signing_key, curve = create_keys(state)
    assert mode(state) == 0o700
    assert mode(state / "node.key") == 0o600
    assert mode(state / "curve.key") == 0o600
    assert mode(state / "curve.pub") == 0o644
    assert security.load_signing_key(state / "node.key").public == signing_key.public
    assert links.load_curve_keypair(state) == curve
    assert leftovers(state) == []


def test_enroll_request_creates_keys_once_and_reuses_them(tmp_path: Path) -> None:
    first = enroll_request(tmp_path, "nxb_token", "spark-1", "0.1.0")
    assert (first.token, first.hostname, first.agent_version) == ("nxb_token", "spark-1", "0.1.0")
    assert (
        security.PublicKey.from_b64(first.signing_public_key) == security.load_signing_key(tmp_path / "node.key").public
    )
    assert first.curve_public_key == links.load_curve_keypair(tmp_path).public
    # The answer was lost, say: a retry with a new token offers the same keys.
    again = enroll_request(tmp_path, "nxb_other", "spark-1", "0.1.0")
    assert (again.signing_public_key, again.curve_public_key) == (first.signing_public_key, first.curve_public_key)
    # Nothing private travels in the request.
    assert "PRIVATE" not in repr(first)
    assert links.load_curve_keypair(tmp_path).secret not in repr(first)


def test_save_enrollment_and_load_identity(tmp_path: Path) -> None:
    req = enroll_request(tmp_path, "nxb_token", "spark-1", "0.1.0")
    save_enrollment(tmp_path, response())
    assert mode(tmp_path / "enrollment.json") == 0o600
    assert leftovers(tmp_path) == []

    ident = load_identity(tmp_path)
    assert ident.node_id == "n-7f3a"
    assert ident.signing_key.public.b64 == req.signing_public_key
    assert ident.curve.public == req.curve_public_key
    assert ident.controller_signing_public == CONTROLLER_KEY.public
    assert ident.controller_curve_public == CONTROLLER_CURVE.public
    assert ident.channel_endpoint == "tcp://127.0.0.1:8471"
    assert identity.load_enrollment(tmp_path).labels == {"rack": "r07"}
    # Secrets stay out of reprs (logs, tracebacks).
    assert ident.curve.secret not in repr(ident)


def test_an_enrolled_identity_is_never_overwritten(tmp_path: Path) -> None:
    enroll_request(tmp_path, "nxb_token", "spark-1", "0.1.0")
    save_enrollment(tmp_path, response())
    before = {name: (tmp_path / name).read_bytes() for name in ("node.key", "curve.key", "curve.pub")}
    with pytest.raises(ConfigError, match="already enrolled"):
        create_keys(tmp_path)
    with pytest.raises(ConfigError, match="already enrolled"):
        enroll_request(tmp_path, "nxb_token", "spark-1", "0.1.0")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_not_enrolled_says_how_to_enroll(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_identity(tmp_path)
    assert info.value.message == "this node is not enrolled: run `nexa node enroll --controller URL --token TOKEN`"
    assert info.value.message == NOT_ENROLLED
    create_keys(tmp_path)  # keys alone are not an enrollment
    with pytest.raises(ConfigError, match="not enrolled"):
        load_identity(tmp_path)


@pytest.mark.parametrize(
    "bad",
    [{"controller_signing_public_key": "not base64!"}, {"controller_curve_public_key": "short"}],
    ids=["signing", "curve"],
)
def test_an_unusable_enrollment_answer_is_refused_and_not_stored(tmp_path: Path, bad: dict[str, str]) -> None:
    create_keys(tmp_path)
    with pytest.raises(ConfigError, match="unusable"):
        save_enrollment(tmp_path, response(**bad))
    assert not (tmp_path / "enrollment.json").exists()


def test_a_damaged_enrollment_file_is_a_config_error(tmp_path: Path) -> None:
    create_keys(tmp_path)
    (tmp_path / "enrollment.json").write_text('{"node_id": "n1"}')
    with pytest.raises(ConfigError, match="damaged"):
        load_identity(tmp_path)


def test_a_readable_private_key_is_refused(tmp_path: Path) -> None:
    enroll_request(tmp_path, "nxb_token", "spark-1", "0.1.0")
    save_enrollment(tmp_path, response())
    (tmp_path / "node.key").chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_identity(tmp_path)


# --- the fence ----------------------------------------------------------------------------------


def fence(epoch: int = 2, generation: int = 5) -> Fence:
    return Fence(
        epoch=epoch,
        generation=generation,
        lease_expires_at=1_700_000_060.5,
        assignments=[wire.Assignment(id="a1", deployment="d1", runtime=sample_runtime())],
    )


def test_no_fence_file_means_nothing_accepted(tmp_path: Path) -> None:
    got = load_fence(tmp_path)
    assert got == Fence()
    assert not got.accepted_any


def test_fence_round_trips_with_mode_0600(tmp_path: Path) -> None:
    save_fence(tmp_path, fence())
    assert mode(tmp_path / "fence.json") == 0o600
    assert load_fence(tmp_path) == fence()
    assert load_fence(tmp_path).accepted_any
    save_fence(tmp_path, fence(3, 1))
    assert load_fence(tmp_path) == fence(3, 1)
    assert leftovers(tmp_path) == []


def test_a_damaged_fence_is_an_error_not_a_reset(tmp_path: Path) -> None:
    (tmp_path / "fence.json").write_text('{"epoch": 2, "generation": "five"}')
    with pytest.raises(ConfigError, match="damaged"):
        load_fence(tmp_path)


def test_fence_writes_are_fsynced_and_renamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_fence(tmp_path, fence())
    # The data reaches the disk before the rename, and the rename before the function returns.
    assert synced == ["file", "dir"]


def test_a_failed_write_keeps_the_previous_fence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_fence(tmp_path, fence(2, 5))

    def fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(ConfigError, match="No space left"):
        save_fence(tmp_path, fence(2, 6))
    monkeypatch.undo()
    assert load_fence(tmp_path) == fence(2, 5)  # never a half-written file
    assert leftovers(tmp_path) == []
