"""nexa's own refusals reach each API's clients in that API's error shape, over real HTTP through a
controller, `nexa node` agents and `sim` runtimes: no Ready replica (503) and a deadline passed while
the runtime worked (504), for OpenAI's chat completions and Responses API (the official `openai`
SDK), Anthropic's Messages API (the official `anthropic` SDK) and rerank (httpx: no SDK has it).
Quota refusals are covered per API beside each one (test_gateway, test_responses, test_messages,
test_pooling)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.api import in_thread
from tests.support.cluster import SimCluster, sdk

pytestmark = pytest.mark.slow

ASK: list[Any] = [{"role": "user", "content": "hello there"}]


async def test_no_replica_and_a_passed_deadline_reach_each_api_in_its_own_shape(cluster: SimCluster) -> None:
    await cluster.model("never", alias="idle")
    await cluster.deploy("broken", replicas=1, alias="idle", args=["--no-such-flag"], wait=False)
    await cluster.model("slowly", alias="slow")
    await cluster.deploy("slow-a", replicas=1, alias="slow", args=["--ttft-ms", "5000", "--output-tokens", "8"])
    chat = sdk(cluster)
    claude = anthropic.Anthropic(base_url=cluster.controller.url, api_key=cluster.inference_key, max_retries=0)
    cluster.on_close.append(claude.close)

    def scenario() -> None:
        for model, status, code, kind in (
            ("idle", 503, "no_ready_replica", "overloaded_error"),
            ("slow", 504, "deadline_exceeded", "api_error"),
        ):
            headers = {"x-nexa-deadline-ms": "300"} if model == "slow" else {}
            with pytest.raises(openai.APIStatusError) as completion:
                chat.chat.completions.create(model=model, messages=ASK, extra_headers=headers)
            assert (completion.value.status_code, completion.value.code) == (status, code)
            with pytest.raises(openai.APIStatusError) as response:
                chat.responses.create(model=model, input="hello there", extra_headers=headers)
            assert (response.value.status_code, response.value.code) == (status, code)
            assert response.value.type == "server_error"
            with pytest.raises(anthropic.APIStatusError) as message:
                claude.messages.create(model=model, max_tokens=8, messages=ASK, extra_headers=headers)
            body: Any = message.value.body
            assert message.value.status_code == status and body["type"] == "error"
            assert body["error"]["type"] == kind and code in body["error"]["message"]
            rerank = httpx.post(
                cluster.controller.url + "/v1/rerank",
                json={"model": model, "query": "q", "documents": ["d"]},
                headers={"authorization": f"Bearer {cluster.inference_key}", **headers},
                timeout=30,
            )
            assert rerank.status_code == status and rerank.json()["error"]["code"] == code
            assert rerank.json()["error"]["type"] == "server_error"

    await in_thread(scenario)
