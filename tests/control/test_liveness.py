"""Liveness split from state, at the controller, over real CurveZMQ (`RawNode`s on loopback).

A node's liveness beat (`[alive, node_id, state_seq]`) is authenticated by its channel alone and
changes nothing the node reports; its signed state (a `Heartbeat`) comes when it changes and at
least every state interval the node announces. Real time with a short lease (1 s) where the
test needs none longer: the controller runs libzmq, whose I/O trio's autojump clock cannot see.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from nexa.contracts import wire
from tests.conftest import Controller, local_config, start_controller
from tests.support.api import TIMEOUT_S, metric, node_view, wait_for
from tests.support.rawnode import RawNode, enroll

LEASE_S = 1.0


async def _controller(nursery: trio.Nursery, tmp_path: Path, **nodes: float) -> Controller:
    return await start_controller(nursery, local_config(tmp_path, **nodes))


def _state_is(c: Controller, node_id: str, expected: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await node_view(c, node_id))["state"] == expected

    return check


async def _ready_node(
    nursery: trio.Nursery, tmp_path: Path, dial: Any, *, state_interval_s: float = 30.0, **nodes: float
) -> tuple[Controller, RawNode]:
    """A controller (`nodes`: its [nodes] settings) and node n1 on it, enrolled, dialled and Ready on its
    first state, which announces `state_interval_s`."""
    c = await _controller(nursery, tmp_path, **nodes)
    node = await dial(await enroll(c, "n1"))
    await node.send(node.frames(node.heartbeat(state_interval_s=state_interval_s)))
    await wait_for(_state_is(c, "n1", "Ready"))
    return c, node


async def _beat(node: RawNode, every_s: float, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
    """Liveness beats until cancelled (what an agent sends between its states)."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            await node.send(node.liveness())
            await trio.sleep(every_s)


async def _asked(node: RawNode) -> wire.StateRequest:
    """The next StateRequest the node gets (sets pushed meanwhile are skipped)."""
    while True:
        msg = await node.receive()
        if isinstance(msg, wire.StateRequest):
            return msg


async def _audit_actions(c: Controller, node_id: str) -> list[str]:
    async with c.client() as http:
        events = (await http.get("/api/v1/audit", params={"target": f"node/{node_id}"})).json()["events"]
    return [e["action"] for e in events if e["action"].startswith("node.")]


async def test_liveness_keeps_a_node_ready_without_state_for_less_than_its_interval(
    nursery: trio.Nursery, tmp_path: Path, dial: Any
) -> None:
    c, node = await _ready_node(nursery, tmp_path, dial, lease_s=LEASE_S)
    heartbeats = await metric(c, "nexa_node_messages_total", kind="heartbeat")
    beating = await nursery.start(_beat, node, LEASE_S / 5)
    await trio.sleep(LEASE_S * 3)  # three leases on liveness alone, far within its state interval
    view = await node_view(c, "n1")
    assert view["state"] == "Ready"
    assert await metric(c, "nexa_node_messages_total", kind="alive") >= 10
    assert await metric(c, "nexa_node_messages_total", kind="heartbeat") == heartbeats  # no state since
    assert await _audit_actions(c, "n1") == ["node.enroll", "node.reachable"]  # never Unreachable between
    beating.cancel()
    stopped = trio.current_time()
    await wait_for(_state_is(c, "n1", "Unreachable"))
    # Marked down one lease after its last beat (the lease the 3 s detection target is made of).
    assert LEASE_S * 0.8 <= trio.current_time() - stopped < LEASE_S + 1.0
    assert (await _audit_actions(c, "n1"))[-1] == "node.unreachable"


async def test_a_node_that_stops_its_liveness_is_down_within_3_s(
    nursery: trio.Nursery, tmp_path: Path, dial: Any
) -> None:
    c, node = await _ready_node(nursery, tmp_path, dial)  # the default lease: 3 s
    beating = await nursery.start(_beat, node, 1.0)  # the agent's default heartbeat_interval_s
    await trio.sleep(1.5)
    beating.cancel()
    last_beat = trio.current_time() - 0.5
    await wait_for(_state_is(c, "n1", "Unreachable"))
    assert trio.current_time() - last_beat <= 3.0 + 0.3  # the lease, and this test's polling


