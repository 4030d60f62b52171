"""Run in a network namespace of its own (`unshare --net`, made by tests/channel/test_keepalive.py):
a controller-side ROUTER and a node-side DEALER with the channel's keepalive (`links.keepalive`, as
`Link` and `Uplink` set it), then every packet between them dropped with the real nft, as when a
host loses power or the network parts. Prints one JSON object: the seconds until each side's zmq
reported the connection closed, and whether the DEALER got through again once packets flowed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from nexa.channel.links import DEFAULT_MAX_MESSAGE_BYTES, LINK_DEAD_AFTER_S, UPLINK_DEAD_AFTER_S, keepalive

DROP = """table inet cut {{
  chain in {{
    type filter hook input priority 0;
    tcp dport {p} drop
    tcp sport {p} drop
  }}
}}
"""


def main() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    keepalive(router, LINK_DEAD_AFTER_S, DEFAULT_MAX_MESSAGE_BYTES)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    keepalive(dealer, UPLINK_DEAD_AFTER_S, DEFAULT_MAX_MESSAGE_BYTES)
    watched = {
        "router": router.get_monitor_socket(zmq.EVENT_DISCONNECTED),
        "dealer": dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED),
    }
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"beat")
    peer, _ = router.recv_multipart()
    router.send_multipart([peer, b"set"])
    assert dealer.recv() == b"set"
    while watched["dealer"].poll(100):
        watched["dealer"].recv_multipart()  # the connect event
    subprocess.run(["nft", "-f", "-"], input=DROP.format(p=port).encode(), check=True)
    cut = time.monotonic()
    closed: dict[str, float] = {}
    poller = zmq.Poller()
    for monitor in watched.values():
        poller.register(monitor, zmq.POLLIN)
    next_beat = cut
    while len(closed) < 2 and time.monotonic() - cut < 30:
        if time.monotonic() >= next_beat:  # the node goes on beating, once a second, as the agent does
            dealer.send(b"beat", zmq.NOBLOCK)
            next_beat += 1.0
        for monitor, _ in poller.poll(100):
            side = next(name for name, m in watched.items() if m is monitor)
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                closed.setdefault(side, round(time.monotonic() - cut, 2))
    subprocess.run(["nft", "delete", "table", "inet", "cut"], check=True)
    dealer.send(b"again")
    through = False
    if router.poll(15_000):
        through = router.recv_multipart()[-1] in {b"again", b"beat"}
    json.dump({"closed": closed, "through_again": through}, sys.stdout)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
