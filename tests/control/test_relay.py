"""The controller's relay with the node relay over a real Link/Uplink pair and a real HTTP runtime.

Cancellation reaching the runtime, per-stream flow control, nodes lost mid-stream, and what a
misbehaving or foreign node can (not) do to a stream. Harness: tests/node/test_relay.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio

from nexa import security
from nexa.channel import links
from nexa.channel.links import Uplink
from nexa.config import Bytes, ChannelConfig, NodesConfig, RelayConfig, Seconds
from nexa.contracts import codec, wire
from nexa.contracts.api import EnrollmentTokenCreate, EnrollRequest
from nexa.contracts.domain import SYSTEM
from nexa.control import store as st
from nexa.control.datapath import relay as control_relay
from nexa.control.fleet.nodes import Fleet
from nexa.control.fleet.southbound import Southbound
from nexa.errors import Conflict, NotConnected
from nexa.telemetry import Metrics
from tests.support.messaging import hello
from tests.support.relay import TIMEOUT_S, data_path, drain, infer_head, request, wait_until

# --- cancellation -------------------------------------------------------------------------------


async def test_leaving_a_stream_early_cancels_it_at_the_runtime() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            async with p.relay.open("n1", "r1", infer_head(stream=True), request("endless")) as s:
                assert await s.receive()
                assert await s.receive()
            await p.runtime.gone("r1").wait()  # the node closed its HTTP request to the runtime
            await wait_until(lambda: p.node.statistics().cancelled == 1)
            assert p.node.statistics().inflight == 0
            assert p.relay.statistics().cancels_sent == 1
            assert p.relay.statistics().open_streams == 0


async def test_a_cancelled_consumer_cancels_its_request_without_waiting() -> None:
    """The gateway's task is cancelled (its client disconnected) while it waits for output."""
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            with trio.move_on_after(0.2) as client:
                async with p.relay.open("n1", "r1", infer_head(), request("hang")) as s:
                    await s.receive()
            assert client.cancelled_caught
            await p.runtime.gone("r1").wait()
            await wait_until(lambda: p.node.statistics().cancelled == 1)


# --- flow control -------------------------------------------------------------------------------


async def test_a_stalled_reader_holds_back_only_its_own_stream() -> None:
    window = 4
    # 64-byte chunks: about one event each, so the window, not coalescing, decides.
    cfg = RelayConfig(max_chunk_bytes=Bytes(64))
    with trio.fail_after(TIMEOUT_S):
        async with (
            data_path(window=window, relay_cfg=cfg) as p,
            p.relay.open("n1", "stalled", infer_head(stream=True), request("stream", events=200)) as stalled,
            p.relay.open("n1", "reader", infer_head(stream=True), request("stream", events=200)) as reader,
        ):
            body, end = await drain(reader)
            assert end.status is wire.EndStatus.OK
            assert body.count(b'"content":"tok') == 200
            # The stalled stream is parked at its window, on both sides of the channel.
            await wait_until(lambda: p.node.statistics().waiting_for_credit == 1)
            stats = p.node.statistics()
            assert stats.unacknowledged == {"stalled": window}
            assert stalled.buffered == window
            assert not stalled.ended
            # Once read, it completes too.
            body, end = await drain(stalled)
            assert end.status is wire.EndStatus.OK
            assert body.count(b'"content":"tok') == 200


async def test_a_node_that_ignores_the_window_loses_that_stream_only() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path(window=2, node_answers=False) as p:
            async with (
                p.relay.open("n1", "greedy", infer_head(), b"{}") as greedy,
                p.relay.open("n1", "polite", infer_head(), b"{}") as polite,
            ):
                for _ in range(3):  # nobody reads, so the third is beyond the window
                    await p.uplink.send_data(wire.CHUNK, "greedy", b"", b"x")
                await wait_until(lambda: p.relay.statistics().protocol_errors == 1)
                assert greedy.ended
                assert not polite.ended
                await p.uplink.send_data(wire.CHUNK, "polite", b"", b"ok")
                await p.uplink.send_data(wire.END, "polite", _end(wire.EndStatus.OK), b"")
                _, greedy_end = await drain(greedy)
                body, polite_end = await drain(polite)
            assert (greedy_end.status, greedy_end.code) == (wire.EndStatus.ERROR, control_relay.PROTOCOL_ERROR)
            assert (body, polite_end.status) == (b"ok", wire.EndStatus.OK)
            assert p.relay.statistics().protocol_errors == 1
            kinds = [(f.kind, f.request_id) for f in p.node_frames]
            assert (wire.CANCEL, "greedy") in kinds  # the node is told to stop it


