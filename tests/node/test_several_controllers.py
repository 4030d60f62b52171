"""A node with a channel to each of several controllers (issue 20, point 3; `NodeConfig.controllers`).

Several `nexa control` on one store share the controller's keys and the nodes' enrolment. Here two
`FakeController`s share them (the same Curve key, signing key and enrolment table: what a shared
store and shared key files give), each with its own Link on loopback, real CurveZMQ. Proved:
heartbeats reach both; a set of a lower epoch than the one accepted is refused on either channel;
inference asked on channel B is answered on B, never on A, while A is killed and restarted; a
controller key rotation moves each channel where its own controller says, and a restart dials
there. The routing itself (which channel answers what, nothing waits on a full channel) is also
checked against fake uplinks in virtual time. Every wait is bounded by `trio.fail_after`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import attrs
import pytest
import trio
import trio.testing

from nexa import security
from nexa.channel import links
from nexa.channel.endpoints import Dial, Routed
from nexa.channel.links import Unverified, generate_curve_keypair
from nexa.channel.pump import PumpStatistics
from nexa.config import NodeConfig, RelayConfig, Seconds, SupervisorConfig, structure_config
from nexa.contracts import codec, wire
from nexa.errors import ChannelClosed, ConfigError
from nexa.node import identity
from nexa.node.agent import serve_node
from nexa.node.relay import NodeRelay
from nexa.node.uplinks import ControllerChannels
from nexa.security import generate_signing_key
from tests.conftest import free_port, gb10_inventory
from tests.support.nodes import FakeController, RunningNode, aset, node_config, sim_runtime, start_node
from tests.support.relay import infer_head

TIMEOUT_S = 60
M = TypeVar("M", bound=wire.NodeMessage)
Reason = wire.RejectReason


def twin(nursery: trio.Nursery, ctl: FakeController, **over: object) -> FakeController:
    """Another controller on the same store: the same keys and enrolled nodes, its own endpoint."""
    shared: dict[str, object] = {"curve": ctl.curve, "key": ctl.key, "by_curve": ctl.by_curve}
    return FakeController(nursery, node_keys=ctl.node_keys, **{**shared, **over})  # type: ignore[arg-type]


@attrs.define(eq=False)
class Tap:
    """Everything one controller's link receives from n1, in order: signed messages and data frames."""

    ctl: FakeController
    signed: list[wire.NodeMessage] = attrs.Factory(list)
    data: list[wire.DataFrame] = attrs.Factory(list)
    changed: trio.Event = attrs.Factory(trio.Event)

    async def run(self) -> None:
        """Read until the controller stops (start it again after each `ctl.start()`)."""
        link = self.ctl.link
        assert link is not None
        with contextlib.suppress(ChannelClosed):
            while True:
                got = await link.receive_any()
                if isinstance(got, links.DataInbound):
                    self.data.append(got.frame)
                elif isinstance(got, links.Inbound):
                    self.signed.append(got.message)
                self.changed.set()
                self.changed = trio.Event()

    def of(self, cls: type[M]) -> list[M]:
        return [m for m in self.signed if isinstance(m, cls)]

    async def wait(self, done: Callable[[Tap], bool]) -> None:
        while not done(self):
            await self.changed.wait()

    async def next_ack(self, generation: int) -> wire.Ack:
        await self.wait(lambda t: any(m.generation == generation for m in t.of(wire.Ack)))
        return next(m for m in self.of(wire.Ack) if m.generation == generation)

    async def beats(self, more: int) -> None:
        """Wait for `more` heartbeats after those seen so far."""
        seen = len(self.of(wire.Heartbeat))
        await self.wait(lambda t: len(t.of(wire.Heartbeat)) >= seen + more)


async def _until(check: Callable[[], bool]) -> None:
    while not check():  # noqa: ASYNC110 - the agent's statistics signal nothing
        await trio.sleep(0.02)


@pytest.fixture
async def pair(nursery: trio.Nursery, state_dir: Path) -> tuple[FakeController, FakeController]:
    a = FakeController(nursery)
    with trio.fail_after(TIMEOUT_S):
        await a.start()
        a.enroll(state_dir)
        b = twin(nursery, a)
        await b.start()
    return a, b


