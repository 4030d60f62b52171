"""Anthropic's Messages API and OpenAI's Responses API served natively, as vLLM serves them
(vllm/entrypoints/anthropic: `POST /v1/messages`, `/v1/messages/count_tokens`; vllm/entrypoints/
openai/serving_responses.py: `POST /v1/responses`), text only, when `--serve` names `messages`,
`message_tokens` or `responses` (the gateway then passes these requests through instead of
translating them). The words are the chat answer's (`tokens.output_words`); a unary answer is one
JSON object, a stream the API's own event grammar, each with its usage in the API's names.

Stored responses, as vLLM keeps them (vllm/envs.py, serving_responses.py): only when started
with `VLLM_ENABLE_RESPONSES_API_STORE=1` (`STORE_ENV`), in memory (`Stored`), lost when it stops.
Then a response made with `store` not false is kept, and a request naming it as
`previous_response_id` continues it: its prompt is the kept conversation (the earlier prompts and
answers) followed by the new input, so its `input_tokens` count them; an id not kept is a 404.
Without the variable `store: true` is silently dropped, `background: true` with it refused (400
naming the variable) and any `previous_response_id` a 404, as vLLM answers. Ids are unique per
process when kept (`resp_sim<n>_<random>`), so two replicas never make the same one.

A kept response's own routes (`stored_route`), as vLLM's router serves them
(vllm/entrypoints/openai/responses/api_router.py at f6e93254, and `retrieve_responses`,
`cancel_responses`, `_make_not_found_error` in responses/serving.py at 4d89a999): `GET
/v1/responses/{id}` answers the kept Response object (`stream=true` replays only a background
response's events, which the simulator makes none of: the same 404 as an unknown id), `POST
/v1/responses/{id}/cancel` a 400 "Cannot cancel a synchronous response." (every kept response is
finished: only a background one, queued or in progress, cancels), an unknown id a 404 "Response
with id '…' not found." (`param` `response_id`). vLLM serves no `DELETE` of it (FastAPI's 405 for
a path it serves by another method) and no `/input_items` (404).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any, Final

from nexa.contracts.gateway import Capability
from nexa.simruntime.asgi import BadRequest, error_body
from nexa.simruntime.tokens import count_words, output_words

#: The paths served, by capability.
PATHS: Final = {
    "/v1/messages": Capability.MESSAGES,
    "/v1/messages/count_tokens": Capability.MESSAGE_TOKENS,
    "/v1/responses": Capability.RESPONSES,
}
Json = dict[str, Any]
#: vLLM keeps Responses API responses only when started with this set to 1 (`nexa.adapters.vllm`).
STORE_ENV: Final = "VLLM_ENABLE_RESPONSES_API_STORE"
#: Responses kept at most (vLLM keeps every one until it stops; the simulator forgets the oldest).
MAX_STORED: Final = 10_000


class Stored:
    """The responses kept, by id: each one's conversation so far, as text, and its Response object
    (oldest forgotten first)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[str, Json]] = {}

    def get(self, response_id: str) -> str | None:
        kept = self._kept.get(response_id)
        return None if kept is None else kept[0]

    def response(self, response_id: str) -> Json | None:
        kept = self._kept.get(response_id)
        return None if kept is None else kept[1]

    def keep(self, response_id: str, text: str, response: Json) -> None:
        self._kept[response_id] = (text, response)
        while len(self._kept) > MAX_STORED:
            del self._kept[next(iter(self._kept))]


