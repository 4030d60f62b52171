"""`nexa sim-runtime`: a simulated OpenAI-compatible runtime for tests, demos and gateway benchmarks.

A raw ASGI app on hypercorn and trio (no framework: it is the upstream of gateway benchmarks, so a
request costs little more than parsing its JSON). Every answer is a deterministic function of the
request; time to first token, token rate, failures and hangs come from flags or from a faults file
re-read when it changes. The journal records request metadata and outcomes, never prompt or output
text, and nothing is logged per request. Refuses to start unless NEXA_SIMULATION_ONLY=1, and binds
loopback only.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import ipaddress
import json
import logging
import math
import os
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from pathlib import Path
from typing import IO, Any, Final

import attrs
import hypercorn.config
import hypercorn.trio
import trio

from nexa.errors import ConfigError
from nexa.runtimes import SIMULATION_ENV

log = logging.getLogger(__name__)

#: Words the simulated output is made of; one word is one token.
# fmt: off
WORDS: Final = (
    "alpha", "amber", "anchor", "apple", "arrow", "aspen", "atlas", "autumn",
    "badge", "basil", "beacon", "birch", "blossom", "border", "breeze", "bridge",
    "cabin", "candle", "canyon", "cedar", "cherry", "cinder", "cloud", "comet",
    "copper", "coral", "crystal", "dawn", "delta", "dune", "ember", "falcon",
    "fern", "field", "flint", "forest", "garnet", "glacier", "harbor", "hazel",
    "horizon", "island", "ivory", "jasper", "juniper", "lagoon", "lantern", "maple",
    "meadow", "mesa", "meteor", "harvest", "nectar", "oasis", "orbit", "pebble",
    "prairie", "quartz", "raven", "river", "saffron", "summit", "thistle", "willow",
)
# fmt: on
#: Largest request body accepted.
MAX_BODY_BYTES: Final = 16 << 20
#: Longest embedding asked for with `dimensions`.
MAX_EMBEDDING_DIM: Final = 8192
#: On SIGTERM, in-flight requests get this long to finish (hung ones are then cut off).
GRACEFUL_TIMEOUT_S: Final = 2.0
#: How often `--exit-with-parent` checks that the parent process is still there.
PARENT_POLL_S: Final = 0.5
#: Longest X-Nexa-Request-Id (the relay's request id) kept in the journal.
MAX_REQUEST_ID_CHARS: Final = 128
OWNED_BY: Final = "nexa-sim"

_INFERENCE_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]
_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_METRICS_HEADERS: Final = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
_DONE: Final = b"data: [DONE]\n\n"

# ASGI messages and scopes are plain dicts: this module is the edge where they are read.
_Scope = Mapping[str, Any]
_Message = Mapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[dict[str, Any]], Awaitable[None]]


class Phase(enum.StrEnum):
    """When an injected fault strikes: before the first byte of the response, or after some tokens."""

    BEFORE = "before"
    AFTER = "after"


class Garble(enum.StrEnum):
    """A 200 answer that is not what the API promises (faults file only): an HTML error page, JSON
    cut off halfway, JSON of the wrong shape (`choices`/`data` of non-objects, a stream event that
    is a list), or a `usage` with counts no runtime reports (2^64 and -1)."""

    HTML = "html"
    TRUNCATED = "truncated"
    SHAPE = "shape"
    USAGE = "usage"


#: The counts of a `usage` garble: beyond int64, and negative.
GARBLED_USAGE: Final = {"prompt_tokens": 2**64, "completion_tokens": -1, "total_tokens": 2**64}
_HTML_PAGE: Final = b"<html><head><title>502 Bad Gateway</title></head><body>bad gateway</body></html>"
_HTML_HEADERS: Final = [(b"content-type", b"text/html")]


@attrs.frozen(kw_only=True)
class Faults:
    """Injected faults. `fail` answers `status` (before) or cuts the stream off after `after_tokens`
    tokens (after; a unary answer fails before); `hang` stops sending, until the client goes away;
    `garble` answers 200 with a broken body (unary), or sends one broken event after `after_tokens`
    tokens and ends the stream (a `usage` garble: the usage event's counts instead)."""

    fail: Phase | None = None
    hang: Phase | None = None
    status: int = 500
    after_tokens: int = 2
    garble: Garble | None = None

    @classmethod
    def from_json(cls, data: object) -> Faults:
        """Parse a faults file's object; ConfigError naming every bad key."""
        if not isinstance(data, dict):
            raise ConfigError("a faults file holds one JSON object")
        known = ("fail", "hang", "status", "after_tokens", "garble")
        problems = [f"{key}: unknown key" for key in data if key not in known]
        phases: dict[str, Phase | None] = {}
        for key in ("fail", "hang"):
            value = data.get(key)
            if value is None or value in (Phase.BEFORE, Phase.AFTER):
                phases[key] = None if value is None else Phase(value)
            else:
                problems.append(f"{key}: must be 'before', 'after' or null")
        status = data.get("status", 500)
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
            problems.append("status: must be an HTTP error status (400 to 599)")
        after_tokens = data.get("after_tokens", 2)
        if not isinstance(after_tokens, int) or isinstance(after_tokens, bool) or after_tokens < 0:
            problems.append("after_tokens: must be a whole number, 0 or more")
        garble = data.get("garble")
        if garble is not None and garble not in tuple(Garble):
            problems.append("garble: must be one of " + ", ".join(g.value for g in Garble) + " or null")
        if problems:
            raise ConfigError("invalid faults: " + "; ".join(problems), problems=tuple(problems))
        return cls(
            fail=phases["fail"],
            hang=phases["hang"],
            status=status,
            after_tokens=after_tokens,
            garble=None if garble is None else Garble(garble),
        )


@attrs.frozen(kw_only=True)
class SimConfig:
    """What `nexa sim-runtime` is started with (its flags); `check_config` validates it."""

    host: str = "127.0.0.1"
    #: 0: any free port (the bound address is printed).
    port: int = 0
    model: str = "sim"
    ttft_ms: float = 20.0
    tokens_per_s: float = 200.0
    output_tokens: int = 16
    embedding_dim: int = 384
    #: JSON-lines journal of requests and their outcomes; "" for none.
    journal: str = ""
    #: JSON faults file, re-read when it changes; when present it replaces `faults`. "" for none.
    faults_path: str = ""
    #: Faults in force while no faults file exists.
    faults: Faults = Faults()
    #: The model artifact's host path (must exist when given); the simulator never reads it.
    artifact: str = ""
    #: Stop when the parent process goes away (the node agent's process driver asks for this).
    exit_with_parent: bool = False


@attrs.frozen(kw_only=True)
class SimStarted:
    """What `serve_sim` reports once it listens."""

    urls: list[str]


def check_config(cfg: SimConfig, environ: Mapping[str, str]) -> None:
    """Raise ConfigError unless simulation is allowed here and `cfg` makes sense."""
    if environ.get(SIMULATION_ENV) != "1":
        raise ConfigError(f"nexa sim-runtime is a simulation: it runs only with {SIMULATION_ENV}=1 in its environment")
    problems: list[str] = []
    if not _is_loopback(cfg.host):
        problems.append(f"--host {cfg.host!r}: a simulated runtime listens on a loopback address only")
    if not 0 <= cfg.port <= 65535:
        problems.append("--port: must be 0 to 65535")
    if not cfg.model:
        problems.append("--model: must not be empty")
    if not (math.isfinite(cfg.ttft_ms) and cfg.ttft_ms >= 0):
        problems.append("--ttft-ms: must be 0 or more")
    if not (math.isfinite(cfg.tokens_per_s) and cfg.tokens_per_s > 0):
        problems.append("--tokens-per-s: must be more than 0")
    if cfg.output_tokens < 0:
        problems.append("--output-tokens: must be 0 or more")
    if not 1 <= cfg.embedding_dim <= MAX_EMBEDDING_DIM:
        problems.append(f"--embedding-dim: must be 1 to {MAX_EMBEDDING_DIM}")
    if not 400 <= cfg.faults.status <= 599:
        problems.append("--fail-status: must be 400 to 599")
    if cfg.faults.after_tokens < 0:
        problems.append("--after-tokens: must be 0 or more")
    if cfg.artifact and not os.path.exists(cfg.artifact):
        problems.append("--artifact: no such file")
    if problems:
        raise ConfigError("invalid sim-runtime flags: " + "; ".join(problems), problems=tuple(problems))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- deterministic output ---------------------------------------------------------------------------


def output_words(prompt: str, count: int) -> list[str]:
    """The `count` words the simulator answers `prompt` with: the same prompt, the same words."""
    if count <= 0:
        return []
    stream = hashlib.shake_256(prompt.encode()).digest(count)
    return [WORDS[b % len(WORDS)] for b in stream]


def embedding(text: str, dim: int) -> list[float]:
    """A unit-norm vector seeded by the sha256 of `text`: the same text, the same vector."""
    raw = hashlib.shake_256(hashlib.sha256(text.encode()).digest()).digest(2 * dim)
    values = [v - 32767.5 for v in struct.unpack(f"<{dim}H", raw)]
    norm = math.sqrt(math.fsum(v * v for v in values))
    return [v / norm for v in values]


def count_words(text: str) -> int:
    return len(text.split())


# --- request parsing ---------------------------------------------------------------------------------


class _BadRequest(Exception):
    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class _Kind(enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"


@attrs.frozen(kw_only=True)
class _Work:
    """One parsed inference request."""

    kind: _Kind
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


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        raise _BadRequest("each message must be an object", param="messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(p for p in parts if isinstance(p, str))
    raise _BadRequest("message content must be a string or a list of parts", param="messages")


def _whole(payload: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = payload.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _BadRequest(f"{key} must be a whole number, 0 or more", param=key)
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
    raise _BadRequest(f"{param} must be a string, a list of strings or of token ids, not empty", param=param)


# --- the app -----------------------------------------------------------------------------------------


class _Journal:
    """JSON lines, one per event, appended and flushed as written (small line-buffered writes)."""

    def __init__(self, file: IO[str] | None) -> None:
        self._file = file

    @classmethod
    def open(cls, path: str) -> _Journal:
        if not path:
            return cls(None)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return cls(open(path, "a", buffering=1, encoding="utf-8"))

    def write(self, event: str, rid: str, path: str, **fields: object) -> None:
        if self._file is None:
            return
        record = {"event": event, "id": rid, "path": path, **fields, "at": round(time.time(), 6)}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _FaultsSource:
    """The faults in force: the faults file's, re-read when its mtime or size changes; the flags' while
    it does not exist. A broken file counts as no faults until it is fixed (logged once per version)."""

    def __init__(self, path: str, default: Faults) -> None:
        self._path = path
        self._default = default
        self._seen: tuple[int, int] | None = None
        self._faults = default

    def current(self) -> Faults:
        if not self._path:
            return self._default
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            self._seen = None
            return self._default
        version = (st.st_mtime_ns, st.st_size)
        if version != self._seen:
            self._seen = version
            try:
                with open(self._path, encoding="utf-8") as f:
                    self._faults = Faults.from_json(json.load(f))
            except (OSError, ValueError, ConfigError) as exc:
                log.warning("ignoring the faults file until it is fixed: %s", exc)
                self._faults = Faults()
        return self._faults


@attrs.define
class _Outcome:
    tokens: int = 0
    #: Set just before the last byte is sent: a disconnect after it is not a cancellation.
    finished: bool = False
    cancelled: bool = False
    #: The stream was cut off on purpose (`fail: after`).
    aborted: bool = False


def _request_id(scope: _Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-nexa-request-id":
            return str(value.decode("latin-1")[:MAX_REQUEST_ID_CHARS])
    return ""


def _error_body(message: str, kind: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": code, "param": param}}).encode()


def _sse(data: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class SimApp:
    """The ASGI app. Counters only; every answer is computed from the request and the config."""

    def __init__(self, cfg: SimConfig, journal: _Journal) -> None:
        self._cfg = cfg
        self._journal = journal
        self._faults = _FaultsSource(cfg.faults_path, cfg.faults)
        self._interval_s = 1.0 / cfg.tokens_per_s
        self._ttft_s = cfg.ttft_ms / 1000.0
        self._running = 0
        self._total = 0
        self._models_body = json.dumps(
            {
                "object": "list",
                "data": [{"id": cfg.model, "object": "model", "created": int(time.time()), "owned_by": OWNED_BY}],
            }
        ).encode()

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        method, path = scope["method"], scope["path"]
        if path in _INFERENCE_PATHS:
            if method != "POST":
                await _reply(send, 405, _error_body("use POST", "invalid_request_error", "method_not_allowed"))
                return
            self._running += 1
            self._total += 1
            try:
                await self._inference(path, _request_id(scope), receive, send)
            finally:
                self._running -= 1
        elif method == "GET" and path == "/health":
            await _reply(send, 200, b'{"status":"ok"}')
        elif method == "GET" and path == "/v1/models":
            await _reply(send, 200, self._models_body)
        elif method == "GET" and path == "/metrics":
            await _reply(send, 200, self._metrics(), headers=_METRICS_HEADERS)
        else:
            await _reply(send, 404, _error_body(f"no route {path}", "invalid_request_error", "not_found"))

    def _metrics(self) -> bytes:
        label = f'{{model_name="{_label_value(self._cfg.model)}"}}'
        lines = [
            "# HELP vllm:num_requests_running Requests being answered now.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {self._running}",
            "# HELP vllm:num_requests_waiting Requests waiting to be scheduled (the simulator never queues).",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0",
            "# HELP nexa_sim_requests_total Inference requests received.",
            "# TYPE nexa_sim_requests_total counter",
            f"nexa_sim_requests_total{label} {self._total}",
        ]
        return ("\n".join(lines) + "\n").encode()

    async def _inference(self, path: str, rid: str, receive: _Receive, send: _Send) -> None:
        journal = self._journal
        try:
            work = self._parse(path, await _read_body(receive))
        except _BadRequest as exc:
            journal.write("request", rid, path, stream=False)
            await _reply(
                send, exc.status, _error_body(exc.message, "invalid_request_error", "invalid_request", exc.param)
            )
            journal.write("failed", rid, path, status=exc.status, reason="invalid_request")
            return
        journal.write("request", rid, path, stream=work.stream)
        faults = self._faults.current()
        if faults.fail is Phase.BEFORE or (faults.fail is Phase.AFTER and not work.stream):
            await _reply(send, faults.status, _error_body("simulated failure", "server_error", "simulated_failure"))
            journal.write("failed", rid, path, status=faults.status, reason="injected")
            return
        recorded = False
        try:
            outcome = await self._watched(receive, partial(self._produce, work, faults, send))
            recorded = True
            if outcome.cancelled:
                journal.write("cancelled", rid, path, tokens=outcome.tokens)
            elif outcome.aborted:
                journal.write("failed", rid, path, status=200, reason="injected", tokens=outcome.tokens)
            else:
                journal.write("completed", rid, path, tokens=outcome.tokens)
        finally:
            if not recorded:  # cancelled from outside: the server is stopping
                journal.write("failed", rid, path, reason="stopped")

    async def _watched(self, receive: _Receive, produce: Callable[[_Outcome], Awaitable[None]]) -> _Outcome:
        """Run `produce` until it is done or the client goes away (ASGI `http.disconnect`)."""
        outcome = _Outcome()

        async def watch(scope: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not outcome.finished:
                outcome.cancelled = True
                scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            await produce(outcome)
            nursery.cancel_scope.cancel()
        return outcome

    def _parse(self, path: str, body: bytes) -> _Work:
        try:
            payload = json.loads(body)
        except ValueError:
            raise _BadRequest("the body is not valid JSON") from None
        if not isinstance(payload, dict):
            raise _BadRequest("the body must be a JSON object")
        model = payload.get("model") or self._cfg.model
        if not isinstance(model, str):
            raise _BadRequest("model must be a string", param="model")
        if path == "/v1/embeddings":
            return self._parse_embeddings(payload, model)
        stream = payload.get("stream") is True
        options = payload.get("stream_options")
        include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        if path == "/v1/chat/completions":
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("messages must be a list of messages, not empty", param="messages")
            texts = [_message_text(m) for m in messages]
            prompt_tokens = max(1, sum(count_words(t) for t in texts))
            limit = _whole(payload, "max_completion_tokens", None)
            limit = _whole(payload, "max_tokens", limit)
            kind, texts = _Kind.CHAT, ["\n".join(texts)]
        else:
            if "prompt" not in payload:
                raise _BadRequest("prompt is required", param="prompt")
            texts = _inputs(payload["prompt"], "prompt")
            prompt_tokens = sum(max(1, count_words(t)) for t in texts)
            limit = _whole(payload, "max_tokens", None)
            kind = _Kind.COMPLETION
        out = self._cfg.output_tokens if limit is None else min(limit, self._cfg.output_tokens)
        return _Work(
            kind=kind,
            model=model,
            stream=stream,
            include_usage=include_usage,
            texts=texts,
            prompt_tokens=prompt_tokens,
            max_tokens=out,
        )

    def _parse_embeddings(self, payload: Mapping[str, Any], model: str) -> _Work:
        if "input" not in payload:
            raise _BadRequest("input is required", param="input")
        texts = _inputs(payload["input"], "input")
        dim = _whole(payload, "dimensions", self._cfg.embedding_dim)
        if dim is None or not 1 <= dim <= MAX_EMBEDDING_DIM:
            raise _BadRequest(f"dimensions must be 1 to {MAX_EMBEDDING_DIM}", param="dimensions")
        encoding = payload.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise _BadRequest("encoding_format must be 'float' or 'base64'", param="encoding_format")
        return _Work(
            kind=_Kind.EMBEDDING,
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

    async def _produce(self, work: _Work, faults: Faults, send: _Send, outcome: _Outcome) -> None:
        if faults.hang is Phase.BEFORE or (faults.hang is Phase.AFTER and not work.stream):
            await trio.sleep_forever()
        if work.kind is _Kind.EMBEDDING:
            body = self._embeddings(work)
            outcome.finished = True
            await _reply_garbled(send, body, faults.garble, outcome)
        elif work.stream:
            await self._stream(work, faults, send, outcome)
        else:
            await trio.sleep_until(trio.current_time() + self._ttft_s + max(0, work.max_tokens - 1) * self._interval_s)
            body = self._unary(work)
            outcome.tokens = work.max_tokens * len(work.texts)
            outcome.finished = True
            await _reply_garbled(send, body, faults.garble, outcome)

    def _unary(self, work: _Work) -> bytes:
        finish = "length" if work.max_tokens < self._cfg.output_tokens else "stop"
        created = int(time.time())
        usage = _usage(work.prompt_tokens, work.max_tokens * len(work.texts))
        if work.kind is _Kind.CHAT:
            text = " ".join(output_words(work.texts[0], work.max_tokens))
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            data = {
                "id": f"chatcmpl-sim{self._total}",
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
                    "text": " ".join(output_words(t, work.max_tokens)),
                    "logprobs": None,
                    "finish_reason": finish,
                }
                for i, t in enumerate(work.texts)
            ]
            data = {
                "id": f"cmpl-sim{self._total}",
                "object": "text_completion",
                "created": created,
                "model": work.model,
                "choices": choices,
                "usage": usage,
            }
        return json.dumps(data).encode()

    def _embeddings(self, work: _Work) -> bytes:
        items: list[dict[str, Any]] = []
        for i, text in enumerate(work.texts):
            vector = embedding(text, work.dim)
            value: object = base64.b64encode(struct.pack(f"<{work.dim}f", *vector)).decode() if work.base64 else vector
            items.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": work.prompt_tokens, "total_tokens": work.prompt_tokens}
        return json.dumps({"object": "list", "data": items, "model": work.model, "usage": usage}).encode()

    async def _stream(self, work: _Work, faults: Faults, send: _Send, outcome: _Outcome) -> None:
        """SSE in OpenAI's format: one chunk per token (per choice), a chunk with the finish reason, a
        usage-only chunk when `stream_options.include_usage`, then `[DONE]`."""
        chat = work.kind is _Kind.CHAT
        base: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-sim{self._total}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": work.model,
        }
        if work.include_usage:
            base["usage"] = None

        def chunk(index: int, piece: str | None, finish: str | None) -> bytes:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return _sse({**base, "choices": [choice]})

        words = [output_words(t, work.max_tokens) for t in work.texts]
        first_at = trio.current_time() + self._ttft_s
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        for i in range(work.max_tokens + 1):
            last = i == work.max_tokens
            # Token i is due at first_at + i / rate; the finish chunk follows the last token at once.
            await trio.sleep_until(first_at + (max(0, i - 1) if last else i) * self._interval_s)
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
                data = _sse({**base, "choices": [_role_choice()]})
            data += b"".join(chunk(c, w[i] if i == 0 else " " + w[i], None) for c, w in enumerate(words))
            await send({"type": "http.response.body", "body": data, "more_body": True})
            outcome.tokens += len(words)
        finish = "length" if work.max_tokens < self._cfg.output_tokens else "stop"
        tail = b""
        if work.max_tokens == 0 and chat:
            tail = _sse({**base, "choices": [_role_choice()]})
        tail += b"".join(chunk(c, None, finish) for c in range(len(words)))
        if work.include_usage:
            usage = _usage(work.prompt_tokens, work.max_tokens * len(words))
            if faults.garble is Garble.USAGE:
                usage = dict(GARBLED_USAGE)
                outcome.aborted = True
            tail += _sse({**base, "choices": [], "usage": usage})
        outcome.finished = True
        await send({"type": "http.response.body", "body": tail + _DONE, "more_body": False})


def _role_choice() -> dict[str, Any]:
    return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


async def _reply_garbled(send: _Send, body: bytes, garble: Garble | None, outcome: _Outcome) -> None:
    """A unary 200 answer: `body`, or the broken form of it the faults ask for."""
    if garble is None:
        await _reply(send, 200, body)
        return
    outcome.aborted = True
    if garble is Garble.HTML:
        await _reply(send, 200, _HTML_PAGE, headers=_HTML_HEADERS)
        return
    if garble is Garble.TRUNCATED:
        await _reply(send, 200, body[: len(body) // 2])
        return
    answer = json.loads(body)
    if garble is Garble.USAGE:
        answer["usage"] = dict(GARBLED_USAGE)
    elif "data" in answer:
        answer["data"] = list(range(len(answer["data"])))
    else:
        answer["choices"] = ["garbled" for _ in answer["choices"]]
    await _reply(send, 200, json.dumps(answer).encode())


def _garbled_event(garble: Garble) -> bytes:
    if garble is Garble.HTML:
        return _HTML_PAGE + b"\n\n"
    if garble is Garble.TRUNCATED:
        return b'data: {"id":"cut-off","choices":[{"index":0,"delta":{"cont\n\n'
    return b"data: [1, 2, 3]\n\n"


async def _read_body(receive: _Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _BadRequest("the client went away", status=499)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _BadRequest(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(send: _Send, status: int, body: bytes, *, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or _JSON_HEADERS})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive: _Receive, send: _Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# --- serving -----------------------------------------------------------------------------------------


def _hypercorn_config(cfg: SimConfig) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    host = "127.0.0.1" if cfg.host == "localhost" else cfg.host
    hc.bind = [f"[{host}]:{cfg.port}" if ":" in host else f"{host}:{cfg.port}"]
    hc.graceful_timeout = GRACEFUL_TIMEOUT_S
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.include_server_header = False
    hc.backlog = 1024
    return hc


async def _stop_when_orphaned(stopping: trio.Event, parent: int) -> None:
    # Re-parented (to init or a subreaper): the agent that started us is gone.
    while os.getppid() == parent:  # noqa: ASYNC110 - nothing signals a re-parenting: poll
        await trio.sleep(PARENT_POLL_S)
    log.warning("the parent process went away; stopping")
    stopping.set()


async def serve_sim(
    cfg: SimConfig,
    *,
    stopping: trio.Event,
    task_status: trio.TaskStatus[SimStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the simulated runtime until `stopping` is set (in-flight requests get GRACEFUL_TIMEOUT_S).

    Supports the nursery start protocol; call `check_config` first."""
    parent = os.getppid()
    journal = await trio.to_thread.run_sync(_Journal.open, cfg.journal)
    try:
        app = SimApp(cfg, journal)
        async with trio.open_nursery() as nursery:

            async def serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
                await hypercorn.trio.serve(
                    app,  # type: ignore[arg-type]  # a plain ASGI 3 callable
                    _hypercorn_config(cfg),
                    shutdown_trigger=stopping.wait,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()  # drained: stop the parent watcher too

            if cfg.exit_with_parent:
                nursery.start_soon(_stop_when_orphaned, stopping, parent)
            urls: list[str] = await nursery.start(serve)
            task_status.started(SimStarted(urls=urls))
    finally:
        journal.close()
