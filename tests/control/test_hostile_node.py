"""A hostile node, for real: an enrolled node drives its CurveZMQ channel by hand (issue 12 §15).

The controller runs in this trio run with a real, well-behaved `nexa node` process (a `sim`
runtime behind it, `tests/support/cluster.py`). The hostile node is enrolled through the API like
any other, then speaks raw zmq with its own Curve and Ed25519 keys, so everything it sends passes
CurveZMQ and ZAP and most of it is validly signed: deep JSON, huge integers, NaN, unknown kinds,
oversized frames, frames for streams it does not own, stale and replayed messages, a flood at
10x its rate limit and inventories that change with every beat. After each class the controller
still answers `/healthz` and serves inference through the good node, and the refusal is counted
in `/metrics`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import zmq

from nexa import security
from nexa.channel import links
from nexa.contracts import codec, wire
from tests.realparts import BuiltImages, S3Store
from tests.support.api import metric, node_view, wait_for
from tests.support.cluster import SimCluster, sim_cluster
from tests.support.models import registry_config
from tests.support.rawnode import RawNode, enroll

pytestmark = pytest.mark.slow

#: The hostile node's (and every node's) signed-message budget in this test.
RATE = 10.0
BURST = 10
#: Store writes one node may cause: a burst of 3, then one every 2 s.
WRITES_BURST = 3
REJECTED = "nexa_node_messages_rejected_total"


def _signed(node: RawNode, kind: bytes, body: bytes) -> list[bytes]:
    return [kind, body, security.sign(node.key, kind, body)]


def _heartbeat_json(node: RawNode) -> str:
    return codec.dumps(codec.wire, node.heartbeat())


def _deep(node: RawNode) -> list[list[bytes]]:
    nested = b"[" * 64 + b"]" * 64  # deeper than the wire decoder's 32
    recursive = b"[" * 100_000  # deeper than Python's recursion limit (and within the frame limit)
    return [_signed(node, b"heartbeat", nested), _signed(node, b"heartbeat", recursive)]


def _huge_integer(node: RawNode) -> list[list[bytes]]:
    body = re.sub(r'"seq":\d+', '"seq":' + "9" * 5000, _heartbeat_json(node))
    beyond_int64 = re.sub(r'"free_memory_bytes":\d+', '"free_memory_bytes":' + str(2**64), _heartbeat_json(node))
    return [_signed(node, b"heartbeat", body.encode()), _signed(node, b"heartbeat", beyond_int64.encode())]


def _nan(node: RawNode) -> list[list[bytes]]:
    nan = re.sub(r'"utilization_pct":[^,}]+', '"utilization_pct":NaN', _heartbeat_json(node))
    inf = re.sub(r'"temperature_c":[^,}]+', '"temperature_c":1e999', _heartbeat_json(node))
    hot = re.sub(r'"temperature_c":[^,}]+', '"temperature_c":100000', _heartbeat_json(node))
    return [_signed(node, b"heartbeat", text.encode()) for text in (nan, inf, hot)]


def _oversized_fabric(node: RawNode) -> list[list[bytes]]:
    """Validly signed heartbeats whose inventory's fabric is beyond the contract's bounds: 65 RDMA
    devices, a device named with a terminal escape, an interface with an address that is not one."""
    port = {"number": 1, "state": "ACTIVE", "rate": "200 Gb/sec (4X HDR)", "link_layer": "Ethernet"}
    device = {"name": "rocep1s0f0", "ports": [port], "netdevs": ["enp1s0f0np0"]}
    fabrics = [
        {"devices": [device] * 65},
        {"devices": [{**device, "name": "roce\x1b]0;owned\x07"}]},
        {"interfaces": [{"name": "enp1s0f0np0", "addresses": ["192.168.100.10/24", "x" * 60000]}]},
    ]
    frames = []
    for fabric in fabrics:
        beat = json.loads(_heartbeat_json(node))
        beat["inventory"]["fabric"] = fabric
        frames.append(_signed(node, b"heartbeat", json.dumps(beat).encode()))
    return frames


def _unknown_kind(node: RawNode) -> list[list[bytes]]:
    body = _heartbeat_json(node).encode()
    return [_signed(node, b"launch", body), [b"heartbeat", body], [b"\xff\xfe", body, b"sig"]]


def _oversized_chunk(node: RawNode) -> list[list[bytes]]:
    return [[b"chunk", b"r-none", b"", b"x" * (65536 + 1)]]


def _stale_ack(node: RawNode) -> list[list[bytes]]:
    node.seq += 1
    ack = wire.Ack(node_id=node.node_id, seq=node.seq, ts=time.time(), epoch=10**6, generation=1, accepted=True)
    return [node.frames(ack)]


def _skewed(node: RawNode) -> list[list[bytes]]:
    return [node.frames(node.heartbeat(ts=time.time() - 3600))]


def _replayed(node: RawNode) -> list[list[bytes]]:
    frames = node.frames(node.heartbeat())
    return [frames, frames]


#: (case, reason counted, frames to send, refusals expected)
CASES: list[tuple[str, str, Callable[[RawNode], list[list[bytes]]], int]] = [
    ("deep json", "malformed", _deep, 2),
    ("huge integers", "malformed", _huge_integer, 2),
    ("nan and out-of-range figures", "malformed", _nan, 3),
    ("unknown kinds and shapes", "malformed", _unknown_kind, 3),
    ("oversized fabric", "malformed", _oversized_fabric, 3),
    ("oversized chunk", "oversized_chunk", _oversized_chunk, 1),
    ("ack for a set never sent", "stale_ack", _stale_ack, 1),
    ("stale", "clock_skew", _skewed, 1),
    ("replayed", "replayed", _replayed, 1),
]


async def _connect(nursery: trio.Nursery, ctx: zmq.Context[zmq.Socket[bytes]], node: RawNode) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, node.enrolled.controller_curve_public_key.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, node.curve.public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, node.curve.secret.encode())
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.connect(node.enrolled.channel_endpoint)
    node.pump = links.ZmqPump(sock, outbox_size=1024)
    await nursery.start(node.pump.run)


async def _serving(cluster: SimCluster) -> None:
    """The controller answers /healthz and a chat completion through the good node."""
    async with cluster.client(cluster.inference_key) as http:
        assert (await http.get("/healthz")).status_code == 200
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "still there?"}]},
        )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"]


async def _counted(cluster: SimCluster, reason: str, at_least: float) -> float:
    async def check() -> bool:
        return await metric(cluster.controller, REJECTED, reason=reason) >= at_least

    await wait_for(check)
    return await metric(cluster.controller, REJECTED, reason=reason)


async def test_a_hostile_node_cannot_stop_the_controller_nor_cost_the_good_node(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    channel = attrs.evolve(
        cfg.channel,
        signed_messages_per_s=RATE,
        signed_messages_burst=BURST,
        node_store_writes_per_s=0.5,
        node_store_writes_burst=WRITES_BURST,
    )
    cfg = attrs.evolve(cfg, channel=channel)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1) as cluster:
            await cluster.deploy("chat-a", replicas=1)
            await _serving(cluster)
            evil = await enroll(cluster.controller, "evil")
            async with trio.open_nursery() as mine:
                await _connect(mine, ctx, evil)
                await _hostile_session(cluster, evil)
                mine.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


async def _hostile_session(cluster: SimCluster, evil: RawNode) -> None:
    c = cluster.controller
    await evil.send(evil.frames(evil.heartbeat()))  # a good beat first: the channel works

    async def evil_ready() -> bool:
        return (await node_view(c, "evil"))["state"] == "Ready"

    await wait_for(evil_ready)

    for case, reason, craft, refusals in CASES:
        before = await metric(c, REJECTED, reason=reason)
        for frames in craft(evil):
            await evil.send(frames)
        after = await _counted(cluster, reason, before + refusals)
        assert after == before + refusals, case
        await _serving(cluster)
        await trio.sleep(refusals / RATE)  # leave the budget as it was for the next case

    await _frames_for_the_good_nodes_stream(cluster, evil)
    await _flood(cluster, evil)
    await _inventory_churn(cluster, evil)
    await _beyond_the_frame_limit(cluster, evil)
    # Nothing the hostile node sent reached the store as NaN or ended a loop: a restart-free check
    # that the controller's own state still reads back.
    async with c.client() as http:
        assert (await http.get("/api/v1/nodes/evil")).status_code == 200
        assert (await http.post("/api/v1/audit/verify")).status_code == 200


async def _frames_for_the_good_nodes_stream(cluster: SimCluster, evil: RawNode) -> None:
    """While a stream runs on the good node, the hostile node sends chunks and an end for it."""
    c = cluster.controller
    before = await metric(c, REJECTED, reason="unknown_stream")
    request_id = "victim-" + str(time.time_ns())
    result: dict[str, Any] = {}

    async def victim() -> None:
        headers = {"X-Request-Id": request_id}
        body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hello"}]}
        async with (
            cluster.client(cluster.inference_key) as http,
            http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            result["status"] = resp.status_code
            result["body"] = b"".join([part async for part in resp.aiter_bytes()])

    async with trio.open_nursery() as n:
        n.start_soon(victim)
        end = codec.dumps(codec.wire, wire.EndHead(status=wire.EndStatus.ERROR, code="hijacked")).encode()
        for _ in range(5):
            assert evil.pump is not None
            await evil.pump.send([b"chunk", request_id.encode(), b"", b"data: forged\n\n"])
            await evil.pump.send([b"end", request_id.encode(), end, b""])
    assert result["status"] == 200
    assert b"forged" not in result["body"] and b"[DONE]" in result["body"]
    await _counted(cluster, "unknown_stream", before + 10)
    await _serving(cluster)


async def _flood(cluster: SimCluster, evil: RawNode) -> None:
    """Valid, signed heartbeats at 10x the node's rate: the excess is dropped unverified and counted."""
    c = cluster.controller
    sent = int(RATE * 10 * 2)  # two seconds at ten times the rate
    limited_before = await metric(c, REJECTED, reason="rate_limited")
    malformed_before = await metric(c, REJECTED, reason="malformed")
    started = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(_serving, cluster)  # the good node serves during the flood
        for _ in range(sent):
            await evil.send(evil.frames(evil.heartbeat()))
            await trio.sleep(1 / (RATE * 10))
    await trio.sleep(BURST / RATE)  # the budget refills
    # A sentinel behind the flood on the same channel: once it is counted, the flood is.
    await evil.send(_signed(evil, b"heartbeat", b"[]"))
    await _counted(cluster, "malformed", malformed_before + 1)
    elapsed = trio.current_time() - started
    limited = await metric(c, REJECTED, reason="rate_limited") - limited_before
    # A token bucket admits at most its burst plus its rate over the time it was asked.
    assert sent - (BURST + RATE * elapsed + 1) <= limited <= sent
    assert (await node_view(c, "evil"))["state"] == "Ready"  # its admitted beats still count
    await _serving(cluster)


