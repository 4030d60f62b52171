"""The Messages ↔ chat completions translation (`control/datapath/messages.py`), pure: requests,
answers, the stream's event grammar, and what a hostile runtime's output becomes (an Anthropic
`error` event that ends the stream, never an exception)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nexa.control.datapath import messages
from nexa.errors import (
    ContractError,
    DeadlineExceeded,
    FieldNotSupported,
    NexaError,
    NoReadyReplica,
    QuotaExceeded,
    RuntimeFailed,
)
from tests.support.translation import HOSTILE_CHUNKS, TOOL_CALL_ANSWER, chunk, events, progress

Json = dict[str, Any]
BASE: Json = {"model": "chat", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
WEATHER: Json = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_a_request_becomes_a_chat_completion_with_system_images_tools_and_tool_results() -> None:
    body = BASE | {
        "system": [{"type": "text", "text": "be brief"}],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 4,
        "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u1"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
    }
    req = messages.to_chat(body)
    assert req.model == "chat" and not req.stream and req.stop_sequences == ("END",)
    chat = req.chat
    assert chat["max_tokens"] == 32 and chat["stop"] == ["END"] and chat["temperature"] == 0.5 and chat["top_k"] == 4
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}
    ]
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
            ],
        },
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]},
    ]
    named = messages.to_chat(BASE | {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 3}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "type"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "name"),
        ({"stream": "yes"}, "stream"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"temperature": 2}, "temperature"),
        ({"tool_choice": {"type": "auto"}}, "tool_choice"),
        ({"n": 2}, "n"),
        ({"temperature": float("nan")}, "temperature"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": []}}]}
                ]
            },
            "source",
        ),
    ],
)
def test_a_request_that_does_not_check_is_refused_naming_the_field(change: Json, field: str) -> None:
    body = {k: v for k, v in (BASE | change).items() if v is not None}
    with pytest.raises(ContractError) as refused:
        messages.to_chat(body)
    assert field in str(refused.value)


@pytest.mark.parametrize(
    "change",
    [
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}]}]},
    ],
)
def test_what_does_not_translate_is_field_not_supported(change: Json) -> None:
    with pytest.raises(FieldNotSupported):
        messages.to_chat(BASE | change)


def test_a_unary_answer_becomes_a_message_with_its_stop_reason_tools_and_usage() -> None:
    req = messages.to_chat(BASE | {"stop_sequences": ["END"]})
    answer = TOOL_CALL_ANSWER
    message = messages.to_message(answer, req, "req_abc", progress())
    assert message["id"] == "msg_abc" and message["model"] == "chat" and message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "text", "text": "it rains"},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    assert message["usage"] == {"input_tokens": 11, "output_tokens": 3}
    # vLLM says which stop string matched; without usage, the metered counts.
    stopped = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop", "stop_reason": "END"}]}
    out = messages.to_message(stopped, req, "req_abc", progress(5, 7))
    assert (out["stop_reason"], out["stop_sequence"], out["usage"]) == (
        "stop_sequence",
        "END",
        {"input_tokens": 5, "output_tokens": 7},
    )
    assert messages.stop_reason("length", None, ())[0] == "max_tokens"
    assert messages.stop_reason("stop", None, ("END",)) == ("end_turn", None)
    assert messages.stop_reason("content_filter", None, ())[0] == "refusal"


@pytest.mark.parametrize(
    "answer",
    [
        None,
        {"choices": []},
        {"choices": [{"finish_reason": "stop"}]},
        {"choices": [{"message": {"tool_calls": "x"}}]},
        {"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}}]},
        {"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}}]},
    ],
)
def test_a_unary_answer_that_does_not_translate_is_runtime_failed(answer: Json | None) -> None:
    call = progress()
    with pytest.raises(RuntimeFailed):
        messages.to_message(answer, messages.to_chat(BASE), "req_1", call)
    assert call.status == "runtime_failed"


def test_a_stream_becomes_anthropics_event_grammar() -> None:
    ev = messages.Events(messages.to_chat(BASE | {"stream": True}), "req_s")
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
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[0][1]["message"]["id"] == "msg_s" and got[0][1]["message"]["role"] == "assistant"
    assert got[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert got[3][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert got[6][1]["index"] == 1 and got[6][1]["content_block"]["type"] == "tool_use"
    assert got[6][1]["content_block"]["id"] == "call_9"
    assert got[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city":'}
    assert got[10][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[10][1]["usage"] == {"input_tokens": 9, "output_tokens": 4}
    assert ev.end(None, progress()) == b""  # ended once


@pytest.mark.parametrize(
    "hostile",
    HOSTILE_CHUNKS,
)
def test_a_hostile_stream_ends_with_an_error_event_never_an_exception(hostile: bytes) -> None:
    ev = messages.Events(messages.to_chat(BASE | {"stream": True}), "req_h")
    call = progress()
    out = ev.start() + ev.feed(chunk(content="ok") + hostile) + ev.feed(chunk(content="more")) + ev.end(None, call)
    assert call.status == "runtime_failed"  # metered as the client saw it end
    got = events(out)
    name, error = got[-1]
    assert name == "error" and error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "runtime_failed" in error["error"]["message"]
    assert sum(n == "error" for n, _ in got) == 1 and "message_stop" not in [n for n, _ in got]
    assert isinstance(ev.failed, RuntimeFailed)


def test_a_tool_call_whose_arguments_never_make_an_object_ends_with_an_error_event() -> None:
    ev = messages.Events(messages.to_chat(BASE | {"stream": True}), "req_t")
    call = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": '}}
    out = ev.start() + ev.feed(chunk(tool_calls=[call], finish="tool_calls")) + ev.end(None, progress())
    assert events(out)[-1][0] == "error"


def test_a_call_that_fails_mid_stream_ends_with_its_typed_error_event() -> None:
    ev = messages.Events(messages.to_chat(BASE | {"stream": True}), "req_d")
    out = ev.start() + ev.feed(chunk(content="partial")) + ev.end(DeadlineExceeded("too slow"), progress())
    name, error = events(out)[-1]
    assert (
        name == "error" and error["error"]["type"] == "api_error" and "deadline_exceeded" in error["error"]["message"]
    )


def test_every_nexa_error_has_anthropics_type_by_status() -> None:
    def kind(exc: NexaError) -> str:
        return messages.error_body(exc, "req_e").error.type

    assert kind(QuotaExceeded("over", limit="requests_per_minute", retry_after_s=1)) == "rate_limit_error"
    assert kind(ContractError("bad")) == "invalid_request_error"
    assert kind(RuntimeFailed("down")) == "api_error"  # 502
    assert kind(NoReadyReplica("none")) == "overloaded_error"  # 503
    body = messages.error_body(ContractError("bad"), "req_e")
    assert body.type == "error" and body.request_id == "req_e" and "invalid_request" in body.error.message
