"""`nexa demo`: a whole local cluster on this machine, set up the way an operator would set one up.

It starts an OCI registry and an S3-compatible store on loopback (the standard parts a real
installation points at), `nexa control` on the embedded SQLite store, and four `nexa node`
agents dialling from 127.0.0.11 to .14, each running `sim` runtimes (simulation only). Then,
through the controller's HTTP API only: a tenant and an inference key, the `sim` runtime
(its placeholder image pushed to the registry and checked by digest), a model whose artifact is
uploaded to the store and verified by the controller, evaluated, approved and aliased as
`chat`, and a deployment of it. It prints the console URL, the keys and ready-to-paste `curl` and
`openai` examples; Ctrl-C stops everything it started, by PID, and waits for it.

With `real`, the runtime is the real llama.cpp one instead: a private rootful podman service under
`state_dir`, a llama-cpp-python image built here (on a cached Debian python root filesystem) and pushed
to the demo's registry, and a tiny generated llama GGUF as the model; the agents run it in podman on
CPU and remove their containers when they stop.

Each run starts from an empty `state_dir` (the demo's own, never a production one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import trio

from nexa import __version__
from nexa.config import (
    ArtifactStoreConfig,
    BootstrapConfig,
    ChannelConfig,
    ControlConfig,
    HostPort,
    HttpConfig,
    OciConfig,
)
from nexa.contracts import codec
from nexa.contracts.api import EnrollResponse
from nexa.control.service import ControlStarted, serve_control
from nexa.errors import ConfigError, RemoteError, Unavailable
from nexa.localparts import (
    S3_REGION,
    LocalPodman,
    LocalRegistry,
    LocalS3,
    build_llama_image,
    build_python_image,
    cache_dir,
    free_ports,
    llama_parts_missing,
    llama_version,
    project_containers_conf,
    python_rootfs_name,
    stop,
    unmount_below,
)
from nexa.node import identity
from nexa.node.processes import default_argv
from nexa.s3.client import S3Client
from nexa.s3.credentials import write_s3_credentials
from nexa.sigv4 import S3Credentials
from nexa.tinymodel import tiny_gguf

log = logging.getLogger(__name__)

#: The model the demo deploys: a few kilobytes of deterministic bytes (the `sim` runtime reads none).
MODEL_BYTES: Final = hashlib.sha256(b"nexa demo model").digest() * 256
SIM_ARGS: Final = ["--ttft-ms", "60", "--tokens-per-s", "40", "--output-tokens", "32"]
READY_TIMEOUT_S: Final = 60.0
#: How to get what `demo --real` needs, said when something is missing (README, "demo --real").
REAL_PARTS_HINT: Final = (
    "Get it with: sudo apt-get install podman runc debootstrap debian-archive-keyring; "
    ".venv/bin/pip install -e '.[real]' (llama-cpp-python builds from source, ~9 min on 2 cores); "
    "then run nexa demo --real as root"
)
#: A real replica pulls its image, fetches and verifies the GGUF and loads it; two at once on a small machine.
REAL_READY_TIMEOUT_S: Final = 180.0
NODE_STOP_TIMEOUT_S: Final = 15.0
#: Stopping every part, shielded: each bounds its own stop (the agents NODE_STOP_TIMEOUT_S, podman,
#: the S3 store and the registry 10 to 15 s, each then a SIGKILL wait); this is their sum and more.
STOP_PARTS_TIMEOUT_S: Final = 120.0


@attrs.frozen(kw_only=True)
class DemoConfig:
    state_dir: Path
    listen: str = "127.0.0.1:8470"
    nodes: int = 4
    replicas: int = 2
    #: The real llama.cpp runtime (llama-cpp-python in podman, on CPU) instead of `sim`.
    real: bool = False


@attrs.frozen(kw_only=True)
class DemoStarted:
    url: str
    admin_key: str
    inference_key: str
    tenant: str
    alias: str
    nodes: list[str]
    deployment: str


@attrs.frozen(kw_only=True)
class Plan:
    """What differs between the `sim` demo and the real one: the runtime, the model, how it is deployed
    and what the node agents need to run it."""

    runtime: dict[str, str]
    model: str
    #: The model's key in the demo's S3 store, and its bytes (uploaded by `upload_model`).
    artifact_key: str
    artifact: bytes
    source: str
    #: The deployment body less its name, alias and replicas.
    deployment: dict[str, Any]
    simulation: bool
    #: TOML tables added to each node's config.
    node_tables: str = ""
    ready_timeout_s: float = READY_TIMEOUT_S


@attrs.define
class Node:
    name: str
    state_dir: Path
    config: Path
    proc: subprocess.Popen[bytes] | None = None


def _say(line: str) -> None:
    print(line, flush=True)


async def serve_demo(
    cfg: DemoConfig,
    *,
    stopping: trio.Event,
    progress: Callable[[str], None] = _say,
    task_status: trio.TaskStatus[DemoStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the demo until `stopping` is set; supports the nursery start protocol. `progress` gets a line
    for each slow step of a real demo's start."""
    if not 1 <= cfg.nodes <= 4:
        raise ConfigError("--nodes: 1 to 4 (one loopback address each, 127.0.0.11 to 127.0.0.14)")
    if cfg.real and (missing := llama_parts_missing(cache_dir())):
        raise ConfigError(f"demo --real cannot run here; missing: {missing}. {REAL_PARTS_HINT}")
    root = cfg.state_dir.absolute()
    await trio.to_thread.run_sync(empty_dir, root)
    registry = LocalRegistry(root / "registry")
    store = LocalS3(
        root / "s3",
        bucket="nexa-demo",
        credentials=S3Credentials(access_key_id="nexa-demo", secret_access_key=secrets.token_urlsafe(24)),
    )
    podman = LocalPodman(root / "podman", containers_conf=project_containers_conf()) if cfg.real else None
    nodes: list[Node] = []
    try:
        await trio.to_thread.run_sync(registry.start)
        await trio.to_thread.run_sync(store.start)
        if podman is None:
            plan = await trio.to_thread.run_sync(sim_plan, registry)
        else:
            plan = await trio.to_thread.run_sync(_real_plan, podman, registry, root, progress)
        artifact_uri = await upload_model(store, plan)
        creds = write_s3_credentials(root / "s3-credentials.json", store.credentials)
        control = ControlConfig(
            state_dir=str(root / "control"),
            http=HttpConfig(listen=HostPort(cfg.listen)),
            channel=ChannelConfig(listen=f"tcp://127.0.0.1:{free_ports(1)[0]}"),
            oci=OciConfig(tls_verify=False),  # the demo registry is plain HTTP on loopback
            artifacts=ArtifactStoreConfig(
                s3_endpoint=store.endpoint, s3_credentials_file=str(creds), s3_tls_verify=False
            ),
            bootstrap=BootstrapConfig(),
        )
        controller_stopping = trio.Event()
        async with trio.open_nursery() as nursery:
            started: ControlStarted = await nursery.start(partial(serve_control, control, stopping=controller_stopping))
            assert started.admin_key is not None  # a fresh state dir
            url = started.urls[0]
            async with httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {started.admin_key}"}, timeout=30, trust_env=False
            ) as http:
                inference_key = await register_model(http, plan, artifact_uri)
                for i in range(1, cfg.nodes + 1):
                    nodes.append(await enroll_node(http, root, i, store, creds, plan=plan))
                await wait_nodes(http, len(nodes))
                replicas = min(cfg.replicas, cfg.nodes)
                deployment = {"name": "chat", "alias": "chat", "replicas": replicas, **plan.deployment}
                await call(http, "POST", "/api/v1/deployments", deployment)
                if podman is not None:
                    progress(f"deploying `chat` ({replicas} replicas: image pull, model fetch and load)…")
                await wait_ready(http, "chat", replicas, plan.ready_timeout_s)
            task_status.started(
                DemoStarted(
                    url=url,
                    admin_key=started.admin_key,
                    inference_key=inference_key,
                    tenant="demo",
                    alias="chat",
                    nodes=[n.name for n in nodes],
                    deployment="chat",
                )
            )
            await stopping.wait()
            log.info("demo stopping")
            await trio.to_thread.run_sync(stop_nodes, nodes)
            controller_stopping.set()
    finally:
        with trio.move_on_after(STOP_PARTS_TIMEOUT_S, shield=True) as scope:
            # The agents removed their containers; podman.stop removes anything left, then stops the service.
            parts = [lambda: stop_nodes(nodes), *([podman.stop] if podman else []), store.stop, registry.stop]
            await trio.to_thread.run_sync(stop_all, parts)
        if scope.cancel_called:  # the thread is not abandoned: every part was still stopped, late
            log.warning("stopping the demo's parts took over %g s", STOP_PARTS_TIMEOUT_S)


