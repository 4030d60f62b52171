"""Rollout test helpers: RawNode fleets that collect every pushed set, two model versions, a
deployment's view polled until a predicate holds, and a running canary (tests/control/test_rollout.py
and the jobs and benchmark tests use them)."""

from __future__ import annotations

from typing import Any, Final

import attrs
import httpx
import trio

from nexa.contracts import wire
from tests.conftest import Controller, gb10_inventory
from tests.realparts import BuiltImages, S3Store
from tests.support.api import TIMEOUT_S, ok, wait_for
from tests.support.deployments import Online, online, registry_ready
from tests.support.deployments import body as deployment_body
from tests.support.models import bring_to

Json = dict[str, Any]

#: Per replica: more than half a GB10's unified pool, so one replica per node.
BIG: Final = 70 * 2**30
POOL: Final = gb10_inventory().accelerator_memory_bytes
V1: Final = {"model": "tiny", "version": "v1"}
V2: Final = {"model": "tiny", "version": "v2"}


def big(name: str = "chat-a", replicas: int = 2, **over: Any) -> Json:
    return deployment_body(name, replicas=replicas, resources={"accelerators": 1, "memory_bytes": BIG}, **over)


def canary_body(replicas: int = 1, weight: float = 0.2, **objective: Any) -> Json:
    return {"model": V2, "replicas": replicas, "weight": weight, "objective": objective}


@attrs.define
class Nodes:
    """Online RawNodes, and every set pushed to each of them (collected, never consumed elsewhere)."""

    nodes: dict[str, Online]
    sets: dict[str, list[wire.AssignmentSet]] = attrs.Factory(dict)

    def ready(self, *replicas: Json) -> None:
        """Have each replica's node report it Ready from its next heartbeat on."""
        for r in replicas:
            self.nodes[r["node_id"]].node.ready.add(r["id"])

    def latest(self, node_id: str) -> wire.AssignmentSet | None:
        pushed = self.sets[node_id]
        return pushed[-1] if pushed else None


async def collect_sets(fleet: Nodes, node_id: str) -> None:
    node = fleet.nodes[node_id].node
    while True:
        fleet.sets[node_id].append(await node.receive_set())


async def fleet_of(
    c: Controller, dial: Any, nursery: trio.Nursery, *names: str, protocols: dict[str, int] | None = None
) -> Nodes:
    """Online RawNodes, each saying hello at its protocol level (`protocols`; this release's by default)."""
    levels = protocols or {}
    fleet = Nodes({n: await online(c, dial, nursery, n, protocol=levels.get(n, wire.PROTOCOL_VERSION)) for n in names})
    for name in names:
        fleet.sets[name] = []
        nursery.start_soon(collect_sets, fleet, name)
    return fleet


async def two_versions(http: httpx.AsyncClient, s3: S3Store, images: BuiltImages) -> tuple[Json, Json]:
    """Runtime `llama`, Approved tiny@v1 (alias `chat`) and tiny@v2."""
    v1 = await registry_ready(http, s3, images)
    v2 = await bring_to(http, s3, "tiny", "v2", "Approved")
    return v1, v2


async def view(http: httpx.AsyncClient, name: str = "chat-a") -> Json:
    return await ok(http.get(f"/api/v1/deployments/{name}"))


async def until(http: httpx.AsyncClient, pred: Any, name: str = "chat-a") -> Json:
    """The deployment's view once `pred(view)` holds."""
    seen: Json = {}

    async def check() -> bool:
        nonlocal seen
        seen = await view(http, name)
        return bool(pred(seen))

    await wait_for(check)
    return seen


async def finish_rollout(http: httpx.AsyncClient, fleet: Nodes, name: str = "chat-a") -> Json:
    """Report every new replica Ready as it appears, until the deployment's rollout is done."""
    with trio.fail_after(TIMEOUT_S * 2):
        while True:
            v = await view(http, name)
            if v["deployment"]["rollout"] is None:
                return v
            fleet.ready(*v["deployment"]["placed"])
            await trio.sleep(0.1)


def versions(v: Json) -> list[tuple[str, str]]:
    """(node, version) of each placed replica, sorted."""
    return sorted((r["node_id"], r["model"]["version"]) for r in v["deployment"]["placed"])


async def audit(http: httpx.AsyncClient, action: str) -> list[Json]:
    events = (await ok(http.get("/api/v1/audit", params={"limit": 1000, "action": action})))["events"]
    return list(events)


@attrs.define
class Watch:
    """Every view of one deployment seen while polling (how a test sees a rollout's course)."""

    views: list[Json] = attrs.Factory(list)


async def watch_views(c: Controller, name: str, watch: Watch) -> None:
    async with c.client() as http:
        while True:
            watch.views.append(await view(http, name))
            await trio.sleep(0.02)


def assert_never_short(watch: Watch, fleet: Nodes, replicas: int) -> None:
    """Never fewer than replicas-1 Ready (nor placed); no node ever asked to hold more than it has."""
    assert watch.views
    for v in watch.views:
        assert v["ready"] >= replicas - 1, v
        assert len(v["deployment"]["placed"]) >= replicas - 1, v
    for node_id, pushed in fleet.sets.items():
        for s in pushed:
            assert sum(a.runtime.memory_bytes for a in s.assignments) <= POOL, (node_id, s)
            assert len(s.assignments) <= 1, (node_id, s)


async def canary_running(http: httpx.AsyncClient, fleet: Nodes, **deployment: Any) -> Json:
    """chat-a (two replicas, on n1 and n2) and a canary of v2 on n3, all Ready."""
    await ok(http.post("/api/v1/deployments", json=big(**deployment)), 201)
    await ok(http.post("/api/v1/deployments/chat-a/canary", json=canary_body()), 201)
    v = await view(http)
    fleet.ready(*v["deployment"]["placed"], *v["deployment"]["canary"]["placed"])
    return await until(http, lambda v: v["ready"] == 2 and v["canary_ready"] == 1)