async def _tapped(nursery: trio.Nursery, *controllers: FakeController) -> list[Tap]:
    taps = [Tap(ctl) for ctl in controllers]
    for tap in taps:
        nursery.start_soon(tap.run)
    return taps


def _connected(node: RunningNode) -> list[bool]:
    return [c.connected for c in node.agent.statistics().controllers]


# --- over real channels -------------------------------------------------------------------------


async def test_heartbeats_reach_every_controller_and_a_lower_epoch_is_refused_on_either_channel(
    nursery: trio.Nursery, pair: tuple[FakeController, FakeController], cfg: NodeConfig, state_dir: Path
) -> None:
    a, b = pair
    cfg = attrs.evolve(cfg, controllers=(a.endpoint, b.endpoint))
    tap_a, tap_b = await _tapped(nursery, a, b)
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await tap_a.beats(3)
        await tap_b.beats(3)
        assert len(tap_a.of(wire.Hello)) == len(tap_b.of(wire.Hello)) == 1
        # Each beat goes to both: the same sequence numbers arrive.
        seqs = {m.seq for m in tap_a.of(wire.Heartbeat)} & {m.seq for m in tap_b.of(wire.Heartbeat)}
        assert len(seqs) >= 2
        await _until(lambda: _connected(node) == [True, True])
        assert [c.configured for c in node.agent.statistics().controllers] == [a.endpoint, b.endpoint]

        # A (the leader, epoch 2) sends a set: accepted, and answered on A only.
        await a.push(aset(2, 1))
        assert (await tap_a.next_ack(1)).accepted
        await tap_b.beats(3)
        assert tap_b.of(wire.Ack) == []

        # B sends a set of epoch 1 (a deposed leader's): refused on B; so is A's own older epoch.
        await b.push(aset(1, 5))
        refused = await tap_b.next_ack(5)
        assert (refused.accepted, refused.reason) == (False, Reason.STALE_EPOCH)
        await a.push(aset(1, 6))
        assert (await tap_a.next_ack(6)).reason is Reason.STALE_EPOCH

        # B becomes the leader (epoch 3): accepted from B; now A's epoch 2 is the stale one.
        await b.push(aset(3, 1))
        assert (await tap_b.next_ack(1)).accepted
        await a.push(aset(2, 2))
        late = await tap_a.next_ack(2)
        assert (late.accepted, late.reason) == (False, Reason.STALE_EPOCH)
        stats = node.agent.statistics()
        assert (stats.epoch, stats.generation) == (3, 1)
        assert stats.rejected[Reason.STALE_EPOCH] == 3
        assert (identity.load_fence(state_dir).epoch, identity.load_fence(state_dir).generation) == (3, 1)
        await node.stop()


