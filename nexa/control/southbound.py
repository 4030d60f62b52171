"""The controller's side of the node protocol: verified node messages → fleet; signed sets → nodes.

One Link (ZeroMQ ROUTER, CurveZMQ, ZAP) carries every node's channel. Three loops share it:
receive (verify, replay-check, record), liveness (a node with no good heartbeat for `lease_s`
becomes Unreachable) and renewal (re-sign each reachable node's set before its lease lapses).
The same channels carry inference: data frames go straight to `self.relay` (no store, no audit),
and a node that becomes Unreachable, is revoked or says hello again loses its open streams.
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
from nexa.messaging import MESSAGE_HEADROOM_BYTES, CurveKeyPair, DataInbound, Inbound, Link, RateLimiter, Refused
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
        while True:
            got = await self._link.receive_any()
            if isinstance(got, DataInbound):
                # Hot path: never blocks, never audits; a refused frame is only counted.
                refused = self.relay.deliver(got.node_id, got.frame)
                if refused is not None:
                    self._metrics.node_messages_rejected.labels(refused).inc()
                continue
            try:
                if isinstance(got, Refused):
                    await self._refuse(got.node_id, got.error)
                else:
                    await self._handle(got)
            except NexaError as exc:
                await self._refuse(got.node_id, exc)
            except Exception as exc:
                # Last resort: no value from a node may end the controller. Counted and logged
                # (type only, never the message's content); the loop goes on with the next one.
                self._metrics.node_messages_rejected.labels(MALFORMED).inc()
                log.warning("refused a message from node %s: %s", got.node_id, type(exc).__name__)

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
        code = MALFORMED if isinstance(error, ContractError) else error.code
        self._metrics.node_messages_rejected.labels(code).inc()
        await self._refuse_audit(node_id, code, error.message)

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
