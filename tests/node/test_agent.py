"""The node agent against a fake controller: real CurveZMQ on 127.0.0.1, a real controller key.

Policy: loopback only; the fake controller binds port 0 and re-binds the same port to play a
restart; every I/O test runs under an absolute `trio.fail_after`. The agent reads real files
(inventory.json, its state directory) in worker threads and runs a fake `nvidia-smi` script, so
these tests use short real intervals rather than the autojump clock (trio #456).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio

from nexa import __version__, security
from nexa.channel import links
from nexa.config import LeaseExpiryPolicy, NodeConfig, Seconds
from nexa.contracts import codec, wire
from nexa.contracts.api import EnrollResponse
from nexa.control.fleet import claims
from nexa.errors import ConfigError
from nexa.node import agent as agent_module
from nexa.node import identity
from nexa.node.agent import channel_endpoint, serve_node
from nexa.node.identity import Fence, load_fence
from nexa.node.verdicts import judge
from tests.conftest import FIXTURES, Controller
from tests.support.nodes import FakeController, aset, assignment, start_node, write_inventory

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 15
RS = wire.RejectReason


def secrets_and_places(ctl: FakeController, state_dir: Path) -> list[str]:
    """What must never appear on the channel or in a log line."""
    ident = identity.load_identity(state_dir)
    return [
        str(state_dir),
        ctl.endpoint,
        "127.0.0.1",
        ident.curve.secret,
        ident.curve.public,
        ident.signing_key.public.b64,
        ctl.key.public.b64,
        ctl.curve.public,
    ]


# --- heartbeats and inventory -------------------------------------------------------------------


async def test_hello_then_signed_heartbeats_with_increasing_seq_and_inventory(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, state_dir: Path
) -> None:
    cfg = attrs.evolve(cfg, source_address="127.0.0.1")  # dial from a chosen local address
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        assert (node.started.node_id, node.started.epoch, node.started.generation) == ("n1", 0, 0)
        # Link.receive verified each message against the key enrolled for n1's Curve key.
        hello = await ctl.next(wire.Hello)
        assert (hello.node_id, hello.agent_version, hello.epoch, hello.generation) == ("n1", __version__, 0, 0)
        assert hello.protocol == wire.PROTOCOL_VERSION
        beats = [await ctl.next(wire.Heartbeat) for _ in range(3)]

    window = security.ReplayWindow().check(hello.seq, hello.ts, time.time())
    for beat in beats:
        window = window.check(beat.seq, beat.ts, time.time())  # strictly increasing, timely
    assert abs(hello.seq / 1e6 - time.time()) < 60  # microseconds of wall-clock time
    inv = beats[-1].inventory
    assert inv.labels == {"rack": "r1"}
    assert [g.name for g in inv.gpus] == ["NVIDIA GB10"]
    assert beats[-1].free_accelerators == 1
    assert beats[-1].free_memory_bytes == inv.memory_available_bytes
    assert (beats[-1].assignments, beats[-1].epoch, beats[-1].generation) == ([], 0, 0)
    body = codec.dumps(codec.wire, beats[-1])
    for secret in secrets_and_places(ctl, state_dir):
        assert secret not in body
    assert node.agent.statistics().heartbeats_sent >= 3
    assert node.agent.statistics().last_seq >= beats[-1].seq


async def test_inventory_edits_reach_heartbeats_and_a_bad_edit_keeps_the_last_good(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexa.node")
    path = Path(cfg.inventory_path)
    with trio.fail_after(TIMEOUT_S):
        await start_node(nursery, cfg)
        assert (await ctl.next(wire.Heartbeat)).inventory.labels == {"rack": "r1"}

        write_inventory(path, {"labels": {"rack": "r2"}})
        await ctl.next(wire.Heartbeat, lambda b: b.inventory.labels == {"rack": "r2"})

        write_inventory(path, '{"labels": {"rack": "r3"')  # broken JSON
        while not any("rejected" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
            await trio.sleep(0.01)
        after = time.time()
        later = await ctl.next(wire.Heartbeat, lambda b: b.ts > after)
        assert later.inventory.labels == {"rack": "r2"}

        write_inventory(path, {"labels": {"rack": "r4"}})  # still watched after the bad edit
        await ctl.next(wire.Heartbeat, lambda b: b.inventory.labels == {"rack": "r4"})


# --- liveness and state -------------------------------------------------------------------------


async def _received(ctl: FakeController, count: int) -> list[links.Alive | wire.NodeMessage]:
    """The next `count` things n1 sends (liveness beats and signed messages), in order."""
    assert ctl.link is not None
    got: list[links.Alive | wire.NodeMessage] = []
    while len(got) < count:
        inbound = await ctl.link.receive()
        if isinstance(inbound, links.Alive | links.Inbound):
            got.append(inbound if isinstance(inbound, links.Alive) else inbound.message)
    return got


@pytest.fixture
def split_cfg(tmp_path: Path, cfg: NodeConfig) -> NodeConfig:
    """A node whose state goes only when it changes (or every 30 s), its memory read from a recorded
    meminfo (so that nothing but the test changes its state)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text((FIXTURES / "meminfo" / "gb10_dgx_spark.meminfo").read_text())
    return attrs.evolve(cfg, state_interval_s=Seconds(30.0), meminfo_path=str(meminfo))


