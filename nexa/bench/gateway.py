"""The OpenAI API calls of `nexa bench`, as a client sends them: streaming and unary chat
completions and embeddings, each timed into one `stats.Sample`.

The one httpx home of the benchmark's load. A failure is a sample, never an exception: an error
answer by its envelope's `error.code` (or `http_<status>`), a lost connection `transport`, a
request past its deadline `timeout`. Payloads are never logged.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any, Final

import httpx

from nexa import __version__
from nexa.bench.stats import TIMEOUT, TRANSPORT, Sample
from nexa.tls import ClientTls

#: One request may take this long before it counts as `timeout`.
REQUEST_TIMEOUT_S: Final = 120.0
OVERHEAD_HEADER: Final = "x-nexa-overhead-ms"


class Gateway:
    """An async client of the gateway's `/v1` routes for one inference key."""

    def __init__(self, base_url: str, key: str, *, connections: int, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        headers = {"User-Agent": f"nexa-bench/{__version__}", "Authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        # An https gateway's certificate is verified as the CLI does: the system's CAs, or NEXA_CA_FILE.
        verify = ClientTls.from_env().context if base_url.startswith("https:") else True
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits, verify=verify
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def chat(self, model: str, messages: list[dict[str, str]], *, max_tokens: int, stream: bool) -> Sample:
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            return await self._stream("/v1/chat/completions", body)
        return await self._unary("/v1/chat/completions", body)

    async def embed(self, model: str, inputs: Sequence[str]) -> Sample:
        return await self._unary("/v1/embeddings", {"model": model, "input": list(inputs)})

    async def _unary(self, path: str, body: dict[str, Any]) -> Sample:
        sample, _, _ = await self.post(path, body)
        return sample

    async def post(self, path: str, body: dict[str, Any]) -> tuple[Sample, int, Any]:
        """One unary call: its sample, the HTTP status (0: none came) and the answer's JSON (None
        unless it succeeded), for callers that read the answer (`nexa eval run`)."""
        sent = time.monotonic()
        try:
            resp = await self._http.post(path, json=body)
        except httpx.TimeoutException:
            return Sample(e2e_ms=_ms(sent), error=TIMEOUT), 0, None
        except httpx.TransportError:
            return Sample(e2e_ms=_ms(sent), error=TRANSPORT), 0, None
        e2e = _ms(sent)
        overhead = _overhead(resp.headers)
        if not resp.is_success:
            error = _code(resp.content, resp.status_code)
            return Sample(e2e_ms=e2e, overhead_ms=overhead, error=error), resp.status_code, None
        try:
            answer = json.loads(resp.content)
        except ValueError:
            return Sample(e2e_ms=e2e, overhead_ms=overhead, error="bad_answer"), resp.status_code, None
        tokens = _completion_tokens(answer) if isinstance(answer, dict) else 0
        return Sample(e2e_ms=e2e, overhead_ms=overhead, completion_tokens=tokens), resp.status_code, answer

    async def _stream(self, path: str, body: dict[str, Any]) -> Sample:
        sent = time.monotonic()
        first: float | None = None
        tokens = events = 0
        overhead: float | None = None
        try:
            async with self._http.stream("POST", path, json=body) as resp:
                overhead = _overhead(resp.headers)
                if not resp.is_success:
                    content = await resp.aread()
                    return Sample(e2e_ms=_ms(sent), overhead_ms=overhead, error=_code(content, resp.status_code))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event, error = _event(data)
                    if error is not None:
                        return Sample(e2e_ms=_ms(sent), ttft_ms=_since(sent, first), error=error)
                    if _has_content(event):
                        events += 1
                        if first is None:
                            first = time.monotonic()
                    tokens = _completion_tokens(event) or tokens
        except httpx.TimeoutException:
            return Sample(e2e_ms=_ms(sent), ttft_ms=_since(sent, first), error=TIMEOUT)
        except httpx.TransportError:
            return Sample(e2e_ms=_ms(sent), ttft_ms=_since(sent, first), error=TRANSPORT)
        return Sample(
            e2e_ms=_ms(sent), ttft_ms=_since(sent, first), completion_tokens=tokens or events, overhead_ms=overhead
        )


def _ms(since: float) -> float:
    return (time.monotonic() - since) * 1000.0


def _since(sent: float, at: float | None) -> float | None:
    return None if at is None else (at - sent) * 1000.0


def _overhead(headers: httpx.Headers) -> float | None:
    try:
        value = float(headers.get(OVERHEAD_HEADER, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _code(content: bytes, status: int) -> str:
    try:
        answer = json.loads(content)
    except ValueError:
        return f"http_{status}"
    return _error_code(answer) if isinstance(answer, dict) else f"http_{status}"


def _error_code(answer: dict[str, Any]) -> str:
    """The envelope's `error.code`, kept short and plain (it is the gateway's word, still untrusted)."""
    err = answer.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, str) and code and len(code) <= 64 and code.replace("_", "").replace("-", "").isalnum():
        return code
    return "error"


def _event(data: str) -> tuple[dict[str, Any], str | None]:
    """One stream event's object, or the error it is: in-band (`error.code`) or not an object."""
    try:
        event = json.loads(data)
    except ValueError:
        return {}, "bad_answer"
    if not isinstance(event, dict):
        return {}, "bad_answer"
    if "error" in event:  # in-band: the stream had started
        return event, _error_code(event)
    return event, None


def _has_content(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and delta.get("content"):
            return True
    return False


def _completion_tokens(answer: dict[str, Any]) -> int:
    usage = answer.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, int) and not isinstance(tokens, bool) and 0 <= tokens <= 2**31:
        return tokens
    return 0