async def test_liveness_never_changes_state_nor_makes_a_node_with_stale_state_reachable(
    nursery: trio.Nursery, tmp_path: Path, dial: Any
) -> None:
    """A node that keeps beating but sends no state past its interval is Unreachable, as a node
    without heartbeats always was; beats alone never bring it back; the controller asks for the
    state, and that state does."""
    c, node = await _ready_node(nursery, tmp_path, dial, state_interval_s=1.0, lease_s=LEASE_S)
    before = await node_view(c, "n1")
    beating = await nursery.start(_beat, node, LEASE_S / 5)
    with trio.fail_after(TIMEOUT_S):
        await wait_for(_state_is(c, "n1", "Unreachable"))  # 1 s of interval + the lease
        asked = await _asked(node)  # the beats of a node whose state is not current ask for it
    assert asked == wire.StateRequest(node_id="n1")
    await trio.sleep(LEASE_S * 3)
    after = await node_view(c, "n1")
    assert after["state"] == "Unreachable"  # beats on, but no state: it stays down
    assert after["inventory"] == before["inventory"]
    assert await _audit_actions(c, "n1") == ["node.enroll", "node.reachable", "node.unreachable"]
    async with c.client() as http:
        events = (await http.get("/api/v1/audit", params={"action": "node.unreachable"})).json()["events"]
    assert "no state" in events[0]["detail"]
    await node.send(node.frames(node.heartbeat(state_interval_s=30.0)))  # the answer
    await wait_for(_state_is(c, "n1", "Ready"))
    beating.cancel()


async def test_a_beat_naming_a_state_that_never_came_gets_it_asked_for_and_changes_nothing(
    nursery: trio.Nursery, tmp_path: Path, dial: Any
) -> None:
    c, node = await _ready_node(nursery, tmp_path, dial, lease_s=LEASE_S)
    before = await node_view(c, "n1")
    await node.send(node.liveness(state_seq=node.seq + 5))  # a state the controller never got
    with trio.fail_after(TIMEOUT_S):
        assert await _asked(node) == wire.StateRequest(node_id="n1")
    after = await node_view(c, "n1")
    assert (after["state"], after["inventory"]) == ("Ready", before["inventory"])


async def test_a_beat_before_any_state_makes_nothing_reachable_and_asks_for_the_state(
    nursery: trio.Nursery, tmp_path: Path, dial: Any
) -> None:
    """What a controller that has just started sees from a node that was running: liveness first."""
    c = await _controller(nursery, tmp_path, lease_s=LEASE_S)
    node = await dial(await enroll(c, "n1"))
    await node.send(node.liveness())
    with trio.fail_after(TIMEOUT_S):
        assert await _asked(node) == wire.StateRequest(node_id="n1")
    assert (await node_view(c, "n1"))["state"] == "Unreachable"
    await node.send(node.frames(node.heartbeat(state_interval_s=30.0)))
    await wait_for(_state_is(c, "n1", "Ready"))


async def test_a_liveness_beat_forged_or_replayed_by_another_node_is_refused(
    nursery: trio.Nursery, tmp_path: Path, dial: Any
) -> None:
    """Node m sends n's beats (its own frames naming n, and n's very bytes): refused as `wrong_node`,
    counted, and they keep n alive no longer than its own beats did."""
    c = await _controller(nursery, tmp_path, lease_s=LEASE_S)
    n = await dial(await enroll(c, "n1"))
    m = await dial(await enroll(c, "m1"))
    await n.send(n.frames(n.heartbeat(state_interval_s=30.0)))
    await m.send(m.frames(m.heartbeat(state_interval_s=30.0)))
    await wait_for(_state_is(c, "n1", "Ready"))
    await wait_for(_state_is(c, "m1", "Ready"))
    refused = await metric(c, "nexa_node_messages_rejected_total", reason="wrong_node")
    captured = n.liveness()  # n's beat, byte for byte
    n_quiet = trio.current_time()
    with trio.fail_after(TIMEOUT_S):
        while trio.current_time() - n_quiet < LEASE_S * 3:
            await m.send(m.liveness(node_id="n1"))
            await m.send(captured)
            await trio.sleep(LEASE_S / 5)
    assert await metric(c, "nexa_node_messages_rejected_total", reason="wrong_node") >= refused + 10
    assert (await node_view(c, "n1"))["state"] == "Unreachable"
    assert (await node_view(c, "n1"))["channel"].get("wrong_node") is None  # counted on m's channel
    assert (await node_view(c, "m1"))["channel"]["wrong_node"] >= 10