def stop_all(parts: list[Callable[[], None]]) -> None:
    """Stop every part even when stopping another one failed (a podman that hangs must not leave
    the S3 store and the registry running); the first failure is raised after the last part."""
    failed: list[Exception] = []
    for stop_part in parts:
        try:
            stop_part()
        except Exception as exc:
            log.warning("stopping a demo part failed: %s", type(exc).__name__)
            failed.append(exc)
    if failed:
        raise failed[0]


def empty_dir(root: Path) -> None:
    """A fresh, empty state dir (what a killed real demo left mounted in its podman store unmounted first)."""
    if root.exists():
        unmount_below(root)
        shutil.rmtree(root)
    root.mkdir(parents=True)


async def call(http: httpx.AsyncClient, method: str, path: str, body: object | None = None) -> Any:
    response = await http.request(method, path, json=body)
    if response.is_success:
        return response.json() if response.content else None
    try:
        err = response.json()["error"]
        raise RemoteError(err["message"], remote_code=err["code"], status=response.status_code, request_id=None)
    except (ValueError, KeyError, TypeError):
        raise Unavailable(f"{method} {path}: HTTP {response.status_code}") from None


def sim_plan(registry: LocalRegistry) -> Plan:
    """`sim` runtimes: a placeholder image (no layers) and a few kilobytes the runtime never reads."""
    image = registry.push_empty_image("nexa/sim-runtime")
    return Plan(
        runtime={"name": "sim", "kind": "sim", "version": __version__, "image": image},
        model="demo-chat",
        artifact_key="models/demo-chat/v1/model.bin",
        artifact=MODEL_BYTES,
        source="nexa demo (simulated model)",
        deployment={
            "runtime": "sim",
            "resources": {"accelerators": 0, "memory_bytes": 256 * 2**20, "cpus": 0.5},
            "options": {"port": 18600, "command": SIM_ARGS},
        },
        simulation=True,
    )


