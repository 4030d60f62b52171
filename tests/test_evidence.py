"""`nexa evidence --out DIR` against a real controller process, and `nexa evidence verify DIR`
offline: the bundle verifies; a changed byte of any file or of the manifest, an extra or a missing
file fails it, named; release_ready is false with its reasons when the sim failed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from nexa.contracts import codec
from nexa.contracts.evidence import GateCheck, GateReport, SimStep, SimSummary, StepVerdict
from tests.conftest import ControllerProcess

BUNDLE = {
    "versions.json",
    "sim-summary.json",
    "benchmarks.json",
    "gate.json",
    "audit-head.json",
    "qualifications.json",
    "README.txt",
}


def offline(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m nexa ARGS` with no controller URL or key in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("NEXA_URL", "NEXA_TOKEN")}
    return subprocess.run([sys.executable, "-m", "nexa", *args], env=env, capture_output=True, text=True, timeout=60)


def sim_summary(*, failed: str | None = None) -> SimSummary:
    steps = [
        SimStep(name=name, verdict=StepVerdict.FAIL if name == failed else StepVerdict.PASS, duration_s=1.5)
        for name in ("enroll", "drain")
    ]
    return SimSummary(passed=failed is None, nexa_version="test", seed=7, started_at=1e9, duration_s=3.0, steps=steps)


def write_inputs(tmp_path: Path, sim: SimSummary) -> tuple[Path, Path]:
    sim_file, gate_file = tmp_path / "sim.json", tmp_path / "gate-in.json"
    sim_file.write_text(codec.dumps(codec.api, sim))
    gate = GateReport(clean=True, checks=[GateCheck(name="mypy", ok=True, detail="ok")], started_at=1e9, duration_s=1)
    gate_file.write_text(codec.dumps(codec.api, gate))
    return sim_file, gate_file


def operator_key(cp: ControllerProcess) -> str:
    out = cp.cli("keys", "create", "--role", "operator", "--json", check=True)
    return str(json.loads(out.stdout)["key"])


def public_key(cp: ControllerProcess) -> str:
    answer = httpx.get(f"{cp.url}/api/v1/receipts/public-key", headers={"Authorization": f"Bearer {cp.admin_key}"})
    return str(answer.json()["public_key"])


def make_bundle(
    cp: ControllerProcess, tmp_path: Path, sim: SimSummary
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    sim_file, gate_file = write_inputs(tmp_path, sim)
    binary = tmp_path / "nexa-binary"
    binary.write_bytes(b"\x7fELF not really a binary")
    out = tmp_path / "bundle"
    args = ("evidence", "--out", str(out), "--sim", str(sim_file), "--gate", str(gate_file), "--binary", str(binary))
    done = cp.cli(*args, token=operator_key(cp))
    assert done.returncode == 0, done.stderr
    return out, done


def test_a_bundle_is_written_signed_and_verifies_offline(controller_process: ControllerProcess, tmp_path: Path) -> None:
    cp = controller_process
    out, done = make_bundle(cp, tmp_path, sim_summary())
    assert {p.name for p in out.iterdir()} == {*BUNDLE, "manifest.json"}
    # No benchmark was recorded: not release-ready, and it says why and what to do.
    assert "release_ready: false" in done.stdout
    assert "  - no benchmark recorded: run nexa bench" in done.stdout
    assert "a named human approval are still required" in done.stdout

    versions = json.loads((out / "versions.json").read_text())
    assert versions["binary"]["path"] == "nexa-binary"  # the name only, never the directory
    assert str(tmp_path) not in (out / "versions.json").read_text()
    assert versions["binary"]["size"] == len(b"\x7fELF not really a binary")
    readme = (out / "README.txt").read_text()
    assert "NOT cover acceptance on the real fleet" in readme and "named human who approves" in readme
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    assert manifest["checks"]["sim_passed"] is True and manifest["checks"]["gate_clean"] is True
    assert manifest["real_fleet_acceptance"] == "required" and manifest["human_approval"] == "required"
    assert {f["path"] for f in manifest["files"]} == BUNDLE
    # An operator key may not read the audit head: the file says where the head is instead.
    assert json.loads((out / "audit-head.json").read_text())["checkpoint"] is None

    verified = offline("evidence", "verify", str(out))
    assert verified.returncode == 0, verified.stderr
    assert "proves the bundle is intact, not who signed it" in verified.stdout
    assert f"controller fingerprint {manifest['controller_fingerprint']}" in verified.stdout
    key_file = tmp_path / "controller.pub"
    key_file.write_text(public_key(cp) + "\n")
    trusted = offline("evidence", "verify", str(out), "--public-key", str(key_file))
    assert trusted.returncode == 0, trusted.stderr
    assert "not who signed it" not in trusted.stdout
    assert trusted.stdout.strip().endswith("ok (signature, every file's size and sha256, no extra file, release rule)")

    # An admin key reads the audit head: its signed checkpoint goes into the bundle and is checked.
    sim_file, gate_file = write_inputs(tmp_path, sim_summary())
    admin_out = tmp_path / "admin-bundle"
    admin_out.mkdir()  # an empty directory is fine
    done = cp.cli("evidence", "--out", str(admin_out), "--sim", str(sim_file), "--gate", str(gate_file))
    assert done.returncode == 0, done.stderr
    assert json.loads((admin_out / "audit-head.json").read_text())["checkpoint"]["checkpoint"]["seq"] >= 1
    assert json.loads((admin_out / "versions.json").read_text())["binary"] is None  # not frozen, no --binary
    assert offline("evidence", "verify", str(admin_out), "--public-key", public_key(cp)).returncode == 0


def _tampered(src: Path, dst: Path, name: str) -> Path:
    shutil.copytree(src, dst)
    path = dst / name
    data = bytearray(path.read_bytes())
    at = data.index(b":") + 2  # inside the first value (the manifest stays JSON more often than not)
    data[at] = ord("x") if data[at] != ord("x") else ord("y")
    path.write_bytes(bytes(data))
    return dst


def test_any_changed_byte_extra_or_missing_file_fails_verify(
    controller_process: ControllerProcess, tmp_path: Path
) -> None:
    cp = controller_process
    out, _ = make_bundle(cp, tmp_path, sim_summary())
    key = public_key(cp)
    for name in sorted({*BUNDLE, "manifest.json"}):
        copy = _tampered(out, tmp_path / f"t-{name}", name)
        done = offline("evidence", "verify", str(copy), "--public-key", key)
        assert done.returncode == 1, name
        assert f"FAIL {name}" in done.stderr, (name, done.stderr)

    extra = shutil.copytree(out, tmp_path / "extra")
    (extra / "notes.txt").write_text("added later")
    done = offline("evidence", "verify", str(extra))
    assert done.returncode == 1 and "FAIL notes.txt: not in the manifest (an extra file)" in done.stderr

    missing = shutil.copytree(out, tmp_path / "missing")
    (missing / "gate.json").unlink()
    done = offline("evidence", "verify", str(missing))
    assert done.returncode == 1
    assert "FAIL gate.json: missing (the manifest lists it)" in done.stderr
    assert "release rule: gate_clean is false from the files, the manifest says true" in done.stderr

    # Re-signed by another key: intact, but not the trusted controller's.
    done = offline("evidence", "verify", str(out), "--public-key", "A" * 43 + "=")
    assert done.returncode == 1 and "FAIL manifest.json: signed by key" in done.stderr


def test_release_ready_is_false_with_reasons_when_the_sim_failed(
    controller_process: ControllerProcess, tmp_path: Path
) -> None:
    cp = controller_process
    out, done = make_bundle(cp, tmp_path, sim_summary(failed="drain"))
    assert "release_ready: false" in done.stdout
    assert "  - nexa sim did not pass: drain failed" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    assert manifest["release_ready"] is False and manifest["checks"]["sim_passed"] is False
    verified = offline("evidence", "verify", str(out))
    assert verified.returncode == 0, verified.stderr  # consistent: the files say the same
    assert "release_ready: false" in verified.stdout and "nexa sim did not pass" in verified.stdout


def test_bad_input_is_refused_and_writes_nothing(controller_process: ControllerProcess, tmp_path: Path) -> None:
    cp = controller_process
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "old.txt").write_text("x")
    done = cp.cli("evidence", "--out", str(busy))
    assert done.returncode == 1 and "is not an empty directory: name a new or empty one" in done.stderr
    assert {p.name for p in busy.iterdir()} == {"old.txt"}

    bad_sim = tmp_path / "bad-sim.json"
    bad_sim.write_text('{"passed": "yes"}')
    done = cp.cli("evidence", "--out", str(tmp_path / "new"), "--sim", str(bad_sim))
    assert done.returncode == 2 and f"--sim {bad_sim}: not a SimSummary" in done.stderr
    assert not (tmp_path / "new").exists()

    assert cp.cli("evidence").returncode == 2
    done = offline("evidence", "verify", str(tmp_path / "nowhere"))
    assert done.returncode == 1 and "no such directory" in done.stderr


@pytest.mark.parametrize("body", ["{}", "not json"])
def test_verify_names_a_manifest_it_cannot_read(tmp_path: Path, body: str) -> None:
    (tmp_path / "manifest.json").write_text(body)
    done = offline("evidence", "verify", str(tmp_path))
    assert done.returncode == 1
    assert "FAIL manifest.json: not a signed evidence manifest" in done.stderr


def test_out_is_never_written_through_a_symlink(controller_process: ControllerProcess, tmp_path: Path) -> None:
    """Issue 30 point 14: `--out` that is a symlink is refused; a symlink planted inside it after the
    checks makes the write fail (the directory is written by its handle, each file created, never followed)."""
    from nexa.cli.evidence import _BundleDir
    from nexa.errors import Conflict

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty)
    done = controller_process.cli("evidence", "--out", str(tmp_path / "link"))
    assert done.returncode == 1 and "is not an empty directory" in done.stderr
    assert list(empty.iterdir()) == []

    out = tmp_path / "bundle"
    bundle = _BundleDir(out)
    try:
        (out / "versions.json").symlink_to(victim)  # planted between the checks and the write
        with pytest.raises(Conflict, match="something else put it there"):
            bundle.write("versions.json", b"{}")
        bundle.write("gate.json", b"{}")
    finally:
        bundle.close()
    assert victim.read_text() == "keep me" and (out / "gate.json").read_bytes() == b"{}"


def test_verify_reads_no_more_than_the_manifest_says(controller_process: ControllerProcess, tmp_path: Path) -> None:
    """A file grown to 8 GiB (sparse) is named, not read; a symlinked file counts as missing; a
    manifest over 4 MiB is refused unread."""
    out, _ = make_bundle(controller_process, tmp_path, sim_summary())
    grown = shutil.copytree(out, tmp_path / "grown")
    with (grown / "gate.json").open("r+b") as f:
        f.truncate(8 * 2**30)
    done = offline("evidence", "verify", str(grown))
    assert done.returncode == 1 and "FAIL gate.json: over the manifest's" in done.stderr
    linked = shutil.copytree(out, tmp_path / "linked")
    (linked / "gate.json").unlink()
    (linked / "gate.json").symlink_to(out / "gate.json")
    done = offline("evidence", "verify", str(linked))
    assert done.returncode == 1 and "FAIL gate.json: missing" in done.stderr
    huge = tmp_path / "huge"
    huge.mkdir()
    with (huge / "manifest.json").open("wb") as f:
        f.truncate(64 * 2**20)
    done = offline("evidence", "verify", str(huge))
    assert done.returncode == 1 and "FAIL manifest.json: missing or unreadable" in done.stderr
