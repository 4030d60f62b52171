"""The node's channels to several controllers (`NodeConfig.controllers`): one `NodeChannel` each.

Several `nexa control` processes on one store share the controller's signing and Curve keys; the
node keeps a channel (one CurveZMQ connection, its own keys, the same pinned controller keys) to
every one of them, and shows them to the agent and the relay as one channel (`NodeChannel`'s
interface), so that nothing in the agent's protocol changes:

* hello, heartbeats (the node's signed state) and liveness beats go on every channel; a beat of
  either kind is not queued on a channel whose previous one has not left (no connection there: it
  would only deliver stale beats in a burst later);
* every other signed message (an ack, a key rotation) goes to the controller whose message was
  verified last: the agent's control loop handles one message at a time, so an ack answers the set
  it acknowledges on the channel that set came on;
* signed messages from every channel reach the agent's one fence: a set from a lower epoch than
  one already accepted is refused whichever channel brings it (a deposed leader's);
* a data-path request (`infer`) is answered (`chunk`, `end`) on the channel it came on and never
  on another; `credit` and `cancel` count only from that channel. Each data frame leaves here as
  `Routed`, with its channel; the node relay keeps that channel with the request (its one table,
  `nexa.node.relay`), so nothing here is keyed by request.

One controller never holds up another: each channel runs and reconnects (the usual backoff) under
its own supervision, and with more than one channel signed messages are queued without waiting
(a full outbox drops it for that channel, counted). With no list the agent keeps its single
`NodeChannel` to the enrolled endpoint, exactly as before.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NoReturn

import attrs
import trio

from nexa.channel.endpoints import Dial, NodeChannel, OpenRequests, Routed, UplinkFactory
from nexa.channel.links import CurveKeyPair, Unverified, Uplink
from nexa.channel.pump import PumpStatistics
from nexa.config import NodeConfig
from nexa.contracts import wire
from nexa.errors import ChannelClosed, ConfigError, ContractError
from nexa.node.identity import ChannelTarget, NodeIdentity, load_channel_targets, save_channel_targets
from nexa.security import PublicKey, SigningKey
from nexa.supervision import supervised

log = logging.getLogger(__name__)

#: First wait before re-dialling the controller; zmq doubles it up to `reconnect_max_s`.
RECONNECT_FIRST_S: Final = 0.1
#: Messages from all the channels waiting for the agent's receive loop (each channel's own inbox
#: is behind it: a full one stops reading that connection, and zmq pushes back on that controller).
_INBOX: Final = 64


def channel_endpoint(endpoint: str, source_address: str) -> str:
    """The endpoint to dial: with a source address, zmq's `tcp://SRC:0;HOST:PORT` form."""
    if not source_address:
        return endpoint
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        raise ConfigError("source_address needs a tcp:// channel endpoint")
    try:
        source = ipaddress.ip_address(source_address)
    except ValueError:
        raise ConfigError(f"source_address {source_address!r} is not an IP address") from None
    src = f"[{source}]" if source.version == 6 else str(source)
    return f"tcp://{src}:0;{rest}"


@attrs.frozen(kw_only=True)
class ControllerLinkStatus:
    """One controller's channel as the node sees it (`ControllerChannels.statuses()`)."""

    #: As `NodeConfig.controllers` lists it, and what the channel dials now (a controller key
    #: rotation moves it).
    configured: str
    endpoint: str
    #: Messages leave on it (judged at each heartbeat: a queued message that has not left since
    #: the last one means no connection; zmq keeps redialling).
    connected: bool
    sent: int
    received: int
    #: Signed messages not queued on it because its outbox was full (no connection).
    dropped: int
    #: Heartbeats not queued on it because the previous one had not left.
    heartbeats_skipped: int


@attrs.define(eq=False)
class _Member:
    index: int
    configured: str
    channel: NodeChannel
    #: What `Unverified.route` carries for this channel's signed messages (see `receive_unverified`).
    route: bytes
    #: The channel's `sent` when the last heartbeat was queued on it (-1: none yet).
    sent_at_beat: int = -1
    connected: bool = False
    dropped: int = 0
    heartbeats_skipped: int = 0