@pytest.mark.slow
async def test_inference_asked_on_one_channel_is_answered_on_it_while_the_other_controller_restarts(
    nursery: trio.Nursery,
    pair: tuple[FakeController, FakeController],
    tmp_path: Path,
    state_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NEXA_SIMULATION_ONLY", "1")
    a, b = pair
    cfg = node_config(
        tmp_path,
        state_dir,
        {"runtimes": ["sim"]},
        simulation=True,
        supervisor=SupervisorConfig(restart_backoff_initial_s=Seconds(0.1), reconcile_interval_s=Seconds(0.2)),
        controllers=(a.endpoint, b.endpoint),
    )
    tap_a, tap_b = await _tapped(nursery, a, b)
    port = free_port()
    # 10 tokens a second: the stream lasts through A's restart.
    assignment = wire.Assignment(id="a1", deployment="chat-small", runtime=sim_runtime(port, "--tokens-per-s", "10"))
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await tap_a.beats(1)
        await a.push(
            wire.AssignmentSet(
                node_id="n1", epoch=1, generation=1, lease_expires_at=time.time() + 120, assignments=[assignment]
            )
        )
        assert (await tap_a.next_ack(1)).accepted

        def ready(tap: Tap) -> bool:
            beats = tap.of(wire.Heartbeat)
            return bool(beats) and any(s.state is wire.RuntimeState.READY for s in beats[-1].assignments)

        await tap_b.wait(ready)

        # A stream asked on B, one chunk at a time (window 1): the node waits for B's credit.
        head = wire.InferHead(
            assignment_id="a1", path="/v1/chat/completions", stream=True, deadline_at=time.time() + TIMEOUT_S, window=1
        )
        body = {
            "model": "chat-small",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 40,
            "stream": True,
        }
        assert b.link is not None
        await b.link.send_data(
            "n1", wire.INFER, "r1", codec.dumps(codec.wire, head).encode(), json.dumps(body).encode()
        )
        await tap_b.wait(lambda t: len(t.data) >= 1)

        # A is killed: the node sees its channel go down; B's request is still open.
        await a.stop()
        await _until(lambda: _connected(node) == [False, True])
        credit = codec.dumps(codec.wire, wire.CreditHead(chunks=1)).encode()
        await b.link.send_data("n1", wire.CREDIT, "r1", credit, b"")
        await tap_b.wait(lambda t: len(t.data) >= 2)

        # A comes back on its port: the node redials it (the usual backoff) and beats there again.
        await a.start()
        tap_again = Tap(a)
        nursery.start_soon(tap_again.run)
        await tap_again.beats(2)
        await _until(lambda: _connected(node) == [True, True])
        assert not any(f.kind == wire.END for f in tap_b.data)  # r1 is still streaming on B

        # B's stream goes on to its end, every frame of it on B.
        while not any(f.kind == wire.END for f in tap_b.data):
            seen = len(tap_b.data)
            await b.link.send_data("n1", wire.CREDIT, "r1", credit, b"")
            await tap_b.wait(lambda t, seen=seen: len(t.data) > seen)  # type: ignore[misc]
        frames = tap_b.data
        assert {f.request_id for f in frames} == {"r1"}
        assert [f.kind for f in frames[:-1]] == [wire.CHUNK] * (len(frames) - 1) and frames[-1].kind == wire.END
        end = codec.loads(codec.wire, frames[-1].head, wire.EndHead)
        assert end.status is wire.EndStatus.OK
        assert b"[DONE]" in b"".join(f.body for f in frames)
        assert tap_a.data == [] and tap_again.data == []  # nothing of it ever went to A
        assert node.agent.statistics().heartbeats_sent > 0
        await node.stop()


async def test_a_controller_key_rotation_moves_each_channel_where_its_controller_says_and_a_restart_dials_there(
    nursery: trio.Nursery, pair: tuple[FakeController, FakeController], cfg: NodeConfig, state_dir: Path
) -> None:
    a0, b0 = pair
    old, new, new_curve = a0.key, security.generate_signing_key(), links.generate_curve_keypair()
    cfg = attrs.evolve(cfg, controllers=(a0.endpoint, b0.endpoint))
    with trio.fail_after(TIMEOUT_S):
        # Each controller serves the shared new Curve key on its rotation endpoint.
        a1, b1 = twin(nursery, a0, curve=new_curve, key=new), twin(nursery, a0, curve=new_curve, key=new)
        await a1.start()
        await b1.start()
        tap_a0, tap_b0, tap_a1, tap_b1 = await _tapped(nursery, a0, b0, a1, b1)
        node = await start_node(nursery, cfg)
        await tap_a0.beats(1)
        await tap_b0.beats(1)

        def announce(endpoint: str) -> wire.ControllerKeysAnnounced:
            return wire.ControllerKeysAnnounced(
                node_id="n1",
                key_id=new.public.fingerprint,
                signing_public_key=new.public.b64,
                curve_public_key=new_curve.public,
                previous_key_id=old.public.fingerprint,
                overlap_until=time.time() + 600,
                channel_endpoint=endpoint,
            )

        # A announces first: the node pins the new key and moves A's channel (only A's) to a1.
        await a0.push(announce(a1.endpoint))
        await tap_a1.beats(2)
        await tap_b0.beats(2)
        assert tap_b1.signed == []
        # B repeats it (signed with the key it replaced, still in its overlap): B's channel moves to b1.
        await b0.push(announce(b1.endpoint))
        await tap_b1.beats(2)
        assert identity.load_enrollment(state_dir).controller_signing_public_key == new.public.b64
        assert [c.endpoint for c in node.agent.statistics().controllers] == [a1.endpoint, b1.endpoint]
        assert identity.load_channel_targets(state_dir) == {
            a0.endpoint: identity.ChannelTarget(endpoint=a1.endpoint, curve_public_key=new_curve.public),
            b0.endpoint: identity.ChannelTarget(endpoint=b1.endpoint, curve_public_key=new_curve.public),
        }
        await b1.push(aset(2, 1))  # signed with the new key, on the new channel
        assert (await tap_b1.next_ack(1)).accepted

        # Restarted (the old endpoints gone), the node dials where the channels moved.
        await node.stop()
        await a0.stop()
        await b0.stop()
        hellos = (len(tap_a1.of(wire.Hello)), len(tap_b1.of(wire.Hello)))
        node = await start_node(nursery, cfg)
        await tap_a1.wait(lambda t: len(t.of(wire.Hello)) > hellos[0])
        await tap_b1.wait(lambda t: len(t.of(wire.Hello)) > hellos[1])
        await _until(lambda: _connected(node) == [True, True])
        await node.stop()


async def test_one_listed_controller_is_one_channel(
    nursery: trio.Nursery, pair: tuple[FakeController, FakeController], cfg: NodeConfig
) -> None:
    # The enrolled endpoint is A's; node.toml names B alone: the node dials B, and only B.
    a, b = pair
    tap_a, tap_b = await _tapped(nursery, a, b)
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, attrs.evolve(cfg, controllers=(b.endpoint,)))
        await tap_b.beats(2)
        await b.push(aset(1, 1))
        assert (await tap_b.next_ack(1)).accepted
        await _until(lambda: _connected(node) == [True])
        await node.stop()
    assert tap_a.signed == []


