"""The OpenAI-shaped answers: a unary body (chat, completions, embeddings), a stream of
server-sent events paced by the configured time to first token and token rate, and the broken
forms the faults ask for. `Outcome` records what was sent, for the journal."""

from __future__ import annotations

import base64
import json
import secrets
import struct
import time
from typing import Any, Final

import attrs
import trio

from nexa.simruntime import tools
from nexa.simruntime.asgi import Send, reply, sse
from nexa.simruntime.config import SimConfig
from nexa.simruntime.faults import GARBLED_USAGE, Faults, Garble, Phase
from nexa.simruntime.parse import Kind, Work
from nexa.simruntime.tokens import embedding, output_words

_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_DONE: Final = b"data: [DONE]\n\n"
_HTML_PAGE: Final = b"<html><head><title>502 Bad Gateway</title></head><body>bad gateway</body></html>"
_HTML_HEADERS: Final = [(b"content-type", b"text/html")]


@attrs.define
class Outcome:
    tokens: int = 0
    #: Set just before the last byte is sent: a disconnect after it is not a cancellation.
    finished: bool = False
    cancelled: bool = False
    #: The stream was cut off on purpose (`fail: after`).
    aborted: bool = False
    #: When (trio time) the first and the last token went out (None: no token did).
    first_token_at: float | None = None
    last_token_at: float | None = None


def _said(text: str, count: int, faults: Faults | None) -> str:
    """What the simulator answers `text` with: its own words, a taught answer, or wrong words."""
    if faults is not None and faults.wrong:
        return " ".join(output_words("\x00wrong\x00" + text, count))
    for taught, answer in faults.taught if faults is not None else ():
        if taught in text:
            return answer
    return " ".join(output_words(text, count))


