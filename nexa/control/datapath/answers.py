"""Checking what a runtime answered before a client sees it. Pure functions; never log or quote an
answer: a problem names fields only.

A unary answer, and each stream event as it is relayed, goes through msgspec's compiled JSON decoder
(`event_json`), then its shape is checked against the OpenAI answer of its capability. The decoder is
about 20 times cheaper than the one strict decoder (`codec.parse_json`), more for answers full of
numbers (embeddings), and as strict on what a client could choke on (valid UTF-8, no lone surrogates,
no NaN or Infinity, no truncation); what it lets through that the strict decoder refuses is duplicate
keys (the last one counts, as in most clients' parsers), integers beyond ±2^63 in fields nexa does
not read, and nesting between 64 and the interpreter's recursion limit. The counts nexa does read
(`usage`) are checked (`usage_problem`). Request bodies and signed messages keep the strict decoder.
"""

from __future__ import annotations

import json
import time
from typing import Any, Final, NamedTuple

import msgspec

from nexa.contracts.gateway import Capability
from nexa.control.datapath.metering import token_count_ok

#: Lines an SSE event may hold besides `data:` (comments start with a colon).
_SSE_OTHER_FIELDS: Final = (b":", b"event:", b"id:", b"retry:")
#: Answers and stream events' data (`event_json`): msgspec's JSON decoder, to Python objects.
_EVENT_DECODER: Final = msgspec.json.Decoder()


def event_json(raw: bytes) -> object:
    """A unary answer or a stream event's data through the compiled decoder (module docstring), or
    None when it refuses it: not UTF-8, a lone surrogate, truncated, NaN or Infinity, too deep."""
    try:
        return _EVENT_DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None


def unary_answer(body: bytes, capability: Capability) -> tuple[dict[str, Any] | None, str]:
    """The runtime's unary answer if it has the shape of its capability's answer, else (None, what
    is wrong): a JSON object; `choices` a list of objects (chat, completion), `data` a list of
    embedding objects (embeddings), the pooling, tokenizer and native APIs' own shapes; `usage`,
    when present, whole counts."""
    answer = event_json(body)
    if capability.media:
        return _media_answer(body, answer, capability)
    if not isinstance(answer, dict):
        return None, "not a JSON object" if body else "an empty body"
    problem = _shape_problem(capability, answer) or usage_problem(answer)
    if problem is not None:
        return None, problem
    return answer, ""


def _shape_problem(capability: Capability, answer: dict[str, Any]) -> str | None:
    if capability is Capability.EMBEDDING:
        data = answer.get("data")
        if not isinstance(data, list) or not all(
            isinstance(d, dict) and isinstance(d.get("embedding"), list | str) for d in data
        ):
            return "`data` is not a list of embedding objects"
        return None
    if capability.native:
        return _native_problem(capability, answer)
    if not capability.streams:
        return _pooling_problem(capability, answer)
    choices = answer.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return "`choices` is not a list of objects"
    return None


#: The list each pooling and tokenizer answer holds (vLLM's shapes; llama.cpp's server answers
#: rerank and tokenize alike, and detokenize with `content` for vLLM's `prompt`).
_POOLING_LISTS: Final = {Capability.RERANK: "results", Capability.SCORE: "data", Capability.TOKENIZE: "tokens"}


def _pooling_problem(capability: Capability, answer: dict[str, Any]) -> str | None:
    if capability is Capability.DETOKENIZE:
        text = answer.get("prompt", answer.get("content"))
        return None if isinstance(text, str) else "neither `prompt` nor `content` is a string"
    name = _POOLING_LISTS[capability]
    items = answer.get(name)
    if not isinstance(items, list):
        return f"`{name}` is not a list"
    if capability is Capability.TOKENIZE:
        # Token ids, or (llama.cpp's `with_pieces`) objects with an id and its piece.
        if not all(isinstance(t, int | dict) and not isinstance(t, bool) for t in items):
            return "`tokens` is not a list of token ids"
    elif not all(isinstance(item, dict) for item in items):
        return f"`{name}` is not a list of objects"
    return None


