"""The container engines' HTTP APIs on their unix sockets (libpod, Docker Engine): the one home of
httpx for the node's engine drivers (`engines.libpod`, `engines.docker`; `engines.common` holds
what they share).

`EngineHttp.request` gives an answer read whole, bounded (`EngineAnswer`), `EngineHttp.stream` one
read as it arrives (`EngineStream`: a pull, an attached exec, the event stream). Every transport
failure becomes `EngineUnavailable` (the socket does not answer) or `EngineError` here, httpcore's
`map_exceptions` way, so the drivers never see httpx; what an engine's error status means is theirs
to say.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from typing import Any, Final, TypeAlias, final

import attrs
import httpx
import trio

from nexa.errors import EngineError, EngineUnavailable

#: Connecting to a local socket is instant or broken.
CONNECT_TIMEOUT_S: Final = 5.0
#: A request that gets no answer for a minute is stuck.
READ_TIMEOUT_S: Final = 60.0
#: Longest wait for closing a stream the caller stopped reading (shielded from cancellation).
STREAM_CLOSE_S: Final = 2.0
#: The most an answer read whole may hold (a listing of thousands of containers, a long pull's
#: progress stream are far smaller); beyond it the answer is refused, not kept in memory.
MAX_ANSWER_BYTES: Final = 64 * 1024 * 1024

#: What the drivers' `transport=` takes: an httpx transport, a seam for fault-injection tests only.
EngineTransport: TypeAlias = httpx.AsyncBaseTransport
#: A JSON request body.
JsonBody: TypeAlias = dict[str, Any]


@attrs.frozen
class EngineAnswer:
    """An engine's answer, read whole."""

    status: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not JSON."""
        return json.loads(self.content)


@final
class EngineStream:
    """An engine's answer whose body is read as it arrives, inside `EngineHttp.stream`."""

    def __init__(self, response: httpx.Response, failure: _Failure) -> None:
        self._response = response
        self._failure = failure
        self.status: int = response.status_code

    async def read(self) -> EngineAnswer:
        """The rest of the body, read whole up to MAX_ANSWER_BYTES (an error answer's message)."""
        with self._failure.mapped():
            return EngineAnswer(self.status, await _read_bounded(self._response, self._failure))

    async def drain(self) -> None:
        """Read the body to its end and drop it (an attached exec's output: never kept)."""
        with self._failure.mapped():
            async for _ in self._response.aiter_raw():
                pass

    async def lines(self) -> AsyncGenerator[str, None]:
        """The body's lines as they arrive. Use under `aclosing`: closing it early closes the answer
        and ends httpx's generators under it (see `_finish_stream`)."""
        lines = self._response.aiter_lines()
        try:
            with self._failure.mapped():
                async for line in lines:
                    yield line
        finally:
            await _finish_stream(self._response, lines)


@attrs.frozen
class _Failure:
    """httpx's failures as nexa errors naming the engine (never the socket's path: messages reach
    the controller in runtime states, and the agent logs the path once when it starts)."""

    engine: str

    @contextlib.contextmanager
    def mapped(self) -> Iterator[None]:
        try:
            yield
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{self.engine} does not answer on its socket: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"talking to {self.engine} failed: {type(exc).__name__}") from exc


def _timeout(read_timeout_s: float | None) -> httpx.Timeout:
    return httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S)


@final
class EngineHttp:
    """One engine's API on its unix socket. Use as `async with EngineHttp(socket, …) as http:`.

    `base_url` is where the API lives (the host part is ignored on a socket); `engine` names it in
    messages. No proxies and no .netrc: this is a local socket.
    """

    def __init__(
        self, socket_path: str, *, base_url: str, engine: str, transport: EngineTransport | None = None
    ) -> None:
        self._failure = _Failure(engine)
        self._http = httpx.AsyncClient(
            base_url=base_url,
            # verify=False: a unix socket carries no TLS, so no CA bundle is loaded (~1 MiB of RSS).
            transport=transport if transport is not None else httpx.AsyncHTTPTransport(uds=socket_path, verify=False),
            timeout=_timeout(READ_TIMEOUT_S),
            trust_env=False,
        )

    async def __aenter__(self) -> EngineHttp:
        await self._http.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: JsonBody | None = None,
        headers: Mapping[str, str] | None = None,
        read_timeout_s: float | None = READ_TIMEOUT_S,
    ) -> EngineAnswer:
        """Send one request and read its answer whole, up to MAX_ANSWER_BYTES (EngineError beyond);
        None as `read_timeout_s` waits for as long as the caller's cancel scope allows."""
        with self._failure.mapped():
            async with self._http.stream(
                method, path, params=params, json=body, headers=headers, timeout=_timeout(read_timeout_s)
            ) as response:
                return EngineAnswer(response.status_code, await _read_bounded(response, self._failure))

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: JsonBody | None = None,
        read_timeout_s: float | None = None,
    ) -> AsyncIterator[EngineStream]:
        """Send one request; its answer streamed inside the `async with` (no read timeout unless
        given: the caller's cancel scope is the deadline)."""
        with self._failure.mapped():
            async with self._http.stream(
                method, path, params=params, json=body, timeout=_timeout(read_timeout_s)
            ) as response:
                yield EngineStream(response, self._failure)


async def _read_bounded(response: httpx.Response, failure: _Failure) -> bytes:
    """A body read whole, or EngineError once it holds more than MAX_ANSWER_BYTES (what was read is dropped)."""
    content = bytearray()
    chunks = response.aiter_bytes()
    try:
        async for chunk in chunks:
            content += chunk
            if len(content) > MAX_ANSWER_BYTES:
                request = response.request
                raise EngineError(
                    f"{failure.engine} answered {request.method} {request.url.path[:200]} with more than "
                    f"{MAX_ANSWER_BYTES} bytes: refused"
                )
    finally:
        await _finish_stream(response, chunks)
    return bytes(content)


async def _finish_stream(response: httpx.Response, lines: AsyncIterator[object]) -> None:
    """Close a streamed response the caller stopped reading, and end httpx's generators under it.

    `aiter_lines` sits on a chain of async generators (text, bytes, raw, transport, httpcore) that
    httpx leaves suspended when the outer one is closed early (encode/httpx#3686); trio would warn as
    the garbage collector finds each. Once the response is closed, reading on fails inside the
    innermost generator and so ends all of them.
    """
    with trio.CancelScope(deadline=trio.current_time() + STREAM_CLOSE_S, shield=True):
        with contextlib.suppress(httpx.HTTPError):
            await response.aclose()
        with contextlib.suppress(Exception):
            while True:  # lines already decoded come first; then the closed stream raises
                await anext(lines)