async def test_the_nodes_new_keys_are_asked_for_once_and_then_used_on_every_channel(
    nursery: trio.Nursery, pair: tuple[FakeController, FakeController], cfg: NodeConfig, state_dir: Path
) -> None:
    a, b = pair
    tap_a, tap_b = await _tapped(nursery, a, b)
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, attrs.evolve(cfg, controllers=(a.endpoint, b.endpoint)))
        await tap_b.beats(1)
        await b.push(aset(1, 1))
        assert (await tap_b.next_ack(1)).accepted
        # `nexa node rotate-keys`: the request goes to one controller (B, heard last), not to each.
        pending = await trio.to_thread.run_sync(identity.prepare_rotation, state_dir)
        await tap_b.wait(lambda t: bool(t.of(wire.RotateKeys)))
        await tap_a.beats(2)
        assert tap_a.of(wire.RotateKeys) == []
        # B stores the new keys (the shared store: A admits them too) and answers.
        a.by_curve[pending.curve.public] = "n1"
        a.node_keys["n1"] = pending.signing_key.public
        await b.push(
            wire.KeysRotated(
                node_id="n1",
                signing_public_key=pending.signing_key.public.b64,
                curve_public_key=pending.curve.public,
            )
        )
        await _until(lambda: node.agent.statistics().keys_rotated == 1)
        # Only messages signed with the new key verify now: both channels carry them.
        await tap_a.beats(2)
        await tap_b.beats(2)
        await node.stop()


async def test_doctor_checks_each_listed_controller_endpoint(
    pair: tuple[FakeController, FakeController], cfg: NodeConfig, state_dir: Path
) -> None:
    from nexa.contracts.doctor import CheckStatus
    from nexa.node import doctor

    a, _ = pair
    gone = f"tcp://127.0.0.1:{free_port()}"
    record = identity.load_enrollment(state_dir)
    listed = attrs.evolve(cfg, controllers=(a.endpoint, gone))
    up, down = [await doctor.check_channel(listed, record, endpoint) for endpoint in listed.controllers]
    assert (up.status, up.detail) == (CheckStatus.OK, f"{a.endpoint} accepts connections")
    assert down.status is CheckStatus.FAIL and down.detail.startswith(f"cannot connect to {gone}")


# --- bad configuration --------------------------------------------------------------------------


