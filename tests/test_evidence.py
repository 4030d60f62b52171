"""`nexa evidence --out DIR` against a real controller process, and `nexa evidence verify DIR`
offline: the bundle verifies; a changed byte of any file or of the manifest, an extra or a missing
file fails it, named; release_ready is false with its reasons when the sim failed. A real sim run
and gate report signed by the key the controller trusts are verified; a bare one, or one edited by
a byte, is signed as asserted; `verify` shows each part's provenance and reads a manifest without
it as asserted (issue 30 point 10)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from nexa import security
from nexa.contracts import codec
from nexa.contracts.evidence import (
    Benchmarks,
    BenchRun,
    BenchRunCreate,
    BenchVerdict,
    DeploymentObjectives,
    EvidenceManifest,
    EvidenceSigned,
    GateCheck,
    GateReport,
    ServiceObjectives,
    SimStep,
    SimSummary,
    StepVerdict,
)
from tests.conftest import ControllerProcess, running_controller
from tests.support.bench import bench_run
from tests.support.evidence import SignedReports, one_byte_edited, signed_reports

__all__ = ["signed_reports"]  # the session fixture, used here

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- provenance: what the controller saw (issue 30 point 10) ------------------------------------


@pytest.fixture
def trusting(tmp_path: Path, signed_reports: SignedReports) -> Iterator[ControllerProcess]:
    """`nexa control` that trusts the release key of `signed_reports` (`[evidence] trusted_report_keys`)."""
    with running_controller(tmp_path, f'[evidence]\ntrusted_report_keys = ["{signed_reports.public_key}"]\n') as cp:
        yield cp


def evidence(cp: ControllerProcess, out: Path, sim: Path, gate: Path) -> subprocess.CompletedProcess[str]:
    return cp.cli("evidence", "--out", str(out), "--sim", str(sim), "--gate", str(gate), token=operator_key(cp))


@pytest.mark.slow  # signed_reports: a `nexa sim` run, about 25 s
def test_signed_reports_are_verified_and_verify_shows_each_parts_provenance(
    trusting: ControllerProcess, signed_reports: SignedReports, tmp_path: Path
) -> None:
    out = tmp_path / "bundle"
    done = evidence(trusting, out, signed_reports.sim_file, signed_reports.gate_file)
    assert done.returncode == 0, done.stderr
    release = security.PublicKey.from_b64(signed_reports.public_key).fingerprint
    assert f"sim: verified (signed by key {release})" in done.stdout
    assert f"gate: verified (signed by key {release})" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    # Only the benchmarks are missing (this controller has no deployment): sim and gate count.
    assert manifest["checks"]["reasons"] == [
        "no benchmark recorded: run nexa bench concurrency --deployment NAME against each deployment"
    ]
    assert manifest["checks"]["sim_passed"] is True and manifest["checks"]["gate_clean"] is True
    signed_sim = json.loads(signed_reports.sim_file.read_text())
    assert manifest["provenance"]["sim"]["signature"] == signed_sim["signature"]
    assert json.loads((out / "sim-summary.json").read_text()) == signed_sim["summary"]  # the bare report
    readme = (out / "README.txt").read_text()
    assert "verified  signed by the release pipeline's key" in readme and "asserted  the client's word" in readme

    verified = offline("evidence", "verify", str(out), "--public-key", public_key(trusting))
    assert verified.returncode == 0, verified.stderr
    assert f"sim: verified (signed by key {release})" in verified.stdout
    assert f"gate: verified (signed by key {release})" in verified.stdout


@pytest.mark.slow  # signed_reports: a `nexa sim` run, about 25 s
def test_a_bare_or_edited_report_is_signed_as_asserted_never_ready(
    trusting: ControllerProcess, signed_reports: SignedReports, tmp_path: Path
) -> None:
    edited = one_byte_edited(signed_reports.sim_file, tmp_path / "edited-sim.json")
    _, bare_gate = write_inputs(tmp_path, sim_summary())  # `clean: true`, claimed, unsigned
    out = tmp_path / "bundle"
    done = evidence(trusting, out, edited, bare_gate)
    assert done.returncode == 0, done.stderr
    release = security.PublicKey.from_b64(signed_reports.public_key).fingerprint
    assert "release_ready: false" in done.stdout
    assert f"  - asserted, not verified: the sim report's signature by key {release} does not verify" in done.stdout
    assert "  - asserted, not verified: the gate report is not signed" in done.stdout
    assert f"sim: asserted (signed by key {release})" in done.stdout and "gate: asserted\n" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    assert manifest["release_ready"] is False
    assert manifest["checks"]["sim_passed"] is True and manifest["checks"]["gate_clean"] is True  # as claimed
    assert {p: manifest["provenance"][p]["provenance"] for p in ("sim", "gate")} == {
        "sim": "asserted",
        "gate": "asserted",
    }

    verified = offline("evidence", "verify", str(out), "--public-key", public_key(trusting))
    assert verified.returncode == 0, verified.stderr  # consistent: signed as asserted
    assert "release_ready: false" in verified.stdout and "sim: asserted" in verified.stdout


@pytest.mark.slow  # signed_reports: a `nexa sim` run, about 25 s
def test_a_malformed_signature_or_oversize_report_is_refused_and_writes_nothing(
    trusting: ControllerProcess, signed_reports: SignedReports, tmp_path: Path
) -> None:
    forged = json.loads(signed_reports.sim_file.read_text())
    forged["signature"]["signature"] = "AAAA"
    forged_file = tmp_path / "forged.json"
    forged_file.write_text(json.dumps(forged))
    out = tmp_path / "bundle"
    done = evidence(trusting, out, forged_file, signed_reports.gate_file)
    assert done.returncode == 1
    assert "sim_signature: an Ed25519 signature is 64 bytes, got 3" in done.stderr
    assert not out.exists()

    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"padding": "x" * 2**20}))
    done = evidence(trusting, out, huge, signed_reports.gate_file)
    assert done.returncode == 2 and f"--sim {huge}: over" in done.stderr
    assert not out.exists()
    signs = trusting.cli("audit", "list", "--action", "evidence.sign", "--json", check=True)
    assert json.loads(signs.stdout)["events"] == []


def _resigned(src: Path, dst: Path, key: security.SigningKey, edit: Any, **files: bytes) -> Path:
    """A copy of bundle `src` with `files` replaced, listed again, and the manifest `edit`ed and
    signed by `key` (a forger's, or a controller's before provenance existed)."""
    shutil.copytree(src, dst)
    signed = codec.loads(codec.api, (src / "manifest.json").read_text(), EvidenceSigned)
    listed = []
    for f in signed.manifest.files:
        data = files.get(f.path.replace(".", "_").replace("-", "_"))
        if data is not None:
            (dst / f.path).write_bytes(data)
        listed.append(f if data is None else attrs.evolve(f, size=len(data), sha256=hashlib.sha256(data).hexdigest()))
    manifest: EvidenceManifest = edit(attrs.evolve(signed.manifest, files=listed))
    (dst / "manifest.json").write_text(codec.dumps(codec.api, security.sign_evidence(key, manifest)))
    return dst


@pytest.mark.slow  # signed_reports: a `nexa sim` run, about 25 s
def test_verify_checks_a_verified_parts_signature_against_the_bundles_file(
    trusting: ControllerProcess, signed_reports: SignedReports, tmp_path: Path
) -> None:
    """A forger re-signs a bundle whose sim summary they edited, keeping the release key's
    signature in the provenance: without --public-key the manifest holds, the sim's signature does not."""
    out = tmp_path / "bundle"
    assert evidence(trusting, out, signed_reports.sim_file, signed_reports.gate_file).returncode == 0
    edited = json.loads(one_byte_edited(signed_reports.sim_file, tmp_path / "edited.json").read_text())["summary"]
    forger = security.generate_signing_key()
    forged = _resigned(out, tmp_path / "forged", forger, lambda m: m, sim_summary_json=json.dumps(edited).encode())
    done = offline("evidence", "verify", str(forged))
    assert done.returncode == 1
    assert "FAIL provenance: sim-summary.json: the signature in the manifest does not verify over the file" in (
        done.stderr
    )


