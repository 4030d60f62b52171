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

`--modes native` (perf/gateway_native.py) measures the gateways with a C load generator and a paced C
upstream (perf/c/, built by perf/native.py) that cost tens of µs per event at most where a Python gateway
costs hundreds, vllm-router too: CPU µs per relayed event and per request by process, the added p50 at
c=1 and the TTFC.

    .venv/bin/python perf/gateway.py --seconds 5
    .venv/bin/python perf/gateway.py --modes native --native-streams 1000 --native-seconds 10
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shlex
import shutil
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
from nexa.s3.client import S3Client
from nexa.s3.credentials import write_s3_credentials
from nexa.sigv4 import S3Credentials
from perf import gateway_native
from perf.loadgen import Point, Target, run_point
from perf.native import PacedUpstream
from perf.upstream import Nginx, sse_body, unary_body, wrk_point

Json = dict[str, Any]
#: The node's loopback address: its agent dials from it and its runtimes listen on it.
NODE_HOST = "127.0.0.7"
START_TIMEOUT_S = 60.0
#: LiteLLM proxy imports for a minute or more on a busy 2-core machine.
LITELLM_START_TIMEOUT_S = 300.0
S3_BUCKET = "nexa-models"
PERF_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nexa-perf"
LITELLM_VENV = PERF_CACHE / "litellm-venv"
VLLM_ROUTER_VENV = PERF_CACHE / "vllm-router-venv"
PROMPT = "say something short about the weather"
#: The model name (an alias of the one model) each kind of request asks for: nginx answers one
#: fixed body per port, so unary and streamed requests reach different deployments.
ALIASES = {"unary": "chat", "stream": "chat-stream", "paced": "chat-paced", "native": gateway_native.ALIAS}
#: The paced-stream test's token rate per stream, and the most streams it tries.
PACED_TOKENS_PER_S = 20
MAX_STREAMS = 8192


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

    def wait(self, name: str, ready: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll `ready` (a refused connection counts as not yet) until it holds: Unavailable, with the
        log's tail, if `name` exits first or `timeout_s` passes."""

        def check() -> bool:
            with contextlib.suppress(httpx.HTTPError, OSError):
                return ready()
            return False

        wait_until(check, self.started[name], what, self.logs / f"{name}.log", timeout_s)

    def tail(self, name: str, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / f"{name}.log").read_text(errors="replace")[-chars:]
        return ""

    def stop_all(self) -> None:
        # A long grace: hypercorn drains for up to its graceful timeout (10 s), and a process run
        # under cProfile (--profile-controller/--profile-node) writes its profile only on a clean exit.
        for proc in reversed(self.started.values()):
            stop(proc, grace_s=60.0)


# --- the parts ------------------------------------------------------------------------------------------


def local_parts(
    base: Path, parts: contextlib.ExitStack, keep_logs: str = ""
) -> tuple[LocalRegistry, LocalS3, Processes]:
    """A run's OCI registry, SeaweedFS S3 (a fresh key) and process table under `base`, logs in `base/logs`; none
    started yet. `parts` stops them: the processes first, then (with `keep_logs`) copies their logs there."""
    (base / "logs").mkdir()
    registry = LocalRegistry(base / "registry")
    parts.callback(registry.stop)
    credentials = S3Credentials(access_key_id="nexa-perf", secret_access_key=secrets.token_hex(16))
    s3 = LocalS3(root=base / "seaweedfs", bucket=S3_BUCKET, credentials=credentials)
    parts.callback(s3.stop)
    procs = Processes(base / "logs")
    if keep_logs:
        parts.callback(shutil.copytree, base / "logs", keep_logs, dirs_exist_ok=True)
    parts.callback(procs.stop_all)
    return registry, s3, procs


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
    #: The sim runtime of the paced deployment (the others are stand-ins, see `deploy`).
    runtime_pid: int = 0


def ok(resp: httpx.Response, *status: int) -> Json:
    if resp.status_code not in (status or (200, 201)):
        raise RuntimeError(f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {resp.text[:500]}")
    body: Json = resp.json()
    return body


def start_control(
    procs: Processes, base: Path, s3: LocalS3, creds: Path, extra_toml: str = "", profile_to: str = ""
) -> tuple[str, httpx.Client, subprocess.Popen[bytes]]:
    """`nexa control` on free loopback ports, verifying against `s3`: its URL, an admin client, its process."""
    http_port, channel_port = free_ports(2)
    config = base / "control.toml"
    config.write_text(
        f'state_dir = "{base / "control"}"\n'
        f'[http]\nlisten = "127.0.0.1:{http_port}"\n'
        f'[channel]\nlisten = "tcp://127.0.0.1:{channel_port}"\n'
        "[oci]\ntls_verify = false\n"
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{S3_REGION}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        '[log]\nlevel = "warning"\n'
        f"{extra_toml}"
    )
    profile = ["-m", "cProfile", "-o", profile_to] if profile_to else []
    controller = procs.start("control", [sys.executable, *profile, "-m", "nexa", "control", "--config", str(config)])
    url = f"http://127.0.0.1:{http_port}"
    procs.wait("control", lambda: "listening on" in procs.tail("control"), "nexa control")
    admin_key = next(
        line.split("=", 1)[1].strip() for line in procs.tail("control", 100_000).splitlines() if "NEXA_TOKEN=" in line
    )
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)
    return url, admin, controller


def register_model(admin: httpx.Client, s3: LocalS3, name: str, alias: str, artifact: bytes) -> None:
    """`name@v1` over the artifact uploaded at `perf/tiny.gguf`: verified, evaluated, approved, aliased `alias`."""
    model = {
        "name": name,
        "version": "v1",
        "artifact": {
            "uri": s3.uri("perf/tiny.gguf"),
            "sha256": hashlib.sha256(artifact).hexdigest(),
            "size_bytes": len(artifact),
        },
        "format": "gguf",
        "memory_bytes": 2**30,
        "provenance": {"source": "https://huggingface.co/org/tiny@abc123", "signer": "perf"},
        "license": {"spdx_id": "Apache-2.0", "accepted_by": "perf@example.com", "expires_at": None},
    }
    ok(admin.post("/api/v1/models", json=model))
    ok(admin.post(f"/api/v1/models/{name}/v1/verify"))
    evaluation = {"suite": "smoke", "metrics": {"a": 1}, "passed": True}
    ok(admin.post(f"/api/v1/models/{name}/v1/evaluations", json=evaluation))
    ok(admin.post(f"/api/v1/models/{name}/v1/approve"))
    ok(admin.post(f"/api/v1/aliases/{alias}/promote", json={"model": name, "version": "v1"}))


def start_cluster(
    procs: Processes,
    base: Path,
    registry: LocalRegistry,
    s3: LocalS3,
    args: argparse.Namespace,
    upstream_ports: dict[str, int],
) -> Cluster:
    image = registry.push_empty_image("nexa-perf/sim")
    creds = write_s3_credentials(base / "s3-credentials.json", s3.credentials)
    # The paced-stream test holds thousands of streams on one replica at once.
    gateway = f"[gateway]\nmax_inflight_per_replica = {MAX_STREAMS}\nqueue_depth = {MAX_STREAMS}\n"
    url, admin, controller = start_control(procs, base, s3, creds, gateway, args.profile_controller)

    ok(admin.post("/api/v1/tenants", json={"id": "perf"}))
    key = ok(admin.post("/api/v1/keys", json={"role": "inference", "tenant": "perf"}))["key"]
    ok(admin.post("/api/v1/runtimes", json={"name": "sim", "kind": "sim", "version": "1", "image": image}))
    artifact = secrets.token_bytes(200_000)
    trio.run(upload, s3, "perf/tiny.gguf", artifact)
    # One model per alias: a model's requests go to every deployment of it, whatever its alias.
    for mode, alias in ALIASES.items():
        register_model(admin, s3, f"tiny-{mode}", alias, artifact)

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
        f"[relay]\nmax_inflight = {MAX_STREAMS}\n"
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

    # The nginx (and paced C upstream) deployments: the agent relays to the spec's port, where the
    # upstream of every target listens; the sim runtime it supervises there is a stand-in that `--port`
    # moves aside (a later flag wins over the one the node puts first), so its /health probe reaches the upstream.
    for mode, port in upstream_ports.items():
        stand_in = ["--port", str(free_ports(1, NODE_HOST)[0])]
        deploy(admin, f"perf-{mode}", ALIASES[mode], port, stand_in)
    paced = ["--ttft-ms", "0", "--tokens-per-s", str(PACED_TOKENS_PER_S), "--output-tokens", str(args.paced_tokens)]
    deploy(admin, "perf-paced", ALIASES["paced"], free_ports(1, NODE_HOST)[0], paced, args.paced_replicas)
    names = [f"perf-{mode}" for mode in (*upstream_ports, "paced")]

    def ready() -> bool:
        deps = [ok(admin.get(f"/api/v1/deployments/{name}"))["deployment"] for name in names]
        states = {
            a["assignment_id"]: a["state"] for n in ok(admin.get("/api/v1/nodes"))["nodes"] for a in n["assignments"]
        }
        return all(bool(d["placed"]) and all(states.get(r["id"]) == "Ready" for r in d["placed"]) for d in deps)

    procs.wait("node", ready, "the deployments")
    cluster = Cluster(url=url, admin=admin, inference_key=key, controller_pid=controller.pid, node_pid=node.pid)
    runtimes = [pid for pid in children_of(node.pid) if "--tokens-per-s" in proc_cmdline(pid)]
    cluster.runtime_pid = runtimes[0] if runtimes else 0
    return cluster


def proc_cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    return []


def deploy(admin: httpx.Client, name: str, alias: str, port: int, command: list[str], replicas: int = 1) -> None:
    deployment = {
        "name": name,
        "runtime": "sim",
        "alias": alias,
        "replicas": replicas,
        "resources": {"accelerators": 0, "memory_bytes": 64 * 2**20, "cpus": 0.25},
        "options": {"port": port, "command": command},
    }
    ok(admin.post("/api/v1/deployments", json=deployment))


def cached_venv(venv: Path, requirement: str, executable: str) -> Path:
    """The venv at `venv` with `requirement` installed (on first use, from PyPI); its `executable`."""
    found = venv / "bin" / executable
    if found.exists():
        return found
    print(f"installing {requirement} into {venv} (first use) ...", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", requirement],
        check=True,
        timeout=900,
        stdout=subprocess.DEVNULL,
    )
    return found


def litellm_python() -> Path:
    """The venv with `litellm[proxy]`, created on first use."""
    cached_venv(LITELLM_VENV, "litellm[proxy]", "litellm")
    return LITELLM_VENV / "bin" / "python"


def start_litellm(procs: Processes, base: Path, upstreams: dict[str, str]) -> tuple[str, str, int]:
    """LiteLLM proxy (one worker) with each model name's OpenAI-compatible upstream (nginx's ports).

    Returns its URL, its master key (it refuses to start without one) and its PID."""
    litellm_python()
    port = free_ports(1)[0]
    master_key = "sk-" + secrets.token_hex(16)
    config = base / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        + "".join(
            f"  - model_name: {model}\n    litellm_params:\n      model: openai/{model}\n"
            f"      api_base: {upstream}/v1\n      api_key: sk-perf\n"
            for model, upstream in upstreams.items()
        )
        + "litellm_settings:\n"
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
        LITELLM_START_TIMEOUT_S,
    )
    return url, master_key, proc.pid


