"""A new LoRA adapter version as a canary on the same replicas, watched, reverted or passed by itself
(issues 34 and 36): a controller, two real `nexa node` agents running `sim` runtimes that load adapters at
run time (vLLM's endpoints), and clients asking for the adapter's alias through the official `openai` SDK
the whole time.

The alias `poet` serves adapter poet@a1 on the deployment's model; promoted to poet@a2, the deployment goes
to it in place (reason `adapter`, `in_place`): no replica is replaced; every replica is given poet@a2 beside
poet@a1, and each request for `poet` draws poet@a2 with the policy's `adapter_weight`.

* A bad poet@a2: the sim runtimes fail every request naming an adapter loaded from a path that holds
  `poet@a2` (the faults file's `loras`; the node keeps it at `<adapter directory>/poet@a2`) before any
  output. Its failures break the error-rate objective during its soak: every request goes back to
  poet@a1, audited with the figures, and poet@a2 is held. Each failed attempt was retried on poet@a1:
  every client request is answered, and usage names poet@a1 for all of them.
* A good poet@a2: it soaks its time unbroken and passes; both versions answered meanwhile (usage names
  each), and afterwards every request is poet@a2's, on the same replicas.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SIM_ARGS, SimCluster, gateway_cluster, usage_rows, wait_until
from tests.support.console import sign_in
from tests.support.models import bring_to
from tests.support.watched import send_steadily

pytestmark = pytest.mark.slow

Json = dict[str, Any]
TIMEOUT_S = 120


async def adapter(cluster: SimCluster, s3: S3Store, data: bytes, version: str) -> str:
    """The adapter poet@`version` for tiny@v1, Approved; its artifact's sha256 (hex)."""
    async with cluster.client() as http:
        lora = {"kind": "lora", "base": [{"model": "tiny", "version": "v1"}]}
        model = await bring_to(http, s3, "poet", version, "Approved", data=data, **lora)
    return str(model["artifact"]["sha256"]).removeprefix("sha256:")


async def serve(cluster: SimCluster, version: str) -> None:
    async with cluster.client() as http:
        body = {"model": "tiny", "version": "v1", "adapter": {"model": "poet", "version": version}}
        await ok(http.post("/api/v1/aliases/poet/promote", json=body))


def at_least(outcomes: list[str], count: int) -> Any:
    async def check() -> bool:
        return len(outcomes) >= count

    return check


async def deployed(cluster: SimCluster, s3: S3Store, lora: bytes, *, weight: float) -> list[str]:
    """poet@a1 and poet@a2 registered, `poet` serving a1 on a two-replica deployment watched in
    place with `weight`; its replicas' ids."""
    await adapter(cluster, s3, lora, "a1")
    await adapter(cluster, s3, lora + b"\0" * 8, "a2")
    await serve(cluster, "a1")
    await cluster.deploy("chat", replicas=2, args=[*SIM_ARGS, "--max-loras", "2"])
    async with cluster.client() as http:
        policy = {"rollout_policy": {"soak_s": 4.0, "min_requests": 8, "adapter_weight": weight}}
        await ok(http.post("/api/v1/deployments/chat/change", json=policy))
        dep = (await ok(http.get("/api/v1/deployments/chat")))["deployment"]
    return sorted(r["id"] for r in dep["placed"])


async def rolled_in_place(cluster: SimCluster, outcomes: list[str], done: Any) -> tuple[Json, list[Json]]:
    """Promote poet to a2 while clients ask; the deployment once `done` says so, and its audit events."""
    with trio.fail_after(3 * TIMEOUT_S):
        await wait_until("answers for poet@a1", at_least(outcomes, 10), timeout_s=TIMEOUT_S)
        await serve(cluster, "a2")
        async with cluster.client() as http:

            async def ended() -> Json | None:
                dep: Json = (await ok(http.get("/api/v1/deployments/chat")))["deployment"]
                return dep if done(dep) else None

            dep = await wait_until("the adapter rollout's end", ended, timeout_s=TIMEOUT_S)
            assert dep is not None
            events: list[Json] = (await ok(http.get("/api/v1/audit", params={"limit": 500})))["events"]
        await wait_until("answers after it", at_least(outcomes, len(outcomes) + 10), timeout_s=TIMEOUT_S)
    return dep, events


async def asking(cluster: SimCluster, outcomes: list[str], step: Any) -> Any:
    """Run `step` while three clients ask `poet` steadily; what it returned."""
    stop = trio.Event()
    async with trio.open_nursery() as clients:
        for _ in range(3):
            clients.start_soon(trio.to_thread.run_sync, send_steadily, cluster, stop, outcomes, "poet")
        try:
            return await step()
        finally:
            stop.set()