class ControllerChannels:
    """The node's channels to every listed controller, as one channel for the agent and the relay."""

    def __init__(
        self,
        make: UplinkFactory,
        dials: Sequence[tuple[str, Dial]],
        controller_keys: Sequence[tuple[PublicKey, float]] = (),
        *,
        state_dir: Path | None = None,
    ) -> None:
        """`dials`: (the endpoint as listed, what its channel dials) for each controller, in order.
        With `state_dir`, where a rotation moves a channel is stored (`identity.save_channel_targets`)."""
        if not dials:
            raise ConfigError("no controller to dial: list at least one channel endpoint in controllers")
        self._members = [
            _Member(index=i, configured=configured, channel=NodeChannel(make, dial, controller_keys), route=b"%d" % i)
            for i, (configured, dial) in enumerate(dials)
        ]
        self._by_route = {m.route: m for m in self._members}
        self._controller_keys = tuple(controller_keys)
        self._state_dir = state_dir
        #: The channel of the last signed message verified: replies and `dial`/`redial` are its.
        self._replying = self._members[0]
        #: The key the last verified message was signed with.
        self.verified_with: PublicKey | None = None
        # Every member's receive loop → the agent's one reader: (member, what came).
        self._inbox_tx, self._inbox_rx = trio.open_memory_channel[tuple[_Member, Routed | Unverified | ContractError]](
            _INBOX
        )

    # --- running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Run every channel, each supervised on its own (one failing restarts only itself)."""
        async with trio.open_nursery() as nursery:
            for member in self._members:
                await nursery.start(supervised, f"uplink.{member.index}", self._serve, member)
            task_status.started()
        raise AssertionError("the channels never return")  # pragma: no cover

    async def _serve(self, member: _Member, *, task_status: trio.TaskStatus[None]) -> NoReturn:
        async with trio.open_nursery() as nursery:
            await nursery.start(member.channel.run)
            task_status.started()
            while True:
                got: Routed | Unverified | ContractError
                try:
                    got = await member.channel.receive_unverified()
                except ContractError as exc:  # a malformed data frame: the agent counts it
                    got = exc
                await self._inbox_tx.send((member, got))
        raise AssertionError("unreachable")  # pragma: no cover

    # --- what the agent uses

    @property
    def controller_keys(self) -> tuple[tuple[PublicKey, float], ...]:
        """The controller keys in force on every channel (the controllers share them)."""
        return self._controller_keys

    @controller_keys.setter
    def controller_keys(self, keys: tuple[tuple[PublicKey, float], ...]) -> None:
        self._controller_keys = tuple(keys)
        for member in self._members:
            member.channel.controller_keys = self._controller_keys

    @property
    def dial(self) -> Dial:
        """What the channel of the last verified message dials."""
        return self._replying.channel.dial

    async def send(self, msg: wire.NodeMessage) -> None:
        """Hello and heartbeats on every channel; anything else to the last verified one's controller."""
        if len(self._members) == 1:
            if isinstance(msg, wire.Heartbeat):
                self._beat_due(self._members[0])  # only noted: the agent skips beats to a single channel
            await self._members[0].channel.send(msg)  # no other controller to hold up: wait, as before
            return
        await trio.lowlevel.checkpoint()
        if isinstance(msg, wire.Hello | wire.Heartbeat):
            for member in self._members:
                if isinstance(msg, wire.Hello) or self._beat_due(member):
                    self._offer(member, msg)
        else:
            self._offer(self._replying, msg)

    async def send_liveness(self, node_id: str, state_seq: int) -> None:
        """A liveness beat on every channel whose last beat has left (one channel: waits, as `send`)."""
        if len(self._members) == 1:
            self._beat_due(self._members[0])
            await self._members[0].channel.send_liveness(node_id, state_seq)
            return
        await trio.lowlevel.checkpoint()
        for member in self._members:
            if self._beat_due(member):
                try:
                    member.channel.send_liveness_nowait(node_id, state_seq)
                except (trio.WouldBlock, ChannelClosed):
                    member.dropped += 1

    def send_nowait(self, msg: wire.NodeMessage) -> None:
        if isinstance(msg, wire.Hello | wire.Heartbeat):
            for member in self._members:
                self._offer(member, msg)
        else:
            self._replying.channel.send_nowait(msg)

    def _offer(self, member: _Member, msg: wire.NodeMessage) -> None:
        try:
            member.channel.send_nowait(msg)
        except (trio.WouldBlock, ChannelClosed):
            member.dropped += 1
            log.warning(
                "dropped a %s for the controller at %s: its channel is not connected", msg.kind, member.configured
            )

    def _beat_due(self, member: _Member) -> bool:
        """Whether to queue a heartbeat on `member` (and note whether its messages leave)."""
        try:
            stats = member.channel.statistics()
        except ChannelClosed:
            self._set_connected(member, False)
            return False
        stuck = stats.outbox_depth > 0 and stats.sent == member.sent_at_beat
        self._set_connected(member, stats.sent > 0 and not stuck)
        if stuck:
            member.heartbeats_skipped += 1
            return False
        member.sent_at_beat = stats.sent
        return True

    def _set_connected(self, member: _Member, connected: bool) -> None:
        if connected != member.connected:
            if connected:
                log.info("the channel to the controller at %s is connected", member.configured)
            else:
                log.warning("the channel to the controller at %s is not connected; redialling", member.configured)
        member.connected = connected

    # --- receiving

    async def receive_unverified(self) -> Routed | Unverified:
        """The next message from any controller. A signed one carries its channel in `route` (so
        `verify` knows it); a data frame comes `Routed` with its channel. ContractError: a malformed frame."""
        while True:
            member, got = await self._inbox_rx.receive()
            if isinstance(got, ContractError):
                raise got
            if isinstance(got, Routed):
                return got  # its channel is the member's
            return attrs.evolve(got, route=member.route)

    def verify(self, pending: Unverified) -> wire.ControllerMessage:
        """Check a signed message against the controller keys in force (`NodeChannel.verify`); the
        channel it came on becomes the one replies go to. BadSignature or ContractError as there."""
        member = self._by_route.get(pending.route, self._members[0])
        msg = member.channel.verify(pending)
        self._replying, self.verified_with = member, member.channel.verified_with
        return msg

    def statistics(self) -> PumpStatistics:
        """All the running channels' counters added up (the agent's heartbeat skip reads them)."""
        running: list[PumpStatistics] = []
        for member in self._members:
            try:
                running.append(member.channel.statistics())
            except ChannelClosed:
                continue
        if not running:
            raise ChannelClosed("no controller channel is running")
        return PumpStatistics(
            received=sum(s.received for s in running),
            sent=sum(s.sent for s in running),
            dropped=sum(s.dropped for s in running),
            inbox_depth=sum(s.inbox_depth for s in running),
            outbox_depth=sum(s.outbox_depth for s in running),
        )

    def statuses(self) -> tuple[ControllerLinkStatus, ...]:
        """Each controller's channel: where it dials and whether it is connected (as of the last beat)."""
        out = []
        for member in self._members:
            try:
                stats = member.channel.statistics()
                sent, received = stats.sent, stats.received
            except ChannelClosed:
                sent = received = 0
            out.append(
                ControllerLinkStatus(
                    configured=member.configured,
                    endpoint=member.channel.dial.endpoint,
                    connected=member.connected,
                    sent=sent,
                    received=received,
                    dropped=member.dropped,
                    heartbeats_skipped=member.heartbeats_skipped,
                )
            )
        return tuple(out)

    # --- key rotations

    async def rekey(self, curve: CurveKeyPair, signing_key: SigningKey, open_requests: OpenRequests) -> None:
        """The node's new keys on every channel (`NodeChannel.rekey`, make before break): the
        requests open on each finish on its old connection."""
        for member in self._members:
            await member.channel.rekey(curve, signing_key, open_requests)

    async def redial(self, server_curve_public: str, endpoint: str, open_requests: OpenRequests) -> None:
        """The controller whose announcement was verified last serves its new Curve key at
        `endpoint`: move its channel there (`NodeChannel.redial`), storing that first."""
        member = self._replying
        if self._state_dir is not None:
            targets = {
                m.configured: ChannelTarget(
                    endpoint=m.channel.dial.endpoint, curve_public_key=m.channel.dial.server_curve_public
                )
                for m in self._members
            }
            targets[member.configured] = ChannelTarget(endpoint=endpoint, curve_public_key=server_curve_public)
            await trio.to_thread.run_sync(save_channel_targets, self._state_dir, targets)
        await member.channel.redial(server_curve_public, endpoint, open_requests)


