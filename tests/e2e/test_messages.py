"""Anthropic's Messages API (`/v1/messages`) end to end: the official `anthropic` SDK against a
controller, real `nexa node` agents and their `sim` runtimes, which serve only chat completions, so
every call goes through the gateway's translation (`control/datapath/messages.py`) both ways."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.support.api import in_thread
from tests.support.cluster import SimCluster, new_key, usage_rows

pytestmark = pytest.mark.slow

Json = dict[str, Any]
#: A tool the sim runtime calls with {"city": "sim"} (`nexa/simruntime/tools.py`).
WEATHER: Json = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK: list[Any] = [{"role": "user", "content": "what is the weather in Oslo?"}]


def sdk(cluster: SimCluster, key: str | None = None) -> anthropic.Anthropic:
    """The official SDK's synchronous client (run in worker threads), sending the key as `x-api-key`."""
    client = anthropic.Anthropic(
        base_url=cluster.controller.url, api_key=key or cluster.inference_key, max_retries=0, timeout=30
    )
    cluster.on_close.append(client.close)
    return client


async def test_unary_streamed_and_system_prompt_answers_and_usage_is_metered(cluster: SimCluster) -> None:
    client = sdk(cluster)

    def scenario() -> int:
        asked: Any = {"system": "answer briefly", "messages": [{"role": "user", "content": "hello there"}]}
        message = client.messages.create(model="chat", max_tokens=64, **asked)
        assert message.type == "message" and message.role == "assistant" and message.model == "chat"
        [block] = message.content
        assert block.type == "text" and block.text
        assert message.stop_reason == "end_turn" and message.stop_sequence is None
        assert message.usage.output_tokens == 8 and message.usage.input_tokens == 4  # system + user words

        short = client.messages.create(model="chat", max_tokens=3, messages=ASK)
        assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3

        # A stop sequence the output reaches: the sim runtime stops before it and says which (as vLLM does).
        words = block.text.split()
        stop = words[3]
        before = " ".join(words[: words.index(stop)])
        stopped = client.messages.create(model="chat", max_tokens=64, stop_sequences=["zzz", stop], **asked)
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
        assert "".join(b.text for b in stopped.content if b.type == "text") == before
        with client.messages.stream(model="chat", max_tokens=64, stop_sequences=[stop], **asked) as stream:
            assert "".join(stream.text_stream) == before
            assert stream.get_final_message().stop_sequence == stop

        with client.messages.stream(model="chat", max_tokens=64, messages=ASK) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and final.content[0].type == "text" and final.content[0].text == text
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == 8 and final.usage.input_tokens > 0
        return len(before.split())

    n = await in_thread(scenario)
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["requests"] == 5 and row["errors"] == 0
    assert row["completion_tokens"] == 8 + 3 + n + n + 8


async def test_a_tool_call_and_its_result_round_trip_unary_and_streamed(cluster: SimCluster) -> None:
    client = sdk(cluster)

    def scenario() -> None:
        called = client.messages.create(model="chat", max_tokens=64, messages=ASK, tools=[WEATHER])
        assert called.stop_reason == "tool_use"
        [use] = called.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "sim"}

        with client.messages.stream(
            model="chat",
            max_tokens=64,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
        ) as stream:
            events = [e.type for e in stream]
            streamed = stream.get_final_message()
        assert streamed.stop_reason == "tool_use" and "input_json" in events
        assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [("tool_use", {"city": "sim"})]

        result = {"type": "tool_result", "tool_use_id": use.id, "content": "12 degrees and raining"}
        answered = client.messages.create(
            model="chat",
            max_tokens=64,
            tools=[WEATHER],
            messages=[*ASK, {"role": "assistant", "content": called.content}, {"role": "user", "content": [result]}],
        )
        assert answered.stop_reason == "end_turn" and answered.content[0].type == "text"

    await in_thread(scenario)
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["requests"] == 3 and row["errors"] == 0