async def test_between_states_the_agent_beats_liveness_and_a_changed_state_goes_at_once(
    nursery: trio.Nursery, ctl: FakeController, split_cfg: NodeConfig
) -> None:
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, split_cfg)
        state = await ctl.next(wire.Heartbeat)
        while state.runtime_cache is None:  # its first measurement is a change, sent at once
            state = await ctl.next(wire.Heartbeat)
        assert state.state_interval_s == 30.0  # what the controller holds it current for (plus its lease)
        # Its first measurements may land a beat apart (each a change, sent at once): at most one more.
        [first] = await _received(ctl, 1)
        if isinstance(first, wire.Heartbeat):
            state, first = first, (await _received(ctl, 1))[0]
        quiet = [first, *await _received(ctl, 9)]
        # Ten beats, all liveness: nothing changed and the interval is far off. Each names the state.
        assert quiet == [links.Alive(node_id="n1", state_seq=state.seq)] * 10
        write_inventory(Path(split_cfg.inventory_path), {"labels": {"rack": "r2"}})
        edited = trio.current_time()
        changed = await ctl.next(wire.Heartbeat)
        # At the next beat after the watcher read the edit (polled every 0.02 s), not at the interval.
        assert trio.current_time() - edited < 1.0
        assert changed.inventory.labels == {"rack": "r2"} and changed.seq > state.seq
        after = await _received(ctl, 3)
        assert after == [links.Alive(node_id="n1", state_seq=changed.seq)] * 3
    stats = node.agent.statistics()
    assert stats.liveness_sent >= 13 and stats.heartbeats_sent >= 2


async def test_the_agent_sends_its_state_when_the_controller_asks_and_when_a_set_is_accepted(
    nursery: trio.Nursery, ctl: FakeController, split_cfg: NodeConfig
) -> None:
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, split_cfg)
        await ctl.next(wire.Heartbeat)
        await _received(ctl, 2)  # beating liveness now
        await ctl.push(wire.StateRequest(node_id="n1"))
        asked = await _received(ctl, 1)
        assert isinstance(asked[0], wire.Heartbeat)  # the next thing sent
        await ctl.push(wire.StateRequest(node_id="someone-else"))  # not for this node: ignored
        await ctl.push(aset(1, 1, assignments=[]))
        assert (await ctl.next(wire.Ack)).accepted
        acked = trio.current_time()
        state = await ctl.next(wire.Heartbeat)  # the set it runs now, at once: not at the interval
        assert (state.epoch, state.generation) == (1, 1)
        assert trio.current_time() - acked < 1.0
    assert node.agent.statistics().states_requested == 1


# --- assignment sets ----------------------------------------------------------------------------


