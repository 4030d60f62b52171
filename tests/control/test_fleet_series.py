"""The fleet's series on a real controller's `/metrics` (issue 18 points 1 and 2's export).

A GB10 `nexa node` process (a fake nvidia-smi, `sim_cluster(gb10=True)`) shows up per GPU and
with its unified pool once, scraped with a monitoring key; revoked, it leaves no series. A raw
node on the real channel reports runtime loads for a replica the controller placed on it: they
are exported under the replica's deployment, a failing metrics endpoint reads 0 in
`nexa_runtime_metrics_up`, loads for replicas the controller never placed are not exported, and
hostile figures are refused at the channel without breaking a scrape.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import trio

from nexa import security
from nexa.contracts import codec, wire
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import make_key, metric, ok, wait_for
from tests.support.cluster import sim_cluster
from tests.support.deployments import body, online, registry_ready, set_where
from tests.support.models import registry_config
from tests.support.rawnode import RawNode


async def _scrape(c: Controller, key: str) -> str:
    async with c.client(key) as http:
        resp = await http.get("/metrics")
    assert resp.status_code == 200, resp.text
    return resp.text


def _value(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}{{{re.escape(want)}}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


async def test_a_gb10_node_process_is_exported_per_gpu_and_leaves_when_revoked(
    nursery: trio.Nursery, tmp_path: Any, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1, gb10=True) as cluster:
        c = cluster.controller
        monitoring = await make_key(c, "monitoring")
        gpu = {"node": "sim-1", "gpu": "0", "model": "NVIDIA GB10"}

        async def exported() -> bool:
            return _value(await _scrape(c, monitoring), "nexa_gpu_temperature_celsius", **gpu) is not None

        await wait_for(exported, timeout_s=40)
        text = await _scrape(c, monitoring)
        assert _value(text, "nexa_gpu_temperature_celsius", **gpu) == 41.0  # the recorded nvidia-smi
        assert _value(text, "nexa_gpu_power_watts", **gpu) == 4.71
        assert _value(text, "nexa_gpu_utilization_ratio", **gpu) == 0.0
        pool = {**gpu, "gpu": "unified"}
        assert (_value(text, "nexa_gpu_memory_total_bytes", **pool) or 0) > 0
        assert _value(text, "nexa_gpu_memory_total_bytes", **gpu) is None  # the pool once, not per GPU
        assert len(re.findall(r"^nexa_gpu_memory_total_bytes\{", text, re.M)) == 1
        age = _value(text, "nexa_node_heartbeat_age_seconds", node="sim-1")
        assert age is not None
        assert age >= 0
        assert (_value(text, "nexa_node_memory_total_bytes", node="sim-1") or 0) > 0
        # The role guard holds: an inference key may not scrape.
        async with c.client(cluster.inference_key) as http:
            assert (await http.get("/metrics")).status_code == 403

        async with c.client() as http:
            await ok(http.post("/api/v1/nodes/sim-1/revoke"))
        text = await _scrape(c, monitoring)
        assert 'node="sim-1"' not in text


def _loaded(node: RawNode, loads: dict[str, wire.RuntimeLoad]) -> wire.Heartbeat:
    beat = node.heartbeat()
    statuses = [
        wire.AssignmentStatus(assignment_id=aid, state=wire.RuntimeState.READY, load=load)
        for aid, load in sorted(loads.items())
    ]
    return attrs.evolve(beat, assignments=statuses)


async def test_runtime_loads_from_the_node_channel_are_exported_per_replica(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    n1 = await online(dep_reg, dial, nursery, "n1")
    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        await ok(http.post("/api/v1/deployments", json=body("chat-a")), 201)
    placed = await set_where(n1.node, lambda s: [a.deployment for a in s.assignments] == ["chat-a"])
    [replica] = [a.id for a in placed.assignments]
    n1.beating.cancel()  # from here the test beats, with loads
    monitoring = await make_key(dep_reg, "monitoring")
    ttft = wire.LatencyHistogram(bounds=(0.01, 0.1, 1.0), counts=(1.0, 4.0, 6.0), count=7.0, sum=2.5)
    good = wire.RuntimeLoad(
        ok=True, age_s=0.5, queue_depth=7, running=2, kv_cache_ratio=0.75, prefix_cache_hit_ratio=0.25, ttft=ttft
    )
    stray = wire.RuntimeLoad(ok=True, age_s=0.0, queue_depth=99)
    labels = {"deployment": "chat-a", "replica": replica, "node": "n1"}

    async def beat_until(loads: dict[str, wire.RuntimeLoad], name: str, value: float) -> str:
        text = ""

        async def shown() -> bool:
            nonlocal text
            await n1.node.send(n1.node.frames(_loaded(n1.node, loads)))
            text = await _scrape(dep_reg, monitoring)
            return _value(text, name, **labels) == value

        await wait_for(shown, timeout_s=30)
        return text

    text = await beat_until({replica: good, "not-placed-here": stray}, "nexa_runtime_queue_depth", 7.0)
    assert _value(text, "nexa_runtime_running_requests", **labels) == 2.0
    assert _value(text, "nexa_runtime_kv_cache_usage_ratio", **labels) == 0.75
    assert _value(text, "nexa_runtime_prefix_cache_hit_ratio", **labels) == 0.25
    assert _value(text, "nexa_runtime_metrics_up", **labels) == 1.0
    assert (_value(text, "nexa_runtime_metrics_age_seconds", **labels) or -1) >= 0.5
    assert _value(text, "nexa_runtime_time_to_first_token_seconds_bucket", **labels, le="0.1") == 4.0
    assert _value(text, "nexa_runtime_time_to_first_token_seconds_bucket", **labels, le="+Inf") == 7.0
    assert _value(text, "nexa_runtime_time_to_first_token_seconds_count", **labels) == 7.0
    assert "not-placed-here" not in text  # a replica id the controller never placed: no series

    # Hostile figures: refused at the channel (counted), and the scrape goes on as before.
    malformed = await metric(dep_reg, "nexa_node_messages_rejected_total", reason="malformed")
    hostile = codec.dumps(codec.wire, _loaded(n1.node, {replica: good}))
    for bad in ('"queue_depth":NaN', '"queue_depth":-1', '"kv_cache_ratio":7'):
        field = bad.split(":")[0]
        text_body = re.sub(rf"{field}:[^,}}]+", bad, hostile)
        await n1.node.send([b"heartbeat", text_body.encode(), _sign(n1.node, text_body.encode())])

    async def refused() -> bool:
        return await metric(dep_reg, "nexa_node_messages_rejected_total", reason="malformed") >= malformed + 3

    await wait_for(refused)
    assert _value(await _scrape(dep_reg, monitoring), "nexa_runtime_queue_depth", **labels) == 7.0

    # A failing endpoint: up 0, no figures (the replica stays Ready).
    failing = wire.RuntimeLoad(ok=False, age_s=1.0, error="connection refused")
    text = await beat_until({replica: failing}, "nexa_runtime_metrics_up", 0.0)
    assert _value(text, "nexa_runtime_queue_depth", **labels) is None


def _sign(node: RawNode, body: bytes) -> bytes:
    return security.sign(node.key, b"heartbeat", body)
