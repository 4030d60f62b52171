"""`control.datapath.retention.Retention` on both stores (`store_cfg`: SQLite, then a real PostgreSQL) and the
run's real SeaweedFS: a capture kept is sealed into the bucket and recorded, read back (audited),
and purged at its TTL; the bound on waiting writes refuses before anything runs."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from nexa.config import RetentionConfig, StoreConfig
from nexa.contracts.domain import Actor, KeyId, Role, TenantId
from nexa.contracts.retention import RetentionPolicySet
from nexa.control import store as st
from nexa.control.datapath.retention import MAGIC, Retention
from nexa.errors import Overloaded, RetentionNotPermitted, RetentionUnavailable
from nexa.s3.client import S3Client
from nexa.telemetry import Metrics
from tests.realparts import S3Store
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401
from tests.support.s3 import bucket_objects

ADMIN = Actor(key_id=KeyId("admin1"), role=Role.ADMIN)
READER = Actor(key_id=KeyId("reader1"), role=Role.RETENTION_READER)
ACME = TenantId("acme")


@pytest.fixture
async def retention(
    tmp_path: Path, store_cfg: StoreConfig, s3_store: S3Store, nursery: trio.Nursery
) -> AsyncIterator[tuple[Retention, str]]:
    prefix = f"unit-{secrets.token_hex(4)}/"
    cfg = RetentionConfig(bucket=s3_store.bucket, prefix=prefix, max_pending=2)
    async with (
        st.open_store(tmp_path, store_cfg) as store,
        S3Client(s3_store.endpoint, region=s3_store.region, credentials=s3_store.credentials) as s3,
    ):
        kept = Retention(
            cfg, store, Metrics(), s3=s3, master_key=secrets.token_bytes(32), policies=[], tenant_exists=lambda _t: True
        )
        await nursery.start(kept.run)
        yield kept, prefix


async def test_kept_sealed_read_and_purged_at_ttl(retention: tuple[Retention, str], s3_store: S3Store) -> None:
    kept, prefix = retention
    await kept.set_policy(ADMIN, "brief", RetentionPolicySet(ttl_s=1, tenants=[ACME]))
    with pytest.raises(RetentionNotPermitted):
        kept.capture(TenantId("beta"), "brief", "req_1", "openai", b"{}")
    capture = kept.capture(ACME, "brief", "req_1", "openai", b'{"prompt": "canary-unit"}')
    assert capture is not None
    capture.add(b'{"answer": ')
    capture.add(b'"fine"}')
    capture.keep()
    with trio.fail_after(10):
        while not (found := await kept.page(request_id="req_1", tenant=None, policy=None, after=None, limit=10)):  # noqa: ASYNC110 - polling the store
            await trio.sleep(0.05)
    [record] = found
    assert (record.request_bytes, record.answer_bytes) == (25, 18)
    [blob] = (await bucket_objects(s3_store, prefix)).values()
    assert blob.startswith(MAGIC) and b"canary-unit" not in blob
    payload = await kept.read(READER, record.id)
    assert json.loads(payload.request) == {"prompt": "canary-unit"} and payload.answer == '{"answer": "fine"}'
    assert await kept.purge_expired(now=record.expires_at - 0.5) == 0
    assert await kept.purge_expired(now=record.expires_at) == 1
    assert await bucket_objects(s3_store, prefix) == {}
    assert await kept.page(request_id=None, tenant="acme", policy=None, after=None, limit=10) == []


async def test_waiting_writes_are_bounded_and_ephemeral_keeps_nothing(retention: tuple[Retention, str]) -> None:
    kept, _ = retention
    await kept.set_policy(ADMIN, "long", RetentionPolicySet(ttl_s=3600, tenants=[ACME]))
    assert kept.capture(ACME, "ephemeral", "req_0", "openai", b"{}") is None
    first = kept.capture(ACME, "long", "req_1", "openai", b"{}")
    second = kept.capture(ACME, "long", "req_2", "openai", b"{}")
    assert first is not None and second is not None
    with pytest.raises(Overloaded):
        kept.capture(ACME, "long", "req_3", "openai", b"{}")
    first.drop()
    first.drop()  # once only
    third = kept.capture(ACME, "long", "req_3", "openai", b"{}")
    assert third is not None
    with pytest.raises(Overloaded):
        kept.capture(ACME, "long", "req_4", "openai", b"{}")


async def test_without_a_key_every_retention_but_ephemeral_is_unavailable(tmp_path: Path) -> None:
    async with st.open_store(tmp_path, StoreConfig()) as store:
        off = Retention(RetentionConfig(), store, Metrics(), s3=None, master_key=None, policies=[])
        assert off.capture(ACME, "ephemeral", "req_1", "openai", b"{}") is None
        with pytest.raises(RetentionUnavailable, match="send retention: ephemeral"):
            off.capture(ACME, "long", "req_1", "openai", b"{}")
