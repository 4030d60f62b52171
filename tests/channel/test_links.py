"""nexa.channel.links over real ZeroMQ on 127.0.0.1.

Policy: loopback only; servers bind port 0 (`tcp://127.0.0.1:*`) and report the real endpoint
through `nursery.start`; every I/O test runs under an absolute `trio.fail_after`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import zmq
from zmq.utils import z85

from nexa import security
from nexa.channel import framing, links, zap
from nexa.channel.pump import receive_frames
from nexa.contracts import codec, wire
from nexa.errors import (
    BadSignature,
    ChannelClosed,
    ChannelError,
    ConfigError,
    ContractError,
    NotConnected,
    Unauthenticated,
    WrongNode,
)
from tests.conftest import gb10_inventory, sample_runtime
from tests.support.messaging import LOOPBACK, Fleet, NodeIdentity, hello

TIMEOUT_S = 10
#: The bound on the long round-trip test, which only has to tell a deadlock from slow progress.
DEADLOCK_S = 90


@pytest.fixture
def fleet() -> Fleet:
    return Fleet()


@contextlib.asynccontextmanager
async def raw_node(fleet: Fleet, node: NodeIdentity, link: links.Link) -> AsyncIterator[links.ZmqPump]:
    """A raw Curve DEALER with an enrolled node's keys, connected to `link` (run here), behind a pump:
    it sends whatever frames a test gives it, as no node agent would."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with ctx.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.CURVE_SERVERKEY, fleet.curve.public.encode())
            dealer.setsockopt(zmq.CURVE_PUBLICKEY, node.curve.public.encode())
            dealer.setsockopt(zmq.CURVE_SECRETKEY, node.curve.secret.encode())
            async with trio.open_nursery() as nursery:
                dealer.connect(await nursery.start(link.run))
                pump = links.ZmqPump(dealer)
                await nursery.start(pump.run)
                yield pump
                nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def uplinked(fleet: Fleet, node: NodeIdentity, link: links.Link, **uplink_kw: Any) -> AsyncIterator[links.Uplink]:
    """`link` run here and an enrolled node's uplink (`uplink_kw` for `Fleet.uplink`) running against it;
    both are cancelled when the block ends."""
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(link.run)
        uplink = fleet.uplink(endpoint, node, **uplink_kw)
        await nursery.start(uplink.run)
        yield uplink
        nursery.cancel_scope.cancel()


def heartbeat(node_id: str, seq: int) -> wire.Heartbeat:
    return wire.Heartbeat(
        node_id=node_id,
        seq=seq,
        ts=time.time(),
        inventory=gb10_inventory(),
        free_memory_bytes=64 << 30,
        free_accelerators=1,
        assignments=[wire.AssignmentStatus(assignment_id="a1", state=wire.RuntimeState.READY)],
    )


def assignment_set(node_id: str, generation: int) -> wire.AssignmentSet:
    return wire.AssignmentSet(
        node_id=node_id,
        epoch=1,
        generation=generation,
        lease_expires_at=time.time() + 30,
        assignments=[wire.Assignment(id="a1", deployment="d1", runtime=sample_runtime())],
    )


# --- round trips --------------------------------------------------------------------------------


