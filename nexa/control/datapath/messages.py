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
from nexa.control.datapath import answers
from nexa.control.datapath.calls import Progress
from nexa.control.datapath.metering import token_count_ok
from nexa.control.http.common import status_for
from nexa.errors import ContractError, FieldNotSupported, NexaError, RuntimeFailed

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


def _refuse(field: str, why: str) -> ContractError:
    return ContractError(f"{field}: {why}", problems=(f"{field}: {why}",))


def _unsupported(field: str, what: str) -> FieldNotSupported:
    return FieldNotSupported(
        f"{field}: {what} does not translate to the chat completions the runtime serves; leave it out",
        field=field,
    )


def to_chat(body: Json) -> Request:
    """The checked request and its chat-completions body; ContractError (400) naming what is wrong."""
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise _refuse(unknown[0], "not a Messages API field this gateway takes")
    model = body.get("model")
    problem = model_problem(model)
    if problem is not None or not isinstance(model, str):
        raise _refuse("model", problem or "required")
    max_tokens = body.get("max_tokens")
    if not _whole(max_tokens, 1, MAX_REQUEST_TOKENS):
        raise _refuse("max_tokens", f"required, an integer from 1 to {MAX_REQUEST_TOKENS}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _refuse("stream", "true or false")
    chat: Json = {"max_tokens": max_tokens}
    messages = _system(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _refuse("messages", "a list of messages, not empty")
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
        raise _refuse("metadata", "an object")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise _refuse("service_tier", "auto or standard_only")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise _unsupported("thinking", "extended thinking")


def _sampling(body: Json) -> Json:
    chat: Json = {}
    for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        if (value := body.get(name)) is not None:
            if not _number(value, low, high):
                raise _refuse(name, f"a number from {low:g} to {high:g}")
            chat[name] = value
    if (top_k := body.get("top_k")) is not None:
        if not _whole(top_k, 0, 2**31 - 1):
            raise _refuse("top_k", "a whole number, 0 or more")
        chat["top_k"] = top_k
    return chat


def _whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number(value: object, low: float, high: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high


def _system(system: object) -> list[Json]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        texts = [_text_block(b, f"system[{i}]") for i, b in enumerate(system)]
        return [{"role": "system", "content": "\n".join(texts)}] if texts else []
    raise _refuse("system", "a string or a list of text blocks")


def _text_block(block: object, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise _refuse(where, 'a text block ({"type": "text", "text": "…"})')
    return str(block["text"])


def _stop_sequences(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise _refuse("stop_sequences", "a list of non-empty strings")
    return tuple(value)


def _message(message: object, where: str) -> list[Json]:
    """One Messages message as the chat messages it becomes: a user turn's tool results become
    `tool` messages (first, as the chat API wants them right after the assistant's tool calls)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise _refuse(f"{where}.role", "user or assistant")
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise _refuse(f"{where}.{extra[0]}", "not a message field (role, content)")
    role = message["role"]
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _refuse(f"{where}.content", "a string or a list of content blocks")
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
            raise _unsupported(f"{at}.type", f"a {kind} block")
        else:
            raise _refuse(f"{at}.type", "text, image or tool_result in a user message")
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
                raise _refuse(at, "a tool_use block has an id, a name and an input object")
            arguments = json.dumps(args, separators=(",", ":"))
            calls.append({"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("thinking", "redacted_thinking"):
            raise _unsupported(f"{at}.type", "a thinking block")
        else:
            raise _refuse(f"{at}.type", "text or tool_use in an assistant message")
    out: Json = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_result(block: Json, where: str) -> Json:
    ident = block.get("tool_use_id")
    if not isinstance(ident, str) or not ident:
        raise _refuse(f"{where}.tool_use_id", "the id of the tool_use it answers")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(b, f"{where}.content[{i}]") for i, b in enumerate(content))
    elif not isinstance(content, str):
        raise _refuse(f"{where}.content", "a string or a list of text blocks")
    if block.get("is_error") is True:
        content = f"Error: {content}"  # the chat API has no error flag on a tool message
    return {"role": "tool", "tool_call_id": ident, "content": content}


def _image(block: Json, where: str) -> Json:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if isinstance(source, dict) and kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _IMAGE_TYPES or not isinstance(data, str) or not data:
            raise _refuse(f"{where}.source", "media_type one of " + ", ".join(sorted(_IMAGE_TYPES)) + ", and data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if isinstance(source, dict) and kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    if kind == "file":
        raise _unsupported(f"{where}.source", "a file source (the Files API)")
    raise _refuse(f"{where}.source", "a base64 or url image source")


def _tools(tools: object) -> list[Json]:
    if not isinstance(tools, list):
        raise _refuse("tools", "a list of tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _refuse(at, "a tool object")
        if tool.get("type") not in _FUNCTION_TOOLS:
            raise _unsupported(f"{at}.type", f"the server tool {tool.get('type')!r}")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise _refuse(at, "a tool has a name and an input_schema object")
        function: Json = {"name": name, "parameters": schema}
        if isinstance(description := tool.get("description"), str):
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object, *, has_tools: bool) -> Json:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or kind not in ("auto", "any", "tool", "none"):
        raise _refuse("tool_choice", "an object whose type is auto, any, tool or none")
    if kind != "none" and not has_tools:
        raise _refuse("tool_choice", "needs tools")
    out: Json = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)}
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise _refuse("tool_choice.name", "the name of the tool to use")
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


def _tool_input(arguments: object) -> Json:
    """A tool call's arguments (a JSON text) as the tool_use block's input object; RuntimeFailed otherwise."""
    parsed = answers.event_json(arguments.encode()) if isinstance(arguments, str) else None
    if arguments == "":
        parsed = {}
    if not isinstance(parsed, dict):
        raise RuntimeFailed("the runtime's answer is unusable (a tool call's arguments are not a JSON object)")
    return parsed


def to_message(answer: Json | None, req: Request, request_id: str, progress: Progress) -> Json:
    """The Messages answer for a checked unary chat completion (`calls.Answer.answer`); the
    call's token counts (`progress`, as metered) when the answer carries no usage. An answer that
    does not translate is RuntimeFailed, and the call's status (what is metered) says so."""
    try:
        return _to_message(answer, req, request_id, progress)
    except RuntimeFailed as exc:
        progress.status = exc.code
        raise


def _to_message(answer: Json | None, req: Request, request_id: str, progress: Progress) -> Json:
    choices = (answer or {}).get("choices") or []
    if not choices:
        raise RuntimeFailed("the runtime's answer is unusable (no choice)")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise RuntimeFailed("the runtime's answer is unusable (a choice without a message)")
    content: list[Json] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RuntimeFailed("the runtime's answer is unusable (tool_calls is not a list)")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RuntimeFailed("the runtime's answer is unusable (a tool call without a function name)")
        ident = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"toolu_{len(content)}"
        content.append(
            {"type": "tool_use", "id": ident, "name": function["name"], "input": _tool_input(function.get("arguments"))}
        )
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), req.stop_sequences)
    usage = (answer or {}).get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return {
        "id": message_id(request_id),
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(
            int(usage.get("prompt_tokens") or progress.prompt_tokens),
            int(usage.get("completion_tokens") or progress.completion_tokens),
        ),
    }


def error_body(exc: NexaError, request_id: str) -> AnthropicError:
    """nexa's error `exc` in Anthropic's shape, typed by its HTTP status; nexa's code in the message."""
    status = status_for(exc)
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    message = f"{exc.message} ({exc.code}; request {request_id})"
    return AnthropicError(error=AnthropicErrorBody(type=kind, message=message), request_id=request_id)


def sse(event: str, data: Json) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class Events:
    """A chat-completions stream (whole SSE events, as `calls.Answer` yields them) as Anthropic's
    stream events. `start` opens the message; `feed` translates what the runtime sent; `end` closes
    it with the stop reason and usage, or with an `error` event when the call failed (`error`) or the
    runtime said something that does not translate. Never raises on what the runtime sent."""

    def __init__(self, req: Request, request_id: str) -> None:
        self._req = req
        self._rid = request_id
        self._rest = b""
        #: The open content block: its index, and `text` or the chat tool call's index.
        self._block = -1
        self._open: str | int | None = None
        #: Each tool call's arguments as streamed, by chat index (checked when its block closes).
        self._args: dict[int, list[str]] = {}
        self._finish: object = None
        self._matched: object = None
        self._usage: tuple[int, int] | None = None
        #: What ended the translation early (its `error` event already written).
        self.failed: NexaError | None = None
        self._ended = False

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

    def feed(self, chunk: bytes) -> bytes:
        if self.failed is not None or self._ended:
            return b""
        events, self._rest = answers.split_events(self._rest + chunk)
        out: list[bytes] = []
        for event in events:
            try:
                out += self._event(event)
            except NexaError as exc:
                out.append(self._fail(exc))
                break
        return b"".join(out)

    def end(self, error: NexaError | None, progress: Progress) -> bytes:
        """The stream's last events; the call's token counts (`progress`) when the runtime sent no usage."""
        out = b""
        if error is None and self.failed is None and self._rest.strip():
            self._rest, tail = b"", self._rest + b"\n\n"  # a last event without its blank line
            out = self.feed(tail)
        if self.failed is not None and progress.status == "ok":
            progress.status = self.failed.code  # the call ends as the client saw it end
        if self.failed is not None or self._ended:
            return out
        if error is not None:
            return out + self._fail(error)
        try:
            out += b"".join(self._close())
        except NexaError as exc:
            progress.status = exc.code
            return out + self._fail(exc)
        reason, sequence = stop_reason(self._finish, self._matched, self._req.stop_sequences)
        prompt, completion = self._usage or (progress.prompt_tokens, progress.completion_tokens)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        delta["usage"] = _usage(prompt, completion)
        self._ended = True
        return out + sse("message_delta", delta) + sse("message_stop", {"type": "message_stop"})

    def _fail(self, exc: NexaError) -> bytes:
        self.failed = exc
        return sse("error", codec.api.unstructure(error_body(exc, self._rid)))

    def _event(self, event: bytes) -> list[bytes]:
        data = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
        if not data or b"\n".join(data).strip() == b"[DONE]":
            return []
        obj = answers.event_json(b"\n".join(data))
        if not isinstance(obj, dict):
            raise _bad("an event whose data is not a JSON object")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
            if not (token_count_ok(prompt) and token_count_ok(completion)):
                raise _bad("a usage that is not token counts")
            self._usage = (int(prompt), int(completion))
        choices = obj.get("choices")
        if not isinstance(choices, list):
            raise _bad("an event without choices")
        out: list[bytes] = []
        for choice in choices[:1]:  # Messages answers one choice; the request asked for one
            if not isinstance(choice, dict):
                raise _bad("a choice that is not an object")
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise _bad("a delta that is not an object")
            text = delta.get("content")
            if isinstance(text, str) and text:
                out += self._open_block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": text}))
            out += self._tool_calls(delta.get("tool_calls"))
            if choice.get("finish_reason") is not None:
                self._finish, self._matched = choice.get("finish_reason"), choice.get("stop_reason")
        return out

    def _tool_calls(self, calls: object) -> list[bytes]:
        if calls is None:
            return []
        if not isinstance(calls, list):
            raise _bad("tool_calls that is not a list")
        out: list[bytes] = []
        for call in calls:
            if not isinstance(call, dict) or not isinstance(function := call.get("function") or {}, dict):
                raise _bad("a tool call delta that is not an object with a function")
            index = call.get("index", 0)
            if not isinstance(index, int) or not _whole(index, 0, 1024):
                raise _bad("a tool call delta without an index")
            if index != self._open:
                name, ident = function.get("name"), call.get("id")
                if not isinstance(name, str) or not name or index in self._args:
                    raise _bad("a new tool call without a function name")
                ident = ident if isinstance(ident, str) and ident else f"toolu_{self._rid}_{index}"
                self._args[index] = []
                out += self._open_block(index, {"type": "tool_use", "id": ident, "name": name, "input": {}})
            piece = function.get("arguments")
            if piece is not None and not isinstance(piece, str):
                raise _bad("tool call arguments that are not text")
            if piece:
                self._args[index].append(piece)
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return out

    def _open_block(self, which: str | int, block: Json) -> list[bytes]:
        if self._open == which:
            return []
        out = self._close()
        self._block += 1
        self._open = which
        return [
            *out,
            sse("content_block_start", {"type": "content_block_start", "index": self._block, "content_block": block}),
        ]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        if isinstance(self._open, int):
            _tool_input("".join(self._args[self._open]))  # a tool's input must be a JSON object
        self._open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self._block})]

    def _delta(self, delta: Json) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": delta})


def _bad(problem: str) -> RuntimeFailed:
    return RuntimeFailed(f"the runtime's stream does not translate to Messages events ({problem})")
