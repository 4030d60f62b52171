"""Watched-rollout helpers for the end-to-end tests against a `sim_cluster` (tests/e2e/test_rollout_watch.py,
tests/e2e/test_suite_gate_runs.py): runtime images registered by name, a suite gate's stage set,
clients sending steadily through the official SDK, deployment `chat-a`'s view and its rollout's
status polled."""

from __future__ import annotations

from typing import Any

import trio

from tests.realparts import BuiltImages
from tests.support.api import ok
from tests.support.cluster import MESSAGES, SIM_ARGS, SimCluster, free_runtime_port, node_host, sdk, wait_until
from tests.support.evals import CASES, TAUGHT, lines
from tests.support.evals import register as register_suite
from tests.support.oci import push_index
from tests.support.rollout import audit

Json = dict[str, Any]
#: Two images of one runtime: the platforms differ, so the digests do (never pulled: sim nodes).
GOOD_PLATFORMS = [{"os": "linux", "architecture": "amd64"}, {"os": "linux", "architecture": "arm64"}]
BAD_PLATFORMS = [*GOOD_PLATFORMS, {"os": "linux", "architecture": "s390x"}]


async def register(cluster: SimCluster, name: str, image: str) -> None:
    """Register `image` as the `sim` runtime `name`."""
    async with cluster.client() as http:
        body = {"name": name, "kind": "sim", "version": name, "image": image}
        await ok(http.post("/api/v1/runtimes", json=body), 201)


async def suite_gate_stage(cluster: SimCluster, images: BuiltImages, repo: str) -> Json:
    """Two images of the `sim` runtime (`sim-good`, whose runtime answers as taught, and
    `sim-wrong`, whose runtime answers wrong), suite `qa` (its exact and contains cases), and
    deployment `chat-a` of one replica on a cluster of two nodes, Ready: more than half a node, so
    a new replica starts on the other node, beside the old one. Its view."""
    host = images.busybox.partition("/")[0]
    good = await trio.to_thread.run_sync(push_index, host, f"nexa-test/{repo}-good", GOOD_PLATFORMS)
    wrong = await trio.to_thread.run_sync(push_index, host, f"nexa-test/{repo}-wrong", BAD_PLATFORMS)
    await register(cluster, "sim-good", good)
    await register(cluster, "sim-wrong", wrong)
    for node in cluster.nodes:
        node.set_faults(taught=TAUGHT, images={wrong.partition("@")[2]: {"wrong": True}})
    exact = [c for c in CASES if c["scorer"]["kind"] in ("exact", "contains")]
    registered = await register_suite(cluster, "qa", lines(exact))
    assert registered.returncode == 0, registered.stderr
    async with cluster.client() as http:
        nodes = (await ok(http.get("/api/v1/nodes")))["nodes"]
        body = {
            "name": "chat-a",
            "runtime": "sim",
            "alias": "chat",
            "replicas": 1,
            "resources": {
                "accelerators": 0,
                "memory_bytes": int(nodes[0]["inventory"]["memory_total_bytes"] * 0.55),
                "cpus": 0.5,
            },
            "options": {"port": free_runtime_port([node_host(1), node_host(2)]), "command": SIM_ARGS},
            "rollout_policy": {"soak_s": 1.0, "min_requests": 5},
        }
        await ok(http.post("/api/v1/deployments", json=body), 201)
    await cluster.wait_ready("chat-a", 1)
    return await view(cluster)


def send_steadily(cluster: SimCluster, stop: Any, outcomes: list[str], model: str = "chat") -> None:
    """Chat completions for `model` one after another until `stop` (a trio.Event) is set: `ok`, or
    the error's class and message. Run in a thread."""
    client = sdk(cluster)
    i = 0
    while not stop.is_set():
        i += 1  # other words each time: prefix-affinity routing spreads them over every replica
        messages = [{"role": "user", "content": f"question {i}: {MESSAGES[0]['content']}"}]
        try:
            answer = client.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
            outcomes.append("ok" if answer.choices[0].message.content else "empty")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")


async def suite_revert(cluster: SimCluster, *, timeout_s: float) -> Json:
    """The revert of `sim-wrong` by the suite gate's failing run, once audited (checked: by the
    controller, with the run's pass rates), then `sim-good` back on the replica; the audit event."""
    async with cluster.client() as http:

        async def reverted() -> list[Json]:
            return await audit(http, "deployment.rollout.revert")

        [revert] = await wait_until("the wrong image reverted", reverted, timeout_s=timeout_s)
    assert "failed suite qa with every pass rate >= 1: run evrun_" in revert["detail"], revert
    assert "exact 0" in revert["detail"] and "back to runtime sim-good" in revert["detail"]
    assert revert["actor_key_id"] is None
    await wait_until("the right image back", lambda: rolled_to_one(cluster, "sim-good"), timeout_s=timeout_s)
    return revert


async def view(cluster: SimCluster) -> Json:
    async with cluster.client() as http:
        return await ok(http.get("/api/v1/deployments/chat-a"))


async def rollout_status(cluster: SimCluster) -> Json:
    async with cluster.client() as http:
        return await ok(http.get("/api/v1/deployments/chat-a/rollout"))


async def waits_for_suite(cluster: SimCluster) -> Json | None:
    """The rollout's status once a new replica soaked and waits for its suite; None before."""
    status = await rollout_status(cluster)
    rollout = status["rollout"]
    waiting = rollout is not None and any(s["suite_wait"] and not s["passed"] for s in rollout["soaks"])
    return status if waiting else None


async def rolled_to_one(cluster: SimCluster, runtime: str) -> bool:
    """The rollout ended with chat-a's one replica on the spec `runtime` names, Ready."""
    v = await view(cluster)
    dep = v["deployment"]
    return dep["rollout"] is None and dep["runtime"] == runtime and v["ready"] == 1
