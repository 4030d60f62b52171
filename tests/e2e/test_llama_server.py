"""llama.cpp's own C++ `llama-server`, the default variant of the `llamacpp` runtime, end to end through
real podman on CPU (issue 29, point 5).

The image (`llama_server_image`) is built here: the server compiled from the llama.cpp source that the
llama-cpp-python sdist vendors (cached in `cache_dir()`), laid out as llama.cpp's published server image
(`ENTRYPOINT ["/app/llama-server"]`). It is registered as a `llamacpp` runtime with no `server` setting,
so the adapter is llama-server's (`--alias`, `--metrics`, `--embedding`, …). The tiny generated GGUFs
are deployed on two enrolled `nexa node` agents; the official `openai` SDK asks the controller for a chat
completion, a Responses API call (translated to a chat completion) and embeddings, and the runtime's
`/metrics` series (llamacpp:requests_deferred, llamacpp:requests_processing) reach `nexa deployments show`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import trio

from tests.conftest import Controller
from tests.realparts import PodmanService, S3Store
from tests.support.api import Json, in_thread, ok
from tests.support.realmodel import (
    LLAMA_SERVER,
    Node,
    cli,
    cosine,
    llama_server_deployment,
    ready_on,
    reference_embedding,
    register_llama_server,
    register_model,
    runtime_logs,
    wait_for,
)

pytestmark = pytest.mark.slow


async def tokenizer(controller: Controller, key: str) -> None:
    """llama-server's /tokenize and /detokenize through the controller, in llama.cpp's own shape
    (`content` in, `tokens` out, and back): the openai SDK has no tokenizer call, so httpx."""
    async with controller.client(key) as http:
        tokens = (await ok(http.post("/tokenize", json={"model": "tiny", "content": "hello world"})))["tokens"]
        assert tokens and all(isinstance(t, int) for t in tokens), tokens
        text = (await ok(http.post("/detokenize", json={"model": "tiny", "tokens": tokens})))["content"]
        assert isinstance(text, str) and text.strip(), text
        # Not started with --reranking: the gateway refuses rerank before any runtime sees it.
        refused = await http.post("/v1/rerank", json={"model": "tiny", "query": "q", "documents": ["d"]})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "api_not_served"
    async with controller.client() as admin:
        before = sum(r["prompt_tokens"] for r in (await ok(admin.get("/api/v1/usage")))["rows"])
    async with controller.client(key) as http:
        await ok(http.post("/tokenize", json={"model": "tiny", "content": "hello world"}))
        await ok(http.post("/detokenize", json={"model": "tiny", "tokens": tokens}))
    async with controller.client() as admin:
        after = sum(r["prompt_tokens"] for r in (await ok(admin.get("/api/v1/usage")))["rows"])
    assert after - before == 2 * len(tokens)  # metered by the ids answered, and the ids sent back


async def test_the_cpp_llama_server_serves_chat_and_embeddings_and_its_metrics_reach_deployments_show(
    llama_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    llama_server_image: str,
    tiny_gguf: Path,
    tiny_embedding_gguf: Path,
    podman_service: PodmanService,
) -> None:
    controller, _nodes = llama_cluster
    await register_llama_server(controller, llama_server_image)
    # What the registry's image config says, and what a replica will run.
    shown = await trio.to_thread.run_sync(cli, controller, "runtimes", "show", LLAMA_SERVER)
    assert "entrypoint /app/llama-server;" in shown and "workdir /app;" in shown, shown
    assert "runs (llama-server): /app/llama-server …" in shown, shown
    await register_model(controller, s3_store, "tiny", tiny_gguf)
    await register_model(controller, s3_store, "tiny-embed", tiny_embedding_gguf)
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201))["key"]
        chat = llama_server_deployment("chat", "tiny", {"ctx_size": 512, "parallel": 1, "flash_attn": "off"})
        await ok(http.post("/api/v1/deployments", json=chat), 201)
        await ok(
            http.post("/api/v1/deployments", json=llama_server_deployment("embed", "tiny-embed", {"embedding": True})),
            201,
        )
        placement = await ok(http.get("/api/v1/deployments/chat/placement"))
    # The image's entrypoint names the program by path: that path runs it, with the adapter's arguments once.
    process = placement["process"]
    assert process[:3] == ["/app/llama-server", "--model", "/models/model"], process
    assert process.count("--alias") == 1 and "--metrics" in process
    await wait_for(lambda: ready_on(controller, "chat"), "chat Ready")
    await wait_for(lambda: ready_on(controller, "embed"), "embed Ready")

    client = openai.OpenAI(base_url=controller.url + "/v1", api_key=key, max_retries=0, timeout=60)
    try:

        def chat_completion() -> None:
            got = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello world"}], max_tokens=8, temperature=0
            )
            assert got.usage is not None and got.usage.prompt_tokens > 0
            assert 1 <= got.usage.completion_tokens <= 8
            assert got.choices[0].finish_reason in {"length", "stop"}

        text = "The quick brown fox jumps over the lazy dog."

        def embedding() -> list[float]:
            return client.embeddings.create(model="tiny-embed", input=text).data[0].embedding

        def message() -> None:
            """Anthropic's Messages API, translated to llama-server's chat completions and back."""
            with anthropic.Anthropic(base_url=controller.url, api_key=key, max_retries=0, timeout=60) as claude:
                asked: Any = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
                got = claude.messages.create(system="be brief", **asked)
                assert got.stop_reason in {"max_tokens", "end_turn"} and 1 <= got.usage.output_tokens <= 8
                assert got.usage.input_tokens > 0
                with claude.messages.stream(**asked) as stream:
                    text = "".join(stream.text_stream)
                    final = stream.get_final_message()
                assert final.stop_reason in {"max_tokens", "end_turn"} and final.usage.output_tokens >= 1
                assert text == "".join(b.text for b in final.content if b.type == "text")

        def response() -> None:
            """OpenAI's Responses API, translated to llama-server's chat completions and back."""
            got = client.responses.create(model="tiny", input="hello", instructions="be brief", max_output_tokens=8)
            assert got.status in {"completed", "incomplete"} and got.usage is not None
            assert 1 <= got.usage.output_tokens <= 8 and got.usage.input_tokens > 0
            events = list(client.responses.create(model="tiny", input="hello", max_output_tokens=8, stream=True))
            last = events[-1]
            assert last.type in {"response.completed", "response.incomplete"}, [e.type for e in events]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert text == last.response.output_text and last.response.usage is not None
            assert last.response.usage.output_tokens >= 1

        try:
            await in_thread(chat_completion)
            await in_thread(message)
            await in_thread(response)
        except (openai.OpenAIError, anthropic.APIError):
            pytest.fail(runtime_logs(podman_service))
        await tokenizer(controller, key)
        served = await in_thread(embedding)
        reference = await trio.to_thread.run_sync(reference_embedding, tiny_embedding_gguf, text)
        assert len(served) == len(reference) == 64
        assert cosine(served, reference) > 0.999
    finally:
        client.close()

    # llama-server's /metrics, scraped by the node and sent in its heartbeats, in `nexa deployments show`.
    async def reported() -> Json | None:
        out = json.loads(await trio.to_thread.run_sync(cli, controller, "deployments", "show", "chat", "--json"))
        scores = out.get("replica_scores") or []
        fresh = [s for s in scores if s["report"] == "fresh" and s["running_reported"] is not None]
        # A scrape taken while the calls above still ran says 1 running; the next ones say the server is idle.
        return fresh[0] if fresh and fresh[0]["running_reported"] == 0 else None

    score = await wait_for(reported, "llama-server's metrics (idle) in deployments show", 60)
    assert score["queue_reported"] == 0 and score["running_reported"] == 0, score
    assert score["metrics_error"] in ("", None), score
