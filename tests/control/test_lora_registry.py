"""LoRA adapters in the model registry through the real HTTP API (issue 34, point 1): an adapter is a model
version of kind `lora` naming its base versions, stored in a real S3 store (SeaweedFS), verified by the
controller itself (its GGUF header read: a LoRA adapter's, for its base's architecture), evaluated, approved
and audited like any model. A base that does not exist or does not match, and missing files, are typed errors
that keep nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.conftest import Controller
from tests.realparts import S3Store
from tests.support.api import Json, assert_envelope, ok
from tests.support.models import Artifact, audit_events, bring_to, get_model, head_seq, model_body, unique, upload


def lora_body(name: str, version: str, art: Artifact, base: list[tuple[str, str]], **over: object) -> Json:
    body = model_body(name, version, art, kind="lora", base=[{"model": m, "version": v} for m, v in base])
    body["memory_bytes"] = 64 * 2**20
    body.update(over)
    return body


async def test_an_adapter_of_a_registered_base_goes_through_the_models_lifecycle_and_audit(
    reg: Controller, s3_store: S3Store, tiny_gguf: Path, tiny_lora_gguf: Path
) -> None:
    async with reg.client() as http:
        base = await bring_to(http, s3_store, "tiny", "v1", "Approved", data=await trio.Path(tiny_gguf).read_bytes())
        assert base["kind"] == "model" and base["base"] == []
        art = await upload(s3_store, (await trio.Path(tiny_lora_gguf).read_bytes()))
        adapter = await ok(http.post("/api/v1/models", json=lora_body("tiny-poet", "a1", art, [("tiny", "v1")])), 201)
        assert (adapter["kind"], adapter["base"], adapter["state"]) == (
            "lora",
            [{"model": "tiny", "version": "v1"}],
            "Candidate",
        )
        verified = await ok(http.post("/api/v1/models/tiny-poet/a1/verify"))
        assert verified["state"] == "Verified"
        assert verified["verification"]["sha256"] == art.sha256
        await ok(
            http.post("/api/v1/models/tiny-poet/a1/evaluations", json={"suite": "s", "metrics": {}, "passed": True}),
            201,
        )
        assert (await ok(http.post("/api/v1/models/tiny-poet/a1/approve")))["state"] == "Approved"
        listed = await ok(http.get("/api/v1/models", params={"name": "tiny-poet"}))
        assert [(m["kind"], m["state"]) for m in listed["models"]] == [("lora", "Approved")]
        events = [e for e in await audit_events(http) if e["target"] == "model/tiny-poet/a1"]
    assert [e["action"] for e in events] == ["model.register", "model.verify", "model.evaluate", "model.approve"]
    assert "LoRA for llama" in events[1]["detail"]


@pytest.mark.parametrize(
    ("base", "why"),
    [
        ([("nope", "v1")], "no base model version nope@v1"),
        ([("tiny", "v1"), ("tiny", "v9")], "no base model version tiny@v9"),
        ([("other-lora", "a1")], "is itself a LoRA adapter"),
        ([("retired", "v1")], "is Retired"),
        ([("tiny-st", "v1")], "is gguf but base tiny-st@v1 is safetensors"),
    ],
)
async def test_a_base_that_does_not_exist_or_does_not_match_is_422_and_keeps_nothing(
    reg: Controller, s3_store: S3Store, base: list[tuple[str, str]], why: str
) -> None:
    async with reg.client() as http:
        await bring_to(http, s3_store, "tiny", "v1", "Verified")
        await bring_to(http, s3_store, "retired", "v1", "Retired")
        art = await upload(s3_store)
        await ok(http.post("/api/v1/models", json=model_body("tiny-st", "v1", art, format="safetensors")), 201)
        await ok(http.post("/api/v1/models", json=lora_body("other-lora", "a1", art, [("tiny", "v1")])), 201)
        before, models_before = await head_seq(http), (await ok(http.get("/api/v1/models")))["models"]
        err = assert_envelope(
            await http.post("/api/v1/models", json=lora_body("tiny-poet", "a1", art, base)), 422, "lora_base_invalid"
        )
        assert why in err["message"], err["message"]
        assert await head_seq(http) == before
        assert (await ok(http.get("/api/v1/models")))["models"] == models_before
        assert_envelope(await http.get("/api/v1/models/tiny-poet/a1"), 404, "not_found")


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"base": []}, "base: a LoRA adapter names the 1-16 base model versions"),
        ({"base": [{"model": "tiny", "version": "v1"}] * 2}, "base: each base model version once"),
        ({"base": [{"model": "Tiny!", "version": "v1"}]}, "base[0].model"),
        ({"kind": "model"}, "base: only a LoRA adapter (kind lora) names base model versions"),
        ({"kind": "prompt"}, "kind"),
    ],
)
async def test_bad_adapter_bodies_are_400_naming_the_field_and_keep_nothing(
    reg: Controller, s3_store: S3Store, over: Json, field: str
) -> None:
    art = Artifact(uri="s3://nexa-models/x.gguf", sha256="a" * 64, size=10)
    async with reg.client() as http:
        before = await head_seq(http)
        body = {**lora_body("tiny-poet", "a1", art, [("tiny", "v1")]), **over}
        err = assert_envelope(await http.post("/api/v1/models", json=body), 400, "invalid_request")
        assert field in err["message"], err["message"]
        assert await head_seq(http) == before
        assert (await ok(http.get("/api/v1/models")))["models"] == []


async def test_an_adapter_whose_files_are_missing_is_422_and_keeps_nothing(reg: Controller, s3_store: S3Store) -> None:
    async with reg.client() as http:
        await bring_to(http, s3_store, "tiny", "v1", "Verified")
        prefix = f"s3://{s3_store.bucket}/{unique('lora')}/"
        files = [{"path": "adapter.gguf", "size_bytes": 17568, "sha256": "b" * 64}]
        body = lora_body("tiny-poet", "a1", Artifact(uri=prefix, sha256="", size=0), [("tiny", "v1")])
        body["artifact"] = {"uri": prefix, "files": files, "entry": "adapter.gguf"}
        before = await head_seq(http)
        assert_envelope(await http.post("/api/v1/models", json=body), 422, "artifact_missing")
        assert_envelope(await http.get("/api/v1/models/tiny-poet/a1"), 404, "not_found")
        assert [e["result"] for e in await audit_events(http, before)] == ["rejected"]


@pytest.mark.parametrize("which", ["not an adapter", "another architecture"])
async def test_an_adapter_file_that_does_not_fit_its_base_fails_verification_and_stays_candidate(
    reg: Controller, s3_store: S3Store, tiny_gguf: Path, tiny_lora_gguf: Path, which: str
) -> None:
    async with reg.client() as http:
        await bring_to(http, s3_store, "tiny", "v1", "Verified", data=await trio.Path(tiny_gguf).read_bytes())
        if which == "not an adapter":
            data, why = await trio.Path(tiny_gguf).read_bytes(), "is not a LoRA adapter's"
        else:  # the adapter with its architecture renamed in place (same length: the header stays valid)
            data, why = (
                (await trio.Path(tiny_lora_gguf).read_bytes()).replace(b"llama", b"gemma", 1),
                "for architecture 'gemma'",
            )
        art = await upload(s3_store, data)
        await ok(http.post("/api/v1/models", json=lora_body("tiny-poet", "a1", art, [("tiny", "v1")])), 201)
        err = assert_envelope(await http.post("/api/v1/models/tiny-poet/a1/verify"), 422, "lora_base_invalid")
        assert why in err["message"], err["message"]
        model = await get_model(http, "tiny-poet", "a1")
        assert (model["state"], model["verification"]) == ("Candidate", None)
        events = [e for e in await audit_events(http) if e["target"] == "model/tiny-poet/a1"]
    assert [(e["action"], e["result"]) for e in events] == [("model.register", "ok"), ("model.verify", "rejected")]


async def test_an_alias_serves_an_approved_adapter_on_one_of_its_bases_and_rolls_back_with_it(
    reg: Controller, s3_store: S3Store, tiny_gguf: Path, tiny_lora_gguf: Path
) -> None:
    base = await trio.Path(tiny_gguf).read_bytes()
    async with reg.client() as http:
        await bring_to(http, s3_store, "tiny", "v1", "Approved", data=base)
        await bring_to(http, s3_store, "tiny", "v2", "Approved", data=base)
        art = await upload(s3_store, await trio.Path(tiny_lora_gguf).read_bytes())
        await ok(http.post("/api/v1/models", json=lora_body("poet", "a1", art, [("tiny", "v1")])), 201)
        for step in ("verify", "approve"):
            if step == "approve":
                eval_body = {"suite": "s", "metrics": {}, "passed": True}
                await ok(http.post("/api/v1/models/poet/a1/evaluations", json=eval_body), 201)
            await ok(http.post(f"/api/v1/models/poet/a1/{step}"))
        await ok(http.post("/api/v1/models", json=lora_body("poet", "a2", art, [("tiny", "v1")])), 201)
        before = await head_seq(http)
        promote = "/api/v1/aliases/tiny-poet/promote"
        # Bad input: each refused, nothing changes.
        wrong_base = {"model": "tiny", "version": "v2", "adapter": {"model": "poet", "version": "a1"}}
        err = assert_envelope(await http.post(promote, json=wrong_base), 422, "lora_base_invalid")
        assert "applies to tiny@v1, not tiny@v2" in err["message"]
        candidate = {"model": "tiny", "version": "v1", "adapter": {"model": "poet", "version": "a2"}}
        assert_envelope(await http.post(promote, json=candidate), 409, "model_not_approved")
        alone = {"model": "poet", "version": "a1"}
        err = assert_envelope(await http.post(promote, json=alone), 422, "lora_base_invalid")
        assert "served only on a base" in err["message"]
        not_lora = {"model": "tiny", "version": "v1", "adapter": {"model": "tiny", "version": "v2"}}
        assert_envelope(await http.post(promote, json=not_lora), 422, "lora_base_invalid")
        bad_name = {"model": "tiny", "version": "v1", "adapter": {"model": "Poet!", "version": "a1"}}
        err = assert_envelope(await http.post(promote, json=bad_name), 400, "invalid_request")
        assert "adapter.model" in err["message"]
        assert await head_seq(http) == before
        assert_envelope(await http.get("/api/v1/aliases/tiny-poet"), 404, "not_found")

        await ok(http.post(promote, json={"model": "tiny", "version": "v1"}))
        receipt = await ok(http.post(promote, json={**candidate, "adapter": {"model": "poet", "version": "a1"}}))
        assert (receipt["to"], receipt["adapter"], receipt["from_adapter"]) == (
            {"model": "tiny", "version": "v1"},
            {"model": "poet", "version": "a1"},
            None,
        )
        alias = (await ok(http.get("/api/v1/aliases/tiny-poet")))["alias"]
        assert alias["adapter"] == {"model": "poet", "version": "a1"}
        # An adapter an alias serves is in use: it is not retired.
        assert_envelope(await http.post("/api/v1/models/poet/a1/retire"), 409, "model_in_use")
        assert (await ok(http.get("/api/v1/models/poet/a1")))["aliases"] == ["tiny-poet"]
        back = await ok(http.post("/api/v1/aliases/tiny-poet/rollback"))
        assert (back["to"], back["adapter"], back["from_adapter"]) == (
            {"model": "tiny", "version": "v1"},
            None,
            {"model": "poet", "version": "a1"},
        )
        events = [e for e in await audit_events(http, before) if e["target"] == "alias/tiny-poet"]
    assert [e["detail"] for e in events][1:] == [
        "generation 2: tiny@v1 -> tiny@v1+poet@a1",
        "generation 3: tiny@v1+poet@a1 -> tiny@v1",
    ]
