"""The model registry through the real HTTP API: runtimes checked against a real OCI registry, models
verified by streaming from a real S3 store (SeaweedFS), the lifecycle's every illegal transition,
licences, aliases with receipts, and the audit chain. One CLI test runs the whole flow as an operator.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
import time
from pathlib import Path

import attrs
import pytest
import trio

from nexa.security import SigningKey, generate_signing_key, sign_digest
from tests.conftest import Controller, ControllerProcess, free_port, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import Json, assert_envelope, make_key, ok
from tests.support.models import (
    Artifact,
    audit_events,
    bring_to,
    get_model,
    head_seq,
    model_body,
    registry_config,
    unique,
    upload,
)

# --- runtimes: the controller asks the registry ------------------------------------------------------------


async def test_a_runtime_is_registered_for_a_digest_the_registry_holds(
    reg: Controller, test_images: BuiltImages
) -> None:
    body = {"name": "busybox-httpd", "kind": "sim", "version": "1.35", "image": test_images.busybox}
    async with reg.client() as http:
        runtime = await ok(http.post("/api/v1/runtimes", json=body), 201)
        assert runtime.pop("warnings") == []  # only the registration's answer carries warnings
        assert runtime["image"] == test_images.busybox
        assert runtime["media_type"].startswith("application/vnd.")
        assert runtime["platforms"] and runtime["platforms"][0]["os"] == "linux"  # from the image's config
        assert (await ok(http.get("/api/v1/runtimes/busybox-httpd"))) == runtime
        assert (await ok(http.get("/api/v1/runtimes")))["runtimes"] == [runtime]
        assert_envelope(await http.post("/api/v1/runtimes", json=body), 409, "already_exists")
        assert_envelope(await http.get("/api/v1/runtimes/nope"), 404, "not_found")
        events = [e for e in await audit_events(http) if e["action"] == "runtime.register"]
    assert [(e["target"], e["result"]) for e in events] == [("runtime/busybox-httpd", "ok")]
    assert events[0]["next_sha256"]


async def test_a_digest_the_registry_lacks_is_refused_audited_and_not_kept(
    reg: Controller, test_images: BuiltImages
) -> None:
    repo = test_images.busybox.partition("@")[0]
    other_repo = repo.rsplit("/", 1)[0] + "/never-pushed"
    async with reg.client() as http:
        for image in (f"{repo}@sha256:{'0' * 64}", f"{other_repo}@{test_images.busybox_digest}"):
            resp = await http.post(
                "/api/v1/runtimes", json={"name": "ghost", "kind": "vllm", "version": "1", "image": image}
            )
            err = assert_envelope(resp, 422, "digest_unknown")
            assert err["retryable"] is False
        assert (await ok(http.get("/api/v1/runtimes")))["runtimes"] == []
        events = [e for e in await audit_events(http) if e["action"] == "runtime.register"]
    assert [e["result"] for e in events] == ["rejected", "rejected"]
    assert all(e["detail"].startswith("digest_unknown:") and e["next_sha256"] is None for e in events)


@pytest.mark.parametrize(
    "image",
    [
        "127.0.0.1:5000/nexa/vllm:0.6.3",
        "127.0.0.1:5000/nexa/vllm@sha256:abc",
        "127.0.0.1:5000/nexa/vllm@sha256:" + "A" * 64,
        "busybox",
    ],
)
async def test_a_reference_not_pinned_by_digest_is_400_and_asks_nobody(reg: Controller, image: str) -> None:
    async with reg.client() as http:
        before = await head_seq(http)
        resp = await http.post("/api/v1/runtimes", json={"name": "x", "kind": "vllm", "version": "1", "image": image})
        err = assert_envelope(resp, 400, "invalid_request")
        assert "image" in err["message"]
        assert await head_seq(http) == before


async def test_an_unreachable_registry_is_503_retryable_and_changes_nothing(reg: Controller) -> None:
    image = f"127.0.0.1:{free_port()}/nexa/vllm@sha256:{'1' * 64}"
    async with reg.client() as http:
        before = await head_seq(http)
        resp = await http.post("/api/v1/runtimes", json={"name": "x", "kind": "vllm", "version": "1", "image": image})
        assert assert_envelope(resp, 503, "unavailable")["retryable"] is True
        assert await head_seq(http) == before
        assert (await ok(http.get("/api/v1/runtimes")))["runtimes"] == []


# --- models: the controller streams the artifact itself ----------------------------------------------------


async def test_verification_streams_the_artifact_and_records_what_it_saw(reg: Controller, s3_store: S3Store) -> None:
    art = await upload(s3_store)
    async with reg.client() as http:
        model = await ok(http.post("/api/v1/models", json=model_body("tiny", "v1", art)), 201)
        assert model["state"] == "Candidate" and model["verification"] is None
        verified = await ok(http.post("/api/v1/models/tiny/v1/verify"))
        assert verified["state"] == "Verified"
        v = verified["verification"]
        assert (v["sha256"], v["size_bytes"], v["signature_key"]) == (art.sha256, art.size, None)
        events = [e for e in await audit_events(http) if e["target"] == "model/tiny/v1"]
    assert [(e["action"], e["result"]) for e in events] == [("model.register", "ok"), ("model.verify", "ok")]
    assert events[1]["prior_sha256"] == events[0]["next_sha256"]


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ("tampered", "artifact_digest_mismatch"),
        ("declared_smaller", "artifact_size_mismatch"),
        ("declared_larger", "artifact_size_mismatch"),
        ("missing_object", "artifact_missing"),
        ("missing_bucket", "artifact_missing"),
    ],
)
async def test_an_artifact_that_does_not_match_is_refused_and_stays_candidate(
    reg: Controller, s3_store: S3Store, change: str, code: str
) -> None:
    data = secrets.token_bytes(300_000)
    art = await upload(s3_store, data)
    if change == "tampered":  # same size, other bytes (the last one flipped: never the same, as `\x00` was 1 in 256)
        art = attrs.evolve(art, sha256=hashlib.sha256(data[:-1] + bytes([data[-1] ^ 0xFF])).hexdigest())
    elif change == "declared_smaller":
        art = attrs.evolve(art, size=art.size - 1)
    elif change == "declared_larger":
        art = attrs.evolve(art, size=art.size + 1)
    elif change == "missing_object":
        art = attrs.evolve(art, uri=s3_store.uri(unique("never-uploaded.gguf")))
    else:
        art = attrs.evolve(art, uri=f"s3://no-such-bucket-{secrets.token_hex(3)}/model.gguf")
    async with reg.client() as http:
        await ok(http.post("/api/v1/models", json=model_body("tiny", "v1", art)), 201)
        err = assert_envelope(await http.post("/api/v1/models/tiny/v1/verify"), 422, code)
        assert err["retryable"] is False
        model = await get_model(http, "tiny", "v1")
        assert (model["state"], model["verification"]) == ("Candidate", None)
        last = (await audit_events(http))[-1]
    assert (last["action"], last["target"], last["result"]) == ("model.verify", "model/tiny/v1", "rejected")
    assert last["detail"].startswith(f"{code}:")


async def test_an_unreachable_store_is_503_and_changes_nothing(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    cfg = attrs.evolve(cfg, artifacts=attrs.evolve(cfg.artifacts, s3_endpoint=f"http://127.0.0.1:{free_port()}"))
    c = await start_controller(nursery, cfg)
    art = Artifact(uri="s3://nexa-models/x.gguf", sha256="1" * 64, size=10)
    async with c.client() as http:
        await ok(http.post("/api/v1/models", json=model_body("tiny", "v1", art)), 201)
        before = await head_seq(http)
        assert assert_envelope(await http.post("/api/v1/models/tiny/v1/verify"), 503, "unavailable")["retryable"]
        assert await head_seq(http) == before
        assert (await get_model(http, "tiny", "v1"))["state"] == "Candidate"
    c.stopping.set()


async def test_a_verdict_cannot_be_written_by_hand(reg: Controller, s3_store: S3Store) -> None:
    art = await upload(s3_store)
    async with reg.client() as http:
        for extra in ({"state": "Verified"}, {"verified": True}, {"verification": {"sha256": art.sha256}}):
            resp = await http.post("/api/v1/models", json=model_body("tiny", "v1", art, **extra))
            err = assert_envelope(resp, 400, "invalid_request")
            assert f"{next(iter(extra))}: unknown key" in err["message"]
        await ok(http.post("/api/v1/models", json=model_body("tiny", "v1", art)), 201)
        for body in ({"verified": True}, {"signature_verified": True, "provenance_verified": True}):
            assert_envelope(await http.post("/api/v1/models/tiny/v1/verify", json=body), 400, "invalid_request")
        assert (await get_model(http, "tiny", "v1"))["state"] == "Candidate"


async def test_a_trusted_key_requires_a_good_signature_over_the_digest(
    signed_reg: Controller, s3_store: S3Store, signer: SigningKey
) -> None:
    art = await upload(s3_store)
    stranger = generate_signing_key()
    async with signed_reg.client() as http:
        await ok(http.post("/api/v1/models", json=model_body("tiny", "v1", art)), 201)
        err = assert_envelope(await http.post("/api/v1/models/tiny/v1/verify"), 422, "signature_rejected")
        assert "signature" in err["message"]
        forged = {"signature": sign_digest(stranger, art.sha256)}
        assert_envelope(await http.post("/api/v1/models/tiny/v1/verify", json=forged), 422, "signature_rejected")
        other_digest = {"signature": sign_digest(signer, "2" * 64)}
        assert_envelope(await http.post("/api/v1/models/tiny/v1/verify", json=other_digest), 422, "signature_rejected")
        assert (await get_model(http, "tiny", "v1"))["state"] == "Candidate"
        good = {"signature": sign_digest(signer, art.sha256)}
        verified = await ok(http.post("/api/v1/models/tiny/v1/verify", json=good))
        assert verified["state"] == "Verified"
        assert verified["verification"]["signature_key"] == signer.public.fingerprint
        assert verified["signature"] == good["signature"]

        # A signature given at registration is used by a later verification.
        art2 = await upload(s3_store)
        body = model_body("tiny", "v2", art2, signature=sign_digest(signer, art2.sha256))
        await ok(http.post("/api/v1/models", json=body), 201)
        assert (await ok(http.post("/api/v1/models/tiny/v2/verify")))["state"] == "Verified"
        results = [e["result"] for e in await audit_events(http) if e["action"] == "model.verify"]
    assert results == ["rejected", "rejected", "rejected", "ok", "ok"]


async def test_a_good_signature_does_not_excuse_tampered_bytes(
    signed_reg: Controller, s3_store: S3Store, signer: SigningKey
) -> None:
    art = await upload(s3_store)
    claimed = hashlib.sha256(b"what the signer meant").hexdigest()
    body = model_body("tiny", "v1", attrs.evolve(art, sha256=claimed), signature=sign_digest(signer, claimed))
    async with signed_reg.client() as http:
        await ok(http.post("/api/v1/models", json=body), 201)
        assert_envelope(await http.post("/api/v1/models/tiny/v1/verify"), 422, "artifact_digest_mismatch")
        assert (await get_model(http, "tiny", "v1"))["state"] == "Candidate"


@pytest.mark.parametrize(
    ("override", "fields"),
    [
        ({"name": "Tiny Model"}, ["name"]),
        ({"version": "v1/../x"}, ["version"]),
        ({"artifact": {"uri": "file:///etc/passwd", "sha256": "a" * 64, "size_bytes": 1}}, ["artifact.uri"]),
        ({"artifact": {"uri": "s3://nexa-models/../x", "sha256": "a" * 64, "size_bytes": 1}}, ["artifact.uri"]),
        ({"artifact": {"uri": "s3://nexa-models/x", "sha256": "A" * 64, "size_bytes": 0}}, ["sha256", "size_bytes"]),
        ({"memory_bytes": -1, "format": "pickle"}, ["format"]),
        ({"memory_bytes": 0}, ["memory_bytes"]),
        ({"provenance": {"source": ""}}, ["provenance.source"]),
        ({"license": {"spdx_id": "MIT", "terms_sha256": "a" * 64}}, ["license"]),
        ({"license": {"accepted_by": "me"}}, ["license"]),
        ({"license": {"spdx_id": "MIT", "expires_at": "tomorrow"}}, ["expires_at"]),
        ({"signature": "not base64"}, ["signature"]),
    ],
)
async def test_bad_model_bodies_are_400_naming_fields_and_change_nothing(
    reg: Controller, override: Json, fields: list[str]
) -> None:
    art = Artifact(uri="s3://nexa-models/x.gguf", sha256="a" * 64, size=10)
    async with reg.client() as http:
        before = await head_seq(http)
        err = assert_envelope(
            await http.post("/api/v1/models", json={**model_body("tiny", "v1", art), **override}),
            400,
            "invalid_request",
        )
        for field in fields:
            assert field in err["message"], (field, err["message"])
        assert await head_seq(http) == before
        assert (await ok(http.get("/api/v1/models")))["models"] == []


async def test_a_version_is_registered_once(reg: Controller) -> None:
    art = Artifact(uri="s3://nexa-models/x.gguf", sha256="a" * 64, size=10)
    async with reg.client() as http:
        await ok(http.post("/api/v1/models", json=model_body("tiny", "v1", art)), 201)
        assert_envelope(await http.post("/api/v1/models", json=model_body("tiny", "v1", art)), 409, "already_exists")
        await ok(http.post("/api/v1/models", json=model_body("tiny", "v2", art)), 201)
        listed = await ok(http.get("/api/v1/models", params={"name": "tiny", "state": "Candidate"}))
        assert [m["version"] for m in listed["models"]] == ["v1", "v2"]
        assert (await ok(http.get("/api/v1/models", params={"state": "Approved"})))["models"] == []
        assert_envelope(await http.get("/api/v1/models", params={"state": "Shiny"}), 400, "invalid_request")
        assert_envelope(await http.get("/api/v1/models/tiny/v9"), 404, "not_found")


# --- the lifecycle: every illegal transition ---------------------------------------------------------------

_EVAL = {"suite": "smoke", "metrics": {"acc": 0.5}, "passed": True}
_LICENSE = {"spdx_id": "MIT", "accepted_by": "legal"}
#: (state the model is in, action, body) → 409 illegal_transition, nothing changes.
ILLEGAL: list[tuple[str, str, Json | None]] = [
    ("Candidate", "evaluations", _EVAL),
    ("Candidate", "approve", None),
    ("Verified", "verify", None),
    ("Verified", "approve", None),
    ("Evaluated", "verify", None),
    ("Approved", "verify", None),
    ("Approved", "evaluations", _EVAL),
    ("Approved", "approve", None),
    ("Retired", "verify", None),
    ("Retired", "evaluations", _EVAL),
    ("Retired", "approve", None),
    ("Retired", "license", _LICENSE),
    ("Retired", "retire", None),
]


async def test_every_illegal_transition_is_409_and_changes_nothing(reg: Controller, s3_store: S3Store) -> None:
    async with reg.client() as http:
        models = {}
        for state in ("Candidate", "Verified", "Evaluated", "Approved", "Retired"):
            models[state] = await bring_to(http, s3_store, f"m-{state.lower()}", "v1", state)
        before = await head_seq(http)
        for state, action, body in ILLEGAL:
            path = f"/api/v1/models/m-{state.lower()}/v1/{action}"
            resp = await http.post(path, json=body) if body is not None else await http.post(path)
            err = assert_envelope(resp, 409, "illegal_transition")
            assert state in err["message"], (state, action, err["message"])
        for state, model in models.items():
            assert await get_model(http, f"m-{state.lower()}", "v1") == model
        assert await head_seq(http) == before  # refused transitions write nothing

        # An alias may point only at an Approved version.
        for state in ("Candidate", "Verified", "Evaluated", "Retired"):
            resp = await http.post(
                "/api/v1/aliases/chat/promote", json={"model": f"m-{state.lower()}", "version": "v1"}
            )
            assert_envelope(resp, 409, "model_not_approved")
        assert_envelope(await http.get("/api/v1/aliases/chat"), 404, "not_found")
        assert await head_seq(http) == before


async def test_evaluations_decide_between_verified_and_evaluated(reg: Controller, s3_store: S3Store) -> None:
    async with reg.client() as http:
        await bring_to(http, s3_store, "tiny", "v1", "Verified")
        failed = {"suite": "mmlu-5shot", "metrics": {"accuracy": 0.21, "latency_p95_ms": 80}, "passed": False}
        out = await ok(http.post("/api/v1/models/tiny/v1/evaluations", json=failed), 201)
        assert (out["evaluation"]["passed"], out["model"]["state"]) == (False, "Verified")
        passed = {**failed, "metrics": {"accuracy": 0.71}, "passed": True, "evidence": "s3://evals/run-7.json"}
        out = await ok(http.post("/api/v1/models/tiny/v1/evaluations", json=passed), 201)
        assert out["model"]["state"] == "Evaluated"
        assert out["model"]["last_evaluation"] == out["evaluation"]["id"]
        # The latest evaluation decides: a failing re-run takes the model back to Verified.
        out = await ok(http.post("/api/v1/models/tiny/v1/evaluations", json=failed), 201)
        assert out["model"]["state"] == "Verified"
        assert_envelope(await http.post("/api/v1/models/tiny/v1/approve"), 409, "illegal_transition")
        detail = await ok(http.get("/api/v1/models/tiny/v1"))
        assert [e["passed"] for e in detail["evaluations"]] == [False, True, False]
        bad = {"suite": "x", "metrics": {"bad name!": 1.0}, "passed": True}
        assert_envelope(await http.post("/api/v1/models/tiny/v1/evaluations", json=bad), 400, "invalid_request")
        results = [(e["result"], e["detail"][-6:]) for e in await audit_events(http) if e["action"] == "model.evaluate"]
    assert results == [("ok", "failed"), ("ok", "passed"), ("ok", "failed")]


async def test_an_expired_or_unaccepted_licence_blocks_approval(reg: Controller, s3_store: S3Store) -> None:
    async with reg.client() as http:
        await bring_to(http, s3_store, "tiny", "v1", "Evaluated")
        path = "/api/v1/models/tiny/v1"
        expired = {"spdx_id": "Apache-2.0", "accepted_by": "legal", "expires_at": time.time() - 60}
        await ok(http.post(f"{path}/license", json=expired))
        err = assert_envelope(await http.post(f"{path}/approve"), 409, "license_invalid")
        assert "expired" in err["message"]
        unaccepted = {"terms_sha256": hashlib.sha256(b"custom terms").hexdigest()}
        await ok(http.post(f"{path}/license", json=unaccepted))
        err = assert_envelope(await http.post(f"{path}/approve"), 409, "license_invalid")
        assert "accepted" in err["message"]
        assert (await get_model(http, "tiny", "v1"))["state"] == "Evaluated"
        renewed = {**unaccepted, "accepted_by": "legal@example.com", "expires_at": time.time() + 86400}
        await ok(http.post(f"{path}/license", json=renewed))
        approved = await ok(http.post(f"{path}/approve"))
        assert approved["state"] == "Approved"
        assert approved["license"]["accepted_by"] == "legal@example.com"
        approvals = [
            (e["result"], e["detail"][:15]) for e in await audit_events(http) if e["action"] == "model.approve"
        ]
    assert approvals == [("rejected", "license_invalid"), ("rejected", "license_invalid"), ("ok", "")]


async def test_a_model_without_a_licence_is_never_approved(reg: Controller, s3_store: S3Store) -> None:
    art = await upload(s3_store)
    async with reg.client() as http:
        await ok(http.post("/api/v1/models", json=model_body("tiny", "v1", art, license=None)), 201)
        await ok(http.post("/api/v1/models/tiny/v1/verify"))
        await ok(http.post("/api/v1/models/tiny/v1/evaluations", json=_EVAL), 201)
        err = assert_envelope(await http.post("/api/v1/models/tiny/v1/approve"), 409, "license_invalid")
        assert "no licence" in err["message"]
        assert_envelope(await http.post("/api/v1/models/tiny/v1/approve", json={"force": True}), 400, "invalid_request")


# --- aliases -----------------------------------------------------------------------------------------------


async def test_aliases_promote_and_roll_back_with_generations_receipts_and_history(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with trio.open_nursery() as first:
        c = await start_controller(first, cfg)
        async with c.client() as http:
            for version in ("v1", "v2", "v3"):
                await bring_to(http, s3_store, "llama", version, "Approved")
            assert_envelope(await http.post("/api/v1/aliases/chat/rollback"), 404, "not_found")
            receipts = []
            for version in ("v1", "v2", "v3"):
                promote = {"model": "llama", "version": version}
                receipts.append(await ok(http.post("/api/v1/aliases/chat/promote", json=promote)))
            # A retried promotion is answered with the receipt of the one that took effect.
            again = await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "llama", "version": "v3"}))
            assert again == receipts[-1]
            receipts.append(await ok(http.post("/api/v1/aliases/chat/rollback")))
            receipts.append(await ok(http.post("/api/v1/aliases/chat/rollback")))
            err = assert_envelope(await http.post("/api/v1/aliases/chat/rollback"), 409, "no_rollback_target")
            assert "chat" in err["message"]
            # The version an alias points at cannot be retired; others can.
            assert_envelope(await http.post("/api/v1/models/llama/v1/retire"), 409, "model_in_use")
            await ok(http.post("/api/v1/models/llama/v3/retire"))
            detail = await ok(http.get("/api/v1/aliases/chat"))
            listed = await ok(http.get("/api/v1/aliases"))
            show = await ok(http.get("/api/v1/models/llama/v1"))
            events = {e["id"]: e for e in await audit_events(http)}
        c.stopping.set()

    ref = {f"v{i}": {"model": "llama", "version": f"v{i}"} for i in (1, 2, 3)}
    moves = [(r["generation"], r["action"], r["from"], r["to"]) for r in receipts]
    assert moves == [
        (1, "promote", None, ref["v1"]),
        (2, "promote", ref["v1"], ref["v2"]),
        (3, "promote", ref["v2"], ref["v3"]),
        (4, "rollback", ref["v3"], ref["v2"]),
        (5, "rollback", ref["v2"], ref["v1"]),
    ]
    for r in receipts:
        assert set(r) == {
            "alias",
            "generation",
            "action",
            "from",
            "to",
            "at",
            "actor",
            "event_id",
            "adapter",
            "from_adapter",
        }
        event = events[r["event_id"]]
        assert (event["action"], event["target"], event["result"]) == (f"alias.{r['action']}", "alias/chat", "ok")
        assert event["actor_key_id"] == r["actor"] is not None
    assert detail["history"] == receipts
    assert (detail["alias"]["target"], detail["alias"]["generation"]) == (ref["v1"], 5)
    assert listed["aliases"] == [detail["alias"]]
    assert show["aliases"] == ["chat"]

    # A restarted controller has the same aliases, history and models (the store is the truth).
    async with trio.open_nursery() as second:
        c = await start_controller(second, cfg, admin_key=c.admin_key)
        async with c.client() as http:
            assert await ok(http.get("/api/v1/aliases/chat")) == detail
            assert (await get_model(http, "llama", "v3"))["state"] == "Retired"
            # Rolling back onto a version retired meanwhile is refused.
            await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "llama", "version": "v2"}))
            await ok(http.post("/api/v1/models/llama/v1/retire"))
            assert_envelope(await http.post("/api/v1/aliases/chat/rollback"), 409, "model_not_approved")
        c.stopping.set()


async def test_alias_and_model_routes_need_operator_or_admin(reg: Controller) -> None:
    inference = await make_key(reg, "inference", tenant="acme")
    operator = await make_key(reg, "operator")
    async with reg.client(inference) as http:
        assert_envelope(await http.get("/api/v1/models"), 403, "forbidden")
        assert_envelope(await http.post("/api/v1/aliases/chat/rollback"), 403, "forbidden")
    async with reg.client(operator) as http:
        assert (await ok(http.get("/api/v1/aliases")))["aliases"] == []


# --- the audit chain -----------------------------------------------------------------------------------------


async def test_every_transition_is_in_the_audit_chain_and_the_chain_verifies(
    reg: Controller, s3_store: S3Store
) -> None:
    async with reg.client() as http:
        start = await head_seq(http)
        await bring_to(http, s3_store, "tiny", "v1", "Approved")
        await ok(http.post("/api/v1/models/tiny/v1/license", json={"spdx_id": "MIT", "accepted_by": "legal"}))
        await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "tiny", "version": "v1"}))
        await bring_to(http, s3_store, "tiny", "v2", "Retired")
        events = await audit_events(http, after=start)
        verdict = await ok(http.post("/api/v1/audit/verify"))
    assert [(e["action"], e["target"]) for e in events] == [
        ("model.register", "model/tiny/v1"),
        ("model.verify", "model/tiny/v1"),
        ("model.evaluate", "model/tiny/v1"),
        ("model.approve", "model/tiny/v1"),
        ("model.license", "model/tiny/v1"),
        ("alias.promote", "alias/chat"),
        ("model.register", "model/tiny/v2"),
        ("model.verify", "model/tiny/v2"),
        ("model.evaluate", "model/tiny/v2"),
        ("model.approve", "model/tiny/v2"),
        ("model.retire", "model/tiny/v2"),
    ]
    # Each model event's prior digest is the previous event's next digest for that model.
    by_target: dict[str, list[Json]] = {}
    for e in events:
        by_target.setdefault(e["target"], []).append(e)
    for chain in by_target.values():
        for a, b in itertools.pairwise(chain):
            assert b["prior_sha256"] == a["next_sha256"]
    assert verdict["ok"] is True and verdict["checked"] == events[-1]["seq"]


# --- the CLI, as an operator runs it -------------------------------------------------------------------------


@pytest.mark.slow  # the whole model lifecycle through the CLI: about 25 s
def test_cli_register_license_verify_evaluate_approve_promote_rollback(
    tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    data_v1, data_v2 = secrets.token_bytes(150_000), secrets.token_bytes(160_000)
    uris = [trio.run(s3_store.put, unique("m.gguf"), d) for d in (data_v1, data_v2)]
    cfg = registry_config(tmp_path, s3_store)
    config_file = tmp_path / "control.toml"
    config_file.write_text(
        "[oci]\ntls_verify = false\n"
        f'[artifacts]\ns3_endpoint = "{s3_store.endpoint}"\ns3_region = "{s3_store.region}"\n'
        f's3_credentials_file = "{cfg.artifacts.s3_credentials_file}"\n'
    )
    cp = ControllerProcess(state_dir=tmp_path / "state", port=free_port())
    try:
        cp.start("--config", str(config_file))

        def run(*args: str) -> str:
            out = cp.cli(*args)
            assert out.returncode == 0, (args, out.stderr)
            return out.stdout

        out = run(
            "runtimes",
            "register",
            "llamacpp-cpu",
            "--kind",
            "llamacpp",
            "--version",
            "0.3",
            "--image",
            test_images.busybox,
        )
        assert "registered" in out and test_images.busybox in out
        assert "llamacpp-cpu" in run("runtimes", "list")
        ghost = cp.cli(
            "runtimes",
            "register",
            "x",
            "--kind",
            "vllm",
            "--version",
            "1",
            "--image",
            f"{test_images.busybox.partition('@')[0]}@sha256:{'0' * 64}",
        )
        assert ghost.returncode == 1 and "digest_unknown" in ghost.stderr

        for version, uri, data in (("v1", uris[0], data_v1), ("v2", uris[1], data_v2)):
            sha = hashlib.sha256(data).hexdigest()
            out = run(
                "models", "register", "tiny", version, "--uri", uri, "--sha256", sha, "--size", str(len(data)),
                "--format", "gguf", "--memory", "2GiB", "--source", "https://example.com/tiny",
            )  # fmt: skip
            assert "Candidate" in out
            terms = tmp_path / "terms.txt"
            terms.write_text("custom terms")
            out = run(
                "models",
                "license",
                "tiny",
                version,
                "--terms-file",
                str(terms),
                "--accepted-by",
                "legal",
                "--expires",
                "2099-01-01",
            )
            assert "accepted by legal" in out
            assert "Verified" in run("models", "verify", "tiny", version)
            out = run("models", "evaluate", "tiny", version, "--suite", "smoke", "--metric", "acc=0.9", "--passed")
            assert "passed" in out and "Evaluated" in out
            assert "Approved" in run("models", "approve", "tiny", version)

        listing = run("models", "list")
        assert listing.splitlines()[0].split()[:3] == ["NAME", "VERSION", "STATE"]
        assert listing.count("Approved") == 2
        show = run("models", "show", "tiny", "v1")
        assert "evaluation" in show and "acc=0.9" in show

        out = run("aliases", "promote", "chat", "--model", "tiny", "--version", "v1")
        assert "generation 1" in out and "- -> tiny@v1" in out
        receipt = json.loads(run("aliases", "promote", "chat", "--model", "tiny", "--version", "v2", "--json"))
        assert (receipt["generation"], receipt["from"]["version"], receipt["to"]["version"]) == (2, "v1", "v2")
        out = run("aliases", "rollback", "chat")
        assert "generation 3" in out and "tiny@v2 -> tiny@v1" in out
        history = run("aliases", "history", "chat")
        assert history.splitlines()[0] == "alias chat -> tiny@v1 (generation 3)"
        assert [line.split()[:2] for line in history.splitlines()[2:]] == [
            ["1", "promote"],
            ["2", "promote"],
            ["3", "rollback"],
        ]
        failed = cp.cli("aliases", "rollback", "chat")
        assert failed.returncode == 1 and "no_rollback_target" in failed.stderr
        illegal = cp.cli("models", "verify", "tiny", "v1")
        assert illegal.returncode == 1 and "illegal_transition" in illegal.stderr

        # Deployments through the CLI: no node is enrolled here, so nothing fits, and the
        # forecast and the refusal both say why without creating anything.
        forecast = run("capacity", "forecast", "chat-a", "--runtime", "llamacpp-cpu", "--alias", "chat")
        assert forecast.startswith("chat-a: does not fit")
        as_json = json.loads(run("capacity", "forecast", "chat-a", "--runtime", "llamacpp-cpu", "--model", "tiny:v2",
                                 "--json"))  # fmt: skip
        assert as_json["feasible"] is False and as_json["explanations"] == []
        refused = cp.cli("deployments", "create", "chat-a", "--runtime", "llamacpp-cpu", "--alias", "chat")
        assert refused.returncode == 1 and "unplaceable" in refused.stderr
        assert "(none)" in run("deployments", "list")
        missing = cp.cli("deployments", "show", "chat-a")
        assert missing.returncode == 1 and "not_found" in missing.stderr
        assert "ok" in run("audit", "verify")
    finally:
        cp.kill()
