"""The node channel over ZeroMQ: one pump task per socket, CurveZMQ with a trio ZAP handler, signed frames.

`Link` is the controller's ROUTER: it binds, admits node Curve keys through ZAP and tags every
message with the node id ZAP gave its channel. `Uplink` is a node's DEALER: it dials out and
lets zmq reconnect with capped backoff. Both sign what they send and verify what they receive
before parsing it (the frames are `nexa.channel.framing`'s). The same channel carries the unsigned
data-path frames `[kind, request_id, head, body]` (`wire.DATA_KINDS`), which CurveZMQ alone
authenticates; each side accepts only the data kinds of its direction. With `pump`, the only
module that imports `zmq`; zmq errors leave it as ChannelError.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Final, NoReturn, TypeVar

import attrs
import trio
import zmq
from zmq.utils import z85

from nexa import security
from nexa.channel.framing import (
    decode_data,
    decode_data_batch,
    decode_frames,
    decode_liveness,
    encode_data,
    encode_frames,
    encode_liveness,
    is_data,
    is_liveness,
    joins_data,
    read_liveness,
)
from nexa.channel.pump import (
    SEND_RETRY_S,
    PumpStatistics,
    ZmqPump,
    _Context,
    _Socket,
    close_all,
    new_socket,
    read_events,
)
from nexa.channel.zap import ZAP_ENDPOINT, domain_of, serve_zap
from nexa.contracts import wire
from nexa.errors import (
    BadSignature,
    ChannelClosed,
    ChannelError,
    ConfigError,
    ContractError,
    MessageTooLarge,
    NexaError,
    NodeRateLimited,
    NotConnected,
    Unauthenticated,
    WrongNode,
)
from nexa.ratelimit import RateLimiter

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Length of a Curve25519 key in Z85 text.
CURVE_KEY_CHARS: Final = 40
#: Largest message a peer may send (bytes); larger ones cost the sender its connection.
DEFAULT_MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
#: What a controller's zmq frame limit (MAXMSGSIZE) allows above the largest data chunk: room for
#: the signed messages (a heartbeat with a large inventory is a few KiB) and the data-path heads.
MESSAGE_HEADROOM_BYTES: Final = 64 * 1024
#: A `Link` refuses (and counts, by node) a message over its limit and keeps the connection; libzmq
#: itself drops only messages over this many times the limit, closing the node's connection (each
#: such disconnect is counted by node too: `on_disconnect`).
TRANSPORT_LIMIT_FACTOR: Final = 4


#: A node finds its connection to a controller dead this long after the controller's host stopped
#: answering (a controller that exits closes it at once): then it dials again.
UPLINK_DEAD_AFTER_S: Final = 5.0
#: A controller drops a node's connection this long after the node's host stopped answering (the
#: node is Unreachable sooner: after `[nodes] lease_s` without a liveness beat).
LINK_DEAD_AFTER_S: Final = 10.0
#: Unanswered keepalive probes before the kernel closes a connection.
KEEPALIVE_PROBES: Final = 3

#: How long `Link.rebind` tries to bind an endpoint again after closing it.
_REBIND_S: Final = 5.0


def _node_of(frames: list[zmq.Frame]) -> str:
    """The node a message came from: the `User-Id` our ZAP handler set from its Curve key; "" for
    none (a peer ZAP never saw)."""
    try:
        node_id = frames[-1].get("User-Id")
    except zmq.ZMQError:  # no such property
        return ""
    return node_id if isinstance(node_id, str) else ""


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


# --- Curve25519 keys (CurveZMQ transport identity) ----------------------------------------------


@attrs.frozen(kw_only=True)
class CurveKeyPair:
    """A Curve25519 key pair in Z85 text. The secret never appears in a repr."""

    public: str
    secret: str = attrs.field(repr=False)


def generate_curve_keypair() -> CurveKeyPair:
    public, secret = zmq.curve_keypair()
    return CurveKeyPair(public=public.decode("ascii"), secret=secret.decode("ascii"))


def check_curve_key(text: str) -> str:
    """Return `text` stripped if it is a Z85 Curve25519 key, else raise ContractError."""
    text = text.strip()
    if len(text) != CURVE_KEY_CHARS:
        raise ContractError(f"a Curve key is {CURVE_KEY_CHARS} Z85 characters, got {len(text)}")
    try:
        z85.decode(text)
    except (ValueError, KeyError, TypeError, struct.error):  # struct: a group above 2**32
        raise ContractError("a Curve key must be Z85 text") from None
    return text


def save_curve_keypair(pair: CurveKeyPair, directory: Path, *, name: str = "curve", overwrite: bool = False) -> None:
    """Write `<name>.key` (secret, mode 0600) and `<name>.pub` (public, 0644) atomically."""
    security.write_key_file(directory / f"{name}.key", (pair.secret + "\n").encode(), private=True, overwrite=overwrite)
    security.write_key_file(
        directory / f"{name}.pub", (pair.public + "\n").encode(), private=False, overwrite=overwrite
    )


def load_curve_keypair(directory: Path, *, name: str = "curve") -> CurveKeyPair:
    """Read `<name>.key` (refused if others can read it); the public half is derived from it."""
    path = directory / f"{name}.key"
    raw = security.read_key_file(path, private=True)
    try:
        secret = check_curve_key(raw.decode("ascii"))
    except (UnicodeDecodeError, ContractError):
        raise ConfigError(f"{path} does not hold a Z85 Curve secret key") from None
    return CurveKeyPair(public=zmq.curve_public(secret.encode()).decode("ascii"), secret=secret)


def load_curve_public(path: Path) -> str:
    """Read a `.pub` file written by `save_curve_keypair` (a controller's key, pinned on a node)."""
    raw = security.read_key_file(path, private=False)
    try:
        return check_curve_key(raw.decode("ascii"))
    except (UnicodeDecodeError, ContractError):
        raise ConfigError(f"{path} does not hold a Z85 Curve public key") from None


def keepalive(sock: _Socket, dead_after_s: float, max_message_bytes: int) -> None:
    """A dead connection found by the kernel, not by messages of the channel's own: TCP keepalive
    probes once nothing has arrived for 40 % of `dead_after_s` (then 3, at 20 % of it apart), and
    TCP_USER_TIMEOUT (libzmq's TCP_MAXRT on Linux) when what was sent goes unacknowledged that long;
    either closes it, a ROUTER drops the peer and a DEALER reconnects. A live peer's kernel answers
    both with no wake-up of its process, where ZMTP's PINGs cost each side a CurveZMQ message and a
    read every interval whatever else flows (a node's liveness beats already do every second)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, round(dead_after_s * 0.4)))
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, round(dead_after_s * 0.2)))
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    sock.setsockopt(zmq.TCP_MAXRT, _ms(dead_after_s))
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


# --- controller side ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Inbound:
    """A verified message and the node its channel belongs to (from ZAP, not from the body)."""

    node_id: str
    message: wire.NodeMessage
    #: Signed with the key the node had before it rotated them (`Link`'s `previous_key`).
    previous_key: bool = False
    #: It came on another connection than the node's last message: the node redialled (a key
    #: switch, or zmq reconnected), and its route is this connection from now on.
    moved: bool = False


@attrs.frozen(kw_only=True)
class DataInbound:
    """A data-path frame and the node whose channel (Curve key, through ZAP) carried it."""

    node_id: str
    frame: wire.DataFrame


@attrs.frozen(kw_only=True)
class Alive:
    """A node's liveness beat (`wire.Liveness`), from the node whose channel carried it."""

    node_id: str
    #: `seq` of the node's last signed state (`wire.Liveness.state_seq`).
    state_seq: int
    #: It came on another connection than the node's last message (as `Inbound.moved`).
    moved: bool = False


@attrs.frozen(kw_only=True)
class Refused:
    """A message that failed a check, with the node its channel belongs to ("" if none)."""

    node_id: str
    error: NexaError


@attrs.frozen(kw_only=True)
class Unverified:
    """A signed message as it came off the socket, its signature not yet checked (`verify`).

    Receive loops hand these to a control task, so that the signature check (and whatever the
    message leads to) never holds up the data frames behind it. On a `Link`, `node_id` is the
    channel's node (from ZAP) and the message is already within that node's signed rate.
    """

    frames: list[bytes] = attrs.field(repr=False)
    node_id: str = ""
    route: bytes = attrs.field(default=b"", repr=False)
    #: The file descriptor of the zmq connection it came on (-1: not known).
    fd: int = -1


class Link:
    """The controller's end of every node channel: a CurveZMQ ROUTER plus its ZAP handler.

    `authorize(curve_public_z85)` returns the node id for an enrolled key, or None to refuse;
    `node_key(node_id)` returns the node's Ed25519 key, or None once it is revoked;
    `previous_key(node_id)` the key it had before it rotated them, while that one is still
    accepted (its messages come in marked `Inbound.previous_key`). All are called on the event
    loop and must not block (`node_key` is asked for every message, data frames included).

    One socket serves every endpoint (`bind`): a controller key rotation serves its new Curve key on
    a second endpoint beside the first, with the same routing table and ZAP handler (libzmq takes
    the Curve key and the ZAP domain at each bind). A Curve key retired (`rebind`) is refused to every node
    that dials it, whose Curve key goes to `retired_dial`.

    Sends to a node that is gone or not keeping up are dropped and counted (never queued
    without bound), so whoever waits for an answer on the data path must bound the wait.
    `gather()` (seconds; None: off) moderates the receive side's wake-ups (`ZmqPump`).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        curve: CurveKeyPair,
        signing_key: security.SigningKey,
        authorize: Callable[[str], str | None],
        node_key: Callable[[str], security.PublicKey | None],
        previous_key: Callable[[str], security.PublicKey | None] = lambda _: None,
        inbox_size: int = 64,
        outbox_size: int = 64,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        dead_after_s: float = LINK_DEAD_AFTER_S,
        receive_hwm: int = 1000,
        signed_rate: RateLimiter | None = None,
        retired_dial: Callable[[str], None] = lambda _: None,
        on_disconnect: Callable[[str], None] = lambda _: None,
        gather: Callable[[], float] | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._gather = gather
        self._retired_dial = retired_dial
        self._on_disconnect = on_disconnect
        self._max_message_bytes = max_message_bytes
        # zmq connection (file descriptor) → the node whose verified message last came on it.
        self._node_by_fd: dict[int, str] = {}
        self._router: _Socket | None = None
        # Endpoint (as bound) → the Curve key it serves; bound again if the link runs again.
        self._served: dict[str, CurveKeyPair] = {}
        # The ZAP domains of the Curve keys no longer admitted (`rebind`).
        self._retired: set[bytes] = set()
        self._curve, self._key, self._authorize = curve, signing_key, authorize
        self._node_key, self._previous_key = node_key, previous_key
        self._sizes = (inbox_size, outbox_size)
        self._limits = (dead_after_s, max_message_bytes * TRANSPORT_LIMIT_FACTOR)
        # Signed messages per node, checked before the signature: a flood costs a dict lookup each.
        self._receive_hwm, self._signed_rate = receive_hwm, signed_rate
        self._pump: ZmqPump | None = None
        # node id → ZMQ routing id of the connection its latest verified message came on.
        self._routes: dict[str, bytes] = {}
        # The data frames of a node's joined message not yet returned (`receive_unverified`).
        self._batched: collections.deque[DataInbound] = collections.deque()
        #: Messages of each node in the pump's inbox, not yet returned by `receive_unverified`: while
        #: a node has any, its next one goes there too (`_take`), so each node's stay in order.
        self._queued: collections.Counter[str] = collections.Counter()
        #: Where well-formed data frames go straight from the pump (`take_data`); None: `receive`.
        self._data_handler: Callable[[str, wire.DataFrame], None] | None = None
        #: Where well-formed liveness beats go straight from the pump (`take_alive`); None: `receive`.
        self._alive_handler: Callable[[Alive], None] | None = None

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind and serve until cancelled. Supports `endpoint = await nursery.start(link.run)`."""
        ctx: _Context = zmq.Context()  # its own context: the ZAP endpoint is per context
        sockets: list[_Socket] = []
        try:
            try:
                # ZAP first: with no handler bound, libzmq would admit every Curve client.
                zap = new_socket(ctx, zmq.REP, sockets)
                zap.bind(ZAP_ENDPOINT)
                router = new_socket(ctx, zmq.ROUTER, sockets)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends fail (and are counted)
                router.setsockopt(zmq.CURVE_SERVER, 1)
                router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
                # Per node connection: at most this many messages wait in zmq before it stops
                # reading that node's socket (TCP then pushes back on the node alone).
                router.setsockopt(zmq.RCVHWM, self._receive_hwm)
                keepalive(router, *self._limits)
                monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                sockets.insert(0, monitor)  # closed before the router (`close_all` goes backwards)
            except zmq.ZMQError as exc:
                raise ChannelError(f"cannot set up the node channel: {exc.strerror}") from exc
            served, self._served = list(self._served.items()) or [(self._endpoint, self._curve)], {}
            endpoint, *_ = [self._bind_on(router, *each) for each in served]  # the first is the link's own
            pump = ZmqPump(
                router,
                inbox_size=self._sizes[0],
                outbox_size=self._sizes[1],
                drop_unroutable=True,
                take=self._take,
                gather=self._gather,
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_zap, zap, self._admit)
                nursery.start_soon(self._watch_disconnects, monitor)
                await nursery.start(pump.run)
                self._pump, self._router = pump, router
                task_status.started(endpoint)
        finally:
            self._pump, self._router = None, None
            self._routes.clear()
            self._node_by_fd.clear()
            self._batched.clear()
            self._queued.clear()
            close_all(ctx, sockets)

    async def _watch_disconnects(self, monitor: _Socket) -> NoReturn:
        """Tell `on_disconnect` which node's connection libzmq closed: the peer left or went silent,
        or libzmq dropped it (a message over its own bound, a protocol error)."""
        # Here, not at the top: zmq.utils.monitor imports zmq.asyncio (all of asyncio), and only the
        # controller's Link watches; a node's Uplink never loads it (perf/node_memory.py).
        from zmq.utils.monitor import parse_monitor_message

        fd = monitor.fileno()  # edge-triggered, as the pump's
        while True:
            while read_events(monitor) & zmq.POLLIN:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
                # The fd may be reused at once by another connection; the node's next message names it again.
                node_id = self._node_by_fd.pop(int(event["value"]), None)
                if node_id is not None:
                    self._on_disconnect(node_id)
            await trio.lowlevel.wait_readable(fd)

    def _admit(self, client_key: str, domain: bytes) -> str | None:
        if domain in self._retired:
            self._retired_dial(client_key)
            return None
        return self._authorize(client_key)

    def bind(self, endpoint: str, curve: CurveKeyPair) -> str:
        """Serve `endpoint` too, with `curve` (a rotation's new Curve key); the endpoint bound."""
        router, pump = self._running_router()
        try:
            return self._bind_on(router, endpoint, curve)
        finally:
            pump.wake()  # zmq calls may take the FD's edge: the pump reads EVENTS again

    def _bind_on(self, router: _Socket, endpoint: str, curve: CurveKeyPair) -> str:
        try:
            router.setsockopt(zmq.CURVE_SECRETKEY, curve.secret.encode("ascii"))
            router.setsockopt(zmq.ZAP_DOMAIN, domain_of(curve.public))
            router.bind(endpoint)
            bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            raise ChannelError(f"cannot bind the node channel on {endpoint}: {exc.strerror}") from exc
        self._served[bound] = curve
        log.info("node channel bound on %s", bound)
        return bound

    def unbind(self, endpoint: str) -> None:
        """Stop serving `endpoint` (as `bind` or `run` reported it); the connections on it close."""
        router, pump = self._running_router()
        try:
            router.unbind(endpoint)
        except zmq.ZMQError as exc:
            raise ChannelError(f"cannot close the node channel endpoint {endpoint}: {exc.strerror}") from exc
        finally:
            pump.wake()
        del self._served[endpoint]

    async def rebind(self, endpoint: str, curve: CurveKeyPair, *, admit: bool = True) -> str:
        """Serve `endpoint` with `curve` from now on, closing what it served (and its connections).
        `admit=False` retires `curve`: whoever dials it is refused and handed to `retired_dial`."""
        (self._retired.discard if admit else self._retired.add)(domain_of(curve.public))
        if endpoint not in self._served:
            return self.bind(endpoint, curve)  # nothing of ours held it: a refusal is final
        self.unbind(endpoint)
        with trio.move_on_after(_REBIND_S):
            while True:  # libzmq frees the port in its I/O thread, a moment after `unbind`
                with contextlib.suppress(ChannelError):
                    return self.bind(endpoint, curve)
                await trio.sleep(SEND_RETRY_S)
        return self.bind(endpoint, curve)

    def _running_router(self) -> tuple[_Socket, ZmqPump]:
        pump = self._running()
        if self._router is None:
            raise ChannelClosed("the node channel is not running")
        return self._router, pump

    async def send(self, node_id: str, msg: wire.ControllerMessage, *, key: security.SigningKey | None = None) -> None:
        """Queue a message for a node, signed with `key` or the link's. NotConnected if it has not spoken here."""
        await self._running().send([self._route(node_id), *encode_frames(msg, key or self._key)])

    def use_signing_key(self, key: security.SigningKey) -> None:
        """Sign what is sent from now on with `key` (`nexa keys rotate-controller`)."""
        self._key = key

    async def send_data(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        """Queue a data-path frame (`wire.DATA_FROM_CONTROLLER`) for a node; NotConnected if it has no route."""
        pump = self._running()
        await pump.send([self._route(node_id), *encode_data(kind, request_id, head, body)])

    def send_data_nowait(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        """Like `send_data` without waiting; raises trio.WouldBlock when the outbox is full."""
        pump = self._running()
        pump.send_nowait([self._route(node_id), *encode_data(kind, request_id, head, body)])

    def _route(self, node_id: str) -> bytes:
        route = self._routes.get(node_id)
        if route is None:
            raise NotConnected(node_id=node_id)
        return route

    async def receive(self) -> Inbound | DataInbound | Alive:
        """The next message from a node: a verified signed message, a data frame or a liveness beat.

        A rejected message raises (Unauthenticated, BadSignature, WrongNode, ContractError)
        and is logged with its node; the next call goes on with the next message.
        """
        got = await self.receive_any()
        if isinstance(got, Refused):
            raise got.error
        return got

    async def receive_any(self) -> Inbound | DataInbound | Alive | Refused:
        """Like `receive`, but a rejected message comes back as `Refused` naming its channel's node.

        A data frame is accepted from an enrolled, non-revoked node's channel and only in the
        kinds a node may send (`wire.DATA_FROM_NODE`); it is neither logged nor signature-checked.
        Signed messages above the node's rate are refused (NodeRateLimited) before they are
        verified. Nothing a node sends makes this raise: whatever fails is a `Refused`.
        """
        got = await self.receive_unverified()
        return self.verify(got) if isinstance(got, Unverified) else got

    async def receive_unverified(self) -> DataInbound | Alive | Unverified | Refused:
        """Like `receive_any`, but a signed message comes back `Unverified` (check it with `verify`).

        What is done here is cheap and never waits: the channel's node, its enrolment, the data
        frame's shape, the signed rate, a liveness beat's node id. The signature check is left to
        whoever handles the message. The data frames a node joined into one message come back one a
        call, with no wait between. A liveness beat, authenticated by the channel as data frames
        are, moves the node's route to its connection (so a node whose connection zmq re-made is
        reachable again before its next signed message); it is never rate-limited or logged.
        """
        if self._batched:
            return self._batched.popleft()
        # When the link is being cancelled, callers see Cancelled, not ChannelClosed. No schedule
        # point here otherwise: the inbox's receive has one, and a second per message (a pass of
        # the run loop each) was a fair part of a liveness beat's cost (`perf/southbound_fanin.py`).
        await trio.lowlevel.checkpoint_if_cancelled()
        frames = await self._running().receive()
        node_id = _node_of(frames)
        if (left := self._queued[node_id] - 1) > 0:
            self._queued[node_id] = left
        else:
            self._queued.pop(node_id, None)
        if not node_id or len(frames) < 2:
            return Refused(node_id="", error=Unauthenticated("a message arrived on a channel without a node identity"))
        return self._refusing(node_id, self._accept, node_id, frames)

    def verify(self, pending: Unverified) -> Inbound | Refused:
        """Check a signed message from `receive_unverified`; on success its connection becomes the node's route."""
        return self._refusing(pending.node_id, self._verify, pending)

    def _refusing(self, node_id: str, check: Callable[..., T], *args: object) -> T | Refused:
        """`check(*args)`, with whatever it raises turned into a logged `Refused` for `node_id`."""
        try:
            return check(*args)
        except NexaError as exc:
            log.warning("rejected a message from node %s: %s (%s)", node_id, exc.code, exc.message)
            return Refused(node_id=node_id, error=exc)
        except Exception as exc:  # last resort: no value from a node may end the controller
            log.warning("rejected a malformed message from node %s: %s", node_id, type(exc).__name__)
            return Refused(node_id=node_id, error=ContractError(f"malformed message ({type(exc).__name__})"))

    def _enrolled_key(self, node_id: str) -> security.PublicKey:
        pub = self._node_key(node_id)
        if pub is None:
            self._routes.pop(node_id, None)
            raise Unauthenticated(f"node {node_id} is not enrolled")
        return pub

    def take_data(self, handler: Callable[[str, wire.DataFrame], None] | None) -> None:
        """Hand each well-formed data frame of an enrolled node to `handler(node_id, frame)` in the
        pump's own task, with no task switch (None: `receive` returns them again). Only a message
        that arrives with nothing of its node's before it in the inbox goes this way, so a node's
        frames keep their order; anything else, a refused frame included, still comes from
        `receive`. `handler` must not block or raise."""
        self._data_handler = handler

    def take_alive(self, handler: Callable[[Alive], None] | None) -> None:
        """Hand each well-formed liveness beat of an enrolled node to `handler` in the pump's own
        task, as `take_data` does data frames (None: `receive` returns them again): a fleet's beats
        are most of what its channel carries, and each task switch saved is a share of its cost
        (`perf/southbound_fanin.py`). The same checks as `receive`'s: a beat naming another node
        than its channel's, or from a node not enrolled, still comes from `receive`, refused.
        `handler` must not block or raise."""
        self._alive_handler = handler

    def _take(self, frames: list[zmq.Frame], inbox_empty: bool) -> bool:
        """The pump's hook: a data message or a liveness beat, handled in its task when a handler
        takes it (`take_data`, `take_alive`) and no message of its node waits in the inbox before
        it (another node's may: under a fleet's burst of beats the inbox is seldom empty, and each
        beat that waited there cost a task switch and a pass of the receive loop); False leaves it
        to `receive`, counted as its node's (`_queued`)."""
        node_id = _node_of(frames)
        taken = False
        if not self._batched and len(frames) > 1 and node_id and (inbox_empty or not self._queued[node_id]):
            kind = frames[1].bytes
            taken = self._take_alive(node_id, frames) if is_liveness(kind) else self._take_data(node_id, frames)
        if not taken:
            self._queued[node_id] += 1
        return taken

    def _take_alive(self, node_id: str, frames: list[zmq.Frame]) -> bool:
        handler = self._alive_handler
        if handler is None:
            return False
        try:
            self._enrolled_key(node_id)
            route_frame, _, node_b, seq_b = frames  # another shape: refused by `receive`, which says why
            named, state_seq = read_liveness(node_b.bytes, seq_b.bytes)
            if named != node_id:
                return False
            route = route_frame.bytes  # zmq is asked for the connection's descriptor only for a new route
            moved = route != self._routes.get(node_id) and self._learn_route(node_id, route, int(seq_b.get(zmq.SRCFD)))
        except Exception:  # refused: `receive` refuses it again, and says why
            return False
        try:
            handler(Alive(node_id=node_id, state_seq=state_seq, moved=moved))
        except Exception as exc:  # last resort: the pump (the whole channel) must outlive a bug there
            log.error("handing a liveness beat of node %s over failed: %s", node_id, type(exc).__name__)  # noqa: TRY400
        return True

    def _take_data(self, node_id: str, frames: list[zmq.Frame]) -> bool:
        handler = self._data_handler
        if handler is None or len(frames) < 5 or not is_data(frames[1].bytes):
            return False
        try:
            taken = self._data_frames(node_id, frames)
        except Exception:  # refused: `receive` refuses it again, and says why
            return False
        try:
            for frame in taken:
                handler(node_id, frame)
        except Exception as exc:  # last resort: the pump (the whole channel) must outlive a bug there
            log.error("handing a data frame of node %s over failed: %s", node_id, type(exc).__name__)  # noqa: TRY400
        return True

    def _data_frames(self, node_id: str, frames: list[zmq.Frame]) -> list[wire.DataFrame]:
        """The data frames of a node's message, all checked (a bad one refuses the message)."""
        self._enrolled_key(node_id)
        size = sum(len(f) for f in frames)
        if size > self._max_message_bytes:
            raise MessageTooLarge(size=size, limit=self._max_message_bytes)
        return decode_data_batch([f.bytes for f in frames[1:]], wire.DATA_FROM_NODE)

    def _accept(self, node_id: str, frames: list[zmq.Frame]) -> DataInbound | Alive | Unverified | Refused:
        """Check one message of a node's channel (not its signature); raises what `receive` documents."""
        self._enrolled_key(node_id)
        size = sum(len(f) for f in frames)
        if size > self._max_message_bytes:
            raise MessageTooLarge(size=size, limit=self._max_message_bytes)
        raw = [f.bytes for f in frames[1:]]
        if is_data(raw[0]):
            # Hot path: no log line per frame; the route is learnt only from signed messages.
            if len(raw) == 4:
                return DataInbound(node_id=node_id, frame=decode_data(raw, wire.DATA_FROM_NODE))
            first, *rest = decode_data_batch(raw, wire.DATA_FROM_NODE)  # all checked before any is filed
            self._batched.extend(DataInbound(node_id=node_id, frame=frame) for frame in rest)
            return DataInbound(node_id=node_id, frame=first)
        if is_liveness(raw[0]):
            beat = decode_liveness(raw)
            if beat.node_id != node_id:
                raise WrongNode(channel_node=node_id, claimed_node=beat.node_id)
            moved = self._learn_route(node_id, frames[0].bytes, int(frames[-1].get(zmq.SRCFD)))
            return Alive(node_id=node_id, state_seq=beat.state_seq, moved=moved)
        if self._signed_rate is not None and not self._signed_rate.allow(node_id, trio.current_time()):
            # Not logged: a flood would flood the log too. Counted by the caller.
            return Refused(node_id=node_id, error=NodeRateLimited(node_id=node_id))
        return Unverified(frames=raw, node_id=node_id, route=frames[0].bytes, fd=int(frames[-1].get(zmq.SRCFD)))

    def _verify(self, pending: Unverified) -> Inbound:
        node_id = pending.node_id
        # Asked again: the node may have been revoked while its message waited.
        previous = False
        try:
            msg = decode_frames(pending.frames, self._enrolled_key(node_id), wire.FROM_NODE)
        except BadSignature:
            if (old := self._previous_key(node_id)) is None:
                raise
            msg, previous = decode_frames(pending.frames, old, wire.FROM_NODE), True
        if msg.node_id != node_id:
            raise WrongNode(channel_node=node_id, claimed_node=msg.node_id)
        moved = self._learn_route(node_id, pending.route, pending.fd)
        return Inbound(node_id=node_id, message=msg, previous_key=previous, moved=moved)

    def _learn_route(self, node_id: str, route: bytes, fd: int) -> bool:
        """The node's route is `route` (its connection, socket `fd`; -1: unknown) from now on;
        whether it moved from another one."""
        known = self._routes.get(node_id)
        if known == route:
            return False
        self._routes[node_id] = route
        if fd >= 0:
            self._node_by_fd[fd] = node_id
        return known is not None

    def connected(self, node_id: str) -> bool:
        """Whether a verified message from this node has given us a route to it."""
        return node_id in self._routes

    def forget(self, node_id: str) -> None:
        """Drop the route to a node (revoked): nothing more is sent to it."""
        self._routes.pop(node_id, None)

    def statistics(self) -> PumpStatistics:
        return self._running().statistics()

    def _running(self) -> ZmqPump:
        if self._pump is None:
            raise ChannelClosed("the node channel is not running")
        return self._pump


# --- node side ----------------------------------------------------------------------------------


class Uplink:
    """A node's end of its channel: a CurveZMQ DEALER that dials the controller.

    zmq reconnects on its own, backing off from `reconnect_ivl_s` up to `reconnect_ivl_max_s`.
    While there is no connection, messages wait in the bounded outbox (zmq's IMMEDIATE), so
    `send` applies backpressure and `send_nowait` raises trio.WouldBlock.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        curve: CurveKeyPair,
        server_curve_public: str,
        signing_key: security.SigningKey,
        controller_key: security.PublicKey,
        inbox_size: int = 64,
        outbox_size: int = 64,
        reconnect_ivl_s: float = 0.1,
        reconnect_ivl_max_s: float = 5.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        dead_after_s: float = UPLINK_DEAD_AFTER_S,
        share_inbox_of: Uplink | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._share = share_inbox_of
        self._curve = curve
        self._server_public = check_curve_key(server_curve_public)
        self._key = signing_key
        self._controller_key = controller_key
        self._sizes = (inbox_size, outbox_size)
        self._reconnect = (reconnect_ivl_s, reconnect_ivl_max_s)
        self._limits = (dead_after_s, max_message_bytes)
        self._pump: ZmqPump | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Connect and serve until cancelled. Started means queued, not yet connected."""
        ctx: _Context = zmq.Context()
        sockets: list[_Socket] = []
        try:
            try:
                dealer = new_socket(ctx, zmq.DEALER, sockets)
                dealer.setsockopt(zmq.CURVE_SERVERKEY, self._server_public.encode("ascii"))
                dealer.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.public.encode("ascii"))
                dealer.setsockopt(zmq.CURVE_SECRETKEY, self._curve.secret.encode("ascii"))
                dealer.setsockopt(zmq.RECONNECT_IVL, _ms(self._reconnect[0]))
                dealer.setsockopt(zmq.RECONNECT_IVL_MAX, _ms(self._reconnect[1]))
                dealer.setsockopt(zmq.IMMEDIATE, 1)  # queue only on live connections
                keepalive(dealer, *self._limits)
                dealer.connect(self._endpoint)
            except zmq.ZMQError as exc:
                raise ChannelError(f"cannot dial the controller at {self._endpoint}: {exc.strerror}") from exc
            # Data messages queued together leave as one zmq message (`framing.joins_data`).
            self._pump = ZmqPump(dealer, inbox_size=self._sizes[0], outbox_size=self._sizes[1], coalesce=joins_data)
            if self._share is not None and self._share._pump is not None:  # its reader reads ours too
                self._pump.share_inbox(self._share._pump)
            log.info("dialling the controller at %s", self._endpoint)
            await self._pump.run(task_status=task_status)
        finally:
            self._pump = None
            close_all(ctx, sockets)

    async def send(self, msg: wire.NodeMessage) -> None:
        await self._running().send(encode_frames(msg, self._key))

    def send_nowait(self, msg: wire.NodeMessage) -> None:
        self._running().send_nowait(encode_frames(msg, self._key))

    async def send_liveness(self, node_id: str, state_seq: int) -> None:
        """Queue a liveness beat (`wire.LIVENESS`; backpressure when the outbox is full)."""
        await self._running().send(encode_liveness(node_id, state_seq))

    def send_liveness_nowait(self, node_id: str, state_seq: int) -> None:
        """Like `send_liveness` without waiting; raises trio.WouldBlock when the outbox is full."""
        self._running().send_nowait(encode_liveness(node_id, state_seq))

    async def send_data(self, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        """Queue a data-path frame (`wire.DATA_FROM_NODE`) for the controller (backpressure when full)."""
        await self._running().send(encode_data(kind, request_id, head, body))

    def send_data_nowait(self, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        """Like `send_data` without waiting; raises trio.WouldBlock when the outbox is full."""
        self._running().send_nowait(encode_data(kind, request_id, head, body))

    async def receive(self) -> wire.ControllerMessage | wire.DataFrame:
        """The next message from the controller: signed ones verified against its pinned key,
        data frames (`wire.DATA_FROM_CONTROLLER` kinds only) as they are."""
        got = await self.receive_unverified()
        return self.verify(got) if isinstance(got, Unverified) else got

    async def receive_unverified(self) -> wire.DataFrame | Unverified:
        """Like `receive`, but a signed message comes back `Unverified` (check it with `verify`)."""
        await trio.lowlevel.checkpoint()  # cancelled callers see Cancelled, not ChannelClosed
        frames = await self._running().receive()
        raw = [f.bytes for f in frames]
        if raw and is_data(raw[0]):
            return _from_controller(decode_data, raw, wire.DATA_FROM_CONTROLLER)
        return Unverified(frames=raw)

    def verify(self, pending: Unverified) -> wire.ControllerMessage:
        """Check a signed message from `receive_unverified` against the controller's pinned key.

        Raises BadSignature or ContractError (logged)."""
        msg: wire.ControllerMessage = _from_controller(
            decode_frames, pending.frames, self._controller_key, wire.FROM_CONTROLLER
        )
        return msg

    def statistics(self) -> PumpStatistics:
        return self._running().statistics()

    def wake(self) -> None:
        if self._pump is not None:
            self._pump.wake()

    def _running(self) -> ZmqPump:
        if self._pump is None:
            raise ChannelClosed("the controller channel is not running")
        return self._pump


def _from_controller(check: Callable[..., T], *args: object) -> T:
    """`check(*args)` on a message from the controller: what fails is logged and leaves as a NexaError."""
    try:
        return check(*args)
    except NexaError as exc:
        log.warning("rejected a message from the controller: %s (%s)", exc.code, exc.message)
        raise
    except Exception as exc:  # last resort: no value from the controller may end the node
        log.warning("rejected a malformed message from the controller: %s", type(exc).__name__)
        raise ContractError(f"malformed message ({type(exc).__name__})") from None
