"""A node key rotation on disk (`keys.next`): made whole or not at all, promoted only once the
controller confirmed, and a crash at any step leaves keys the controller still admits."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nexa import security
from nexa.channel import links
from nexa.contracts.api import EnrollResponse
from nexa.errors import ConfigError
from nexa.node import identity


def _enrolled(tmp_path: Path) -> tuple[Path, security.SigningKey, links.CurveKeyPair]:
    state = tmp_path / "state"
    signing_key, curve = identity.create_keys(state)
    answer = EnrollResponse(
        node_id="n-1",
        controller_signing_public_key=security.generate_signing_key().public.b64,
        controller_curve_public_key=links.generate_curve_keypair().public,
        channel_endpoint="tcp://127.0.0.1:8471",
        labels={},
    )
    identity.save_enrollment(state, answer)
    return state, signing_key, curve


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_keys_wait_in_keys_next_and_the_node_keeps_its_own(tmp_path: Path) -> None:
    state, signing_key, curve = _enrolled(tmp_path)
    pending = identity.prepare_rotation(state)
    directory = state / identity.NEXT_KEYS_DIR
    assert _mode(directory) == 0o700
    assert _mode(directory / "node.key") == 0o600 and _mode(directory / "curve.key") == 0o600
    assert pending.signing_key.public != signing_key.public and pending.curve.public != curve.public
    assert "secret" not in repr(pending.curve) and "PRIVATE" not in repr(pending)
    # Asked again (the CLI twice, or the controller asking while one waits): the same keys.
    again = identity.prepare_rotation(state)
    assert again.signing_key.public == pending.signing_key.public and again.curve == pending.curve
    # Not confirmed yet: the node starts with its own keys and sends the pending ones again.
    resumed = identity.resume_rotation(state)
    assert resumed is not None and resumed.curve == pending.curve
    loaded = identity.load_identity(state)
    assert loaded.signing_key.public == signing_key.public and loaded.curve == curve
    assert not [p for p in state.iterdir() if p.name.endswith(".tmp")]


def test_promotion_cut_short_by_a_crash_is_finished_at_start(tmp_path: Path) -> None:
    state, _, _ = _enrolled(tmp_path)
    pending = identity.prepare_rotation(state)
    # The crash: the Curve key was replaced (so the controller had confirmed), the signing key not.
    links.save_curve_keypair(pending.curve, state, name=identity.CURVE_KEY_NAME, overwrite=True)
    assert identity.resume_rotation(state) is None
    loaded = identity.load_identity(state)
    assert loaded.signing_key.public == pending.signing_key.public and loaded.curve == pending.curve
    assert not (state / identity.NEXT_KEYS_DIR).exists()
    assert _mode(state / "node.key") == 0o600


def test_refused_keys_are_discarded_and_a_node_not_enrolled_has_none_to_rotate(tmp_path: Path) -> None:
    state, signing_key, _ = _enrolled(tmp_path)
    identity.prepare_rotation(state)
    identity.discard_pending_keys(state)
    assert identity.load_pending_keys(state) is None
    assert identity.load_identity(state).signing_key.public == signing_key.public
    with pytest.raises(ConfigError, match="not enrolled"):
        identity.prepare_rotation(tmp_path / "fresh")
    assert not (tmp_path / "fresh" / identity.NEXT_KEYS_DIR).exists()


def test_rotate_keys_cli_without_a_running_agent_leaves_the_keys_pending(tmp_path: Path) -> None:
    state, signing_key, _ = _enrolled(tmp_path)
    argv = [sys.executable, "-m", "nexa", "node", "rotate-keys", "--state-dir", str(state), "--wait", "0.5"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "is `nexa node` running" in done.stderr
    assert "PRIVATE" not in done.stdout + done.stderr
    assert identity.load_pending_keys(state) is not None
    assert identity.load_identity(state).signing_key.public == signing_key.public
