"""Gateway overhead: one `sim` runtime measured direct, through `nexa control`, and through LiteLLM proxy.

Sets up, as an operator would and on loopback only: an OCI registry (Debian `docker-registry`, an image
with no layers pushed over its HTTP API) and SeaweedFS S3 (`weed`, a model artifact uploaded), both
from `nexa.localparts`; then `nexa control` and one `nexa node` with `simulation = true`
(NEXA_SIMULATION_ONLY=1) as subprocesses; then, over the controller's HTTP API, a `sim` runtime, a
model verified/evaluated/approved and aliased `chat`, a deployment of one replica, a tenant and an
inference key. LiteLLM proxy (`litellm[proxy]`, installed on first use into its own venv under
~/.cache/nexa-perf) is started with the sim runtime as its OpenAI-compatible upstream; if it cannot
start, the other two are still measured.

The load generator (`perf/loadgen.py`) is raw HTTP/1.1 keep-alive over trio sockets, in
`--client-procs` processes. Unary chat completions (closed loop, `--seconds` per point) at concurrency
1, 16 and 64: requests/s, latency p50/p99 and what each gateway adds over direct. Streaming
(`--stream-tokens` tokens) at concurrency 1 and 16: time to the first SSE event p50/p99 and SSE events
(chunks) per second. Also the CPU share (of one core, /proc/PID/stat) of the controller, the node
agent, the sim runtime, LiteLLM and the client during each point. Bounded in time; stops only what it
started, by PID.

    .venv/bin/python perf/gateway.py --seconds 5
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa.errors import Unavailable
from nexa.localparts import S3_REGION, LocalRegistry, LocalS3, free_ports, stop, wait_until
from nexa.s3 import S3Client, write_s3_credentials
from nexa.sigv4 import S3Credentials
from perf.loadgen import Point, Target, run_point

Json = dict[str, Any]
#: The node's loopback address: its agent dials from it and its runtimes listen on it.
NODE_HOST = "127.0.0.7"
START_TIMEOUT_S = 60.0
S3_BUCKET = "nexa-models"
LITELLM_VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nexa-perf" / "litellm-venv"
PROMPT = "say something short about the weather"


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (the node's sim runtimes run in their own session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


class Processes:
    """What this run started besides the registry and S3, each logging to `logs/<name>.log`; stopped in
    reverse order, by PID."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, **kw)
        self.started[name] = proc
        return proc

    def wait(self, name: str, ready: Callable[[], bool], what: str) -> None:
        """Poll `ready` (a refused connection counts as not yet) until it holds: Unavailable, with the
        log's tail, if `name` exits first or START_TIMEOUT_S passes."""

        def check() -> bool:
            with contextlib.suppress(httpx.HTTPError, OSError):
                return ready()
            return False

        wait_until(check, self.started[name], what, self.logs / f"{name}.log", START_TIMEOUT_S)

    def tail(self, name: str, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / f"{name}.log").read_text(errors="replace")[-chars:]
        return ""

    def stop_all(self) -> None:
        for proc in reversed(self.started.values()):
            stop(proc)


# --- the parts ------------------------------------------------------------------------------------------


async def upload(s3: LocalS3, key: str, data: bytes) -> None:
    async with S3Client(s3.endpoint, region=S3_REGION, credentials=s3.credentials, trust_env=False) as client:
        await client.put_bytes(s3.bucket, key, data)


@attrs.define
class Cluster:
    url: str
    admin: httpx.Client
    inference_key: str
    controller_pid: int
    node_pid: int
    runtime_url: str = ""
    runtime_pid: int = 0


