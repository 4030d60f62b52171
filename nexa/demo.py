"""`nexa demo`: a whole local cluster on this machine, set up the way an operator would set one up.

It starts an OCI registry and an S3-compatible store on loopback (the standard parts a real
installation points at), `nexa control` on the embedded SQLite store, and four `nexa node`
agents dialling from 127.0.0.11 to .14, each running `sim` runtimes (simulation only). Then,
through the controller's HTTP API only: a tenant and an inference key, the `sim` runtime
(its placeholder image pushed to the registry and checked by digest), a model whose artifact is
uploaded to the store and verified by the controller, evaluated, approved and aliased as
`chat`, and a deployment of it. It prints the console URL, the keys and ready-to-paste `curl` and
`openai` examples; Ctrl-C stops everything it started, by PID, and waits for it.

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
from nexa.localparts import LocalRegistry, LocalS3, free_ports, stop
from nexa.node import identity
from nexa.node.processes import default_argv
from nexa.s3 import S3Credentials

log = logging.getLogger(__name__)

#: The model the demo deploys: a few kilobytes of deterministic bytes (the `sim` runtime reads none).
MODEL_BYTES: Final = hashlib.sha256(b"nexa demo model").digest() * 256
SIM_ARGS: Final = ["--ttft-ms", "60", "--tokens-per-s", "40", "--output-tokens", "32"]
READY_TIMEOUT_S: Final = 60.0
NODE_STOP_TIMEOUT_S: Final = 15.0


@attrs.frozen(kw_only=True)
class DemoConfig:
    state_dir: Path
    listen: str = "127.0.0.1:8470"
    nodes: int = 4
    replicas: int = 2


@attrs.frozen(kw_only=True)
class DemoStarted:
    url: str
    admin_key: str
    inference_key: str
    tenant: str
    alias: str
    nodes: list[str]
    deployment: str


@attrs.define
class _Node:
    name: str
    state_dir: Path
    config: Path
    proc: subprocess.Popen[bytes] | None = None


async def serve_demo(
    cfg: DemoConfig, *, stopping: trio.Event, task_status: trio.TaskStatus[DemoStarted] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the demo until `stopping` is set; supports the nursery start protocol."""
    if not 1 <= cfg.nodes <= 4:
        raise ConfigError("--nodes: 1 to 4 (one loopback address each, 127.0.0.11 to 127.0.0.14)")
    root = cfg.state_dir
    if root.exists():
        await trio.to_thread.run_sync(shutil.rmtree, root)
    root.mkdir(parents=True)
    registry = LocalRegistry(root / "registry")
    store = LocalS3(
        root / "s3",
        bucket="nexa-demo",
        credentials=S3Credentials(access_key_id="nexa-demo", secret_access_key=secrets.token_urlsafe(24)),
    )
    nodes: list[_Node] = []
    try:
        await trio.to_thread.run_sync(registry.start)
        await trio.to_thread.run_sync(store.start)
        image = await trio.to_thread.run_sync(registry.push_empty_image, "nexa/sim-runtime")
        artifact = await trio.to_thread.run_sync(store.put, "models/demo-chat/v1/model.bin", MODEL_BYTES)
        creds = root / "s3-credentials.json"
        creds.write_text(
            json.dumps(
                {
                    "access_key_id": store.credentials.access_key_id,
                    "secret_access_key": store.credentials.secret_access_key,
                }
            )
        )
        creds.chmod(0o600)
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
                inference_key = await _registry(http, image, artifact)
                for i in range(1, cfg.nodes + 1):
                    nodes.append(await _node(http, root, i, store, creds))
                await _wait_nodes(http, len(nodes))
                await _call(
                    http,
                    "POST",
                    "/api/v1/deployments",
                    {
                        "name": "chat",
                        "runtime": "sim",
                        "alias": "chat",
                        "replicas": min(cfg.replicas, cfg.nodes),
                        "resources": {"accelerators": 0, "memory_bytes": 256 * 2**20, "cpus": 0.5},
                        "options": {"port": 18600, "command": SIM_ARGS},
                    },
                )
                await _wait_ready(http, "chat", min(cfg.replicas, cfg.nodes))
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
            await trio.to_thread.run_sync(_stop_nodes, nodes)
            controller_stopping.set()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_stop_nodes, nodes)
            await trio.to_thread.run_sync(store.stop)
            await trio.to_thread.run_sync(registry.stop)


