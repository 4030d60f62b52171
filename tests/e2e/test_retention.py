"""Payload retention end to end: a controller with `[retention]` on the run's real SeaweedFS, a real
`nexa node` with a `sim` runtime, requests through the official `openai` SDK (`x-nexa-retention`) and
the canonical envelope (`retention`).

What a policy keeps is sealed in the bucket (a canary string in the prompt is in no byte of the
bucket, of the database file or of the controller's log), read back only by the `retention-reader`
role (audited), purged at its TTL and on demand (audited); a policy the tenant may not use is a
typed 403 and keeps nothing.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
import trio

from nexa.config import RetentionConfig, Seconds
from nexa.control.datapath.retention import MAGIC
from nexa.errors import ConfigError
from nexa.telemetry import JsonFormatter
from tests.conftest import start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, ok
from tests.support.cluster import SimCluster, new_key, sim_cluster, wait_until
from tests.support.models import registry_config
from tests.support.s3 import bucket_objects

pytestmark = pytest.mark.slow

Json = dict[str, Any]
#: The purge loop's period here: a 1-second TTL is purged within about a second of expiring.
PURGE_INTERVAL_S = Seconds(0.2)


def write_key(tmp_path: Path) -> Path:
    path = tmp_path / "retention.key"
    path.write_text(base64.b64encode(secrets.token_bytes(32)).decode() + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
async def kept(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[tuple[SimCluster, str]]:
    """A one-node sim cluster whose controller keeps retained payloads under its own prefix."""
    prefix = f"retained-{secrets.token_hex(4)}/"
    cfg = registry_config(tmp_path, s3_store)
    retention = RetentionConfig(
        key_file=str(write_key(tmp_path)), bucket=s3_store.bucket, prefix=prefix, purge_interval_s=PURGE_INTERVAL_S
    )
    cfg = attrs.evolve(cfg, retention=retention)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1) as cluster:
        await cluster.deploy("chat-a", replicas=1)
        yield cluster, prefix


async def records(cluster: SimCluster, **params: str) -> list[Json]:
    async with cluster.client() as http:
        found: list[Json] = (await ok(http.get("/api/v1/retention/records", params=params)))["records"]
    return found


async def audit(cluster: SimCluster, action: str) -> list[Json]:
    async with cluster.client() as http:
        events: list[Json] = (await ok(http.get("/api/v1/audit", params={"action": action})))["events"]
    return events


async def test_retained_payloads_are_sealed_read_by_the_reader_and_purged(
    kept: tuple[SimCluster, str],
    s3_store: S3Store,
    caplog: pytest.LogCaptureFixture,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    caplog.set_level(logging.DEBUG)
    cluster, prefix = kept
    canary = "canary-" + secrets.token_hex(8)
    messages: list[Any] = [{"role": "user", "content": f"remember {canary} please"}]
    beta = await new_key(cluster, "inference", "beta")
    reader = await new_key(cluster, "retention-reader")
    async with cluster.client() as http:
        await ok(http.put("/api/v1/retention/policies/audit-30d", json={"ttl_s": 30 * 86400, "tenants": ["acme"]}))
        await ok(http.put("/api/v1/retention/policies/short", json={"ttl_s": 1, "tenants": ["acme"]}))
        # A policy naming a tenant that does not exist changes nothing.
        bad = await http.put("/api/v1/retention/policies/nobody", json={"ttl_s": 60, "tenants": ["ghost"]})
        assert_envelope(bad, 400, "invalid_request")
        assert "ghost" in bad.json()["error"]["message"]
        for name, body in (
            ("ephemeral", {"ttl_s": 60, "tenants": ["acme"]}),
            ("zero", {"ttl_s": 0, "tenants": ["acme"]}),
            ("none", {"ttl_s": 60, "tenants": []}),
            ("twice", {"ttl_s": 60, "tenants": ["acme", "acme"]}),
        ):
            assert_envelope(await http.put(f"/api/v1/retention/policies/{name}", json=body), 400, "invalid_request")
        listed = await ok(http.get("/api/v1/retention/policies"))
        assert [p["name"] for p in listed["policies"]] == ["audit-30d", "short"]
        for purge in ({"tenant": "acme", "policy": "short"}, {"tenant": "bad tenant\u001b"}):
            assert_envelope(await http.post("/api/v1/retention/purge", json=purge), 400, "invalid_request")
    made = await cluster.cli("retention", "set-policy", "by-cli", "--ttl", "60", "--tenant", "acme", "--json")
    assert made.returncode == 0 and json.loads(made.stdout)["tenants"] == ["acme"], made.stderr
    gone = await cluster.cli("retention", "delete-policy", "by-cli")
    assert gone.returncode == 0, gone.stderr
    listed_cli = await cluster.cli("retention", "policies", "--json")
    assert [p["name"] for p in json.loads(listed_cli.stdout)["policies"]] == ["audit-30d", "short"]
    assert [e["target"] for e in await audit(cluster, "retention.policy.delete")] == ["retention-policy/by-cli"]
    sdk = openai.OpenAI(base_url=cluster.base_url, api_key=cluster.inference_key, max_retries=0, timeout=30)
    cluster.on_close.append(sdk.close)
    beta_sdk = openai.OpenAI(base_url=cluster.base_url, api_key=beta, max_retries=0, timeout=30)
    cluster.on_close.append(beta_sdk.close)
    keep = {"x-nexa-retention": "audit-30d"}

    def through_the_sdk() -> tuple[str, str]:
        chat = sdk.chat.completions.with_raw_response.create(model="chat", messages=messages, extra_headers=keep)
        stream = sdk.chat.completions.create(model="chat", messages=messages, stream=True, extra_headers=keep)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed
        # Not for this tenant, or no such policy: a typed 403, and the SDK's usual exception.
        for name in ("audit-30d", "no-such-policy"):
            with pytest.raises(openai.PermissionDeniedError) as refused:
                beta_sdk.chat.completions.create(
                    model="chat", messages=messages, extra_headers={"x-nexa-retention": name}
                )
            assert refused.value.code == "retention_not_permitted"
            assert "ephemeral" in refused.value.message
        return chat.headers["x-request-id"], chat.parse().choices[0].message.content or ""

    unary_id, unary_answer = await trio.to_thread.run_sync(through_the_sdk)
    envelope = {
        "version": "nexa.v1",
        "idempotency_key": "k-" + secrets.token_hex(4),
        "workload_id": "w-" + secrets.token_hex(4),
        "capability": "chat",
        "model": "chat",
        "payload": {"messages": messages},
        "retention": "audit-30d",
    }
    async with cluster.client(cluster.inference_key) as http:
        done = await ok(http.post("/api/v1/workloads", json=envelope))
        assert done["state"] == "succeeded"
        streamed_envelope = {**envelope, "idempotency_key": "k-s", "workload_id": "w-s", "stream": True}
        sse = await http.post("/api/v1/workloads", json=streamed_envelope)
        assert sse.status_code == 200 and "event: end" in sse.text
    async with cluster.client(beta) as http:
        refused = await http.post("/api/v1/workloads", json={**envelope, "idempotency_key": "k-beta"})
        assert_envelope(refused, 403, "retention_not_permitted")

    # Written after each answer, off the token path: three records, all the tenant's, none of beta.
    found = await wait_until("four retained records", lambda: _count(cluster, 4))
    assert {r["tenant"] for r in found} == {"acme"} and {r["policy"] for r in found} == {"audit-30d"}
    assert sorted(r["api"] for r in found) == ["openai", "openai", "workloads", "workloads"]
    assert await records(cluster, tenant="beta") == []
    unary = next(r for r in found if r["request_id"] == unary_id)

    # The retention-reader role reads one, decrypted by the controller; every other role is refused.
    async with cluster.client(reader) as http:
        payload = await ok(http.get(f"/api/v1/retention/records/{unary['id']}"))
        assert canary in payload["request"] and json.loads(payload["request"])["messages"] == messages
        assert json.loads(payload["answer"])["choices"][0]["message"]["content"] == unary_answer
        for r in found:
            one = await ok(http.get(f"/api/v1/retention/records/{r['id']}"))
            assert canary in one["request"] and one["answer"]
        streamed = next(r for r in found if r["api"] == "openai" and r["id"] != unary["id"])
        assert (await ok(http.get(f"/api/v1/retention/records/{streamed['id']}")))["answer"].startswith("data: ")
    for key in (cluster.controller.admin_key, cluster.inference_key, await new_key(cluster, "audit")):
        async with cluster.client(key) as http:
            assert_envelope(await http.get(f"/api/v1/retention/records/{unary['id']}"), 403, "forbidden")
    reads = await audit(cluster, "retention.read")
    assert len(reads) == 1 + 4 + 1 and {e["target"] for e in reads} == {f"retained/{r['id']}" for r in found}
    policy_events = await audit(cluster, "retention.policy.set")
    assert sorted(e["target"] for e in policy_events) == [
        "retention-policy/audit-30d",
        "retention-policy/by-cli",
        "retention-policy/short",
    ]
    cli = await cluster.cli("retention", "show", unary["id"], key=reader)
    assert cli.returncode == 0, cli.stderr
    assert canary in json.loads(cli.stdout)["request"]

    # In the bucket: one sealed object per record, and the canary in no byte of it (nor anywhere
    # in the bucket), in no byte of the database, in no line the controller logged.
    objects = await bucket_objects(s3_store, prefix)
    assert sorted(objects) == sorted(f"{prefix}acme/{r['id']}" for r in found)
    assert all(blob.startswith(MAGIC) for blob in objects.values())
    everything = await bucket_objects(s3_store)
    assert all(canary.encode() not in blob for blob in everything.values())
    # SeaweedFS's own files too (its volumes, the filer's metadata), read as bytes on disk.
    weed_files = [p for p in tmp_path_factory.getbasetemp().glob("seaweedfs*/data/**/*") if p.is_file()]
    assert weed_files and not [p for p in weed_files if canary.encode() in p.read_bytes()]
    for name in ("control.db", "control.db-wal"):
        path = cluster.controller.state_dir / name
        assert not path.exists() or canary.encode() not in path.read_bytes(), name
    formatter = JsonFormatter()
    logged = [formatter.format(r) for r in caplog.records]
    assert logged and not [line for line in logged if canary in line]

    # On demand: by request id, then by policy; the objects go with the records, audited.
    cli = await cluster.cli("retention", "purge", "--request-id", unary_id)
    assert cli.returncode == 0 and "purged 1" in cli.stdout, cli.stderr
    assert f"{prefix}acme/{unary['id']}" not in await bucket_objects(s3_store, prefix)
    async with cluster.client(reader) as http:
        assert_envelope(await http.get(f"/api/v1/retention/records/{unary['id']}"), 404, "not_found")
    async with cluster.client() as http:
        purged = await ok(http.post("/api/v1/retention/purge", json={"policy": "audit-30d"}))
        assert purged == {"purged": 3}
        assert_envelope(await http.post("/api/v1/retention/purge", json={}), 400, "invalid_request")
    assert await records(cluster) == [] and await bucket_objects(s3_store, prefix) == {}
    purges = await audit(cluster, "retention.purge")
    assert [e["detail"].split(":")[0] for e in purges] == [f"request_id={unary_id}", "policy=audit-30d"]

    # At its TTL: a 1-second policy's record and object are gone soon after, audited by the controller.
    def short_lived() -> None:
        sdk.chat.completions.create(model="chat", messages=messages, extra_headers={"x-nexa-retention": "short"})

    await trio.to_thread.run_sync(short_lived)
    [short] = await wait_until("the short-lived record", lambda: records(cluster, policy="short"))
    assert await bucket_objects(s3_store, prefix)
    await wait_until("the TTL purge", lambda: _none_left(cluster, s3_store, prefix))
    expired = (await audit(cluster, "retention.purge"))[-1]
    assert expired["actor_key_id"] is None and short["id"] in expired["detail"]


async def _count(cluster: SimCluster, n: int) -> list[Json] | None:
    found = await records(cluster)
    return found if len(found) == n else None


async def _none_left(cluster: SimCluster, s3: S3Store, prefix: str) -> bool:
    return not await records(cluster) and not await bucket_objects(s3, prefix)


async def test_a_bad_retention_key_file_fails_the_start_saying_what_to_do(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store
) -> None:
    bad = tmp_path / "retention.key"
    bad.write_text("not a key")
    bad.chmod(0o600)
    cfg = attrs.evolve(
        registry_config(tmp_path, s3_store), retention=RetentionConfig(key_file=str(bad), bucket=s3_store.bucket)
    )
    with pytest.raises(ConfigError, match="nexa keygen --backup --out FILE"):
        await start_controller(nursery, cfg)