async def _inventory_churn(cluster: SimCluster, evil: RawNode) -> None:
    """Every beat with another inventory: the store writes are limited, memory has the newest."""
    c = cluster.controller
    beats = 10
    before = await metric(c, "nexa_node_store_writes_deferred_total", kind="inventory")
    started = trio.current_time()
    for i in range(beats):
        evil.seq += 1
        inventory = attrs.evolve(evil.heartbeat().inventory, cpu_count=100 + i)
        beat = attrs.evolve(evil.heartbeat(seq=evil.seq), inventory=inventory)
        await evil.send(evil.frames(beat))
        await trio.sleep(1.5 / RATE)  # within the message rate: only the write rate applies

    async def newest_in_memory() -> bool:
        return (await node_view(c, "evil"))["inventory"]["cpu_count"] == 100 + beats - 1

    await wait_for(newest_in_memory)
    elapsed = trio.current_time() - started
    deferred = await metric(c, "nexa_node_store_writes_deferred_total", kind="inventory") - before
    assert deferred >= beats - (WRITES_BURST + 0.5 * elapsed + 1)
    await _serving(cluster)


async def _channel_counts(cluster: SimCluster, node: str) -> dict[str, int]:
    return dict((await node_view(cluster.controller, node))["channel"])


async def _beyond_the_frame_limit(cluster: SimCluster, evil: RawNode) -> None:
    """A message over the channel's limit is refused and counted by node, its connection kept; one over
    the transport's own bound (libzmq's MAXMSGSIZE) costs the node its connection, counted by node too."""
    c = cluster.controller
    limit = 65536 + links.MESSAGE_HEADROOM_BYTES
    oversized_before = await metric(c, REJECTED, reason="oversized_chunk")
    too_large_before = await metric(c, REJECTED, reason="message_too_large")
    disconnects_before = await metric(c, "nexa_channel_disconnects_total")
    counts_before = await _channel_counts(cluster, "evil")
    # Over the limit: a data frame one byte too long, and a signed frame nested 100,000 levels deep.
    await evil.send([b"chunk", b"r-none", b"", b"x" * (limit + 1)])
    await evil.send(_signed(evil, b"heartbeat", b"[" * 100_000 + b"]" * 100_000))
    await _counted(cluster, "message_too_large", too_large_before + 2)
    assert await metric(c, REJECTED, reason="oversized_chunk") == oversized_before  # never read as a chunk
    counts = await _channel_counts(cluster, "evil")
    assert counts.get("message_too_large", 0) == counts_before.get("message_too_large", 0) + 2
    assert counts.get("disconnected", 0) == counts_before.get("disconnected", 0)  # the connection stayed
    await _serving(cluster)
    # Over the transport's bound: libzmq drops the connection before nexa sees a byte; counted as
    # the node's disconnect, and the DEALER re-dials on its own.
    await evil.send([b"chunk", b"r-none", b"", b"x" * (links.TRANSPORT_LIMIT_FACTOR * limit + 1)])

    async def dropped() -> bool:
        return (await _channel_counts(cluster, "evil")).get("disconnected", 0) > counts.get("disconnected", 0)

    await wait_for(dropped)
    assert await metric(c, "nexa_channel_disconnects_total") >= disconnects_before + 1
    await _serving(cluster)
    malformed_before = await metric(c, REJECTED, reason="malformed")
    await trio.sleep(0.5)  # the DEALER reconnects on its own
    await evil.send(_signed(evil, b"heartbeat", json.dumps({"not": "a heartbeat"}).encode()))
    await _counted(cluster, "malformed", malformed_before + 1)  # the re-dialled channel works
    assert await metric(c, REJECTED, reason="message_too_large") == too_large_before + 2