def package_version(venv: Path, package: str) -> str:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout.strip()


def start_vllm_router(procs: Processes, upstream: str) -> tuple[str, int]:
    """vllm-router (the vLLM project's Rust router, PyPI `vllm-router`, installed on first use into its own
    venv) with `upstream` as its one worker; its URL and PID. It routes by worker, not by model name."""
    router = cached_venv(VLLM_ROUTER_VENV, "vllm-router", "vllm-router")
    port = free_ports(1)[0]
    argv = [str(router), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream]
    argv += ["--policy", "round_robin", "--log-level", "warning"]
    argv += ["--max-concurrent-requests", str(MAX_STREAMS), "--queue-size", str(MAX_STREAMS)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_ports(1)[0])]
    proc = procs.start("vllm-router", argv)
    url = f"http://127.0.0.1:{port}"
    body = {"model": gateway_native.ALIAS, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    procs.wait(
        "vllm-router",
        lambda: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 200,
        "vllm-router",
    )
    return url, proc.pid


# --- the points (the load generator is perf/loadgen.py) ------------------------------------------------


def request_body(mode: str, tokens: int) -> bytes:
    """A chat completion request of `mode`'s alias; streamed (with usage asked for) unless unary."""
    payload: Json = {"model": ALIASES[mode], "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens}
    if mode != "unary":
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    return json.dumps(payload).encode()


def measure(target: Target, mode: str, conc: int, args: argparse.Namespace, watched: dict[str, int]) -> Point:
    """One point against `target`: unary by wrk, streamed by perf/loadgen.py (wrk cannot time a first chunk)."""
    if mode == "unary":
        body = request_body(mode, args.unary_tokens)
        return wrk_point(
            target,
            conc,
            body,
            seconds=args.seconds,
            warmup_s=args.warmup_s,
            threads=args.wrk_threads,
            watched=watched,
            scripts=args.base,
        )
    body = request_body(mode, args.stream_tokens)
    return run_point(
        target,
        mode,
        conc,
        body,
        seconds=args.seconds,
        warmup_s=args.warmup_s,
        client_procs=args.client_procs,
        watched=watched,
    )


@attrs.frozen
class PacedStep:
    streams: int
    point: Point
    #: A stream is behind when it ends later than BEHIND_FACTOR x its nominal duration after it was sent.
    behind: int
    expected: int

    @property
    def ok(self) -> bool:
        errors = sum(self.point.result.errors.values())
        ttfc_ok = self.point.ttft(0.99) < PACED_TTFC_P99_MS
        return not errors and not self.behind and self.point.count >= self.expected and ttfc_ok


#: Pass marks of the paced-stream test.
PACED_TTFC_P99_MS = 250.0
BEHIND_FACTOR = 1.2


def paced(target: Target, args: argparse.Namespace, watched: dict[str, int]) -> list[PacedStep]:
    """N streams at once, each `--paced-tokens` tokens at 20 tokens/s, for N in `--paced-streams` until one fails.

    The N connections start spread over one nominal duration (so N streams run at once, arriving
    evenly, not in one burst), then each streams back to back; the step lasts ROUNDS + 1.5 nominal
    durations. It passes when every stream completed its rounds (N x ROUNDS streams), none ended later than
    BEHIND_FACTOR x its nominal duration (`--paced-tokens` / 20 s) after it was sent, the time to its
    first chunk stayed under PACED_TTFC_P99_MS at p99, and there was no error."""
    nominal = args.paced_tokens / PACED_TOKENS_PER_S
    body = request_body("paced", args.paced_tokens)
    steps = []
    for n in [int(c) for c in args.paced_streams.split(",") if c.strip()]:
        point = run_point(
            target,
            "paced",
            n,
            body,
            seconds=nominal * (PACED_ROUNDS + 1.5),
            warmup_s=args.warmup_s,
            client_procs=args.client_procs,
            watched=watched,
            stagger_s=nominal,
        )
        behind = sum(1 for lat in point.result.latencies if lat > BEHIND_FACTOR * nominal)
        steps.append(PacedStep(streams=n, point=point, behind=behind, expected=n * PACED_ROUNDS))
        step = steps[-1]
        print(
            f"  paced N={n}: {'ok' if step.ok else 'FAILED'}: {point.count}/{step.expected} streams, "
            f"{behind} behind, TTFC p99 {fmt(point.ttft(0.99))} ms, {point.chunks_per_s:.0f} chunks/s, "
            f"errors {sum(point.result.errors.values())}, control CPU {point.cpu.get('control', 0) * 100:.0f} %",
            flush=True,
        )
        if not step.ok:
            break
    return steps


#: Streams each connection of a paced step runs back to back.
PACED_ROUNDS = 2


# --- report ---------------------------------------------------------------------------------------------


def fmt(value: float, spec: str = ".2f") -> str:
    return "-" if value != value else format(value, spec)  # NaN → "-"


def cpu_ms(p: Point, name: str, per: int) -> float:
    """`name`'s CPU milliseconds per `per` (requests or chunks) over the point's window."""
    return p.cpu[name] * p.seconds / per * 1000 if per and name in p.cpu else float("nan")


#: The processes whose CPU per request / per chunk is reported (the client's is a share only).
PER_REQUEST = ("control", "node", "nginx", "sim", "litellm")


def report(points: list[Point], targets: list[str], steps: list[PacedStep]) -> None:
    by = {(p.target, p.mode, p.conc): p for p in points}
    print()
    print("unary chat completions by wrk (latency in ms; added = minus direct at the same concurrency)")
    print(
        f"{'target':<9} {'c':>3} {'req/s':>9} {'p50':>8} {'p99':>8} {'+p50':>8} {'+p99':>8} {'errors':>7}"
        "  CPU ms per request | CPU % of one core"
    )
    for p in points:
        if p.mode != "unary":
            continue
        d = by.get(("direct", "unary", p.conc))
        add50 = p.lat(0.5) - d.lat(0.5) if d and p.target != "direct" else float("nan")
        add99 = p.lat(0.99) - d.lat(0.99) if d and p.target != "direct" else float("nan")
        per = " ".join(f"{n}={cpu_ms(p, n, p.count):.3f}" for n in PER_REQUEST if cpu_ms(p, n, p.count) >= 0.001)
        shares = " ".join(f"{n}={v * 100:.0f}" for n, v in sorted(p.cpu.items()))
        print(
            f"{p.target:<9} {p.conc:>3} {p.rps:>9.0f} {fmt(p.lat(0.5)):>8} {fmt(p.lat(0.99)):>8} "
            f"{fmt(add50):>8} {fmt(add99):>8} {sum(p.result.errors.values()):>7}  {per} | {shares}"
        )
    print()
    print(
        "streaming chat completions by perf/loadgen.py (TTFC = time to the first body bytes, ms; chunks = SSE events)"
    )
    print(
        f"{'target':<9} {'c':>3} {'TTFC p50':>9} {'TTFC p99':>9} {'+p50':>8} {'chunks/s':>10} {'streams/s':>9}"
        f" {'errors':>7}  CPU ms per chunk | CPU % of one core"
    )
    for p in points:
        if p.mode != "stream":
            continue
        d = by.get(("direct", "stream", p.conc))
        add50 = p.ttft(0.5) - d.ttft(0.5) if d and p.target != "direct" else float("nan")
        events = p.result.events
        per = " ".join(f"{n}={cpu_ms(p, n, events):.4f}" for n in PER_REQUEST if cpu_ms(p, n, events) >= 0.0001)
        shares = " ".join(f"{n}={v * 100:.0f}" for n, v in sorted(p.cpu.items()))
        print(
            f"{p.target:<9} {p.conc:>3} {fmt(p.ttft(0.5)):>9} {fmt(p.ttft(0.99)):>9} {fmt(add50):>8} "
            f"{p.chunks_per_s:>10.0f} {p.rps:>9.1f} {sum(p.result.errors.values()):>7}  {per} | {shares}"
        )
    errors = {f"{p.target}/{p.mode}/c{p.conc}": p.result.errors for p in points if p.result.errors}
    if errors:
        print("errors:", json.dumps(errors))
    print()
    print("ratios (unary req/s and p50 latency; streaming chunks/s and TTFC p50)")
    for a, b in [("control", "direct"), ("litellm", "direct"), ("control", "litellm")]:
        if a not in targets or b not in targets:
            continue
        parts = []
        for mode, conc in sorted({(p.mode, p.conc) for p in points}, key=lambda k: (k[0] != "unary", k[1])):
            pa, pb = by.get((a, mode, conc)), by.get((b, mode, conc))
            if not pa or not pb:
                continue
            if mode == "unary":
                rate = pa.rps / pb.rps if pb.rps else float("nan")
                parts.append(f"unary c{conc}: req/s x{fmt(rate)} p50 x{fmt(pa.lat(0.5) / pb.lat(0.5))}")
            else:
                rate = pa.chunks_per_s / pb.chunks_per_s if pb.chunks_per_s else float("nan")
                parts.append(f"stream c{conc}: chunks/s x{fmt(rate)} TTFC p50 x{fmt(pa.ttft(0.5) / pb.ttft(0.5))}")
        print(f"  {a} / {b}: " + "; ".join(parts))
    if steps:
        print()
        print(
            f"paced streams through control ({PACED_TOKENS_PER_S} tokens/s each; pass: TTFC p99 < "
            f"{PACED_TTFC_P99_MS:g} ms, no stream ending later than {BEHIND_FACTOR:g} x tokens/{PACED_TOKENS_PER_S} s, "
            "every stream done, no error)"
        )
        print(
            f"{'N':>6} {'result':>6} {'streams':>9} {'behind':>6} {'TTFC p50':>9} {'TTFC p99':>9}"
            f" {'chunks/s':>9}  CPU %"
        )
        for s in steps:
            p = s.point
            shares = " ".join(f"{n}={v * 100:.0f}" for n, v in sorted(p.cpu.items()))
            print(
                f"{s.streams:>6} {'ok' if s.ok else 'FAIL':>6} {p.count:>4}/{s.expected:<4} {s.behind:>6} "
                f"{fmt(p.ttft(0.5)):>9} {fmt(p.ttft(0.99)):>9} {p.chunks_per_s:>9.0f}  {shares}"
            )
        passed = [s.streams for s in steps if s.ok]
        last = "" if steps[-1].ok else f" (N={steps[-1].streams} failed)"
        print(f"  largest N sustained: {max(passed) if passed else 'none of those tried'}{last}")
    print()
    print("issue 16 targets: controller + agent CPU <= 0.8 ms per unary request; control adds <= 1 ms p50 at c=1;")
    print("  >= 100,000 relayed chunks/s at c=16; >= 2,000 concurrent paced streams.")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="unmeasured seconds before each point")
    parser.add_argument("--concurrency", default="1,16,64", help="unary concurrencies")
    parser.add_argument("--stream-concurrency", default="1,16,64", help="streaming concurrencies")
    parser.add_argument("--unary-tokens", type=int, default=16, help="completion tokens of nginx's unary answer")
    parser.add_argument("--stream-tokens", type=int, default=64, help="content chunks of nginx's streamed answer")
    parser.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (-t; at most c)")
    parser.add_argument("--client-procs", type=int, default=1, help="streaming load-generator processes (at most c)")
    parser.add_argument(
        "--targets", default="direct,control,litellm,vllm-router", help="which to measure (interleaved)"
    )
    parser.add_argument(
        "--modes",
        default="unary,stream,paced",
        help="unary and stream (nginx, wrk, perf/loadgen.py), paced (the sim runtime, through control), "
        "native (the C load generator and paced C upstream; vllm-router is measured only here)",
    )
    parser.add_argument("--paced-streams", default="50,100,200,400,800,1600,3200", help="N to try, until one fails")
    parser.add_argument("--paced-tokens", type=int, default=40, help="tokens per paced stream (at 20 tokens/s)")
    parser.add_argument("--paced-replicas", type=int, default=1, help="sim replicas of the paced deployment")
    parser.add_argument("--native-streams", default="1000", help="native: concurrent paced streams, N[,N...]")
    parser.add_argument("--native-events", type=int, default=40, help="native: content chunks per stream")
    parser.add_argument("--native-rate", type=float, default=20.0, help="native: events per second per stream")
    parser.add_argument("--native-seconds", type=float, default=10.0, help="native: measured seconds per N")
    parser.add_argument("--profile-controller", default="", help="run the controller under cProfile, to this file")
    parser.add_argument("--profile-node", default="", help="run the node agent under cProfile, to this file")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    modes = {m.strip() for m in args.modes.split(",") if m.strip()}
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()] if "unary" in modes else []
    stream_concs = [int(c) for c in args.stream_concurrency.split(",") if c.strip()] if "stream" in modes else []
    print(f"machine: {os.cpu_count()} CPUs; {args.seconds:g} s per point; stream client processes: {args.client_procs}")

    with tempfile.TemporaryDirectory(prefix="nexa-perf-") as tmp, contextlib.ExitStack() as parts:
        base = Path(tmp)
        args.base = base
        registry, s3, procs = local_parts(base, parts)
        nginx = Nginx(base / "nginx")
        parts.callback(nginx.stop)
        ports = dict(zip(("unary", "stream"), free_ports(2, NODE_HOST), strict=True))
        nginx.serve(NODE_HOST, ports["unary"], unary_body(ALIASES["unary"], args.unary_tokens), "application/json")
        nginx.serve(NODE_HOST, ports["stream"], sse_body(ALIASES["stream"], args.stream_tokens), "text/event-stream")
        started = time.monotonic()
        nginx_pid = nginx.start()
        print(f"nginx (pid {nginx_pid}) on {NODE_HOST}:{ports['unary']} (unary) and :{ports['stream']} (SSE)")
        upstream = None
        if "native" in modes:
            ports["native"] = free_ports(1, NODE_HOST)[0]
            upstream = PacedUpstream(NODE_HOST, ports["native"], args.native_events, args.native_rate)
            parts.callback(upstream.stop)
            print(f"paced C upstream (pid {upstream.start()}) on {NODE_HOST}:{ports['native']}")
        registry.start()
        s3.start()
        cluster = start_cluster(procs, base, registry, s3, args, ports)
        print(f"set up nginx, registry, S3, controller, node and deployments in {time.monotonic() - started:.1f} s")
        watched = {"control": cluster.controller_pid, "node": cluster.node_pid, "nginx": nginx_pid}
        if upstream is not None and upstream.proc is not None:
            watched["upstream"] = upstream.proc.pid
        ctl = httpx.URL(cluster.url)
        assert ctl.port is not None
        path = "/v1/chat/completions"
        targets = {
            "direct": {mode: Target("direct", NODE_HOST, port, path, "") for mode, port in ports.items()},
            "control": {mode: Target("control", ctl.host, ctl.port, path, cluster.inference_key) for mode in ALIASES},
        }
        if "litellm" in wanted:
            upstreams = {ALIASES[mode]: f"http://{NODE_HOST}:{port}" for mode, port in ports.items()}
            try:
                url, master_key, pid = start_litellm(procs, base, upstreams)
            except (RuntimeError, Unavailable, OSError, subprocess.SubprocessError) as exc:
                print(f"LiteLLM proxy could not start ({exc}); measuring the others")
                print(procs.tail("litellm", 1500))
            else:
                lu = httpx.URL(url)
                assert lu.port is not None
                targets["litellm"] = {mode: Target("litellm", lu.host, lu.port, path, master_key) for mode in ports}
                watched["litellm"] = pid
                print(f"LiteLLM proxy {package_version(LITELLM_VENV, 'litellm')} (1 worker) on {url}")
        if upstream is not None and "vllm-router" in wanted:
            try:
                url, pid = start_vllm_router(procs, upstream.url)
            except (RuntimeError, Unavailable, OSError, subprocess.SubprocessError) as exc:
                print(f"vllm-router could not start ({exc}); measuring the others")
                print(procs.tail("vllm-router", 1500))
            else:
                vu = httpx.URL(url)
                assert vu.port is not None
                targets["vllm-router"] = {"native": Target("vllm-router", vu.host, vu.port, path, "")}
                watched["vllm-router"] = pid
                print(f"vllm-router {package_version(VLLM_ROUTER_VENV, 'vllm-router')} on {url}")
        order = [t for t in wanted if t in targets]
        points = []
        # Interleaved: every target at one (mode, c) before the next, so the machine's noise hits all alike.
        for mode, conc in [("unary", c) for c in concs] + [("stream", c) for c in stream_concs]:
            for name in order:
                if mode not in targets[name]:
                    continue
                points.append(measure(targets[name][mode], mode, conc, args, watched))
                p = points[-1]
                if mode == "unary":
                    print(f"  {name} unary c={conc}: {p.rps:.0f} req/s p50 {fmt(p.lat(0.5))} ms", flush=True)
                else:
                    print(
                        f"  {name} stream c={conc}: {p.chunks_per_s:.0f} chunks/s TTFC p50 {fmt(p.ttft(0.5))} ms",
                        flush=True,
                    )
        steps: list[PacedStep] = []
        if "paced" in modes and "control" in targets and args.paced_streams.strip():
            paced_watched = {"control": cluster.controller_pid, "node": cluster.node_pid}
            if cluster.runtime_pid:
                paced_watched["sim"] = cluster.runtime_pid
            steps = paced(targets["control"]["paced"], args, paced_watched)
        rows = []
        if upstream is not None:
            native = [name for name in order if "native" in targets[name]]
            rows = gateway_native.measure({n: targets[n]["native"] for n in native}, native, args, watched, base)
        if points or steps:
            report(points, order, steps)
        if rows:
            gateway_native.report(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
