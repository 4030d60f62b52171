"""The controller's side of the node protocol: verified node messages → fleet; signed sets → nodes.

One Link (ZeroMQ ROUTER, CurveZMQ, ZAP) carries every node's channel. Four loops share it:
receive (the link's only reader: data frames to the relay at once, signed messages to control),
control (verify, replay-check, record, audit), liveness (a node with no good heartbeat for
`lease_s` becomes Unreachable) and renewal (re-sign each reachable node's set before its lease
lapses). Data frames go straight to `self.relay` (no store, no audit, no signature check) and
never wait behind control work; a node that becomes Unreachable, is revoked or says hello again
loses its open streams.

Control never blocks data: the receive loop hands signed messages (and refusals to audit) to the
control loop through a bounded channel, in arrival order (so one node's messages stay in order),
and never waits on it. When the control loop is behind, a node with `_CONTROL_PER_NODE` messages
already waiting, or any node once the channel is full, has its message refused and counted
(`control_backlog`), as the signed rate already refuses: one ROUTER reads every node, so the only
backpressure that would not stall every stream is refusal. Nothing is lost for good: a heartbeat
is superseded by the next (each carries the node's whole state), a lost ack is answered again at
the next lease renewal, and a node whose hello was lost reports an old set in its heartbeats and
is sent its set again (`_REPUSH_MIN_S`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Final

import trio

from nexa.config import ChannelConfig, NodesConfig
from nexa.contracts.wire import Ack, AssignmentSet, Heartbeat, Hello
from nexa.control.fleet import Fleet, NodeLive
from nexa.control.relay import Relay
from nexa.errors import ContractError, NexaError, NotConnected
from nexa.messaging import (
    MESSAGE_HEADROOM_BYTES,
    CurveKeyPair,
    DataInbound,
    Inbound,
    Link,
    RateLimiter,
    Refused,
    Unverified,
)
from nexa.security import SigningKey
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
#: The reason counted for an acknowledgement of a set this controller never sent.
STALE_ACK: Final = "stale_ack"


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
        epoch: int,
        stream_window_chunks: int = 32,
    ) -> None:
        self._channel = channel
        self._cfg = cfg
        self._fleet = fleet
        self._metrics = metrics
        self._epoch = epoch
        self._link = Link(
            channel.listen,
            curve=curve,
            signing_key=signing_key,
            authorize=self._authorize,
            node_key=fleet.node_key,
            inbox_size=_LINK_QUEUE,
            outbox_size=_LINK_QUEUE,
            max_message_bytes=int(channel.max_chunk_bytes) + MESSAGE_HEADROOM_BYTES,
            receive_hwm=channel.receive_hwm,
            signed_rate=RateLimiter(channel.signed_messages_per_s, channel.signed_messages_burst),
        )
        fleet.limit_writes(RateLimiter(channel.node_store_writes_per_s, channel.node_store_writes_burst))
        #: The inference data path over the same channels (the gateway opens streams on it).
        self.relay = Relay(self._link, window=stream_window_chunks, max_chunk_bytes=int(channel.max_chunk_bytes))
        fleet.on_change(self._end_streams_of_lost_nodes)
        self._last_refusal_audit: dict[tuple[str, str], float] = {}
        # ZAP runs inside the link; refusals there are audited from this loop's nursery.
        self._zap_refusals_tx, self._zap_refusals_rx = trio.open_memory_channel[str](64)
        # Receive loop → control loop (module docstring); with how many of each node's wait there.
        self._control_tx, self._control_rx = trio.open_memory_channel[Unverified | Refused](_CONTROL_QUEUE)
        self._control_waiting: dict[str, int] = {}

    def _authorize(self, curve_public_z85: str) -> str | None:
        node_id = self._fleet.authorize_curve(curve_public_z85)
        if node_id is None:
            self._metrics.node_messages_rejected.labels("unknown_key").inc()
            # Counted above; the audit trail takes what it can without ever blocking ZAP.
            with contextlib.suppress(trio.WouldBlock):
                self._zap_refusals_tx.send_nowait(curve_public_z85)
        return node_id

    async def _audit_zap_refusals(self) -> None:
        async for curve_key in self._zap_refusals_rx:
            revoked = self._fleet.revoked_node_with_curve(curve_key)
            reason = "revoked node" if revoked else "unknown node key"
            await self._refuse_audit(revoked or "", "unknown_key", f"channel refused: {reason}")

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind the node channel and serve it; `started` reports the endpoint nodes should dial."""
        async with trio.open_nursery() as nursery:
            bound: str = await nursery.start(supervised, "southbound.link", self._link.run)
            endpoint = self._channel.advertise or bound
            self._fleet.channel_endpoint = endpoint
            nursery.start_soon(supervised, "southbound.receive", self._receive_loop)
            nursery.start_soon(supervised, "southbound.control", self._control_loop)
            nursery.start_soon(supervised, "southbound.liveness", self._liveness_loop)
            nursery.start_soon(supervised, "southbound.renewal", self._renewal_loop)
            nursery.start_soon(supervised, "southbound.zap_audit", self._audit_zap_refusals)
            task_status.started(endpoint)

    def _end_streams_of_lost_nodes(self) -> None:
        # Fleet listener (sync): unreachable or revoked nodes will send no more output.
        for node_id in self.relay.nodes():
            try:
                reachable = self._fleet.get(node_id).reachable
            except NexaError:
                reachable = False
            if not reachable:
                self.relay.node_lost(node_id)

    async def _receive_loop(self) -> None:
        # The link's only reader. Nothing here waits but the link: no store, no audit, no signature.
        while True:
            got = await self._link.receive_unverified()
            if isinstance(got, DataInbound):
                # Hot path: a refused frame is only counted.
                refused = self.relay.deliver(got.node_id, got.frame)
                if refused is not None:
                    self._metrics.node_messages_rejected.labels(refused).inc()
                continue
            if isinstance(got, Refused):
                self._count_refusal(got.error)  # at once; the audit (rate-limited) is the control loop's
            if not self._to_control(got) and isinstance(got, Unverified):
                # (A refusal is counted already; only its audit is skipped.)
                self._metrics.node_messages_rejected.labels(CONTROL_BACKLOG).inc()

    def _to_control(self, got: Unverified | Refused) -> bool:
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

    async def _control(self, got: Unverified | Refused) -> None:
        if isinstance(got, Refused):
            await self._refuse_audit(got.node_id, self._refusal_code(got.error), got.error.message)
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
        if isinstance(msg, Hello):
            # A new agent process: whatever it was relaying before is gone with the old one. Before
            # any await, so no stream opened on the new channel can be ended by mistake.
            self.relay.node_lost(inbound.node_id)
        live = await self._fleet.heard(inbound.node_id, msg)
        if isinstance(msg, Hello):
            await self._push(live)  # a (re)connected node gets its set at once
        elif isinstance(msg, Heartbeat):
            behind = (msg.epoch, msg.generation) < (self._epoch, live.desired.generation)
            if behind and trio.current_time() - live.last_push >= _REPUSH_MIN_S:
                await self._push(live)
        elif isinstance(msg, Ack):
            if msg.epoch != self._epoch or msg.generation > live.desired.generation:
                # Not an answer to a set this controller sent: nothing to record (and no write).
                self._metrics.node_messages_rejected.labels(STALE_ACK).inc()
                return
            await self._fleet.record_ack(live, msg)

    async def _refuse(self, node_id: str, error: NexaError) -> None:
        await self._refuse_audit(node_id, self._count_refusal(error), error.message)

    @staticmethod
    def _refusal_code(error: NexaError) -> str:
        return MALFORMED if isinstance(error, ContractError) else error.code

    def _count_refusal(self, error: NexaError) -> str:
        code = self._refusal_code(error)
        self._metrics.node_messages_rejected.labels(code).inc()
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
        desired = live.desired
        signed = AssignmentSet(
            node_id=live.node.id,
            epoch=self._epoch,
            generation=desired.generation,
            lease_expires_at=time.time() + self._cfg.assignment_lease_s,
            assignments=list(desired.assignments),
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
