"""Controller cost of a large fleet: N simulated nodes beating at 1 Hz over CurveZMQ.

Starts `nexa control` (venv or binary) on a temporary state dir, enrolls N nodes through the
real HTTP API, connects N Curve DEALER sockets from this process (one shared zmq context), and
has each node do what a node agent does (`nexa.node.agent`): once a second, at a phase of its own
(`--slices`: the second is cut into that many phases, the nodes spread over them), it sends a liveness
beat (`[alive, node_id, state_seq]`, authenticated by the channel), or its signed state (a
`Heartbeat`) when that is due: when it changed (an assignment set it accepted), when the
controller asked for it (`state_request`) and at least every `--state-interval` seconds (the
`[node] state_interval_s` default; each node starts at its own phase, as real nodes do).
Reports the controller's CPU (share of one core, from /proc/PID/stat) and RSS over the measured
window, what the nodes sent, and how many nodes it saw Ready. Loopback only; bounded in time;
stops the controller it started.

    .venv/bin/python perf/southbound_fanin.py --nodes 1000 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
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
from nexa.config import NodeConfig
from nexa.contracts import wire
from nexa.contracts.node import DiscoveredHost, InventoryFile
from nexa.localparts import free_ports, stop
from nexa.node.inventory import merge

#: `python -c` program: `python -m nexa ARGS...` under cProfile timed by the thread's CPU time,
#: from SIGUSR1 to SIGUSR2 (the measured window only, not the start-up and the enrollments).
_PROFILED = """
import cProfile, runpy, signal, sys, time
out, sys.argv = sys.argv[1], ["nexa", *sys.argv[2:]]
profile = cProfile.Profile(time.thread_time)
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
signal.signal(signal.SIGUSR2, lambda *_: profile.disable())
try:
    runpy.run_module("nexa", run_name="__main__")
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats(out)
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def handled(http: httpx.Client) -> dict[str, float]:
    """The controller's `nexa_node_messages_total`, by kind: what it has taken from nodes."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("nexa_node_messages_total{"):
            labels, _, value = line.rpartition(" ")
            out[labels.split('kind="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--binary", help="a built dist/nexa instead of `python -m nexa`")
    parser.add_argument(
        "--state-interval",
        type=float,
        default=NodeConfig().state_interval_s,
        help="seconds between a node's signed states when nothing changes ([node] state_interval_s)",
    )
    parser.add_argument(
        "--slices", type=int, default=100, help="phases a second is cut into; the nodes beat spread over them"
    )
    parser.add_argument(
        "--profile",
        help="profile the controller's main thread by CPU time (cProfile) over the measured window into FILE",
        metavar="FILE",
    )
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))

    http_port, channel_port = free_ports(2)
    base = [args.binary] if args.binary else [sys.executable, "-m", "nexa"]
    if args.profile:  # by CPU time, not wall time: a busy machine's waits are not the controller's cost
        base = [sys.executable, "-c", _PROFILED, args.profile]
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
                # Dead-connection detection as the agent's uplink has it (`links.Uplink`: TCP keepalive
                # and TCP_USER_TIMEOUT, in the kernel; before them, ZMTP PINGs every second, which
                # the controller answered each, a cost of its fleet as real as the beats).
                links.keepalive(sock, links.UPLINK_DEAD_AFTER_S, links.DEFAULT_MAX_MESSAGE_BYTES)
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
            # What each node's last state said (its fence), when it is next due, and its seq.
            reported: dict[zmq.Socket[bytes], tuple[int, int]] = {}
            due: dict[zmq.Socket[bytes], float] = {}
            state_seq: dict[zmq.Socket[bytes], int] = {}
            for _, _, sock in nodes:
                poller.register(sock, zmq.POLLIN)
                fences[sock], reported[sock], state_seq[sock], due[sock] = (0, 0), (-1, -1), 0, 0.0
            seq = int(time.time() * 1e6)
            sent = {"state": 0, "alive": 0, "asked": 0}

            def tick(
                beating: list[tuple[str, security.SigningKey, zmq.Socket[bytes]]], *, warming: bool = False
            ) -> None:
                # While warming up, each node's next state is set at a phase of its own (nodes that
                # started at different times), so the measured window sees the steady rate.
                nonlocal seq
                now = time.monotonic()
                for node_id, key, sock in beating:
                    seq += 1
                    if fences[sock] == reported[sock] and now < due[sock]:
                        sock.send_multipart(framing.encode_liveness(node_id, state_seq[sock]), zmq.NOBLOCK)
                        sent["alive"] += 1
                        continue
                    epoch, generation = fences[sock]
                    beat = wire.Heartbeat(
                        node_id=node_id,
                        seq=seq,
                        ts=time.time(),
                        inventory=inventory,
                        free_memory_bytes=100 << 30,
                        free_accelerators=0,
                        epoch=epoch,
                        generation=generation,
                        state_interval_s=args.state_interval,
                    )
                    sock.send_multipart(framing.encode_frames(beat, key), zmq.NOBLOCK)
                    interval = args.state_interval * (random.random() if warming else 1.0)
                    reported[sock], due[sock], state_seq[sock] = fences[sock], now + interval, seq
                    sent["state"] += 1

            def drain(until: float) -> None:
                while (left := until - time.monotonic()) > 0:
                    for sock, _ in poller.poll(timeout=left * 1000):
                        while True:
                            try:
                                kind, body, _sig = sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            if kind == b"assignments":  # accepted, like an agent would: its state changed
                                pushed = json.loads(body)
                                fences[sock] = (pushed["epoch"], pushed["generation"])
                            elif kind == b"state_request":  # the state goes with the next beat
                                due[sock] = 0.0
                                sent["asked"] += 1

            # Each node beats once a second at a phase of its own, as agents started at different
            # times do: the second is cut into `--slices` and node i beats in slice i mod slices
            # (`--slices 1`: every node at once, a burst the controller takes in few wake-ups).
            slices = max(1, min(args.slices, len(nodes)))
            phased = [nodes[k::slices] for k in range(slices)]

            def second(*, warming: bool = False) -> None:
                start = time.monotonic()
                for k, beating in enumerate(phased):
                    tick(beating, warming=warming)
                    drain(start + (k + 1) / slices)

            for _ in range(3):  # warm-up: connect, first pushes, inventories stored
                second(warming=True)
            before = handled(http)
            if args.profile:
                proc.send_signal(signal.SIGUSR1)
            cpu0, wall0 = cpu_seconds(proc.pid), time.monotonic()
            sent = dict.fromkeys(sent, 0)
            ticks = 0
            while time.monotonic() - wall0 < args.seconds:
                second()
                ticks += 1
            cpu_s, window = cpu_seconds(proc.pid) - cpu0, time.monotonic() - wall0
            if args.profile:
                proc.send_signal(signal.SIGUSR2)
            cpu = cpu_s / window
            after = handled(http)
            took = {kind: after[kind] - before.get(kind, 0.0) for kind in after}
            ready, cursor = 0, None
            while True:  # every page: the list is paginated (100 a page by default)
                query = {"limit": 1000} | ({"cursor": cursor} if cursor else {})
                page = http.get("/api/v1/nodes", params=query).json()
                ready += sum(1 for n in page["nodes"] if n["state"] == "Ready")
                if not (cursor := page.get("next_cursor")):
                    break
            print(
                f"nodes: {args.nodes}; over {ticks} s: {sent['alive']} liveness beats, {sent['state']} signed states "
                f"(state interval {args.state_interval:g} s; {sent['asked']} asked for by the controller)"
            )
            print(f"controller CPU: {cpu * 100:.1f} % of one core (target <= 5 % at 1000 nodes)")
            # Robust to a busy machine: a controller starved of CPU takes fewer messages, not cheaper ones.
            per = cpu_s / max(1.0, sum(took.values())) * 1e6
            print(f"messages the controller took in the window: {took}; {per:.0f} us of CPU per message")
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