def _real_plan(podman: LocalPodman, registry: LocalRegistry, root: Path, progress: Callable[[str], None]) -> Plan:
    """The llama-cpp-python image built and pushed, the tiny GGUF made (blocking: run in a thread)."""
    cache = cache_dir()
    progress("starting a private podman service…")
    podman.start()
    if (cache / python_rootfs_name()).is_file():
        progress(f"importing the Debian python root filesystem cached in {cache}…")
    else:
        progress(
            f"building a Debian python root filesystem with debootstrap (first run only, ~1 min; cached in {cache})…"
        )
    python = build_python_image(podman, f"{registry.host}/nexa-demo/python", root / "images", cache)
    progress("building the llama-cpp-python image and pushing it to the demo registry…")
    image = build_llama_image(podman, python, f"{registry.host}/nexa-demo/llama-cpp-python", root / "images" / "llama")
    gguf = tiny_gguf(cache).read_bytes()
    return Plan(
        runtime={"name": "llamacpp", "kind": "llamacpp", "version": llama_version(), "image": image},
        model="tiny-llama",
        artifact_key="models/tiny-llama/v1/model.gguf",
        artifact=gguf,
        source="nexa demo (a tiny random-weight llama, generated)",
        deployment={
            "runtime": "llamacpp",
            "resources": {"accelerators": 0, "memory_bytes": 512 * 2**20, "cpus": 1.0},
            "options": {"port": 18700, "settings": {"server": "llama-cpp-python", "n_ctx": 512}},
        },
        simulation=False,
        # The agents remove their containers when they stop, so Ctrl-C leaves nothing running.
        node_tables=(
            f'[container]\nsocket = "{podman.socket}"\nregistry_tls_verify = false\nleave_running_on_exit = false\n'
        ),
        ready_timeout_s=REAL_READY_TIMEOUT_S,
    )


