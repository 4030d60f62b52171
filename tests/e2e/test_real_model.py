"""A real model end to end, through real podman on CPU.

The runtime image (the Debian python image plus llama-cpp-python and its server, `llama_image`) is
built offline and pushed to the run's registry; the tiny llama GGUF is generated (`tiny_gguf`) and,
with the real all-MiniLM-L6-v2 GGUF, uploaded to SeaweedFS. Then only the CLI and the API: register
the runtime and the models, record licences, verify, evaluate, approve, deploy onto two enrolled
`nexa node` agents (127.0.0.11 and .12) whose supervisors pull the image by digest, fetch and verify
the artifact and start the container; the official `openai` SDK talks to the controller. Finally the
node serving the chat model is drained and its replica comes up on the other node while requests
keep succeeding.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import openai
import pytest
import trio

from tests.conftest import Controller, start_controller
from tests.control.test_models import ok, registry_config, upload
from tests.realparts import PodmanService, S3Store

pytestmark = pytest.mark.slow
T = TypeVar("T")
Json = dict[str, Any]
TIMEOUT_S = 120
READY_S = 180
MIB = 2**20


@attrs.define
class Node:
    name: str
    host: str
    config: Path
    proc: subprocess.Popen[bytes] | None = None

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


def node_config(tmp: Path, name: str, host: str, s3: S3Store, podman: PodmanService) -> Path:
    state = tmp / name
    creds = tmp / "node-s3.json"
    creds.write_text(
        json.dumps(
            {"access_key_id": s3.credentials.access_key_id, "secret_access_key": s3.credentials.secret_access_key}
        )
    )
    creds.chmod(0o600)
    inventory = tmp / f"{name}-inventory.json"
    inventory.write_text(json.dumps({"labels": {"board": "cpu"}, "runtimes": ["llamacpp"]}))
    config = tmp / f"{name}.toml"
    config.write_text(
        f'state_dir = "{state}"\ninventory_path = "{inventory}"\ninventory_poll_interval_s = 0.5\n'
        f'heartbeat_interval_s = 0.3\nsource_address = "{host}"\nruntime_host = "{host}"\nreconnect_max_s = 1\n'
        f'[podman]\nsocket = "{podman.socket}"\nregistry_tls_verify = false\nleave_running_on_exit = false\n'
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{s3.region}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        "[supervisor]\nreconcile_interval_s = 1\n"
    )
    return config


def cli(controller: Controller, *argv: str) -> str:
    env = {**os.environ, "NEXA_URL": controller.url, "NEXA_TOKEN": controller.admin_key}
    done = subprocess.run(
        [sys.executable, "-m", "nexa", *argv], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert done.returncode == 0, f"nexa {' '.join(argv)}: {done.stderr}"
    return done.stdout


async def register_model(controller: Controller, s3: S3Store, name: str, gguf: Path) -> None:
    """Upload the GGUF, then over the CLI: register, licence, verify, evaluate, approve, alias."""
    art = await upload(s3, await trio.to_thread.run_sync(gguf.read_bytes))
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
            "gguf",
            "--memory",
            str(256 * MIB),
            "--source",
            f"file://{gguf.name}",
        ],
        ["models", "license", name, "v1", "--spdx", "Apache-2.0", "--accepted-by", "legal@example.com"],
        ["models", "verify", name, "v1"],
        ["models", "evaluate", name, "v1", "--suite", "smoke", "--metric", "loads=1", "--passed"],
        ["models", "approve", name, "v1"],
        ["aliases", "promote", name, "--model", name, "--version", "v1"],
    ]
    for argv in steps:
        await trio.to_thread.run_sync(cli, controller, *argv)


async def register_llama_runtime(controller: Controller, image: str) -> None:
    """Register the llama-cpp-python image as the `llama-cpp-python` runtime, over the CLI."""
    argv = ["runtimes", "register", "llama-cpp-python", "--kind", "llamacpp", "--version", "0.3.36", "--image", image]
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


def runtime_logs(podman: PodmanService) -> str:
    """The last lines of every runtime container's log (shown when the test fails)."""
    out = []
    for name in podman.cli("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split():
        if name.startswith("nexa-"):
            logs = podman.cli("logs", "--tail", "12", name, check=False)
            out.append(f"--- {name}\n{logs.stdout[-2000:]}{logs.stderr[-600:]}")
    return "\n".join(out)


@pytest.fixture
async def cluster(
    nursery: trio.Nursery,
    tmp_path: Path,
    s3_store: S3Store,
    podman_service: PodmanService,
) -> AsyncIterator[tuple[Controller, list[Node]]]:
    controller = await start_controller(nursery, registry_config(tmp_path, s3_store))
    hosts = {f"cpu-{i}": f"127.0.0.1{i}" for i in (1, 2)}
    nodes = [
        Node(name=name, host=host, config=node_config(tmp_path, name, host, s3_store, podman_service))
        for name, host in hosts.items()
    ]
    try:
        for node in nodes:
            token = await trio.to_thread.run_sync(cli, controller, "tokens", "create", "--json")
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
            return len(listed) == 2 and all(n["state"] == "Ready" for n in listed)

        await wait_for(all_ready, "both nodes Ready", 60)
        yield controller, nodes
    finally:
        for node in nodes:
            node.stop()
        controller.stopping.set()


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


async def test_a_real_model_served_through_podman_on_cpu_survives_a_drain(
    cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    llama_image: str,
    tiny_gguf: Path,
    minilm_gguf: Path,
    podman_service: PodmanService,
) -> None:
    controller, _nodes = cluster
    await register_llama_runtime(controller, llama_image)
    await register_model(controller, s3_store, "tiny", tiny_gguf)
    await register_model(controller, s3_store, "minilm", minilm_gguf)
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201))["key"]
        # An option the adapter does not know is a typed 400 naming it, and nothing is created.
        bad = await http.post("/api/v1/deployments", json=deployment("chat", "tiny", {"n_ctxx": 512}))
        assert bad.status_code == 400, bad.text
        assert "settings.n_ctxx: unknown option for llama-cpp-python" in bad.text
        assert (await http.get("/api/v1/deployments/chat")).status_code == 404
        await ok(http.post("/api/v1/deployments", json=deployment("chat", "tiny", {"n_ctx": 512, "seed": 1})), 201)
        embed = deployment("embed", "minilm", {"embedding": True})
        await ok(http.post("/api/v1/deployments", json=embed), 201)
    [chat_node] = await wait_for(lambda: ready_on(controller, "chat"), "chat Ready")
    await wait_for(lambda: ready_on(controller, "embed"), "embed Ready")

    client = openai.OpenAI(base_url=controller.url + "/v1", api_key=key, max_retries=0, timeout=60)
    try:

        def completion() -> None:
            got = client.completions.create(model="tiny", prompt="once upon a time", max_tokens=8, temperature=0)
            assert got.usage is not None and got.usage.prompt_tokens > 0
            assert 1 <= got.usage.completion_tokens <= 8
            assert got.choices[0].finish_reason in {"length", "stop"}

        def streamed_chat() -> None:
            stream = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hello world"}],
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            assert any(c.choices and c.choices[0].delta.content for c in chunks)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1

        text = "The quick brown fox jumps over the lazy dog."

        def embedding() -> list[float]:
            got = client.embeddings.create(model="minilm", input=text)
            return got.data[0].embedding

        try:
            await in_thread(completion)
        except openai.OpenAIError:
            pytest.fail(runtime_logs(podman_service))
        await in_thread(streamed_chat)
        served = await in_thread(embedding)
        reference = await trio.to_thread.run_sync(reference_embedding, minilm_gguf, text)
        assert len(served) == len(reference) == 384
        assert cosine(served, reference) > 0.999

        # Drain the chat model's node: its replica comes up on the other node, and requests keep working.
        failures: list[BaseException] = []
        done = trio.Event()

        async def keep_asking() -> None:
            while not done.is_set():
                try:
                    await in_thread(completion)
                except (openai.OpenAIError, AssertionError) as exc:
                    failures.append(exc)
                await trio.sleep(0.2)

        async with trio.open_nursery() as n:
            n.start_soon(keep_asking)
            await trio.to_thread.run_sync(cli, controller, "nodes", "drain", chat_node)
            started = time.monotonic()
            moved = await wait_for(lambda: _moved(controller, "chat", chat_node), "chat replaced on the other node")
            assert moved and chat_node not in moved
            await trio.sleep(1.0)
            done.set()
        assert not failures, f"{len(failures)} requests failed during the drain ({time.monotonic() - started:.1f} s)"
        await in_thread(completion)
    finally:
        client.close()


async def _moved(controller: Controller, deployment: str, old: str) -> list[str]:
    async with controller.client() as http:
        dep = await ok(http.get(f"/api/v1/deployments/{deployment}"))
    placed = [r["node_id"] for r in dep["deployment"]["placed"]]
    ready = await ready_on(controller, deployment)
    return ready if old not in placed and ready else []
