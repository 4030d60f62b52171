"""The controller's node channel over real CurveZMQ: enrollment, refusals, liveness, signed sets.

A `RawNode` (tests/support/rawnode.py) is a test double for a node agent built from the real pieces
(keys, Curve DEALER, signed frames) so a test can also send what a real agent never would.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa import security
from nexa.channel import links
from nexa.config import StoreConfig
from nexa.contracts import wire
from nexa.control import store as st
from nexa.errors import Unauthenticated
from tests.conftest import Controller, local_config
from tests.support.api import TIMEOUT_S, metric, node_view, wait_for
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401
from tests.support.rawnode import RawNode, enroll


async def test_enrollment_gives_keys_and_endpoint_and_spends_the_token(controller: Controller) -> None:
    key = security.generate_signing_key()
    curve = links.generate_curve_keypair()
    async with controller.client() as http:
        token = (await http.post("/api/v1/enrollment-tokens", json={"ttl_s": 900, "labels": {"rack": "r7"}})).json()
        assert token["token"].startswith("nxb_")
        body = {
            "token": token["token"],
            "hostname": "spark-1.lab",
            "signing_public_key": key.public.b64,
            "curve_public_key": curve.public,
        }
        async with httpx.AsyncClient(base_url=controller.url) as anonymous:
            first = await anonymous.post("/api/v1/enroll", json=body)
            again = await anonymous.post(
                "/api/v1/enroll", json={**body, "curve_public_key": links.generate_curve_keypair().public}
            )
            unknown = await anonymous.post("/api/v1/enroll", json={**body, "token": "nxb_" + "A" * 43})
        nodes = (await http.get("/api/v1/nodes")).json()["nodes"]
    assert first.status_code == 201
    enrolled = first.json()
    assert enrolled["node_id"] == "spark-1"
    assert enrolled["labels"] == {"rack": "r7"}
    assert enrolled["channel_endpoint"].startswith("tcp://127.0.0.1:")
    security.PublicKey.from_b64(enrolled["controller_signing_public_key"])
    assert again.status_code == 401 and "already used" in again.json()["error"]["message"]
    assert unknown.status_code == 401 and "unknown" in unknown.json()["error"]["message"]
    assert [n["id"] for n in nodes] == ["spark-1"]  # the refusals changed nothing
    assert nodes[0]["state"] == "Unreachable"  # enrolled, not yet heard from
    assert "signing_public_key" not in str(nodes) and curve.public not in str(nodes)


async def test_an_expired_token_is_refused_and_changes_nothing(tmp_path: Any, store_cfg: StoreConfig) -> None:
    from nexa.contracts.domain import AuditDraft, EnrollmentToken, Node, NodeId
    from nexa.security import hash_token, new_enrollment_token

    secret = new_enrollment_token()
    async with st.open_store(tmp_path, store_cfg) as store:
        token = EnrollmentToken(
            id="et_1", token_sha256=hash_token(secret), labels={}, created_at=0, expires_at=100, created_by=None
        )
        audit = AuditDraft(
            actor_key_id=None, actor_role=None, action="t", target="t", prior_sha256=None, next_sha256=None
        )
        await store.run(st.insert_token, token, audit)
        node = Node(
            id=NodeId("n1"), hostname="h", signing_public_key="k", curve_public_key="c", labels={}, enrolled_at=0
        )
        with pytest.raises(Unauthenticated, match="expired"):
            await store.run(st.enroll_node, hash_token(secret), 100.5, node, audit)
        assert await store.run(st.load_nodes) == []


@pytest.mark.parametrize(
    ("bad_request", "field"),
    [
        ({"token": "nope"}, "token"),
        ({"signing_public_key": "AAAA"}, "signing_public_key"),
        ({"curve_public_key": "short"}, "curve_public_key"),
        ({"hostname": ""}, "hostname"),
    ],
)
async def test_malformed_enrollment_is_a_400_naming_the_field(
    controller: Controller, bad_request: dict[str, str], field: str
) -> None:
    body = {
        "token": "nxb_" + "A" * 43,
        "hostname": "h",
        "signing_public_key": security.generate_signing_key().public.b64,
        "curve_public_key": links.generate_curve_keypair().public,
    } | bad_request
    async with httpx.AsyncClient(base_url=controller.url) as anonymous:
        resp = await anonymous.post("/api/v1/enroll", json=body)
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]


async def test_hello_gets_a_signed_set_and_the_ack_is_recorded(controller: Controller, dial: Any) -> None:
    node = await dial(await enroll(controller, "n1"))
    with trio.fail_after(TIMEOUT_S):
        await node.send(node.frames(wire.Hello(node_id="n1", seq=1, ts=time.time(), agent_version="test")))
        node.seq = 1
        pushed = await node.receive_set()
    async with controller.client() as http:
        epoch = (await http.get("/version")).json()["epoch"]
    assert (pushed.node_id, pushed.epoch, pushed.generation) == ("n1", epoch, 1)
    assert pushed.lease_expires_at > time.time() + 30
    ack = wire.Ack(node_id="n1", seq=2, ts=time.time(), epoch=epoch, generation=1, accepted=True)
    await node.send(node.frames(ack))
    node.seq = 2

    async def acked() -> bool:
        return (await node_view(controller, "n1"))["acked_generation"] == 1

    await wait_for(acked)
    refusal = wire.Ack(
        node_id="n1",
        seq=3,
        ts=time.time(),
        epoch=epoch,
        generation=1,
        accepted=False,
        reason=wire.RejectReason.STALE_GENERATION,
    )
    await node.send(node.frames(refusal))

    async def refused() -> bool:
        return (await node_view(controller, "n1"))["ack_reason"] == "stale_generation"

    await wait_for(refused)
    async with controller.client() as http:
        events = (await http.get("/api/v1/audit", params={"action": "assignments.rejected"})).json()["events"]
    assert [e["target"] for e in events] == ["node/n1"]


async def test_a_node_is_joining_until_its_inventory_arrives_then_ready(controller: Controller, dial: Any) -> None:
    """Its hello makes it reachable; only its first heartbeat (the inventory) makes it Ready, so no
    client or test sees a Ready node with nothing known about it."""
    node = await dial(await enroll(controller, "n1"))
    with trio.fail_after(TIMEOUT_S):
        await node.send(node.frames(wire.Hello(node_id="n1", seq=1, ts=time.time(), agent_version="test")))
        node.seq = 1
        await node.receive_set()  # the hello was taken
        view = await node_view(controller, "n1")
        assert (view["state"], view["inventory"]) == ("Joining", None)
        async with controller.client() as http:
            metrics = (await http.get("/metrics")).text
        assert 'nexa_nodes{state="Joining"} 1.0' in metrics
        await node.send(node.frames(node.heartbeat()))

        async def ready() -> bool:
            return (await node_view(controller, "n1"))["state"] == "Ready"

        await wait_for(ready)
        async with controller.client() as http:
            metrics = (await http.get("/metrics")).text
        # Counted at the scrape: Joining to Ready is no reachability change, and the gauge follows it.
        assert 'nexa_nodes{state="Ready"} 1.0' in metrics
        assert 'nexa_nodes{state="Joining"} 0.0' in metrics
    assert (await node_view(controller, "n1"))["inventory"]["gpus"]


def _craft(kind: str) -> Any:
    """Each case returns the frames to send (or a special marker) and the rejection reason counted."""

    def forged(node: RawNode, other: RawNode) -> list[bytes]:
        return node.frames(node.heartbeat(), key=security.generate_signing_key())

    def tampered(node: RawNode, other: RawNode) -> list[bytes]:
        kind_, body, sig = node.frames(node.heartbeat())
        return [kind_, body.replace(b'"free_accelerators":1', b'"free_accelerators":9'), sig]

    def wrong_node(node: RawNode, other: RawNode) -> list[bytes]:
        return node.frames(node.heartbeat(node_id=other.node_id))

    def skewed(node: RawNode, other: RawNode) -> list[bytes]:
        return node.frames(node.heartbeat(ts=time.time() - 3600))

    return {"forged": forged, "tampered": tampered, "wrong_node": wrong_node, "skewed": skewed}[kind]


REFUSALS = [
    ("forged", "bad_signature"),
    ("tampered", "bad_signature"),
    ("wrong_node", "wrong_node"),
    ("skewed", "clock_skew"),
    ("replayed", "replayed"),
    ("out_of_order", "replayed"),
    ("unknown_key", "unknown_key"),
    ("revoked", "unknown_key"),
    ("revoked_open_channel", "unauthenticated"),
]


@pytest.mark.parametrize(("case", "reason"), REFUSALS, ids=[c for c, _ in REFUSALS])
async def test_each_bad_message_is_refused_counted_and_audited(
    controller: Controller, dial: Any, case: str, reason: str
) -> None:
    node = await dial(await enroll(controller, "n1"))
    other = await enroll(controller, "n2")
    with trio.fail_after(TIMEOUT_S):
        await node.send(node.frames(node.heartbeat()))  # a good one first: the channel works

        async def ready() -> bool:
            return (await node_view(controller, "n1"))["state"] == "Ready"

        await wait_for(ready)
        before = await metric(controller, "nexa_node_messages_rejected_total", reason=reason)
        good_before = await metric(controller, "nexa_node_messages_total", kind="heartbeat")
        if case in {"forged", "tampered", "wrong_node", "skewed"}:
            await node.send(_craft(case)(node, other))
        elif case == "replayed":
            frames = node.frames(node.heartbeat())
            await node.send(frames)
            await node.send(frames)
        elif case == "out_of_order":
            await node.send(node.frames(node.heartbeat(seq=100)))
            await node.send(node.frames(node.heartbeat(seq=50)))
        elif case == "unknown_key":
            stranger = attrs.evolve(other, curve=links.generate_curve_keypair(), pump=None)
            await dial(stranger)
            await stranger.send(stranger.frames(stranger.heartbeat()))
        elif case == "revoked":
            async with controller.client() as http:
                assert (await http.post("/api/v1/nodes/n2/revoke")).json()["state"] == "Revoked"
            await dial(other)
            await other.send(other.frames(other.heartbeat()))
        elif case == "revoked_open_channel":
            async with controller.client() as http:
                await http.post("/api/v1/nodes/n1/revoke")
            await node.send(node.frames(node.heartbeat()))

        async def counted() -> bool:
            return await metric(controller, "nexa_node_messages_rejected_total", reason=reason) == before + 1

        await wait_for(counted)
        async with controller.client() as http:
            events = (await http.get("/api/v1/audit", params={"action": "node.message.rejected"})).json()["events"]
        assert any(e["detail"].startswith(reason) and e["result"] == "rejected" for e in events), events
    accepted = await metric(controller, "nexa_node_messages_total", kind="heartbeat")
    expected_good = {"replayed": 1, "out_of_order": 1}.get(case, 0)
    assert accepted == good_before + expected_good


async def test_silence_makes_a_node_unreachable_and_a_heartbeat_brings_it_back(
    nursery: trio.Nursery, tmp_path: Any, dial: Any
) -> None:
    from functools import partial

    from nexa.control.service import serve_control

    stopping = trio.Event()
    started = await nursery.start(partial(serve_control, local_config(tmp_path, lease_s=0.5), stopping=stopping))
    c = Controller(url=started.urls[0], admin_key=started.admin_key, state_dir=tmp_path / "state", stopping=stopping)
    node = await dial(await enroll(c, "n1"))

    async def state_is(expected: str) -> Any:
        async def check() -> bool:
            return (await node_view(c, "n1"))["state"] == expected

        return check

    await node.send(node.frames(node.heartbeat()))
    await wait_for(await state_is("Ready"))
    went_quiet = trio.current_time()
    await wait_for(await state_is("Unreachable"))
    assert trio.current_time() - went_quiet >= 0.4  # not before its lease ran out
    await node.send(node.frames(node.heartbeat()))
    await wait_for(await state_is("Ready"))
    async with c.client() as http:
        events = (await http.get("/api/v1/audit", params={"target": "node/n1"})).json()["events"]
    assert [e["action"] for e in events if e["action"].startswith("node.")] == [
        "node.enroll",
        "node.reachable",
        "node.unreachable",
        "node.reachable",
    ]
    stopping.set()


async def test_operators_cordon_drain_uncordon_and_revoke(controller: Controller, dial: Any) -> None:
    node = await dial(await enroll(controller, "n1", labels="rack=r1"))
    await node.send(node.frames(node.heartbeat()))

    async def ready() -> bool:
        return (await node_view(controller, "n1"))["state"] == "Ready"

    await wait_for(ready)
    async with controller.client() as http:
        operator_key = (await http.post("/api/v1/keys", json={"role": "operator"})).json()["key"]
    async with controller.client(operator_key) as http:
        assert (await http.post("/api/v1/nodes/n1/cordon")).json()["state"] == "Cordoned"
        assert (await http.post("/api/v1/nodes/n1/drain")).json()["state"] == "Draining"
        assert (await http.post("/api/v1/nodes/n1/uncordon")).json()["state"] == "Ready"
        assert (await http.post("/api/v1/nodes/n1/revoke")).status_code == 403  # admin only
        assert (await http.post("/api/v1/nodes/nope/cordon")).status_code == 404
        listed = (await http.get("/api/v1/nodes")).json()["nodes"]
    assert listed[0]["labels"]["rack"] == "r1"
    assert listed[0]["inventory"]["gpus"][0]["name"] == "NVIDIA GB10"
    async with controller.client() as http:
        assert (await http.post("/api/v1/nodes/n1/revoke")).json()["state"] == "Revoked"
        assert (await http.post("/api/v1/nodes/n1/cordon")).status_code == 409
        actions = [
            e["action"] for e in (await http.get("/api/v1/audit", params={"target": "node/n1"})).json()["events"]
        ]
    assert [a for a in actions if a in {"node.cordon", "node.drain", "node.uncordon", "node.revoke"}] == [
        "node.cordon",
        "node.drain",
        "node.uncordon",
        "node.revoke",
    ]
