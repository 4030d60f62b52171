"""The ASGI app: routes, counters (`/metrics` in vLLM's names: `metrics`), the journal, and the life of one
inference request (parse, faults, answer, and the outcome journaled, the client watched for
going away). Counters only: every answer is computed from the request and the config."""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import IO, Final

import trio

from nexa.contracts.gateway import Capability
from nexa.simruntime import answers, media, native, pooling
from nexa.simruntime.answers import Outcome
from nexa.simruntime.asgi import BadRequest, Receive, Scope, Send, error_body, lifespan, read_body, reply
from nexa.simruntime.config import SimConfig
from nexa.simruntime.faults import IMAGE_ENV, Faults, FaultsSource, Phase
from nexa.simruntime.lora import SimLoras
from nexa.simruntime.metrics import SimMetrics
from nexa.simruntime.parse import Kind, Work, parse

#: Longest X-Nexa-Request-Id (the relay's request id) kept in the journal.
MAX_REQUEST_ID_CHARS: Final = 128
OWNED_BY: Final = "nexa-sim"

_INFERENCE_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
#: vLLM's sleep-mode routes (`SimConfig.sleep_mode`).
_SLEEP_PATHS: Final = frozenset({"/sleep", "/wake_up", "/is_sleeping"})
#: The paths besides OpenAI's inference ones, each served when `--serve` names its capability.
_OTHER_PATHS: Final = {**pooling.PATHS, **native.PATHS}
#: The media paths (`media`), each served when `--serve` names its capability (all by default).
_MEDIA: Final = {c.path: c for c in Capability if c.media}
_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_LORA_PATHS: Final = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
_METRICS_HEADERS: Final = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]


