"""Routing on live load, end to end: two `sim` replicas on real `nexa node` agents, one told by its
faults file to report a long queue on its vLLM-named `/metrics`; the node scrapes it, the heartbeat
carries it, the controller's router sends new requests (the official `openai` SDK) to the other.
Per-deployment weights are set through the CLI and the API, and `nexa deployments show` shows each
replica's score terms and a failing metrics endpoint, which never costs the replica its readiness.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, ok
from tests.support.cluster import MESSAGES, SimCluster, gateway_cluster, wait_until

pytestmark = pytest.mark.slow

Json = dict[str, Any]
REQUESTS = 40


async def scores(cluster: SimCluster, deployment: str) -> dict[str, Json]:
    """node id → the score terms of the deployment's replica there (`GET /api/v1/deployments/{name}`)."""
    async with cluster.client() as http:
        view = await ok(http.get(f"/api/v1/deployments/{deployment}"))
    return {s["node_id"]: s for s in view["replica_scores"]}


def requests_served(cluster: SimCluster) -> Counter[str]:
    """node id → chat requests its sim runtime journaled."""
    return Counter({n.node_id: sum(e["event"] == "request" for e in n.journal()) for n in cluster.nodes})


async def test_a_replica_reporting_a_long_queue_gets_few_new_requests(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        await cluster.deploy("chat-a", replicas=2)
        busy, idle = cluster.nodes
        busy.set_faults(queue_depth=50)

        async def busy_reported() -> bool:
            got = await scores(cluster, "chat-a")
            return (
                got.get(busy.node_id, {}).get("report") == "fresh"
                and got[busy.node_id]["queue_reported"] == 50
                and got.get(idle.node_id, {}).get("report") == "fresh"
            )

        await wait_until("the controller to see the long queue", busy_reported)
        got = await scores(cluster, "chat-a")
        assert got[busy.node_id]["queue_term"] >= 50 and got[busy.node_id]["score"] > got[idle.node_id]["score"]
        before = requests_served(cluster)
        client = openai.OpenAI(base_url=cluster.base_url, api_key=cluster.inference_key, max_retries=0, timeout=30)
        cluster.on_close.append(client.close)

        def send() -> None:
            for i in range(REQUESTS):
                messages = [{"role": "user", "content": f"question {i}: {MESSAGES[0]['content']}"}]
                answer = client.chat.completions.create(model="chat", messages=messages)  # type: ignore[arg-type]
                assert answer.choices[0].message.content

        await trio.to_thread.run_sync(send)
        served = requests_served(cluster) - before
        assert served.total() == REQUESTS
        assert served[idle.node_id] >= 0.8 * REQUESTS, served

        # Weights through the CLI (only those given change), shown by `deployments show`.
        updated = await cluster.cli("deployments", "update", "chat-a", "--routing-kv-cache", "2.5")
        assert updated.returncode == 0, updated.stderr
        shown = await cluster.cli("deployments", "show", "chat-a")
        assert shown.returncode == 0, shown.stderr
        assert "weights: queue 1, kv_cache 2.5, prefix 1" in shown.stdout
        assert "IN_FLIGHT" in shown.stdout and "fresh (" in shown.stdout
        refused = await cluster.cli("deployments", "update", "chat-a", "--routing-queue", "1000")
        assert refused.returncode != 0 and "routing" not in refused.stdout
        assert "queue: from 0 to 100" in refused.stderr
        async with cluster.client() as http:
            err = assert_envelope(
                await http.post("/api/v1/deployments/chat-a/routing", json={"prefix": -1}), 400, "invalid_request"
            )
            assert "prefix: from 0 to 100" in str(err["message"])
            assert_envelope(
                await http.post("/api/v1/deployments/chat-a/routing", json={"queue": "x"}), 400, "invalid_request"
            )
            view = await ok(http.get("/api/v1/deployments/chat-a"))
            assert view["deployment"]["routing"] == {"queue": 1.0, "kv_cache": 2.5, "prefix": 1.0}
            forecast = {
                "name": "other",
                "runtime": "sim",
                "alias": "chat",
                "resources": {"memory_bytes": 64 * 2**20, "cpus": 0.5},
                "routing": {"kv_cache": 101},
            }
            assert_envelope(await http.post("/api/v1/capacity/forecast", json=forecast), 400, "invalid_request")

        # A failing metrics endpoint is marked, and the replica stays Ready and keeps serving.
        idle.set_faults(metrics_fail=True)

        async def idle_failing() -> bool:
            return (await scores(cluster, "chat-a")).get(idle.node_id, {}).get("report") == "failing"

        await wait_until("the failing metrics endpoint to be reported", idle_failing)
        shown = await cluster.cli("deployments", "show", "chat-a")
        assert shown.returncode == 0, shown.stderr
        assert "metrics failing: " in shown.stdout
        assert len(await cluster.ready_replicas("chat-a")) == 2
        got = await scores(cluster, "chat-a")
        assert got[idle.node_id]["metrics_error"] and got[idle.node_id]["kv_term"] == 0.0
        answer = await trio.to_thread.run_sync(lambda: client.chat.completions.create(model="chat", messages=MESSAGES))
        assert answer.choices[0].message.content