async def test_a_set_is_stored_then_acked_renewed_and_replaced_by_a_newer_epoch(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow_save_fence(directory: Path, fence: Fence) -> None:
        time.sleep(0.1)  # a slow disk: an ack sent before the write finished would win this race
        identity.save_fence(directory, fence)

    monkeypatch.setattr(agent_module, "save_fence", slow_save_fence)
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        offered = aset(2, 5)
        ack = await ctl.answer(offered)
        assert (ack.node_id, ack.epoch, ack.generation, ack.accepted, ack.reason) == ("n1", 2, 5, True, None)
        # The fence was on disk before the ack left, with the signed set as the epoch's proof.
        stored = load_fence(state_dir)
        assert attrs.evolve(stored, signed_body="", signature="") == Fence(
            epoch=2, generation=5, lease_expires_at=offered.lease_expires_at, assignments=[assignment()]
        )
        beat = await ctl.next(wire.Heartbeat, lambda b: b.generation == 5)
        assert beat.epoch == 2
        # Hello and heartbeats carry it: the controller's key verifies it, at this (epoch, generation).
        assert claims.proof_problem("n1", beat, {"k": ctl.key.public}) is None
        assert (beat.proof_set, beat.proof_signature) == (stored.signed_body, stored.signature)
        # The supervisor reports the accepted assignment (no podman here, so it cannot get far).
        assert [s.assignment_id for s in beat.assignments] == ["a1"]
        assert beat.assignments[0].state is not wire.RuntimeState.READY

        renewal = aset(2, 5, lease_s=60)
        assert (await ctl.answer(renewal)).accepted
        assert load_fence(state_dir).lease_expires_at == renewal.lease_expires_at

        newer = aset(3, 1, assignments=[assignment("a2")])  # a new epoch restarts generations
        assert (await ctl.answer(newer)).accepted
        assert load_fence(state_dir).assignments == [assignment("a2")]

    stats = node.agent.statistics()
    assert (stats.sets_accepted, stats.leases_renewed, stats.epoch, stats.generation) == (2, 1, 3, 1)
    assert sum(stats.rejected.values()) == 0


@pytest.mark.parametrize(
    ("offered", "reason"),
    [
        (partial(aset, 3, 1, node_id="n2"), RS.WRONG_NODE),
        (partial(aset, 1, 9), RS.STALE_EPOCH),
        (partial(aset, 2, 4), RS.STALE_GENERATION),
        (partial(aset, 2, 5, assignments=[assignment("other")]), RS.STALE_GENERATION),
        (partial(aset, 2, 6, lease_s=-1), RS.LEASE_EXPIRED),
    ],
    ids=["wrong-node", "stale-epoch", "stale-generation", "same-generation-other-set", "expired-lease"],
)
async def test_refusals_are_answered_counted_and_logged_without_secrets(
    nursery: trio.Nursery,
    ctl: FakeController,
    cfg: NodeConfig,
    state_dir: Path,
    caplog: pytest.LogCaptureFixture,
    offered: Callable[[], wire.AssignmentSet],
    reason: wire.RejectReason,
) -> None:
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        assert (await ctl.answer(aset(2, 5))).accepted
        accepted = load_fence(state_dir)
        caplog.clear()
        caplog.set_level(logging.INFO, logger="nexa")

        refused = offered()
        ack = await ctl.answer(refused)

    assert (ack.accepted, ack.reason, ack.node_id) == (False, reason, "n1")
    assert (ack.epoch, ack.generation) == (refused.epoch, refused.generation)
    assert ack.detail
    stats = node.agent.statistics()
    assert stats.rejected == {r: int(r is reason) for r in RS}
    assert load_fence(state_dir) == accepted
    assert (stats.epoch, stats.generation) == (2, 5)
    # The agent's own (the supervisor's retries against the podman that is not there may log too).
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "nexa.node.agent"]
    assert len(warnings) == 1
    assert str(reason) in warnings[0].getMessage()
    for secret in secrets_and_places(ctl, state_dir):
        assert secret not in ack.detail
        assert all(secret not in r.getMessage() for r in caplog.records)