async def _call(http: httpx.AsyncClient, method: str, path: str, body: object | None = None) -> Any:
    response = await http.request(method, path, json=body)
    if response.is_success:
        return response.json() if response.content else None
    try:
        err = response.json()["error"]
        raise RemoteError(err["message"], remote_code=err["code"], status=response.status_code, request_id=None)
    except (ValueError, KeyError, TypeError):
        raise Unavailable(f"{method} {path}: HTTP {response.status_code}") from None


async def _registry(http: httpx.AsyncClient, image: str, artifact: str) -> str:
    """Tenant, inference key, runtime, model through its whole lifecycle, alias. The inference key."""
    await _call(http, "POST", "/api/v1/tenants", {"id": "demo", "display_name": "Demo tenant"})
    key = await _call(http, "POST", "/api/v1/keys", {"role": "inference", "tenant": "demo", "name": "demo client"})
    await _call(
        http, "POST", "/api/v1/runtimes", {"name": "sim", "kind": "sim", "version": __version__, "image": image}
    )
    model = {
        "name": "demo-chat",
        "version": "v1",
        "artifact": {
            "uri": artifact,
            "sha256": hashlib.sha256(MODEL_BYTES).hexdigest(),
            "size_bytes": len(MODEL_BYTES),
        },
        "format": "gguf",
        "memory_bytes": 256 * 2**20,
        "provenance": {"source": "nexa demo (simulated model)", "signer": "nexa-demo"},
        "license": {"spdx_id": "Apache-2.0", "accepted_by": "demo operator", "expires_at": None},
    }
    await _call(http, "POST", "/api/v1/models", model)
    path = "/api/v1/models/demo-chat/v1"
    await _call(http, "POST", f"{path}/verify")
    await _call(http, "POST", f"{path}/evaluations", {"suite": "demo-smoke", "metrics": {"ok": 1.0}, "passed": True})
    await _call(http, "POST", f"{path}/approve")
    await _call(http, "POST", "/api/v1/aliases/chat/promote", {"model": "demo-chat", "version": "v1"})
    secret: str = key["key"]
    return secret


async def _node(http: httpx.AsyncClient, root: Path, i: int, store: LocalS3, creds: Path) -> _Node:
    """Enroll node `i` (its keys made here, its token spent) and start its agent process."""
    name = f"demo-{i}"
    state = root / "nodes" / name
    address = f"127.0.0.1{i}"
    inventory = root / "nodes" / f"{name}-inventory.json"
    inventory.parent.mkdir(parents=True, exist_ok=True)
    inventory.write_text(json.dumps({"labels": {"demo": "true"}, "runtimes": ["sim"]}))
    config = root / "nodes" / f"{name}.toml"
    config.write_text(
        f'state_dir = "{state}"\ninventory_path = "{inventory}"\nheartbeat_interval_s = 0.5\n'
        f'source_address = "{address}"\nruntime_host = "{address}"\nreconnect_max_s = 1\nsimulation = true\n'
        f'[artifacts]\ns3_endpoint = "{store.endpoint}"\ns3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        "[supervisor]\nreconcile_interval_s = 1\n"
    )
    token = await _call(http, "POST", "/api/v1/enrollment-tokens", {"ttl_s": 600, "labels": {"zone": f"z{i}"}})
    request = await trio.to_thread.run_sync(identity.enroll_request, state, token["token"], name, __version__)
    enrolled = await _call(http, "POST", "/api/v1/enroll", codec.api.unstructure(request))
    await trio.to_thread.run_sync(identity.save_enrollment, state, codec.structure(codec.api, enrolled, EnrollResponse))
    node = _Node(name=enrolled["node_id"], state_dir=state, config=config)
    node.proc = _start_agent(config, root / "nodes" / f"{name}.log")
    return node


def _start_agent(config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """`nexa node --config …` with NEXA_SIMULATION_ONLY=1 (it runs `sim` runtimes), logging to a file."""
    with log_path.open("wb") as out:
        return subprocess.Popen(
            [*default_argv(), "node", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "NEXA_SIMULATION_ONLY": "1"},
        )


async def _wait_nodes(http: httpx.AsyncClient, count: int) -> None:
    with trio.fail_after(READY_TIMEOUT_S):
        while True:
            listed = (await _call(http, "GET", "/api/v1/nodes"))["nodes"]
            if sum(n["state"] == "Ready" for n in listed) >= count:
                return
            await trio.sleep(0.2)


async def _wait_ready(http: httpx.AsyncClient, deployment: str, replicas: int) -> None:
    with trio.fail_after(READY_TIMEOUT_S):
        while True:
            if (await _call(http, "GET", f"/api/v1/deployments/{deployment}"))["ready"] >= replicas:
                return
            await trio.sleep(0.2)


def _stop_nodes(nodes: list[_Node]) -> None:
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
