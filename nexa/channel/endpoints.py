"""Curve-key endpoints and their rotation, make before break, on both ends of the channel.

The controller's side (`ServedEndpoints`): one `Link` serves two endpoints (`[channel] listen`
and `rotation_listen`). One serves the current Curve key; a rotation serves its next key on the
other before any node is told of it, and at the switch the old key's endpoint is bound again to
refuse (and report) whoever still dials it. Which key that is, and when, is the keyring's and
`Southbound`'s decision; here is only how.

The node's side: `NodeChannel` is what the agent and the relay send and receive through: one `Uplink`, until
`rekey` opens a second one with the node's new keys beside it (or `redial`, with the controller's
new Curve key at its new endpoint, after a controller key rotation) (sharing its inbox, so one reader still
sees every message in order per connection). From then on every signed message (signed with the
new key) and the data of every request that was not open goes on the new connection. The requests
open at that moment finish on the old one, so each request's frames stay in order on one
connection. The old connection closes once they have ended and something has arrived on the new
one (the controller has moved its route to it), a short grace later; or after `DRAIN_MAX_S`.
The agent stays the only owner of the channel: nothing else on the node dials the controller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final, NoReturn, Protocol

import attrs
import trio

from nexa.channel.framing import decode_frames
from nexa.channel.links import CurveKeyPair, Link, Unverified, Uplink
from nexa.channel.pump import PumpStatistics
from nexa.contracts import wire
from nexa.errors import BadSignature, ChannelClosed, ChannelError, NexaError, RotationEndpointInUse
from nexa.security import PublicKey, SigningKey

log = logging.getLogger(__name__)

#: The longest the old connection stays open after a rotation (requests still on it then fail).
DRAIN_MAX_S: Final = 600.0
#: How long the old connection stays open once it has nothing left to do: frames the controller
#: sent on it just before it moved its route to the new one are still read.
DRAIN_GRACE_S: Final = 1.0


# --- the controller's two endpoints ------------------------------------------------------------


class ServedEndpoints:
    """The controller's two channel endpoints on one `Link`: which serves the current Curve key
    (`slot`), and what each is bound as. `endpoint(slot)` is `(bind, advertise)` as configured
    (`ChannelConfig.endpoint`; "" advertise: what was bound)."""

    def __init__(self, link: Link, endpoint: Callable[[int], tuple[str, str]], *, slot: int = 0) -> None:
        self._link = link
        self._endpoint = endpoint
        #: The endpoint that serves the current Curve key; the other serves a rotation's next key
        #: or refuses the one the last switch retired.
        self.slot = slot
        self._bound: dict[int, str] = {}

    def started(self, bound: str) -> None:
        """The link runs and serves the current Curve key as `bound` (what `Link.run` reported)."""
        self._bound[self.slot] = bound

    def bound(self, slot: int) -> bool:
        return slot in self._bound

    def advertised(self, slot: int) -> str:
        """What nodes are told to dial for endpoint `slot` (bound already)."""
        return self._endpoint(slot)[1] or self._bound[slot]

    async def serve_other(self, curve: CurveKeyPair, *, admit: bool) -> None:
        """Serve `curve` on the other endpoint (at a start, mid-rotation) unless it serves one already.
        `admit=False`: a retired key, refused to every node that dials it (`Link.rebind`)."""
        other = 1 - self.slot
        if other not in self._bound:
            self._bound[other] = await self._link.rebind(self._endpoint(other)[0], curve, admit=admit)

    async def switch(self, slot: int, retired: CurveKeyPair | None) -> None:
        """Endpoint `slot` serves the current Curve key from now on; the other one (closed, with its
        connections) serves `retired` to refuse whoever dials it."""
        old = self._bound.get(slot ^ 1)
        self.slot = slot
        if old is not None and retired is not None:
            self._bound[slot ^ 1] = await self._link.rebind(old, retired, admit=False)

    async def serve_next(self, curve: CurveKeyPair) -> None:
        """Serve a rotation's new Curve key on the other endpoint. An endpoint that cannot be bound
        raises RotationEndpointInUse (nothing else changed)."""
        slot = self.slot ^ 1
        try:
            self._bound[slot] = await self._serve_next(slot, curve)
        except ChannelClosed:
            raise
        except ChannelError as exc:
            reason = exc.message.rpartition(": ")[2].partition(" (addr=")[0] or "refused"
            raise RotationEndpointInUse(endpoint=self._endpoint(slot)[0], reason=reason) from exc

    async def _serve_next(self, slot: int, curve: CurveKeyPair) -> str:
        """A configured port is bound again once its old listener is closed; an ephemeral one (`*` or
        0) gets a fresh port before the old one closes, so nothing else on the host can take the port
        in between."""
        configured, bound = self._endpoint(slot)[0], self._bound.get(slot)
        if bound is None or not configured.endswith((":*", ":0")):
            return await self._link.rebind(bound or configured, curve)
        fresh = self._link.bind(configured, curve)
        self._link.unbind(bound)
        return fresh


# --- the node's channel -------------------------------------------------------------------------


class DataSender(Protocol):
    """What answers a data-path request: the channel its `infer` came on."""

    async def send_data(self, kind: str, request_id: str, head: bytes, body: bytes) -> None: ...

    def send_data_nowait(self, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        """Queue without waiting; trio.WouldBlock when the outbox is full."""
        ...


@attrs.frozen(kw_only=True)
class Routed:
    """A data frame, and the channel that answers its request (a node with several controllers
    answers each request on the channel it came on; the node relay keeps it with the request)."""

    frame: wire.DataFrame
    reply: DataSender


@attrs.frozen(kw_only=True)
class Dial:
    """What one connection is made with: the node's keys, the controller's Curve key and endpoint."""

    curve: CurveKeyPair
    signing_key: SigningKey = attrs.field(repr=False)
    server_curve_public: str
    endpoint: str


#: Makes an Uplink for a `Dial`; the second argument is the uplink whose inbox it shares.
UplinkFactory = Callable[[Dial, Uplink | None], Uplink]
#: The requests open now whose answers go on the channel given (the node relay's `open_requests`).
OpenRequests = Callable[["DataSender"], Iterable[str]]


class NodeChannel:
    """The agent's channel: the current `Uplink`, and while a rotation drains, the old one."""

    def __init__(
        self,
        make: UplinkFactory,
        dial: Dial,
        controller_keys: Sequence[tuple[PublicKey, float]] = (),
    ) -> None:
        self._make = make
        #: What the current connection was made with.
        self.dial = dial
        #: The controller keys a signed message may carry, current first, each until when (Unix
        #: seconds); empty: the uplink's own pinned key. A key past its time is refused.
        self.controller_keys = tuple(controller_keys)
        #: The key the last message `verify` passed was signed with.
        self.verified_with: PublicKey | None = None
        self._current = make(dial, None)
        self._current_scope: trio.CancelScope | None = None
        self._old: Uplink | None = None
        self._old_scope: trio.CancelScope | None = None
        #: Requests whose frames go on the old connection until they end.
        self._old_requests: set[str] = set()
        #: Whether anything arrived on the current connection since the rotation.
        self._moved = False
        self._old_idle = trio.Event()
        self._old_what = ""
        self._nursery: trio.Nursery | None = None
        #: Rotations done by this channel.
        self.rekeyed = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Run the current uplink (and a draining old one) until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._current_scope = await nursery.start(self._serve, self._current)
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            # A restarted channel starts from its current keys alone.
            self._nursery, self._old, self._old_scope = None, None, None
            self._old_requests.clear()
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _serve(uplink: Uplink, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(uplink.run)
                task_status.started(scope)

    async def rekey(self, curve: CurveKeyPair, signing_key: SigningKey, open_requests: OpenRequests) -> None:
        """Dial with the new keys beside the current connection, then make the new one current.

        The caller holds its send lock, so no message signed with the old key follows this onto
        the new connection. The requests `open_requests(self)` names once the new connection runs
        finish on the old one.
        """
        dial = attrs.evolve(self.dial, curve=curve, signing_key=signing_key)
        await self._switch(dial, open_requests, "the node's previous keys")

    async def redial(self, server_curve_public: str, endpoint: str, open_requests: OpenRequests) -> None:
        """The controller serves a new Curve key at `endpoint` (its key rotation): dial it with the
        node's own keys beside the current connection, then make it current, as `rekey` does."""
        dial = attrs.evolve(self.dial, server_curve_public=server_curve_public, endpoint=endpoint)
        await self._switch(dial, open_requests, "the controller's previous Curve key")

    async def _switch(self, dial: Dial, open_requests: OpenRequests, old: str) -> None:
        nursery = self._nursery
        if nursery is None:
            raise ChannelClosed("the controller channel is not running")
        self._close_old()  # a rotation before the last one drained: what was left on it ends now
        new = self._make(dial, self._current)
        self.dial, self._old_what = dial, old
        new_scope: trio.CancelScope = await nursery.start(self._serve, new)
        self._old, self._old_scope = self._current, self._current_scope
        self._current, self._current_scope = new, new_scope
        # Read now, with no wait since `_old` was set: a request that ended while the new connection
        # started sent its end already, and would otherwise hold the old channel open to DRAIN_MAX_S.
        self._old_requests = set(open_requests(self))
        self._moved = False
        self._old_idle = trio.Event()
        self.rekeyed += 1
        nursery.start_soon(self._drain, self._old, self._old_idle)
        log.info("dialled the controller anew; %d requests finish on the old channel", len(self._old_requests))

    async def _drain(self, old: Uplink, idle: trio.Event) -> None:
        with trio.move_on_after(DRAIN_MAX_S):
            await idle.wait()
            await trio.sleep(DRAIN_GRACE_S)
        if self._old is old:
            if self._old_requests:
                log.warning("closing the old channel with %d requests still on it", len(self._old_requests))
            self._close_old()

    def _close_old(self) -> None:
        if self._old_scope is not None:
            self._old_scope.cancel()
        if self._old is not None:
            log.info("closed the channel of %s", self._old_what)
        self._old, self._old_scope = None, None
        self._old_requests.clear()

    def _check_idle(self) -> None:
        if self._moved and not self._old_requests:
            self._old_idle.set()

    # --- what the agent and the relay use (the Uplink's interface)

    async def send(self, msg: wire.NodeMessage) -> None:
        await self._current.send(msg)

    def send_nowait(self, msg: wire.NodeMessage) -> None:
        self._current.send_nowait(msg)

    async def send_liveness(self, node_id: str, state_seq: int) -> None:
        await self._current.send_liveness(node_id, state_seq)

    def send_liveness_nowait(self, node_id: str, state_seq: int) -> None:
        self._current.send_liveness_nowait(node_id, state_seq)

    def _data_uplink(self, kind: str, request_id: str) -> Uplink:
        if self._old is None or request_id not in self._old_requests:
            return self._current
        old = self._old
        if kind == wire.END:
            self._old_requests.discard(request_id)
            self._check_idle()
        return old

    async def send_data(self, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        await self._data_uplink(kind, request_id).send_data(kind, request_id, head, body)

    def send_data_nowait(self, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        self._data_uplink(kind, request_id).send_data_nowait(kind, request_id, head, body)

    async def receive_unverified(self) -> Routed | Unverified:
        """The next message on either connection (they share one inbox); a data frame comes `Routed`
        back on this channel."""
        got = await self._current.receive_unverified()
        if self._old is not None:
            self._old.wake()  # there is room in the shared inbox for the old pump too
            if not self._moved and self._current.statistics().received:
                self._moved = True
                self._check_idle()
        return Routed(frame=got, reply=self) if isinstance(got, wire.DataFrame) else got

    def verify(self, pending: Unverified) -> wire.ControllerMessage:
        """Check a signed message against the controller keys in force now; BadSignature (counted
        by the agent, logged) when none of them signed it."""
        now = time.time()
        keys = [key for key, until in self.controller_keys if now < until]
        if not keys:
            self.verified_with = None
            return self._current.verify(pending)
        for key in keys:
            try:
                msg: wire.ControllerMessage = decode_frames(pending.frames, key, wire.FROM_CONTROLLER)
            except BadSignature:
                continue
            except NexaError as exc:
                log.warning("rejected a message from the controller: %s (%s)", exc.code, exc.message)
                raise
            self.verified_with = key
            return msg
        log.warning("rejected a message from the controller: no controller key in force signed it")
        raise BadSignature("no controller key in force signed this message", kind="controller")

    def statistics(self) -> PumpStatistics:
        return self._current.statistics()
