"""Run in a network namespace of its own (`unshare --net`, made by tests/node/test_firewall.py):
the fabric firewall, with the real nft, around a listener bound on every address as torch's
rendezvous store binds. Prints one JSON object: which addresses a connection reached at each step.

Loopback only: the fabric address is 127.0.0.11, the "management" one 127.0.0.1 (both on `lo` of
the namespace, which exists only for this run).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import trio

from nexa.contracts.groups import GroupMember
from nexa.node.firewall import FabricFirewall

FABRIC = "127.0.0.11"
ADDRESSES = (FABRIC, "127.0.0.1", "127.0.0.12")


def reached(port: int) -> list[str]:
    out = []
    for address in ADDRESSES:
        with socket.socket() as c:
            c.settimeout(2.0)
            try:
                c.connect((address, port))
            except OSError:
                continue
            out.append(address)
    return out


def table(name: str) -> str:
    return subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, text=True, check=False).stdout


def main() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))  # every address, as torch's TCPStore binds
        listener.listen(16)
        port = listener.getsockname()[1]
        head = GroupMember(rank=0, node_id="n0", address=FABRIC, port=port, interface="")
        # `lo` as the fabric interface: a connection from the node itself arrives on it.
        head_on_lo = GroupMember(rank=0, node_id="n0", address=FABRIC, port=port, interface="lo")
        fw = FabricFirewall("nexa-probe")
        steps: dict[str, object] = {"before": reached(port)}
        trio.run(fw.close, ("old", head))
        steps["closed"] = reached(port)
        trio.run(fw.close, ("new", head_on_lo))  # a successor's hold on the same port
        steps["table"] = table("nexa-probe")
        trio.run(fw.release, "old")
        steps["one_hold_left"] = reached(port)
        trio.run(fw.release, "new")
        steps["released"] = reached(port)
        steps["table_after"] = table("nexa-probe")
    json.dump(steps, sys.stdout)


if __name__ == "__main__":
    main()