def test_a_controller_list_must_name_controllers_each_once() -> None:
    with pytest.raises(ConfigError) as caught:
        structure_config(
            {"controllers": ["tcp://c1:8471", "c2:8471", "tcp://c1:8471", "nope", "tcp://*:8471"]}, NodeConfig
        )
    assert caught.value.problems == (
        "controllers[2]: tcp://c1:8471 is listed twice: name each controller once",
        "controllers[3]: 'nope' is not a channel address: use HOST:PORT or tcp://HOST:PORT",
        "controllers[4]: 'tcp://*:8471' is a listening address: a node dials a controller's host and port",
    )
    with pytest.raises(ConfigError, match="controllers: expected a list"):
        structure_config({"controllers": "tcp://c1:8471"}, NodeConfig)
    with pytest.raises(ConfigError, match=r"controllers\[0\]: expected a channel address"):
        structure_config({"controllers": [""]}, NodeConfig)
    with pytest.raises(ValueError, match=r"controllers\[1\]: tcp://c1:1 is listed twice"):
        NodeConfig(controllers=("c1:1", "tcp://c1:1"))
    # An empty list is the enrolled endpoint; a bare HOST:PORT means tcp://HOST:PORT.
    assert structure_config({"controllers": []}, NodeConfig).controllers == ()
    listed = structure_config({"controllers": ["c1:8471", "tcp://[::1]:8472"]}, NodeConfig).controllers
    assert listed == ("tcp://c1:8471", "tcp://[::1]:8472")


async def test_a_damaged_channels_file_or_source_address_fails_the_start_and_changes_nothing(
    pair: tuple[FakeController, FakeController], cfg: NodeConfig, state_dir: Path
) -> None:
    a, b = pair
    cfg = attrs.evolve(cfg, controllers=(a.endpoint, b.endpoint))
    path = state_dir / identity.CHANNELS_FILE
    path.write_text('{"channels": {"x": {"endpoint": "tcp://h:1"}}}')
    with pytest.raises(ConfigError, match=r"channels\.json is damaged"):
        await serve_node(cfg, stopping=trio.Event())
    assert path.read_text() == '{"channels": {"x": {"endpoint": "tcp://h:1"}}}'
    path.unlink()
    with pytest.raises(ConfigError, match="is not an IP address"):
        await serve_node(attrs.evolve(cfg, source_address="not-an-address"), stopping=trio.Event())
    assert not path.exists() and identity.load_fence(state_dir).epoch == 0


# --- the routing, against fake uplinks in virtual time ------------------------------------------


