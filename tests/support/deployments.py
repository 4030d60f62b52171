"""Deployments over the API with RawNodes online: nodes that say hello and keep heartbeating GB10
inventories, the signed sets pushed to them, a runtime image for both architectures, and the
registry state (runtime, Approved model, alias) a deployment needs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio

from nexa.contracts import wire
from nexa.contracts.deployments import Deployment, PlacementSpec, Replica, Resources, RuntimeOptions
from nexa.contracts.models import ModelRef
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import TIMEOUT_S, Json, node_view, ok, wait_for
from tests.support.models import bring_to
from tests.support.oci import push_index
from tests.support.rawnode import RawNode, enroll


@attrs.define
class Online:
    node: RawNode
    beating: trio.CancelScope


async def _beat(node: RawNode, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            await node.send(node.frames(node.heartbeat()))
            await trio.sleep(0.3)


async def online(
    c: Controller,
    dial: Any,
    nursery: trio.Nursery,
    name: str,
    labels: str = "",
    claims: Json | None = None,
    *,
    protocol: int = wire.PROTOCOL_VERSION,
) -> Online:
    """Enroll a node, say hello (at `protocol`: an earlier release's node says less), and keep it
    heartbeating its inventory (with `claims` over its fields) until the test ends."""
    node = await dial(await enroll(c, name, labels))
    node.claims = claims or {}
    node.seq += 1
    hello = wire.Hello(node_id=node.node_id, seq=node.seq, ts=time.time(), agent_version="test", protocol=protocol)
    await node.send(node.frames(hello))
    with trio.fail_after(TIMEOUT_S):
        first = await node.receive_set()
    assert first.assignments == []
    scope = await nursery.start(_beat, node)

    async def ready() -> bool:
        view = await node_view(c, node.node_id)
        return bool(view["state"] == "Ready")  # Ready: its inventory arrived

    await wait_for(ready)
    return Online(node, scope)


async def set_where(node: RawNode, pred: Callable[[wire.AssignmentSet], bool]) -> wire.AssignmentSet:
    """The next signed set pushed to the node that satisfies `pred` (renewals and re-pushes are skipped)."""
    with trio.fail_after(TIMEOUT_S):
        while True:
            pushed = await node.receive_set()
            if pred(pushed):
                return pushed


def names(pushed: wire.AssignmentSet) -> list[str]:
    return [a.deployment for a in pushed.assignments]


def fleet_image(images: BuiltImages) -> str:
    """A runtime image in the run's registry offering linux/amd64 and linux/arm64: the raw nodes here
    report GB10 (arm64) inventories, and placement filters nodes whose architecture an image lacks.
    Never pulled (the nodes are raw channels)."""
    host = images.busybox.partition("/")[0]
    arches = [{"os": "linux", "architecture": "amd64"}, {"os": "linux", "architecture": "arm64"}]
    return push_index(host, "nexa-test/fleet-runtime", arches)


async def registry_ready(http: httpx.AsyncClient, s3: S3Store, images: BuiltImages) -> Json:
    """A runtime, an Approved model tiny@v1 and alias `chat` pointing at it."""
    await ok(
        http.post(
            "/api/v1/runtimes",
            json={"name": "llama", "kind": "llamacpp", "version": "1", "image": fleet_image(images)},
        ),
        201,
    )
    model = await bring_to(http, s3, "tiny", "v1", "Approved")
    await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "tiny", "version": "v1"}))
    return model


def body(name: str = "chat-a", **over: Any) -> Json:
    b: Json = {
        "name": name,
        "runtime": "llama",
        "alias": "chat",
        "replicas": 1,
        "resources": {"accelerators": 1},
        "options": {"port": 18100, "command": ["llama-server", "--model", "/models/model"]},
    }
    b.update(over)
    return b


def placed_deployment(node_id: str, model: ModelRef) -> Deployment:
    """Deployment chat-a (sim runtime, alias chat) of `model` with its one replica placed on `node_id`."""
    now = time.time()
    return Deployment(
        name="chat-a",
        runtime="sim",
        alias="chat",
        model=model,
        replicas=1,
        resources=Resources(),
        options=RuntimeOptions(),
        placement=PlacementSpec(),
        created_at=now,
        created_by=None,
        updated_at=now,
        placed=[Replica(id="chat-a-r1", node_id=node_id, gpus=[], model=model)],
    )
