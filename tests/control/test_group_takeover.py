"""A group replica across a change of leader (`grouprun`: the leader keeps each group's run in the
store, and a controller that takes the lead continues it). First the controller is the only one on
its embedded store, stopped and started again on the same state dir and channel port: the new
process takes the next epoch and reads the store as a controller taking over a shared one does
(`Deployments.run` resumes the runs when it starts leading). Then two controllers on one
PostgreSQL database: the leader stops, the follower takes the lease and the nodes dial it. The
nodes are RawNodes heartbeating real GB10 inventories over the real CurveZMQ channel.

Asserted: a group that was Ready stays Ready and routable (its members are never withdrawn: its
nodes' sets keep their generation), and a group caught half started (its worker sent, its head
not) is restarted whole: its worker withdrawn, then sent again after the backoff, workers first.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import attrs
import trio

from nexa.config import ChannelConfig
from nexa.control.service import KEYS_DIR
from tests.conftest import Controller, free_channel_port, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import node_view, ok, wait_for
from tests.support.deployments import body, online, registry_ready, set_where
from tests.support.follow import cluster_config, until_leads
from tests.support.models import registry_config
from tests.support.postgres import pg_url_fixture, postgres_fixture  # noqa: F401

GIB = 2**30
#: More than one GB10's pool holds, and more than half of it: one group per pair of nodes.
BIG = 150 * GIB
NODES = {"n1": "ib0", "n2": "ib0", "n3": "ib1", "n4": "ib1"}


def held(pushed: Any, deployment: str) -> list[str]:
    """The ids of `deployment`'s members a pushed set holds."""
    return [a.id for a in pushed.assignments if a.deployment == deployment]


async def groups(c: Controller, name: str) -> tuple[list[dict[str, Any]], int]:
    async with c.client() as http:
        view = await ok(http.get(f"/api/v1/deployments/{name}"))
    return view["groups"], view["ready"]


async def group_events(c: Controller) -> list[tuple[str, str]]:
    async with c.client() as http:
        events = (await ok(http.get("/api/v1/audit")))["events"]
    return [(e["target"], e["detail"]) for e in events if e["action"] == "deployment.group"]


