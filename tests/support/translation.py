"""What the translated APIs' pure tests share (tests/control/test_messages_translation.py,
test_responses_translation.py): a call's metered progress, a chat stream chunk as a runtime sends it,
and a translated stream read back as (event, data) pairs."""

from __future__ import annotations

import json
from typing import Any

from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, Capability
from nexa.control.datapath.calls import Progress, Work

Json = dict[str, Any]

#: Chat stream chunks a hostile or broken runtime might send: not JSON, not an object, bad shapes,
#: a bad tool index, arguments that are not a JSON object's text, negative usage.
HOSTILE_CHUNKS: list[bytes] = [
    b"data: {not json\n\n",
    b"data: [1, 2]\n\n",
    b'data: {"choices": "x"}\n\n',
    b'data: {"choices": [{"delta": "x"}]}\n\n',
    b'data: {"choices": [{"delta": {"tool_calls": [{"index": -1, "function": {"name": "f"}}]}}]}\n\n',
    b'data: {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}\n\n',
    b'data: {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": 7}}]}}]}\n\n',
    b'data: {"choices": [], "usage": {"prompt_tokens": -4}}\n\n',
]

#: A runtime's unary chat answer: text, one tool call, its finish reason and usage.
TOOL_CALL_ANSWER: Json = {
    "choices": [
        {
            "message": {
                "role": "assistant",
                "content": "it rains",
                "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 11, "completion_tokens": 3},
}


def progress(prompt: int = 5, completion: int = 7) -> Progress:
    work = Work(
        request_id="req_1",
        api=Api.MESSAGES,
        tenant=TenantId("acme"),
        key_id=KeyId("k"),
        capability=Capability.CHAT,
        model="chat",
        body={},
        stream=True,
        deadline_at=0.0,
    )
    p = Progress(work=work, started=0.0)
    p.prompt_tokens, p.completion_tokens = prompt, completion
    return p


def chunk(**delta: Any) -> bytes:
    finish = delta.pop("finish", None)
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode() + b"\n\n"


def events(raw: bytes) -> list[tuple[str, Json]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            head, data = block.split("\n", 1)
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out