@pytest.mark.slow  # signed_reports: a `nexa sim` run, about 25 s
def test_a_manifest_without_provenance_verifies_and_reads_as_asserted_never_ready(
    trusting: ControllerProcess, signed_reports: SignedReports, tmp_path: Path
) -> None:
    """A bundle signed before provenance existed, whose benchmarks met their objectives and whose
    manifest says release_ready true: it still verifies, and reads as not ready."""
    out = tmp_path / "bundle"
    assert evidence(trusting, out, signed_reports.sim_file, signed_reports.gate_file).returncode == 0
    create = codec.structure(codec.api, bench_run(), BenchRunCreate)
    run = BenchRun(
        id="b1",
        recorded_at=1.0,
        recorded_by="k",
        replicas=1,
        objectives=ServiceObjectives(),
        verdict=BenchVerdict(meets_objectives=True),
        run=create,
    )
    met = Benchmarks(
        runs=[run], deployments=[DeploymentObjectives(name="chat-a", replicas=1, objectives=ServiceObjectives())]
    )
    old_controller = security.generate_signing_key()

    def before_provenance(m: EvidenceManifest) -> EvidenceManifest:
        checks = attrs.evolve(m.checks, benchmarks_meet_objectives=True, reasons=[])
        return attrs.evolve(m, checks=checks, release_ready=True, provenance=None)

    old = _resigned(
        out,
        tmp_path / "old",
        old_controller,
        before_provenance,
        benchmarks_json=codec.dumps(codec.api, met).encode(),
    )
    assert (
        "provenance"
        not in security.evidence_body(
            codec.loads(codec.api, (old / "manifest.json").read_text(), EvidenceSigned).manifest
        ).decode()
    )
    done = offline("evidence", "verify", str(old), "--public-key", old_controller.public.b64)
    assert done.returncode == 0, done.stderr
    assert "release_ready: false: the manifest says true, but it records no provenance" in done.stdout
    assert "provenance: none recorded (signed before provenance existed): sim and gate read as asserted" in (
        done.stdout
    )


def test_keygen_signing_writes_a_private_key_and_prints_its_public_half(tmp_path: Path) -> None:
    key_file = tmp_path / "release.pem"
    done = offline("keygen", "--signing", "--out", str(key_file))
    assert done.returncode == 0, done.stderr
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert security.load_signing_key(key_file).public.b64 == done.stdout.strip()
    again = offline("keygen", "--signing", "--out", str(key_file))
    assert again.returncode != 0 and security.load_signing_key(key_file).public.b64 == done.stdout.strip()
    missing = offline("keygen", "--signing")
    assert missing.returncode == 2 and "--signing writes a private key: give --out FILE" in missing.stderr