# --- nodes lost, frames lost --------------------------------------------------------------------


async def test_a_node_killed_mid_stream_ends_its_streams_with_node_lost() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            async with (
                p.relay.open("n1", "r1", infer_head(stream=True), request("endless")) as started,
                p.relay.open("n1", "r2", infer_head(), request("hang")) as waiting,
            ):
                assert await started.receive()
                p.node_scope.cancel()  # the node dies
                p.relay.node_lost("n1")  # what the southbound does when it becomes Unreachable
                _, end = await drain(started)
                assert (end.status, end.code, end.first_byte_sent) == (wire.EndStatus.ERROR, "node_lost", True)
                _, end = await drain(waiting)
                assert (end.code, end.first_byte_sent) == ("node_lost", False)
            stats = p.relay.statistics()
            assert (stats.lost, stats.open_streams, stats.cancels_sent) == (2, 0, 0)


async def test_a_node_that_never_answers_is_ended_by_the_controller_after_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The infer (or the end) was dropped on the way: the stream must not hang forever."""
    monkeypatch.setattr(control_relay, "DEADLINE_GRACE_S", 0.1)
    with trio.fail_after(TIMEOUT_S):
        async with data_path(node_answers=False) as p:
            async with p.relay.open("n1", "r1", infer_head(deadline_s=0.2), b"{}") as s:
                _, end = await drain(s)
            assert (end.status, end.code) == (wire.EndStatus.ERROR, "deadline_exceeded")
            assert p.relay.statistics().expired == 1
            await wait_until(lambda: len(p.node_frames) >= 2)
            assert [f.kind for f in p.node_frames] == [wire.INFER, wire.CANCEL]


async def test_the_relays_expiry_task_ends_a_silent_stream_and_once_it_stops_a_wait_times_out_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the southbound runs it: one task ends the streams past their deadline; once it stops, a
    waiting consumer falls back on its own timeout."""
    monkeypatch.setattr(control_relay, "DEADLINE_GRACE_S", 0.1)
    with trio.fail_after(TIMEOUT_S):
        async with data_path(node_answers=False) as p, trio.open_nursery() as nursery:
            expiry = trio.CancelScope()

            async def expire() -> None:
                with expiry:
                    await p.relay.expire()

            nursery.start_soon(expire)
            await wait_until(lambda: p.relay._expiring)
            async with p.relay.open("n1", "r1", infer_head(deadline_s=0.2), b"{}") as s:
                _, end = await drain(s)
            assert (end.status, end.code) == (wire.EndStatus.ERROR, "deadline_exceeded")
            assert p.relay.statistics().expired == 1

            ends: list[wire.EndHead] = []

            async def consume() -> None:
                async with p.relay.open("n1", "r2", infer_head(deadline_s=0.3), b"{}") as s:
                    ends.append((await drain(s))[1])

            nursery.start_soon(consume)
            await trio.sleep(0.05)
            expiry.cancel()  # the task stops while the consumer waits: its own timeout ends it
            await wait_until(lambda: ends)
            assert ends[0].code == "deadline_exceeded" and not p.relay._expiring
            assert p.relay.statistics().expired == 2


async def test_frames_from_another_node_or_for_unknown_requests_are_dropped() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path(node_answers=False) as p, trio.open_nursery() as nursery:
            n2 = p.fleet.enroll("n2")
            intruder = p.fleet.uplink(p.endpoint, n2)
            await nursery.start(intruder.run)
            await intruder.send(hello("n2"))
            async with p.relay.open("n1", "r1", infer_head(), b"{}") as s:
                await intruder.send_data(wire.CHUNK, "r1", b"", b"injected")
                await intruder.send_data(wire.END, "r1", _end(wire.EndStatus.OK), b"")
                await p.uplink.send_data(wire.CHUNK, "nobody", b"", b"x")
                await wait_until(lambda: p.relay.statistics().dropped_frames == 3)
                await p.uplink.send_data(wire.CHUNK, "r1", b"", b"real")
                await p.uplink.send_data(wire.END, "r1", _end(wire.EndStatus.OK), b"")
                body, end = await drain(s)
            assert (body, end.status) == (b"real", wire.EndStatus.OK)
            nursery.cancel_scope.cancel()