def _native_problem(capability: Capability, answer: dict[str, Any]) -> str | None:
    """What is wrong with a native API's unary answer: a Messages API `message` with its `content`
    list, a Responses API `response` with its `output` list, a token count's `input_tokens`."""
    if capability is Capability.MESSAGE_TOKENS:
        return None if token_count_ok(answer.get("input_tokens")) else "`input_tokens` is not a token count"
    kind, name = ("message", "content") if capability is Capability.MESSAGES else ("response", "output")
    if answer.get("type" if capability is Capability.MESSAGES else "object") != kind:
        return f"not a {kind} object"
    if not isinstance(answer.get(name), list):
        return f"`{name}` is not a list"
    return _native_usage_problem(answer.get("usage"))


def _native_usage_problem(usage: object) -> str | None:
    if usage is None:
        return None
    if not isinstance(usage, dict):
        return "`usage` is not an object"
    for name in ("input_tokens", "output_tokens"):
        value = usage.get(name)
        if value is not None and not token_count_ok(value):
            return f"`usage.{name}` is not a token count (a whole number, 0 to 2^31)"
    return None


def native_usage(capability: Capability, answer: dict[str, Any]) -> tuple[int | None, int | None]:
    """(input, output) tokens a native API's unary answer reports (checked by `unary_answer`)."""
    if capability is Capability.MESSAGE_TOKENS:
        return answer.get("input_tokens"), None
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None, None
    return usage.get("input_tokens"), usage.get("output_tokens")


#: The native stream events that end an answer, and those that carry output text.
_NATIVE_LAST: Final = frozenset({"message_stop", "response.completed", "response.incomplete", "response.failed"})
_NATIVE_TEXT: Final = frozenset({"content_block_delta", "response.output_text.delta"})


def _sse_data(event: bytes) -> list[bytes] | None:
    """The `data:` lines of one SSE event, each without its field name; None when a line is no SSE field."""
    data = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
        elif line and not line.startswith(_SSE_OTHER_FIELDS):
            return None
    return data


def check_native_event(event: bytes) -> EventCheck:
    """Check one SSE event of a native API's stream (Anthropic's or the Responses API's grammar):
    its lines are SSE fields and its data a JSON object with a `type`; the usage it carries is read:
    `message_start`'s message and `message_delta` (Messages), `response.completed` or
    `response.incomplete`'s response (Responses)."""
    data = _sse_data(event)
    if data is None:
        return EventCheck("a line that is not an SSE field")
    if not data:
        return _FINE
    obj = event_json(b"\n".join(data))
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        return EventCheck("an event whose data is not a JSON object with a type")
    kind = obj["type"]
    holder = (
        obj.get("message") if kind == "message_start" else obj.get("response") if kind.startswith("response.") else obj
    )
    usage = holder.get("usage") if isinstance(holder, dict) else None
    if (problem := _native_usage_problem(usage)) is not None:
        return EventCheck(problem)
    counts = usage if isinstance(usage, dict) else {}
    return EventCheck(
        None,
        done=kind in _NATIVE_LAST,
        text=kind in _NATIVE_TEXT,
        usage=bool(counts),
        prompt_tokens=counts.get("input_tokens"),
        completion_tokens=counts.get("output_tokens"),
    )


def counted_prompt_tokens(capability: Capability, answer: dict[str, Any], body: dict[str, Any]) -> int | None:
    """The tokens a tokenizer call metered when its runtime reports no `usage` (neither vLLM nor
    llama.cpp does there): the ids a tokenize answer lists, the ids a detokenize request sent.
    None for every other capability."""
    if capability is Capability.TOKENIZE:
        tokens = answer.get("tokens")
        return len(tokens) if isinstance(tokens, list) else 0
    if capability is Capability.DETOKENIZE:
        tokens = body.get("tokens")
        return len(tokens) if isinstance(tokens, list) else 0
    return None


