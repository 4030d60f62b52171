"""Anthropic's Messages API (`POST /v1/messages`) translated to and from chat completions. Pure: no I/O.

`to_chat` checks a Messages request and makes the chat-completions body a runtime that serves only
chat completions answers (system prompt, text, images, tools and tool results, stop sequences,
sampling); what does not map faithfully (documents, server tools, extended thinking, unknown fields)
is refused with a typed error, never dropped. `to_message` makes the Messages answer from a unary
chat completion; `Events` turns a chat-completions stream into Anthropic's event grammar
(`message_start`, `ping`, `content_block_start`/`_delta`/`_stop` with `text_delta` and
`input_json_delta`, `message_delta`, `message_stop`), and ends it with an `error` event when the
runtime's stream fails or says something that does not translate. `error_body` is nexa's error in
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), by HTTP status.

Stop reasons: `length` is `max_tokens`, `tool_calls` is `tool_use`, `content_filter` is `refusal`;
`stop` is `stop_sequence` when the runtime says which stop string matched (vLLM's `stop_reason`, a
string the request listed), else `end_turn`. Nothing here logs or keeps a payload.
"""

from __future__ import annotations

import json
from typing import Any, Final

import attrs

from nexa.contracts import codec
from nexa.contracts.gateway import (
    MAX_REQUEST_TOKENS,
    AnthropicError,
    AnthropicErrorBody,
    Capability,
    body_problems,
    model_problem,
)
from nexa.control.datapath.calls import Progress
from nexa.control.datapath.translation import (
    ChatEvents,
    number,
    read_answer,
    refuse,
    sse,
    unsupported,
    whole,
)
from nexa.control.http.common import status_for
from nexa.errors import ContractError, NexaError

Json = dict[str, Any]

