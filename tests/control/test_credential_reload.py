"""S3 credentials files re-read while the controller (and the node's artifact cache) run, against
the real SeaweedFS store of `tests/realparts.py`; the AWS INI profile and the AWS_* variables."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import trio

from nexa.config import ArtifactsConfig
from nexa.contracts.runtime import ArtifactRef
from nexa.errors import ArtifactUnavailable
from nexa.node.artifacts import ArtifactCache
from nexa.s3.credentials import s3_credentials
from tests.conftest import start_controller
from tests.realparts import S3Store
from tests.support.api import assert_envelope, metric, ok
from tests.support.models import head_seq, model_body, registry_config, upload

TIMEOUT_S = 60


def _replace(path: Path, text: str) -> None:
    """A new file renamed over the old one, as operators' tools (and secret managers) write them."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)


def _ini(s3: S3Store, *, profile: str = "default", secret: str | None = None) -> str:
    secret = secret if secret is not None else s3.credentials.secret_access_key
    return f"[{profile}]\naws_access_key_id = {s3.credentials.access_key_id}\naws_secret_access_key = {secret}\n"


async def test_the_controller_rereads_its_s3_credentials_file_without_a_restart(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    creds = Path(cfg.artifacts.s3_credentials_file)
    _replace(creds, _ini(s3_store, secret="not-the-secret-0123456789"))  # wrong from the start
    c = await start_controller(nursery, cfg)
    with trio.fail_after(TIMEOUT_S):
        async with c.client() as http:
            for version in ("v1", "v2", "v3"):
                art = await upload(s3_store)
                await ok(http.post("/api/v1/models", json=model_body("tiny", version, art)), 201)
            before = await head_seq(http)
            refused = assert_envelope(await http.post("/api/v1/models/tiny/v1/verify"), 503, "unavailable")
            assert "SignatureDoesNotMatch" in str(refused["message"])
            assert await head_seq(http) == before  # a 503 changes nothing

            _replace(creds, _ini(s3_store))  # the right secret, same format: taken at the next use
            assert (await ok(http.post("/api/v1/models/tiny/v1/verify")))["state"] == "Verified"

            _replace(creds, "[default]\naws_access_key_id = half-written\n")  # invalid: the last good stays
            assert (await ok(http.post("/api/v1/models/tiny/v2/verify")))["state"] == "Verified"
            assert await metric(c, "nexa_credential_reload_failures_total", file="s3") == 1

            _replace(creds, _ini(s3_store, profile="other"))  # no [default] profile: refused, kept
            assert (await ok(http.post("/api/v1/models/tiny/v3/verify")))["state"] == "Verified"
            assert await metric(c, "nexa_credential_reload_failures_total", file="s3") == 2
    c.stopping.set()


async def test_an_ini_profile_and_the_aws_variables_reach_the_store(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    for sub in ("ini", "env"):
        (tmp_path / sub).mkdir()
    cfg = registry_config(tmp_path / "ini", s3_store)
    creds = Path(cfg.artifacts.s3_credentials_file)
    _replace(creds, _ini(s3_store, secret="wrong-secret-of-the-default") + "\n" + _ini(s3_store, profile="nexa"))
    c = await start_controller(nursery, attrs.evolve(cfg, artifacts=attrs.evolve(cfg.artifacts, s3_profile="nexa")))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_store.credentials.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_store.credentials.secret_access_key)
    env_cfg = registry_config(tmp_path / "env", s3_store)
    env_c = await start_controller(
        nursery, attrs.evolve(env_cfg, artifacts=attrs.evolve(env_cfg.artifacts, s3_credentials_file=""))
    )
    with trio.fail_after(TIMEOUT_S):
        for controller in (c, env_c):
            art = await upload(s3_store)
            async with controller.client() as http:
                await ok(http.post("/api/v1/models", json=model_body("tiny", "v1", art)), 201)
                assert (await ok(http.post("/api/v1/models/tiny/v1/verify")))["state"] == "Verified"
    c.stopping.set()
    env_c.stopping.set()


async def test_the_node_artifact_cache_rereads_its_credentials_file(tmp_path: Path, s3_store: S3Store) -> None:
    creds = tmp_path / "s3-credentials"
    _replace(creds, _ini(s3_store, secret="not-the-secret-0123456789"))
    cfg = ArtifactsConfig(s3_endpoint=s3_store.endpoint, s3_region=s3_store.region, s3_credentials_file=str(creds))
    source = s3_credentials(cfg.s3_credentials_file, profile=cfg.s3_profile, environ={})
    with trio.fail_after(TIMEOUT_S):
        art = await upload(s3_store)
        ref = ArtifactRef(uri=art.uri, sha256=art.sha256, size_bytes=art.size)
        async with ArtifactCache(cfg, state_dir=tmp_path / "node", credentials=source) as cache:
            with pytest.raises(ArtifactUnavailable, match="SignatureDoesNotMatch"):
                await cache.fetch(ref)
            _replace(creds, _ini(s3_store))
            fetched = await cache.fetch(ref)
            assert fetched.stat().st_size == art.size
