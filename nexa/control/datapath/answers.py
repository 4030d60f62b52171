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
    """The runtime's unary answer if it has the shape of its capability's OpenAI answer, else
    (None, what is wrong): a JSON object; `choices` a list of objects (chat, completion) or
    `data` a list of embedding objects (embeddings); `usage`, when present, whole counts."""
    answer = event_json(body)
    if capability.media:
        return _media_answer(body, answer, capability)
    if not isinstance(answer, dict):
        return None, "not a JSON object" if body else "an empty body"
    if capability is Capability.EMBEDDING:
        data = answer.get("data")
        if not isinstance(data, list) or not all(
            isinstance(d, dict) and isinstance(d.get("embedding"), list | str) for d in data
        ):
            return None, "`data` is not a list of embedding objects"
    else:
        choices = answer.get("choices")
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            return None, "`choices` is not a list of objects"
    problem = usage_problem(answer)
    if problem is not None:
        return None, problem
    return answer, ""


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


_FINE: Final = EventCheck(None)


def check_event(event: bytes) -> EventCheck:
    """Check one SSE event of an inference stream: its lines are SSE fields; its data, if any, is
    `[DONE]` or a JSON object with `choices` (a list of objects) or an `error`, and a sane `usage`
    if it has one. The answer also says whether it carries text (what the controller counts, one
    event a token, when the runtime sends no usage) and a usage object."""
    data = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
        elif line and not line.startswith(_SSE_OTHER_FIELDS):
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
