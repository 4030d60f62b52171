"""Model versions whose artifact is a manifest (a directory of files under an S3 prefix), through the
real HTTP API and a real S3 store (SeaweedFS): registration computes the digest and checks the store
holds every file; verification streams each file and names the one that does not match; a signature
signs the manifest's digest; bad manifests are typed 4xx naming the field and change nothing.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa.contracts.manifest import ArtifactFile, Manifest
from nexa.security import SigningKey, sign_digest
from tests.conftest import Controller, start_controller
from tests.realparts import S3Store
from tests.support.api import assert_envelope, ok
from tests.support.models import audit_events, get_model, registry_config

Json = dict[str, Any]

HF_FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}',
    "generation_config.json": b'{"do_sample": false}',
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
    "model-00001-of-00002.safetensors": secrets.token_bytes(150_000),
    "model-00002-of-00002.safetensors": secrets.token_bytes(120_000),
}


async def upload_dir(s3: S3Store, files: dict[str, bytes]) -> tuple[str, list[Json]]:
    """Upload `files` under a fresh prefix; the prefix URI and the manifest's file entries."""
    prefix = f"{secrets.token_hex(4)}/models/llama/v1/"
    for path, data in files.items():
        await s3.put(prefix + path, data)
    entries = [
        {"path": path, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for path, data in files.items()
    ]
    return s3.uri(prefix), entries


def manifest_body(name: str, version: str, uri: str, files: list[Json], entry: str = ".", **over: Any) -> Json:
    body: Json = {
        "name": name,
        "version": version,
        "artifact": {"uri": uri, "files": files, "entry": entry},
        "format": "safetensors",
        "memory_bytes": 40 * 2**30,
        "provenance": {"source": "https://huggingface.co/org/llama@abc123", "signer": ""},
        "license": {"spdx_id": "Apache-2.0", "accepted_by": "legal@example.com", "expires_at": None},
    }
    body.update(over)
    return body


def digest_of(files: list[Json], entry: str = ".") -> str:
    return Manifest(files=[ArtifactFile(**f) for f in files], entry=entry).digest


async def model_count(http: httpx.AsyncClient) -> int:
    return len((await ok(http.get("/api/v1/models")))["models"])


async def test_a_manifest_is_registered_with_its_digest_and_verified_file_by_file(
    reg: Controller, s3_store: S3Store
) -> None:
    uri, files = await upload_dir(s3_store, HF_FILES)
    async with reg.client() as http:
        # Listed out of order: the record keeps them in path order, and the digest is over that.
        body = manifest_body("llama", "v1", uri, list(reversed(files)))
        model = await ok(http.post("/api/v1/models", json=body), 201)
        art = model["artifact"]
        assert art["sha256"] == digest_of(files)
        assert art["size_bytes"] == sum(len(d) for d in HF_FILES.values())
        assert [f["path"] for f in art["files"]] == sorted(HF_FILES)
        assert (art["uri"], art["entry"], model["state"]) == (uri, ".", "Candidate")
        verified = await ok(http.post("/api/v1/models/llama/v1/verify"))
    assert verified["state"] == "Verified"
    assert verified["verification"]["sha256"] == art["sha256"]
    assert verified["verification"]["size_bytes"] == art["size_bytes"]


async def test_a_tampered_shard_fails_verification_naming_it(reg: Controller, s3_store: S3Store) -> None:
    uri, files = await upload_dir(s3_store, HF_FILES)
    async with reg.client() as http:
        await ok(http.post("/api/v1/models", json=manifest_body("llama", "v1", uri, files)), 201)
        shard = "model-00002-of-00002.safetensors"
        tampered = bytearray(HF_FILES[shard])
        tampered[1000] ^= 0xFF  # same size, other bytes
        prefix = uri.removeprefix(f"s3://{s3_store.bucket}/")
        await s3_store.put(prefix + shard, bytes(tampered))
        err = assert_envelope(await http.post("/api/v1/models/llama/v1/verify"), 422, "artifact_digest_mismatch")
        assert shard in str(err["message"])
        assert "model-00001" not in str(err["message"])
        model = await get_model(http, "llama", "v1")
        last = (await audit_events(http))[-1]
    assert (model["state"], model["verification"]) == ("Candidate", None)
    assert (last["action"], last["result"]) == ("model.verify", "rejected")


async def test_a_signature_signs_the_manifest_digest(
    signed_reg: Controller, s3_store: S3Store, signer: SigningKey
) -> None:
    uri, files = await upload_dir(s3_store, HF_FILES)
    digest = digest_of(files)
    async with signed_reg.client() as http:
        body = manifest_body("llama", "v1", uri, files, signature=sign_digest(signer, digest))
        await ok(http.post("/api/v1/models", json=body), 201)
        model = await ok(http.post("/api/v1/models/llama/v1/verify"))
        assert model["verification"]["signature_key"] == signer.public.fingerprint
        # A signature over one file's digest instead of the manifest's does not verify.
        one_file = files[0]["sha256"]
        body = manifest_body("llama", "v2", uri, files, signature=sign_digest(signer, one_file))
        await ok(http.post("/api/v1/models", json=body), 201)
        assert_envelope(await http.post("/api/v1/models/llama/v2/verify"), 422, "signature_rejected")


@pytest.mark.parametrize(
    ("change", "status", "code", "named"),
    [
        ("missing_file", 422, "artifact_missing", "artifact.files[0]"),
        ("wrong_size", 422, "artifact_size_mismatch", "artifact.files[0]"),
        ("outside", 400, "invalid_request", "artifact.files[0].path"),
        ("absolute", 400, "invalid_request", "artifact.files[0].path"),
        ("long_segment", 400, "invalid_request", "artifact.files[0].path"),
        ("duplicate", 400, "invalid_request", "artifact.files[1].path"),
        ("entry", 400, "invalid_request", "artifact.entry"),
        ("digest", 400, "invalid_request", "artifact.sha256"),
        ("total", 400, "invalid_request", "artifact.size_bytes"),
        ("not_a_prefix", 400, "invalid_request", "artifact.uri"),
        ("bad_sha256", 400, "invalid_request", "artifact.files[0].sha256"),
    ],
)
async def test_a_bad_manifest_is_typed_naming_the_field_and_changes_nothing(
    reg: Controller, s3_store: S3Store, change: str, status: int, code: str, named: str
) -> None:
    uri, files = await upload_dir(s3_store, HF_FILES)
    files = sorted(files, key=lambda f: f["path"])
    first = files[0]
    artifact: Json = {"uri": uri, "files": files, "entry": "."}
    if change == "missing_file":
        files[0] = {**first, "path": "never-uploaded.json"}
    elif change == "wrong_size":
        files[0] = {**first, "size_bytes": first["size_bytes"] + 1}
    elif change == "outside":
        files[0] = {**first, "path": "../other-model/config.json"}
    elif change == "absolute":
        files[0] = {**first, "path": "/etc/passwd"}
    elif change == "long_segment":  # a name no node's file system takes
        files[0] = {**first, "path": "weights/" + "w" * 256}
    elif change == "duplicate":
        files[1] = {**files[1], "path": first["path"]}
    elif change == "entry":
        artifact["entry"] = "weights/model.safetensors"
    elif change == "digest":
        artifact["sha256"] = "0" * 64
    elif change == "total":
        artifact["size_bytes"] = 1
    elif change == "not_a_prefix":
        artifact["uri"] = uri.rstrip("/")
    elif change == "bad_sha256":
        files[0] = {**first, "sha256": "XYZ"}
    body = manifest_body("llama", "v1", uri, files)
    body["artifact"] = artifact
    async with reg.client() as http:
        before = await model_count(http)
        err = assert_envelope(await http.post("/api/v1/models", json=body), status, code)
        assert named in str(err["message"]), err["message"]
        assert await model_count(http) == before
        missing = await http.get("/api/v1/models/llama/v1")
    assert missing.status_code == 404


async def test_a_single_object_registered_the_old_way_still_verifies(reg: Controller, s3_store: S3Store) -> None:
    data = secrets.token_bytes(50_000)
    key = f"{secrets.token_hex(4)}/tiny.gguf"
    uri = await s3_store.put(key, data)
    body = manifest_body("tiny", "v1", uri, [])
    body["artifact"] = {"uri": uri, "sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
    body["format"] = "gguf"
    async with reg.client() as http:
        model = await ok(http.post("/api/v1/models", json=body), 201)
        assert (model["artifact"]["files"], model["artifact"]["entry"]) == ([], "")
        verified = await ok(http.post("/api/v1/models/tiny/v1/verify"))
    assert verified["state"] == "Verified"


async def test_an_artifact_outside_the_allowed_prefixes_is_refused_before_the_store_is_asked(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store
) -> None:
    """Issue 30 point 7: `[artifacts] allowed_prefixes` bounds what a model may name. A model outside
    it is refused at registration (and verification) without the store being asked: the answer quotes
    no digest or size of the object it named, even one that exists with other bytes."""
    uri, files = await upload_dir(s3_store, HF_FILES)  # under <random>/models/llama/v1/
    inside = uri.removeprefix("s3://").split("/models/")[0] + "/models/"
    cfg = registry_config(tmp_path, s3_store)
    cfg = attrs.evolve(cfg, artifacts=attrs.evolve(cfg.artifacts, allowed_prefixes=(inside,)))
    c = await start_controller(nursery, cfg)
    try:
        async with c.client() as http:
            await ok(http.post("/api/v1/models", json=manifest_body("llama", "v1", uri, files)), 201)
            await ok(http.post("/api/v1/models/llama/v1/verify"))
            outside = f"s3://{s3_store.bucket}/elsewhere/"
            wrong = [{**files[0], "size_bytes": 1, "sha256": "0" * 64}]  # the store holds other bytes there
            await s3_store.put("elsewhere/" + files[0]["path"], HF_FILES[files[0]["path"]])
            for bad in (outside, uri.replace("/models/", "/models/../secret/")):
                err = assert_envelope(
                    await http.post("/api/v1/models", json=manifest_body("llama", "v2", bad, wrong)),
                    400,
                    "invalid_request",
                )
                assert "allowed_prefixes" in str(err["message"]) and inside in str(err["message"])
                # (the allowed prefix the message quotes is random hex, which may hold the size's digits)
                assert str(len(HF_FILES[files[0]["path"]])) not in str(err["message"]).replace(inside, "")
            assert [m["version"] for m in (await ok(http.get("/api/v1/models")))["models"]] == ["v1"]
    finally:
        c.stopping.set()
