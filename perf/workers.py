"""Gateway workers (`[http] workers = N`, issue 32): one `nexa control` with 1 worker against one with 2.

Sets up what `perf/gateway.py` does (its parts and helpers): the OCI registry and SeaweedFS S3 from
`nexa.localparts`, nginx's fixed unary answer on the node's address standing in for the runtime
(`perf/upstream.py`), then two clusters side by side: `nexa control` with `[http] workers = 1` and
with 2 (its supervisor starts the worker processes), each with one `nexa node` (`simulation = true`)
that has a channel to every worker (node.toml `controllers`), a `sim` deployment whose runtime is
moved aside so that the agent relays to nginx, a tenant and an inference key. Then, in interleaved
rounds (each cluster once per round), wrk at `--concurrency` keep-alive connections on the shared
port; per point it prints req/s and p50/p99, each worker's CPU share and CPU µs per request (from
/proc, over the window), the agent's, and how many requests each worker answered (its own address's
`nexa_gateway_requests_total`: the kernel spreads connections, not requests). Bounded in time;
stops only what it started, by PID.

    .venv/bin/python perf/workers.py --seconds 5 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa.localparts import S3_REGION, LocalS3, free_ports
from nexa.s3.credentials import write_s3_credentials
from perf.gateway import (
    NODE_HOST,
    Processes,
    children_of,
    deploy,
    local_parts,
    ok,
    register_model,
    request_body,
    upload,
)
from perf.loadgen import Point, Target, machine_busy_seconds
from perf.upstream import Nginx, unary_body, wrk_point

ALIAS = "chat"
PATH = "/v1/chat/completions"


@attrs.define
class Workers:
    """One `nexa control` with `count` gateway workers, its node, and how to read each worker."""

    count: int
    url: str
    admin: httpx.Client
    key: str
    supervisor_pid: int
    node_pid: int
    #: Worker → (pid, its own address), from `GET /api/v1/cluster` and the supervisor's children.
    workers: dict[str, tuple[int, str]] = attrs.Factory(dict)

    def watched(self) -> dict[str, int]:
        out = {name: pid for name, (pid, _) in self.workers.items()}
        if self.count > 1:
            out["supervisor"] = self.supervisor_pid
        return {**out, "node": self.node_pid}

    def served(self) -> dict[str, float]:
        """Each worker's `nexa_gateway_requests_total`, read at its own address."""
        out = {}
        for name, (_, address) in self.workers.items():
            text = self.admin.get(f"{address}/metrics").text
            lines = [x for x in text.splitlines() if x.startswith("nexa_gateway_requests_total{")]
            out[name] = sum(float(x.rsplit(" ", 1)[1]) for x in lines)
        return out