async def test_opening_to_a_node_without_a_route_is_not_connected_and_ids_are_unique() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            with pytest.raises(NotConnected) as info:
                async with p.relay.open("n9", "r1", infer_head(), b"{}"):
                    pytest.fail("opened a stream to a node with no channel")
            assert info.value.retryable
            assert p.relay.statistics().open_streams == 0
            async with p.relay.open("n1", "r1", infer_head(), request("hang")):
                with pytest.raises(Conflict):
                    async with p.relay.open("n1", "r1", infer_head(), b"{}"):
                        pass


def _end(status: wire.EndStatus) -> bytes:
    return codec.dumps(codec.wire, wire.EndHead(status=status)).encode()


# --- the southbound wiring: data frames to the relay, lost nodes end their streams ---------------


@contextlib.asynccontextmanager
async def southbound_with_node(tmp_path: Path) -> AsyncIterator[tuple[Southbound, Fleet, Uplink, str]]:
    """A real Southbound over a real store and fleet, and one enrolled node's Uplink (no agent)."""
    metrics = Metrics()
    nodes = NodesConfig(lease_s=Seconds(0.5))
    async with st.open_store(tmp_path) as store:
        fleet_ = Fleet(nodes, store, metrics)
        await fleet_.load()
        key, curve = security.generate_signing_key(), links.generate_curve_keypair()
        controller_key, controller_curve = security.generate_signing_key(), links.generate_curve_keypair()
        secret, _ = await fleet_.create_token(SYSTEM, EnrollmentTokenCreate(ttl_s=60))
        node = await fleet_.enroll(
            EnrollRequest(token=secret, hostname="n1", signing_public_key=key.public.b64, curve_public_key=curve.public)
        )
        southbound = Southbound(
            ChannelConfig(listen="tcp://127.0.0.1:*"),
            nodes,
            fleet_,
            metrics,
            curve=controller_curve,
            signing_key=controller_key,
            epoch=lambda: store.epoch,
            stream_window_chunks=4,
        )
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(southbound.run)
            uplink = Uplink(
                endpoint,
                curve=curve,
                server_curve_public=controller_curve.public,
                signing_key=key,
                controller_key=controller_key.public,
            )
            await nursery.start(uplink.run)
            await uplink.send(wire.Hello(node_id=node.id, seq=1, ts=time.time(), agent_version="test"))
            await wait_until(lambda: fleet_.get(node.id).reachable)
            yield southbound, fleet_, uplink, node.id
            nursery.cancel_scope.cancel()


