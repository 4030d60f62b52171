"""Release evidence (`POST /api/v1/evidence`, `security.verify_signed`): the controller fills in its
facts, decides `release_ready` with its reasons, and signs; the signature verifies offline with
the controller's key and fails when anything in the manifest changes."""

from __future__ import annotations

import json
from typing import Any

import attrs
import trio

from nexa import security
from nexa.contracts import codec
from nexa.contracts.evidence import EvidenceSigned
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, make_key, ok
from tests.support.bench import bench_run
from tests.support.deployments import body, registry_ready
from tests.support.models import audit_events
from tests.support.rollout import fleet_of

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


def _tampered(signed: EvidenceSigned) -> list[EvidenceSigned]:
    m = signed.manifest
    edits = [
        attrs.evolve(m, release_ready=not m.release_ready),
        attrs.evolve(m, created_at=m.created_at + 1),
        attrs.evolve(m, audit_head_seq=m.audit_head_seq + 1),
        attrs.evolve(m, files=[attrs.evolve(m.files[0], sha256="b" * 64)]),
        attrs.evolve(m, checks=attrs.evolve(m.checks, reasons=["edited"])),
        attrs.evolve(m, statement=m.statement + "."),
    ]
    return [attrs.evolve(signed, manifest=e) for e in edits]


async def test_evidence_is_signed_verifies_and_says_why_it_is_not_release_ready(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    await fleet_of(dep_reg, dial, nursery, "n1")
    operator = await make_key(dep_reg, "operator")
    async with dep_reg.client() as admin:
        await registry_ready(admin, s3_store, test_images)
        await ok(admin.post("/api/v1/deployments", json=body()), 201)
        trusted = (await ok(admin.get("/api/v1/receipts/public-key")))["public_key"]
        version = await ok(admin.get("/version"))
    async with dep_reg.client(operator) as http:
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
        assert bad["manifest"]["release_ready"] is False and len(reasons) == 3
        assert "c=2: ttft p95 120 ms > 100 ms" in reasons[0]
        assert reasons[1] == "nexa sim did not pass: drain failed"
        assert reasons[2] == "the release gate is not clean: secrets failed"

        # Objectives met, sim passed, gate clean: ready.
        await ok(http.post("/api/v1/deployments/chat-a/objectives", json={"ttft_p95_ms": 1000}))
        good = await ok(
            http.post("/api/v1/evidence", json={"sim": SIM_PASSED, "gate": GATE_CLEAN, "files": FILES}), 201
        )
        manifest = good["manifest"]
        assert manifest["release_ready"] is True and manifest["checks"]["reasons"] == []
        assert manifest["nexa_version"] == version["version"]
        assert manifest["controller_fingerprint"] == version["controller_fingerprint"]
        assert manifest["files"] == FILES and good["public_key"] == trusted

        # Refusals: typed 400s.
        for files in ([{"path": "../x", "sha256": "a" * 64, "size": 1}], [{"path": "x", "sha256": "zz", "size": 1}]):
            assert_envelope(await http.post("/api/v1/evidence", json={"files": files}), 400, "invalid_request")
        assert_envelope(await http.post("/api/v1/evidence", json={"sim": {"passed": True}}), 400, "invalid_request")

    signed = codec.loads(codec.api, json.dumps(good), EvidenceSigned)
    assert security.verify_signed(signed, trusted) == []
    assert security.verify_signed(signed, None) == []
    for edited in _tampered(signed):
        assert security.verify_signed(edited, trusted) == [
            "the signature does not verify: the manifest was changed after it was signed"
        ]
    other = security.generate_signing_key().public.b64
    assert any("not the trusted key" in p for p in security.verify_signed(signed, other))
    assert security.verify_signed(attrs.evolve(signed, signature="%%%"), trusted) == ["the signature is not base64"]

    async with dep_reg.client() as admin:
        signs = [e for e in await audit_events(admin) if e["action"] == "evidence.sign"]
        assert len(signs) == 3 and "release_ready true" in signs[-1]["detail"]
        assert signs[-1]["seq"] > manifest["audit_head_seq"]
