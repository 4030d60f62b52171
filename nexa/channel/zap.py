"""ZAP (ZeroMQ RFC 27) for the node channel: which Curve keys may open a channel, and the node each
one is. libzmq asks the handler bound at `ZAP_ENDPOINT` (in the socket's own context) about every
peer; `serve_zap` answers from a trio task, `zap_reply` decides (`Link` gives it the check)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final, NoReturn

import trio
import zmq
from zmq.utils import z85

from nexa.channel.pump import Frames, _Socket, read_events
from nexa.errors import ChannelError

log = logging.getLogger(__name__)

#: RFC 27: libzmq asks the handler bound here (in the socket's own context) about every peer.
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
#: The ZAP domain of the node channel; each endpoint's is `nexa-nodes/<its Curve public key>` (so
#: ZAP knows which key a peer dialled); requests for any other domain are refused.
ZAP_DOMAIN: Final = b"nexa-nodes"
_ZAP_VERSION: Final = b"1.0"


def zap_reply(request: list[bytes], authorize: Callable[[str, bytes], str | None]) -> Frames:
    """The answer to one ZAP request; `authorize(client_key, domain)` names the node or refuses (None)."""

    def reply(status: bytes, text: bytes, user_id: bytes = b"") -> Frames:
        request_id = request[1] if len(request) > 1 else b""
        return [_ZAP_VERSION, request_id, status, text, user_id, b""]

    # version, request id, domain, address, identity, mechanism, credentials...
    if len(request) < 6 or request[0] != _ZAP_VERSION:
        log.warning("refused a malformed ZAP request")
        return reply(b"400", b"malformed request")
    _, _, domain, address, _, mechanism, *credentials = request
    ours = domain == ZAP_DOMAIN or domain.startswith(ZAP_DOMAIN + b"/")
    if not ours or mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
        log.warning("refused a node channel from %s: not a CURVE peer in our domain", address.decode(errors="replace"))
        return reply(b"400", b"CURVE only")
    client_key = z85.encode(credentials[0]).decode("ascii")
    try:
        node_id = authorize(client_key, domain)
    except Exception:
        log.exception("node key check failed for %s", address.decode(errors="replace"))
        return reply(b"500", b"internal error")
    if node_id is None:
        log.warning(
            "refused a node channel from %s: Curve key %s is not admitted", address.decode(errors="replace"), client_key
        )
        return reply(b"400", b"key not admitted")
    return reply(b"200", b"OK", node_id.encode("utf-8"))


async def serve_zap(sock: _Socket, authorize: Callable[[str, bytes], str | None]) -> NoReturn:
    """Answer libzmq's ZAP requests. This task owns the REP socket (same FD rules as the pump)."""
    fd = sock.fileno()  # zmq.FD: edge-triggered
    try:
        while True:
            if read_events(sock) & zmq.POLLIN:
                request = sock.recv_multipart(zmq.NOBLOCK)
                sock.send_multipart(zap_reply(request, authorize), zmq.NOBLOCK)
                await trio.lowlevel.checkpoint()
                continue
            await trio.lowlevel.wait_readable(fd)
    except zmq.ZMQError as exc:
        raise ChannelError(f"ZAP handler socket failed: {exc.strerror}") from exc


def domain_of(curve_public: str) -> bytes:
    """The ZAP domain of an endpoint serving Curve public key `curve_public` (Z85)."""
    return ZAP_DOMAIN + b"/" + curve_public.encode("ascii")