#: What the agent and the relay talk to the controllers through.
Channel = NodeChannel | ControllerChannels


async def open_channel(cfg: NodeConfig, identity: NodeIdentity, state_dir: Path) -> Channel:
    """The node's channel: to the enrolled endpoint (`NodeChannel`), or with `controllers` listed, to
    each of them (`ControllerChannels`, where a rotation moved a channel: there). ConfigError for a
    source address the endpoints cannot be dialled from, or a damaged `channels.json`."""

    def make_uplink(dial: Dial, share: Uplink | None) -> Uplink:
        return Uplink(
            channel_endpoint(dial.endpoint, cfg.source_address),
            curve=dial.curve,
            server_curve_public=dial.server_curve_public,
            signing_key=dial.signing_key,
            controller_key=identity.controller_signing_public,
            reconnect_ivl_s=min(RECONNECT_FIRST_S, cfg.reconnect_max_s),
            reconnect_ivl_max_s=cfg.reconnect_max_s,
            share_inbox_of=share,
        )

    first = Dial(
        curve=identity.curve,
        signing_key=identity.signing_key,
        server_curve_public=identity.controller_curve_public,
        endpoint=identity.channel_endpoint,
    )
    if not cfg.controllers:
        channel_endpoint(identity.channel_endpoint, cfg.source_address)  # a bad source address fails the start
        return NodeChannel(make_uplink, first, identity.controller_keys)
    moved = await trio.to_thread.run_sync(load_channel_targets, state_dir)
    dials = []
    for configured in cfg.controllers:
        target = moved.get(configured)
        dial = first if target is None else attrs.evolve(first, server_curve_public=target.curve_public_key)
        dial = attrs.evolve(dial, endpoint=configured if target is None else target.endpoint)
        channel_endpoint(dial.endpoint, cfg.source_address)
        dials.append((configured, dial))
    log.info("keeping a channel to each of %d controllers", len(dials))
    return ControllerChannels(make_uplink, dials, identity.controller_keys, state_dir=state_dir)
