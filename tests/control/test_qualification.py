"""Runtime qualification (`nexa runtimes qualify`) through a real controller and real `nexa node`
agents running `sim` runtimes: the steps, the signed record (it verifies, a tampered one does not),
`nexa runtimes show`, the job, refusals that change nothing, and `[placement] require_qualified`."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from nexa import security
from nexa.config import PlacementConfig
from nexa.contracts import codec
from nexa.contracts.models import ModelRef
from nexa.contracts.node import RuntimeKind
from nexa.contracts.qualification import Qualification, QualificationStep, SignedQualification, StepOutcome
from nexa.control.deployments.scheduler import place
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, ok
from tests.support.cluster import sim_cluster
from tests.support.console import sign_in
from tests.support.models import registry_config
from tests.support.scheduler import explanation, failures, lab, vllm, where

MIB = 2**20


def _deployment(name: str) -> dict[str, object]:
    return {
        "name": name,
        "runtime": "sim",
        "alias": "chat",
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 64 * MIB, "cpus": 0.5},
        "options": {"port": 18600},
    }


@pytest.mark.slow
async def test_a_runtime_qualified_on_a_node_is_placed_only_once_qualified_and_its_record_is_signed(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = attrs.evolve(registry_config(tmp_path, s3_store), placement=PlacementConfig(require_qualified=True))
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1) as cluster:
        async with cluster.client() as http:
            # Not qualified yet: refused, and the explanation names the failing filter and what to do.
            refused = await http.post("/api/v1/deployments", json=_deployment("chat-a"))
            assert_envelope(refused, 422, "unplaceable")
            message = refused.json()["error"]["message"]
            assert "qualified: sim image sha256:" in message
            assert "is not qualified on amd64 with GPU none" in message
            assert "nexa runtimes qualify RUNTIME --node sim-1" in message

            # Bad requests are typed refusals that start nothing.
            assert_envelope(await http.post("/api/v1/runtimes/sim/qualify", json={"node": "nope"}), 404, "not_found")
            unknown = await http.post("/api/v1/runtimes/nope/qualify", json={"node": "sim-1"})
            assert_envelope(unknown, 422, "runtime_unknown")
            no_model = await http.post("/api/v1/runtimes/sim/qualify", json={"node": "sim-1", "model": "nope"})
            assert_envelope(no_model, 422, "model_unknown")
            bad = await http.post("/api/v1/runtimes/sim/qualify", json={"node": "sim-1", "timeout_s": 0})
            assert_envelope(bad, 400, "invalid_request")
            assert (await ok(http.get("/api/v1/jobs", params={"kind": "qualification"})))["jobs"] == []

        # The operator's command: it follows the job and prints each step.
        done = await cluster.cli("runtimes", "qualify", "sim", "--node", "sim-1", "--model", "chat", "--timeout", "60")
        assert done.returncode == 0, done.stderr + done.stdout
        lines = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[1:] if line.startswith("  ")}
        assert lines == {
            "placement": "pass",
            "process": "pass",
            "ready": "pass",
            "answer": "pass",
            "metrics": "pass",  # the sim runtime exports vLLM's series
            "cache": "unknown",  # a sim runtime is a process: it has no container cache
            "memory": "pass",  # the node measures the sim process (within the 2 GiB reserved)
            "stop": "pass",
        }, done.stdout
        assert "on sim-1 (amd64, GPU none) with tiny@v1: passed" in done.stdout

        async with cluster.client() as http:
            listed = await ok(http.get("/api/v1/qualifications", params={"runtime": "sim"}))
            [raw] = listed["qualifications"]
            signed = codec.api.structure(raw, SignedQualification)
            q = signed.qualification
            assert q.passed and q.failed_step is None and q.node_id == "sim-1"
            assert [s.name for s in q.steps][:2] == ["placement", "process"]
            assert q.steps[3].figures["content_chars"] >= 0
            assert await ok(http.get(f"/api/v1/qualifications/{q.id}")) == raw
            key = (await ok(http.get("/api/v1/receipts/public-key")))["public_key"]
            job = await ok(http.get(f"/api/v1/jobs/{q.job}"))
            assert job["kind"] == "qualification" and job["state"] == "succeeded"
            assert job["link"] == f"/api/v1/qualifications/{q.id}"
            # The replica is gone from the node's set.
            node = await ok(http.get("/api/v1/nodes/sim-1"))
            assert node["assignments"] == []

            # Signed by the controller's key; any edit breaks it.
            assert security.verify_qualification(signed, key) == []
            tampered = attrs.evolve(signed, qualification=attrs.evolve(q, gpu_model="NVIDIA GB10"))
            assert security.verify_qualification(tampered, key) == [
                "the signature does not verify: the qualification was changed after it was signed"
            ]

            # Qualified: the same deployment is placed now, its explanation passing `qualified`.
            await ok(http.post("/api/v1/deployments", json=_deployment("chat-a")), 201)
            placement = await ok(http.get("/api/v1/deployments/chat-a/placement"))
            [explained] = placement["decision"]["explanations"]
            assert {f["name"]: f["passed"] for f in explained["filters"]}["qualified"] is True

        # The console's models page shows it beside the runtime.
        async with httpx.AsyncClient(base_url=cluster.controller.url) as browser:
            assert (await sign_in(browser, cluster.controller.admin_key)).status_code == 303
            page = await browser.get("/console/models")
        assert page.status_code == 200
        assert f'id="qualification-{q.id}">qualified</span> on sim-1 (amd64, GPU none)' in page.text

        # The evidence bundle carries it, and `nexa evidence verify` checks its signature.
        bundle = tmp_path / "bundle"
        written = await cluster.cli("evidence", "--out", str(bundle))
        assert written.returncode == 0, written.stderr
        [carried] = json.loads((bundle / "qualifications.json").read_text())["qualifications"]
        assert carried == raw
        checked = await cluster.cli("evidence", "verify", str(bundle), "--public-key", key)
        assert checked.returncode == 0, checked.stderr

        # `nexa runtimes show` lists it.
        show = await cluster.cli("runtimes", "show", "sim")
        assert show.returncode == 0, show.stderr
        assert "qualifications (newest first):" in show.stdout
        assert q.id in show.stdout and "passed" in show.stdout
        as_json = await cluster.cli("runtimes", "show", "sim", "--json")
        assert json.loads(as_json.stdout)["name"] == "sim"


def test_a_qualification_signature_holds_only_for_the_key_and_bytes_it_covers() -> None:
    record = Qualification(
        id="qual_0123456789abcdef",
        runtime="llama",
        kind=RuntimeKind.LLAMACPP,
        image="registry.lab/llama@sha256:" + "a" * 64,
        image_digest="sha256:" + "a" * 64,
        node_id="spark-1",
        arch="arm64",
        gpu_model="NVIDIA GB10",
        model=ModelRef(model="tiny", version="v1"),
        started_at=1.0,
        finished_at=2.0,
        passed=True,
        steps=[QualificationStep(name="process", outcome=StepOutcome.PASS, detail="started")],
    )
    key, other = security.generate_signing_key(), security.generate_signing_key()
    signed = security.sign_qualification(key, record)
    assert security.verify_qualification(signed, key.public.b64) == []
    assert security.verify_qualification(signed, None) == []
    wrong = security.verify_qualification(signed, other.public.b64)
    assert wrong and wrong[0].startswith(f"signed by key {key.public.fingerprint}, not the trusted key")
    edited = attrs.evolve(signed, qualification=attrs.evolve(record, passed=False))
    assert security.verify_qualification(edited, key.public.b64) == [
        "the signature does not verify: the qualification was changed after it was signed"
    ]
    assert security.verify_qualification(attrs.evolve(signed, signature="!!"), None) == ["the signature is not base64"]


def test_require_qualified_places_only_qualified_pairs_and_names_the_failing_filter() -> None:
    nodes = lab()
    spark = explanation(place(nodes, vllm()), "spark-1")
    assert spark.eligible  # not required: every pair passes `qualified`
    digest = "sha256:" + "b" * 64
    sparks_only = vllm(qualified=(("arm64", "NVIDIA GB10"),), image_digest=digest)
    decision = place(nodes, sparks_only)
    assert decision.feasible and where(decision) == ["spark-1"]
    assert failures(explanation(decision, "h100-1")) == [
        (
            "qualified",
            f"vllm image {digest[:19]} is not qualified on amd64 with GPU NVIDIA H100 80GB HBM3 "
            "([placement] require_qualified): run `nexa runtimes qualify RUNTIME --node h100-1`",
        )
    ]
    nothing = place(nodes, vllm(qualified=(), image_digest=digest))
    assert not nothing.feasible and not nothing.placements
    assert nothing.reason is not None and "most often failed: qualified" in nothing.reason
