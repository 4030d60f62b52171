"""`nexa node`: the agent's composition root, heartbeats and the signed-assignment fence.

`serve_node` wires the parts (`node.builders`: inventory watcher, engine, runtimes; the channel,
the relay, the agent) in one nursery; `Agent` owns the node's side of the protocol: it says
hello, beats, judges every assignment set against the fence kept on disk and answers it, and
watches the accepted set's lease. Nothing it sends or logs names keys, file paths or addresses.

Beats are of two kinds. Every `heartbeat_interval_s` the agent sends either a liveness beat (a
few bytes the channel authenticates: "this agent runs", with the seq of its last state) or, when
that is due, its state: the signed `Heartbeat` (inventory, free memory and accelerators, every
replica's state and load, the accepted set). The state goes at once when it changes (`beats`:
what moves by itself between reads, a load's age, discovery's clock, GPU telemetry and small
drifts of free memory, does not count as a change), when the controller asks (`StateRequest`) and
at least every `state_interval_s`.

Control never blocks data: `agent.receive`, the uplink's only reader, hands data frames to the
relay at once and signed messages to `agent.control` (signature check, judgement, the fsync'd
fence save, the ack) through a bounded channel, in order. It never waits on that channel: when
`_CONTROL_QUEUE` messages already wait, the new one is dropped and counted (`control_dropped`).
That is safe because what the controller sends supersedes what came before (an assignment set is
the whole desired state with its lease; a drain is a flag) and the controller sends the set again
at every renewal (lease / 3) and whenever a heartbeat reports an older one.

Key rotation (`nexa node rotate-keys` writes `keys.next` in the state directory; `nexa nodes
rotate` has the controller ask): the agent sends the new public keys in a `RotateKeys` signed
with its current key, again every `ROTATION_RETRY_S` until a `KeysRotated` answers; then it
makes them its keys on disk and has its channel dial with them (`channel.endpoints`, make before
break), and its next heartbeat, signed with the new key, tells the controller to drop the old.
"""

from __future__ import annotations

import collections
import logging
import os
import time
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Final, NoReturn, Protocol

import attrs
import trio

from nexa import __version__
from nexa.channel.endpoints import DataSender, OpenRequests, Routed
from nexa.channel.links import Unverified
from nexa.config import LeaseExpiryPolicy, NodeConfig
from nexa.container_spec import SIMULATION_ENV
from nexa.contracts import wire
from nexa.errors import BadSignature, ChannelError, ConfigError, ContractError
from nexa.moderation import moderated
from nexa.node.beats import Sent, changed, sent
from nexa.node.builders import (
    NodeRuntimes,
    artifact_cache,
    container_engine,
    engine_version,
    inventory,
    load_state,
    runtimes_of,
)
from nexa.node.identity import (
    Fence,
    NodeIdentity,
    PendingKeys,
    controller_keys,
    discard_pending_keys,
    load_pending_keys,
    pin_controller_keys,
    prepare_rotation,
    promote_pending_keys,
    save_fence,
)
from nexa.node.inventory import InventoryWatcher
from nexa.node.lora import NodeLoras
from nexa.node.processes import DriverRouter, open_process_driver
from nexa.node.relay import NodeRelay
from nexa.node.uplinks import (
    Channel,
    ControllerChannels,
    ControllerLinkStatus,
    channel_endpoint,  # noqa: F401 - importable from here, as before
    open_channel,
)
from nexa.node.verdicts import judge
from nexa.supervision import Supervision, supervised, watch_event_loop

log = logging.getLogger(__name__)


#: Signed messages from the controller waiting for `agent.control` (it sends about one per lease / 3).
_CONTROL_QUEUE: Final = 16
#: A `RotateKeys` not answered is sent again this often (the controller answers a repeat the same way).
ROTATION_RETRY_S: Final = 5.0