async def test_a_new_leader_keeps_a_ready_group_serving_and_restarts_a_half_started_one_whole(
    dial: Any, nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    cfg = attrs.evolve(cfg, channel=ChannelConfig(listen=f"tcp://127.0.0.1:{free_channel_port()}"))
    async with trio.open_nursery() as first_run:
        first = await start_controller(first_run, cfg)
        nodes = {}
        for i, (name, fabric) in enumerate(NODES.items(), start=1):
            labels = f"fabric={fabric},fabric-address=10.0.0.{i}"
            nodes[name] = (await online(first, dial, nursery, name, labels=labels)).node
            nodes[name].report_generation = True
        async with first.client() as http:
            await registry_ready(http, s3_store, test_images)
            for dep in ("ready", "half"):
                b = body(name=dep, nodes_per_replica=2, resources={"accelerators": 1, "memory_bytes": BIG})
                b["options"] = {"port": 18100}
                await ok(http.post("/api/v1/deployments", json=b), 201)
        # `ready` on n1 (head) and n2; `half` on n3 (head) and n4, its worker sent and never Ready.
        [ready] = (await groups(first, "ready"))[0]
        [half] = (await groups(first, "half"))[0]
        assert [m["node_id"] for m in ready["members"]] == ["n1", "n2"]
        assert [m["node_id"] for m in half["members"]] == ["n3", "n4"]
        ready_id, half_id = ready["replica_id"], half["replica_id"]
        await set_where(nodes["n2"], lambda s: held(s, "ready") == [f"{ready_id}-rank1"])
        nodes["n2"].ready.add(f"{ready_id}-rank1")
        await set_where(nodes["n1"], lambda s: held(s, "ready") == [ready_id])
        nodes["n1"].ready.add(ready_id)
        await set_where(nodes["n4"], lambda s: held(s, "half") == [f"{half_id}-rank1"])

        async def serving() -> bool:
            got, routable = await groups(first, "ready")
            return bool(got[0]["state"] == "ready" and routable == 1)

        await wait_for(serving)
        assert (await groups(first, "half"))[0][0]["state"] == "starting"
        generations = {n: (await node_view(first, n))["desired_generation"] for n in NODES}
        # Becoming Ready changed no node set; it was written to the store (and audited) all the same.
        assert ("deployment/ready", f"group {ready_id} ready") in await group_events(first)
        first.stopping.set()

    # The new leader: the next epoch, the same store.
    second = await start_controller(nursery, cfg, admin_key=first.admin_key)
    # The half-started group is withdrawn whole (its worker leaves n4's set at the new epoch) ...
    withdrawn = await set_where(nodes["n4"], lambda s: not held(s, "half"))
    assert withdrawn.generation == generations["n4"] + 1
    [state] = (await groups(second, "half"))[0]
    assert state["state"] == "restarting"
    assert state["detail"].startswith("the leading controller changed while the group was starting")
    # ... then sent again after the backoff, workers first, on the ports it had.
    again = await set_where(nodes["n4"], lambda s: held(s, "half") == [f"{half_id}-rank1"])
    [member] = [a for a in again.assignments if a.deployment == "half"]
    assert member.runtime.group is not None and member.runtime.group.me.port == 19100

    # The Ready group stayed Ready and routable: its members were never withdrawn.
    async def still_serving() -> bool:
        got, routable = await groups(second, "ready")
        return bool(got[0]["state"] == "ready" and routable == 1)

    await wait_for(still_serving)
    for name in ("n1", "n2"):
        assert (await node_view(second, name))["desired_generation"] == generations[name]
    events = await group_events(second)
    assert [d for t, d in events if t == "deployment/ready" and "withdrawn" in d] == []
    assert any(
        t == "deployment/half" and f"group {half_id}: caught starting at a change of leader" in d for t, d in events
    )
    second.stopping.set()


async def test_a_follower_that_takes_the_lease_keeps_a_ready_group_ready_on_postgresql(
    dial: Any, nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, pg_url: str
) -> None:
    def config(name: str) -> Any:
        clustered = cluster_config(tmp_path, name, pg_url)
        (tmp_path / name).mkdir(exist_ok=True)
        registry = registry_config(tmp_path / name, s3_store)
        channel = ChannelConfig(listen=f"tcp://127.0.0.1:{free_channel_port()}")
        return attrs.evolve(clustered, oci=registry.oci, artifacts=registry.artifacts, channel=channel)

    a_cfg, b_cfg = config("a"), config("b")
    async with trio.open_nursery() as a_run:
        leader = await start_controller(a_run, a_cfg)
        # Every controller on a store shares the controller keys (copied, as an operator does).
        shutil.copytree(leader.state_dir / KEYS_DIR, tmp_path / "b" / "state" / KEYS_DIR)
        follower = await start_controller(nursery, b_cfg, admin_key=leader.admin_key)
        nodes = {}
        for i, name in enumerate(("n1", "n2"), start=1):
            labels = f"fabric=ib0,fabric-address=10.0.0.{i}"
            nodes[name] = (await online(leader, dial, nursery, name, labels=labels)).node
            nodes[name].report_generation = True
        async with leader.client() as http:
            await registry_ready(http, s3_store, test_images)
            b = body(name="ready", nodes_per_replica=2, resources={"accelerators": 1, "memory_bytes": BIG})
            b["options"] = {"port": 18100}
            await ok(http.post("/api/v1/deployments", json=b), 201)
        [group] = (await groups(leader, "ready"))[0]
        rid = group["replica_id"]
        await set_where(nodes["n2"], lambda s: held(s, "ready") == [f"{rid}-rank1"])
        nodes["n2"].ready.add(f"{rid}-rank1")
        await set_where(nodes["n1"], lambda s: held(s, "ready") == [rid])
        nodes["n1"].ready.add(rid)

        async def ready_on(c: Controller) -> bool:
            got, routable = await groups(c, "ready")
            return bool(got[0]["state"] == "ready" and routable == 1)

        await wait_for(lambda: ready_on(leader))
        # The follower shows the group as the leader wrote its run (it runs none itself).
        await wait_for(lambda: _state(follower, "ready"))
        generations = {n: (await node_view(leader, n))["desired_generation"] for n in nodes}
        leader.stopping.set()  # a clean stop releases the lease: the follower takes it

    async with follower.client() as http:
        await until_leads(http)
    # The nodes dial the new leader (an agent keeps a channel to every controller).
    for node in nodes.values():
        node.enrolled = attrs.evolve(node.enrolled, channel_endpoint=b_cfg.channel.listen)
        await dial(node)
    await wait_for(lambda: ready_on(follower))
    for name in nodes:
        assert (await node_view(follower, name))["desired_generation"] == generations[name]
    events = await group_events(follower)
    assert [d for _, d in events if "withdrawn" in d] == []
    follower.stopping.set()


async def _state(c: Controller, want: str) -> bool:
    got, _ = await groups(c, "ready")
    return bool(got and got[0]["state"] == want)
