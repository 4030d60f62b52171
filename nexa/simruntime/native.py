"""Anthropic's Messages API and OpenAI's Responses API served natively, as vLLM serves them
(vllm/entrypoints/anthropic: `POST /v1/messages`, `/v1/messages/count_tokens`; vllm/entrypoints/
openai/serving_responses.py: `POST /v1/responses`), text only, when `--serve` names `messages`,
`message_tokens` or `responses` (the gateway then passes these requests through instead of
translating them). The words are the chat answer's (`tokens.output_words`); a unary answer is one
JSON object, a stream the API's own event grammar, each with its usage in the API's names.
"""

from __future__ import annotations

import json
import time
from typing import Any, Final

from nexa.contracts.gateway import Capability
from nexa.simruntime.asgi import BadRequest
from nexa.simruntime.tokens import count_words, output_words

#: The paths served, by capability.
PATHS: Final = {
    "/v1/messages": Capability.MESSAGES,
    "/v1/messages/count_tokens": Capability.MESSAGE_TOKENS,
    "/v1/responses": Capability.RESPONSES,
}
Json = dict[str, Any]


def _text(content: object, param: str) -> str:
    """A message's text: a string, or the text of its blocks (`text`, `input_text`, `output_text`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [b.get("text") for b in content if isinstance(b, dict)]
        return " ".join(p for p in parts if isinstance(p, str))
    raise BadRequest(f"{param} must be a string or a list of blocks", param=param)


def _prompt(capability: Capability, payload: Json) -> str:
    """The prompt's text: the system prompt (instructions) and every message's (input item's)."""
    if capability is Capability.RESPONSES:
        items = payload.get("input")
        texts = [payload.get("instructions") or ""]
        if isinstance(items, str):
            return " ".join([*texts, items])
        if not isinstance(items, list) or not items:
            raise BadRequest("input must be a string or a non-empty list of items", param="input")
        return " ".join(texts + [_text(i.get("content"), "input") for i in items if isinstance(i, dict)])
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    system = payload.get("system")
    texts = [_text(system, "system")] if system is not None else []
    return " ".join(texts + [_text(m.get("content"), "messages") for m in messages if isinstance(m, dict)])


def answer(
    capability: Capability, default_model: str, raw: bytes, *, serial: int, output_tokens: int
) -> tuple[bytes | list[bytes], int]:
    """The answer (one body, or a stream's events) and the tokens it made; BadRequest naming the field."""
    try:
        payload = json.loads(raw)
    except ValueError:
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise BadRequest("the body must be a JSON object")
    model = str(payload.get("model") or default_model)
    prompt = _prompt(capability, payload)
    asked = count_words(prompt)
    if capability is Capability.MESSAGE_TOKENS:
        return json.dumps({"input_tokens": asked}).encode(), 0
    limit_name = "max_tokens" if capability is Capability.MESSAGES else "max_output_tokens"
    limit = payload.get(limit_name, output_tokens)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise BadRequest(f"{limit_name} must be a whole number, 1 or more", param=limit_name)
    words = output_words(prompt, min(limit, output_tokens))
    cut = limit < output_tokens
    stream = payload.get("stream") is True
    if capability is Capability.MESSAGES:
        return _message(model, f"msg_sim{serial}", words, asked, cut, stream=stream), len(words)
    return _response(model, f"resp_sim{serial}", words, asked, cut, stream=stream), len(words)


def _sse(event: str, data: Json) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _message(model: str, ident: str, words: list[str], asked: int, cut: bool, *, stream: bool) -> bytes | list[bytes]:
    reason = "max_tokens" if cut else "end_turn"
    text = " ".join(words)
    message: Json = {"id": ident, "type": "message", "role": "assistant", "model": model}
    if not stream:
        usage = {"input_tokens": asked, "output_tokens": len(words)}
        whole = {**message, "content": [{"type": "text", "text": text}], "stop_reason": reason, "stop_sequence": None}
        return json.dumps({**whole, "usage": usage}).encode()
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": asked, "output_tokens": 0}
    events = [
        _sse("message_start", {"type": "message_start", "message": start}),
        _sse(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
    ]
    for at, word in enumerate(words):
        piece = word if at == 0 else " " + word
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
        events.append(_sse("content_block_delta", delta))
    last = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None}}
    last["usage"] = {"output_tokens": len(words)}
    return [
        *events,
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse("message_delta", last),
        _sse("message_stop", {"type": "message_stop"}),
    ]


def _response(model: str, ident: str, words: list[str], asked: int, cut: bool, *, stream: bool) -> bytes | list[bytes]:
    text = " ".join(words)
    item_id = "msg_" + ident
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"type": "message", "id": item_id, "status": "completed", "role": "assistant", "content": [part]}
    usage = {"input_tokens": asked, "output_tokens": len(words), "total_tokens": asked + len(words)}
    done: Json = {
        "id": ident,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": [item],
        "usage": usage,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    if not stream:
        return json.dumps(done).encode()
    events: list[bytes] = []

    def emit(kind: str, **data: object) -> None:
        events.append(_sse(kind, {"type": kind, "sequence_number": len(events), **data}))

    opened = {**done, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    emit("response.created", response=opened)
    emit("response.in_progress", response=opened)
    emit("response.output_item.added", output_index=0, item={**item, "status": "in_progress", "content": []})
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    emit("response.content_part.added", **where, part={**part, "text": ""})
    for at, word in enumerate(words):
        emit("response.output_text.delta", **where, delta=word if at == 0 else " " + word)
    emit("response.output_text.done", **where, text=text)
    emit("response.content_part.done", **where, part=part)
    emit("response.output_item.done", output_index=0, item=item)
    emit("response.incomplete" if cut else "response.completed", response=done)
    return events