async def upload_model(store: LocalS3, plan: Plan) -> str:
    """The model's bytes into the demo's S3 store through the one S3 client; their `s3://` URI."""
    async with S3Client(store.endpoint, region=S3_REGION, credentials=store.credentials, trust_env=False) as s3:
        await s3.put_bytes(store.bucket, plan.artifact_key, plan.artifact)
    return store.uri(plan.artifact_key)


async def register_model(http: httpx.AsyncClient, plan: Plan, artifact_uri: str) -> str:
    """Tenant, inference key, runtime, model through its whole lifecycle, alias. The inference key."""
    await call(http, "POST", "/api/v1/tenants", {"id": "demo", "display_name": "Demo tenant"})
    key = await call(http, "POST", "/api/v1/keys", {"role": "inference", "tenant": "demo", "name": "demo client"})
    await call(http, "POST", "/api/v1/runtimes", plan.runtime)
    await add_model(http, plan, artifact_uri, name=plan.model, alias="chat")
    secret: str = key["key"]
    return secret


async def add_model(http: httpx.AsyncClient, plan: Plan, artifact_uri: str, *, name: str, alias: str) -> None:
    """Model `name`@v1 over the plan's artifact, verified, evaluated, approved and aliased `alias`."""
    model = {
        "name": name,
        "version": "v1",
        "artifact": {
            "uri": artifact_uri,
            "sha256": hashlib.sha256(plan.artifact).hexdigest(),
            "size_bytes": len(plan.artifact),
        },
        "format": "gguf",
        "memory_bytes": 256 * 2**20,
        "provenance": {"source": plan.source, "signer": "nexa-demo"},
        "license": {"spdx_id": "Apache-2.0", "accepted_by": "demo operator", "expires_at": None},
    }
    await call(http, "POST", "/api/v1/models", model)
    path = f"/api/v1/models/{name}/v1"
    await call(http, "POST", f"{path}/verify")
    await call(http, "POST", f"{path}/evaluations", {"suite": "demo-smoke", "metrics": {"ok": 1.0}, "passed": True})
    await call(http, "POST", f"{path}/approve")
    await call(http, "POST", f"/api/v1/aliases/{alias}/promote", {"model": name, "version": "v1"})


