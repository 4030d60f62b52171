"""Controller cost of a large fleet: N simulated nodes heartbeating at 1 Hz over CurveZMQ.

Starts `nexa control` (venv or binary) on a temporary state dir, enrolls N nodes through the
real HTTP API, connects N Curve DEALER sockets from this process (one shared zmq context) and
sends each node's signed heartbeat once a second. Reports the controller's CPU (share of one
core, from /proc/PID/stat) and RSS over the measured window, and how many nodes it saw Ready.
Loopback only; bounded in time; stops the controller it started.

    .venv/bin/python perf/southbound_fanin.py --nodes 1000 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa import security
from nexa.channel import framing, links
from nexa.contracts import wire
from nexa.contracts.node import DiscoveredHost, InventoryFile
from nexa.localparts import free_ports, stop
from nexa.node.inventory import merge


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--binary", help="a built dist/nexa instead of `python -m nexa`")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))

    http_port, channel_port = free_ports(2)
    base = [args.binary] if args.binary else [sys.executable, "-m", "nexa"]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [
                *base,
                "control",
                "--state-dir",
                f"{tmp}/state",
                "--listen",
                f"127.0.0.1:{http_port}",
                "--channel",
                f"tcp://127.0.0.1:{channel_port}",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=2)
        try:
            admin = ""
            assert proc.stdout is not None
            for line in proc.stdout:
                if "NEXA_TOKEN=" in line:
                    admin = line.strip().split("=", 1)[1]
                if "listening on" in line:
                    break
            http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", headers={"Authorization": f"Bearer {admin}"})
            started = time.perf_counter()
            nodes = []
            for i in range(args.nodes):
                key, curve = security.generate_signing_key(), links.generate_curve_keypair()
                token = http.post("/api/v1/enrollment-tokens", json={"ttl_s": 600}).json()["token"]
                enrolled = http.post(
                    "/api/v1/enroll",
                    json={
                        "token": token,
                        "hostname": f"sim-{i:04d}",
                        "signing_public_key": key.public.b64,
                        "curve_public_key": curve.public,
                    },
                ).json()
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.CURVE_SERVERKEY, enrolled["controller_curve_public_key"].encode())
                sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public.encode())
                sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret.encode())
                sock.connect(enrolled["channel_endpoint"])
                nodes.append((enrolled["node_id"], key, sock))
            print(f"enrolled {args.nodes} nodes in {time.perf_counter() - started:.1f} s")

            host = DiscoveredHost(
                hostname="sim",
                arch="arm64",
                cpu_count=20,
                memory_total_bytes=128 << 30,
                memory_available_bytes=100 << 30,
                gpus=(),
                discovered_at=time.time(),
            )
            inventory = merge(host, InventoryFile())
            poller = zmq.Poller()
            fences: dict[zmq.Socket[bytes], tuple[int, int]] = {}
            for _, _, sock in nodes:
                poller.register(sock, zmq.POLLIN)
                fences[sock] = (0, 0)
            seq = int(time.time() * 1e6)

            def tick() -> None:
                nonlocal seq
                for node_id, key, sock in nodes:
                    seq += 1
                    beat = wire.Heartbeat(
                        node_id=node_id,
                        seq=seq,
                        ts=time.time(),
                        inventory=inventory,
                        free_memory_bytes=100 << 30,
                        free_accelerators=0,
                    )
                    sock.send_multipart(framing.encode_frames(beat, key), zmq.NOBLOCK)

            def drain(until: float) -> None:
                while (left := until - time.monotonic()) > 0:
                    for sock, _ in poller.poll(timeout=left * 1000):
                        while True:
                            try:
                                kind, body, _sig = sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            if kind == b"assignments":  # report it as accepted, like an agent would
                                pushed = json.loads(body)
                                fences[sock] = (pushed["epoch"], pushed["generation"])

            for _ in range(3):  # warm-up: connect, first pushes, inventories stored
                tick()
                drain(time.monotonic() + 1.0)
            cpu0, wall0 = cpu_seconds(proc.pid), time.monotonic()
            ticks = 0
            while time.monotonic() - wall0 < args.seconds:
                next_tick = time.monotonic() + 1.0
                tick()
                ticks += 1
                drain(next_tick)
            cpu = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - wall0)
            ready, cursor = 0, None
            while True:  # every page: the list is paginated (100 a page by default)
                query = {"limit": 1000} | ({"cursor": cursor} if cursor else {})
                page = http.get("/api/v1/nodes", params=query).json()
                ready += sum(1 for n in page["nodes"] if n["state"] == "Ready")
                if not (cursor := page.get("next_cursor")):
                    break
            print(f"nodes: {args.nodes}; heartbeats sent: {ticks * args.nodes} over {ticks} s")
            print(f"controller CPU: {cpu * 100:.1f} % of one core (target <= 25 % at 1000 nodes)")
            print(f"controller RSS: {rss_mib(proc.pid):.1f} MiB (target <= 150 MB at 1000 nodes)")
            print(f"nodes Ready at the end: {ready}/{args.nodes}")
            for line in http.get("/metrics").text.splitlines():
                if line.startswith(
                    (
                        "nexa_node_messages_rejected_total",
                        "nexa_audit_events_total",
                        "nexa_assignment_pushes_total",
                        "nexa_node_messages_total",
                    )
                ):
                    print("  ", line)
        finally:
            ctx.destroy(linger=0)
            stop(proc, grace_s=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