def ok(resp: httpx.Response, *status: int) -> Json:
    if resp.status_code not in (status or (200, 201)):
        raise RuntimeError(f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {resp.text[:500]}")
    body: Json = resp.json()
    return body


def start_cluster(
    procs: Processes, base: Path, registry: LocalRegistry, s3: LocalS3, args: argparse.Namespace
) -> Cluster:
    image = registry.push_empty_image("nexa-perf/sim")
    http_port, channel_port = free_ports(2)
    creds = write_s3_credentials(base / "s3-credentials.json", s3.credentials)
    config = base / "control.toml"
    config.write_text(
        f'state_dir = "{base / "control"}"\n'
        f'[http]\nlisten = "127.0.0.1:{http_port}"\n'
        f'[channel]\nlisten = "tcp://127.0.0.1:{channel_port}"\n'
        "[oci]\ntls_verify = false\n"
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{S3_REGION}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        '[log]\nlevel = "warning"\n'
    )
    profile = ["-m", "cProfile", "-o", args.profile_controller] if args.profile_controller else []
    controller = procs.start("control", [sys.executable, *profile, "-m", "nexa", "control", "--config", str(config)])
    url = f"http://127.0.0.1:{http_port}"
    procs.wait("control", lambda: "listening on" in procs.tail("control"), "nexa control")
    admin_key = next(
        line.split("=", 1)[1].strip() for line in procs.tail("control", 100_000).splitlines() if "NEXA_TOKEN=" in line
    )
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)

    ok(admin.post("/api/v1/tenants", json={"id": "perf"}))
    key = ok(admin.post("/api/v1/keys", json={"role": "inference", "tenant": "perf"}))["key"]
    ok(admin.post("/api/v1/runtimes", json={"name": "sim", "kind": "sim", "version": "1", "image": image}))
    artifact = secrets.token_bytes(200_000)
    trio.run(upload, s3, "perf/tiny.gguf", artifact)
    model = {
        "name": "tiny",
        "version": "v1",
        "artifact": {
            "uri": s3.uri("perf/tiny.gguf"),
            "sha256": hashlib.sha256(artifact).hexdigest(),
            "size_bytes": len(artifact),
        },
        "format": "gguf",
        "memory_bytes": 2 * 2**30,
        "provenance": {"source": "https://huggingface.co/org/tiny@abc123", "signer": "perf"},
        "license": {"spdx_id": "Apache-2.0", "accepted_by": "perf@example.com", "expires_at": None},
    }
    ok(admin.post("/api/v1/models", json=model))
    ok(admin.post("/api/v1/models/tiny/v1/verify"))
    ok(admin.post("/api/v1/models/tiny/v1/evaluations", json={"suite": "smoke", "metrics": {"a": 1}, "passed": True}))
    ok(admin.post("/api/v1/models/tiny/v1/approve"))
    ok(admin.post("/api/v1/aliases/chat/promote", json={"model": "tiny", "version": "v1"}))

    node_dir = base / "node"
    inventory = base / "node-inventory.json"
    inventory.write_text(json.dumps({"labels": {"board": "sim"}, "runtimes": ["sim"]}))
    node_config = base / "node.toml"
    node_config.write_text(
        f'state_dir = "{node_dir}"\ninventory_path = "{inventory}"\n'
        f'source_address = "{NODE_HOST}"\nruntime_host = "{NODE_HOST}"\nsimulation = true\n'
        '[log]\nlevel = "warning"\n'
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{S3_REGION}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        "[supervisor]\nreconcile_interval_s = 1\n"
    )
    token = ok(admin.post("/api/v1/enrollment-tokens", json={"ttl_s": 600}))["token"]
    enroll = [sys.executable, "-m", "nexa", "node", "enroll", "--controller", url, "--token", token]
    enroll += ["--name", "perf-node", "--state-dir", str(node_dir)]
    done = subprocess.run(enroll, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nexa node enroll failed: {done.stderr[-2000:]}")
    env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"}
    profile = ["-m", "cProfile", "-o", args.profile_node] if args.profile_node else []
    node = procs.start("node", [sys.executable, *profile, "-m", "nexa", "node", "--config", str(node_config)], env=env)
    procs.wait("node", lambda: any(n["state"] == "Ready" for n in ok(admin.get("/api/v1/nodes"))["nodes"]), "node")

    port = free_ports(1, NODE_HOST)[0]
    sim = ["--ttft-ms", "0", "--tokens-per-s", str(args.tokens_per_s), "--output-tokens", str(args.stream_tokens)]
    deployment = {
        "name": "perf",
        "runtime": "sim",
        "alias": "chat",
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 64 * 2**20, "cpus": 0.5},
        "options": {"port": port, "command": sim},
    }
    ok(admin.post("/api/v1/deployments", json=deployment))

    def ready() -> bool:
        dep = ok(admin.get("/api/v1/deployments/perf"))["deployment"]
        states = {
            a["assignment_id"]: a["state"] for n in ok(admin.get("/api/v1/nodes"))["nodes"] for a in n["assignments"]
        }
        return bool(dep["placed"]) and all(states.get(r["id"]) == "Ready" for r in dep["placed"])

    procs.wait("node", ready, "the sim deployment")
    cluster = Cluster(url=url, admin=admin, inference_key=key, controller_pid=controller.pid, node_pid=node.pid)
    cluster.runtime_url = f"http://{NODE_HOST}:{port}"
    runtimes = children_of(node.pid)
    cluster.runtime_pid = runtimes[0] if runtimes else 0
    return cluster