async def test_a_set_the_node_cannot_store_is_refused_and_not_acted_on(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(directory: Path, fence: Fence) -> None:
        raise ConfigError(f"cannot write {directory}/fence.json: No space left on device")

    monkeypatch.setattr(agent_module, "save_fence", full_disk)
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        ack = await ctl.answer(aset(2, 5))
        beat = await ctl.next(wire.Heartbeat)
    assert (ack.accepted, ack.reason) == (False, None)
    assert "could not store" in ack.detail
    assert str(state_dir) not in ack.detail
    assert (beat.epoch, beat.generation, beat.assignments) == (0, 0, [])
    stats = node.agent.statistics()
    assert (stats.store_failures, stats.sets_accepted, stats.epoch) == (1, 0, 0)


async def test_a_set_signed_by_another_key_is_never_judged_and_the_agent_reconnects(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, state_dir: Path
) -> None:
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        # An impostor on the controller's address with its Curve keys but not its signing key.
        await ctl.stop()
        await ctl.start(signing_key=security.generate_signing_key())
        await ctl.next(wire.Heartbeat)  # the node came back on its own
        await ctl.push(aset(3, 1))
        while node.agent.statistics().bad_signatures == 0:  # noqa: ASYNC110
            await trio.sleep(0.01)
        with trio.move_on_after(0.3) as quiet:
            await ctl.next(wire.Ack)
        assert quiet.cancelled_caught  # a forged set gets no answer
        stats = node.agent.statistics()
        assert (stats.bad_signatures, sum(stats.rejected.values()), stats.sets_accepted) == (1, 0, 0)
        assert not (state_dir / "fence.json").exists()

        await ctl.stop()  # the real controller restarts on the same port
        await ctl.start()
        await ctl.next(wire.Heartbeat)
        assert (await ctl.answer(aset(3, 1))).accepted
        assert load_fence(state_dir).epoch == 3


async def test_a_restarted_node_keeps_its_fence_and_its_sequence(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, state_dir: Path
) -> None:
    with trio.fail_after(TIMEOUT_S):
        first = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        assert (await ctl.answer(aset(2, 5))).accepted
        last_seq = first.agent.statistics().last_seq
        await first.stop()

        second = await start_node(nursery, cfg)
        assert (second.started.epoch, second.started.generation) == (2, 5)
        hello = await ctl.next(wire.Hello)
        assert (hello.epoch, hello.generation) == (2, 5)
        assert hello.seq > last_seq
        beat = await ctl.next(wire.Heartbeat)
        assert (beat.epoch, beat.generation, beat.seq) == (2, 5, beat.seq)
        assert beat.seq > hello.seq
        assert [a.assignment_id for a in beat.assignments] == ["a1"]

        assert (await ctl.answer(aset(2, 4))).reason is RS.STALE_GENERATION
        assert (await ctl.answer(aset(1, 9))).reason is RS.STALE_EPOCH
        assert load_fence(state_dir).generation == 5


async def test_the_agent_reconnects_when_the_controller_comes_back(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig
) -> None:
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        first = await ctl.next(wire.Heartbeat)
        endpoint = ctl.endpoint
        await ctl.stop()
        await trio.sleep(0.3)  # several beats while nobody listens
        await ctl.start()
        assert ctl.endpoint == endpoint
        later = await ctl.next(wire.Heartbeat)
        assert later.seq > first.seq
        # Beats are skipped rather than piled up while disconnected, so few stale ones arrive.
        assert node.agent.statistics().heartbeats_skipped > 0


# --- the lease ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [LeaseExpiryPolicy.KEEP_SERVING, LeaseExpiryPolicy.STOP])
async def test_a_lapsed_lease_applies_the_configured_policy_once(
    nursery: trio.Nursery,
    ctl: FakeController,
    cfg: NodeConfig,
    caplog: pytest.LogCaptureFixture,
    policy: LeaseExpiryPolicy,
) -> None:
    caplog.set_level(logging.INFO, logger="nexa.node.agent")
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, attrs.evolve(cfg, on_lease_expiry=policy))
        await ctl.next(wire.Hello)
        assert (await ctl.answer(aset(1, 1, lease_s=0.3))).accepted
        while not node.agent.statistics().lease_lapsed:  # noqa: ASYNC110
            await trio.sleep(0.01)
        after = time.time()
        if policy is LeaseExpiryPolicy.KEEP_SERVING:
            beat = await ctl.next(wire.Heartbeat, lambda b: b.ts > after)
            assert [s.assignment_id for s in beat.assignments] == ["a1"]
            assert beat.assignments[0].detail.endswith(f"lease lapsed ({policy})")
        else:  # the supervisor stops every runtime: the assignment leaves the report
            await ctl.next(wire.Heartbeat, lambda b: b.ts > after and not b.assignments)
        await trio.sleep(0.2)
        lapsed = [
            r for r in caplog.records if r.name == "nexa.node.agent" and "lapsed without renewal" in r.getMessage()
        ]
        assert len(lapsed) == 1
        assert policy.value in lapsed[0].getMessage()

        assert (await ctl.answer(aset(1, 1, lease_s=30))).accepted  # renewal puts it back in force
        assert not node.agent.statistics().lease_lapsed
        after = time.time()
        beat = await ctl.next(wire.Heartbeat, lambda b: b.ts > after and bool(b.assignments))
        assert [s.assignment_id for s in beat.assignments] == ["a1"]
        assert "lease lapsed" not in beat.assignments[0].detail


async def test_drain_is_recorded_and_a_foreign_one_ignored(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig
) -> None:
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        await ctl.push(wire.Drain(node_id="n2", epoch=1))
        assert (await ctl.answer(aset(1, 1))).accepted  # processed in order after the one above
        assert not node.agent.statistics().draining
        await ctl.push(wire.Drain(node_id="n1", epoch=1, reason="maintenance"))
        while not node.agent.statistics().draining:  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_an_unenrolled_node_does_not_start(cfg: NodeConfig) -> None:
    with trio.fail_after(TIMEOUT_S), pytest.raises(ConfigError) as info:
        await serve_node(cfg, stopping=trio.Event())
    assert info.value.message == identity.NOT_ENROLLED