async def test_messages_round_trip_in_both_directions(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(link.run)
            assert endpoint.startswith("tcp://127.0.0.1:")
            assert not endpoint.endswith(":*")
            uplink = fleet.uplink(endpoint, n1)
            await nursery.start(uplink.run)

            sent_hello, sent_beat = hello("n1"), heartbeat("n1", 1)
            await uplink.send(sent_hello)
            await uplink.send(sent_beat)
            assert await link.receive() == links.Inbound(node_id="n1", message=sent_hello)
            assert await link.receive() == links.Inbound(node_id="n1", message=sent_beat)

            down: list[wire.ControllerMessage] = [
                assignment_set("n1", 1),
                wire.Drain(node_id="n1", epoch=1, reason="maintenance"),
            ]
            for msg in down:
                await link.send("n1", msg)
            assert [await uplink.receive() for _ in down] == down

            ack = wire.Ack(node_id="n1", seq=2, ts=time.time(), epoch=1, generation=1, accepted=True)
            await uplink.send(ack)
            assert (await link.receive()).message == ack
            assert fleet.zap_calls == [n1.curve.public]
            assert link.statistics().received == 3
            assert uplink.statistics().sent == 3
            nursery.cancel_scope.cancel()


@pytest.mark.slow
def test_a_pump_receives_each_message_whole_and_alone() -> None:
    """`receive_frames` takes one message's frames (empty ones too), and only that message's."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.bind("inproc://pump-frames")
        dealer.setsockopt(zmq.IDENTITY, b"n1")
        dealer.connect("inproc://pump-frames")
        dealer.send_multipart([b"alive", b"", b"x" * 10_000, b""])
        dealer.send(b"one")
        while not router.poll(100):
            pass
        first = receive_frames(router)
        assert [f.bytes for f in first] == [b"n1", b"alive", b"", b"x" * 10_000, b""]
        assert [f.bytes for f in receive_frames(router)] == [b"n1", b"one"]
        with pytest.raises(zmq.Again):
            receive_frames(router)
        router.close(linger=0)
        dealer.close(linger=0)
    finally:
        ctx.term()


async def test_2000_round_trips_through_two_slot_channels_do_not_deadlock(fleet: Fleet) -> None:
    """The consumer answers every message with two while the producer keeps sending. A pump
    that blocked on delivery would stop sending and deadlock against it."""
    count = 2000
    n1 = fleet.enroll("n1")
    link = fleet.link(inbox_size=2, outbox_size=2)
    generations: list[int] = []
    # A deadlock never ends; 4,000 signed messages on a loaded 2-core machine take up to ~20 s.
    with trio.fail_after(DEADLOCK_S):
        async with uplinked(fleet, n1, link, inbox_size=2, outbox_size=2) as uplink:

            async def controller() -> None:
                window = security.ReplayWindow()
                for _ in range(count):
                    inbound = await link.receive()
                    assert isinstance(inbound.message, wire.Heartbeat)
                    window = window.check(inbound.message.seq, inbound.message.ts, time.time())
                    await link.send(inbound.node_id, assignment_set("n1", inbound.message.seq))
                    await link.send(inbound.node_id, wire.Drain(node_id="n1", epoch=inbound.message.seq))
                assert window.last_seq == count - 1

            async def node_sender() -> None:
                for seq in range(count):
                    await uplink.send(heartbeat("n1", seq))

            async def node_receiver() -> None:
                for _ in range(count):
                    msg = await uplink.receive()
                    assert isinstance(msg, wire.AssignmentSet)
                    generations.append(msg.generation)
                    assert await uplink.receive() == wire.Drain(node_id="n1", epoch=msg.generation)

            async with trio.open_nursery() as work:
                work.start_soon(controller)
                work.start_soon(node_sender)
                work.start_soon(node_receiver)
            stats = link.statistics()
    assert generations == list(range(count))
    assert (stats.received, stats.sent, stats.dropped) == (count, 2 * count, 0)


# --- the data path: unsigned [kind, request_id, head, body] frames ------------------------------


async def test_data_frames_travel_both_ways_beside_signed_messages(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with uplinked(fleet, n1, link) as uplink:
            with pytest.raises(NotConnected):  # a route comes only from a verified signed message
                await link.send_data("n1", wire.INFER, "r1", b"{}", b"")
            await uplink.send(hello("n1"))
            assert (await link.receive()).node_id == "n1"

            await link.send_data("n1", wire.INFER, "r1", b'{"h":1}', b'{"prompt":"hi"}')
            link.send_data_nowait("n1", wire.CREDIT, "r1", b'{"chunks":2}', b"")
            signed = assignment_set("n1", 1)
            await link.send("n1", signed)
            await link.send_data("n1", wire.CANCEL, "r1", b"{}", b"")
            assert await uplink.receive() == wire.DataFrame(
                kind=wire.INFER, request_id="r1", head=b'{"h":1}', body=b'{"prompt":"hi"}'
            )
            assert await uplink.receive() == wire.DataFrame(
                kind=wire.CREDIT, request_id="r1", head=b'{"chunks":2}', body=b""
            )
            assert await uplink.receive() == signed
            assert (await uplink.receive()).kind == wire.CANCEL  # type: ignore[union-attr]

            await uplink.send_data(wire.CHUNK, "r1", b"", b"data: x\n\n")
            await uplink.send(heartbeat("n1", 1))
            uplink.send_data_nowait(wire.END, "r1", b'{"status":"ok"}', b"")
            assert await link.receive() == links.DataInbound(
                node_id="n1", frame=wire.DataFrame(kind=wire.CHUNK, request_id="r1", head=b"", body=b"data: x\n\n")
            )
            assert isinstance((await link.receive()).message, wire.Heartbeat)  # type: ignore[union-attr]
            got = await link.receive()
            assert isinstance(got, links.DataInbound)
            assert (got.frame.kind, got.frame.head) == (wire.END, b'{"status":"ok"}')


async def test_take_data_hands_data_frames_over_in_the_pumps_task_in_order_and_leaves_the_rest_to_receive(
    fleet: Fleet,
) -> None:
    """`Link.take_data`: well-formed data frames (a node's joined ones too) reach the handler in
    order, with no `receive`; signed messages and refused data frames still come from `receive`,
    and a frame behind a message waiting in the inbox waits its turn there."""
    n1 = fleet.enroll("n1")
    link = fleet.link()
    taken: list[tuple[str, wire.DataFrame]] = []
    link.take_data(lambda node_id, frame: taken.append((node_id, frame)))

    async def until(check: Any) -> None:
        while not check():  # noqa: ASYNC110 - zmq's I/O thread sets no trio event
            await trio.sleep(0.005)

    with trio.fail_after(TIMEOUT_S):
        async with uplinked(fleet, n1, link) as uplink:
            for n in range(50):  # queued at once: the uplink joins them into few zmq messages
                uplink.send_data_nowait(wire.CHUNK, "r1", b"", b"%d" % n)
            uplink.send_data_nowait(wire.END, "r1", b'{"status":"ok"}', b"")
            await until(lambda: len(taken) == 51)
            assert [f.body for _, f in taken[:50]] == [b"%d" % n for n in range(50)]
            end = wire.DataFrame(kind=wire.END, request_id="r1", head=b'{"status":"ok"}', body=b"")
            assert taken[-1] == ("n1", end)

            received = link.statistics().received
            await uplink.send(hello("n1"))
            await until(lambda: link.statistics().received == received + 1)  # in the inbox, not read
            uplink.send_data_nowait(wire.CHUNK, "r2", b"", b"behind the hello")
            await until(lambda: link.statistics().received == received + 2)
            assert isinstance(await link.receive_any(), links.Inbound)
            behind = wire.DataFrame(kind=wire.CHUNK, request_id="r2", head=b"", body=b"behind the hello")
            assert await link.receive_any() == links.DataInbound(node_id="n1", frame=behind)
            assert len(taken) == 51
        async with raw_node(fleet, n1, link) as pump:
            await pump.send([b"infer", b"r3", b"{}", b""])  # a controller's kind: refused by `receive`
            got = await link.receive_any()
            assert isinstance(got, links.Refused) and isinstance(got.error, ContractError)
            assert len(taken) == 51


async def test_take_alive_hands_liveness_beats_over_in_the_pumps_task_and_leaves_refusals_to_receive(
    fleet: Fleet,
) -> None:
    """`Link.take_alive`: a well-formed beat of an enrolled node's own id reaches the handler, with
    no `receive`; one naming another node is still refused by `receive` (WrongNode), and a handler
    that raises ends neither the pump nor the channel."""
    n1 = fleet.enroll("n1")
    fleet.enroll("n2")
    link = fleet.link()
    taken: list[links.Alive] = []

    def handler(got: links.Alive) -> None:
        taken.append(got)
        if got.state_seq == 13:
            raise RuntimeError("a bug in the handler")

    link.take_alive(handler)

    async def until(check: Any) -> None:
        while not check():  # noqa: ASYNC110 - zmq's I/O thread sets no trio event
            await trio.sleep(0.005)

    with trio.fail_after(TIMEOUT_S):
        async with uplinked(fleet, n1, link) as uplink:
            await uplink.send_liveness("n1", 7)
            await uplink.send_liveness("n1", 13)
            await until(lambda: len(taken) == 2)
            assert [(a.node_id, a.state_seq) for a in taken] == [("n1", 7), ("n1", 13)]
            await uplink.send(hello("n1"))
            assert isinstance(await link.receive_any(), links.Inbound)  # the channel still works
        async with raw_node(fleet, n1, link) as pump:
            await pump.send(framing.encode_liveness("n2", 1))  # another node's id on n1's channel
            got = await link.receive_any()
            assert isinstance(got, links.Refused) and isinstance(got.error, WrongNode)
            assert len(taken) == 2


async def test_a_beat_overtakes_another_nodes_waiting_message_but_never_its_own_nodes(fleet: Fleet) -> None:
    """While a message waits in the inbox, a beat of another node is still taken in the pump's task
    (a fleet's beats come in bursts, and each one sent through the inbox cost a task switch and a
    pass of the receive loop: `perf/southbound_fanin.py`); a beat of the waiting message's own node
    waits behind it, so each node's messages are handled in the order it sent them."""
    n1, n2 = fleet.enroll("n1"), fleet.enroll("n2")
    link = fleet.link()
    taken: list[links.Alive] = []
    link.take_alive(taken.append)

    async def until(check: Any) -> None:
        while not check():  # noqa: ASYNC110 - zmq's I/O thread sets no trio event
            await trio.sleep(0.005)

    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(link.run)
            uplink1, uplink2 = fleet.uplink(endpoint, n1), fleet.uplink(endpoint, n2)
            await nursery.start(uplink1.run)
            await nursery.start(uplink2.run)
            received = link.statistics().received
            await uplink1.send(hello("n1"))
            await until(lambda: link.statistics().received == received + 1)  # in the inbox, not read
            await uplink2.send_liveness("n2", 5)
            await until(lambda: len(taken) == 1)  # past n1's hello
            await uplink1.send_liveness("n1", 6)
            await until(lambda: link.statistics().received == received + 3)
            assert [(a.node_id, a.state_seq) for a in taken] == [("n2", 5)]  # n1's waits behind its hello
            first = await link.receive_any()
            assert isinstance(first, links.Inbound) and first.node_id == "n1"
            second = await link.receive_any()
            assert isinstance(second, links.Alive) and (second.node_id, second.state_seq) == ("n1", 6)
            await uplink1.send_liveness("n1", 7)  # nothing of n1's waits now: taken again
            await until(lambda: len(taken) == 2)
            assert (taken[-1].node_id, taken[-1].state_seq) == ("n1", 7)
            nursery.cancel_scope.cancel()


async def test_a_take_data_handler_that_raises_ends_neither_the_pump_nor_the_channel(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    calls: list[bytes] = []

    def handler(node_id: str, frame: wire.DataFrame) -> None:
        calls.append(frame.body)
        if frame.body == b"boom":
            raise RuntimeError("a bug in the handler")

    link.take_data(handler)
    with trio.fail_after(TIMEOUT_S):
        async with uplinked(fleet, n1, link) as uplink:
            await uplink.send_data(wire.CHUNK, "r1", b"", b"boom")
            await uplink.send(hello("n1"))
            assert isinstance(await link.receive_any(), links.Inbound)  # the channel still works
            assert calls == [b"boom"]
            await link.send_data("n1", wire.CREDIT, "r1", b'{"chunks":1}', b"")
            assert (await uplink.receive()) == wire.DataFrame(
                kind=wire.CREDIT, request_id="r1", head=b'{"chunks":1}', body=b""
            )


async def test_data_frames_of_the_wrong_direction_or_shape_are_refused(fleet: Fleet) -> None:
    """A raw Curve client with an enrolled key sends what a node agent never would."""
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with raw_node(fleet, n1, link) as pump:
            bad = {
                "controller kind": [b"infer", b"r1", b"{}", b""],
                "three frames": [b"chunk", b"r1", b""],
                "empty id": [b"chunk", b"", b"", b"x"],
                "id not UTF-8": [b"chunk", b"\xff", b"", b"x"],
                "id too long": [b"chunk", b"r" * 129, b"", b"x"],
            }
            for frames in bad.values():
                await pump.send(frames)
                got = await link.receive_any()
                assert isinstance(got, links.Refused)
                assert got.node_id == "n1"
                assert isinstance(got.error, ContractError)
            await pump.send([b"chunk", b"r1", b"", b"x"])
            got = await link.receive_any()
            assert isinstance(got, links.DataInbound)
            assert not link.connected("n1")  # data frames never give a route

            del fleet.node_keys["n1"]  # revoked: its channel's data is refused too
            await pump.send([b"chunk", b"r1", b"", b"x"])
            got = await link.receive_any()
            assert isinstance(got, links.Refused)
            assert isinstance(got.error, Unauthenticated)


async def test_a_node_refuses_data_kinds_only_nodes_send(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with uplinked(fleet, n1, link) as uplink:
            await uplink.send(hello("n1"))
            await link.receive()
            await link.send_data("n1", wire.CHUNK, "r1", b"", b"x")
            with pytest.raises(ContractError, match="unexpected data kind"):
                await uplink.receive()
            await link.send_data("n1", wire.CANCEL, "r1", b"{}", b"")
            assert (await uplink.receive()).kind == wire.CANCEL  # type: ignore[union-attr]


def test_data_frames_are_encoded_only_for_data_kinds_and_sane_ids() -> None:
    assert framing.encode_data(wire.CHUNK, "r-1", b"", b"x") == [b"chunk", b"r-1", b"", b"x"]
    with pytest.raises(ContractError):
        framing.encode_data("hello", "r1", b"", b"")
    with pytest.raises(ContractError):
        framing.encode_data(wire.CHUNK, "", b"", b"")
    with pytest.raises(ContractError):
        framing.encode_data(wire.CHUNK, "r" * 129, b"", b"")


# --- who may talk -------------------------------------------------------------------------------


async def test_zap_refuses_an_unknown_curve_key(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    rogue = fleet.stranger("rogue")
    fleet.node_keys["rogue"] = rogue.key.public  # even a known signing key does not help
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(link.run)
            rogue_uplink = fleet.uplink(endpoint, rogue)
            await nursery.start(rogue_uplink.run)
            await rogue_uplink.send(hello("rogue"))
            await fleet.zap_event(rogue.curve.public).wait()  # the handshake reached ZAP...

            uplink = fleet.uplink(endpoint, n1)
            await nursery.start(uplink.run)
            await uplink.send(hello("n1"))
            assert (await link.receive()).node_id == "n1"  # ...the legitimate node gets through

            with trio.move_on_after(0.5) as quiet:
                got = await link.receive()
                pytest.fail(f"a refused peer's message arrived: {got!r}")
            assert quiet.cancelled_caught
            assert rogue_uplink.statistics().sent == 0  # it never had a channel to send on
            assert rogue_uplink.statistics().outbox_depth == 1
            assert link.statistics().received == 1
            nursery.cancel_scope.cancel()


async def test_a_failing_key_check_refuses_the_peer_and_zap_keeps_serving(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    broken = fleet.stranger("broken")
    asked = trio.Event()

    def authorize(curve_public: str) -> str | None:
        if curve_public == broken.curve.public:
            asked.set()
            raise RuntimeError("registry unavailable")
        return fleet.authorize(curve_public)

    link = links.Link(
        LOOPBACK, curve=fleet.curve, signing_key=fleet.key, authorize=authorize, node_key=fleet.node_keys.get
    )
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(link.run)
            refused = fleet.uplink(endpoint, broken)
            await nursery.start(refused.run)
            await refused.send(hello("broken"))
            await asked.wait()
            uplink = fleet.uplink(endpoint, n1)
            await nursery.start(uplink.run)
            await uplink.send(hello("n1"))
            assert (await link.receive()).node_id == "n1"
            assert refused.statistics().sent == 0
            nursery.cancel_scope.cancel()


def _zap_request(mechanism: bytes = b"CURVE", domain: bytes = zap.ZAP_DOMAIN, key: bytes = b"k" * 32) -> list[bytes]:
    return [b"1.0", b"7", domain, b"127.0.0.1", b"", mechanism, key]


@pytest.mark.parametrize(
    ("request_frames", "status", "user_id"),
    [
        (_zap_request(), b"200", b"n1"),
        (_zap_request(key=b"x" * 32), b"400", b""),  # not enrolled
        (_zap_request(mechanism=b"PLAIN"), b"400", b""),
        (_zap_request(domain=b"other"), b"400", b""),
        (_zap_request(key=b"short"), b"400", b""),
        ([b"2.0", b"7", zap.ZAP_DOMAIN, b"", b"", b"CURVE", b"k" * 32], b"400", b""),
    ],
)
def test_zap_replies_follow_rfc_27(request_frames: list[bytes], status: bytes, user_id: bytes) -> None:

    enrolled = {z85.encode(b"k" * 32).decode(): "n1"}
    reply = zap.zap_reply(request_frames, lambda key, _domain: enrolled.get(key))
    assert len(reply) == 6
    assert (reply[0], reply[1], reply[2], reply[4], reply[5]) == (b"1.0", b"7", status, user_id, b"")


async def test_forged_signature_is_rejected_and_the_link_carries_on(fleet: Fleet) -> None:
    n1, n2 = fleet.enroll("n1"), fleet.enroll("n2")
    impostor = attrs.evolve(n1, key=security.generate_signing_key())  # right Curve key, wrong signing key
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(link.run)
            bad = fleet.uplink(endpoint, impostor)
            await nursery.start(bad.run)
            await bad.send(hello("n1"))
            with pytest.raises(BadSignature) as info:
                await link.receive()
            assert info.value.kind == "hello"
            with pytest.raises(NotConnected):  # no verified message, so no route
                await link.send("n1", assignment_set("n1", 1))

            good = fleet.uplink(endpoint, n2)
            await nursery.start(good.run)
            await good.send(hello("n2"))
            assert (await link.receive()).node_id == "n2"
            nursery.cancel_scope.cancel()


async def test_tampered_body_is_rejected_before_parsing(fleet: Fleet) -> None:
    """A raw Curve client with an enrolled key sends frames whose body was changed after signing."""
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with raw_node(fleet, n1, link) as pump:
            kind, body, sig = framing.encode_frames(hello("n1", seq=1), n1.key)
            await pump.send([kind, body.replace(b'"seq":1', b'"seq":9'), sig])
            with pytest.raises(BadSignature):
                await link.receive()
            await pump.send([kind, b"{not json", sig])  # would be a ContractError if parsed first
            with pytest.raises(BadSignature):
                await link.receive()
            await pump.send([kind, body])  # signature stripped
            with pytest.raises(ContractError, match="3 frames"):
                await link.receive()
            await pump.send([kind, body, sig])  # the untouched frames still go through
            expected = framing.decode_frames([kind, body, sig], n1.key.public, wire.FROM_NODE)
            assert (await link.receive()).message == expected


async def test_a_node_cannot_speak_for_another(fleet: Fleet) -> None:
    n1, n2 = fleet.enroll("n1"), fleet.enroll("n2")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(link.run)
            uplink = fleet.uplink(endpoint, n1)
            await nursery.start(uplink.run)
            await uplink.send(hello("n2"))  # signed by n1, naming n2
            with pytest.raises(WrongNode) as info:
                await link.receive()
            assert (info.value.channel_node, info.value.claimed_node) == ("n1", "n2")

            n1_with_n2s_key = fleet.uplink(endpoint, attrs.evolve(n1, key=n2.key))
            await nursery.start(n1_with_n2s_key.run)
            await n1_with_n2s_key.send(hello("n2"))  # even n2's own signature: the channel is n1's
            with pytest.raises(BadSignature):
                await link.receive()
            nursery.cancel_scope.cancel()


async def test_a_revoked_node_is_refused_on_an_open_channel(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with uplinked(fleet, n1, link) as uplink:
            await uplink.send(hello("n1"))
            await link.receive()
            del fleet.node_keys["n1"]
            await uplink.send(heartbeat("n1", 1))
            with pytest.raises(Unauthenticated, match="not enrolled"):
                await link.receive()
            with pytest.raises(NotConnected):  # and its route is forgotten
                await link.send("n1", assignment_set("n1", 1))


async def test_node_rejects_a_message_not_signed_by_its_pinned_controller(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with uplinked(fleet, n1, link, controller_key=security.generate_signing_key().public) as uplink:
            await uplink.send(hello("n1"))
            await link.receive()
            await link.send("n1", assignment_set("n1", 1))
            with pytest.raises(BadSignature) as info:
                await uplink.receive()
            assert info.value.kind == "assignments"


# --- connection loss ----------------------------------------------------------------------------


async def test_uplink_reconnects_when_the_router_comes_back_on_the_same_port(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            first = fleet.link()
            async with trio.open_nursery() as first_scope:
                endpoint = await first_scope.start(first.run)
                uplink = fleet.uplink(endpoint, n1)
                await nursery.start(uplink.run)
                await uplink.send(hello("n1"))
                assert (await first.receive()).node_id == "n1"
                first_scope.cancel_scope.cancel()  # the controller goes away; its socket is closed
            with pytest.raises(ChannelClosed):
                await first.receive()

            second = fleet.link(endpoint)
            assert await nursery.start(second.run) == endpoint

            async def keep_beating() -> None:  # what the agent does: the next heartbeat gets through
                for seq in range(1, 1000):
                    await uplink.send(heartbeat("n1", seq))
                    await trio.sleep(0.05)

            nursery.start_soon(keep_beating)
            inbound = await second.receive()
            assert inbound.node_id == "n1"
            assert isinstance(inbound.message, wire.Heartbeat)
            await second.send("n1", assignment_set("n1", 2))
            got = await uplink.receive()
            assert isinstance(got, wire.AssignmentSet)
            assert got.generation == 2
            nursery.cancel_scope.cancel()


def _free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def test_uplink_holds_messages_until_connected_and_pushes_back_when_full(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    endpoint = _free_tcp_endpoint()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            uplink = fleet.uplink(endpoint, n1, outbox_size=3)
            await nursery.start(uplink.run)
            for seq in range(3):
                uplink.send_nowait(heartbeat("n1", seq))
            with pytest.raises(trio.WouldBlock):
                uplink.send_nowait(heartbeat("n1", 3))
            await trio.sleep(0.2)
            assert uplink.statistics().sent == 0

            link = fleet.link(endpoint)
            await nursery.start(link.run)
            seqs = []
            for _ in range(3):
                msg = (await link.receive()).message
                assert isinstance(msg, wire.Heartbeat)
                seqs.append(msg.seq)
            assert seqs == [0, 1, 2]
            nursery.cancel_scope.cancel()


async def test_messages_for_a_vanished_node_are_dropped_and_counted(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(link.run)
            async with trio.open_nursery() as node:
                uplink = fleet.uplink(endpoint, n1)
                await node.start(uplink.run)
                await uplink.send(hello("n1"))
                await link.receive()
                node.cancel_scope.cancel()
            while link.statistics().dropped == 0:  # until the ROUTER has seen the disconnect
                await link.send("n1", assignment_set("n1", 1))
                await trio.sleep(0.01)
            assert link.statistics().dropped >= 1
            nursery.cancel_scope.cancel()


async def test_link_calls_fail_clearly_when_not_running(fleet: Fleet) -> None:
    link = fleet.link()
    with pytest.raises(ChannelClosed):
        await link.receive()
    with pytest.raises(ChannelClosed):
        await link.send("n1", assignment_set("n1", 1))
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            with pytest.raises(NotConnected) as info:
                await link.send("n1", assignment_set("n1", 1))
            nursery.cancel_scope.cancel()
    assert info.value.node_id == "n1"
    assert info.value.retryable


async def test_binding_a_taken_port_is_a_channel_error(fleet: Fleet) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(fleet.link().run)
            with pytest.raises(ChannelError, match="cannot bind"):
                await nursery.start(fleet.link(endpoint).run)
            nursery.cancel_scope.cancel()


# --- framing and keys (no sockets) --------------------------------------------------------------


def test_frames_are_kind_body_signature_and_decode_only_in_their_direction(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    msg = heartbeat("n1", 5)
    frames = framing.encode_frames(msg, n1.key)
    assert frames[0] == b"heartbeat"
    assert frames[1].startswith(b'{"assignments":[')  # canonical JSON: sorted keys, no spaces
    assert frames[1] == codec.canonical_json(json.loads(frames[1])).encode()  # canonical form
    security.verify(n1.key.public, frames[2], frames[0], frames[1])
    assert framing.decode_frames(frames, n1.key.public, wire.FROM_NODE) == msg
    with pytest.raises(ContractError, match="unexpected message kind"):
        framing.decode_frames(frames, n1.key.public, wire.FROM_CONTROLLER)


def test_signed_but_invalid_body_is_a_contract_error(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    body = b'{"node_id":"n1","seq":"one","ts":1.0,"agent_version":"x","extra":1}'
    frames = [b"hello", body, security.sign(n1.key, b"hello", body)]
    with pytest.raises(ContractError) as info:
        framing.decode_frames(frames, n1.key.public, wire.FROM_NODE)
    assert "seq: expected an integer, got str" in info.value.problems
    assert "extra: unknown key" in info.value.problems


def test_curve_keypair_files(tmp_path: Path) -> None:
    pair = links.generate_curve_keypair()
    assert pair.secret not in repr(pair)
    links.save_curve_keypair(pair, tmp_path, name="node")
    assert stat.S_IMODE((tmp_path / "node.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "node.pub").stat().st_mode) == 0o644
    assert links.load_curve_keypair(tmp_path, name="node") == pair
    assert links.load_curve_public(tmp_path / "node.pub") == pair.public

    (tmp_path / "node.key").chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        links.load_curve_keypair(tmp_path, name="node")
    security.write_key_file(tmp_path / "bad.key", b"not a key\n", private=True)
    with pytest.raises(ConfigError, match="Z85"):
        links.load_curve_keypair(tmp_path, name="bad")


@pytest.mark.parametrize(
    "text",
    ["", " " * 40, "#" * 40, "é" * 40, "short", links.generate_curve_keypair().public + "A"],
    # Named, not by value: a fresh key each run, and pytest-xdist's workers must collect the same ids.
    ids=["empty", "spaces", "not-z85", "not-ascii", "short", "a-key-and-one-more"],
)
def test_malformed_curve_keys_are_rejected(text: str) -> None:
    with pytest.raises(ContractError):
        links.check_curve_key(text)


async def test_one_link_serves_a_second_curve_key_on_a_second_endpoint_and_retires_the_first(fleet: Fleet) -> None:
    """A controller key rotation's Curve switch: the same ROUTER (routes, ZAP) binds a second
    endpoint with the new key; each endpoint admits only the key it was bound with; a node that
    moves is `Inbound.moved`; once the first is retired, whoever dials it is refused and reported."""
    n1 = fleet.enroll("n1")
    new = links.generate_curve_keypair()
    reported: list[str] = []
    link = fleet.link(retired_dial=reported.append)
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            first = await nursery.start(link.run)
            second = link.bind(LOOPBACK, new)
            old_uplink = fleet.uplink(first, n1)
            await nursery.start(old_uplink.run)
            await old_uplink.send(hello("n1", seq=1))
            assert not (await link.receive()).moved  # type: ignore[union-attr]
            # The new key on the first endpoint (or the old on the second) gets no channel.
            wrong = fleet.uplink(first, n1, server_curve_public=new.public)
            await nursery.start(wrong.run)
            wrong.send_nowait(hello("n1", seq=2))
            new_uplink = fleet.uplink(second, n1, server_curve_public=new.public)
            await nursery.start(new_uplink.run)
            await new_uplink.send(hello("n1", seq=3))
            got = await link.receive()
            assert isinstance(got, links.Inbound) and got.message.seq == 3 and got.moved
            await link.send("n1", wire.Drain(node_id="n1", epoch=1))  # the route is the new connection
            assert isinstance(await new_uplink.receive(), wire.Drain)
            assert wrong.statistics().sent == 0

            await link.rebind(first, fleet.curve, admit=False)
            again = fleet.uplink(first, n1)
            await nursery.start(again.run)
            again.send_nowait(hello("n1", seq=4))
            while n1.curve.public not in reported:  # noqa: ASYNC110 - ZAP reports through a plain callback
                await trio.sleep(0.01)
            assert again.statistics().sent == 0
            nursery.cancel_scope.cancel()


async def test_a_nodes_data_frames_queued_together_travel_as_one_message_in_order(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    with trio.fail_after(TIMEOUT_S):
        async with uplinked(fleet, n1, link) as uplink:
            # Queued with no wait between: the pump joins the data frames, never the signed message.
            for i in range(10):
                uplink.send_data_nowait(wire.CHUNK, f"r{i}", b"", b"data: %d\n\n" % i)
            uplink.send_nowait(heartbeat("n1", 1))
            for i in range(10, 15):
                uplink.send_data_nowait(wire.CHUNK, f"r{i}", b"", b"data: %d\n\n" % i)
            got = [await link.receive() for _ in range(16)]
            frames = [g.frame for g in got if isinstance(g, links.DataInbound)]
            assert [f.request_id for f in frames] == [f"r{i}" for i in range(15)]
            assert [f.body for f in frames] == [b"data: %d\n\n" % i for i in range(15)]
            assert isinstance(got[10], links.Inbound) and isinstance(got[10].message, wire.Heartbeat)
            assert link.statistics().received == 3  # ten frames, the heartbeat, five frames


async def test_a_joined_data_message_is_refused_whole_when_one_of_its_frames_is_bad(fleet: Fleet) -> None:
    n1 = fleet.enroll("n1")
    link = fleet.link()
    good = [b"chunk", b"r1", b"", b"x"]
    with trio.fail_after(TIMEOUT_S):
        async with raw_node(fleet, n1, link) as pump:
            bad = {
                "a controller kind among them": [*good, b"infer", b"r2", b"{}", b""],
                "a frame short": [*good, b"chunk", b"r2", b""],
                "an empty id among them": [*good, b"chunk", b"", b"", b"x"],
                "too many": good * (framing.MAX_DATA_BATCH + 1),
            }
            for frames in bad.values():
                await pump.send(frames)
                got = await link.receive_any()
                assert isinstance(got, links.Refused)
                assert isinstance(got.error, ContractError)
            await pump.send([*good, b"end", b"r1", b'{"status":"ok"}', b""])
            first, second = await link.receive_any(), await link.receive_any()
            assert isinstance(first, links.DataInbound) and isinstance(second, links.DataInbound)
            assert (first.frame.kind, second.frame.kind) == (wire.CHUNK, wire.END)
            # Nothing of the refused messages was filed: the next message is the next frame.
            await pump.send(good)
            assert isinstance(await link.receive_any(), links.DataInbound)
