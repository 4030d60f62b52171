"""A real model end to end, through real podman on CPU.

The runtime image (the Debian python image plus llama-cpp-python and its server, `llama_image`) is
built offline and pushed to the run's registry; the tiny llama GGUF and its embedding form (mean
pooling) are generated (`tiny_gguf`, `tiny_embedding_gguf`: nothing is downloaded) and uploaded to
SeaweedFS. Then only the CLI and the API: register the runtime and the models, record licences,
verify, evaluate, approve, deploy onto two enrolled `nexa node` agents (127.0.0.11 and .12) whose
supervisors pull the image by digest, fetch and verify the artifact and start the container; the
official `openai` SDK talks to the controller. Finally the node serving the chat model is drained and
its replica comes up on the other node while requests keep succeeding.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from tests.conftest import Controller
from tests.realparts import PodmanService, S3Store
from tests.support.api import in_thread, ok
from tests.support.realmodel import (
    Node,
    cli,
    cosine,
    deployment,
    ready_on,
    reference_embedding,
    register_llama_runtime,
    register_model,
    runtime_logs,
    wait_for,
)

pytestmark = pytest.mark.slow
Json = dict[str, Any]
TIMEOUT_S = 120


async def test_a_real_model_served_through_podman_on_cpu_survives_a_drain(
    llama_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    llama_image: str,
    tiny_gguf: Path,
    tiny_embedding_gguf: Path,
    podman_service: PodmanService,
) -> None:
    controller, _nodes = llama_cluster
    await register_llama_runtime(controller, llama_image)
    await register_model(controller, s3_store, "tiny", tiny_gguf)
    await register_model(controller, s3_store, "tiny-embed", tiny_embedding_gguf)
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201))["key"]
        # An option the adapter does not know is a typed 400 naming it, and nothing is created.
        bad = await http.post("/api/v1/deployments", json=deployment("chat", "tiny", {"n_ctxx": 512}))
        assert bad.status_code == 400, bad.text
        assert "settings.n_ctxx: unknown option for llama-cpp-python" in bad.text
        assert (await http.get("/api/v1/deployments/chat")).status_code == 404
        await ok(http.post("/api/v1/deployments", json=deployment("chat", "tiny", {"n_ctx": 512, "seed": 1})), 201)
        embed = deployment("embed", "tiny-embed", {"embedding": True})
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
            got = client.embeddings.create(model="tiny-embed", input=text)
            return got.data[0].embedding

        try:
            await in_thread(completion)
        except openai.OpenAIError:
            pytest.fail(runtime_logs(podman_service))
        await in_thread(streamed_chat)
        served = await in_thread(embedding)
        reference = await trio.to_thread.run_sync(reference_embedding, tiny_embedding_gguf, text)
        assert len(served) == len(reference) == 64
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