#: The route, and its token-counting sibling.
MESSAGES_PATH: Final = "/v1/messages"
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"
#: Anthropic's error types by HTTP status (its "Errors" page); any other 4xx is an invalid request,
#: any other 5xx an `api_error`, and 503 (no replica, a failed runtime) `overloaded_error`.
ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
#: Fields of a Messages request this translation reads; any other is refused by name.
_KNOWN: Final = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "stream",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "service_tier",
        "cache_control",
    }
)
#: Tool types a runtime can run as functions (absent, or `custom`); Anthropic's server tools cannot.
_FUNCTION_TOOLS: Final = (None, "custom")
_IMAGE_TYPES: Final = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_STOP_REASONS: Final = {
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


@attrs.frozen(kw_only=True)
class Request:
    """A checked Messages request: what the gateway runs (`chat`), and what its answer echoes."""

    model: str
    stream: bool
    #: The chat-completions body (without `model` and `stream`).
    chat: Json
    stop_sequences: tuple[str, ...] = ()


def to_chat(body: Json) -> Request:
    """The checked request and its chat-completions body; ContractError (400) naming what is wrong."""
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise refuse(unknown[0], "not a Messages API field this gateway takes")
    model = body.get("model")
    problem = model_problem(model)
    if problem is not None or not isinstance(model, str):
        raise refuse("model", problem or "required")
    max_tokens = body.get("max_tokens")
    if not whole(max_tokens, 1, MAX_REQUEST_TOKENS):
        raise refuse("max_tokens", f"required, an integer from 1 to {MAX_REQUEST_TOKENS}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise refuse("stream", "true or false")
    chat: Json = {"max_tokens": max_tokens}
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise refuse("messages", "a list of messages, not empty")
    for i, message in enumerate(raw):
        messages += _message(message, f"messages[{i}]")
    chat["messages"] = messages
    stops = _stop_sequences(body.get("stop_sequences"))
    if stops:
        chat["stop"] = list(stops)
    chat |= _sampling(body)
    _ignored(body)
    if (tools := body.get("tools")) is not None:
        chat["tools"] = _tools(tools)
    if (choice := body.get("tool_choice")) is not None:
        chat |= _tool_choice(choice, has_tools=bool(body.get("tools")))
    if problems := body_problems(Capability.CHAT, chat):  # what every chat completion is checked for
        raise ContractError("invalid request: " + "; ".join(problems), problems=tuple(problems))
    return Request(model=model, stream=stream, chat=chat, stop_sequences=stops)


def _ignored(body: Json) -> None:
    """Check the fields that change nothing the runtime does (metadata, service tier, thinking off,
    prompt-caching hints: `cache_control` here and on blocks is taken and ignored)."""
    if (metadata := body.get("metadata")) is not None and not isinstance(metadata, dict):
        raise refuse("metadata", "an object")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise refuse("service_tier", "auto or standard_only")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise unsupported("thinking", "extended thinking")


def _sampling(body: Json) -> Json:
    chat: Json = {}
    for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        if (value := body.get(name)) is not None:
            if not number(value, low, high):
                raise refuse(name, f"a number from {low:g} to {high:g}")
            chat[name] = value
    if (top_k := body.get("top_k")) is not None:
        if not whole(top_k, 0, 2**31 - 1):
            raise refuse("top_k", "a whole number, 0 or more")
        chat["top_k"] = top_k
    return chat


def _system(system: object) -> list[Json]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        texts = [_text_block(b, f"system[{i}]") for i, b in enumerate(system)]
        return [{"role": "system", "content": "\n".join(texts)}] if texts else []
    raise refuse("system", "a string or a list of text blocks")


def _text_block(block: object, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise refuse(where, 'a text block ({"type": "text", "text": "…"})')
    return str(block["text"])


def _stop_sequences(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise refuse("stop_sequences", "a list of non-empty strings")
    return tuple(value)


def _message(message: object, where: str) -> list[Json]:
    """One Messages message as the chat messages it becomes: a user turn's tool results become
    `tool` messages (first, as the chat API wants them right after the assistant's tool calls)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise refuse(f"{where}.role", "user or assistant")
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise refuse(f"{where}.{extra[0]}", "not a message field (role, content)")
    role = message["role"]
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise refuse(f"{where}.content", "a string or a list of content blocks")
    if role == "assistant":
        return [_assistant(content, where)]
    tool_results: list[Json] = []
    parts: list[Json] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            tool_results.append(_tool_result(block, at))
        elif kind == "text":
            parts.append({"type": "text", "text": _text_block(block, at)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind in ("document", "search_result", "container_upload"):
            raise unsupported(f"{at}.type", f"a {kind} block")
        else:
            raise refuse(f"{at}.type", "text, image or tool_result in a user message")
    return tool_results + ([{"role": "user", "content": parts}] if parts else [])


def _assistant(content: list[object], where: str) -> Json:
    texts: list[str] = []
    calls: list[Json] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use" and isinstance(block, dict):
            ident, name, args = block.get("id"), block.get("name"), block.get("input")
            if not (isinstance(ident, str) and ident and isinstance(name, str) and name and isinstance(args, dict)):
                raise refuse(at, "a tool_use block has an id, a name and an input object")
            arguments = json.dumps(args, separators=(",", ":"))
            calls.append({"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("thinking", "redacted_thinking"):
            raise unsupported(f"{at}.type", "a thinking block")
        else:
            raise refuse(f"{at}.type", "text or tool_use in an assistant message")
    out: Json = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_result(block: Json, where: str) -> Json:
    ident = block.get("tool_use_id")
    if not isinstance(ident, str) or not ident:
        raise refuse(f"{where}.tool_use_id", "the id of the tool_use it answers")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(b, f"{where}.content[{i}]") for i, b in enumerate(content))
    elif not isinstance(content, str):
        raise refuse(f"{where}.content", "a string or a list of text blocks")
    if block.get("is_error") is True:
        content = f"Error: {content}"  # the chat API has no error flag on a tool message
    return {"role": "tool", "tool_call_id": ident, "content": content}


def _image(block: Json, where: str) -> Json:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if isinstance(source, dict) and kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or media not in _IMAGE_TYPES or not isinstance(data, str) or not data:
            raise refuse(f"{where}.source", "media_type one of " + ", ".join(sorted(_IMAGE_TYPES)) + ", and data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if isinstance(source, dict) and kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if kind == "file":
        raise unsupported(f"{where}.source", "a file source (the Files API)")
    raise refuse(f"{where}.source", "a base64 or url image source")


def _tools(tools: object) -> list[Json]:
    if not isinstance(tools, list):
        raise refuse("tools", "a list of tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise refuse(at, "a tool object")
        if tool.get("type") not in _FUNCTION_TOOLS:
            raise unsupported(f"{at}.type", f"the server tool {tool.get('type')!r}")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise refuse(at, "a tool has a name and an input_schema object")
        function: Json = {"name": name, "parameters": schema}
        if isinstance(description := tool.get("description"), str):
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object, *, has_tools: bool) -> Json:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or kind not in ("auto", "any", "tool", "none"):
        raise refuse("tool_choice", "an object whose type is auto, any, tool or none")
    if kind != "none" and not has_tools:
        raise refuse("tool_choice", "needs tools")
    out: Json = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)}
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise refuse("tool_choice.name", "the name of the tool to use")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


# ---- answers ------------------------------------------------------------------------------------


def stop_reason(finish: object, matched: object, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a chat choice's `finish_reason` (and
    vLLM's `stop_reason`, the stop string that matched, when it sends one)."""
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn", None


def _usage(input_tokens: int, output_tokens: int) -> Json:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message_id(request_id: str) -> str:
    return "msg_" + request_id.removeprefix("req_")


def to_message(answer: Json | None, req: Request, request_id: str, progress: Progress) -> Json:
    """The Messages answer for a checked unary chat completion (`calls.Answer.answer`); the
    call's token counts (`progress`, as metered) when the answer carries no usage. An answer that
    does not translate is RuntimeFailed, and the call's status (what is metered) says so."""
    reply = read_answer(answer, progress)
    content: list[Json] = [{"type": "text", "text": reply.text}] if reply.text else []
    for call in reply.calls:
        ident = call.id or f"toolu_{len(content)}"
        content.append({"type": "tool_use", "id": ident, "name": call.name, "input": call.input})
    reason, sequence = stop_reason(reply.finish, reply.matched, req.stop_sequences)
    return {
        "id": message_id(request_id),
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(*reply.usage),
    }


def error_body(exc: NexaError, request_id: str) -> AnthropicError:
    """nexa's error `exc` in Anthropic's shape, typed by its HTTP status; nexa's code in the message."""
    status = status_for(exc)
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    message = f"{exc.message} ({exc.code}; request {request_id})"
    return AnthropicError(error=AnthropicErrorBody(type=kind, message=message), request_id=request_id)


class Events(ChatEvents):
    """A chat-completions stream (`translation.ChatEvents`) as Anthropic's stream events: `start`
    opens the message, each text or tool call is a content block, `end` writes `message_delta` (stop
    reason and usage) and `message_stop`, or an `error` event."""

    def __init__(self, req: Request, request_id: str) -> None:
        super().__init__(request_id)
        self._req = req
        #: The index of the open (or last) content block.
        self._block = -1

    def start(self, input_tokens: int = 0) -> bytes:
        message: Json = {
            "id": message_id(self._rid),
            "type": "message",
            "role": "assistant",
            "model": self._req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(input_tokens, 0),
        }
        return sse("message_start", {"type": "message_start", "message": message}) + sse("ping", {"type": "ping"})

    def _begin_text(self) -> list[bytes]:
        return self._begin({"type": "text", "text": ""})

    def _text(self, text: str) -> list[bytes]:
        return [self._delta({"type": "text_delta", "text": text})]

    def _begin_tool(self, index: int, ident: str | None, name: str) -> list[bytes]:
        return self._begin({"type": "tool_use", "id": ident or f"toolu_{self._rid}_{index}", "name": name, "input": {}})

    def _arguments(self, piece: str) -> list[bytes]:
        return [self._delta({"type": "input_json_delta", "partial_json": piece})]

    def _end_block(self, tool: bool, whole: str) -> list[bytes]:
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self._block})]

    def _last(self, prompt: int, completion: int) -> list[bytes]:
        reason, sequence = stop_reason(self.finish, self.matched, self._req.stop_sequences)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        delta["usage"] = _usage(prompt, completion)
        return [sse("message_delta", delta), sse("message_stop", {"type": "message_stop"})]

    def _error(self, exc: NexaError) -> bytes:
        return sse("error", codec.api.unstructure(error_body(exc, self._rid)))

    def _begin(self, block: Json) -> list[bytes]:
        self._block += 1
        return [
            sse("content_block_start", {"type": "content_block_start", "index": self._block, "content_block": block})
        ]

    def _delta(self, delta: Json) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": delta})
