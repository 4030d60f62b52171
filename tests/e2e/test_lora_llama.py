"""A LoRA adapter served on its base by the real llama.cpp `llama-server` in podman (issue 34, point 2).

The tiny GGUF base (`tiny_gguf`) and a LoRA adapter for it made here in llama.cpp's adapter layout
(`tiny_lora_gguf`) are registered, verified, approved and aliased over the CLI (`tiny`, and `tiny-poet`
serving the adapter on `tiny@v1`); one deployment of the base on an enrolled `nexa node` gives its replica
the adapter at scale 0 (`--lora-init-without-apply --lora-scaled /models/lora/tiny-poet:0`). The official
`openai` SDK asks both aliases the same thing at temperature 0 with a seed: the base answers alike each
time and the adapter's answer differs (llama.cpp applies it for that request only, through the request's
`lora` field the node writes). Usage is recorded per adapter, and `nexa usage` shows it.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio

from tests.conftest import Controller
from tests.realparts import PodmanService, S3Store
from tests.support.api import Json, in_thread, ok
from tests.support.realmodel import (
    Node,
    cli,
    llama_server_deployment,
    ready_on,
    register_llama_server,
    register_model,
    runtime_logs,
    wait_for,
)

pytestmark = pytest.mark.slow


async def test_an_adapter_alias_answers_otherwise_than_its_base_and_its_usage_is_its_own(
    llama_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    llama_server_image: str,
    tiny_gguf: Path,
    tiny_lora_gguf: Path,
    podman_service: PodmanService,
) -> None:
    controller, _nodes = llama_cluster
    await register_llama_server(controller, llama_server_image)
    await register_model(controller, s3_store, "tiny", tiny_gguf)
    await register_model(controller, s3_store, "tiny-poet", tiny_lora_gguf, lora_for="tiny@v1")
    shown = await trio.to_thread.run_sync(cli, controller, "models", "show", "tiny-poet", "v1")
    assert "lora for     tiny@v1" in shown and "aliases      tiny-poet" in shown, shown
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201))["key"]
        chat = llama_server_deployment("chat", "tiny", {"ctx_size": 512, "parallel": 1, "flash_attn": "off"})
        await ok(http.post("/api/v1/deployments", json=chat), 201)
        placement = await ok(http.get("/api/v1/deployments/chat/placement"))
    process = placement["process"]
    assert "--lora-init-without-apply" in process, process
    assert process[process.index("--lora-scaled") + 1] == "/models/lora/tiny-poet:0", process
    await wait_for(lambda: ready_on(controller, "chat"), "chat Ready")

    client = openai.OpenAI(base_url=controller.url + "/v1", api_key=key, max_retries=0, timeout=60)
    try:

        def answer(model: str) -> str:
            got = client.completions.create(model=model, prompt="hello world", max_tokens=8, temperature=0, seed=7)
            assert got.usage is not None and got.usage.completion_tokens >= 1
            return got.choices[0].text

        try:
            base = [await in_thread(lambda: answer("tiny")) for _ in range(2)]
            adapted = [await in_thread(lambda: answer("tiny-poet")) for _ in range(2)]
            again = await in_thread(lambda: answer("tiny"))
        except openai.OpenAIError:
            pytest.fail(runtime_logs(podman_service))
    finally:
        client.close()
    assert base[0] == base[1] == again  # greedy: the base answers alike, also after the adapter's requests
    assert adapted[0] == adapted[1] != base[0]  # the adapter changes the answer, for its requests only

    async def rows() -> list[Json] | None:
        async with controller.client() as http:
            found: list[Json] = (await ok(http.get("/api/v1/usage", params={"tenant": "acme"})))["rows"]
        return found if sum(r["requests"] for r in found) >= 5 else None

    usage = {r["model"]: r["requests"] for r in await wait_for(rows, "usage recorded")}
    assert usage == {"tiny:v1": 3, "tiny:v1+tiny-poet:v1": 2}
    async with controller.client() as http:
        only = (await ok(http.get("/api/v1/usage", params={"model": "tiny-poet"})))["rows"]
    assert [(r["model"], r["requests"]) for r in only] == [("tiny:v1+tiny-poet:v1", 2)]
    report = await trio.to_thread.run_sync(cli, controller, "usage", "--tenant", "acme")
    assert "tiny:v1+tiny-poet:v1" in report, report
