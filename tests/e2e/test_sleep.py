"""Sleep when idle and wake on demand, end to end: a controller, real `nexa node` agents and their
`sim` runtimes, the official `openai` SDK (`control.deployments.idle`).

A deployment with `idle_after_s` and `min_replicas` 0 sleeps once idle (its replicas leave the
node's signed set, so the node stops its runtime), a request wakes it and is answered within its
deadline, and a request whose deadline is shorter than the wake gets a typed 504 and is charged
nothing. Swap on demand: two deployments on one node with room for one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import in_thread, ok
from tests.support.cluster import (
    MESSAGES,
    SIM_ARGS,
    SimCluster,
    free_runtime_port,
    gateway_cluster,
    node_host,
    sdk,
    sim_cluster,
    usage_rows,
    wait_until,
)
from tests.support.console import sign_in
from tests.support.models import registry_config

pytestmark = pytest.mark.slow

Json = dict[str, Any]
#: Short, so the tests never sleep long: the keeper looks every quarter of it.
IDLE_AFTER_S = 1.0
MIB = 2**20


async def _deploy_sleepy(
    cluster: SimCluster,
    name: str,
    alias: str,
    *,
    evictable: bool = False,
    memory_bytes: int = 64 * MIB,
    idle_after_s: float = IDLE_AFTER_S,
) -> None:
    body = {
        "name": name,
        "runtime": "sim",
        "alias": alias,
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": memory_bytes, "cpus": 0.5, "overhead_bytes": 0},
        "options": {
            "port": free_runtime_port([node_host(i) for i in range(1, len(cluster.nodes) + 1)]),
            "command": SIM_ARGS,
        },
        "idle_after_s": idle_after_s,
        "min_replicas": 0,
        "evictable": evictable,
    }
    async with cluster.client() as http:
        await ok(http.post("/api/v1/deployments", json=body), 201)


async def _show(cluster: SimCluster, name: str) -> Json:
    async with cluster.client() as http:
        return await ok(http.get(f"/api/v1/deployments/{name}"))


async def _asleep(cluster: SimCluster, name: str) -> bool:
    """The deployment is asleep and no node runs a replica of it any more."""
    view = await _show(cluster, name)
    if view["sleep"]["state"] != "asleep" or view["deployment"]["placed"]:
        return False
    running = [a for n in (await cluster.node_views()).values() for a in n["assignments"]]
    return not any(a["assignment_id"].startswith(name + "-") for a in running)


def _chat(cluster: SimCluster, alias: str, deadline_ms: int) -> Any:
    return sdk(cluster).chat.completions.create(
        model=alias, messages=MESSAGES, extra_headers={"x-nexa-deadline-ms": str(deadline_ms)}
    )


async def test_an_idle_deployment_sleeps_and_a_request_wakes_it(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        await _deploy_sleepy(cluster, "sleepy", "chat")
        await cluster.wait_ready("sleepy", 1)
        answer = await in_thread(lambda: _chat(cluster, "chat", 20_000))
        assert answer.choices[0].message.content

        # Idle for idle_after_s: its runtime stops (the node's set no longer holds it).
        await wait_until("the deployment to sleep", lambda: _asleep(cluster, "sleepy"))
        view = await _show(cluster, "sleepy")
        assert view["sleep"]["last_request_at"] is not None and view["ready"] == 0

        # A request wakes it and is answered within its deadline; the wait is in its overhead figure.
        raw = await in_thread(
            lambda: sdk(cluster).chat.completions.with_raw_response.create(
                model="chat", messages=MESSAGES, extra_headers={"x-nexa-deadline-ms": "30000"}
            )
        )
        assert raw.parse().choices[0].message.content
        view = await _show(cluster, "sleepy")
        assert view["sleep"]["state"] == "awake" and view["ready"] == 1
        woke_s = view["sleep"]["last_wake_s"]
        assert woke_s is not None and woke_s > 0
        assert float(raw.headers["x-nexa-overhead-ms"]) >= woke_s * 1000.0 * 0.9
        async with cluster.client() as http:
            metrics = (await http.get("/metrics")).text
        assert 'nexa_wake_seconds_count{deployment="sleepy"} 1.0' in metrics
        assert 'nexa_deployment_sleeps_total{deployment="sleepy",reason="idle"} 1.0' in metrics

        # Asleep again: a deadline shorter than its last wake gets a typed 504 at once, nothing charged.
        await wait_until("the deployment to sleep again", lambda: _asleep(cluster, "sleepy"))
        before = await usage_rows(cluster, tenant="acme")
        short_ms = max(1, int(woke_s * 1000 / 4))
        with pytest.raises(openai.InternalServerError) as refused:
            await in_thread(lambda: _chat(cluster, "chat", short_ms))
        assert refused.value.status_code == 504 and refused.value.code == "deadline_exceeded"
        assert "wake" in refused.value.message
        [after] = await usage_rows(cluster, tenant="acme")
        assert after["prompt_tokens"] == before[0]["prompt_tokens"]
        assert after["completion_tokens"] == before[0]["completion_tokens"]
        # The refused request started the wake all the same.
        await cluster.wait_ready("sleepy", 1)

        async with cluster.client() as http:
            audit = (await ok(http.get("/api/v1/audit", params={"limit": "200"})))["events"]
        actions = [e["action"] for e in audit if e["target"] == "deployment/sleepy"]
        assert actions.count("deployment.sleep") == 2 and actions.count("deployment.wake") == 2


async def test_operators_wake_and_sleep_a_deployment_by_hand(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        await _deploy_sleepy(cluster, "manual", "chat")
        await cluster.wait_ready("manual", 1)
        # Long idle time: only the operator puts it to sleep.
        changed = await cluster.cli("deployments", "idle", "manual", "--idle-after-s", "3600", "--min-replicas", "0")
        assert changed.returncode == 0, changed.stderr
        slept = await cluster.cli("deployments", "sleep", "manual")
        assert slept.returncode == 0, slept.stderr
        await wait_until("the deployment to sleep", lambda: _asleep(cluster, "manual"))
        shown = await cluster.cli("deployments", "show", "manual")
        assert "sleep    asleep" in shown.stdout, shown.stdout
        async with cluster.client() as browser:
            assert (await sign_in(browser, cluster.controller.admin_key)).status_code == 303
            page = (await browser.get("/console/deployments/manual")).text
        assert 'id="sleep-state">Sleep: <strong>asleep</strong>' in page and "sleeps after 3600" in page
        woke = await cluster.cli("deployments", "wake", "manual")
        assert woke.returncode == 0, woke.stderr
        await cluster.wait_ready("manual", 1)
        shown = await cluster.cli("deployments", "show", "manual")
        assert "sleep    awake" in shown.stdout and "time to wake" in shown.stdout, shown.stdout

        bad = await cluster.cli("deployments", "idle", "manual", "--idle-after-s", "-1", "--min-replicas", "0")
        assert bad.returncode != 0 and "idle_after_s" in bad.stderr
        view = await _show(cluster, "manual")
        assert view["deployment"]["idle_after_s"] == 3600  # the refusal changed nothing


async def test_swap_on_demand_alternates_two_models_on_a_node_with_room_for_one(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1) as cluster:
        await cluster.model("tiny2", "other")
        [node] = (await cluster.node_views()).values()
        # Each takes 60 % of the node's memory: one fits, never both.
        each = int(node["inventory"]["memory_total_bytes"] * 0.6)
        for name, alias in (("model-a", "chat"), ("model-b", "other")):
            # Long idle times: only swap on demand puts them to sleep here.
            await _deploy_sleepy(cluster, name, alias, evictable=True, memory_bytes=each, idle_after_s=3600)
            await cluster.wait_ready(name, 1)
            if name == "model-a":
                async with cluster.client() as http:
                    await ok(http.post("/api/v1/deployments/model-a/sleep"))

        # Alternating requests: each wakes its model, putting the other (evictable, idle) to sleep.
        for alias in ("chat", "other", "chat", "other"):
            answer = await in_thread(lambda alias=alias: _chat(cluster, alias, 30_000))  # type: ignore[misc]
            assert answer.choices[0].message.content
        a, b = await _show(cluster, "model-a"), await _show(cluster, "model-b")
        assert (a["sleep"]["state"], b["sleep"]["state"]) == ("asleep", "awake")
        async with cluster.client() as http:
            audit = (await ok(http.get("/api/v1/audit", params={"limit": "500"})))["events"]
            placement = await ok(http.get("/api/v1/deployments/model-b/placement"))
        swaps = [e for e in audit if e["action"] == "deployment.sleep" and "swap on demand" in e["detail"]]
        # One swap per request: b for a, a for b, b for a, a for b.
        assert sorted(e["target"] for e in swaps) == ["deployment/model-a"] * 2 + ["deployment/model-b"] * 2
        [why] = placement["decision"]["swaps"]
        assert "model-a (evictable" in why and "to make room for model-b" in why
        shown = await cluster.cli("deployments", "placement", "model-b")
        assert f"swap: {why}" in shown.stdout, shown.stdout
        async with cluster.client() as http:
            metrics = (await http.get("/metrics")).text
        assert 'nexa_deployment_sleeps_total{deployment="model-a",reason="swap"} 2.0' in metrics

        # A deployment that is not evictable is never put to sleep: the other model cannot wake.
        async with cluster.client() as http:
            body = {"idle_after_s": 3600, "min_replicas": 0, "evictable": False}
            await ok(http.post("/api/v1/deployments/model-b/idle", json=body))
        with pytest.raises(openai.APIStatusError) as refused:
            await in_thread(lambda: _chat(cluster, "chat", 10_000))
        assert refused.value.status_code == 503 and "no node has room" in refused.value.message
        b = await _show(cluster, "model-b")
        assert b["sleep"]["state"] == "awake" and b["ready"] == 1
        a = await _show(cluster, "model-a")
        assert a["sleep"]["state"] == "asleep" and "no node has room" in (a["problem"] or "")