def litellm_python() -> Path:
    """The venv with `litellm[proxy]`, created on first use."""
    python = LITELLM_VENV / "bin" / "python"
    if (LITELLM_VENV / "bin" / "litellm").exists():
        return python
    print(f"installing litellm[proxy] into {LITELLM_VENV} (first use) ...", flush=True)
    LITELLM_VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", str(LITELLM_VENV)], check=True, timeout=300)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "litellm[proxy]"],
        check=True,
        timeout=900,
        stdout=subprocess.DEVNULL,
    )
    return python


def start_litellm(procs: Processes, base: Path, upstream: str) -> tuple[str, str, int]:
    """LiteLLM proxy (one worker) with the sim runtime as the OpenAI-compatible upstream of `chat`.

    Returns its URL, its master key (it refuses to start without one) and its PID."""
    litellm_python()
    port = free_ports(1)[0]
    master_key = "sk-" + secrets.token_hex(16)
    config = base / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: chat\n"
        "    litellm_params:\n"
        "      model: openai/chat\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: sk-perf\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: true\n"
        "general_settings:\n"
        f"  master_key: {master_key}\n"
    )
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "NO_PROXY": "*",
    }
    env.pop("DATABASE_URL", None)
    argv = [str(LITELLM_VENV / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--num_workers", "1"]
    proc = procs.start("litellm", argv, env=env, cwd=base)
    url = f"http://127.0.0.1:{port}"
    body = {"model": "chat", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    auth = {"Authorization": f"Bearer {master_key}"}
    procs.wait(
        "litellm",
        lambda: httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=10).status_code == 200,
        "litellm",
    )
    return url, master_key, proc.pid


# --- the points (the load generator is perf/loadgen.py) ------------------------------------------------


def measure(target: Target, mode: str, conc: int, args: argparse.Namespace, watched: dict[str, int]) -> Point:
    """One point against `target`: a chat completion of `chat`, streamed when `mode` is "stream"."""
    stream = mode == "stream"
    payload: Json = {"model": "chat", "messages": [{"role": "user", "content": PROMPT}]}
    payload["max_tokens"] = args.stream_tokens if stream else args.unary_tokens
    if stream:
        payload["stream"] = True
    return run_point(
        target,
        mode,
        conc,
        json.dumps(payload).encode(),
        seconds=args.seconds,
        warmup_s=args.warmup_s,
        client_procs=args.client_procs,
        watched=watched,
    )


# --- report ---------------------------------------------------------------------------------------------


def fmt(value: float, spec: str = ".2f") -> str:
    return "-" if value != value else format(value, spec)  # NaN → "-"


def report(points: list[Point], targets: list[str]) -> None:
    by = {(p.target, p.mode, p.conc): p for p in points}
    cpu_names = sorted({n for p in points for n in p.cpu})
    print()
    print("unary chat completions (latency in ms; added = minus direct at the same concurrency)")
    head = f"{'target':<9} {'c':>3} {'req/s':>9} {'p50':>8} {'p99':>8} {'+p50':>8} {'+p99':>8} {'errors':>8}"
    head += "  CPU % of one core"
    print(head)
    for p in points:
        if p.mode != "unary":
            continue
        d = by.get(("direct", "unary", p.conc))
        add50 = p.lat(0.5) - d.lat(0.5) if d and p.target != "direct" else float("nan")
        add99 = p.lat(0.99) - d.lat(0.99) if d and p.target != "direct" else float("nan")
        cpu = " ".join(f"{n}={p.cpu[n] * 100:.0f}" for n in cpu_names if n in p.cpu)
        errs = sum(p.result.errors.values())
        if p.result.latencies:
            n_req = len(p.result.latencies)
            per = {n: p.cpu[n] * p.seconds / n_req * 1000 for n in ("control", "node", "sim", "litellm") if n in p.cpu}
            cpu += "  | CPU ms/req " + " ".join(f"{n}={v:.2f}" for n, v in per.items() if v >= 0.01)
        print(
            f"{p.target:<9} {p.conc:>3} {p.rps:>9.0f} {fmt(p.lat(0.5)):>8} {fmt(p.lat(0.99)):>8} "
            f"{fmt(add50):>8} {fmt(add99):>8} {errs:>8}  {cpu}"
        )
    print()
    print("streaming chat completions (TTFT = time to the first SSE event, ms; chunks = SSE events)")
    print(
        f"{'target':<9} {'c':>3} {'TTFT p50':>9} {'TTFT p99':>9} {'+p50':>8} {'chunks/s':>10} {'streams/s':>9}"
        f" {'errors':>7}  CPU %"
    )
    for p in points:
        if p.mode != "stream":
            continue
        d = by.get(("direct", "stream", p.conc))
        add50 = p.ttft(0.5) - d.ttft(0.5) if d and p.target != "direct" else float("nan")
        cpu = " ".join(f"{n}={p.cpu[n] * 100:.0f}" for n in cpu_names if n in p.cpu)
        print(
            f"{p.target:<9} {p.conc:>3} {fmt(p.ttft(0.5)):>9} {fmt(p.ttft(0.99)):>9} {fmt(add50):>8} "
            f"{p.chunks_per_s:>10.0f} {p.rps:>9.1f} {sum(p.result.errors.values()):>7}  {cpu}"
        )
    errors = {f"{p.target}/{p.mode}/c{p.conc}": p.result.errors for p in points if p.result.errors}
    if errors:
        print("errors:", json.dumps(errors))
    print()
    print("ratios (unary req/s and p50 latency; streaming chunks/s and TTFT p50)")
    pairs = [("control", "direct"), ("litellm", "direct"), ("control", "litellm")]
    for a, b in pairs:
        if a not in targets or b not in targets:
            continue
        parts = []
        for mode, conc in sorted({(p.mode, p.conc) for p in points}, key=lambda k: (k[0] != "unary", k[1])):
            pa, pb = by.get((a, mode, conc)), by.get((b, mode, conc))
            if not pa or not pb:
                continue
            if mode == "unary":
                rate = pa.rps / pb.rps if pb.rps else float("nan")
                lat = pa.lat(0.5) / pb.lat(0.5)
                parts.append(f"unary c{conc}: req/s x{fmt(rate)} p50 x{fmt(lat)}")
            else:
                rate = pa.chunks_per_s / pb.chunks_per_s if pb.chunks_per_s else float("nan")
                ttft = pa.ttft(0.5) / pb.ttft(0.5)
                parts.append(f"stream c{conc}: chunks/s x{fmt(rate)} TTFT p50 x{fmt(ttft)}")
        print(f"  {a} / {b}: " + "; ".join(parts))
    print()
    print("DESIGN.md §7 targets: control adds <= 1 ms p50 at c=1; >= 2,000 req/s at c=16 through control;")
    print("  >= 100,000 chunks/s relayed; <= 1 ms added to the first chunk p50 unloaded.")
    print("  reference: LiteLLM proxy +17 ms, ~52 req/s per worker, ~620 chunks/s.")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="unmeasured seconds before each point")
    parser.add_argument("--concurrency", default="1,16,64", help="unary concurrencies")
    parser.add_argument("--stream-concurrency", default="1,16", help="streaming concurrencies")
    parser.add_argument("--unary-tokens", type=int, default=16, help="max_tokens of a unary request")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens of a streamed answer")
    parser.add_argument("--tokens-per-s", type=float, default=100000.0, help="the sim runtime's token rate")
    parser.add_argument("--client-procs", type=int, default=1, help="load-generator processes (at most c)")
    parser.add_argument("--targets", default="direct,control,litellm", help="which to measure, in order")
    parser.add_argument("--profile-controller", default="", help="run the controller under cProfile, to this file")
    parser.add_argument("--profile-node", default="", help="run the node agent under cProfile, to this file")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    stream_concs = [int(c) for c in args.stream_concurrency.split(",") if c.strip()]
    print(f"machine: {os.cpu_count()} CPUs; {args.seconds:g} s per point; client processes: {args.client_procs}")

    with tempfile.TemporaryDirectory(prefix="nexa-perf-") as tmp, contextlib.ExitStack() as parts:
        base = Path(tmp)
        (base / "logs").mkdir()
        registry = LocalRegistry(base / "registry")
        parts.callback(registry.stop)
        credentials = S3Credentials(access_key_id="nexa-perf", secret_access_key=secrets.token_hex(16))
        s3 = LocalS3(root=base / "seaweedfs", bucket=S3_BUCKET, credentials=credentials)
        parts.callback(s3.stop)
        procs = Processes(base / "logs")
        parts.callback(procs.stop_all)
        started = time.monotonic()
        registry.start()
        s3.start()
        cluster = start_cluster(procs, base, registry, s3, args)
        print(f"set up registry, S3, controller, node and sim deployment in {time.monotonic() - started:.1f} s")
        watched = {"control": cluster.controller_pid, "node": cluster.node_pid}
        if cluster.runtime_pid:
            watched["sim"] = cluster.runtime_pid
        rt = httpx.URL(cluster.runtime_url)
        ctl = httpx.URL(cluster.url)
        assert rt.port is not None
        assert ctl.port is not None
        targets = {
            "direct": Target("direct", rt.host, rt.port, "/v1/chat/completions", ""),
            "control": Target("control", ctl.host, ctl.port, "/v1/chat/completions", cluster.inference_key),
        }
        if "litellm" in wanted:
            try:
                url, master_key, pid = start_litellm(procs, base, cluster.runtime_url)
            except (RuntimeError, Unavailable, OSError, subprocess.SubprocessError) as exc:
                print(f"LiteLLM proxy could not start ({exc}); measuring the others")
                print(procs.tail("litellm", 1500))
            else:
                lu = httpx.URL(url)
                assert lu.port is not None
                targets["litellm"] = Target("litellm", lu.host, lu.port, "/v1/chat/completions", master_key)
                watched["litellm"] = pid
                version = subprocess.run(
                    [
                        str(LITELLM_VENV / "bin" / "python"),
                        "-c",
                        "import importlib.metadata as m; print(m.version('litellm'))",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                print(f"LiteLLM proxy {version.stdout.strip()} (1 worker) on {url}")
        order = [t for t in wanted if t in targets]
        points = []
        for name in order:
            for conc in concs:
                points.append(measure(targets[name], "unary", conc, args, watched))
                p = points[-1]
                print(f"  {name} unary c={conc}: {p.rps:.0f} req/s p50 {fmt(p.lat(0.5))} ms", flush=True)
            for conc in stream_concs:
                points.append(measure(targets[name], "stream", conc, args, watched))
                p = points[-1]
                print(
                    f"  {name} stream c={conc}: {p.chunks_per_s:.0f} chunks/s TTFT p50 {fmt(p.ttft(0.5))} ms",
                    flush=True,
                )
        report(points, order)
    return 0


if __name__ == "__main__":
    sys.exit(main())
