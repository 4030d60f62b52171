"""The sim's HTTP: the controller's management API (`Api`) and the OpenAI gateway as a client sees it
(`Gateway`), both on loopback with no proxies from the environment. Every public answer that is not
a success is kept (status, headers, body) with a sample of the successes, for the release gate's
leak scan (`--public-answers`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import trio

from nexa.demo import call
from nexa.errors import Unavailable

#: Every this many successful answers, one is kept for the leak scan.
SAMPLE_EVERY: Final = 25
#: The longest body kept of one answer.
MAX_KEPT_BODY: Final = 4096
#: A request to the gateway that takes longer than this is a hang.
REQUEST_TIMEOUT_S: Final = 60.0


@attrs.define
class Answers:
    """The public answers seen: every non-2xx one, and one 2xx of every `SAMPLE_EVERY`."""

    kept: list[dict[str, Any]] = attrs.Factory(list)
    successes: int = 0

    def see(self, path: str, status: int, headers: httpx.Headers, body: bytes) -> None:
        if 200 <= status < 300:
            self.successes += 1
            if self.successes % SAMPLE_EVERY != 1:
                return
        self.kept.append(
            {
                "path": path,
                "status": status,
                "headers": dict(headers.items()),
                "body": body[:MAX_KEPT_BODY].decode("utf-8", "replace"),
            }
        )

    def bodies(self) -> list[str]:
        return [a["body"] for a in self.kept] + [json.dumps(a["headers"]) for a in self.kept]

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(a, sort_keys=True) + "\n" for a in self.kept))


@attrs.frozen(kw_only=True)
class Result:
    """One gateway request as the client saw it."""

    status: int
    #: Seconds on the trio clock when it was sent and when its answer ended.
    started: float
    ended: float
    retry_after: str | None = None
    error_code: str | None = None
    #: A stream: whether it ended with `[DONE]`, and the typed error event it carried, if any.
    done: bool = False
    stream_error: str | None = None
    #: What failed on the client's side ("transport", "timeout"), if anything.
    transport: str | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.stream_error is None and self.transport is None


class Api:
    """The management API with one key (the sim's admin key)."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        #: The client itself, for the demo's set-up functions that take one.
        self.http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30, trust_env=False
        )

    async def get(self, path: str) -> Any:
        return await self._call("GET", path)

    async def post(self, path: str, body: object | None = None) -> Any:
        return await self._call("POST", path, body)

    async def _call(self, method: str, path: str, body: object | None = None) -> Any:
        """`demo.call`, with a controller that does not answer as `Unavailable` (never an httpx error)."""
        try:
            return await call(self.http, method, path, body)
        except httpx.TransportError as exc:
            raise Unavailable(f"{method} {self.url}{path}: {type(exc).__name__}") from None

    async def status(self, path: str) -> int:
        """The status of a GET (whether a route exists, whether the controller answers)."""
        try:
            return (await self.http.get(path)).status_code
        except httpx.TransportError:
            return 0

    async def aclose(self) -> None:
        await self.http.aclose()


class Gateway:
    """`POST /v1/chat/completions` with the inference key, as a client would."""

    def __init__(self, url: str, key: str, answers: Answers) -> None:
        self._answers = answers
        self._http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=REQUEST_TIMEOUT_S,
            trust_env=False,
            limits=httpx.Limits(max_connections=400, max_keepalive_connections=64),
        )

    async def chat(self, prompt: str, *, stream: bool = False, max_tokens: int | None = 4) -> Result:
        body: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": prompt}], "stream": stream}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        started = trio.current_time()
        try:
            async with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                content = await response.aread()
        except httpx.TimeoutException:
            return Result(status=0, started=started, ended=trio.current_time(), transport="timeout")
        except httpx.TransportError:
            return Result(status=0, started=started, ended=trio.current_time(), transport="transport")
        ended = trio.current_time()
        self._answers.see("/v1/chat/completions", response.status_code, response.headers, content)
        error_code = _error_code(content) if response.status_code >= 400 else None
        done, stream_error = _stream_end(content) if stream and response.status_code == 200 else (False, None)
        return Result(
            status=response.status_code,
            started=started,
            ended=ended,
            retry_after=response.headers.get("retry-after"),
            error_code=error_code,
            done=done,
            stream_error=stream_error,
        )

    async def aclose(self) -> None:
        await self._http.aclose()


def _error_code(content: bytes) -> str | None:
    try:
        code = json.loads(content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return str(code)


def _stream_end(content: bytes) -> tuple[bool, str | None]:
    """(ended with `[DONE]`, the code of its error event or None) of an SSE body."""
    done, error = False, None
    for line in content.decode("utf-8", "replace").splitlines():
        data = line.removeprefix("data:").strip() if line.startswith("data:") else None
        if data is None:
            continue
        if data == "[DONE]":
            done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            error = error or "malformed_event"
            continue
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            error = str(event["error"].get("code") or "error")
    return done, error


async def steady(gateway: Gateway, prompt: str, results: list[Result], stop: trio.Event, *, clients: int) -> None:
    """`clients` closed loops of chat requests until `stop` is set, each result appended in order."""

    async def loop(i: int) -> None:
        n = 0
        while not stop.is_set():
            results.append(await gateway.chat(f"{prompt} loop {i} request {n}"))
            n += 1

    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(loop, i)
