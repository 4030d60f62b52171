"""Release evidence (`POST /api/v1/evidence`, `security.verify_signed`): the controller fills in its
facts, decides `release_ready` with its reasons, and signs; the signature verifies offline with
the controller's key and fails when anything in the manifest changes. `release_ready` is true only
over a real sim run and gate report signed by a key the controller trusts; a bare claim, a report
edited after signing or signed by another key is signed as asserted (issue 30 point 10)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa import security
from nexa.config import EvidenceConfig, PublicKeyB64, Seconds
from nexa.contracts import codec
from nexa.contracts.evidence import EvidenceManifest, EvidenceSigned, GateReport, Origin, ReleaseChecks
from tests.conftest import Controller, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, make_key, ok
from tests.support.bench import bench_run
from tests.support.deployments import body, registry_ready
from tests.support.evidence import SignedReports, one_byte_edited, signed_reports
from tests.support.models import audit_events, registry_config
from tests.support.rollout import fleet_of

__all__ = ["signed_reports"]  # the session fixture, used here

Json = dict[str, Any]

SIM_PASSED: Json = {
    "passed": True,
    "nexa_version": "0",
    "seed": 7,
    "started_at": 1_700_000_000.0,
    "duration_s": 90.0,
    "steps": [{"name": "enrollment", "verdict": "pass", "duration_s": 3.0}],
}
GATE_CLEAN: Json = {"clean": True, "checks": [{"name": "sbom", "ok": True}], "started_at": 1.0, "duration_s": 2.0}
FILES: list[Json] = [{"path": "sim/summary.json", "sha256": "a" * 64, "size": 10}]


@pytest.fixture
async def ev_reg(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, signed_reports: SignedReports
) -> AsyncIterator[Controller]:
    """`ev_reg`, trusting the release key that signed `signed_reports`."""
    cfg = registry_config(tmp_path, s3_store)
    cfg = attrs.evolve(
        cfg,
        nodes=attrs.evolve(cfg.nodes, replace_after_s=Seconds(1.0)),
        evidence=EvidenceConfig(trusted_report_keys=(PublicKeyB64(signed_reports.public_key),)),
    )
    started = await start_controller(nursery, cfg)
    yield started
    started.stopping.set()


async def _signs(controller: Controller) -> list[Json]:
    async with controller.client() as admin:
        return [e for e in await audit_events(admin) if e["action"] == "evidence.sign"]


def _signed(path: Path, report: str) -> tuple[Json, Json]:
    signed = json.loads(path.read_text())
    return signed[report], signed["signature"]


def _tampered(signed: EvidenceSigned) -> list[EvidenceSigned]:
    m = signed.manifest
    edits = [
        attrs.evolve(m, release_ready=not m.release_ready),
        attrs.evolve(m, created_at=m.created_at + 1),
        attrs.evolve(m, audit_head_seq=m.audit_head_seq + 1),
        attrs.evolve(m, files=[attrs.evolve(m.files[0], sha256="b" * 64)]),
        attrs.evolve(m, checks=attrs.evolve(m.checks, reasons=["edited"])),
        attrs.evolve(m, statement=m.statement + "."),
        attrs.evolve(m, provenance=None),
    ]
    if m.provenance is not None:
        asserted = attrs.evolve(m.provenance.sim, provenance=Origin.ASSERTED)
        edits.append(attrs.evolve(m, provenance=attrs.evolve(m.provenance, sim=asserted)))
    return [attrs.evolve(signed, manifest=e) for e in edits]


@pytest.mark.slow  # signed_reports: a `nexa sim` run, about 25 s
async def test_evidence_is_signed_verifies_and_says_why_it_is_not_release_ready(
    ev_reg: Controller,
    dial: Any,
    nursery: trio.Nursery,
    s3_store: S3Store,
    test_images: BuiltImages,
    signed_reports: SignedReports,
    tmp_path: Path,
) -> None:
    await fleet_of(ev_reg, dial, nursery, "n1")
    operator = await make_key(ev_reg, "operator")
    async with ev_reg.client() as admin:
        await registry_ready(admin, s3_store, test_images)
        await ok(admin.post("/api/v1/deployments", json=body()), 201)
        trusted = (await ok(admin.get("/api/v1/receipts/public-key")))["public_key"]
        version = await ok(admin.get("/version"))
    async with ev_reg.client(operator) as http:
        # Nothing given, no run recorded: not ready, and each reason says what to do.
        bare = await ok(http.post("/api/v1/evidence", json={}), 201)
        checks = bare["manifest"]["checks"]
        assert bare["manifest"]["release_ready"] is False
        assert (checks["sim_passed"], checks["benchmarks_meet_objectives"], checks["gate_clean"]) == (False,) * 3
        assert any(r.startswith("no benchmark recorded: run nexa bench") for r in checks["reasons"])
        assert any("nexa sim --json" in r for r in checks["reasons"]) and any(
            "release-gate" in r for r in checks["reasons"]
        )
        assert (
            bare["manifest"]["real_fleet_acceptance"] == "required" and bare["manifest"]["human_approval"] == "required"
        )

        # A run that breaks its objectives, a failed sim step and an unclean gate: three reasons.
        await ok(http.post("/api/v1/deployments/chat-a/objectives", json={"ttft_p95_ms": 100}))
        await ok(http.post("/api/v1/benchmarks", json=bench_run()), 201)
        failing_sim = {**SIM_PASSED, "passed": False, "steps": [{"name": "drain", "verdict": "fail", "duration_s": 1}]}
        dirty_gate = {**GATE_CLEAN, "clean": False, "checks": [{"name": "secrets", "ok": False}]}
        bad = await ok(
            http.post("/api/v1/evidence", json={"sim": failing_sim, "gate": dirty_gate, "files": FILES}), 201
        )
        reasons = bad["manifest"]["checks"]["reasons"]
        assert bad["manifest"]["release_ready"] is False and len(reasons) == 5
        assert "c=2: ttft p95 120 ms > 100 ms" in reasons[0]
        assert reasons[1] == "nexa sim did not pass: drain failed"
        assert reasons[2] == "the release gate is not clean: secrets failed"
        assert reasons[3].startswith("asserted, not verified: the sim report is not signed: write it with nexa sim")
        assert reasons[4].startswith("asserted, not verified: the gate report is not signed")

        # Objectives met, and a real sim run and gate report signed by the trusted release key: ready.
        await ok(http.post("/api/v1/deployments/chat-a/objectives", json={"ttft_p95_ms": 1000}))
        sim, sim_signature = _signed(signed_reports.sim_file, "summary")
        gate, gate_signature = _signed(signed_reports.gate_file, "report")
        real = {"sim": sim, "sim_signature": sim_signature, "gate": gate, "gate_signature": gate_signature}
        good = await ok(http.post("/api/v1/evidence", json={**real, "files": FILES}), 201)
        manifest = good["manifest"]
        assert manifest["release_ready"] is True and manifest["checks"]["reasons"] == []
        release_fp = security.PublicKey.from_b64(signed_reports.public_key).fingerprint
        for part, signature in (("sim", sim_signature), ("gate", gate_signature)):
            assert manifest["provenance"][part] == {
                "provenance": "verified",
                "signature": signature,
                "signed_by": release_fp,
                "note": "",
            }
        assert manifest["nexa_version"] == version["version"]
        assert manifest["controller_fingerprint"] == version["controller_fingerprint"]
        assert manifest["files"] == FILES and good["public_key"] == trusted

        # The same claims without the controller's seeing them: signed as asserted, never ready.
        edited = json.loads(one_byte_edited(signed_reports.sim_file, tmp_path / "edited.json").read_text())
        stranger = security.generate_signing_key()
        stranger_gate = codec.loads(codec.api, json.dumps(gate), GateReport)
        for claim, part, why in (
            ({**real, "sim": SIM_PASSED, "sim_signature": None}, "sim", "the sim report is not signed"),
            ({**real, "gate": GATE_CLEAN, "gate_signature": None}, "gate", "the gate report is not signed"),
            (
                {**real, "sim": edited["summary"]},
                "sim",
                f"the sim report's signature by key {release_fp} does not verify: the report was changed after it"
                " was signed; run it again with nexa sim --json FILE --sign-key KEY",
            ),
            (
                {**real, "gate_signature": codec.api.unstructure(security.sign_report(stranger, stranger_gate))},
                "gate",
                f"the gate report is signed by key {stranger.public.fingerprint}, which this controller does not trust",
            ),
        ):
            asserted = (await ok(http.post("/api/v1/evidence", json=claim), 201))["manifest"]
            assert asserted["release_ready"] is False, why
            assert asserted["checks"]["sim_passed"] and asserted["checks"]["gate_clean"]
            assert asserted["provenance"][part]["provenance"] == "asserted"
            assert asserted["provenance"][part]["signature"] is None
            [reason] = asserted["checks"]["reasons"]
            assert reason.startswith(f"asserted, not verified: {why}"), reason
            other_part = "gate" if part == "sim" else "sim"
            assert asserted["provenance"][other_part]["provenance"] == "verified"

        # Refusals: typed 400s.
        for files in ([{"path": "../x", "sha256": "a" * 64, "size": 1}], [{"path": "x", "sha256": "zz", "size": 1}]):
            assert_envelope(await http.post("/api/v1/evidence", json={"files": files}), 400, "invalid_request")
        assert_envelope(await http.post("/api/v1/evidence", json={"sim": {"passed": True}}), 400, "invalid_request")
        # ... a malformed signature, a signature without its report, an oversize report: refused, nothing signed.
        signed_before = len(await _signs(ev_reg))
        steps = [{"name": f"s{i}", "verdict": "pass", "duration_s": 1} for i in range(300)]
        for refused, problem in (
            ({**real, "sim_signature": {**sim_signature, "signature": "%%%"}}, "sim_signature: the signature is not"),
            ({**real, "gate_signature": {**gate_signature, "signature": "AAAA"}}, "gate_signature: an Ed25519 sig"),
            ({**real, "sim_signature": {**sim_signature, "public_key": "A" * 8}}, "sim_signature: an Ed25519 publ"),
            ({**real, "sim": None}, "sim_signature: a signature without its sim report"),
            ({**real, "sim": {**sim, "steps": steps}}, "sim: at most 256 steps or checks"),
            ({**real, "gate": {**gate, "checks": [{"name": "x", "ok": True, "detail": "d" * 300_000}]}}, "gate: at"),
        ):
            answer = await http.post("/api/v1/evidence", json=refused)
            assert_envelope(answer, 400, "invalid_request")
            assert problem in answer.json()["error"]["message"], (problem, answer.json())
        signed_after = len(await _signs(ev_reg))
        assert signed_after == signed_before

    signed = codec.loads(codec.api, json.dumps(good), EvidenceSigned)
    assert signed.manifest.provenance is not None
    assert security.verify_signed(signed, trusted) == []
    assert security.verify_signed(signed, None) == []
    for edited in _tampered(signed):
        assert security.verify_signed(edited, trusted) == [
            "the signature does not verify: the manifest was changed after it was signed"
        ]
    other = security.generate_signing_key().public.b64
    assert any("not the trusted key" in p for p in security.verify_signed(signed, other))
    assert security.verify_signed(attrs.evolve(signed, signature="%%%"), trusted) == ["the signature is not base64"]

    async with ev_reg.client() as admin:
        signs = [e for e in await audit_events(admin) if e["action"] == "evidence.sign"]
        assert len(signs) == 7 and "release_ready true" in signs[2]["detail"]
        assert all("release_ready false" in e["detail"] for e in signs[3:])
        assert signs[-1]["seq"] > manifest["audit_head_seq"]


def test_a_manifest_signed_before_provenance_still_verifies_and_reads_as_asserted() -> None:
    """A manifest without `provenance` (signed before it existed, over JSON without the key) still
    verifies; it decodes with no provenance, which `nexa evidence verify` reads as asserted."""
    key = security.generate_signing_key()
    manifest = EvidenceManifest(
        created_at=1.0,
        nexa_version="0",
        controller_fingerprint="f" * 16,
        audit_head_seq=1,
        audit_head_hash="a" * 64,
        files=[],
        checks=ReleaseChecks(sim_passed=True, benchmarks_meet_objectives=True, gate_clean=True),
        release_ready=True,
    )
    body = codec.api.unstructure(manifest)
    del body["provenance"]  # as manifests were before it
    raw = security.sign(key, security.EVIDENCE_KIND, codec.canonical_json(body).encode())
    old = {"manifest": body, "signature": base64.b64encode(raw).decode(), "public_key": key.public.b64}
    signed = codec.loads(codec.api, json.dumps(old), EvidenceSigned)
    assert signed.manifest.provenance is None
    assert security.verify_signed(signed, key.public.b64) == []
