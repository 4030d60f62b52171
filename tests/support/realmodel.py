"""Real models on real podman: two enrolled `nexa node` agents on the run's podman and S3 store, the
`nexa` CLI as an operator runs it, the llama-cpp-python runtime and its deployments, and waiting for
replicas to be Ready."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import pytest
import trio

from tests.conftest import Controller, start_controller
from tests.realparts import PodmanService, S3Store, loopback_net
from tests.support.api import Json, ok
from tests.support.models import registry_config, upload
from tests.support.s3 import write_credentials

T = TypeVar("T")
#: How long `wait_for` waits for a replica by default.
READY_S = 180
MIB = 2**20


@attrs.define
class Node:
    name: str
    host: str
    config: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def firewall_table(self) -> str:
        """Its agent's own nftables table (`[firewall] table`): one per agent sharing this host."""
        return firewall_table(self.name)

    def drop_firewall_table(self) -> None:
        """Remove what its agent left in the host's nftables (a group member's closed port)."""
        subprocess.run(["nft", "delete", "table", "inet", self.firewall_table], capture_output=True, check=False)

    def start(self, log: Path) -> None:
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nexa", "node", "--config", str(self.config)], stdout=out, stderr=out
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def firewall_table(name: str) -> str:
    return f"nexa-test{os.getpid()}-{name}"


def node_config(
    tmp: Path,
    name: str,
    host: str,
    s3: S3Store,
    podman: PodmanService,
    runtimes: tuple[str, ...] = ("llamacpp",),
    *,
    firewall: bool = False,
) -> Path:
    """`firewall`: the agent closes its group members' ports in its own nftables table. Off by default:
    agents sharing this host's network namespace would refuse each other's fabric addresses (on a
    real fleet each node's rules see only its own)."""
    state = tmp / name
    creds = write_credentials(tmp / "node-s3.json", s3)
    inventory = tmp / f"{name}-inventory.json"
    inventory.write_text(json.dumps({"labels": {"board": "cpu"}, "runtimes": list(runtimes)}))
    config = tmp / f"{name}.toml"
    config.write_text(
        f'state_dir = "{state}"\ninventory_path = "{inventory}"\ninventory_poll_interval_s = 0.5\n'
        f'heartbeat_interval_s = 0.3\nsource_address = "{host}"\nruntime_host = "{host}"\nreconnect_max_s = 1\n'
        f'[container]\nsocket = "{podman.socket}"\nregistry_tls_verify = false\nleave_running_on_exit = false\n'
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{s3.region}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        "[supervisor]\nreconcile_interval_s = 1\n"
        f'[firewall]\nenabled = {str(firewall).lower()}\ntable = "{firewall_table(name)}"\n'
    )
    return config


def cli(controller: Controller, *argv: str) -> str:
    env = {**os.environ, "NEXA_URL": controller.url, "NEXA_TOKEN": controller.admin_key}
    done = subprocess.run(
        [sys.executable, "-m", "nexa", *argv], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert done.returncode == 0, f"nexa {' '.join(argv)}: {done.stderr}"
    return done.stdout


async def register_llama_runtime(controller: Controller, image: str) -> None:
    """Register the llama-cpp-python image as the `llama-cpp-python` runtime, over the CLI."""
    argv = ["runtimes", "register", "llama-cpp-python", "--kind", "llamacpp", "--version", "0.3.36", "--image", image]
    await trio.to_thread.run_sync(cli, controller, *argv)


async def register_model(
    controller: Controller, s3: S3Store, name: str, gguf: Path, *, lora_for: str = "", fmt: str = "gguf"
) -> None:
    """Upload the GGUF, then over the CLI: register, licence, verify, evaluate, approve, alias. With
    `lora_for` (`base@version`) it is a LoRA adapter for that base, and its alias serves it there; `fmt`:
    the model's format (`ggml` for a whisper.cpp model)."""
    art = await upload(s3, await trio.to_thread.run_sync(gguf.read_bytes))
    base, _, base_version = lora_for.partition("@")
    lora = ["--kind", "lora", "--base", lora_for] if lora_for else []
    target = ["--model", base, "--version", base_version, "--adapter", f"{name}@v1"] if lora_for else []
    steps = [
        [
            "models",
            "register",
            name,
            "v1",
            "--uri",
            art.uri,
            "--sha256",
            art.sha256,
            "--size",
            str(art.size),
            "--format",
            fmt,
            "--memory",
            str(256 * MIB),
            "--source",
            f"file://{gguf.name}",
            *lora,
        ],
        ["models", "license", name, "v1", "--spdx", "Apache-2.0", "--accepted-by", "legal@example.com"],
        ["models", "verify", name, "v1"],
        ["models", "evaluate", name, "v1", "--suite", "smoke", "--metric", "loads=1", "--passed"],
        ["models", "approve", name, "v1"],
        ["aliases", "promote", name, *(target or ["--model", name, "--version", "v1"])],
    ]
    for argv in steps:
        await trio.to_thread.run_sync(cli, controller, *argv)


def deployment(name: str, alias: str, settings: Json) -> Json:
    return {
        "name": name,
        "runtime": "llama-cpp-python",
        "alias": alias,
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 512 * MIB, "cpus": 1.0},
        "options": {"port": 18700, "settings": {"server": "llama-cpp-python", **settings}},
    }