async def enroll_node(
    http: httpx.AsyncClient,
    root: Path,
    i: int,
    store: LocalS3,
    creds: Path,
    *,
    plan: Plan,
    prefix: str = "demo",
    channel_endpoint: str | None = None,
    controllers: tuple[str, ...] = (),
) -> Node:
    """Enroll node `i` (its keys made here, its token spent) and start its agent process, named
    `{prefix}-{i}`; with `channel_endpoint`, the agent dials that instead of what enrollment answered;
    with `controllers`, it keeps a channel to each of those (several controllers on one store)."""
    name = f"{prefix}-{i}"
    state = root / "nodes" / name
    address = f"127.0.0.1{i}"
    inventory = root / "nodes" / f"{name}-inventory.json"
    inventory.parent.mkdir(parents=True, exist_ok=True)
    inventory.write_text(json.dumps({"labels": {"demo": "true"}, "runtimes": [plan.runtime["kind"]]}))
    config = root / "nodes" / f"{name}.toml"
    config.write_text(
        f'state_dir = "{state}"\ninventory_path = "{inventory}"\nheartbeat_interval_s = 0.5\n'
        f'source_address = "{address}"\nruntime_host = "{address}"\nreconnect_max_s = 1\n'
        f"simulation = {str(plan.simulation).lower()}\n"
        + (f"controllers = {json.dumps(list(controllers))}\n" if controllers else "")
        + f'[artifacts]\ns3_endpoint = "{store.endpoint}"\ns3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        f"[supervisor]\nreconcile_interval_s = 1\n{plan.node_tables}"
    )
    token = await call(http, "POST", "/api/v1/enrollment-tokens", {"ttl_s": 600, "labels": {"zone": f"z{i}"}})
    request = await trio.to_thread.run_sync(identity.enroll_request, state, token["token"], name, __version__)
    enrolled = await call(http, "POST", "/api/v1/enroll", codec.api.unstructure(request))
    answer = codec.structure(codec.api, enrolled, EnrollResponse)
    if channel_endpoint is not None:
        answer = attrs.evolve(answer, channel_endpoint=channel_endpoint)
    pin = identity.expected_fingerprint(token["token"])
    await trio.to_thread.run_sync(partial(identity.save_enrollment, state, answer, pin=pin))
    node = Node(name=enrolled["node_id"], state_dir=state, config=config)
    node.proc = start_agent(config, root / "nodes" / f"{name}.log", simulation=plan.simulation)
    return node


def start_agent(config: Path, log_path: Path, *, simulation: bool) -> subprocess.Popen[bytes]:
    """`nexa node --config …` logging to a file; with NEXA_SIMULATION_ONLY=1 when it runs `sim` runtimes."""
    env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"} if simulation else dict(os.environ)
    with log_path.open("wb") as out:
        return subprocess.Popen(
            [*default_argv(), "node", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )


async def wait_nodes(http: httpx.AsyncClient, count: int) -> None:
    with trio.fail_after(READY_TIMEOUT_S):
        while True:
            listed = (await call(http, "GET", "/api/v1/nodes"))["nodes"]
            if sum(n["state"] == "Ready" for n in listed) >= count:
                return
            await trio.sleep(0.2)


async def wait_ready(http: httpx.AsyncClient, deployment: str, replicas: int, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while True:
            if (await call(http, "GET", f"/api/v1/deployments/{deployment}"))["ready"] >= replicas:
                return
            await trio.sleep(0.2)


def stop_nodes(nodes: list[Node]) -> None:
    """SIGTERM every agent (each stops its sim runtimes), then wait; SIGKILL stragglers."""
    procs = [n.proc for n in nodes if n.proc is not None and n.proc.poll() is None]
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + NODE_STOP_TIMEOUT_S
    for proc in procs:
        stop(proc, grace_s=max(0.1, deadline - time.monotonic()))


def banner(started: DemoStarted) -> str:
    """What the demo prints once everything is Ready."""
    key = started.inference_key
    base = started.url
    body = '{"model": "chat", "messages": [{"role": "user", "content": "Hello, cluster"}]}'
    return "\n".join(
        [
            f"LunaNexa demo {__version__}: {len(started.nodes)} nodes ({', '.join(started.nodes)}),"
            f" alias `{started.alias}` deployed ({started.deployment}).",
            "",
            f"  console          {base}/  (sign in with the admin key)",
            f"  admin key        {started.admin_key}",
            f"  inference key    {key}  (tenant {started.tenant})",
            "",
            "  operator CLI:",
            f"    export NEXA_URL={base} NEXA_TOKEN={started.admin_key}",
            "    nexa nodes list; nexa deployments show chat; nexa usage",
            "",
            "  curl:",
            f"    curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {key}' \\",
            f"      -H 'Content-Type: application/json' -d '{body}'",
            "",
            "  Python (pip install openai):",
            "    from openai import OpenAI",
            f'    client = OpenAI(base_url="{base}/v1", api_key="{key}")',
            '    print(client.chat.completions.create(model="chat",'
            ' messages=[{"role": "user", "content": "Hello"}]).choices[0].message.content)',
            "",
            "Ctrl-C stops everything.",
        ]
    )