def start_workers(
    procs: Processes, base: Path, s3: LocalS3, image: str, artifact: bytes, count: int, nginx_port: int
) -> Workers:
    """`nexa control` with `[http] workers = count`, its node and the nginx deployment, all Ready."""
    tag = f"w{count}"
    home = base / tag
    home.mkdir()
    creds = write_s3_credentials(home / "s3-credentials.json", s3.credentials)
    http_port, channel_port = free_ports(1)[0], _channel_ports(2 * count)
    config = home / "control.toml"
    config.write_text(
        f'state_dir = "{home / "control"}"\n'
        f'[http]\nlisten = "127.0.0.1:{http_port}"\nworkers = {count}\n'
        f'[channel]\nlisten = "tcp://127.0.0.1:{channel_port}"\n'
        "[oci]\ntls_verify = false\n"
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{S3_REGION}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        '[log]\nlevel = "warning"\n'
    )
    name = f"control-{tag}"
    supervisor = procs.start(name, [sys.executable, "-m", "nexa", "control", "--config", str(config)])
    procs.wait(name, lambda: "listening on" in procs.tail(name), f"nexa control ({count} workers)")
    admin_key = next(
        line.split("=", 1)[1].strip() for line in procs.tail(name, 100_000).splitlines() if "NEXA_TOKEN=" in line
    )
    url = f"http://127.0.0.1:{http_port}"
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)
    ok(admin.post("/api/v1/tenants", json={"id": "perf"}))
    key = ok(admin.post("/api/v1/keys", json={"role": "inference", "tenant": "perf"}))["key"]
    ok(admin.post("/api/v1/runtimes", json={"name": "sim", "kind": "sim", "version": "1", "image": image}))
    register_model(admin, s3, "tiny", ALIAS, artifact)

    node_dir = home / "node"
    inventory = home / "node-inventory.json"
    inventory.write_text(json.dumps({"labels": {"board": "sim"}, "runtimes": ["sim"]}))
    channels = [f"tcp://127.0.0.1:{channel_port + 2 * i}" for i in range(count)]
    node_config = home / "node.toml"
    node_config.write_text(
        f'state_dir = "{node_dir}"\ninventory_path = "{inventory}"\n'
        f'source_address = "{NODE_HOST}"\nruntime_host = "{NODE_HOST}"\nsimulation = true\n'
        f"controllers = {json.dumps(channels)}\n"
        '[log]\nlevel = "warning"\n'
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{S3_REGION}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        "[supervisor]\nreconcile_interval_s = 1\n"
    )
    token = ok(admin.post("/api/v1/enrollment-tokens", json={"ttl_s": 600}))["token"]
    enroll = [sys.executable, "-m", "nexa", "node", "enroll", "--controller", url, "--token", token]
    enroll += ["--name", f"perf-node-{tag}", "--state-dir", str(node_dir)]
    done = subprocess.run(enroll, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nexa node enroll failed: {done.stderr[-2000:]}")
    env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"}
    node = procs.start(f"node-{tag}", [sys.executable, "-m", "nexa", "node", "--config", str(node_config)], env=env)
    procs.wait(
        f"node-{tag}", lambda: any(n["state"] == "Ready" for n in ok(admin.get("/api/v1/nodes"))["nodes"]), "node"
    )
    # The stand-in sim runtime is moved aside by `--port` (a later flag wins): the agent relays to nginx.
    deploy(admin, f"perf-{tag}", ALIAS, nginx_port, ["--port", str(free_ports(1, NODE_HOST)[0])])
    cluster = Workers(count=count, url=url, admin=admin, key=key, supervisor_pid=supervisor.pid, node_pid=node.pid)
    body = request_body("unary", 16)

    def every_worker_answers() -> bool:
        # Each worker has heard the node on its own channel once its own address answers a completion.
        if count == 1:  # `workers = 1` is the one controller process itself, as ever
            cluster.workers["0"] = (supervisor.pid, url)
        else:
            view = ok(admin.get("/api/v1/cluster"))
            pids = sorted(children_of(supervisor.pid))  # worker 0 starts first
            if len(view["controllers"]) < count or len(pids) < count:
                return False
            for member, pid in zip(sorted(view["controllers"], key=lambda m: m["id"]), pids, strict=False):
                cluster.workers[member["id"].rsplit("/", 1)[1]] = (pid, member["address"])
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        return all(
            httpx.post(f"{address}{PATH}", content=body, headers=headers, timeout=30).status_code == 200
            for _, address in cluster.workers.values()
        )

    procs.wait(f"node-{tag}", every_worker_answers, f"every worker of {count} answering through the node")
    return cluster


def _channel_ports(span: int) -> int:
    """A port p with p .. p + span - 1 free on 127.0.0.1 (worker i: p + 2i, its key rotation p + 2i + 1)."""
    for _ in range(200):
        first = free_ports(1)[0]
        if first + span < 65536 and all(_free(port) for port in range(first + 1, first + span)):
            return first
    raise RuntimeError(f"no {span} adjacent free ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def measure(cluster: Workers, args: argparse.Namespace) -> tuple[Point, dict[str, float]]:
    """One wrk point on the shared port; and the requests each worker answered in it (warm-up included)."""
    host, port = httpx.URL(cluster.url).host, httpx.URL(cluster.url).port
    assert port is not None
    target = Target(f"workers-{cluster.count}", host, port, PATH, cluster.key)
    before = cluster.served()
    point = wrk_point(
        target,
        args.concurrency,
        request_body("unary", 16),
        seconds=args.seconds,
        warmup_s=args.warmup_s,
        threads=args.wrk_threads,
        watched=cluster.watched(),
        scripts=args.base,
    )
    after = cluster.served()
    return point, {name: after[name] - before[name] for name in after}


def report(cluster: Workers, point: Point, served: dict[str, float]) -> str:
    workers = sorted(cluster.workers)
    cpu = sum(point.cpu.get(w, 0.0) for w in workers)
    per_request_us = cpu * point.seconds / max(point.count, 1) * 1e6
    each = ", ".join(
        f"worker {w} {point.cpu.get(w, 0.0) * 100:.0f} % / {served.get(w, 0):.0f} requests" for w in workers
    )
    node_us = point.cpu.get("node", 0.0) * point.seconds / max(point.count, 1) * 1e6
    return (
        f"{cluster.count} worker(s) c={point.conc}: {point.rps:.0f} req/s p50 {point.lat(0.5):.1f} ms "
        f"p99 {point.lat(0.99):.1f} ms; workers {cpu * 100:.0f} % of a core, {per_request_us:.0f} µs CPU per "
        f"request ({each}, warm-up included); agent {node_us:.0f} µs per request; "
        f"client {point.cpu.get('client', 0.0) * 100:.0f} %"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="unmeasured seconds before each point")
    parser.add_argument("--concurrency", type=int, default=16, help="wrk keep-alive connections")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each cluster once per round)")
    parser.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (-t; at most c)")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    print(f"machine: {os.cpu_count()} CPUs; {args.seconds:g} s per point, c={args.concurrency}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nexa-perf-") as tmp, contextlib.ExitStack() as parts:
        base = Path(tmp)
        args.base = base
        registry, s3, procs = local_parts(base, parts)
        nginx = Nginx(base / "nginx")
        parts.callback(nginx.stop)
        [port] = free_ports(1, NODE_HOST)
        nginx.serve(NODE_HOST, port, unary_body(ALIAS, 16), "application/json")
        started = time.monotonic()
        nginx.start()
        registry.start()
        s3.start()
        image = registry.push_empty_image("nexa-perf/sim")
        artifact = secrets.token_bytes(200_000)
        trio.run(upload, s3, "perf/tiny.gguf", artifact)
        clusters = [start_workers(procs, base, s3, image, artifact, count, port) for count in (1, 2)]
        print(f"set up nginx, registry, S3 and both clusters in {time.monotonic() - started:.1f} s", flush=True)
        for round_ in range(1, args.rounds + 1):
            for cluster in clusters:  # interleaved: the machine's noise hits both alike
                busy, wall = machine_busy_seconds(), time.monotonic()
                point, served = measure(cluster, args)
                busy = (machine_busy_seconds() - busy) / (time.monotonic() - wall) * 100
                print(f"round {round_}: {report(cluster, point, served)}; machine {busy:.0f} % busy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
