"""The Responses ↔ chat completions translation (`control/datapath/responses.py`), pure: requests,
answers, the Responses event grammar, and what a hostile runtime's output becomes (an `error`
event and `response.failed` that end the stream, never an exception)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nexa.control.datapath import responses
from nexa.control.datapath.translation import param_of
from nexa.errors import ContractError, DeadlineExceeded, FieldNotSupported, RuntimeFailed
from tests.support.translation import HOSTILE_CHUNKS, TOOL_CALL_ANSWER, chunk, events, progress

Json = dict[str, Any]
BASE: Json = {"model": "chat", "input": "hi"}
WEATHER: Json = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def test_a_request_becomes_a_chat_completion_with_instructions_images_tools_and_their_outputs() -> None:
    schema = {"type": "object", "properties": {"t": {"type": "number"}}}
    body = BASE | {
        "instructions": "be brief",
        "max_output_tokens": 64,
        "temperature": 1.5,
        "top_p": 0.9,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}},
        "metadata": {"k": "v"},
        "store": False,
        "input": [
            {"role": "developer", "content": "use metric units"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "data:image/png;base64,iVBOR", "detail": "low"},
                ],
            },
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "checking", "annotations": []}],
            },
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        ],
    }
    req = responses.to_chat(body)
    assert req.model == "chat" and not req.stream and req.instructions == "be brief"
    assert req.max_output_tokens == 64 and req.metadata == {"k": "v"} and req.tools == (WEATHER,)
    chat = req.chat
    assert chat["max_tokens"] == 64 and chat["temperature"] == 1.5 and chat["top_p"] == 0.9
    assert chat["parallel_tool_calls"] is False
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["parameters"],
                "description": "the weather",
                "strict": True,
            },
        }
    ]
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": schema, "strict": True},
    }
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "use metric units"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR", "detail": "low"}},
            ],
        },
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    assert responses.to_chat(BASE).chat == {"messages": [{"role": "user", "content": "hi"}]}
    json_object = responses.to_chat(BASE | {"text": {"format": {"type": "json_object"}}})
    assert json_object.chat["response_format"] == {"type": "json_object"}
    # A function call with no assistant message before it makes one.
    calls = responses.to_chat(
        BASE | {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}
    )
    assert calls.chat["messages"][0]["role"] == "assistant" and calls.chat["messages"][0]["content"] is None


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": ""}, "model"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": [7]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input[0].content[0].type"),
        (
            {"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "audio"}]}, "input[0].type"),
        ({"input": [{"type": ["message"]}]}, "input[0].type"),  # not a string: refused, not a TypeError
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {}}, "stream_options"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"store": "yes"}, "store"),
        ({"n": 2}, "n"),
    ],
)
def test_a_request_that_does_not_check_is_refused_naming_the_field(change: Json, param: str) -> None:
    body = {k: v for k, v in (BASE | change).items() if v is not None}
    with pytest.raises(ContractError) as refused:
        responses.to_chat(body)
    assert not isinstance(refused.value, FieldNotSupported)
    assert param_of(refused.value) == param


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ],
)
def test_state_and_what_does_not_translate_are_field_not_supported(change: Json, param: str) -> None:
    with pytest.raises(FieldNotSupported) as refused:
        responses.to_chat(BASE | change)
    assert param_of(refused.value) == param


def test_a_unary_answer_becomes_a_response_with_its_items_status_and_usage() -> None:
    req = responses.to_chat(BASE | {"instructions": "be brief", "tools": [WEATHER]})
    answer = TOOL_CALL_ANSWER
    out = responses.to_response(answer, req, "req_abc", progress())
    assert out["id"] == "resp_abc" and out["object"] == "response" and out["model"] == "chat"
    assert out["status"] == "completed" and out["incomplete_details"] is None and out["error"] is None
    assert out["instructions"] == "be brief" and out["tools"] == [WEATHER] and out["store"] is False
    message, call = out["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "it rains", "annotations": [], "logprobs": []}]
    assert call == {
        "id": "fc_abc_0",
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city":"Oslo"}',
        "status": "completed",
    }
    assert out["usage"]["input_tokens"] == 11 and out["usage"]["output_tokens"] == 3
    assert out["usage"]["total_tokens"] == 14
    # Cut by the length limit: incomplete; without usage, the metered counts.
    cut = {"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]}
    short = responses.to_response(cut, req, "req_abc", progress(5, 7))
    assert short["status"] == "incomplete" and short["incomplete_details"] == {"reason": "max_output_tokens"}
    assert short["output"][0]["status"] == "incomplete"
    assert (short["usage"]["input_tokens"], short["usage"]["output_tokens"]) == (5, 7)
    assert responses.status_of("content_filter") == ("incomplete", {"reason": "content_filter"})
    assert responses.status_of("stop") == ("completed", None)


@pytest.mark.parametrize(
    "answer",
    [
        None,
        {"choices": []},
        {"choices": [{"finish_reason": "stop"}]},
        {"choices": [{"message": {"tool_calls": "x"}}]},
        {"choices": [{"message": {"tool_calls": [{"function": {"arguments": "{}"}}]}}]},
        {"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}}]},
    ],
)
def test_a_unary_answer_that_does_not_translate_is_runtime_failed(answer: Json | None) -> None:
    call = progress()
    with pytest.raises(RuntimeFailed):
        responses.to_response(answer, responses.to_chat(BASE), "req_1", call)
    assert call.status == "runtime_failed"


def test_a_stream_becomes_the_responses_event_grammar() -> None:
    ev = responses.Events(responses.to_chat(BASE | {"stream": True, "tools": [WEATHER]}), "req_s")
    out = ev.start()
    out += ev.feed(chunk(role="assistant", content="") + chunk(content="Hel") + chunk(content="lo"))
    out += ev.feed(
        chunk(tool_calls=[{"index": 0, "id": "call_9", "function": {"name": "get_weather", "arguments": ""}}])
    )
    out += ev.feed(chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city":'}}]))
    out += ev.feed(chunk(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]) + chunk(finish="tool_calls"))
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    out += ev.feed(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    out += ev.end(None, progress())
    got = events(out)
    assert [name for name, _ in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(data["type"] == name for name, data in got)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    assert got[0][1]["response"]["status"] == "in_progress" and got[0][1]["response"]["id"] == "resp_s"
    message_id = got[2][1]["item"]["id"]
    assert got[4][1] == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        "item_id": message_id,
        "output_index": 0,
        "content_index": 0,
        "delta": "Hel",
        "logprobs": [],
    }
    assert got[6][1]["text"] == "Hello" and got[8][1]["item"]["content"][0]["text"] == "Hello"
    call = got[9][1]["item"]
    assert got[9][1]["output_index"] == 1 and call["type"] == "function_call" and call["call_id"] == "call_9"
    assert got[10][1]["delta"] == '{"city":' and got[10][1]["item_id"] == call["id"]
    assert got[12][1]["arguments"] == '{"city":"Oslo"}'
    final = got[-1][1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"city":"Oslo"}' and final["output"][1]["status"] == "completed"
    assert final["usage"]["input_tokens"] == 9 and final["usage"]["output_tokens"] == 4
    assert ev.end(None, progress()) == b""  # ended once


def test_a_stream_cut_by_the_length_limit_ends_incomplete() -> None:
    ev = responses.Events(responses.to_chat(BASE | {"stream": True, "max_output_tokens": 2}), "req_l")
    out = ev.start() + ev.feed(chunk(content="a b") + chunk(finish="length")) + ev.end(None, progress(3, 2))
    got = events(out)
    name, last = got[-1]
    assert name == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete"
    assert last["response"]["usage"]["output_tokens"] == 2  # the metered count: the runtime sent no usage


@pytest.mark.parametrize(
    "hostile",
    HOSTILE_CHUNKS,
)
def test_a_hostile_stream_ends_with_an_error_and_response_failed_never_an_exception(hostile: bytes) -> None:
    ev = responses.Events(responses.to_chat(BASE | {"stream": True}), "req_h")
    call = progress()
    out = ev.start() + ev.feed(chunk(content="ok") + hostile) + ev.feed(chunk(content="more")) + ev.end(None, call)
    assert call.status == "runtime_failed"  # metered as the client saw it end
    got = events(out)
    (error_name, error), (failed_name, failed) = got[-2:]
    assert error_name == "error" and error["type"] == "error" and error["code"] == "runtime_failed"
    assert failed_name == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "runtime_failed"
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    names = [n for n, _ in got]
    assert names.count("error") == 1 and "response.completed" not in names
    assert isinstance(ev.failed, RuntimeFailed)


def test_a_call_that_fails_mid_stream_ends_with_its_typed_error() -> None:
    ev = responses.Events(responses.to_chat(BASE | {"stream": True}), "req_d")
    out = ev.start() + ev.feed(chunk(content="partial")) + ev.end(DeadlineExceeded("too slow"), progress())
    (name, error), (_, failed) = events(out)[-2:]
    assert name == "error" and error["code"] == "deadline_exceeded" and "too slow" in error["message"]
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "deadline_exceeded"


def test_every_nexa_error_is_openais_error_object_by_status() -> None:
    bad = responses.error_object(FieldNotSupported("store: no", field="store"), "req_e", "store")
    assert bad == {
        "message": "store: no (request req_e)",
        "type": "invalid_request_error",
        "param": "store",
        "code": "field_not_supported",
    }
    assert responses.error_object(RuntimeFailed("down"), "req_e", None)["type"] == "server_error"
    assert param_of(ContractError("the body is not valid JSON", problems=("(body): invalid JSON",))) is None