@attrs.define(eq=False)
class FakeUplink:
    """Records what is sent on it; `put` makes the controller send something; `full`: no connection."""

    endpoint: str
    signed: list[wire.NodeMessage] = attrs.Factory(list)
    data: list[tuple[str, str]] = attrs.Factory(list)
    full: bool = False
    _tx: trio.MemorySendChannel[wire.DataFrame | Unverified] | None = None
    _rx: trio.MemoryReceiveChannel[wire.DataFrame | Unverified] | None = None

    def __attrs_post_init__(self) -> None:
        self._tx, self._rx = trio.open_memory_channel[wire.DataFrame | Unverified](16)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        task_status.started()
        await trio.sleep_forever()

    async def put(self, got: wire.DataFrame | Unverified) -> None:
        assert self._tx is not None
        await self._tx.send(got)

    async def send(self, msg: wire.NodeMessage) -> None:
        self.send_nowait(msg)

    def send_nowait(self, msg: wire.NodeMessage) -> None:
        if self.full:
            raise trio.WouldBlock
        self.signed.append(msg)

    async def send_data(self, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        self.data.append((kind, request_id))

    def send_data_nowait(self, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        self.data.append((kind, request_id))

    async def receive_unverified(self) -> wire.DataFrame | Unverified:
        assert self._rx is not None
        return await self._rx.receive()

    def verify(self, pending: Unverified) -> wire.ControllerMessage:
        return wire.Drain(node_id="n1", epoch=1, reason=self.endpoint)

    def statistics(self) -> PumpStatistics:
        sent = len(self.signed) + len(self.data)
        return PumpStatistics(received=0, sent=sent, dropped=0, inbox_depth=0, outbox_depth=int(self.full))

    def wake(self) -> None:
        pass


def _frame(kind: str, request_id: str) -> wire.DataFrame:
    return wire.DataFrame(kind=kind, request_id=request_id, head=b"{}", body=b"")


def _beat(seq: int) -> wire.Heartbeat:
    inventory = gb10_inventory()
    return wire.Heartbeat(
        node_id="n1", seq=seq, ts=time.time(), inventory=inventory, free_memory_bytes=1, free_accelerators=0
    )


async def test_each_request_is_answered_on_its_channel_and_a_full_channel_holds_up_no_other(
    autojump_clock: trio.testing.MockClock,
) -> None:
    uplinks: dict[str, FakeUplink] = {}

    def make(dial: Dial, _: object) -> FakeUplink:
        uplinks[dial.endpoint] = FakeUplink(dial.endpoint)
        return uplinks[dial.endpoint]

    def dial(endpoint: str) -> tuple[str, Dial]:
        keys = Dial(
            curve=generate_curve_keypair(),
            signing_key=generate_signing_key(),
            server_curve_public=generate_curve_keypair().public,
            endpoint=endpoint,
        )
        return endpoint, keys

    channels = ControllerChannels(make, [dial("tcp://a:1"), dial("tcp://b:1")])  # type: ignore[arg-type]  # the fakes have what is used
    async with trio.open_nursery() as nursery:
        await nursery.start(channels.run)
        a, b = uplinks["tcp://a:1"], uplinks["tcp://b:1"]

        # r1 is asked on B, r2 on A: each frame comes with the channel it came on, and the node's
        # one routing table (the relay's requests) keeps it with the request.
        head = codec.dumps(codec.wire, infer_head()).encode()
        for uplink, frame in (
            (b, attrs.evolve(_frame(wire.INFER, "r1"), head=head)),
            (a, attrs.evolve(_frame(wire.INFER, "r2"), head=head)),
            (a, _frame(wire.CREDIT, "r1")),
            (a, _frame(wire.CREDIT, "r2")),
        ):
            await uplink.put(frame)
        got = [await channels.receive_unverified() for _ in range(4)]
        assert all(isinstance(g, Routed) for g in got)
        routed = [(g.frame.kind, g.frame.request_id, g.reply.dial.endpoint) for g in got]  # type: ignore[union-attr]
        assert routed == [
            (wire.INFER, "r1", "tcp://b:1"),
            (wire.INFER, "r2", "tcp://a:1"),
            (wire.CREDIT, "r1", "tcp://a:1"),
            (wire.CREDIT, "r2", "tcp://a:1"),
        ]
        # A credit for r1 on A is not A's to give: dropped, counted. Each request is answered (here
        # its end: no runtime is ready) on its own channel, and nothing more once it has ended.
        relay = NodeRelay(RelayConfig(), None, lambda _: None)
        await nursery.start(relay.run)
        for g in got:
            relay.deliver(g.frame, g.reply)  # type: ignore[union-attr]
        assert relay.statistics().foreign_frames == 1
        while relay.open_requests():  # noqa: ASYNC110 - virtual time
            await trio.sleep(0.01)
        assert b.data == [(wire.END, "r1")]
        assert a.data == [(wire.END, "r2")]
        dropped = relay.statistics().dropped_frames
        relay.deliver(_frame(wire.CREDIT, "r1"), got[0].reply)  # type: ignore[union-attr]
        assert relay.statistics().dropped_frames == dropped + 1 and b.data == [(wire.END, "r1")]

        # A has no connection (its outbox is full): beats still go to B at once, none wait on A.
        a.full = True
        with trio.fail_after(0.001):  # virtual time: nothing may sleep
            for seq in (1, 2, 3):
                await channels.send(_beat(seq))
        assert [m.seq for m in b.signed] == [1, 2, 3] and a.signed == []
        status_a, status_b = channels.statuses()
        assert (status_a.connected, status_b.connected) == (False, True)
        # The first beat found A's outbox full (dropped); then it was known stuck (not even queued).
        assert (status_a.dropped, status_a.heartbeats_skipped) == (1, 2)

        # A reply (an ack) answers the controller whose message was verified last.
        await b.put(Unverified(frames=[b"set"]))
        pending = await channels.receive_unverified()
        assert isinstance(pending, Unverified)
        assert channels.verify(pending) == wire.Drain(node_id="n1", epoch=1, reason="tcp://b:1")
        ack = wire.Ack(node_id="n1", seq=9, ts=time.time(), epoch=1, generation=1, accepted=True)
        await channels.send(ack)
        assert b.signed[-1] == ack and ack not in a.signed
        assert channels.dial.endpoint == "tcp://b:1"
        nursery.cancel_scope.cancel()
