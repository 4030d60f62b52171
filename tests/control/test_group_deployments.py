"""Group deployments (`nodes_per_replica` above 1) through the real interfaces: the HTTP API and
the `nexa` CLI against a controller checking a real OCI registry and S3 store, with RawNodes
heartbeating real GB10 inventories over the real CurveZMQ channel, enrolled with `fabric` labels
(the admin's, through their enrollment tokens).

These nodes have a fabric label but no fabric address (none discovered, no `fabric-address` label),
so a group cannot start: it is placed and its members' resources reserved, but no member is put
into a node's signed set (every node stays at its first generation), and the deployment shows the
group pending, saying why. Starting groups is tested in tests/control/test_group_runs.py and
end to end over llama.cpp RPC in tests/e2e/test_llama_rpc_group.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import trio

from nexa.contracts import wire
from nexa.contracts.deployments import GROUP_PENDING
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, node_view, ok, wait_for
from tests.support.console import sign_in
from tests.support.deployments import body, online, registry_ready, set_where
from tests.support.models import bring_to
from tests.support.realmodel import cli

GIB = 2**30
#: More than one GB10's pool holds; half of it (plus llama.cpp's overhead) fits each of two.
BIG = 150 * GIB
#: Why their groups stay pending.
NO_ADDRESS = "node n1 has no fabric address: link its RDMA port so it discovers one, or set its fabric-address label"
FABRICS = {"n1": "ib0", "n2": "ib0", "n3": "ib1", "n4": "ib1", "n5": None}


def members(view: dict[str, Any]) -> list[list[tuple[int, str]]]:
    return [[(m["rank"], m["node_id"]) for m in r["members"]] for r in view["deployment"]["placed"]]


async def test_a_group_is_placed_on_one_fabric_shown_held_back_from_the_nodes_and_moved_whole_on_drain(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    for name, fabric in FABRICS.items():
        await online(dep_reg, dial, nursery, name, labels=f"fabric={fabric}" if fabric else "")
    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        # Bad input is a 400 naming the field, and changes nothing.
        for bad in (0, 17):
            err = assert_envelope(
                await http.post("/api/v1/deployments", json=body(nodes_per_replica=bad)), 400, "invalid_request"
            )
            assert "nodes_per_replica: from 1 to 16" in str(err["message"])
        # A runtime that cannot run as a group is refused when the deployment is created.
        python_server = body(nodes_per_replica=2, options={"port": 18100, "settings": {"server": "llama-cpp-python"}})
        err = assert_envelope(await http.post("/api/v1/deployments", json=python_server), 400, "invalid_request")
        assert "a llama.cpp group runs llama-server and RPC servers" in str(err["message"])
        # One node cannot hold the model.
        alone = body(resources={"accelerators": 1, "memory_bytes": BIG})
        assert_envelope(await http.post("/api/v1/deployments", json=alone), 422, "unplaceable")
        assert (await ok(http.get("/api/v1/deployments")))["deployments"] == []

    created = await trio.to_thread.run_sync(
        cli,
        dep_reg,
        *("deployments", "create", "big", "--runtime", "llama", "--alias", "chat", "--nodes-per-replica", "2"),
        *("--accelerators", "1", "--memory-bytes", str(BIG)),
    )
    assert "n1,n2" in created  # the table's nodes: every member's
    async with dep_reg.client() as http:
        view = await ok(http.get("/api/v1/deployments/big"))
        placement = await ok(http.get("/api/v1/deployments/big/placement"))
    dep = view["deployment"]
    assert dep["nodes_per_replica"] == 2
    assert members(view) == [[(0, "n1"), (1, "n2")]]  # spread, all alike: the first fabric; rank 0 the head
    [replica] = dep["placed"]
    assert (replica["node_id"], replica["gpus"]) == ("n1", ["nvidia.com/gpu=0"])
    assert view["groups"] == [
        {
            "replica_id": replica["id"],
            "state": GROUP_PENDING,
            "detail": NO_ADDRESS,
            "canary": False,
            "members": [{"rank": 0, "node_id": "n1", "state": ""}, {"rank": 1, "node_id": "n2", "state": ""}],
        }
    ]
    assert view["ready"] == 0
    fabrics = {f["fabric"]: f for f in placement["decision"]["fabrics"]}
    assert fabrics["ib0"]["detail"] == "fabric ib0: 2 of 2 node(s) fit, took group(s) 0"
    assert fabrics["ib1"]["detail"] == "fabric ib1: 2 of 2 node(s) fit, not taken: another fabric's set came first"
    assert (fabrics[None]["nodes"], fabrics[None]["groups_placed"]) == (["n5"], 0)
    # Held back: no node was sent a member (a rank alone is no replica).
    for name in FABRICS:
        assert (await node_view(dep_reg, name))["desired_generation"] == 1

    shown = await trio.to_thread.run_sync(cli, dep_reg, "deployments", "show", "big")
    assert f"group    {replica['id']}, 2 nodes: pending: {NO_ADDRESS}" in shown
    assert "  rank 0 (head): n1, GPUs nvidia.com/gpu=0" in shown
    assert "  rank 1: n2, GPUs nvidia.com/gpu=0" in shown
    explained = await trio.to_thread.run_sync(cli, dep_reg, "deployments", "placement", "big")
    assert "fabric ib0: 2 of 2 node(s) fit, took group(s) 0" in explained
    assert "no fabric: n5: never grouped" in explained

    async with dep_reg.client() as http:
        # Draining one member moves the whole group, as a unit, to the other fabric.
        await ok(http.post("/api/v1/nodes/n2/drain"))

        async def moved() -> bool:
            return members(await ok(http.get("/api/v1/deployments/big"))) == [[(0, "n3"), (1, "n4")]]

        await wait_for(moved)
        events = [e for e in (await ok(http.get("/api/v1/audit")))["events"] if e["action"] == "deployment.replace"]
        assert [e["target"] for e in events] == ["deployment/big"]
        assert "no node set changed" in events[0]["detail"]
        # The members' reservations are held on n3 and n4 though no node set holds them: a
        # replica of one node that needs 50 GiB goes to n1 (n2 drains), not beside them.
        solo = body(name="solo", resources={"accelerators": 1, "memory_bytes": 50 * GIB})
        await ok(http.post("/api/v1/deployments", json=solo), 201)
        solo_view = await ok(http.get("/api/v1/deployments/solo"))
        assert [r["node_id"] for r in solo_view["deployment"]["placed"]] == ["n1"]
        solo_placement = (await ok(http.get("/api/v1/deployments/solo/placement")))["decision"]
        for e in solo_placement["explanations"]:
            if e["node_id"] in ("n3", "n4"):
                [memory] = [f for f in e["filters"] if f["name"] == "memory"]
                assert not memory["passed"] and "of unified memory" in memory["detail"]
        # No second group fits now: the forecast and a scale say why, fabric by fabric.
        forecast = await ok(
            http.post(
                "/api/v1/capacity/forecast",
                json=body(name="big2", nodes_per_replica=2, resources={"accelerators": 1, "memory_bytes": BIG}),
            )
        )
        assert forecast["feasible"] is False and forecast["placements"] == []
        reason = forecast["reason"]
        assert reason.startswith("no fabric has 2 nodes that fit a group; fabric ib0: 0 of 2 node(s) fit")
        assert "n1: needs 76.0 GiB of unified memory" in reason and "n2: node is Draining" in reason
        assert "fabric ib1: 0 of 2 node(s) fit, a group needs 2 (n3: needs 76.0 GiB of unified memory" in reason
        assert reason.endswith("1 node(s) without a fabric (n5): never grouped")
        err = assert_envelope(
            await http.post("/api/v1/deployments/big/scale", json={"replicas": 2}), 422, "unplaceable"
        )
        assert "no fabric has 2 nodes that fit a group" in str(err["message"])
        assert members(await ok(http.get("/api/v1/deployments/big"))) == [[(0, "n3"), (1, "n4")]]
    # Only the single-node replica was sent to a node.
    assert (await node_view(dep_reg, "n1"))["desired_generation"] == 2
    for name in ("n2", "n3", "n4", "n5"):
        assert (await node_view(dep_reg, name))["desired_generation"] == 1


async def test_scaling_a_canary_and_a_lost_member_work_in_whole_groups(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    for name in ("n1", "n2", "n3", "n4"):
        await online(dep_reg, dial, nursery, name, labels=f"fabric={FABRICS[name]}")
    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        await bring_to(http, s3_store, "tiny", "v2", "Approved")
        group = body(name="big", nodes_per_replica=2, resources={"accelerators": 1, "memory_bytes": 60 * GIB})
        await ok(http.post("/api/v1/deployments", json=group), 201)
        # Scaling adds a whole group, spread to the fabric the deployment is not on yet.
        scaled = await ok(http.post("/api/v1/deployments/big/scale", json={"replicas": 2}))
        assert members(scaled) == [[(0, "n1"), (1, "n2")], [(0, "n3"), (1, "n4")]]
        assert [g["state"] for g in scaled["groups"]] == [GROUP_PENDING, GROUP_PENDING]
        # A canary's replicas are extra groups (on one fabric each), shown as the canary's.
        canary = {"model": {"model": "tiny", "version": "v2"}, "replicas": 1, "weight": 0.1}
        started = await ok(http.post("/api/v1/deployments/big/canary", json=canary), 201)
        [canary_group] = started["deployment"]["canary"]["placed"]
        on = [m["node_id"] for m in canary_group["members"]]
        assert len(on) == 2 and len({FABRICS[n] for n in on}) == 1
        assert [g["canary"] for g in started["groups"]] == [False, False, True]
        await ok(http.post("/api/v1/deployments/big/rollback"))  # the canary removed
        # A lost member takes its group with it: placed again, whole, on the other fabric.
        await ok(http.post("/api/v1/nodes/n4/revoke"))

        async def moved() -> bool:
            return members(await ok(http.get("/api/v1/deployments/big"))) == [
                [(0, "n1"), (1, "n2")],
                [(0, "n1"), (1, "n2")],
            ]

        await wait_for(moved)
        # Scaling down drops whole groups.
        down = await ok(http.post("/api/v1/deployments/big/scale", json={"replicas": 1}))
        assert members(down) == [[(0, "n1"), (1, "n2")]]
    for name in ("n1", "n2", "n3"):
        assert (await node_view(dep_reg, name))["desired_generation"] == 1


def role_of(pushed: wire.AssignmentSet, deployment: str) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """Each group member the set holds: its id, its rank, and every member's fabric address and port."""
    return [
        (a.id, a.runtime.group.rank, [(m.address, m.port) for m in a.runtime.group.members])
        for a in pushed.assignments
        if a.deployment == deployment and a.runtime.group is not None
    ]