# --- the agent ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AgentStatistics:
    """A snapshot of the agent's counters and fence (trio's `statistics()` convention)."""

    node_id: str
    epoch: int
    generation: int
    lease_expires_at: float
    assignments: int
    last_seq: int
    heartbeats_sent: int
    #: Beats not queued because the previous message had not left yet (no connection).
    heartbeats_skipped: int
    sets_accepted: int
    leases_renewed: int
    #: Refused assignment sets by reason; every reason is present.
    rejected: Mapping[wire.RejectReason, int]
    #: Messages whose controller signature did not verify (never judged, never answered).
    bad_signatures: int
    #: Signed messages that did not fit their contract.
    invalid_messages: int
    #: Accepted sets the node could not store (answered with a refusal).
    store_failures: int
    lease_lapsed: bool
    draining: bool
    #: Data-path frames (infer, cancel, credit) handed to the relay.
    data_frames: int = 0
    #: Signed messages dropped unread because `_CONTROL_QUEUE` of them already waited (module docstring).
    control_dropped: int = 0
    #: Key rotations completed by this agent, and whether one waits for the controller's answer.
    keys_rotated: int = 0
    rotation_pending: bool = False
    #: With several controllers (`NodeConfig.controllers`), each one's channel; else empty.
    controllers: tuple[ControllerLinkStatus, ...] = ()
    #: Liveness beats sent (`heartbeats_sent` counts the signed states), and the states sent
    #: because a controller asked for them.
    liveness_sent: int = 0
    states_requested: int = 0


@attrs.frozen(kw_only=True)
class NodeStarted:
    """What `serve_node` reports once the channel is dialling and the hello is queued."""

    node_id: str
    epoch: int
    generation: int
    agent: Agent
    #: The supervision of the node's loops: failures by loop in its `statistics()`.
    supervision: Supervision | None = None


class Runtimes(Protocol):
    """What the agent needs of the runtime supervisor."""

    def update(self, generation: int, assignments: Sequence[wire.Assignment]) -> None: ...

    def statuses(self) -> list[wire.AssignmentStatus]: ...


