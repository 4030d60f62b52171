"""Anthropic's Messages API and OpenAI's Responses API passed through to a runtime that serves them
natively (the `sim` runtime started with `--serve messages,message_tokens,responses`, answering as
vLLM does: `nexa/simruntime/native.py`), with the official `anthropic` and `openai` SDKs, through a
controller and real `nexa node` agents. The `chat` alias's runtimes serve chat completions only, so
its calls are still translated (tests/e2e/test_messages.py, test_responses.py)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.api import in_thread, ok
from tests.support.cluster import SIM_ARGS, SimCluster, new_key, sdk, usage_rows

pytestmark = pytest.mark.slow

NATIVE_ARGS = [*SIM_ARGS, "--serve", "messages,message_tokens,responses"]
ASK: list[Any] = [{"role": "user", "content": "hello there"}]


async def native_cluster(cluster: SimCluster) -> None:
    """`native`: an alias whose one replica serves the Messages and Responses APIs itself."""
    await cluster.model("native", "native")
    await cluster.deploy("native-a", replicas=1, alias="native", args=NATIVE_ARGS)


def claude(cluster: SimCluster) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=cluster.controller.url, api_key=cluster.inference_key, max_retries=0)
    cluster.on_close.append(client.close)
    return client


def runtime_paths(cluster: SimCluster) -> list[str]:
    """The paths the runtimes were asked, in order (their journals)."""
    return [e["path"] for n in cluster.nodes for e in n.journal() if e["event"] == "request"]


async def test_messages_pass_through_unary_streamed_and_counted(cluster: SimCluster) -> None:
    await native_cluster(cluster)
    client = claude(cluster)

    def scenario() -> None:
        message = client.messages.create(model="native", max_tokens=64, system="be brief", messages=ASK)
        assert message.type == "message" and message.id.startswith("msg_sim")  # the runtime's own answer
        assert message.model == "native" and message.stop_reason == "end_turn"
        assert message.usage.input_tokens == 4 and message.usage.output_tokens == 8
        [block] = message.content
        assert block.type == "text" and len(block.text.split()) == 8

        short = client.messages.create(model="native", max_tokens=3, messages=ASK)
        assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3

        with client.messages.stream(model="native", max_tokens=64, messages=ASK) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.content[0].type == "text" and text == final.content[0].text and len(text.split()) == 8
        assert final.usage.input_tokens == 2 and final.usage.output_tokens == 8 and final.stop_reason == "end_turn"

        counted = client.messages.count_tokens(model="native", system="be brief", messages=ASK)
        assert counted.input_tokens == 4

    await in_thread(scenario)
    assert runtime_paths(cluster) == ["/v1/messages"] * 3 + ["/v1/messages/count_tokens"]
    rows = {r["model"]: r for r in await usage_rows(cluster, tenant="acme")}
    [row] = [r for model, r in rows.items() if model.startswith("native")]
    assert row["requests"] == 4 and row["errors"] == 0
    assert row["prompt_tokens"] == 4 + 2 + 2 + 4 and row["completion_tokens"] == 8 + 3 + 8


async def test_responses_pass_through_unary_and_streamed(cluster: SimCluster) -> None:
    await native_cluster(cluster)
    client = sdk(cluster)

    def scenario() -> None:
        got = client.responses.create(model="native", input="hello there", instructions="be brief")
        assert got.id.startswith("resp_sim") and got.status == "completed"
        assert got.usage is not None and (got.usage.input_tokens, got.usage.output_tokens) == (4, 8)
        assert len(got.output_text.split()) == 8

        cut = client.responses.create(model="native", input="hello there", max_output_tokens=3)
        assert cut.status == "incomplete" and cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens"

        events = list(client.responses.create(model="native", input="hello there", stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        last = events[-1]
        assert last.type == "response.completed" and last.response.usage is not None
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == last.response.output_text and len(text.split()) == 8

        # State lives in one replica's memory: not routed to it, so refused by name.
        with pytest.raises(openai.BadRequestError) as stateful:
            client.responses.create(model="native", input="and then?", previous_response_id=got.id)
        assert stateful.value.code == "field_not_supported" and "previous_response_id" in stateful.value.message

    await in_thread(scenario)
    assert runtime_paths(cluster) == ["/v1/responses"] * 3
    rows = [r for r in await usage_rows(cluster, tenant="acme") if r["model"].startswith("native")]
    # The refusal ran nothing and made no call: three calls metered, with the runtime's usage.
    assert [(r["requests"], r["errors"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (3, 0, 4 + 2 + 2, 8 + 3 + 8)
    ]


async def test_a_runtime_refusing_a_passed_request_reaches_the_sdk_as_its_typed_error(cluster: SimCluster) -> None:
    await native_cluster(cluster)
    headers = {"x-api-key": cluster.inference_key, "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(base_url=cluster.controller.url, headers=headers, timeout=30) as http:
        # Passed through as is: the runtime's own 400 comes back in Anthropic's shape.
        refused = await http.post("/v1/messages", json={"model": "native", "max_tokens": 8, "messages": []})
        assert refused.status_code == 400, refused.text
        assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "invalid_request_error"
        assert "runtime_rejected" in refused.json()["error"]["message"]
        # nexa's own checks still come first: nothing reaches the runtime.
        bad = await http.post("/v1/messages", json={"model": "native", "max_tokens": 0, "messages": ASK})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        # The translated alias has no token count.
        counting = await http.post("/v1/messages/count_tokens", json={"model": "chat", "messages": ASK})
        assert counting.status_code == 404 and counting.json()["error"]["type"] == "not_found_error"
        assert "served only by runtimes that serve it themselves" in counting.json()["error"]["message"]
    assert runtime_paths(cluster) == ["/v1/messages"]


async def storing_cluster(cluster: SimCluster) -> tuple[openai.OpenAI, openai.OpenAI]:
    """`native` on two replicas, one on each node, that keep responses (as vLLM does with
    VLLM_ENABLE_RESPONSES_API_STORE=1); the SDK with acme's key, and with another tenant's."""
    await cluster.model("native", "native")
    store = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    await cluster.deploy("native-a", replicas=2, alias="native", args=NATIVE_ARGS, env=store)
    placed = await cluster.ready_replicas("native-a")
    assert len(set(placed.values())) == 2  # one replica on each node
    return sdk(cluster), sdk(cluster, await new_key(cluster, "inference", "globex"))


async def test_stored_responses_continue_on_the_replica_that_keeps_them(cluster: SimCluster) -> None:
    """A runtime started with VLLM_ENABLE_RESPONSES_API_STORE=1 keeps its responses (as vLLM does):
    every later turn goes to the replica that made the previous one, of two; another tenant's id
    is not found; once that replica is gone, the stored response is lost, never routed elsewhere."""
    client, other = await storing_cluster(cluster)
    store = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    turns: list[str] = []

    def scenario() -> None:
        first = client.responses.create(model="native", input="hello there", store=True)
        turns.append(first.id)
        assert first.usage is not None and first.usage.input_tokens == 2
        previous, said = first, 2 + 8
        for n in range(3):  # each turn's prompt is the kept conversation, then its own input
            later = client.responses.create(model="native", input="and then", previous_response_id=previous.id)
            assert later.usage is not None and later.usage.input_tokens == said + 2, n
            turns.append(later.id)
            previous, said = later, said + 2 + 8
        # Streamed: its id is read from the stream's `response.created`, and continued too.
        events = list(
            client.responses.create(model="native", input="and then", previous_response_id=previous.id, stream=True)
        )
        last = events[-1]
        assert last.type == "response.completed" and last.response.usage is not None
        assert last.response.usage.input_tokens == said + 2
        after = client.responses.create(model="native", input="so", previous_response_id=last.response.id)
        assert after.usage is not None and after.usage.input_tokens == said + 2 + 8 + 1
        turns.append(after.id)

        # State is per tenant: another tenant's id is not found, and nothing reaches a runtime.
        with pytest.raises(openai.NotFoundError) as foreign:
            other.responses.create(model="native", input="hi", previous_response_id=first.id)
        assert foreign.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError) as unknown:
            client.responses.create(model="native", input="hi", previous_response_id="resp_never_made")
        assert unknown.value.code == "response_not_found"

    await in_thread(scenario)
    asked = {
        n.name: [e for e in n.journal() if e["event"] == "request" and e["path"] == "/v1/responses"]
        for n in cluster.nodes
    }
    # Every turn of the conversation went to the one replica keeping it (six requests, one node).
    assert sorted(len(a) for a in asked.values()) == [0, 6], asked

    # The replica goes (its deployment is replaced): the stored response went with it.
    async with cluster.client() as http:
        await ok(http.delete("/api/v1/deployments/native-a"))
    await cluster.deploy("native-b", replicas=1, alias="native", args=NATIVE_ARGS, env=store)

    def lost() -> None:
        with pytest.raises(openai.NotFoundError) as gone:
            client.responses.create(model="native", input="and then", previous_response_id=turns[-1])
        assert gone.value.code == "stored_response_lost"
        assert "send the whole conversation" in gone.value.message
        with pytest.raises(openai.NotFoundError) as retrieved:  # its own route too: never another replica
            client.responses.retrieve(turns[-1])
        assert retrieved.value.code == "stored_response_lost"
        fresh = client.responses.create(model="native", input="hello there")  # new conversations go on
        assert fresh.status == "completed"

    await in_thread(lost)


async def test_a_stored_response_is_retrieved_and_cancelled_on_its_replica_as_vllm_serves_them(
    cluster: SimCluster,
) -> None:
    """The SDK's `responses.retrieve` and `responses.cancel` reach the replica keeping the response,
    through the node channel, and answer as vLLM does (a finished response does not cancel: its
    400); `responses.delete` and `responses.input_items.list`, which vLLM does not serve, are a
    typed 404 saying what to do instead; another tenant's id and an unknown one are not found and
    reach no runtime. Each routed call is counted as a request, with no tokens."""
    client, other = await storing_cluster(cluster)
    made: list[str] = []

    def scenario() -> None:
        first = client.responses.create(model="native", input="hello there", store=True)
        made.append(first.id)
        got = client.responses.retrieve(first.id)
        assert (got.id, got.status, got.output_text) == (first.id, "completed", first.output_text)
        later = client.responses.create(model="native", input="and then", previous_response_id=got.id)
        assert later.usage is not None and later.usage.input_tokens == 2 + 8 + 2
        assert client.responses.retrieve(later.id).output_text == later.output_text

        with pytest.raises(openai.BadRequestError) as cancel:  # vLLM: only a background response cancels
            client.responses.cancel(first.id)
        assert (
            cancel.value.code == "runtime_rejected" and "Cannot cancel a synchronous response" in cancel.value.message
        )
        with pytest.raises(openai.NotFoundError) as deleting:
            client.responses.delete(first.id)
        assert deleting.value.code == "api_not_served" and "store: false" in deleting.value.message
        with pytest.raises(openai.NotFoundError) as items:
            client.responses.input_items.list(first.id)
        assert items.value.code == "api_not_served" and "retrieve the response" in items.value.message
        with pytest.raises(openai.BadRequestError) as streamed:
            client.responses.retrieve(first.id, stream=True)
        assert streamed.value.code == "field_not_supported" and streamed.value.param == "stream"
        assert client.responses.retrieve(first.id).id == first.id  # the refused delete changed nothing

        for refused in (
            lambda: other.responses.retrieve(first.id),
            lambda: other.responses.cancel(first.id),
            lambda: other.responses.delete(first.id),
            lambda: client.responses.retrieve("resp_never_made"),
            lambda: client.responses.cancel("resp_never_made"),
        ):
            with pytest.raises(openai.NotFoundError) as unknown:
                refused()
            assert unknown.value.code == "response_not_found"

    await in_thread(scenario)
    asked = {
        n.name: [(e.get("method", "POST"), e["path"]) for e in n.journal() if e["event"] == "request"]
        for n in cluster.nodes
    }
    [(keeping, paths)] = [(name, paths) for name, paths in asked.items() if paths]  # one replica had it all
    first_path = f"/v1/responses/{made[0]}"
    assert paths[0] == ("POST", "/v1/responses") and paths[1] == ("GET", first_path), keeping
    assert paths.count(("POST", first_path + "/cancel")) == 1 and paths.count(("GET", first_path)) == 2
    assert len(paths) == 2 + 2 + 1 + 1  # two creates, two retrieves of it (and one of the later), one cancel
    rows = [r for r in await usage_rows(cluster, tenant="acme") if r["model"].startswith("native")]
    # Six calls routed (the cancel refused by the runtime); the retrieves and the cancel add no tokens.
    assert [(r["requests"], r["errors"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (6, 1, 2 + 12, 8 + 8)
    ]
