"""Watched-rollout helpers for the end-to-end tests against a `sim_cluster` (tests/e2e/test_rollout_watch.py,
tests/e2e/test_suite_gate_runs.py): runtime images registered by name, clients sending steadily
through the official SDK, deployment `chat-a`'s view and its rollout's status polled."""

from __future__ import annotations

from typing import Any

from tests.support.api import ok
from tests.support.cluster import MESSAGES, SimCluster, sdk

Json = dict[str, Any]
#: Two images of one runtime: the platforms differ, so the digests do (never pulled: sim nodes).
GOOD_PLATFORMS = [{"os": "linux", "architecture": "amd64"}, {"os": "linux", "architecture": "arm64"}]
BAD_PLATFORMS = [*GOOD_PLATFORMS, {"os": "linux", "architecture": "s390x"}]


async def register(cluster: SimCluster, name: str, image: str) -> None:
    """Register `image` as the `sim` runtime `name`."""
    async with cluster.client() as http:
        body = {"name": name, "kind": "sim", "version": name, "image": image}
        await ok(http.post("/api/v1/runtimes", json=body), 201)


def send_steadily(cluster: SimCluster, stop: Any, outcomes: list[str]) -> None:
    """Chat completions (alias `chat`) one after another until `stop` (a trio.Event) is set: `ok`,
    or the error's class and message. Run in a thread."""
    client = sdk(cluster)
    i = 0
    while not stop.is_set():
        i += 1
        messages = [{"role": "user", "content": f"question {i}: {MESSAGES[0]['content']}"}]
        try:
            answer = client.chat.completions.create(model="chat", messages=messages)  # type: ignore[arg-type]
            outcomes.append("ok" if answer.choices[0].message.content else "empty")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")


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