async def console_rollout(cluster: SimCluster, seen: list[str]) -> None:
    """The console's rollout line of deployment `chat`, each time it reads one, until cancelled."""
    async with httpx.AsyncClient(base_url=cluster.controller.url) as browser:
        assert (await sign_in(browser, cluster.controller.admin_key)).status_code == 303
        while True:
            page = (await browser.get("/console/deployments/chat")).text
            line = next((x for x in page.splitlines() if 'id="rollout-state"' in x and "in place" in x), None)
            if line is not None:
                seen.append(html.unescape(line))
            await trio.sleep(0.2)


async def metered(cluster: SimCluster, at_least_requests: int) -> dict[str, int]:
    async def rows() -> dict[str, int] | None:
        got = await usage_rows(cluster, tenant=cluster.tenant)
        by_model = {str(r["model"]): int(str(r["requests"])) for r in got}
        return by_model if sum(by_model.values()) >= at_least_requests else None

    got: dict[str, int] = await wait_until("usage of every request", rows, timeout_s=TIMEOUT_S)
    return got


async def test_a_bad_adapter_version_is_reverted_in_place_with_every_request_answered(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, tiny_lora_gguf: Path
) -> None:
    lora = await trio.Path(tiny_lora_gguf).read_bytes()
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        replicas = await deployed(cluster, s3_store, lora, weight=0.5)
        for node in cluster.nodes:
            node.set_faults(loras={"poet@a2": {"fail": "before", "status": 500}})
        outcomes: list[str] = []

        def reverted(dep: Json) -> bool:
            return bool(dep["held_loras"]) and dep["rollout"] is None

        dep, events = await asking(cluster, outcomes, lambda: rolled_in_place(cluster, outcomes, reverted))

        assert dep["loras"] == {"poet": {"model": "poet", "version": "a1"}}
        assert dep["held_loras"] == {"poet": {"model": "poet", "version": "a2"}}
        assert sorted(r["id"] for r in dep["placed"]) == replicas  # the same replicas throughout
        actions = [e["action"] for e in events]
        assert "deployment.rollout.step" not in actions and "deployment.replace" not in actions
        [started] = [e for e in events if e["action"] == "deployment.adapters"]
        assert "adapters poet: poet@a1 -> poet@a2; in place on its replicas" in started["detail"], started
        [revert] = [e for e in events if e["action"] == "deployment.rollout.revert"]
        assert "adapter poet@a2 broke the objectives (error rate" in revert["detail"], revert
        assert "back to poet: poet@a2 -> poet@a1 in place" in revert["detail"], revert
        assert outcomes and all(o == "ok" for o in outcomes), [o for o in outcomes if o != "ok"][:3]
        # Each request is metered once, as the version that answered it: a1's, since every attempt
        # on a2 failed before any output and was retried on a1.
        assert await metered(cluster, len(outcomes)) == {"tiny:v1+poet:a1": len(outcomes)}


async def test_a_good_adapter_version_soaks_on_the_same_replicas_and_then_answers_alone(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, tiny_lora_gguf: Path
) -> None:
    lora = await trio.Path(tiny_lora_gguf).read_bytes()
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        replicas = await deployed(cluster, s3_store, lora, weight=0.5)
        outcomes: list[str] = []

        def passed(dep: Json) -> bool:
            return dep["rollout"] is None and dep["loras"] == {"poet": {"model": "poet", "version": "a2"}}

        seen: list[str] = []
        async with trio.open_nursery() as watching:
            watching.start_soon(console_rollout, cluster, seen)
            dep, events = await asking(cluster, outcomes, lambda: rolled_in_place(cluster, outcomes, passed))
            watching.cancel_scope.cancel()
        # The console's deployment page said what soaked, and how, while it did.
        assert any(
            "in place on the same replicas: the new adapter versions (poet poet@a1 → poet@a2 )" in t for t in seen
        )
        assert any("take 50% of their aliases' requests and soak 4.0 s" in t for t in seen), seen[-1:]
        assert dep["held_loras"] is None
        assert sorted(r["id"] for r in dep["placed"]) == replicas
        [done] = [e for e in events if e["action"] == "deployment.rollout.done"]
        assert "adapters poet: poet@a1 -> poet@a2 in place: passed" in done["detail"], done
        assert outcomes and all(o == "ok" for o in outcomes), [o for o in outcomes if o != "ok"][:3]
        during = await metered(cluster, len(outcomes))
        assert during.keys() == {"tiny:v1+poet:a1", "tiny:v1+poet:a2"}, during  # both answered while it soaked

        # Once passed, poet@a2 answers every request for `poet`.
        after: list[str] = []
        await asking(cluster, after, lambda: wait_until("answers after", at_least(after, 12), timeout_s=TIMEOUT_S))
        now = await metered(cluster, len(outcomes) + len(after))
        assert now["tiny:v1+poet:a1"] == during["tiny:v1+poet:a1"]
        assert all(o == "ok" for o in after)