async def test_a_started_group_sends_its_worker_first_its_head_when_the_worker_is_ready_and_moves_whole_on_drain(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    nodes = {}
    for i, name in enumerate(("n1", "n2", "n3", "n4"), start=1):
        labels = f"fabric={FABRICS[name]},fabric-address=10.0.0.{i}"
        nodes[name] = (await online(dep_reg, dial, nursery, name, labels=labels)).node
        nodes[name].report_generation = True
    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        group = body(
            name="big", nodes_per_replica=2, resources={"accelerators": 1, "memory_bytes": 60 * GIB}, options={}
        )
        group["options"] = {"port": 18100}
        created = await ok(http.post("/api/v1/deployments", json=group), 201)
        [replica] = created["deployment"]["placed"]
        head, worker = replica["id"], f"{replica['id']}-rank1"
        assert [g["state"] for g in created["groups"]] == ["starting"]
        # The worker first: its node's set names it, rank 1, with both members' fabric endpoints.
        pushed = await set_where(nodes["n2"], lambda s: bool(role_of(s, "big")))
        endpoints = [("10.0.0.1", 19100), ("10.0.0.2", 19100)]
        assert role_of(pushed, "big") == [(worker, 1, endpoints)]
        [spec] = [a.runtime for a in pushed.assignments]
        assert spec.port == 19100 and "-H" in spec.command and "10.0.0.2" in spec.command
        assert (await node_view(dep_reg, "n1"))["desired_generation"] == 1  # the head waits
        # The worker Ready: the head is sent, llama-server over the worker's RPC server.
        nodes["n2"].ready.add(worker)
        pushed = await set_where(nodes["n1"], lambda s: bool(role_of(s, "big")))
        assert role_of(pushed, "big") == [(head, 0, endpoints)]
        [spec] = [a.runtime for a in pushed.assignments]
        assert spec.command[spec.command.index("--rpc") + 1] == "10.0.0.2:19100"
        assert spec.port == 18100
        view = await ok(http.get("/api/v1/deployments/big"))
        assert view["groups"][0]["state"] == "starting-head" and view["ready"] == 0
        # The head Ready: the group serves.
        nodes["n1"].ready.add(head)

        async def ready() -> bool:
            view = await ok(http.get("/api/v1/deployments/big"))
            return bool(view["groups"][0]["state"] == "ready" and view["ready"] == 1)

        await wait_for(ready)
        shown = await trio.to_thread.run_sync(cli, dep_reg, "deployments", "show", "big")
        assert f"group    {head}, 2 nodes: ready" in shown
        assert "  rank 1: n2, GPUs nvidia.com/gpu=0, Ready" in shown
        # Only the head is a replica the router scores (and routes to); the console shows the group.
        scored = (await ok(http.get("/api/v1/deployments/big")))["replica_scores"]
        assert [s["replica_id"] for s in scored] == [head]
        async with httpx.AsyncClient(base_url=dep_reg.url, timeout=10) as console:
            assert (await sign_in(console, dep_reg.admin_key)).status_code == 303
            page = (await console.get("/console/deployments/big")).text
        assert 'id="groups-table"' in page and "0 (head): n1, Ready; 1: n2, Ready" in page

        # Draining a member moves the group whole, the new one started workers first; the old one
        # stays until its replacement is Ready.
        await ok(http.post("/api/v1/nodes/n2/drain"))

        async def others() -> list[dict[str, Any]]:
            placed = (await ok(http.get("/api/v1/deployments/big")))["deployment"]["placed"]
            return [r for r in placed if r["id"] != head]

        async def moved() -> bool:
            return bool(await others())

        await wait_for(moved)
        [fresh] = await others()
        assert [(m["rank"], m["node_id"]) for m in fresh["members"]] == [(0, "n3"), (1, "n4")]
        new_endpoints = [("10.0.0.3", 19100), ("10.0.0.4", 19100)]
        pushed = await set_where(nodes["n4"], lambda s: bool(role_of(s, "big")))
        assert role_of(pushed, "big") == [(f"{fresh['id']}-rank1", 1, new_endpoints)]
        nodes["n4"].ready.add(f"{fresh['id']}-rank1")
        pushed = await set_where(nodes["n3"], lambda s: bool(role_of(s, "big")))
        assert role_of(pushed, "big") == [(fresh["id"], 0, new_endpoints)]
        nodes["n3"].ready.add(fresh["id"])
        # Both members of the old group leave their nodes' sets together.
        for name in ("n1", "n2"):
            await set_where(nodes[name], lambda s: not role_of(s, "big"))
        view = await ok(http.get("/api/v1/deployments/big"))
        assert members(view) == [[(0, "n3"), (1, "n4")]]
        assert [g["state"] for g in view["groups"]] == ["ready"]