class Agent:
    """The node's protocol state: sequence numbers, the accepted fence, assignment states."""

    def __init__(
        self,
        *,
        identity: NodeIdentity,
        fence: Fence,
        state_dir: Path,
        uplink: Channel,
        inventory: InventoryWatcher,
        runtimes: Runtimes,
        heartbeat_interval_s: float,
        on_lease_expiry: LeaseExpiryPolicy,
        data: Callable[[wire.DataFrame, DataSender], None] | None = None,
        container_engine: str = "",
        container_engine_version: str = "",
        gpu_method: str = "",
        pending_keys: PendingKeys | None = None,
        open_requests: OpenRequests = lambda _: (),
        cache_disk: Callable[[], wire.CacheDisk | None] = lambda: None,
        runtime_cache: Callable[[], wire.RuntimeCacheDisk | None] = lambda: None,
        memory_pressure: Callable[[], tuple[wire.MemoryPressure | None, int]] = lambda: (None, 0),
        state_interval_s: float = 0.0,
    ) -> None:
        self._memory_pressure = memory_pressure
        # Liveness and state (module docstring): the state last sent, as `beats.changed` compares it, and
        # when (trio clock); its seq, which every liveness beat carries; a wake-up for the beat loop
        # when the state must go before its time (a new set, a lapsed lease, a controller asks).
        self._state_interval_s = state_interval_s
        self._last_state: Sent | None = None
        self._last_state_at = float("-inf")
        self._state_seq = 0
        self._state_wanted, self._wake = False, trio.Event()
        self._liveness_sent = self._states_requested = 0
        self._node_id = identity.node_id
        self._controller_key_id = identity.controller_signing_public.fingerprint
        # A rotation under way (`keys.next`), and when its RotateKeys was last sent.
        self._pending = pending_keys
        self._pending_sent_at = float("-inf")
        self._open_requests, self._cache_disk = open_requests, cache_disk
        self._runtime_cache = runtime_cache
        # Reported in every heartbeat's inventory (`nexa nodes show`).
        self._engine = (container_engine, container_engine_version, gpu_method)
        # The inference relay's `deliver` (never blocks); without one, data frames are dropped.
        self._deliver_data = data
        self._data_frames = self._control_dropped = 0
        # agent.receive → agent.control: signed messages, checked and acted on off the data path.
        self._control_tx, self._control_rx = trio.open_memory_channel[Unverified](_CONTROL_QUEUE)
        # Uplink `sent` at the last beat: a full outbox that has not moved since means no connection.
        self._sent_at_beat = -1
        self._fence = fence
        self._state_dir = state_dir
        self._uplink = uplink
        self._inventory = inventory
        self._heartbeat_interval_s = heartbeat_interval_s
        self._on_lease_expiry = on_lease_expiry
        self._runtimes = runtimes
        self._fence_changed = trio.Event()
        # Sequence numbers and enqueueing happen under one lock, so messages leave in seq order.
        self._send_lock = trio.Lock()
        self._seq = 0
        self._lease_lapsed = False
        self._draining = False
        self._rejected: collections.Counter[wire.RejectReason] = collections.Counter()
        self._heartbeats_sent = self._heartbeats_skipped = self._keys_rotated = 0
        self._sets_accepted = self._leases_renewed = 0
        self._bad_signatures = self._invalid_messages = self._store_failures = 0

    @property
    def fence(self) -> Fence:
        return self._fence

    def statistics(self) -> AgentStatistics:
        return AgentStatistics(
            node_id=self._node_id,
            epoch=self._fence.epoch,
            generation=self._fence.generation,
            lease_expires_at=self._fence.lease_expires_at,
            assignments=len(self._fence.assignments),
            last_seq=self._seq,
            heartbeats_sent=self._heartbeats_sent,
            heartbeats_skipped=self._heartbeats_skipped,
            sets_accepted=self._sets_accepted,
            leases_renewed=self._leases_renewed,
            rejected=types.MappingProxyType({reason: self._rejected[reason] for reason in wire.RejectReason}),
            bad_signatures=self._bad_signatures,
            invalid_messages=self._invalid_messages,
            store_failures=self._store_failures,
            lease_lapsed=self._lease_lapsed,
            draining=self._draining,
            data_frames=self._data_frames,
            control_dropped=self._control_dropped,
            keys_rotated=self._keys_rotated,
            rotation_pending=self._pending is not None,
            controllers=self._uplink.statuses() if isinstance(self._uplink, ControllerChannels) else (),
            liveness_sent=self._liveness_sent,
            states_requested=self._states_requested,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Queue the hello, report started, then beat, answer and watch the lease until cancelled."""
        fence = self._fence
        await self._send(
            lambda seq, ts: wire.Hello(
                node_id=self._node_id,
                seq=seq,
                ts=ts,
                agent_version=__version__,
                epoch=fence.epoch,
                generation=fence.generation,
                controller_key_id=self._pinned_key_id(),
                proof_set=fence.signed_body,
                proof_signature=fence.signature,
            )
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervised, "agent.beat", self._beat)
            nursery.start_soon(supervised, "agent.receive", self._receive)
            nursery.start_soon(supervised, "agent.control", self._control)
            nursery.start_soon(supervised, "agent.watch_lease", self._watch_lease)
            nursery.start_soon(supervised, "agent.watch_rotation", self._watch_rotation)
            nursery.start_soon(supervised, "agent.watchdog", watch_event_loop)
            task_status.started()
        raise AssertionError("the agent's loops never return")  # pragma: no cover

    # --- sending

    def _next_seq(self) -> int:
        # Microseconds of wall-clock time, so a restarted agent continues above its last run;
        # never below last + 1, so a clock step backwards cannot repeat a number.
        self._seq = max(time.time_ns() // 1000, self._seq + 1)
        return self._seq

    async def _send(self, build: Callable[[int, float], wire.NodeMessage]) -> None:
        async with self._send_lock:
            await self._uplink.send(build(self._next_seq(), time.time()))

    # --- heartbeats

    async def _beat(self) -> NoReturn:
        next_at = trio.current_time()
        while True:
            if trio.current_time() >= next_at:
                await self._beat_once()
                next_at += self._heartbeat_interval_s
                if next_at < trio.current_time():  # fell behind (a slow send): do not burst to catch up
                    next_at = trio.current_time() + self._heartbeat_interval_s
            elif self._state_wanted:
                await self._beat_once()  # the state, before its beat: the next beat keeps its time
            with trio.move_on_at(next_at):
                await self._wake.wait()
                self._wake = trio.Event()

    def _want_state(self) -> None:
        """Have the beat loop send the state now rather than at its next beat."""
        self._state_wanted = True
        self._wake.set()

    async def _beat_once(self) -> None:
        """One beat: the state when it changed, is wanted or is due; else a liveness beat."""
        stats = self._uplink.statistics()
        if stats.outbox_depth > 0 and stats.sent == self._sent_at_beat:
            # Nothing has left since the last beat: there is no connection. Queueing more beats
            # would only deliver stale ones in a burst when it comes back. (A busy data path keeps
            # the outbox non-empty while it is moving, which must not silence the heartbeat.)
            self._heartbeats_skipped += 1
            return
        self._sent_at_beat = stats.sent
        state = self._heartbeat(0, 0.0)
        due = trio.current_time() - self._last_state_at >= self._state_interval_s
        if due or self._state_wanted or changed(self._last_state, state):
            await self._send_state(state)
            return
        async with self._send_lock:
            await self._uplink.send_liveness(self._node_id, self._state_seq)
        self._liveness_sent += 1

    async def _heartbeat_once(self) -> None:
        """Send the state now (the first message on a new connection or with a new key)."""
        await self._send_state(self._heartbeat(0, 0.0))

    async def _send_state(self, state: wire.Heartbeat) -> None:
        self._state_wanted = False  # set again by whatever wants a newer one from here on
        async with self._send_lock:
            seq = self._next_seq()
            await self._uplink.send(attrs.evolve(state, seq=seq, ts=time.time()))
            self._state_seq = seq
        self._last_state = sent(state)
        self._last_state_at = trio.current_time()
        self._heartbeats_sent += 1

    def _heartbeat(self, seq: int, ts: float) -> wire.Heartbeat:
        inventory = self._inventory.current()
        engine, version, gpu_method = self._engine
        if engine:
            inventory = attrs.evolve(
                inventory, container_engine=engine, container_engine_version=version, gpu_method=gpu_method
            )
        fence = self._fence
        statuses = self._runtimes.statuses()
        if self._lease_lapsed:
            # Tells the controller why nothing changed (keep_serving) or why everything stopped.
            note = f"lease lapsed ({self._on_lease_expiry})"
            statuses = [attrs.evolve(s, detail=f"{s.detail}; {note}" if s.detail else note) for s in statuses]
        in_use = {gpu for a in fence.assignments for gpu in a.runtime.gpus}
        pressure, stops = self._memory_pressure()
        return wire.Heartbeat(
            node_id=self._node_id,
            seq=seq,
            ts=ts,
            inventory=inventory,
            free_memory_bytes=inventory.memory_available_bytes,
            free_accelerators=sum(1 for gpu in inventory.gpus if gpu.cdi_device not in in_use),
            assignments=statuses,
            epoch=fence.epoch,
            generation=fence.generation,
            controller_key_id=self._pinned_key_id(),
            cache_disk=self._cache_disk(),
            runtime_cache=self._runtime_cache(),
            memory_pressure=pressure,
            memory_pressure_stops=stops,
            proof_set=fence.signed_body,
            proof_signature=fence.signature,
            state_interval_s=self._state_interval_s,
        )

    def _pinned_key_id(self) -> str:
        """The id of the controller key this node pins as current (hello and heartbeat say it)."""
        pinned = self._uplink.controller_keys
        return pinned[0][0].fingerprint if pinned else self._controller_key_id

    # --- what the controller sends

    async def _receive(self) -> NoReturn:
        # The uplink's only reader; nothing here waits but the uplink (module docstring).
        while True:
            try:
                got = await self._uplink.receive_unverified()
            except ContractError:
                self._invalid_messages += 1
                continue
            if isinstance(got, Routed):
                # Inference traffic: authenticated by the channel, never judged as desired state.
                # The relay keeps the channel it came on with the request (its one routing table).
                self._data_frames += 1
                if self._deliver_data is not None:
                    self._deliver_data(got.frame, got.reply)
                continue
            try:
                self._control_tx.send_nowait(got)
            except trio.WouldBlock:
                self._control_dropped += 1
                log.warning("dropped a message from the controller: %d already wait to be handled", _CONTROL_QUEUE)

    async def _control(self) -> NoReturn:
        while True:
            pending = await self._control_rx.receive()
            try:
                msg = self._uplink.verify(pending)
            except BadSignature:
                # Not from our controller: never judged, never answered (the uplink logged it).
                self._bad_signatures += 1
                continue
            except ContractError:
                self._invalid_messages += 1
                continue
            try:
                await self._dispatch(msg, pending.frames)
            except ChannelError:
                raise  # the channel itself is gone: the loop's supervisor restarts it
            except Exception as exc:
                # Last resort: no value from the controller may end the node. Counted and
                # logged by type only (never the message's content); the next message goes on.
                self._invalid_messages += 1
                log.warning("could not act on a message from the controller: %s", type(exc).__name__)

    async def _dispatch(self, msg: wire.ControllerMessage, frames: Sequence[bytes] = ()) -> None:
        if isinstance(msg, wire.AssignmentSet):
            await self._on_assignments(msg, frames)
        elif isinstance(msg, wire.Drain):
            self._on_drain(msg)
        elif isinstance(msg, wire.KeysRotated):
            await self._on_keys_rotated(msg)
        elif isinstance(msg, wire.ControllerKeysAnnounced):
            await self._on_controller_keys(msg)
        elif isinstance(msg, wire.StateRequest):
            if msg.node_id == self._node_id:
                self._states_requested += 1
                self._want_state()
        elif msg.node_id == self._node_id:  # RotateKeysRequest
            log.info("the controller asks this node to rotate its keys")
            self._pending = await trio.to_thread.run_sync(prepare_rotation, self._state_dir)
            await self._send_rotation()

    async def _on_assignments(self, offered: wire.AssignmentSet, frames: Sequence[bytes] = ()) -> None:
        verdict = judge(self._node_id, self._fence, offered, time.time())
        accepted = verdict.accepted
        detail = verdict.detail
        if verdict.reason is not None:
            self._rejected[verdict.reason] += 1
            log.warning(
                "refused assignment set (epoch %d, generation %d): %s: %s",
                offered.epoch,
                offered.generation,
                verdict.reason,
                detail,
            )
        else:
            new = Fence(
                epoch=offered.epoch,
                generation=offered.generation,
                lease_expires_at=offered.lease_expires_at,
                assignments=list(offered.assignments),
            ).with_proof(frames)
            try:
                # On disk before the ack: a crash after acking must not forget what was accepted.
                await trio.to_thread.run_sync(save_fence, self._state_dir, new)
            except ConfigError:
                self._store_failures += 1
                accepted, detail = False, "the node could not store the assignment set"
                log.exception("could not store the assignment set (epoch %d, generation %d)", new.epoch, new.generation)
            else:
                self._install(new, renewal=verdict.renewal)
        await self._send(
            lambda seq, ts: wire.Ack(
                node_id=self._node_id,
                seq=seq,
                ts=ts,
                epoch=offered.epoch,
                generation=offered.generation,
                accepted=accepted,
                reason=verdict.reason,
                detail=detail,
            )
        )

    def _install(self, new: Fence, *, renewal: bool) -> None:
        if renewal:
            self._leases_renewed += 1
            log.debug("assignment lease renewed (epoch %d, generation %d)", new.epoch, new.generation)
        else:
            self._sets_accepted += 1
            log.info(
                "accepted assignment set (epoch %d, generation %d): %d assignments",
                new.epoch,
                new.generation,
                len(new.assignments),
            )
        if not renewal or self._lease_lapsed:
            # A new set, or a renewal after the lease lapsed: the supervisor reconciles to it.
            self._runtimes.update(new.generation, new.assignments)
        if self._lease_lapsed:
            log.info("assignment lease in force again (epoch %d, generation %d)", new.epoch, new.generation)
        if not renewal or self._lease_lapsed:
            self._want_state()  # the controller learns the set it runs (or that it runs again) now
        self._lease_lapsed = False
        self._fence = new
        self._fence_changed.set()
        self._fence_changed = trio.Event()

    def _on_drain(self, msg: wire.Drain) -> None:
        if msg.node_id != self._node_id or msg.epoch < self._fence.epoch:
            log.warning("ignored a drain request that is for another node or an older epoch (epoch %d)", msg.epoch)
            return
        if not self._draining:
            # The supervisor will stop taking new work; for now the state is recorded and reported.
            log.info("draining at the controller's request (reason: %r)", msg.reason)
        self._draining = True

    # --- key rotation

    async def _watch_rotation(self) -> NoReturn:
        # `nexa node rotate-keys` leaves the keys in the state directory; the agent picks them up.
        while True:
            if self._pending is None:
                self._pending = await trio.to_thread.run_sync(load_pending_keys, self._state_dir)
            if self._pending is not None and trio.current_time() - self._pending_sent_at >= ROTATION_RETRY_S:
                await self._send_rotation()
            await trio.sleep(min(self._heartbeat_interval_s, ROTATION_RETRY_S))

    async def _send_rotation(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending_sent_at = trio.current_time()
        await self._send(
            lambda seq, ts: wire.RotateKeys(
                node_id=self._node_id,
                seq=seq,
                ts=ts,
                signing_public_key=pending.signing_key.public.b64,
                curve_public_key=pending.curve.public,
            )
        )

    async def _on_keys_rotated(self, answer: wire.KeysRotated) -> None:
        pending = self._pending
        keys = (answer.signing_public_key, answer.curve_public_key)
        if (
            answer.node_id != self._node_id
            or pending is None
            or keys != (pending.signing_key.public.b64, pending.curve.public)
        ):
            log.info("ignored an answer about keys this node is not rotating to")
            return
        if not answer.accepted:
            log.warning("the controller refused this node's new keys (%s); it keeps its keys", answer.detail)
            await trio.to_thread.run_sync(discard_pending_keys, self._state_dir)
            self._pending = None
            return
        async with self._send_lock:
            # On disk first: from here on a restarted agent finishes the promotion (`resume_rotation`).
            await trio.to_thread.run_sync(promote_pending_keys, self._state_dir, pending)
            await self._uplink.rekey(pending.curve, pending.signing_key, self._open_requests)
            self._pending = None
            self._keys_rotated += 1
        log.info("node keys rotated; the channel uses the new ones")
        await self._heartbeat_once()  # the first message with the new key: the controller drops the old

    async def _on_controller_keys(self, msg: wire.ControllerKeysAnnounced) -> None:
        # Only the key pinned now names its successor: never one it replaced, even in the overlap. Another
        # controller sharing the keys may repeat it (`repeat`): that only moves its own channel, if not yet.
        pinned, dial = self._uplink.controller_keys, self._uplink.dial
        repeat = bool(pinned) and msg.signing_public_key == pinned[0][0].b64
        if msg.node_id != self._node_id or (pinned and not repeat and self._uplink.verified_with != pinned[0][0]):
            log.warning("ignored controller keys not announced with the key this node pins")
            return
        record = await trio.to_thread.run_sync(pin_controller_keys, self._state_dir, msg)
        self._uplink.controller_keys = controller_keys(record)
        target = (msg.curve_public_key, msg.channel_endpoint)
        if msg.channel_endpoint and target != (dial.server_curve_public, dial.endpoint):
            if repeat and dial.server_curve_public == msg.curve_public_key:
                return  # this channel has its new Curve key already
            # The controller serves its new Curve key at its other endpoint: move there, make before break.
            async with self._send_lock:
                await self._uplink.redial(msg.curve_public_key, msg.channel_endpoint, self._open_requests)
            log.info("the controller's channel moved to %s with its new Curve key", msg.channel_endpoint)
            await self._heartbeat_once()  # on the new connection: the controller moves its route

    # --- the lease

    async def _watch_lease(self) -> NoReturn:
        # A lease is a deadline: sleep until it passes or the fence changes (renewal, new set).
        while True:
            fence, changed = self._fence, self._fence_changed
            if not fence.accepted_any or self._lease_lapsed:
                await changed.wait()
                continue
            # Wall-clock expiry mapped onto trio's clock; re-checked against the wall clock below.
            with trio.move_on_after(max(0.0, fence.lease_expires_at - time.time())):
                await changed.wait()
                continue
            if self._fence is fence and time.time() >= fence.lease_expires_at:
                self.on_lease_lapsed()

    def on_lease_lapsed(self) -> None:
        """The accepted set's lease passed without renewal: apply `on_lease_expiry`, once.

        keep_serving changes nothing but the reported state; stop has the supervisor stop every
        runtime (a renewal or a newer set brings them back).
        """
        self._lease_lapsed = True
        self._want_state()
        fence = self._fence
        if self._on_lease_expiry is LeaseExpiryPolicy.STOP:
            self._runtimes.update(fence.generation, [])
            action = "stopping"
        else:
            action = "keep serving"
        log.warning(
            "assignment lease (epoch %d, generation %d) lapsed without renewal; %s its %d assignments "
            "(on_lease_expiry = %s)",
            fence.epoch,
            fence.generation,
            action,
            len(fence.assignments),
            self._on_lease_expiry,
        )


# --- composition root ---------------------------------------------------------------------------


async def serve_node(
    cfg: NodeConfig,
    *,
    stopping: trio.Event,
    task_status: trio.TaskStatus[NodeStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the node agent until `stopping` is set.

    Supports the nursery start protocol: `started = await nursery.start(partial(serve_node, cfg,
    stopping=ev))`. Raises ConfigError before starting when the node is not enrolled, its files
    are damaged or inventory.json is invalid, or `simulation = true` without NEXA_SIMULATION_ONLY=1.
    After the start, a failing loop is logged, counted and restarted (`nexa.supervision`).
    """
    with Supervision().installed() as supervision:
        await _serve_node(cfg, supervision, stopping=stopping, task_status=task_status)


async def _serve_node(
    cfg: NodeConfig, supervision: Supervision, *, stopping: trio.Event, task_status: trio.TaskStatus[NodeStarted]
) -> None:
    """The composition root: each part from its builder, then every loop in one nursery."""
    if cfg.simulation and os.environ.get(SIMULATION_ENV) != "1":
        raise ConfigError(f"simulation = true runs simulated runtimes: it needs {SIMULATION_ENV}=1 in the environment")
    state_dir = Path(cfg.state_dir)
    identity, fence, pending = await trio.to_thread.run_sync(load_state, state_dir)
    uplink = await open_channel(cfg, identity, state_dir)  # a bad source address fails the start
    watcher = inventory(cfg)
    engine = await container_engine(cfg)
    async with (
        engine,
        await artifact_cache(cfg, state_dir) as artifacts,
        # Simulated runtimes are children of this process: they stop when it stops.
        open_process_driver(state_dir, enabled=cfg.simulation, host=cfg.runtime_host) as processes,
    ):
        where = cfg.container.socket_path
        log.info("runtimes through %s at %s; artifacts cached in %s", engine.name, where, artifacts.directory)
        if processes is not None:
            log.warning("simulation = true: sim runtimes run as local processes (never in production)")
        runtimes = runtimes_of(cfg, identity, watcher, DriverRouter(engine, processes), artifacts, state_dir=state_dir)
        # Resume what the fence on disk says: running containers that still match are adopted.
        runtimes.meter.update(fence.generation, fence.assignments)
        # Each data frame is delivered with the channel it came on (`_agent`'s `data`).
        loras = NodeLoras(runtimes.supervisor.lora_view, host=cfg.runtime_host)
        relay = NodeRelay(cfg.relay, None, runtimes.supervisor.endpoint, host=cfg.runtime_host, lora=loras.prepare)
        version = await engine_version(engine)
        agent = _agent(
            cfg,
            identity=identity,
            state=(fence, pending),
            uplink=uplink,
            watcher=watcher,
            runtimes=runtimes,
            relay=relay,
            engine_version=version,
        )
        started = NodeStarted(
            node_id=identity.node_id,
            epoch=fence.epoch,
            generation=fence.generation,
            agent=agent,
            supervision=supervision,
        )
        # While streams are relayed, the agent's wake-ups are moderated (`RelayConfig.gather_s`).
        with moderated(cfg.relay.gather_s, lambda: relay.gathering):
            await _run_loops(cfg, started, (watcher, runtimes, uplink, relay), stopping, task_status)


async def _run_loops(
    cfg: NodeConfig,
    started: NodeStarted,
    parts: tuple[InventoryWatcher, NodeRuntimes, Channel, NodeRelay],
    stopping: trio.Event,
    task_status: trio.TaskStatus[NodeStarted],
) -> None:
    """Every loop in one nursery, until `stopping` is set. Each runs supervised (nexa.supervision,
    restarted on failure); only a failed start ends the agent."""
    watcher, runtimes, uplink, relay = parts
    agent = started.agent
    async with trio.open_nursery() as nursery:
        for name, run in _loops(cfg, watcher=watcher, runtimes=runtimes, uplink=uplink, relay=relay, agent=agent):
            await nursery.start(supervised, name, run)
        log.info(
            "node %s started (accepted epoch %d, generation %d)", started.node_id, started.epoch, started.generation
        )
        task_status.started(started)
        await stopping.wait()
        log.info("node agent stopping")
        if not cfg.container.leave_running_on_exit:
            await runtimes.stop_all(agent.fence.generation)
        # The loops and the watcher stop; the uplink closes its socket as its task ends.
        # Runtime containers keep running (unless configured otherwise): the next agent adopts them.
        nursery.cancel_scope.cancel()


def _agent(
    cfg: NodeConfig,
    *,
    identity: NodeIdentity,
    state: tuple[Fence, PendingKeys | None],
    uplink: Channel,
    watcher: InventoryWatcher,
    runtimes: NodeRuntimes,
    relay: NodeRelay,
    engine_version: str,
) -> Agent:
    fence, pending = state
    return Agent(
        identity=identity,
        fence=fence,
        state_dir=Path(cfg.state_dir),
        uplink=uplink,
        inventory=watcher,
        runtimes=runtimes.meter,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        state_interval_s=cfg.state_interval_s,
        on_lease_expiry=cfg.on_lease_expiry,
        data=relay.deliver,
        container_engine=cfg.container.engine,
        container_engine_version=engine_version,
        gpu_method=cfg.container.gpu_method,
        pending_keys=pending,
        open_requests=relay.open_requests,
        cache_disk=runtimes.metrics.cache_disk,
        runtime_cache=runtimes.caches.disk,
        memory_pressure=lambda: (runtimes.meter.pressure, runtimes.meter.stops),
    )


def _loops(
    cfg: NodeConfig,
    *,
    watcher: InventoryWatcher,
    runtimes: NodeRuntimes,
    uplink: Channel,
    relay: NodeRelay,
    agent: Agent,
) -> list[tuple[str, Callable[..., Awaitable[object]]]]:
    """The node's loops by name, in their start order (the agent last: its hello goes out once all run)."""
    caches_every = cfg.cache.runtime_cache_measure_interval_s
    return [
        ("inventory", watcher.run),
        ("supervisor", runtimes.supervisor.run),
        ("uplink", uplink.run),
        ("relay", relay.run),
        ("runtime_metrics", runtimes.metrics.run),
        ("runtime_cache", partial(runtimes.caches.run, caches_every)),
        ("replica_memory", runtimes.meter.run),
        ("agent", agent.run),
    ]