def _media_answer(body: bytes, answer: object, capability: Capability) -> tuple[dict[str, Any] | None, str]:
    """`unary_answer` of a transcription, translation or image generation (speech is never parsed)."""
    if capability is not Capability.IMAGE and not isinstance(answer, dict):
        # `response_format` text, srt or vtt: plain text, passed on as it is.
        return ({}, "") if body and _utf8(body) else (None, "not text (and not a JSON object)")
    if not isinstance(answer, dict):
        return None, "not a JSON object" if body else "an empty body"
    if capability is Capability.IMAGE:
        data = answer.get("data")
        if not isinstance(data, list) or not data or not all(isinstance(d, dict) for d in data):
            return None, "`data` is not a list of image objects"
    elif not isinstance(answer.get("text"), str):
        return None, "`text` is not a string"
    problem = usage_problem(answer)
    return (None, problem) if problem is not None else (answer, "")


def _utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def usage_problem(obj: dict[str, Any]) -> str | None:
    usage = obj.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        return "`usage` is not an object"
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        value = usage.get(name)
        if value is not None and not token_count_ok(value):
            return f"`usage.{name}` is not a token count (a whole number, 0 to 2^31)"
    return None


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """The complete SSE events at the start of `buf` (each with its blank line), and the rest."""
    events: list[bytes] = []
    start = 0
    crlf = buf.find(b"\r\n\r\n")  # the next one at or after `start`, or -1: none (searched once, not per event)
    while True:
        if 0 <= crlf < start:
            crlf = buf.find(b"\r\n\r\n", start)
        lf = buf.find(b"\n\n", start)
        if lf < 0 and crlf < 0:
            return events, buf[start:]
        stop = lf + 2 if crlf < 0 or 0 <= lf < crlf else crlf + 4
        events.append(buf[start:stop])
        start = stop


class EventCheck(NamedTuple):
    """What `check_event` found in one SSE event of an inference stream."""

    #: What is wrong with it, or None.
    problem: str | None
    #: It is `[DONE]`.
    done: bool = False
    #: One of its choices carries output text (a non-empty `delta.content` or `text` string).
    text: bool = False
    #: It carries a `usage` object (checked: whole counts).
    usage: bool = False
    #: A native API's event: the input and output tokens its usage reports (None: not said).
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


_FINE: Final = EventCheck(None)


def check_event(event: bytes) -> EventCheck:
    """Check one SSE event of an inference stream: its lines are SSE fields; its data, if any, is
    `[DONE]` or a JSON object with `choices` (a list of objects) or an `error`, and a sane `usage`
    if it has one. The answer also says whether it carries text (what the controller counts, one
    event a token, when the runtime sends no usage) and a usage object."""
    data = _sse_data(event)
    if data is None:
        return EventCheck("a line that is not an SSE field")
    if not data:
        return _FINE
    joined = b"\n".join(data)
    if joined.strip() == b"[DONE]":
        return EventCheck(None, done=True)
    obj = event_json(joined)
    if not isinstance(obj, dict):
        return EventCheck("an event whose data is not a JSON object")
    choices = obj.get("choices")
    if "error" not in obj and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        return EventCheck("an event whose `choices` is not a list of objects")
    problem = usage_problem(obj)
    ok = problem is None
    text = ok and isinstance(choices, list) and any(map(_has_text, choices))
    return EventCheck(problem, text=text, usage=ok and obj.get("usage") is not None)


def _has_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return isinstance(text, str) and text != ""


def usage_event(prompt_tokens: int, completion_tokens: int) -> bytes:
    """A usage-only stream event (OpenAI's shape: empty `choices`), for a client that asked for
    usage (`stream_options.include_usage`) from a runtime that sends none (llama-cpp-python)."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    body = {"id": "nexa-usage", "object": "chat.completion.chunk", "created": int(time.time()), "choices": []}
    return b"data: " + json.dumps({**body, "usage": usage}, separators=(",", ":")).encode() + b"\n\n"


def completion_estimate(answer: dict[str, Any]) -> int:
    """A unary answer's completion tokens when the node's figure was refused: its own `usage`
    (already checked), else about four characters a token of the text of its choices."""
    usage = answer.get("usage")
    if isinstance(usage, dict) and token_count_ok(usage.get("completion_tokens")):
        return int(usage["completion_tokens"])
    chars = 0
    for choice in answer.get("choices") or []:
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        if isinstance(text, str):
            chars += len(text)
    return chars // 4