async def test_the_southbound_relays_data_and_a_silent_node_loses_its_streams(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with southbound_with_node(tmp_path) as (southbound, _, uplink, node_id):
            relay = southbound.relay
            async with relay.open(node_id, "r1", infer_head(), b"{}") as s:
                while not isinstance(msg := await uplink.receive(), wire.DataFrame):
                    assert isinstance(msg, wire.AssignmentSet)  # its answer to the hello
                assert (msg.kind, msg.request_id) == (wire.INFER, "r1")
                await uplink.send_data(wire.CHUNK, "r1", b"", b"partial")
                assert await s.receive() == b"partial"
                # No heartbeat follows: after lease_s the node is Unreachable and the stream ends.
                assert await s.receive() is None
                assert s.end is not None
                assert (s.end.status, s.end.code, s.end.first_byte_sent) == (wire.EndStatus.ERROR, "node_lost", True)
            assert relay.statistics().lost == 1


async def test_revoking_a_node_ends_its_streams(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with (
            southbound_with_node(tmp_path) as (southbound, fleet_, _, node_id),
            southbound.relay.open(node_id, "r1", infer_head(), b"{}") as s,
        ):
            await fleet_.act(SYSTEM, node_id, "revoke")
            assert await s.receive() is None
            assert s.end is not None
            assert (s.end.code, s.end.first_byte_sent) == ("node_lost", False)


async def test_a_restarted_agent_saying_hello_again_ends_the_streams_of_its_old_process(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with (
            southbound_with_node(tmp_path) as (southbound, _, uplink, node_id),
            southbound.relay.open(node_id, "r1", infer_head(), b"{}") as s,
        ):
            await uplink.send(wire.Hello(node_id=node_id, seq=2, ts=time.time(), agent_version="test"))
            assert await s.receive() is None
            assert s.end is not None
            assert s.end.code == "node_lost"


# --- what a node's frames may cost the controller (issue 12: bytes, sizes, numbers) --------------


async def test_a_chunk_above_the_limit_ends_only_its_stream_and_buffered_bytes_are_accounted() -> None:
    limit = 10
    with trio.fail_after(TIMEOUT_S):
        async with data_path(window=4, node_answers=False, chunk_limit=limit) as p:
            async with (
                p.relay.open("n1", "big", infer_head(), b"{}") as big,
                p.relay.open("n1", "fine", infer_head(), b"{}") as fine,
            ):
                for _ in range(4):  # the window, each chunk at the limit: the most one stream may hold
                    await p.uplink.send_data(wire.CHUNK, "fine", b"", b"x" * limit)
                await p.uplink.send_data(wire.CHUNK, "big", b"", b"x" * (limit + 1))
                await wait_until(lambda: p.relay.statistics().protocol_errors == 1)
                assert big.ended and not fine.ended
                assert fine.buffered == 4
                assert p.relay.statistics().buffered_bytes == 4 * limit  # bounded: window x chunk limit
                assert await fine.receive() == b"x" * limit
                assert p.relay.statistics().buffered_bytes == 3 * limit
                _, end = await drain(big)
            assert (end.status, end.code) == (wire.EndStatus.ERROR, control_relay.PROTOCOL_ERROR)
            # The consumer left with three chunks unread: nothing stays accounted.
            assert p.relay.statistics().buffered_bytes == 0
            await wait_until(lambda: (wire.CANCEL, "big") in [(f.kind, f.request_id) for f in p.node_frames])


@pytest.mark.parametrize(
    "head",
    [
        b'{"status":"ok","prompt_tokens":9223372036854775807}',
        b'{"status":"ok","completion_tokens":-1}',
        b'{"status":"ok","prompt_tokens":2147483649}',
        b'{"status":"ok","runtime_ms":1e999}',
        b'{"status":"ok","runtime_ms":NaN}',
        b'{"status":"ok","http_status":' + b"9" * 5000 + b"}",
        b"[" * 10_000,
    ],
    ids=["int64", "negative", "above-2^31", "inf", "nan", "5000-digits", "deep"],
)
def test_an_end_with_numbers_out_of_range_is_a_protocol_error_and_counted(head: bytes) -> None:
    relay = control_relay.Relay(_NoLink(), window=4)
    stream = control_relay.RelayStream(relay, "n1", "r1", window=4, deadline=float("inf"), max_bytes=100)
    relay._streams["r1"] = stream
    relay._by_node["n1"].add("r1")
    frame = wire.DataFrame(kind=wire.END, request_id="r1", head=head, body=b"")
    assert relay.deliver("n1", frame) == control_relay.MALFORMED
    assert stream._final is not None
    assert (stream._final.status, stream._final.code) == (wire.EndStatus.ERROR, control_relay.PROTOCOL_ERROR)
    assert relay.statistics().protocol_errors == 1


async def test_frames_of_no_stream_or_another_nodes_stream_are_refused_with_a_reason() -> None:
    relay = control_relay.Relay(_NoLink(), window=4, max_chunk_bytes=8)
    stream = control_relay.RelayStream(relay, "n1", "r1", window=4, deadline=float("inf"), max_bytes=32)
    relay._streams["r1"] = stream
    relay._by_node["n1"].add("r1")
    chunk = wire.DataFrame(kind=wire.CHUNK, request_id="r1", head=b"", body=b"ok")
    assert relay.deliver("n2", chunk) == control_relay.UNKNOWN_STREAM  # another node's stream
    assert relay.deliver("n1", attrs.evolve(chunk, request_id="nope")) == control_relay.UNKNOWN_STREAM
    assert relay.deliver("n2", attrs.evolve(chunk, body=b"x" * 9)) == control_relay.OVERSIZED_CHUNK
    assert stream.buffered == 0 and not stream.ended  # none of them touched it
    assert relay.deliver("n1", chunk) is None
    assert stream.buffered == 1


class _NoLink:
    async def send_data(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        raise NotConnected(node_id=node_id)

    def send_data_nowait(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        raise NotConnected(node_id=node_id)
