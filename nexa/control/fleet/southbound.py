"""The controller's side of the node protocol: verified node messages → fleet; signed sets → nodes.

One Link (ZeroMQ ROUTER, CurveZMQ, ZAP) carries every node's channel. Four loops share it:
receive (the link's only reader: data frames to the relay at once, a liveness beat of a node in
good standing to the fleet's in-memory clock (`Fleet.alive`: no signature, no store, no wait),
signed messages and every other liveness beat to control),
control (verify, replay-check, record, audit), liveness (a node with no good heartbeat for
`lease_s` becomes Unreachable) and renewal (re-sign each reachable node's set before its lease
lapses). Data frames go straight to `self.relay` (no store, no audit, no signature check) and
never wait behind control work: the link's pump hands them over in its own task when nothing waits
before them in its inbox (`Link.take_data`), the receive loop the others; liveness beats go the
same way (`Link.take_alive`); a node that becomes
Unreachable, is revoked or says hello again loses its open streams.

Control never blocks data: the receive loop hands signed messages (and refusals to audit) to the
control loop through a bounded channel, in arrival order (so one node's messages stay in order),
and never waits on it. When the control loop is behind, a node with `_CONTROL_PER_NODE` messages
already waiting, or any node once the channel is full, has its message refused and counted
(`control_backlog`), as the signed rate already refuses: one ROUTER reads every node, so the only
backpressure that would not stall every stream is refusal. Nothing is lost for good: a heartbeat
is superseded by the next (each carries the node's whole state), a lost ack is answered again at
the next lease renewal, and a node whose hello was lost reports an old set in its heartbeats and
is sent its set again (`_REPUSH_MIN_S`).

Liveness and state: a node's liveness beats (authenticated by the channel, `wire.LIVENESS`) keep
it reachable between its signed states, which it sends when they change and at least every
`state_interval_s`. A beat changes nothing the node reports. When one comes from a node whose state
this controller does not hold current (it just started, missed the node's last state, or the node
was Unreachable), the control loop asks the node for its state (`StateRequest`, at most every
`_STATE_REQUEST_MIN_S`); the state that answers makes it reachable as any heartbeat does.

Recovery (`control.operations.recovery`): while `recovering`, nothing is pushed (no set, no renewal, no
re-push); nodes keep what they accepted and the fleet still records what they report. A node
that reports an accepted epoch above this controller's, or equal to it before this process sent
it anything at that epoch, shows the controller runs on an older state: recovery begins there.
The epoch signed is read from its one owner (`Store.epoch`) at each push, so it moves for every
set at once when a recovery ends (`end_recovery`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

import attrs
import trio

from nexa.channel.endpoints import ServedEndpoints
from nexa.channel.links import (
    MESSAGE_HEADROOM_BYTES,
    Alive,
    CurveKeyPair,
    DataInbound,
    Inbound,
    Link,
    Refused,
    Unverified,
)
from nexa.config import ChannelConfig, NodesConfig
from nexa.contracts.wire import (
    LIVENESS,
    Ack,
    AssignmentSet,
    ControllerKeysAnnounced,
    DataFrame,
    Heartbeat,
    Hello,
    KeysRotated,
    NodeMessage,
    RotateKeys,
    RotateKeysRequest,
    StateRequest,
)
from nexa.control.datapath.relay import Relay
from nexa.control.fleet.claims import EpochClaims
from nexa.control.fleet.keyring import ControllerKeys
from nexa.control.fleet.nodes import Fleet, NodeLive
from nexa.errors import (
    Conflict,
    ContractError,
    NexaError,
    NodeNeedsReenrollment,
    NotConnected,
)
from nexa.ratelimit import RateLimiter
from nexa.security import PublicKey, SigningKey
from nexa.supervision import supervised
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: A node that reports an older set than desired is sent it again at most this often. Heartbeats
#: sent before the node received the last push still report the old set, so re-pushing on each
#: of them would multiply the work exactly when the controller is behind.
_REPUSH_MIN_S: Final = 5.0
#: The same refusal from the same node is audited at most this often (always counted).
_REFUSAL_AUDIT_EVERY_S: Final = 5.0
#: Messages each way the link holds between its socket and our loops (chunks of many streams
#: share it; each is at most the relay's max_chunk_bytes).
_LINK_QUEUE: Final = 512
#: Signed messages (and refusals to audit) waiting for the control loop, all nodes together: room
#: for eight of each of a thousand nodes (1,000 enrolling at once with 1024 refused 16 % of their
#: first heartbeats in perf/southbound_fanin.py; with 8192, none).
_CONTROL_QUEUE: Final = 8192
#: At most this many of them from one node: a node cannot crowd the others out of the queue.
_CONTROL_PER_NODE: Final = 8
#: The reason counted for a signed message refused because the control loop is that far behind.
CONTROL_BACKLOG: Final = "control_backlog"
#: The reason counted for a message that does not fit the wire contract, whatever broke it.
MALFORMED: Final = "malformed"
#: `Fleet.count_channel` of a node whose channel connection closed.
DISCONNECTED: Final = "disconnected"
#: The reason counted for an acknowledgement of a set this controller never sent.
STALE_ACK: Final = "stale_ack"
#: A node is asked for its state (`StateRequest`) at most this often.
_STATE_REQUEST_MIN_S: Final = 1.0


class Southbound:
    def __init__(
        self,
        channel: ChannelConfig,
        cfg: NodesConfig,
        fleet: Fleet,
        metrics: Metrics,
        *,
        curve: CurveKeyPair,
        signing_key: SigningKey,
        epoch: Callable[[], int],
        stream_window_chunks: int = 32,
        retired_key_ids: Iterable[str] = (),
        keys: ControllerKeys | None = None,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        #: Whether this controller leads now (`Leadership.is_leader`). A follower hears every node
        #: (its gateway routes by their heartbeats) and relays inference, but signs and sends no
        #: set and no lease renewal, and no node's epoch makes it begin recovery: the leader's
        #: sets outrank whatever it last held.
        self._leading = leading
        self._cfg = cfg
        self._fleet = fleet
        self._metrics = metrics
        #: The epoch to sign with, read at each use: its owner (the store) moves it once a recovery ends.
        self._epoch = epoch
        #: Reconciliation only: while True nothing is pushed (`begin_recovery`, `end_recovery`).
        self.recovering = False
        #: Why recovery began ("" when it did not).
        self.recovery_reason = ""
        self._recovery_listeners: list[Callable[[], None]] = []
        # Nodes sent a set at the current epoch by this process (a node reporting that epoch
        # without being one of them accepted it from another controller on the same epoch).
        self._pushed: set[str] = set()
        self._key_id = signing_key.public.fingerprint
        self._signing_public = signing_key.public
        # What nodes say they accepted counts only within what was issued or signed (`control.fleet.claims`).
        self._claims = EpochClaims(issued=epoch, keys=self._verifying_keys)
        # The controller keys rotated away from: a node that pins only one of them (and can no
        # longer be told its successor) needs re-enrollment (`_pins_only_retired`).
        self._retired = frozenset(retired_key_ids)
        # While nodes may still pin only the previous key: what tells them the new one, and that key.
        self._announcement: tuple[ControllerKeysAnnounced, SigningKey] | None = None
        # The controller's keys: which Curve key each of the channel's two endpoints serves.
        self._keys = keys
        slot = keys.slot if keys is not None else 0
        self._link = Link(
            channel.endpoint(slot)[0],
            curve=curve,
            signing_key=signing_key,
            authorize=self._authorize,
            node_key=fleet.node_key,
            previous_key=fleet.previous_node_key,
            inbox_size=_LINK_QUEUE,
            outbox_size=_LINK_QUEUE,
            max_message_bytes=int(channel.max_chunk_bytes) + MESSAGE_HEADROOM_BYTES,
            receive_hwm=channel.receive_hwm,
            signed_rate=RateLimiter(channel.signed_messages_per_s, channel.signed_messages_burst),
            retired_dial=self._retired_dial,
            on_disconnect=self._disconnected,
            gather=self._gather,
        )
        self._gather_windows = (float(channel.gather_s), float(channel.idle_gather_s))
        # Data frames go to the relay, and liveness beats to the fleet, from the link's pump, with
        # no task switch (`Link.take_data`, `Link.take_alive`).
        self._link.take_data(self._deliver_data)
        self._link.take_alive(self._on_alive)
        # The channel's two endpoints (`ChannelConfig.endpoint`) and their rotation's mechanics.
        self._endpoints = ServedEndpoints(self._link, channel.endpoint, slot=slot)
        fleet.limit_writes(RateLimiter(channel.node_store_writes_per_s, channel.node_store_writes_burst))
        #: The inference data path over the same channels (the gateway opens streams on it).
        self.relay = Relay(self._link, window=stream_window_chunks, max_chunk_bytes=int(channel.max_chunk_bytes))
        fleet.on_change(self._end_streams_of_lost_nodes)
        fleet.on_rotation_request(self._ask_rotation)
        self._last_refusal_audit: dict[tuple[str, str], float] = {}
        # ZAP runs inside the link; refusals there are audited from this loop's nursery.
        # (Curve key, dialled a retired Curve key of the controller's)
        self._zap_refusals_tx, self._zap_refusals_rx = trio.open_memory_channel[tuple[str, bool]](64)
        # Receive loop → control loop (module docstring); with how many of each node's wait there.
        self._control_tx, self._control_rx = trio.open_memory_channel[Unverified | Alive | Refused](_CONTROL_QUEUE)
        self._control_waiting: dict[str, int] = {}
        self._liveness_counted = metrics.node_messages.labels(LIVENESS)

    def _gather(self) -> float:
        # The link's wake-up moderation (`ChannelConfig.gather_s`): short while requests are
        # relayed, long while the channel carries only the fleet's beats and states.
        busy, idle = self._gather_windows
        return busy if self.relay.relaying else idle

    def _authorize(self, curve_public_z85: str) -> str | None:
        node_id = self._fleet.authorize_curve(curve_public_z85)
        if node_id is None:
            self._metrics.node_messages_rejected.labels("unknown_key").inc()
            # Counted above; the audit trail takes what it can without ever blocking ZAP.
            with contextlib.suppress(trio.WouldBlock):
                self._zap_refusals_tx.send_nowait((curve_public_z85, False))
        return node_id

    def _disconnected(self, node_id: str) -> None:
        self._metrics.channel_disconnects.inc()
        self._fleet.count_channel(node_id, DISCONNECTED)

    def _retired_dial(self, curve_public_z85: str) -> None:
        # A node dialled with a Curve key the controller switched away from: it was offline through
        # the whole overlap. Refused by ZAP; marked (and counted) from the audit loop.
        with contextlib.suppress(trio.WouldBlock):
            self._zap_refusals_tx.send_nowait((curve_public_z85, True))

    async def _mark_retired_dial(self, curve_key: str) -> None:
        node_id, keys = self._fleet.authorize_curve(curve_key), self._keys
        if keys is None or keys.retired_curve is None:
            return
        served = keys.retired_curve.public
        key_id = next((r.key_id for r in keys.retired if r.curve_public_key == served), "?")
        self._count_refusal(NodeNeedsReenrollment(node_id=node_id or "", key_id=key_id), node_id or "")
        if node_id is not None:
            await self._fleet.needs_reenrollment(self._fleet.get(node_id), key_id)

    async def _audit_zap_refusals(self) -> None:
        async for curve_key, retired_dial in self._zap_refusals_rx:
            if retired_dial:
                await self._mark_retired_dial(curve_key)
                continue
            revoked = self._fleet.revoked_node_with_curve(curve_key)
            retired = None if revoked else self._fleet.retired_node_with_curve(curve_key)
            reason = (
                "revoked node" if revoked else "a key the node rotated away from" if retired else "unknown node key"
            )
            await self._refuse_audit(revoked or retired or "", "unknown_key", f"channel refused: {reason}")

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind the node channel and serve it; `started` reports the endpoint nodes should dial."""
        async with trio.open_nursery() as nursery:
            self._endpoints.started(await nursery.start(supervised, "southbound.link", self._link.run))
            keys = self._keys
            if keys is not None and (other := keys.next_curve or keys.retired_curve) is not None:
                await self._endpoints.serve_other(other, admit=other is keys.next_curve)
            endpoint = self._endpoints.advertised(keys.newest_slot if keys is not None else self._endpoints.slot)
            self._fleet.channel_endpoint = endpoint
            nursery.start_soon(supervised, "southbound.receive", self._receive_loop)
            nursery.start_soon(supervised, "southbound.control", self._control_loop)
            nursery.start_soon(supervised, "southbound.liveness", self._liveness_loop)
            nursery.start_soon(supervised, "southbound.renewal", self._renewal_loop)
            nursery.start_soon(supervised, "southbound.zap_audit", self._audit_zap_refusals)
            nursery.start_soon(supervised, "southbound.expiry", self.relay.expire)
            task_status.started(endpoint)

    async def switch_curve(self, keys: ControllerKeys) -> None:
        """A rotation's overlap ended (`KeyRotation`): its Curve key is the current one, and the old
        one's endpoint (closed, with its connections) refuses every node that dials it from now on."""
        self._keys = keys
        await self._endpoints.switch(keys.slot, keys.retired_curve)
        self._fleet.channel_endpoint = self._endpoints.advertised(keys.slot)

    async def serve_next_curve(self, curve: CurveKeyPair) -> None:
        """Serve a rotation's new Curve key on the other endpoint before any key file is written
        (`KeyRotation`), so that a port that cannot be bound refuses the rotation with the keys
        unchanged (RotationEndpointInUse); `announce_keys` then tells the nodes to redial there."""
        await self._endpoints.serve_next(curve)

    def _end_streams_of_lost_nodes(self) -> None:
        # Fleet listener (sync): unreachable or revoked nodes will send no more output.
        for node_id in self.relay.nodes():
            try:
                reachable = self._fleet.get(node_id).reachable
            except NexaError:
                reachable = False
            if not reachable:
                self.relay.node_lost(node_id)

    def _deliver_data(self, node_id: str, frame: DataFrame) -> None:
        # Hot path: a refused frame is only counted. Never blocks or raises (`Relay.deliver`).
        refused = self.relay.deliver(node_id, frame)
        if refused is not None:
            self._metrics.node_messages_rejected.labels(refused).inc()

    async def _receive_loop(self) -> None:
        # The link's only reader. Nothing here waits but the link: no store, no audit, no signature.
        while True:
            got = await self._link.receive_unverified()
            if isinstance(got, DataInbound):
                self._deliver_data(got.node_id, got.frame)
                continue
            if isinstance(got, Alive):
                self._on_alive(got)
                continue
            if isinstance(got, Refused):
                self._count_refusal(got.error, got.node_id)  # at once; the audit (rate-limited) is the control loop's
            if not self._to_control(got) and isinstance(got, Unverified):
                # (A refusal is counted already; only its audit is skipped.)
                self._metrics.node_messages_rejected.labels(CONTROL_BACKLOG).inc()

    def _on_alive(self, got: Alive) -> None:
        # Hot path too (the pump's task, or the receive loop's): a node in good standing only moves
        # its clock, in memory; the control loop sees the rest. Never blocks or raises.
        self._liveness_counted.inc()
        if (self._fleet.alive(got.node_id, got.state_seq) or got.moved) and not self._to_control(got):
            self._metrics.node_messages_rejected.labels(CONTROL_BACKLOG).inc()

    def _to_control(self, got: Unverified | Alive | Refused) -> bool:
        """Queue for the control loop without waiting; False if the node's share or the queue is full."""
        waiting = self._control_waiting.get(got.node_id, 0)
        if waiting >= _CONTROL_PER_NODE:
            return False
        try:
            self._control_tx.send_nowait(got)
        except trio.WouldBlock:
            return False
        self._control_waiting[got.node_id] = waiting + 1
        return True

    async def _control_loop(self) -> None:
        async for got in self._control_rx:
            waiting = self._control_waiting.pop(got.node_id, 1) - 1
            if waiting > 0:
                self._control_waiting[got.node_id] = waiting
            await self._control(got)

    async def _control(self, got: Unverified | Alive | Refused) -> None:
        if isinstance(got, Refused):
            await self._refuse_audit(got.node_id, self._refusal_code(got.error), got.error.message)
            return
        if isinstance(got, Alive):
            await self._alive(got)
            return
        # Verified and handled in one step up to `_handle`'s first await (a hello's node_lost).
        checked = self._link.verify(got)
        try:
            if isinstance(checked, Refused):
                await self._refuse(checked.node_id, checked.error)
            else:
                await self._handle(checked)
        except NexaError as exc:
            await self._refuse(checked.node_id, exc)
        except Exception as exc:
            # Last resort: no value from a node may end the controller. Counted and logged
            # (type only, never the message's content); the loop goes on with the next one.
            self._metrics.node_messages_rejected.labels(MALFORMED).inc()
            log.warning("refused a message from node %s: %s", checked.node_id, type(exc).__name__)

    async def _handle(self, inbound: Inbound) -> None:
        msg = inbound.message
        self._fleet.check_replay(inbound.node_id, msg.seq, msg.ts)  # raises Replayed / ClockSkew
        self._metrics.node_messages.labels(msg.kind).inc()
        if await self._needs_reenrollment(inbound.node_id, msg):
            return
        if isinstance(msg, Hello):
            # A new agent process: whatever it was relaying before is gone with the old one. Before
            # any await, so no stream opened on the new channel can be ended by mistake.
            self.relay.node_lost(inbound.node_id)
        if isinstance(msg, Hello | Heartbeat) and self._leading():
            msg = await self._judged(inbound.node_id, msg)
        live = await self._fleet.heard(inbound.node_id, msg)
        # A push on a node's new connection tells it its old one can close (it redialled).
        moved = inbound.moved and not isinstance(msg, Hello)
        if live.previous_keys is not None and not inbound.previous_key and not isinstance(msg, RotateKeys):
            # The first message signed with its new key: the old keys are refused from now on.
            await self._fleet.keys_in_use(live)
            moved = not isinstance(msg, Hello)
        if moved:
            await self._push(live)
        if isinstance(msg, Hello | Heartbeat):
            self._check_fence(live.node.id, msg.epoch)
        if isinstance(msg, Hello) and msg.controller_key_id != self._key_id:
            await self._announce_to(live.node.id)  # the controller's new keys first, if it rotated them
            await self._push(live)  # a (re)connected node gets its set at once
        elif isinstance(msg, Heartbeat):
            behind = (msg.epoch, msg.generation) < (self._epoch(), live.desired.generation)
            if behind and trio.current_time() - live.last_push >= _REPUSH_MIN_S:
                await self._push(live)
        elif isinstance(msg, Ack):
            if msg.epoch != self._epoch() or msg.generation > live.desired.generation:
                # Not an answer to a set this controller sent: nothing to record (and no write).
                self._metrics.node_messages_rejected.labels(STALE_ACK).inc()
                return
            await self._fleet.record_ack(live, msg)
        elif isinstance(msg, RotateKeys):
            await self._rotate_keys(live, msg, by_previous=inbound.previous_key)

    async def _alive(self, got: Alive) -> None:
        """A liveness beat the receive loop could not settle (`Fleet.alive`). It changes nothing the
        node reports: it makes the node reachable again only if its state is current, and asks for
        the state when this controller does not hold it current or missed the one the beat names."""
        try:
            live = self._fleet.get(got.node_id)
        except NexaError:
            return
        if live.reenroll_key_id:
            self._count_refusal(NodeNeedsReenrollment(node_id=got.node_id, key_id=live.reenroll_key_id), got.node_id)
            return
        if got.moved:
            await self._push(live)  # as for a signed message on a new connection: the old one may close
        if not live.reachable:
            await self._fleet.alive_again(live)
        now = trio.current_time()
        wanted = got.state_seq > live.state_seq or not self._fleet.state_current(live, now) or not live.reachable
        if wanted and now - live.state_asked >= _STATE_REQUEST_MIN_S:
            live.state_asked = now
            with contextlib.suppress(NotConnected):
                await self._link.send(live.node.id, StateRequest(node_id=live.node.id))

    async def _judged(self, node_id: str, msg: Hello | Heartbeat) -> Hello | Heartbeat:
        """`msg` with the (epoch, generation) that counts (`EpochClaims`); a refused claim is
        counted, audited and shown on the node, and the rest of the message is taken as usual."""
        (epoch, generation), refusal = self._claims.judge(node_id, msg)
        if refusal is None:
            return msg
        await self._refuse(node_id, refusal)
        return attrs.evolve(msg, epoch=epoch, generation=generation, proof_set="", proof_signature="")

    def _verifying_keys(self) -> dict[str, PublicKey]:
        """The controller's signing keys, current and retired: what a node's accepted set may be signed with."""
        if self._keys is not None:
            return self._keys.verifying_keys()
        return {self._key_id: self._signing_public}

    async def _needs_reenrollment(self, node_id: str, msg: NodeMessage) -> bool:
        """Refuse (counted; audited once, when the fleet marks it) every message of a node that
        pins only a retired controller key: it is never recorded, never sent a set or traffic."""
        live = self._fleet.get(node_id)
        pinned = msg.controller_key_id if isinstance(msg, Hello | Heartbeat) else ""
        if not live.reenroll_key_id and self._pins_only_retired(pinned):
            await self._fleet.needs_reenrollment(live, pinned)
        if not live.reenroll_key_id:
            return False
        self._count_refusal(NodeNeedsReenrollment(node_id=node_id, key_id=live.reenroll_key_id), node_id)
        return True

    def _pins_only_retired(self, key_id: str) -> bool:
        """Whether a node that pins `key_id` as current can no longer follow the controller's keys:
        a retired key, and not the one an announcement still within its overlap is signed with.
        ("" — an agent that does not say — is never taken for one.)"""
        if not key_id or key_id == self._key_id or key_id not in self._retired:
            return False
        announced = self._announcement
        return announced is None or announced[0].previous_key_id != key_id or time.time() >= announced[0].overlap_until

    async def _rotate_keys(self, live: NodeLive, msg: RotateKeys, *, by_previous: bool) -> None:
        """Swap the node's keys (fleet: store, ZAP, audit) and answer; a refusal is answered too."""
        answer = KeysRotated(
            node_id=live.node.id, signing_public_key=msg.signing_public_key, curve_public_key=msg.curve_public_key
        )
        try:
            await self._fleet.rotate_keys(live.node.id, msg, by_previous=by_previous)
        except (ContractError, Conflict) as exc:
            answer = attrs.evolve(answer, accepted=False, detail=exc.message[:300])
            await self._refuse(live.node.id, exc)
        with contextlib.suppress(NotConnected):  # it asks again (the same keys) until answered
            await self._link.send(live.node.id, answer)

    async def announce_keys(
        self, keys: ControllerKeys, previous: SigningKey, overlap_until: float, *, now: bool = True
    ) -> int:
        """`nexa keys rotate-controller`: tell each connected node (`now`; else only those that say
        hello from here on) the controller's new keys, in a message signed with `previous`, the key
        they pin, then sign everything after it with the new key. Until `overlap_until`, every node
        that says hello is told again first. The new Curve key is served on the other endpoint
        already (`serve_next_curve`, or `run` at a restart): the one nodes are told to redial. The
        number of nodes told now."""
        slot = self._endpoints.slot
        newest = slot if keys.next_curve is None else slot ^ 1
        self._keys = keys
        if self._endpoints.bound(newest):  # else (a restart) `run` sets it
            self._fleet.channel_endpoint = self._endpoints.advertised(newest)
        template = ControllerKeysAnnounced(
            node_id="",
            key_id=keys.key_id,
            signing_public_key=keys.signing.public.b64,
            curve_public_key=keys.next_curve_public or keys.curve.public,
            previous_key_id=previous.public.fingerprint,
            overlap_until=overlap_until,
        )
        self._announcement = (template, previous)
        told = 0
        for live in list(self._fleet) if now else []:
            told += await self._announce_to(live.node.id)
        # Queued before anything signed with the new key, so each node reads them in that order.
        self._link.use_signing_key(keys.signing)
        self._key_id = keys.key_id
        self._retired = frozenset(r.key_id for r in keys.retired)
        return told

    async def _announce_to(self, node_id: str) -> int:
        if self._announcement is None or time.time() >= self._announcement[0].overlap_until:
            return 0
        template, previous = self._announcement
        try:
            told = attrs.evolve(template, node_id=node_id, channel_endpoint=self._fleet.channel_endpoint)
            await self._link.send(node_id, told, key=previous)
        except NotConnected:
            return 0  # told when it next says hello
        return 1

    async def _ask_rotation(self, node_id: str) -> None:
        """`nexa nodes rotate`: ask the node over its channel (NotConnected without a route)."""
        await self._link.send(node_id, RotateKeysRequest(node_id=node_id))

    def _check_fence(self, node_id: str, accepted_epoch: int) -> None:
        """Begin recovery when a node accepted a set this controller's state cannot have signed."""
        epoch = self._epoch()
        if not self._leading() or self.recovering or accepted_epoch < epoch:
            return
        if accepted_epoch == epoch and node_id in self._pushed:
            return
        self.begin_recovery(
            f"node {node_id} accepted epoch {accepted_epoch}, not below this controller's epoch {epoch}: "
            "the controller runs on an older state"
        )

    # ---- recovery ------------------------------------------------------------------------------------

    def on_recovery(self, listener: Callable[[], None]) -> None:
        """Call `listener` (sync, must not block) when recovery begins."""
        self._recovery_listeners.append(listener)

    def begin_recovery(self, reason: str) -> None:
        """Push nothing from now on, until `end_recovery`."""
        if self.recovering:
            return
        self.recovering = True
        self.recovery_reason = reason
        log.warning("recovery: pushing nothing to nodes until it ends: %s", reason)
        for listener in self._recovery_listeners:
            listener()

    async def end_recovery(self) -> int:
        """Resume pushing (the store has taken the new epoch): every reachable node gets its set
        now, signed with the new epoch; the others when they next say hello. The number pushed."""
        self.recovering = False
        self.recovery_reason = ""
        return await self.lead()

    async def lead(self) -> int:
        """This controller has just taken the lead (at a new epoch): every reachable node gets its
        set now, signed at that epoch, rather than at its next renewal. The number pushed."""
        self._pushed.clear()  # nothing is signed at the new epoch yet
        pushed = 0
        for live in list(self._fleet):
            if live.reachable:
                await self._push(live)
                pushed += 1
        return pushed

    async def _refuse(self, node_id: str, error: NexaError) -> None:
        await self._refuse_audit(node_id, self._count_refusal(error, node_id), error.message)

    @staticmethod
    def _refusal_code(error: NexaError) -> str:
        return MALFORMED if isinstance(error, ContractError) else error.code

    def _count_refusal(self, error: NexaError, node_id: str = "") -> str:
        code = self._refusal_code(error)
        self._metrics.node_messages_rejected.labels(code).inc()
        self._fleet.count_channel(node_id, code)
        return code

    async def _refuse_audit(self, node_id: str, code: str, detail: str) -> None:
        key = (node_id, code)
        now = trio.current_time()
        if now - self._last_refusal_audit.get(key, float("-inf")) < _REFUSAL_AUDIT_EVERY_S:
            return
        self._last_refusal_audit[key] = now
        await self._fleet.record_refusal(node_id, code, detail)

    async def push_now(self, node_id: str) -> None:
        """Send a node its desired set now (after it changed); a node not connected gets it at its next hello."""
        live = self._fleet.get(node_id)
        if live.reachable:
            await self._push(live)

    async def _push(self, live: NodeLive) -> None:
        if self.recovering or live.reenroll_key_id or not self._leading():
            # Reconciliation only: nodes keep what they accepted; or it cannot verify a set; or a
            # follower, which never signs sets (the leader sends them and renews their leases).
            return
        desired = live.desired
        epoch = self._epoch()
        self._pushed.add(live.node.id)  # before the send: its answer may come before `send` returns
        signed = AssignmentSet(
            node_id=live.node.id,
            epoch=epoch,
            generation=desired.generation,
            lease_expires_at=time.time() + self._cfg.assignment_lease_s,
            assignments=list(desired.assignments),
            key_id=self._key_id,
        )
        try:
            await self._link.send(live.node.id, signed)
        except NotConnected:
            return  # it gets the set when it next says hello
        live.last_push = trio.current_time()
        self._metrics.assignment_pushes.inc()

    async def _liveness_loop(self) -> None:
        while True:
            lapsed, next_deadline = self._fleet.overdue(trio.current_time())
            for live in lapsed:
                await self._fleet.mark_unreachable(live)
                self.relay.node_lost(live.node.id)  # also done by the fleet listener; idempotent
            await trio.sleep_until(next_deadline)

    async def _renewal_loop(self) -> None:
        period = self._cfg.assignment_lease_s / 3
        while True:
            await trio.sleep(period)
            for live in list(self._fleet):
                if live.reachable and trio.current_time() - live.last_push >= period / 2:
                    await self._push(live)
