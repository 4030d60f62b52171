"""The model registry over the API: a controller checking the run's OCI registry and S3 store, model
bodies, artifacts uploaded to the store, and a model brought through its lifecycle."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx

from nexa.config import ArtifactStoreConfig, ControlConfig, ModelsConfig, OciConfig, PublicKeyB64
from nexa.contracts.kvcache import GgufFigures
from tests.conftest import local_config
from tests.realparts import S3Store
from tests.support.api import Json, ok
from tests.support.s3 import write_credentials


def registry_config(tmp_path: Path, s3: S3Store, *, trusted_key: str = "") -> ControlConfig:
    """A loopback controller that checks images in the run's registry and artifacts in its S3 store."""
    creds = write_credentials(tmp_path / "s3-credentials.json", s3)
    return attrs.evolve(
        local_config(tmp_path),
        oci=OciConfig(tls_verify=False),  # the test registry is plain HTTP on 127.0.0.1
        artifacts=ArtifactStoreConfig(
            s3_endpoint=s3.endpoint, s3_region=s3.region, s3_credentials_file=str(creds), s3_tls_verify=False
        ),
        models=ModelsConfig(trusted_signing_key=PublicKeyB64(trusted_key)),
    )


def registry_config_file(tmp_path: Path, s3: S3Store, extra: str = "") -> Path:
    """What `registry_config` sets (but the trusted signing key), as the TOML a `nexa control`
    process reads, and `extra` (more TOML tables)."""
    creds = write_credentials(tmp_path / "s3-credentials.json", s3)
    config = tmp_path / "control.toml"
    config.write_text(
        "[oci]\ntls_verify = false\n"
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{s3.region}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n{extra}'
    )
    return config


def unique(name: str) -> str:
    return f"{secrets.token_hex(4)}/{name}"


@attrs.frozen
class Artifact:
    uri: str
    sha256: str
    size: int


async def upload(s3: S3Store, data: bytes | None = None) -> Artifact:
    data = data if data is not None else secrets.token_bytes(200_000)
    uri = await s3.put(unique("model.gguf"), data)
    return Artifact(uri=uri, sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def model_body(name: str, version: str, art: Artifact, **over: Any) -> Json:
    body: Json = {
        "name": name,
        "version": version,
        "artifact": {"uri": art.uri, "sha256": art.sha256, "size_bytes": art.size},
        "format": "gguf",
        "memory_bytes": 2 * 2**30,
        "provenance": {"source": "https://huggingface.co/org/tiny@abc123", "signer": "ml-platform"},
        "license": {"spdx_id": "Apache-2.0", "accepted_by": "legal@example.com", "expires_at": None},
    }
    body.update(over)
    return body


async def audit_events(http: httpx.AsyncClient, after: int = 0) -> list[Json]:
    resp = await http.get("/api/v1/audit", params={"after": after, "limit": 1000})
    assert resp.status_code == 200, resp.text
    events: list[Json] = resp.json()["events"]
    return events


async def head_seq(http: httpx.AsyncClient) -> int:
    events = await audit_events(http)
    return int(events[-1]["seq"]) if events else 0


async def get_model(http: httpx.AsyncClient, name: str, version: str) -> Json:
    resp = await http.get(f"/api/v1/models/{name}/{version}")
    assert resp.status_code == 200, resp.text
    model: Json = resp.json()["model"]
    return model


async def bring_to(
    http: httpx.AsyncClient,
    s3: S3Store,
    name: str,
    version: str,
    state: str,
    *,
    data: bytes | None = None,
    **body: Any,
) -> Json:
    """Register a model (`data`, else random bytes; `body`: more of its registration, e.g. a LoRA
    adapter's `kind` and `base`) and move it through the lifecycle to `state`, over the API."""
    art = await upload(s3, data)
    model = await ok(http.post("/api/v1/models", json=model_body(name, version, art, **body)), 201)
    path = f"/api/v1/models/{name}/{version}"
    order = ["Candidate", "Verified", "Evaluated", "Approved"]
    steps: list[Callable[[], Awaitable[httpx.Response]]] = [
        lambda: http.post(f"{path}/verify"),
        lambda: http.post(f"{path}/evaluations", json={"suite": "smoke", "metrics": {"acc": 0.9}, "passed": True}),
        lambda: http.post(f"{path}/approve"),
    ]
    target = order.index(state) if state in order else len(order) - 1
    for step in steps[:target]:
        resp = await step()
        assert resp.status_code in {200, 201}, resp.text
    if state == "Retired":
        await ok(http.post(f"{path}/retire"))
    model = await get_model(http, name, version)
    assert model["state"] == state
    return model


#: Llama-3.1-8B's figures (its config.json): 32 layers, 8 KV heads of 128, trained on 128k tokens;
#: 128 KiB of f16 KV cache a token.
LLAMA_8B = GgufFigures(
    architecture="llama",
    context_length=131072,
    block_count=32,
    embedding_length=4096,
    head_count=32,
    head_count_kv=8,
    key_length=128,
    value_length=128,
)
