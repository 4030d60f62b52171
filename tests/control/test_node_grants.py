"""What a node says about itself does not widen what it may receive (issue 30 point 2).

Two RawNodes (real CurveZMQ channels, real controller, real OCI registry and S3 store) both claim
`confidential` in their inventory; only one was granted it by the admin at enrollment
(`data-class.nexa.io/confidential`). The other also tries to grant itself through inventory
labels and to override an admin label. It gets no confidential replica, and a confidential prompt
is never routed to it: with its replica the only one Ready, the prompt is refused; once the granted
node has one, the prompt goes there.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from nexa.cli.nodes import render_node
from nexa.contracts import codec, wire
from nexa.contracts.api import NodeView
from nexa.control.fleet.grants import data_classes, granted_data_classes, labels
from tests.conftest import Controller, gb10_inventory
from tests.realparts import BuiltImages, S3Store
from tests.support.api import TIMEOUT_S, make_key, node_view, ok, wait_for
from tests.support.deployments import body, names, online, registry_ready, set_where

CONFIDENTIAL = {"data_classes": ("public", "confidential")}
GRANT = "zone=a,data-class.nexa.io/public=,data-class.nexa.io/confidential="
MESSAGES = [{"role": "user", "content": "hello"}]


def test_the_admins_grant_is_narrowed_never_widened() -> None:
    inventory = gb10_inventory()
    claims = attrs.evolve(inventory, data_classes=("public", "internal", "confidential"))
    assert granted_data_classes({}) == {"public"}  # no grant: the default
    assert data_classes({}, claims) == ("public",)
    assert data_classes({"data-class.nexa.io/internal": ""}, claims) == ("internal",)
    assert data_classes({"data-class.nexa.io/confidential": "", "data-class.nexa.io/gpu": ""}, inventory) == ()
    assert data_classes({"data-class.nexa.io/public": ""}, None) == ()
    merged = labels({"zone": "a"}, [("zone", "b"), ("rack", "r1"), ("nexa.io/x", ""), ("data-class.nexa.io/c", "")])
    assert merged == {"zone": "a", "rack": "r1"}


async def test_a_node_claiming_confidential_without_the_grant_gets_no_replica_and_no_prompt(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    self_granted = {**CONFIDENTIAL, "labels": {"zone": "b", "data-class.nexa.io/confidential": ""}}
    claimer = await online(dep_reg, dial, nursery, "claimer", "zone=a", claims=self_granted)
    granted = await online(dep_reg, dial, nursery, "granted", GRANT, claims=CONFIDENTIAL)
    shown = await node_view(dep_reg, "claimer")
    assert shown["data_classes"] == ["public"] and shown["labels"] == {"zone": "a"}
    text = render_node(codec.structure(codec.api, shown, NodeView))  # `nexa nodes show`
    assert "data         public (listed by the node, not granted: confidential)" in text
    assert (await node_view(dep_reg, "granted"))["data_classes"] == ["public", "confidential"]

    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        # Only the granted node may hold a confidential replica, whatever the claimer says.
        secret = body("secret", replicas=2, placement={"data_classes": ["confidential"]})
        created = await ok(http.post("/api/v1/deployments", json=secret), 201)
        assert {r["node_id"] for r in created["deployment"]["placed"]} == {"granted"}
        decision = (await ok(http.get("/api/v1/deployments/secret/placement")))["decision"]
        [why] = [e for e in decision["explanations"] if e["node_id"] == "claimer"]
        assert [f["name"] for f in why["filters"] if not f["passed"]] == ["data_classes"]
        # A public deployment on the claimer only (the granted node cordoned meanwhile).
        await ok(http.post("/api/v1/nodes/granted/cordon"))
        await ok(http.post("/api/v1/deployments", json=body("open", options={"port": 18101})), 201)
        await ok(http.post("/api/v1/nodes/granted/uncordon"))
    pushed = await set_where(claimer.node, lambda s: "open" in names(s))
    claimer.node.ready = {a.id for a in pushed.assignments}
    await wait_for(lambda: _ready_on(dep_reg, "claimer"))

    headers = {"x-nexa-data-class": "confidential"}
    request = {"model": "chat", "messages": MESSAGES, "max_tokens": 1}
    async with dep_reg.client(await _inference_key(dep_reg)) as client:
        refused = await client.post("/v1/chat/completions", json=request, headers=headers)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "no_replica_for_data_class"
        # Once the granted node's replica is Ready, the prompt goes there (and never to the claimer).
        pushed = await set_where(granted.node, lambda s: "secret" in names(s))
        granted.node.ready = {a.id for a in pushed.assignments}
        await wait_for(lambda: _ready_on(dep_reg, "granted"))
        async with trio.open_nursery() as n:
            n.start_soon(lambda: client.post("/v1/chat/completions", json=request, headers=headers))
            with trio.fail_after(TIMEOUT_S):
                frames = await _first_data_frame(granted.node)
            n.cancel_scope.cancel()
    assert frames[0] == wire.INFER.encode()


async def _ready_on(c: Controller, node_id: str) -> bool:
    view = await node_view(c, node_id)
    return any(a["state"] == "Ready" for a in view["assignments"])


async def _first_data_frame(node: Any) -> list[bytes]:
    while True:
        got = [f.bytes for f in await node.pump.receive()]
        if len(got) == 4:
            return got


async def _inference_key(c: Controller) -> str:
    return await make_key(c, "inference", "acme")
