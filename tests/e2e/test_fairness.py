"""Fair quotas and queues, and envelope fields that are honoured, through the whole stack: a real
controller's HTTP front end, real `nexa node` agents on 127.0.0.11 and .12 and their `sim` runtimes.

- 50 concurrent requests overshoot a tenant's tokens-per-minute limit by at most one reservation;
- a tenant flooding a model's queue cannot keep another tenant's request out of it;
- priority is an entitlement: a key not granted `interactive` asking for it gets 403
  priority_not_granted, and a granted tenant's interactive flood cannot time out another
  tenant's standard requests;
- an idempotency key replayed with another body is refused (422), and `data_class` routes only to
  nodes whose inventory allows it (typed 503 when none does).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from nexa.config import PriorityOverGrant
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


async def test_an_interactive_flood_cannot_time_out_another_tenants_standard_requests(
    narrow_cluster: SimCluster,
) -> None:
    cluster = narrow_cluster
    flooder = await new_key(cluster, "inference", "alpha", priorities=["interactive", "standard"])
    plain = await new_key(cluster, "inference", "beta")  # the default grant: standard and batch
    # Not granted interactive: a typed 403 through the official SDK, and nothing is run.
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=plain, max_retries=0, timeout=30)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await client.chat.completions.create(
            model="chat", messages=MESSAGES, extra_headers={"x-nexa-priority": "interactive"}
        )
    assert refused.value.code == "priority_not_granted"
    assert "standard, batch" in refused.value.message
    await client.close()

    flood_answers: list[int] = []
    beta: list[tuple[int, str]] = []
    beta_done = trio.Event()

    async def flood(http: httpx.AsyncClient) -> None:
        # Each of A's loopers keeps one interactive request waiting or running until B is done:
        # with strict priority B would get no slot until its deadline.
        while not beta_done.is_set():
            resp = await http.post(
                "/v1/chat/completions",
                json={"model": "chat", "messages": MESSAGES},
                headers={"x-nexa-priority": "interactive"},
            )
            flood_answers.append(resp.status_code)

    async def standard(http: httpx.AsyncClient) -> None:
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": "chat", "messages": MESSAGES},
            headers={"x-nexa-deadline-ms": "5000"},  # standard: the default class
        )
        beta.append((resp.status_code, "" if resp.status_code == 200 else resp.json()["error"]["code"]))

    async with inference(cluster, flooder) as a, inference(cluster, plain) as b, trio.open_nursery() as nursery:
        for _ in range(5):  # with 3 of B's: 7 waiting at most, below queue_depth 8
            nursery.start_soon(flood, a)
        with trio.fail_after(20):
            while len(flood_answers) < 10:  # noqa: ASYNC110 - the flood is under way
                await trio.sleep(0.05)
        for _ in range(3):  # three rounds of three concurrent standard requests
            async with trio.open_nursery() as round_:
                for _ in range(3):
                    round_.start_soon(standard, b)
        beta_done.set()
    assert beta == [(200, "")] * 9
    assert set(flood_answers) == {200} and len(flood_answers) >= 10
    # The interactive flood held the queue the whole time: it was served throughout.
    assert await metric(cluster, "nexa_gateway_queue_depth", model="chat", priority="interactive") == 0


async def test_with_priority_over_grant_lower_an_ungranted_class_is_served_lower(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    async with gateway_cluster(
        nursery, tmp_path, s3_store, test_images, priority_over_grant=PriorityOverGrant.LOWER
    ) as cluster:
        await cluster.deploy("chat-a", replicas=1)
        plain = await new_key(cluster, "inference", "beta")  # standard and batch
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=plain, max_retries=0, timeout=30)
        answer = await client.chat.completions.create(
            model="chat", messages=MESSAGES, extra_headers={"x-nexa-priority": "interactive"}
        )
        assert answer.choices[0].message.content
        await client.close()
        envelope: Json = {
            "version": "nexa.v1",
            "idempotency_key": "lower-1",
            "workload_id": "wl-lower",
            "capability": "chat",
            "model": "chat",
            "payload": {"messages": MESSAGES},
            "latency_class": "realtime",
        }
        async with inference(cluster, plain) as http:
            ran = await ok(http.post("/api/v1/workloads", json=envelope))
            assert (ran["state"], ran["priority"]) == ("succeeded", "standard")  # lowered, and shown so
            assert (await ok(http.get("/api/v1/workloads/wl-lower")))["priority"] == "standard"
