"""A real `nexa node` scrapes its sim replica's `/metrics` and reports the load in its heartbeats
(issue 18 point 2, the node side): the controller's node view shows the queue the faults file
sets, and a failing metrics endpoint reads `ok: false` while the replica stays Ready and serving;
the replicas' writable caches are reported beside the artifact cache (issue 29 point 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok, wait_for
from tests.support.cluster import MESSAGES, SimCluster, sim_cluster
from tests.support.models import registry_config

TIMEOUT_S = 60


async def _assignment(cluster: SimCluster, node_id: str) -> dict[str, Any]:
    async with cluster.client() as http:
        view = await ok(http.get(f"/api/v1/nodes/{node_id}"))
    node = view.get("node", view)
    [assignment] = node["assignments"]
    return dict(assignment)


@pytest.mark.slow
async def test_the_node_view_shows_the_runtimes_queue_and_a_failing_metrics_endpoint(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1, gb10=True) as cluster:
        await cluster.deploy("chat-a", replicas=1)
        node = cluster.nodes[0]
        seen: dict[str, Any] = {}

        async def load_is(**want: Any) -> bool:
            seen.update(await _assignment(cluster, node.node_id))
            load = seen.get("load") or {}
            return seen["state"] == "Ready" and all(load.get(k) == v for k, v in want.items())

        node.set_faults(queue_depth=9, kv_cache_usage=0.75)
        await wait_for(lambda: load_is(ok=True, queue_depth=9.0, kv_cache_ratio=0.75), timeout_s=TIMEOUT_S)
        load = seen["load"]
        assert load["running"] == 0.0
        assert 0.0 <= load["age_s"] < TIMEOUT_S
        assert load["ttft"]["count"] == 0  # nothing answered yet
        shown = await cluster.cli("nodes", "show", node.node_id)
        assert shown.returncode == 0, shown.stderr
        assert "load: queue 9, running 0, kv cache 75 %" in shown.stdout, shown.stdout
        assert "gpu 0: NVIDIA GB10, utilization 0 %" in shown.stdout and "(unified pool)" in shown.stdout
        assert "cache disk   " in shown.stdout and " held, " in shown.stdout, shown.stdout
        # The replicas' writable caches are measured and reported too (a sim replica, a process, has none).
        assert "runtime cache " in shown.stdout and "(0 directories, 0 in use)" in shown.stdout, shown.stdout
        async with cluster.client() as http:
            view = await ok(http.get(f"/api/v1/nodes/{node.node_id}"))
        runtime_cache = view.get("node", view)["runtime_cache"]
        assert runtime_cache["max_bytes"] == 100 * 2**30 and runtime_cache["free_bytes"] > 0, runtime_cache

        node.set_faults(metrics_fail=True)
        await wait_for(lambda: load_is(ok=False), timeout_s=TIMEOUT_S)
        assert "503" in seen["load"]["error"]
        shown = await cluster.cli("nodes", "show", node.node_id)
        assert "load: metrics failing: " in shown.stdout and "503" in shown.stdout, shown.stdout
        assert seen["load"].get("queue_depth") is None  # no figures from a failed read
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=cluster.inference_key, max_retries=0, timeout=30)
        async with client:
            with trio.fail_after(TIMEOUT_S):
                answer = await client.chat.completions.create(model="chat", messages=MESSAGES)
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert (await _assignment(cluster, node.node_id))["state"] == "Ready"  # readiness untouched

        node.set_faults()  # healthy again: the answer just given shows in the TTFT histogram
        await wait_for(lambda: load_is(ok=True, queue_depth=0.0), timeout_s=TIMEOUT_S)
        await wait_for(lambda: _ttft_count(cluster, node.node_id, 1), timeout_s=TIMEOUT_S)


async def _ttft_count(cluster: SimCluster, node_id: str, count: int) -> bool:
    load = (await _assignment(cluster, node_id)).get("load") or {}
    return bool(load.get("ttft")) and load["ttft"]["count"] >= count
