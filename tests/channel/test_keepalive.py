"""A dead connection is found by the kernel (`links.keepalive`: TCP keepalive and TCP_USER_TIMEOUT),
not by ZMTP PINGs: in a network namespace the test makes (`unshare --net`), a ROUTER and a DEALER
set as `Link` and `Uplink` set them, then every packet between them dropped with the real nft (a
host that lost power, a parted network). The node's side closes within `UPLINK_DEAD_AFTER_S` of
its first unanswered beat, the controller's within `LINK_DEAD_AFTER_S` of the last packet, and
the node gets through again once packets flow (tests/support/deadpeer.py)."""

from __future__ import annotations

from pathlib import Path

import zmq

from nexa.channel.links import LINK_DEAD_AFTER_S, UPLINK_DEAD_AFTER_S, keepalive
from tests.support.netns import probe_in_own_netns

REPO = Path(__file__).resolve().parents[2]


def test_each_side_finds_a_silent_peer_dead_in_bounded_time_and_the_node_dials_again() -> None:
    got = probe_in_own_netns("tests.support.deadpeer", timeout_s=90)
    # The node's beats go unacknowledged: TCP_USER_TIMEOUT closes its side (a beat a second, so
    # within one beat of the bound); nothing reaches the controller: its keepalive probes do.
    assert UPLINK_DEAD_AFTER_S - 0.5 <= got["closed"]["dealer"] <= UPLINK_DEAD_AFTER_S + 1.5, got
    assert LINK_DEAD_AFTER_S - 0.5 <= got["closed"]["router"] <= LINK_DEAD_AFTER_S + 2.0, got
    assert got["through_again"] is True


def test_keepalive_sets_the_kernel_s_probes_and_user_timeout_and_no_zmtp_pings() -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        keepalive(sock, 5.0, 1 << 20)
        assert (sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE), sock.getsockopt(zmq.TCP_KEEPALIVE_INTVL)) == (2, 1)
        assert (sock.getsockopt(zmq.TCP_KEEPALIVE), sock.getsockopt(zmq.TCP_KEEPALIVE_CNT)) == (1, 3)
        assert sock.getsockopt(zmq.TCP_MAXRT) == 5000
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0  # no ZMTP PING: the liveness beats flow anyway
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
        sock.close(linger=0)
    finally:
        ctx.term()
