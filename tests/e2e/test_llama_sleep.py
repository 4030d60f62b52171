"""Sleep when idle with the real llama.cpp server in podman: the container-stop path
(`control.deployments.idle`). llama-server has no sleep mode of its own, so a sleeping replica's
container is stopped and removed while the GGUF stays in the node's artifact cache; a request
through the official `openai` SDK wakes it (a new container on the cached artifact) and is
answered within its deadline. The image and the GGUF are those of tests/e2e/test_llama_server.py.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio

from tests.conftest import Controller
from tests.realparts import PodmanService, S3Store
from tests.support.api import Json, in_thread, ok
from tests.support.realmodel import MIB, Node, cli, ready_on, register_model, runtime_logs, wait_for

pytestmark = pytest.mark.slow
RUNTIME = "llama-server"


def _containers(podman: PodmanService, deployment: str) -> list[str]:
    """The running runtime containers of the deployment (nexa names them after the assignment)."""
    names = podman.cli("ps", "--format", "{{.Names}}", check=False).stdout.split()
    return [n for n in names if n.startswith("nexa-") and deployment in n]


def _cached_copies(nodes: list[Node], gguf: Path) -> list[Path]:
    """The files in the nodes' state directories (their artifact caches) holding the GGUF's bytes."""
    data = gguf.read_bytes()
    found = []
    for node in nodes:
        state = node.config.parent / node.name  # `realmodel.node_config`'s state_dir
        found += [
            p for p in state.rglob("*") if p.is_file() and p.stat().st_size == len(data) and p.read_bytes() == data
        ]
    return found


async def test_a_sleeping_llama_server_stops_its_container_and_a_request_starts_it_again(
    llama_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    llama_server_image: str,
    tiny_gguf: Path,
    podman_service: PodmanService,
) -> None:
    controller, nodes = llama_cluster
    argv = ["runtimes", "register", RUNTIME, "--kind", "llamacpp", "--version", "0.3.36", "--image"]
    await trio.to_thread.run_sync(cli, controller, *argv, llama_server_image)
    await register_model(controller, s3_store, "tiny", tiny_gguf)
    body: Json = {
        "name": "napper",
        "runtime": RUNTIME,
        "alias": "tiny",
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 512 * MIB, "cpus": 1.0},
        "options": {"port": 18820, "settings": {"ctx_size": 512, "parallel": 1, "flash_attn": "off"}},
        "idle_after_s": 2.0,
        "min_replicas": 0,
    }
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201))["key"]
        await ok(http.post("/api/v1/deployments", json=body), 201)
    try:
        await wait_for(lambda: ready_on(controller, "napper"), "the replica to be Ready")
        assert _containers(podman_service, "napper")
        cached = _cached_copies(nodes, tiny_gguf)
        assert cached, "the node holds the GGUF"

        async def asleep() -> bool:
            async with controller.client() as http:
                view = await ok(http.get("/api/v1/deployments/napper"))
            return view["sleep"]["state"] == "asleep" and not _containers(podman_service, "napper")

        # Idle for idle_after_s: the container stops; the artifact stays in the node's cache.
        await wait_for(asleep, "the deployment to sleep and its container to stop")
        assert all(p.exists() for p in cached)

        client = openai.OpenAI(base_url=controller.url + "/v1", api_key=key, max_retries=0, timeout=120)
        try:
            answer = await in_thread(
                lambda: client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=4,
                    extra_headers={"x-nexa-deadline-ms": "90000"},
                )
            )
        finally:
            client.close()
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        assert _containers(podman_service, "napper")
        async with controller.client() as http:
            view = await ok(http.get("/api/v1/deployments/napper"))
        assert view["sleep"]["state"] == "awake" and view["sleep"]["last_wake_s"] > 0
    except BaseException:
        print(runtime_logs(podman_service))
        raise