def store_enabled(environ: Mapping[str, str]) -> bool:
    """Whether `environ` has the server keep responses, read as vLLM reads it (`bool(int(value))`)."""
    try:
        return bool(int(environ.get(STORE_ENV, "0")))
    except ValueError:
        return False


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
    capability: Capability,
    default_model: str,
    raw: bytes,
    *,
    serial: int,
    output_tokens: int,
    stored: Stored | None = None,
) -> tuple[bytes | list[bytes], int]:
    """The answer (one body, or a stream's events) and the tokens it made; BadRequest naming the
    field. `stored`: the responses kept (None: the server keeps none, `STORE_ENV` unset)."""
    try:
        payload = json.loads(raw)
    except ValueError:
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise BadRequest("the body must be a JSON object")
    model = str(payload.get("model") or default_model)
    prompt = _prompt(capability, payload)
    keep = False
    if capability is Capability.RESPONSES:
        prompt, keep = _continued(payload, prompt, stored)
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
    ident = f"resp_sim{serial}" if stored is None else f"resp_sim{serial}_{secrets.token_hex(6)}"
    done = _response_object(model, ident, words, asked, cut)
    if keep and stored is not None:
        stored.keep(ident, " ".join([prompt, *words]), done)
    return _response(done, words, stream=stream), len(words)


#: A kept response's own routes: `/v1/responses/{id}` and `/v1/responses/{id}/cancel`.
_STORED_PATH: Final = re.compile(r"/v1/responses/([^/]+)(/cancel)?")


def stored_path(path: str) -> bool:
    """Whether `path` is one of a kept response's own routes (`stored_route` answers it)."""
    return _STORED_PATH.fullmatch(path) is not None


def stored_route(stored: Stored | None, method: str, path: str, query: str) -> tuple[int, bytes]:
    """A kept response's own route (`stored_path`), as vLLM answers it: the status and the body."""
    match = _STORED_PATH.fullmatch(path)
    assert match is not None
    response_id, cancel = match[1], match[2] is not None
    if (method, cancel) not in (("GET", False), ("POST", True)):
        return 405, json.dumps({"detail": "Method Not Allowed"}).encode()
    kept = None if stored is None else stored.response(response_id)
    streamed = "stream=true" in query.lower().split("&")  # only a background response's events replay
    if kept is None or (streamed and not cancel):
        return 404, error_body(
            f"Response with id '{response_id}' not found.", "invalid_request_error", "404", "response_id"
        )
    if cancel:  # kept responses are finished ones here: only a queued or running background one cancels
        return 400, error_body("Cannot cancel a synchronous response.", "invalid_request_error", "400", "response_id")
    return 200, json.dumps(kept).encode()


def _continued(payload: Json, prompt: str, stored: Stored | None) -> tuple[str, bool]:
    """The prompt with the conversation `previous_response_id` continues before it, and whether
    the answer is kept; BadRequest as vLLM answers (see the module docstring)."""
    keep = payload.get("store", True) is not False and stored is not None
    if payload.get("background") not in (None, False):
        if stored is None and payload.get("store", True) is not False:
            raise BadRequest(
                "This vLLM engine does not support `store=True` and therefore does not support the background"
                f" mode. To enable these features, set the environment variable `{STORE_ENV}=1` when launching"
                " the vLLM server.",
                param="background",
            )
        raise BadRequest("background: not simulated", param="background")
    previous = payload.get("previous_response_id")
    if previous is None:
        return prompt, keep
    kept = stored.get(previous) if stored is not None and isinstance(previous, str) else None
    if kept is None:
        raise BadRequest(f"Response with id '{previous}' not found.", param="previous_response_id", status=404)
    return f"{kept} {prompt}", keep


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


def _response_object(model: str, ident: str, words: list[str], asked: int, cut: bool) -> Json:
    """The finished Response object."""
    part = {"type": "output_text", "text": " ".join(words), "annotations": []}
    item = {"type": "message", "id": "msg_" + ident, "status": "completed", "role": "assistant", "content": [part]}
    usage = {"input_tokens": asked, "output_tokens": len(words), "total_tokens": asked + len(words)}
    return {
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


def _response(done: Json, words: list[str], *, stream: bool) -> bytes | list[bytes]:
    """The answer of a finished Response `done`: its JSON, or a stream's events."""
    if not stream:
        return json.dumps(done).encode()
    [item] = done["output"]
    [part] = item["content"]
    item_id, text = item["id"], part["text"]
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
    emit("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)
    return events