class Journal:
    """JSON lines, one per event, appended and flushed as written (small line-buffered writes)."""

    def __init__(self, file: IO[str] | None) -> None:
        self._file = file

    @classmethod
    def open(cls, path: str) -> Journal:
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


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-nexa-request-id":
            return str(value.decode("latin-1")[:MAX_REQUEST_ID_CHARS])
    return ""


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class SimApp:
    """The ASGI app. Counters only; every answer is computed from the request and the config."""

    def __init__(self, cfg: SimConfig, journal: Journal) -> None:
        self._cfg = cfg
        self._journal = journal
        self._faults = FaultsSource(cfg.faults_path, cfg.faults, image=os.environ.get(IMAGE_ENV, ""))
        self._interval_s = 1.0 / cfg.tokens_per_s
        self._ttft_s = cfg.ttft_ms / 1000.0
        self._metrics = SimMetrics(f'model_name="{_label_value(cfg.model)}"')
        #: vLLM's sleep level while asleep (`--enable-sleep-mode`); 0: awake.
        self._sleep_level = 0
        self._created = int(time.time())
        self._models_body = json.dumps(
            {
                "object": "list",
                "data": [{"id": cfg.model, "object": "model", "created": self._created, "owned_by": OWNED_BY}],
            }
        ).encode()
        self._loras = SimLoras(cfg.max_loras)
        #: Responses API responses kept, as vLLM keeps them only with its variable set (`native.STORE_ENV`).
        self._stored = native.Stored() if native.store_enabled(os.environ) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        served = path in _OTHER_PATHS and _OTHER_PATHS[path] in self._cfg.serves
        if self._cfg.sleep_mode and path in _SLEEP_PATHS:
            await self._sleep_route(method, path, scope.get("query_string", b""), send)
        elif path in _INFERENCE_PATHS or served:
            await self._inference_route(method, path, scope, receive, send)
        elif path in _MEDIA and method == "POST" and _MEDIA[path] in self._cfg.serves:
            self._metrics.total += 1
            await self._media(scope, path, _request_id(scope), receive, send)
        elif method == "GET" and path == "/health":
            if self._faults.current().unhealthy:
                await reply(send, 503, error_body("simulated unhealthy runtime", "server_error", "unhealthy"))
            else:
                await reply(send, 200, b'{"status":"ok"}')
        elif method == "GET" and path == "/v1/models":
            await reply(send, 200, self._models())
        elif method == "POST" and path in _LORA_PATHS and self._loras.enabled:
            await self._lora(path, _request_id(scope), receive, send)
        elif method == "GET" and path == "/metrics":
            await self._metrics_route(send)
        elif native.stored_path(path) and Capability.RESPONSES in self._cfg.serves:
            await self._stored_route(method, path, scope, send)
        else:
            await reply(send, 404, error_body(f"no route {path}", "invalid_request_error", "not_found"))

    async def _metrics_route(self, send: Send) -> None:
        faults = self._faults.current()
        if faults.metrics_fail:
            await reply(send, 503, error_body("simulated metrics failure", "server_error", "metrics_failure"))
        else:
            body = self._metrics.render(waiting=faults.queue_depth, kv_cache_usage=faults.kv_cache_usage)
            await reply(send, 200, body, headers=_METRICS_HEADERS)

    async def _stored_route(self, method: str, path: str, scope: Scope, send: Send) -> None:
        """A kept response's own route (`native.stored_route`), journaled with its method."""
        self._metrics.total += 1
        self._journal.write("request", _request_id(scope), path, stream=False, method=method)
        query = scope.get("query_string", b"").decode("latin-1")
        await reply(send, *native.stored_route(self._stored, method, path, query))

    async def _inference_route(self, method: str, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        if method != "POST":
            await reply(send, 405, error_body("use POST", "invalid_request_error", "method_not_allowed"))
            return
        if self._sleep_level:
            await reply(send, 503, error_body("the engine is sleeping: POST /wake_up", "server_error", "sleeping"))
            return
        self._metrics.running += 1
        self._metrics.total += 1
        try:
            run = self._inference if path in _INFERENCE_PATHS else self._pooling
            await run(path, _request_id(scope), receive, send)
        finally:
            self._metrics.running -= 1

    async def _sleep_route(self, method: str, path: str, query: bytes, send: Send) -> None:
        """vLLM's sleep mode as its server answers it: `POST /sleep?level=1` (level 1 offloads the
        weights, 2 discards them; default 1) and `POST /wake_up` answer 200 with no body; `GET
        /is_sleeping` answers `{"is_sleeping": bool}`."""
        want = "GET" if path == "/is_sleeping" else "POST"
        if method != want:
            await reply(send, 405, error_body(f"use {want}", "invalid_request_error", "method_not_allowed"))
        elif path == "/is_sleeping":
            await reply(send, 200, json.dumps({"is_sleeping": bool(self._sleep_level)}).encode())
        elif path == "/wake_up":
            self._sleep_level = 0
            await reply(send, 200, b"")
        else:
            level = urllib.parse.parse_qs(query.decode("latin-1")).get("level", ["1"])[-1]
            if level not in {"1", "2"}:
                await reply(send, 400, error_body("level: 1 or 2", "invalid_request_error", "bad_level"))
                return
            if self._faults.current().sleep_fail:
                await reply(send, 500, error_body("simulated sleep failure", "server_error", "sleep_failure"))
                return
            self._sleep_level = int(level)
            await reply(send, 200, b"")

    async def _media(self, scope: Scope, path: str, rid: str, receive: Receive, send: Send) -> None:
        """A media request (`media`): answered whole, speech in pieces; journaled like the others."""
        self._journal.write("request", rid, path, stream=False)
        content_type = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), "")
        try:
            body = await read_body(receive)
            faults = self._faults.current()
            if faults.fail is not None:
                await reply(send, faults.status, error_body("simulated failure", "server_error", "simulated_failure"))
                self._journal.write("failed", rid, path, status=faults.status, reason="injected")
                return
            if path == media.SPEECH:
                kind, pieces = media.speech(body)
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
                for piece in pieces:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif path == media.IMAGES:
                await reply(send, 200, media.images(body))
            else:
                kind, answer = media.transcript(path, content_type, body)
                await reply(send, 200, answer, headers=[(b"content-type", kind)])
        except BadRequest as exc:
            problem = error_body(exc.message, "invalid_request_error", "invalid_request", exc.param)
            await reply(send, exc.status, problem)
            self._journal.write("failed", rid, path, status=exc.status, reason="invalid_request")
            return
        self._journal.write("completed", rid, path, tokens=0)

    async def _inference(self, path: str, rid: str, receive: Receive, send: Send) -> None:
        journal = self._journal
        try:
            work = parse(self._cfg, path, await read_body(receive))
            self._loras.check_model(work.model)
        except BadRequest as exc:
            journal.write("request", rid, path, stream=False)
            await reply(
                send, exc.status, error_body(exc.message, "invalid_request_error", "invalid_request", exc.param)
            )
            journal.write("failed", rid, path, status=exc.status, reason="invalid_request")
            return
        journal.write("request", rid, path, stream=work.stream)
        started = trio.current_time()
        if work.kind is not Kind.EMBEDDING:
            self._metrics.prompt(work.texts, work.prompt_tokens)
        faults = self._faults.current(self._loras.loaded.get(work.model, ""))
        if faults.fail is Phase.BEFORE or (faults.fail is Phase.AFTER and not work.stream):
            await reply(send, faults.status, error_body("simulated failure", "server_error", "simulated_failure"))
            journal.write("failed", rid, path, status=faults.status, reason="injected")
            return
        recorded = False
        try:
            outcome = await self._watched(receive, partial(self._produce, work, faults, send))
            recorded = True
            if outcome.first_token_at is not None and outcome.last_token_at is not None:
                per_choice = outcome.tokens // max(1, len(work.texts))
                decode_s = outcome.last_token_at - outcome.first_token_at
                self._metrics.answered(outcome.first_token_at - started, per_choice, decode_s)
            if outcome.cancelled:
                journal.write("cancelled", rid, path, tokens=outcome.tokens)
            elif outcome.aborted:
                journal.write("failed", rid, path, status=200, reason="injected", tokens=outcome.tokens)
            else:
                journal.write("completed", rid, path, tokens=outcome.tokens)
        finally:
            if not recorded:  # cancelled from outside: the server is stopping
                journal.write("failed", rid, path, reason="stopped")

    async def _pooling(self, path: str, rid: str, receive: Receive, send: Send) -> None:
        """A rerank, score or tokenizer request (`pooling`), answered at once, or a native Messages or
        Responses API one (`native`); journaled with its tokens."""
        self._journal.write("request", rid, path, stream=False)
        try:
            raw = await read_body(receive)
            capability = _OTHER_PATHS[path]
            if capability.native:
                out, tokens = native.answer(
                    capability,
                    self._cfg.model,
                    raw,
                    serial=self._metrics.total,
                    output_tokens=self._cfg.output_tokens,
                    stored=self._stored,
                )
            else:
                out, tokens = pooling.answer(capability, self._cfg.model, raw, serial=self._metrics.total)
        except BadRequest as exc:
            await reply(
                send, exc.status, error_body(exc.message, "invalid_request_error", "invalid_request", exc.param)
            )
            self._journal.write("failed", rid, path, status=exc.status, reason="invalid_request")
            return
        await trio.sleep(self._ttft_s)  # the model's time, as for a first token
        if isinstance(out, bytes):
            await reply(send, 200, out)
        else:  # a native API's stream, in its own event grammar
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            for event in out:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._journal.write("completed", rid, path, tokens=tokens)

    def _models(self) -> bytes:
        if not self._loras.loaded:
            return self._models_body
        base = {"id": self._cfg.model, "object": "model", "created": self._created, "owned_by": OWNED_BY}
        data = [base, *self._loras.models(self._cfg.model, self._created, OWNED_BY)]
        return json.dumps({"object": "list", "data": data}).encode()

    async def _lora(self, path: str, rid: str, receive: Receive, send: Send) -> None:
        """vLLM's load or unload endpoint (`simruntime.lora`), journaled (`lora_load`, `lora_unload`)."""
        body = await read_body(receive)
        event = "lora_load" if path == "/v1/load_lora_adapter" else "lora_unload"
        try:
            answer = self._loras.load(body) if event == "lora_load" else self._loras.unload(body)
        except BadRequest as exc:
            self._journal.write(event, rid, path, status=exc.status)
            await reply(
                send, exc.status, error_body(exc.message, "invalid_request_error", "invalid_request", exc.param)
            )
            return
        self._journal.write(event, rid, path, status=200, loaded=list(self._loras.loaded))
        await reply(send, 200, answer, headers=[(b"content-type", b"text/plain; charset=utf-8")])

    async def _watched(self, receive: Receive, produce: Callable[[Outcome], Awaitable[None]]) -> Outcome:
        """Run `produce` until it is done or the client goes away (ASGI `http.disconnect`)."""
        outcome = Outcome()

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

    async def _produce(self, work: Work, faults: Faults, send: Send, outcome: Outcome) -> None:
        if faults.hang is Phase.BEFORE or (faults.hang is Phase.AFTER and not work.stream):
            await trio.sleep_forever()
        await trio.sleep(faults.slow_ms / 1000.0)  # an engine that answers slowly (0: at once)
        if work.kind is Kind.EMBEDDING:
            body = answers.embeddings(work, faults)
            outcome.finished = True
            await answers.reply_garbled(send, body, faults.garble, outcome)
        elif work.stream and work.tool is not None:
            await trio.sleep(self._ttft_s)
            await answers.tool_stream(work, work.tool, send, outcome, serial=self._metrics.total)
        elif work.stream:
            await answers.stream(work, faults, send, outcome, self._cfg, serial=self._metrics.total)
        else:
            first_at = trio.current_time() + self._ttft_s
            await trio.sleep_until(first_at + max(0, work.max_tokens - 1) * self._interval_s)
            body = answers.unary(work, self._cfg, serial=self._metrics.total, faults=faults)
            outcome.tokens = work.max_tokens * len(work.texts)
            if work.max_tokens > 0:
                # The whole answer goes out at once: its tokens were "made" at the configured pace.
                outcome.first_token_at, outcome.last_token_at = first_at, trio.current_time()
            outcome.finished = True
            await answers.reply_garbled(send, body, faults.garble, outcome)
