"""A new LoRA adapter version rolled out under watch and reverted by itself (issues 34 and 36): a controller,
two real `nexa node` agents running `sim` runtimes that load adapters at run time (vLLM's endpoints), and
clients asking for the adapter's alias through the official `openai` SDK the whole time.

The alias `poet` serves adapter poet@a1 on the deployment's model; promoted to poet@a2, the deployment's
replicas roll to it (reason `adapter`). poet@a2 is bad: the sim runtimes fail every request naming an adapter
loaded from its artifact (the faults file's `loras`, keyed by its sha256, which the node's cache path holds)
before any output. The first new replica's failures break the deployment's error-rate objective during its
soak: the rollout is reverted to poet@a1, audited with the figures, and poet@a2 is held. Every failed attempt
was before any output, so the gateway retried it on a replica still loading poet@a1: every client request is
answered, and usage names the adapter version that answered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SIM_ARGS, SimCluster, gateway_cluster, usage_rows, wait_until
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


async def revert_of_a2(cluster: SimCluster, outcomes: list[str]) -> tuple[Json, Json]:
    """Promote poet to a2 while clients ask; the deployment once reverted, and the revert's audit event."""
    with trio.fail_after(3 * TIMEOUT_S):
        await wait_until("answers for poet@a1", at_least(outcomes, 10), timeout_s=TIMEOUT_S)
        await serve(cluster, "a2")
        async with cluster.client() as http:

            async def reverted() -> Json | None:
                dep: Json = (await ok(http.get("/api/v1/deployments/chat")))["deployment"]
                return dep if dep["held_loras"] and dep["rollout"] is None else None

            dep = await wait_until("the revert of poet@a2", reverted, timeout_s=TIMEOUT_S)
            assert dep is not None, "no revert"
            events = (await ok(http.get("/api/v1/audit", params={"action": "deployment.rollout.revert"})))["events"]
        await wait_until("answers after the revert", at_least(outcomes, len(outcomes) + 10), timeout_s=TIMEOUT_S)
    return dep, events[0]


async def test_a_bad_adapter_version_is_reverted_after_its_first_replica_with_every_request_answered(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, tiny_lora_gguf: Path
) -> None:
    lora = await trio.Path(tiny_lora_gguf).read_bytes()
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        await adapter(cluster, s3_store, lora, "a1")
        bad = await adapter(cluster, s3_store, lora + b"\0" * 8, "a2")
        await serve(cluster, "a1")
        await cluster.deploy("chat", replicas=2, args=[*SIM_ARGS, "--max-loras", "2"])
        async with cluster.client() as http:
            policy = {"rollout_policy": {"soak_s": 60.0, "min_requests": 5}}
            await ok(http.post("/api/v1/deployments/chat/change", json=policy))
        for node in cluster.nodes:
            node.set_faults(loras={bad: {"fail": "before", "status": 500}})

        stop, outcomes = trio.Event(), []
        async with trio.open_nursery() as clients:
            for _ in range(3):
                clients.start_soon(trio.to_thread.run_sync, send_steadily, cluster, stop, outcomes, "poet")
            try:
                dep, revert = await revert_of_a2(cluster, outcomes)
            finally:
                stop.set()

        assert dep["loras"] == {"poet": {"model": "poet", "version": "a1"}}
        assert dep["held_loras"] == {"poet": {"model": "poet", "version": "a2"}}
        assert "broke the objectives (error rate" in revert["detail"], revert
        assert "adapters poet: poet@a2 -> poet@a1" in revert["detail"], revert
        assert outcomes and all(o == "ok" for o in outcomes), [o for o in outcomes if o != "ok"][:3]

        async def metered() -> dict[str, int] | None:
            rows = await usage_rows(cluster, tenant=cluster.tenant)
            by_model = {str(r["model"]): int(str(r["requests"])) for r in rows}
            return by_model if sum(by_model.values()) >= len(outcomes) else None

        # Each request is metered once, as the version of the replica that answered it: a1's, since
        # every attempt on a2 failed before any output.
        assert await wait_until("usage of every request", metered, timeout_s=TIMEOUT_S) == {
            "tiny:v1+poet:a1": len(outcomes)
        }