async def ready_on(controller: Controller, deployment: str) -> list[str]:
    """Nodes (Ready ones) on which the deployment has a replica reported Ready."""
    async with controller.client() as http:
        dep = await ok(http.get(f"/api/v1/deployments/{deployment}"))
        nodes = {n["id"]: n for n in (await ok(http.get("/api/v1/nodes")))["nodes"]}
    out = []
    for r in dep["deployment"]["placed"]:
        node = nodes[r["node_id"]]
        states = {s["assignment_id"]: s["state"] for s in node["assignments"]}
        if node["state"] in {"Ready", "Draining"} and states.get(r["id"]) == "Ready":
            out.append(r["node_id"])
    return out


async def wait_for(check: Callable[[], Any], what: str, timeout_s: float = READY_S) -> Any:
    with trio.move_on_after(timeout_s):
        while not (got := await check()):  # noqa: ASYNC110 - polling the API
            await trio.sleep(0.2)
        return got
    pytest.fail(f"timed out waiting for {what}")


def runtime_logs(podman: PodmanService) -> str:
    """The last lines of every runtime container's log (shown when the test fails)."""
    out = []
    for name in podman.cli("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split():
        if name.startswith("nexa-"):
            logs = podman.cli("logs", "--tail", "12", name, check=False)
            out.append(f"--- {name}\n{logs.stdout[-2000:]}{logs.stderr[-600:]}")
    return "\n".join(out)


@contextlib.asynccontextmanager
async def real_cluster(
    nursery: trio.Nursery,
    tmp_path: Path,
    s3_store: S3Store,
    podman_service: PodmanService,
    *,
    labels: Callable[[Node], str] | None = None,
    count: int = 2,
    runtimes: tuple[str, ...] = ("llamacpp",),
    firewalled: tuple[str, ...] = (),
) -> AsyncIterator[tuple[Controller, list[Node]]]:
    """A controller and `count` (at most 9) enrolled `nexa node` agents (cpu-1 on 127.0.0.11, cpu-2
    on .12, ...) on the run's podman, all Ready; `labels`: each node's labels (`k=v,k2=v2`, the
    admin's, through its enrollment token); `runtimes`: the runtime kinds their inventories allow;
    `firewalled`: the nodes whose agents run the fabric firewall (`node_config`)."""
    controller = await start_controller(nursery, registry_config(tmp_path, s3_store))
    hosts = {f"cpu-{i}": f"{loopback_net()}.1{i}" for i in range(1, count + 1)}
    nodes = [
        Node(
            name=name,
            host=host,
            config=node_config(tmp_path, name, host, s3_store, podman_service, runtimes, firewall=name in firewalled),
        )
        for name, host in hosts.items()
    ]
    try:
        for node in nodes:
            given = ["--labels", labels(node)] if labels is not None else []
            token = await trio.to_thread.run_sync(cli, controller, "tokens", "create", "--json", *given)
            secret = json.loads(token)["token"]
            await trio.to_thread.run_sync(
                cli,
                controller,
                "node",
                "enroll",
                "--controller",
                controller.url,
                "--token",
                secret,
                "--name",
                node.name,
                "--state-dir",
                str(tmp_path / node.name),
            )
            node.start(tmp_path / f"{node.name}.log")

        async def all_ready() -> bool:
            async with controller.client() as http:
                listed = (await ok(http.get("/api/v1/nodes")))["nodes"]
            return len(listed) == count and all(n["state"] == "Ready" for n in listed)

        await wait_for(all_ready, "every node Ready", 60)
        yield controller, nodes
    finally:
        for node in nodes:
            node.stop()
            node.drop_firewall_table()
        controller.stopping.set()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def reference_embedding(gguf: Path, text: str) -> list[float]:
    """The same GGUF through llama-cpp-python directly, in this process."""
    llama_cpp = pytest.importorskip("llama_cpp") if os.environ.get("CI") != "true" else __import__("llama_cpp")
    model = llama_cpp.Llama(str(gguf), embedding=True, verbose=False)
    try:
        vector: list[float] = model.create_embedding(text)["data"][0]["embedding"]
    finally:
        model.close()
    return vector


#: The llama.cpp runtime registered by the `llama_server_image` tests.
LLAMA_SERVER = "llama-server"


async def register_llama_server(controller: Controller, image: str) -> None:
    """Register the `llama_server_image` tests' runtime (`LLAMA_SERVER`, kind llamacpp) by its digest."""
    argv = ["runtimes", "register", LLAMA_SERVER, "--kind", "llamacpp", "--version", "0.3.36", "--image", image]
    await trio.to_thread.run_sync(cli, controller, *argv)


def llama_server_deployment(name: str, alias: str, settings: Json) -> Json:
    """A deployment of the `llama-server` runtime: no `server` setting, so the default variant."""
    return {
        "name": name,
        "runtime": LLAMA_SERVER,
        "alias": alias,
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 512 * MIB, "cpus": 1.0},
        "options": {"port": 18800, "settings": settings},
    }
