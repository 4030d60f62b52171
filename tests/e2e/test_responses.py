"""OpenAI's Responses API (`/v1/responses`) end to end: the official `openai` SDK against a
controller, real `nexa node` agents and their `sim` runtimes, which serve only chat completions, so
every call goes through the gateway's translation (`control/datapath/responses.py`) both ways."""

from __future__ import annotations

from typing import Any

import apsw
import httpx
import openai
import pytest
from openai.types.responses import ResponseOutputMessage

from nexa.control import store as st
from tests.support.api import in_thread
from tests.support.cluster import SimCluster, new_key, sdk, usage_rows

pytestmark = pytest.mark.slow

Json = dict[str, Any]
#: A function tool the sim runtime calls with {"city": "sim"} (`nexa/simruntime/tools.py`).
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = "what is the weather in Oslo?"


def metered_apis(cluster: SimCluster, tenant: str) -> dict[str, int]:
    """api → requests metered for `tenant`, read from the controller's store (after `usage_rows`,
    which waits for the meter)."""
    db = apsw.Connection(str(cluster.controller.state_dir / st.DB_FILE), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        rows = db.execute("SELECT api, count(*) FROM usage WHERE tenant = ? GROUP BY api", (tenant,)).fetchall()
    finally:
        db.close()
    return {str(api): int(str(n)) for api, n in rows}


async def test_unary_streamed_instructions_and_max_output_tokens_and_usage_is_metered(cluster: SimCluster) -> None:
    client = sdk(cluster)

    def scenario() -> None:
        response = client.responses.create(model="chat", input="hello there", instructions="answer briefly")
        assert response.object == "response" and response.status == "completed" and response.model == "chat"
        assert response.id.startswith("resp_") and response.instructions == "answer briefly"
        [item] = response.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        assert response.output_text and response.incomplete_details is None
        assert response.usage is not None
        assert response.usage.output_tokens == 8 and response.usage.input_tokens == 4  # instructions + input words
        assert response.usage.total_tokens == 12

        short = client.responses.create(model="chat", input=[{"role": "user", "content": ASK}], max_output_tokens=3)
        assert short.status == "incomplete" and short.incomplete_details is not None
        assert short.incomplete_details.reason == "max_output_tokens"
        assert short.usage is not None and short.usage.output_tokens == 3

        events = list(client.responses.create(model="chat", input=ASK, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events[-1].response  # type: ignore[union-attr]
        assert text and final.output_text == text
        assert final.usage is not None and final.usage.output_tokens == 8

        # The SDK's stream helper accumulates the events into the final response.
        with client.responses.stream(model="chat", input=ASK) as stream:
            deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            streamed = stream.get_final_response()
        assert streamed.status == "completed" and streamed.output_text == deltas

        # Cut short by max_output_tokens: the stream ends with response.incomplete.
        cut = list(client.responses.create(model="chat", input=ASK, max_output_tokens=2, stream=True))
        last = cut[-1]
        assert last.type == "response.incomplete" and last.response.status == "incomplete"
        assert last.response.incomplete_details is not None
        assert last.response.incomplete_details.reason == "max_output_tokens"
        assert last.response.usage is not None and last.response.usage.output_tokens == 2
        [message] = last.response.output
        assert isinstance(message, ResponseOutputMessage) and message.status == "incomplete"

    await in_thread(scenario)
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["requests"] == 5 and row["errors"] == 0
    assert row["completion_tokens"] == 8 + 3 + 8 + 8 + 2
    assert metered_apis(cluster, "acme") == {"responses": 5}


async def test_a_function_call_and_its_output_round_trip_unary_and_streamed(cluster: SimCluster) -> None:
    client = sdk(cluster)

    def scenario() -> None:
        called = client.responses.create(model="chat", input=ASK, tools=[WEATHER])
        [call] = called.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.arguments == '{"city": "sim"}' and call.call_id and called.status == "completed"

        events = list(
            client.responses.create(
                model="chat",
                input=ASK,
                tools=[WEATHER],
                tool_choice={"type": "function", "name": "get_weather"},
                stream=True,
            )
        )
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done.arguments == '{"city": "sim"}'
        final = events[-1]
        assert final.type == "response.completed" and final.response.output[0].type == "function_call"

        # The follow-up sends the call back with its output, as agents do.
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees and raining"}
        answered = client.responses.create(
            model="chat",
            tools=[WEATHER],
            input=[{"role": "user", "content": ASK}, call, result],  # type: ignore[list-item]
        )
        assert answered.status == "completed" and answered.output[0].type == "message" and answered.output_text

    await in_thread(scenario)
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["requests"] == 3 and row["errors"] == 0


async def test_nexa_errors_reach_the_sdk_as_its_typed_exceptions(cluster: SimCluster) -> None:
    limited = await new_key(cluster, "inference", "beta")
    async with cluster.client() as http:
        await http.put("/api/v1/quotas/beta", json={"requests_per_minute": 1})

    def ask(key: str | None = None, model: str = "chat", **extra: Any) -> Any:
        return sdk(cluster, key).responses.create(model=model, **({"input": ASK} | extra))

    def scenario() -> None:
        with pytest.raises(openai.AuthenticationError):
            ask("nxk_not_a_key")
        with pytest.raises(openai.NotFoundError) as unknown:
            ask(model="no-such-alias")
        assert unknown.value.code == "model_not_found"
        refusals: list[tuple[Json, str]] = [
            ({"previous_response_id": "resp_1"}, "previous_response_id"),
            ({"store": True}, "store"),
            ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
            ({"temperature": 3}, "temperature"),
        ]
        for extra, param in refusals:
            with pytest.raises(openai.BadRequestError) as bad:
                ask(**extra)
            assert bad.value.param == param, (extra, bad.value.body)
            assert bad.value.type == "invalid_request_error"
        assert ask(store=False).status == "completed"  # nothing stored: store false is what happens
        ask(limited)
        with pytest.raises(openai.RateLimitError) as refused:
            ask(limited)
        assert refused.value.code == "quota_exceeded"
        with pytest.raises(openai.RateLimitError):  # refused before the stream opens
            ask(limited, stream=True)

    await in_thread(scenario)
    rows = {r["tenant"]: r for r in await usage_rows(cluster)}
    # The quota refusals are recorded as errors, with no tokens: one answer was metered.
    assert rows["beta"]["requests"] == 3 and rows["beta"]["errors"] == 2
    assert rows["beta"]["completion_tokens"] == 8


BAD: list[tuple[Json, str]] = [
    ({"model": "chat"}, "input"),
    ({"model": "chat", "input": []}, "input"),
    ({"model": "chat", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "chat", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"model": "chat", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "chat", "input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"model": "chat", "input": "x", "n": 2}, "n"),
]


async def test_bad_input_is_a_typed_4xx_and_nothing_is_metered(cluster: SimCluster) -> None:
    headers = {"authorization": f"Bearer {cluster.inference_key}"}
    async with httpx.AsyncClient(base_url=cluster.controller.url, headers=headers, timeout=30) as http:
        for body, param in BAD:
            refused = await http.post("/v1/responses", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (param, error)
        not_json = await http.post("/v1/responses", content=b"{", headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_request"
        big = b"{" + b" " * 2_000_000 + b"}"  # over [http] max_body_bytes (1 MiB); sync: answered before it is read
        url = cluster.controller.url + "/v1/responses"
        too_big = await in_thread(lambda: httpx.post(url, content=big, headers=headers, timeout=30))
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"
        # The controller serves on.
        served = await http.post("/v1/responses", json={"model": "chat", "input": ASK})
        assert served.status_code == 200 and served.json()["output"][0]["type"] == "message"
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["requests"] == 1 and row["errors"] == 0
