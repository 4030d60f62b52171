"""Deployments through the real API: a controller checking a real OCI registry and S3 store, and
RawNodes heartbeating real (GB10) inventories over the real CurveZMQ channel. Every pushed set is
decoded with the controller's public signing key.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from nexa.control.deployments.scheduler import FILTERS
from nexa.control.service import serve_control
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import TIMEOUT_S, assert_envelope, make_key, node_view, ok, wait_for
from tests.support.deployments import Online, body, fleet_image, names, online, registry_ready, set_where
from tests.support.models import bring_to, registry_config


async def placed_on(http: httpx.AsyncClient, name: str) -> list[str]:
    view = await ok(http.get(f"/api/v1/deployments/{name}"))
    return sorted(r["node_id"] for r in view["deployment"]["placed"])


async def test_a_deployment_is_placed_and_its_nodes_get_signed_sets(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    n1 = await online(dep_reg, dial, nursery, "n1")
    n2 = await online(dep_reg, dial, nursery, "n2")
    async with dep_reg.client() as http:
        model = await registry_ready(http, s3_store, test_images)
        created = await ok(http.post("/api/v1/deployments", json=body(replicas=2)), 201)
        assert created["ready_to_run"] == 2 and created["problem"] is None
        assert created["deployment"]["model"] == {"model": "tiny", "version": "v1"}
        assert await placed_on(http, "chat-a") == ["n1", "n2"]  # spread: one replica per node
        placement = await ok(http.get("/api/v1/deployments/chat-a/placement"))
        listed = await ok(http.get("/api/v1/deployments"))
        events = [e for e in (await ok(http.get("/api/v1/audit")))["events"] if e["action"] == "deployment.create"]
    for online_node in (n1, n2):
        pushed = await set_where(online_node.node, lambda s: "chat-a" in names(s))
        assert pushed.generation == 2  # decoded with the controller's key by receive_set
        [a] = pushed.assignments
        spec = a.runtime
        assert spec.image == fleet_image(test_images) and spec.kind == "llamacpp"
        assert spec.artifact is not None
        assert (spec.artifact.uri, spec.artifact.sha256, spec.artifact.size_bytes) == (
            model["artifact"]["uri"],
            model["artifact"]["sha256"],
            model["artifact"]["size_bytes"],
        )
        assert spec.gpus == ["nvidia.com/gpu=0"] and spec.port == 18100
        assert spec.memory_bytes == model["memory_bytes"]
        assert spec.process == ["llama-server", "--model", "/models/model"]
        # The busybox image has no ENTRYPOINT (its config, read from the registry): the program is set as one.
        assert spec.entrypoint == ["llama-server"]
    # The placement explanation shows what the replica runs, as signed.
    assert placement["process"] == ["llama-server", "--model", "/models/model"]
    decision = placement["decision"]
    assert decision["feasible"] is True
    assert [e["node_id"] for e in decision["explanations"]] == ["n1", "n2"]
    for e in decision["explanations"]:
        assert [f["name"] for f in e["filters"]] == list(FILTERS)
        assert all(f["passed"] for f in e["filters"])
        assert {t["name"] for t in e["terms"]} >= {"headroom", "load", "reliability", "policy"}
    assert [d["deployment"]["name"] for d in listed["deployments"]] == ["chat-a"]
    assert [(e["target"], e["result"]) for e in events] == [("deployment/chat-a", "ok")]


async def test_refusals_are_422_naming_the_reason_and_place_nothing(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    await online(dep_reg, dial, nursery, "n1")
    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        await bring_to(http, s3_store, "tiny", "v2", "Evaluated")
        unapproved = body(alias=None, model={"model": "tiny", "version": "v2"})
        err = assert_envelope(await http.post("/api/v1/deployments", json=unapproved), 422, "model_not_approved")
        assert "tiny@v2" in str(err["message"]) and "Evaluated" in str(err["message"])
        err = assert_envelope(await http.post("/api/v1/deployments", json=body(runtime="nope")), 422, "runtime_unknown")
        assert "nope" in str(err["message"])
        assert_envelope(await http.post("/api/v1/deployments", json=body(alias="ghost")), 422, "model_unknown")
        expired = {"spdx_id": "Apache-2.0", "accepted_by": "legal", "expires_at": time.time() - 60}
        await ok(http.post("/api/v1/models/tiny/v1/license", json=expired))
        err = assert_envelope(await http.post("/api/v1/deployments", json=body()), 422, "license_invalid")
        assert "expired" in str(err["message"])
        assert_envelope(await http.post("/api/v1/deployments", json=body(name="Bad Name!")), 400, "invalid_request")
        negative = body(resources={"accelerators": 1, "overhead_bytes": -1})
        err = assert_envelope(await http.post("/api/v1/deployments", json=negative), 400, "invalid_request")
        assert "resources.overhead_bytes: 0 or more bytes" in str(err["message"])
        assert (await ok(http.get("/api/v1/deployments")))["deployments"] == []
    assert (await node_view(dep_reg, "n1"))["desired_generation"] == 1


async def test_an_impossible_deployment_is_422_with_every_node_explained(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    await online(dep_reg, dial, nursery, "n1", labels="zone=a")
    await online(dep_reg, dial, nursery, "n2", labels="zone=b")
    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        impossible = body(placement={"node_selector": {"zone": "c"}})
        err = assert_envelope(await http.post("/api/v1/deployments", json=impossible), 422, "unplaceable")
        message = str(err["message"])
        assert "no node passes every filter" in message
        assert "n1: selector_labels: needs zone=c (node has zone=a)" in message
        assert "n2: selector_labels: needs zone=c (node has zone=b)" in message
        huge = body(resources={"accelerators": 1, "memory_bytes": 1 << 50})
        err = assert_envelope(await http.post("/api/v1/deployments", json=huge), 422, "unplaceable")
        assert "n1: memory: needs" in str(err["message"])
        assert (await ok(http.get("/api/v1/deployments")))["deployments"] == []
        assert_envelope(await http.get("/api/v1/deployments/chat-a/placement"), 404, "not_found")
    for node_id in ("n1", "n2"):
        assert (await node_view(dep_reg, node_id))["desired_generation"] == 1


async def test_a_forecast_answers_and_changes_nothing(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    await online(dep_reg, dial, nursery, "n1", labels="zone=a")
    await online(dep_reg, dial, nursery, "n2", labels="zone=b")
    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        before = await ok(http.get("/api/v1/audit"))
        fits = await ok(http.post("/api/v1/capacity/forecast", json=body(placement={"node_selector": {"zone": "b"}})))
        nope = await ok(http.post("/api/v1/capacity/forecast", json=body(placement={"node_selector": {"zone": "c"}})))
        assert_envelope(await http.post("/api/v1/capacity/forecast", json=body(runtime="nope")), 422, "runtime_unknown")
        assert (await ok(http.get("/api/v1/deployments")))["deployments"] == []
        after = await ok(http.get("/api/v1/audit"))
    assert fits["feasible"] is True
    assert [p["node_id"] for p in fits["placements"]] == ["n2"]
    assert nope["feasible"] is False and nope["placements"] == []
    assert "no node passes every filter" in nope["reason"]
    assert before["events"][-1]["seq"] == after["events"][-1]["seq"]
    for node_id in ("n1", "n2"):
        assert (await node_view(dep_reg, node_id))["desired_generation"] == 1


async def two_nodes_one_replica(
    c: Controller, dial: Any, nursery: trio.Nursery, s3: S3Store, images: BuiltImages
) -> tuple[dict[str, Online], str]:
    """Nodes n1 and n2 online, deployment chat-a (one replica) created; where the replica went."""
    nodes = {name: await online(c, dial, nursery, name) for name in ("n1", "n2")}
    async with c.client() as http:
        await registry_ready(http, s3, images)
        await ok(http.post("/api/v1/deployments", json=body()), 201)
        [first] = await placed_on(http, "chat-a")
    return nodes, first


async def test_a_revoked_node_loses_its_replica_to_another(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    nodes, first = await two_nodes_one_replica(dep_reg, dial, nursery, s3_store, test_images)
    async with dep_reg.client() as http:
        other = "n2" if first == "n1" else "n1"
        generation = (await node_view(dep_reg, first))["desired_generation"]
        await ok(http.post(f"/api/v1/nodes/{first}/revoke"))

        async def moved() -> bool:
            return await placed_on(http, "chat-a") == [other]

        await wait_for(moved)
    pushed = await set_where(nodes[other].node, lambda s: "chat-a" in names(s))
    assert len(pushed.assignments) == 1
    revoked = await node_view(dep_reg, first)
    assert revoked["state"] == "Revoked"
    assert revoked["desired_generation"] == generation + 1  # its own set emptied


@pytest.mark.slow
async def test_a_drained_node_keeps_its_replica_until_the_replacement_is_ready(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    nodes, first = await two_nodes_one_replica(dep_reg, dial, nursery, s3_store, test_images)
    async with dep_reg.client() as http:
        other = "n2" if first == "n1" else "n1"
        original = await set_where(nodes[first].node, lambda s: "chat-a" in names(s))
        nodes[first].node.ready.add(original.assignments[0].id)
        await ok(http.post(f"/api/v1/nodes/{first}/drain"))
        # The replacement is placed while the drained node keeps serving.
        replacement = await set_where(nodes[other].node, lambda s: "chat-a" in names(s))
        assert sorted(await placed_on(http, "chat-a")) == sorted([first, other])
        await trio.sleep(2.5)  # several reconciler passes: nothing stops before the replacement is Ready
        assert sorted(await placed_on(http, "chat-a")) == sorted([first, other])
        nodes[other].node.ready.add(replacement.assignments[0].id)
        emptied = await set_where(nodes[first].node, lambda s: s.assignments == [])
        assert emptied.generation == 3
        assert await placed_on(http, "chat-a") == [other]


@pytest.mark.slow
async def test_an_unreachable_node_is_replaced_after_the_grace_period(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    nodes, first = await two_nodes_one_replica(dep_reg, dial, nursery, s3_store, test_images)
    async with dep_reg.client() as http:
        other = "n2" if first == "n1" else "n1"
        nodes[first].beating.cancel()
        silent_at = trio.current_time()

        async def moved() -> bool:
            return await placed_on(http, "chat-a") == [other]

        await wait_for(moved)
    # lease_s (3 s) to become Unreachable, then replace_after_s (1 s) of grace
    assert trio.current_time() - silent_at >= 3.5
    await set_where(nodes[other].node, lambda s: "chat-a" in names(s))


async def test_scale_up_down_and_delete_change_the_node_sets(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    nodes, first = await two_nodes_one_replica(dep_reg, dial, nursery, s3_store, test_images)
    async with dep_reg.client() as http:
        other = "n2" if first == "n1" else "n1"
        scaled = await ok(http.post("/api/v1/deployments/chat-a/scale", json={"replicas": 2}))
        assert scaled["deployment"]["replicas"] == 2 and scaled["ready_to_run"] == 2
        assert await placed_on(http, "chat-a") == ["n1", "n2"]
        await set_where(nodes[other].node, lambda s: "chat-a" in names(s))
        down = await ok(http.post("/api/v1/deployments/chat-a/scale", json={"replicas": 1}))
        assert down["ready_to_run"] == 1
        assert await placed_on(http, "chat-a") == [first]
        await set_where(nodes[other].node, lambda s: s.assignments == [])
        too_many = await http.post("/api/v1/deployments/chat-a/scale", json={"replicas": 200})
        assert_envelope(too_many, 422, "unplaceable")
        assert await placed_on(http, "chat-a") == [first]
        deleted = await ok(http.delete("/api/v1/deployments/chat-a"))
        assert deleted["deployment"]["name"] == "chat-a"
        assert_envelope(await http.get("/api/v1/deployments/chat-a"), 404, "not_found")
    await set_where(nodes[first].node, lambda s: s.assignments == [])


async def test_deployment_routes_need_operator_or_admin(dep_reg: Controller) -> None:
    key = await make_key(dep_reg, "monitoring")
    async with dep_reg.client(key) as http:
        assert_envelope(await http.get("/api/v1/deployments"), 403, "forbidden")
        assert_envelope(await http.post("/api/v1/capacity/forecast", json=body()), 403, "forbidden")


async def _serve(cfg: Any, admin_key: str | None, *, task_status: trio.TaskStatus[Controller]) -> None:
    """serve_control until its `stopping` is set; returns only once it has closed its store."""
    stopping = trio.Event()

    async def run(task_status: trio.TaskStatus[Any]) -> None:
        await serve_control(cfg, stopping=stopping, task_status=task_status)

    async with trio.open_nursery() as inner:
        started = await inner.start(run)
        key = started.admin_key or admin_key
        task_status.started(
            Controller(url=started.urls[0], admin_key=key, state_dir=Path(cfg.state_dir), stopping=stopping)
        )


async def test_deployments_and_node_sets_survive_a_controller_restart(
    nursery: trio.Nursery, tmp_path: Path, dial: Any, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    done = trio.Event()

    async def first_run(task_status: trio.TaskStatus[Controller]) -> None:
        await _serve(cfg, None, task_status=task_status)
        done.set()

    first: Controller = await nursery.start(first_run)
    n1 = await online(first, dial, nursery, "n1")
    async with first.client() as http:
        await registry_ready(http, s3_store, test_images)
        await ok(http.post("/api/v1/deployments", json=body()), 201)
        before = await ok(http.get("/api/v1/deployments/chat-a"))
        node_before = await ok(http.get("/api/v1/nodes/n1"))
    n1.beating.cancel()
    first.stopping.set()
    with trio.fail_after(TIMEOUT_S):
        await done.wait()

    second: Controller = await nursery.start(_serve, cfg, first.admin_key)
    async with second.client() as http:
        after = await ok(http.get("/api/v1/deployments/chat-a"))
        node_after = await ok(http.get("/api/v1/nodes/n1"))
        placement = await ok(http.get("/api/v1/deployments/chat-a/placement"))
    assert after["deployment"] == before["deployment"]
    assert node_after["desired_generation"] == node_before["desired_generation"] == 2
    assert placement["decision"] is not None and placement["decision"]["feasible"] is True
    second.stopping.set()
