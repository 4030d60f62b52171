"""Signed release reports made by the real programs (issue 30 point 10): a release-signing key from
`nexa keygen --signing`, a `nexa sim --steps enroll` run and a `builds/release-gate.sh --only
images-pinned` run, each `--json FILE --sign-key KEY`. Session-scoped: the sim takes about 30 s.
`one_byte_edited` changes one byte of a report inside its signed file (the JSON stays valid)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
#: `nexa sim` of one step, with its cluster's start and stop; generous for a loaded machine.
SIM_TIMEOUT_S = 300


@attrs.frozen
class SignedReports:
    key_file: Path
    #: The key's public half (base64), as `[evidence] trusted_report_keys` lists it.
    public_key: str
    #: A `SignedSimSummary` and a `SignedGateReport`, both passed and clean.
    sim_file: Path
    gate_file: Path


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def release_key(path: Path) -> str:
    """A release-signing key written to `path` by `nexa keygen --signing`; its public half."""
    return _run(sys.executable, "-m", "nexa", "keygen", "--signing", "--out", str(path)).stdout.strip()


@pytest.fixture(scope="session")
def signed_reports(tmp_path_factory: pytest.TempPathFactory) -> SignedReports:
    require_tool("docker-registry")
    base = tmp_path_factory.mktemp("release")
    key = base / "release.pem"
    public = release_key(key)
    sim, gate = base / "sim.json", base / "gate.json"
    _run(
        sys.executable,
        "-m",
        "nexa",
        "sim",
        "--steps",
        "enroll",
        "--state-dir",
        str(base / "sim"),
        "--json",
        str(sim),
        "--sign-key",
        str(key),
        timeout=SIM_TIMEOUT_S,
    )
    gate_py = str(ROOT / "builds" / "gate" / "gate.py")
    _run(sys.executable, gate_py, "--only", "images-pinned", "--json", str(gate), "--sign-key", str(key))
    return SignedReports(key_file=key, public_key=public, sim_file=sim, gate_file=gate)


def one_byte_edited(src: Path, dst: Path) -> Path:
    """`src` with one digit of its report's start time changed; its signature left as it was."""
    text = src.read_text()
    at = text.index('"started_at":') + len('"started_at":')
    while not text[at].isdigit():
        at += 1
    digit = text[at]
    dst.write_text(text[:at] + ("2" if digit == "1" else "1") + text[at + 1 :])
    assert json.loads(dst.read_text()) != json.loads(text)
    return dst
