"""Sleep when idle by the runtime's own sleep, end to end: a controller, a real `nexa node` agent and
its `sim` runtime started with `--enable-sleep-mode` (vLLM's sleep routes, `nexa.simruntime.app`),
the official `openai` SDK (`control.deployments.idle`, `node.sleeper`).

An idle deployment whose runtime has its own sleep keeps its replica placed and its runtime running,
asleep (`GET /is_sleeping` says so); a request wakes it by `POST /wake_up`, without a restart, and is
answered. A runtime whose `/sleep` fails stays awake, and the controller stops its container instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
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
    wait_until,
)

pytestmark = pytest.mark.slow

Json = dict[str, Any]
IDLE_AFTER_S = 1.0
MIB = 2**20


async def _deploy(cluster: SimCluster, name: str, alias: str) -> int:
    port = free_runtime_port([node_host(i) for i in range(1, len(cluster.nodes) + 1)])
    body = {
        "name": name,
        "runtime": "sim",
        "alias": alias,
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 64 * MIB, "cpus": 0.5, "overhead_bytes": 0},
        "options": {"port": port, "command": [*SIM_ARGS, "--enable-sleep-mode"]},
        "idle_after_s": IDLE_AFTER_S,
        "min_replicas": 0,
    }
    async with cluster.client() as http:
        await ok(http.post("/api/v1/deployments", json=body), 201)
    return port


async def _show(cluster: SimCluster, name: str) -> Json:
    async with cluster.client() as http:
        return await ok(http.get(f"/api/v1/deployments/{name}"))


async def _status(cluster: SimCluster, name: str) -> Json | None:
    """The node's status of the deployment's one replica; None when no node runs it."""
    found = [a for n in (await cluster.node_views()).values() for a in n["assignments"]]
    return next((a for a in found if a["assignment_id"].startswith(name + "-")), None)


async def _is_sleeping(host: str, port: int) -> bool:
    """What the runtime itself says (`GET /is_sleeping`, as vLLM answers it)."""
    async with httpx.AsyncClient() as http:
        answer = (await http.get(f"http://{host}:{port}/is_sleeping")).json()
    said: bool = answer["is_sleeping"]
    return said


def _chat(cluster: SimCluster, alias: str) -> Any:
    return sdk(cluster).chat.completions.create(
        model=alias, messages=MESSAGES, extra_headers={"x-nexa-deadline-ms": "30000"}
    )


async def test_an_idle_runtime_sleeps_by_its_own_sleep_and_a_request_wakes_it(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        port = await _deploy(cluster, "napper", "chat")
        [node_id] = (await cluster.wait_ready("napper", 1)).values()
        host = node_host(1 + [n.node_id for n in cluster.nodes].index(node_id))
        assert not await _is_sleeping(host, port)
        before = await _status(cluster, "napper")
        assert before is not None

        async def runtime_asleep() -> bool:
            status = await _status(cluster, "napper")
            return status is not None and status["asleep"] and await _is_sleeping(host, port)

        # Idle: the replica stays placed, its runtime keeps running, asleep.
        await wait_until("the runtime to sleep", runtime_asleep)
        view = await _show(cluster, "napper")
        assert view["sleep"]["state"] == "asleep" and len(view["deployment"]["placed"]) == 1
        assert view["ready"] == 0  # never routed while asleep
        status = await _status(cluster, "napper")
        assert status is not None and status["state"] == "Ready" and status["restarts"] == before["restarts"]

        # A request wakes it (`POST /wake_up`: no restart) and is answered.
        answer = await in_thread(lambda: _chat(cluster, "chat"))
        assert answer.choices[0].message.content
        assert not await _is_sleeping(host, port)
        status = await _status(cluster, "napper")
        assert status is not None and not status["asleep"] and status["restarts"] == before["restarts"]
        view = await _show(cluster, "napper")
        assert view["sleep"]["state"] == "awake" and view["ready"] == 1
        async with cluster.client() as http:
            audit = (await ok(http.get("/api/v1/audit", params={"limit": "200"})))["events"]
        mine = [e for e in audit if e["target"] == "deployment/napper"]
        assert any(e["action"] == "deployment.sleep" and "runtime's own sleep" in e["detail"] for e in mine)
        assert any(e["action"] == "deployment.wake" and "runtime's own wake" in e["detail"] for e in mine)


async def test_a_runtime_whose_sleep_fails_is_stopped_instead(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        for node in cluster.nodes:
            node.set_faults(sleep_fail=True)
        await _deploy(cluster, "insomniac", "chat")
        await cluster.wait_ready("insomniac", 1)

        async def stopped() -> bool:
            view = await _show(cluster, "insomniac")
            return view["sleep"]["state"] == "asleep" and not view["deployment"]["placed"]

        # Its `/sleep` answers 500: the node reports `sleep_failed`, the controller stops it instead.
        await wait_until("the deployment to sleep by stopping its container", stopped)
        await wait_until("its replica to leave the node", lambda: _gone(cluster, "insomniac"))
        async with cluster.client() as http:
            audit = (await ok(http.get("/api/v1/audit", params={"limit": "200"})))["events"]
        details = [e["detail"] for e in audit if e["target"] == "deployment/insomniac"]
        assert any("sleep failed" in d and "stopped instead" in d for d in details), json.dumps(details)

        # A request starts it again and is answered.
        for node in cluster.nodes:
            node.set_faults()
        answer = await in_thread(lambda: _chat(cluster, "chat"))
        assert answer.choices[0].message.content


async def _gone(cluster: SimCluster, name: str) -> bool:
    return await _status(cluster, name) is None
