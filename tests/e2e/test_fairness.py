"""Fair quotas and queues, and envelope fields that are honoured, through the whole stack: a real
controller's HTTP front end, real `nexa node` agents on 127.0.0.11 and .12 and their `sim` runtimes.

- 50 concurrent requests overshoot a tenant's tokens-per-minute limit by at most one reservation;
- a tenant flooding a model's queue cannot keep another tenant's request out of it;
- an idempotency key replayed with another body is refused (422), and `data_class` routes only to
  nodes whose inventory allows it (typed 503 when none does).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import MESSAGES, SimCluster, gateway_cluster, new_key

pytestmark = pytest.mark.slow
Json = dict[str, Any]


@pytest.fixture
async def narrow_cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[SimCluster]:
    """One replica taking one request at a time, and 8 places in the queue."""
    async with gateway_cluster(
        nursery, tmp_path, s3_store, test_images, queue_depth=8, max_inflight_per_replica=1
    ) as c:
        await c.deploy("chat-a", replicas=1)
        yield c


def inference(cluster: SimCluster, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=cluster.controller.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


async def metric(cluster: SimCluster, name: str, **labels: str) -> float:
    async with cluster.client() as http:
        text = (await http.get("/metrics")).text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == wanted:
            return float(m.group(3))
    return 0.0


async def test_fifty_concurrent_requests_overshoot_a_token_limit_by_at_most_one_reservation(
    cluster: SimCluster,
) -> None:
    limit = 100
    async with cluster.client() as http:
        await ok(http.put(f"/api/v1/quotas/{cluster.tenant}", json={"tokens_per_minute": limit}))
    # "hello there" and "user": 15 characters → 4 prompt tokens estimated, plus max_tokens 20.
    reservation = 4 + 20
    statuses: list[int] = []
    codes: list[str] = []

    async def one(http: httpx.AsyncClient) -> None:
        resp = await http.post("/v1/chat/completions", json={"model": "chat", "messages": MESSAGES, "max_tokens": 20})
        statuses.append(resp.status_code)
        if resp.status_code != 200:
            codes.append(resp.json()["error"]["code"])

    async with inference(cluster, cluster.inference_key) as http, trio.open_nursery() as nursery:
        for _ in range(50):
            nursery.start_soon(one, http)
    served = statuses.count(200)
    assert served >= 1
    assert set(codes) == {"quota_exceeded"} and statuses.count(429) == 50 - served
    async with cluster.client() as http:
        use = (await ok(http.get(f"/api/v1/quotas/{cluster.tenant}")))["use"]
    # Each served request used 2 prompt + 8 completion tokens (the sim's answer): all settled now.
    assert use["concurrent_requests"] == 0
    assert use["tokens_last_minute"] == served * 10
    assert use["tokens_last_minute"] <= limit + reservation
    # Counted at finish only (as before), all 50 would have been admitted at once: 500 tokens.


async def test_a_tenant_flooding_the_queue_does_not_keep_another_tenant_out(narrow_cluster: SimCluster) -> None:
    cluster = narrow_cluster
    key_b = await new_key(cluster, "inference", "beta")
    results: dict[str, list[tuple[int, str]]] = {"a": [], "b": []}
    for node in cluster.nodes:
        node.set_faults(hang="before")  # the one slot stays taken until A's first request's deadline

    async def one(http: httpx.AsyncClient, who: str, headers: dict[str, str] | None = None) -> None:
        resp = await http.post("/v1/chat/completions", json={"model": "chat", "messages": MESSAGES}, headers=headers)
        code = "" if resp.status_code == 200 else resp.json()["error"]["code"]
        results[who].append((resp.status_code, code))

    async with (
        inference(cluster, cluster.inference_key) as a,
        inference(cluster, key_b) as b,
        trio.open_nursery() as nursery,
    ):
        for _ in range(12):  # 1 in the slot, 8 waiting, 3 refused at once
            nursery.start_soon(one, a, "a", {"x-nexa-deadline-ms": "8000"})

        async def flooded() -> bool:
            depth = await metric(cluster, "nexa_gateway_queue_depth", model="chat", priority="standard")
            return len(results["a"]) >= 3 and depth == 8

        with trio.fail_after(20):
            while not await flooded():  # noqa: ASYNC110 - polling the API
                await trio.sleep(0.05)
        assert results["a"] == [(429, "queue_full")] * 3  # A alone finds the queue full
        for node in cluster.nodes:
            node.set_faults()  # answers again once the hung request's deadline frees the slot
        with trio.fail_after(30):
            await one(b, "b")  # takes A's newest place, and is served in its turn
        assert results["b"] == [(200, "")]
        assert await metric(cluster, "nexa_gateway_queue_displaced_total", model="chat") == 1
    # The 3 refused at once, and the one that gave its place to B; the rest waited for their deadline.
    assert results["a"].count((429, "queue_full")) == 4
    assert len(results["a"]) == 12


async def test_replayed_keys_and_data_classes_through_the_envelope(cluster: SimCluster) -> None:
    envelope: Json = {
        "version": "nexa.v1",
        "idempotency_key": "order-7",
        "workload_id": "wl-7",
        "capability": "chat",
        "model": "chat",
        "payload": {"messages": MESSAGES},
        "data_class": "public",  # what the sim nodes' inventory allows (the default)
        "latency_class": "realtime",
    }
    async with inference(cluster, cluster.inference_key) as http:
        first = await ok(http.post("/api/v1/workloads", json=envelope))
        assert first["state"] == "succeeded" and first["priority"] == "interactive"
        again = await ok(http.post("/api/v1/workloads", json=envelope))
        assert again["receipt"] == first["receipt"]
        changed = {**envelope, "payload": {"messages": [{"role": "user", "content": "something else"}]}}
        reused = await http.post("/api/v1/workloads", json=changed)
        assert reused.status_code == 422, reused.text
        assert reused.json()["error"]["code"] == "idempotency_key_reused"
        assert (await ok(http.get("/api/v1/workloads/wl-7/receipt"))) == first["receipt"]  # unchanged
        secret = {**envelope, "idempotency_key": "order-8", "workload_id": "wl-8", "data_class": "confidential"}
        refused = await http.post("/api/v1/workloads", json=secret)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "no_replica_for_data_class"
        assert (await http.get("/api/v1/workloads/wl-8")).status_code == 404  # refused before admission: not stored
        header = await http.post(
            "/v1/chat/completions",
            json={"model": "chat", "messages": MESSAGES},
            headers={"x-nexa-data-class": "confidential"},
        )
        assert header.status_code == 503 and header.json()["error"]["code"] == "no_replica_for_data_class"