def unary(work: Work, cfg: SimConfig, *, serial: int, faults: Faults | None = None) -> bytes:
    """The whole answer at once; `serial` numbers its id; `faults` may teach or spoil it."""
    finish = _finish(work, cfg)
    created = int(time.time())
    usage = _usage(work.prompt_tokens, work.max_tokens * len(work.texts))
    if work.tool is not None:
        usage = _usage(work.prompt_tokens, len(work.tool[1]) // 4 + 1)
    if work.kind is Kind.CHAT:
        text = _said(work.texts[0], work.max_tokens, faults)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        if work.stopped is not None:
            choice["stop_reason"] = work.stopped
        if work.tool is not None:
            choice |= {"message": tools.message(work.tool, serial), "finish_reason": "tool_calls"}
        data = {
            "id": f"chatcmpl-sim{serial}",
            "object": "chat.completion",
            "created": created,
            "model": work.model,
            "choices": [choice],
            "usage": usage,
        }
    else:
        choices = [
            {
                "index": i,
                "text": _said(t, work.max_tokens, faults),
                "logprobs": None,
                "finish_reason": finish,
            }
            for i, t in enumerate(work.texts)
        ]
        data = {
            "id": f"cmpl-sim{serial}",
            "object": "text_completion",
            "created": created,
            "model": work.model,
            "choices": choices,
            "usage": usage,
        }
    return json.dumps(data).encode()


def embeddings(work: Work, faults: Faults | None = None) -> bytes:
    items: list[dict[str, Any]] = []
    for i, text in enumerate(work.texts):
        # `wrong`: a random vector (the same text no longer gives the same one).
        vector = embedding(text + secrets.token_hex(8) if faults is not None and faults.wrong else text, work.dim)
        value: object = base64.b64encode(struct.pack(f"<{work.dim}f", *vector)).decode() if work.base64 else vector
        items.append({"object": "embedding", "index": i, "embedding": value})
    usage = {"prompt_tokens": work.prompt_tokens, "total_tokens": work.prompt_tokens}
    return json.dumps({"object": "list", "data": items, "model": work.model, "usage": usage}).encode()


async def stream(work: Work, faults: Faults, send: Send, outcome: Outcome, cfg: SimConfig, *, serial: int) -> None:
    """SSE in OpenAI's format: one chunk per token (per choice), a chunk with the finish reason, a
    usage-only chunk when `stream_options.include_usage`, then `[DONE]`."""
    chat = work.kind is Kind.CHAT
    base: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-sim{serial}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": work.model,
    }
    if work.include_usage:
        base["usage"] = None

    def chunk(index: int, piece: str | None, finish: str | None) -> bytes:
        if chat:
            choice = _delta_choice(index, piece, finish, work.stopped)
        else:
            choice = {"index": index, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return sse({**base, "choices": [choice]})

    words = [output_words(t, work.max_tokens) for t in work.texts]
    interval_s = 1.0 / cfg.tokens_per_s
    first_at = trio.current_time() + cfg.ttft_ms / 1000.0
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    for i in range(work.max_tokens + 1):
        last = i == work.max_tokens
        # Token i is due at first_at + i / rate; the finish chunk follows the last token at once.
        await trio.sleep_until(first_at + (max(0, i - 1) if last else i) * interval_s)
        # An `after` fault strikes after `after_tokens` tokens, or before the finish chunk when
        # the answer is shorter than that.
        if i == faults.after_tokens or (last and faults.after_tokens > i):
            if faults.hang is Phase.AFTER:
                await trio.sleep_forever()
            if faults.fail is Phase.AFTER:
                outcome.aborted = True
                return  # no finish chunk: hypercorn closes the connection mid-body
            if faults.garble is not None and faults.garble is not Garble.USAGE:
                outcome.aborted = True
                event = _garbled_event(faults.garble)
                await send({"type": "http.response.body", "body": event + _DONE, "more_body": False})
                return
        if last:
            break
        data = b""
        if i == 0 and chat:
            data = sse({**base, "choices": [_role_choice()]})
        data += b"".join(chunk(c, w[i] if i == 0 else " " + w[i], None) for c, w in enumerate(words))
        await send({"type": "http.response.body", "body": data, "more_body": True})
        outcome.tokens += len(words)
        outcome.last_token_at = trio.current_time()
        if outcome.first_token_at is None:
            outcome.first_token_at = outcome.last_token_at
    finish = _finish(work, cfg)
    tail = b""
    if work.max_tokens == 0 and chat:
        tail = sse({**base, "choices": [_role_choice()]})
    tail += b"".join(chunk(c, None, finish) for c in range(len(words)))
    if work.include_usage:
        usage = _usage(work.prompt_tokens, work.max_tokens * len(words))
        if faults.garble is Garble.USAGE:
            usage = dict(GARBLED_USAGE)
            outcome.aborted = True
        tail += sse({**base, "choices": [], "usage": usage})
    outcome.finished = True
    await send({"type": "http.response.body", "body": tail + _DONE, "more_body": False})


async def tool_stream(work: Work, call: tuple[str, str], send: Send, outcome: Outcome, *, serial: int) -> None:
    """A tool call's stream (`tools.deltas`) at once, the finish, the usage if asked, `[DONE]`."""
    base = {"id": f"chatcmpl-sim{serial}", "object": "chat.completion.chunk", "created": int(time.time())}
    base["model"] = work.model
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    choices: list[dict[str, Any]] = [
        {"index": 0, "delta": d, "logprobs": None, "finish_reason": None} for d in tools.deltas(call, serial)
    ]
    choices.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"})
    tail = sse({**base, "choices": [_role_choice()]}) + b"".join(sse({**base, "choices": [c]}) for c in choices)
    outcome.tokens = len(call[1]) // 4 + 1
    if work.include_usage:
        tail += sse({**base, "choices": [], "usage": _usage(work.prompt_tokens, outcome.tokens)})
    outcome.finished = True
    await send({"type": "http.response.body", "body": tail + _DONE, "more_body": False})


def _delta_choice(index: int, piece: str | None, finish: str | None, stopped: str | None) -> dict[str, Any]:
    """A chat stream's choice: a piece, or the finish (with vLLM's `stop_reason` when a stop string ended it)."""
    delta = {} if piece is None else {"content": piece}
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None and stopped is not None:
        choice["stop_reason"] = stopped
    return choice


def _finish(work: Work, cfg: SimConfig) -> str:
    return "length" if work.max_tokens < cfg.output_tokens and work.stopped is None else "stop"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _role_choice() -> dict[str, Any]:
    return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


async def reply_garbled(send: Send, body: bytes, garble: Garble | None, outcome: Outcome) -> None:
    """A unary 200 answer: `body`, or the broken form of it the faults ask for."""
    if garble is None:
        await reply(send, 200, body)
        return
    outcome.aborted = True
    if garble is Garble.HTML:
        await reply(send, 200, _HTML_PAGE, headers=_HTML_HEADERS)
        return
    if garble is Garble.TRUNCATED:
        await reply(send, 200, body[: len(body) // 2])
        return
    answer = json.loads(body)
    if garble is Garble.USAGE:
        answer["usage"] = dict(GARBLED_USAGE)
    elif "data" in answer:
        answer["data"] = list(range(len(answer["data"])))
    else:
        answer["choices"] = ["garbled" for _ in answer["choices"]]
    await reply(send, 200, json.dumps(answer).encode())


def _garbled_event(garble: Garble) -> bytes:
    if garble is Garble.HTML:
        return _HTML_PAGE + b"\n\n"
    if garble is Garble.TRUNCATED:
        return b'data: {"id":"cut-off","choices":[{"index":0,"delta":{"cont\n\n'
    return b"data: [1, 2, 3]\n\n"
