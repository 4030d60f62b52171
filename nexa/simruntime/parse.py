"""Parsing an OpenAI-shaped inference request (chat, completions, embeddings) into one `Work`;
anything else is a `BadRequest` naming the parameter."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

import attrs

from nexa.simruntime import tools
from nexa.simruntime.asgi import BadRequest
from nexa.simruntime.config import MAX_EMBEDDING_DIM, SimConfig
from nexa.simruntime.tokens import count_words, output_words


class Kind(enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"


@attrs.frozen(kw_only=True)
class Work:
    """One parsed inference request."""

    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    #: One text per choice (completions accept a batch of prompts) or per embedding input.
    texts: list[str]
    prompt_tokens: int
    #: Tokens to produce per choice.
    max_tokens: int
    #: Embeddings only.
    dim: int = 0
    base64: bool = False
    #: Chat only: the tool call (name, arguments) that answers it (`tools.tool_call`), or None.
    tool: tuple[str, str] | None = None
    #: Chat only: the stop string (one of the output's words) that ended the output before it, as
    #: vLLM reports it in a choice's `stop_reason`; `max_tokens` is then the words before it.
    stopped: str | None = None


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        raise BadRequest("each message must be an object", param="messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(p for p in parts if isinstance(p, str))
    raise BadRequest("message content must be a string or a list of parts", param="messages")


def _whole(payload: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = payload.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"{key} must be a whole number, 0 or more", param=key)
    return value


def _inputs(value: object, param: str) -> list[str]:
    """A prompt or embedding input: a string, a list of strings, a token list, or a list of token lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [str(v) for v in value]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [" ".join(str(v) for v in value)]
        if all(isinstance(v, list) and v and all(isinstance(t, int) for t in v) for v in value):
            return [" ".join(str(t) for t in v) for v in value]
    raise BadRequest(f"{param} must be a string, a list of strings or of token ids, not empty", param=param)


def parse(cfg: SimConfig, path: str, body: bytes) -> Work:
    try:
        payload = json.loads(body)
    except ValueError:
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise BadRequest("the body must be a JSON object")
    model = payload.get("model") or cfg.model
    if not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    if path == "/v1/embeddings":
        return _parse_embeddings(cfg, payload, model)
    stream = payload.get("stream") is True
    options = payload.get("stream_options")
    include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    if path == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a list of messages, not empty", param="messages")
        texts = [_message_text(m) for m in messages]
        prompt_tokens = max(1, sum(count_words(t) for t in texts))
        limit = _whole(payload, "max_completion_tokens", None)
        limit = _whole(payload, "max_tokens", limit)
        kind, texts = Kind.CHAT, ["\n".join(texts)]
    else:
        if "prompt" not in payload:
            raise BadRequest("prompt is required", param="prompt")
        texts = _inputs(payload["prompt"], "prompt")
        prompt_tokens = sum(max(1, count_words(t)) for t in texts)
        limit = _whole(payload, "max_tokens", None)
        kind = Kind.COMPLETION
    out = cfg.output_tokens if limit is None else min(limit, cfg.output_tokens)
    stopped = None
    if kind is Kind.CHAT and (stops := _stops(payload.get("stop"))):
        words = output_words(texts[0], out)
        at = next((i for i, w in enumerate(words) if w in stops), None)
        out, stopped = (out, None) if at is None else (at, words[at])
    return Work(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        texts=texts,
        prompt_tokens=prompt_tokens,
        max_tokens=out,
        tool=tools.tool_call(payload) if kind is Kind.CHAT else None,
        stopped=stopped,
    )


def _stops(value: object) -> frozenset[str]:
    """The request's stop strings (`stop`: a string or a list of them)."""
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset({value})
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return frozenset(value)
    raise BadRequest("stop must be a string or a list of strings", param="stop")


def _parse_embeddings(cfg: SimConfig, payload: Mapping[str, Any], model: str) -> Work:
    if "input" not in payload:
        raise BadRequest("input is required", param="input")
    texts = _inputs(payload["input"], "input")
    dim = _whole(payload, "dimensions", cfg.embedding_dim)
    if dim is None or not 1 <= dim <= MAX_EMBEDDING_DIM:
        raise BadRequest(f"dimensions must be 1 to {MAX_EMBEDDING_DIM}", param="dimensions")
    encoding = payload.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequest("encoding_format must be 'float' or 'base64'", param="encoding_format")
    return Work(
        kind=Kind.EMBEDDING,
        model=model,
        stream=False,
        include_usage=False,
        texts=texts,
        prompt_tokens=sum(max(1, count_words(t)) for t in texts),
        max_tokens=0,
        dim=dim,
        base64=encoding == "base64",
    )


# --- answers