async def test_nexa_errors_reach_the_sdk_as_its_typed_exceptions(cluster: SimCluster) -> None:
    operator = await new_key(cluster, "operator")
    limited = await new_key(cluster, "inference", "beta")
    async with cluster.client() as http:
        await http.put("/api/v1/quotas/beta", json={"requests_per_minute": 1})

    def ask(key: str | None = None, model: str = "chat", **extra: Any) -> Any:
        return sdk(cluster, key).messages.create(model=model, max_tokens=16, messages=ASK, **extra)

    def scenario() -> None:
        with pytest.raises(anthropic.AuthenticationError) as bad_key:
            ask("nxk_not_a_key")
        assert bad_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        keyless = httpx.post(f"{cluster.controller.url}/v1/messages", json={}, timeout=30)
        assert keyless.status_code == 401
        assert "x-api-key: <key>" in keyless.json()["error"]["message"]  # says how Anthropic clients present one
        with pytest.raises(anthropic.PermissionDeniedError):
            ask(operator)
        with pytest.raises(anthropic.NotFoundError) as unknown:
            ask(model="no-such-alias")
        assert unknown.value.body["type"] == "error"  # type: ignore[index]
        assert "model_not_found" in unknown.value.message
        with pytest.raises(anthropic.BadRequestError) as bad:
            ask(extra_body={"top_k": -1})
        assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError) as unsupported:
            ask(thinking={"type": "enabled", "budget_tokens": 1024})
        assert "field_not_supported" in unsupported.value.message
        ask(limited)
        with pytest.raises(anthropic.RateLimitError) as refused:
            ask(limited)
        assert "quota_exceeded" in refused.value.message
        assert int(refused.value.response.headers["retry-after"]) >= 1
        streamed = sdk(cluster, limited).messages.stream(model="chat", max_tokens=16, messages=ASK)
        with pytest.raises(anthropic.RateLimitError), streamed as stream:  # refused before the stream opens
            stream.get_final_message()

    await in_thread(scenario)
    rows = {r["tenant"]: r for r in await usage_rows(cluster)}
    # The quota refusals are recorded as errors, with no tokens: one answer was metered.
    assert rows["beta"]["requests"] == 3 and rows["beta"]["errors"] == 2
    assert rows["beta"]["completion_tokens"] == 8


BAD: list[tuple[Json, str]] = [
    ({"model": "chat", "messages": ASK}, "max_tokens"),
    ({"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": 7}]}, "content"),
    ({"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "type"),
    ({"model": "chat", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"model": "chat", "max_tokens": 8, "messages": ASK, "n": 2}, "n"),
]


async def test_bad_input_is_a_typed_4xx_and_nothing_is_metered(cluster: SimCluster) -> None:
    headers = {"x-api-key": cluster.inference_key, "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(base_url=cluster.controller.url, headers=headers, timeout=30) as http:
        for body, problem in BAD:
            refused = await http.post("/v1/messages", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            assert problem in error["error"]["message"], (problem, error)
        big = b"{" + b" " * 2_000_000 + b"}"  # over [http] max_body_bytes (1 MiB); sync: answered before it is read
        url = cluster.controller.url + "/v1/messages"
        too_big = await in_thread(lambda: httpx.post(url, content=big, headers=headers, timeout=30))
        assert too_big.status_code == 413
        assert too_big.json()["error"]["type"] == "request_too_large"
        counting = await http.post("/v1/messages/count_tokens", json={"model": "chat", "messages": ASK})
        assert counting.status_code == 404 and counting.json()["error"]["type"] == "not_found_error"
        # The controller serves on.
        served = await http.post("/v1/messages", json={"model": "chat", "max_tokens": 8, "messages": ASK})
        assert served.status_code == 200 and served.json()["content"][0]["type"] == "text"
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["requests"] == 1 and row["errors"] == 0