# --- pure parts ---------------------------------------------------------------------------------


NOW = 1_700_000_000.0
ACCEPTED = Fence(epoch=2, generation=5, lease_expires_at=NOW + 10, assignments=[assignment()])


def offer(epoch: int, generation: int, **kw: object) -> wire.AssignmentSet:
    fields: dict[str, object] = {"node_id": "n1", "lease_expires_at": NOW + 30, "assignments": [assignment()], **kw}
    return wire.AssignmentSet(epoch=epoch, generation=generation, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fence", "offered", "reason", "renewal"),
    [
        (Fence(), offer(1, 1), None, False),
        (Fence(), offer(0, 1), None, False),
        (ACCEPTED, offer(2, 6), None, False),
        (ACCEPTED, offer(3, 0), None, False),
        (ACCEPTED, offer(2, 5), None, True),
        (ACCEPTED, offer(2, 5, assignments=[]), RS.STALE_GENERATION, False),
        (ACCEPTED, offer(2, 4), RS.STALE_GENERATION, False),
        (ACCEPTED, offer(1, 99), RS.STALE_EPOCH, False),
        (ACCEPTED, offer(3, 1, node_id="n2"), RS.WRONG_NODE, False),
        (ACCEPTED, offer(3, 1, lease_expires_at=NOW), RS.LEASE_EXPIRED, False),
        (ACCEPTED, offer(2, 5, lease_expires_at=NOW - 1), RS.LEASE_EXPIRED, False),
        # Several faults: the set's address is checked first, then its age, then its lease.
        (ACCEPTED, offer(1, 1, node_id="n2", lease_expires_at=NOW - 1), RS.WRONG_NODE, False),
        (ACCEPTED, offer(1, 1, lease_expires_at=NOW - 1), RS.STALE_EPOCH, False),
    ],
)
def test_judge(fence: Fence, offered: wire.AssignmentSet, reason: wire.RejectReason | None, renewal: bool) -> None:
    verdict = judge("n1", fence, offered, NOW)
    assert (verdict.reason, verdict.renewal, verdict.accepted) == (reason, renewal, reason is None)
    assert bool(verdict.detail) == (reason is not None)


def test_channel_endpoint_with_a_source_address() -> None:
    assert channel_endpoint("tcp://127.0.0.99:8471", "") == "tcp://127.0.0.99:8471"
    assert channel_endpoint("tcp://127.0.0.99:8471", "127.0.0.1") == "tcp://127.0.0.1:0;127.0.0.99:8471"
    assert channel_endpoint("tcp://[fd00::1]:8471", "::1") == "tcp://[::1]:0;[fd00::1]:8471"
    with pytest.raises(ConfigError, match="not an IP address"):
        channel_endpoint("tcp://127.0.0.99:8471", "eth0; rm")
    with pytest.raises(ConfigError, match="tcp://"):
        channel_endpoint("ipc:///run/nexa.sock", "127.0.0.1")


# --- with the real controller -------------------------------------------------------------------


async def test_the_real_controller_sees_the_agent_ready_and_records_its_ack(
    nursery: trio.Nursery, controller: Controller, cfg: NodeConfig, state_dir: Path
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with controller.client() as http:
            token = (await http.post("/api/v1/enrollment-tokens", json={"ttl_s": 60})).json()["token"]
            req = identity.enroll_request(state_dir, token, "spark-1", __version__)
            resp = await http.post("/api/v1/enroll", json=codec.api.unstructure(req))
            assert resp.status_code == 201, resp.text
            identity.save_enrollment(state_dir, codec.structure(codec.api, resp.json(), EnrollResponse))
            epoch = (await http.get("/version")).json()["epoch"]
            node = await start_node(nursery, cfg)
            while True:
                view = (await http.get(f"/api/v1/nodes/{node.started.node_id}")).json()
                if view["state"] == "Ready" and view["acked_epoch"] == epoch and view["inventory"]:
                    break
                await trio.sleep(0.02)
    assert view["labels"]["rack"] == "r1"
    assert view["agent_version"] == __version__
    assert view["free_accelerators"] == 1
    assert view["ack_reason"] is None
    assert node.agent.statistics().epoch == epoch
    assert load_fence(state_dir).epoch == epoch
