"""A lean keep-alive HTTP/1.1 client for the node's own runtimes on loopback: h11 over trio sockets.

The relay sends every inference request through here. A general client (httpx) spent a quarter
of the node agent's CPU per request in its connection pool and request models, and its pool's
bookkeeping grew with the number of connections; this one keeps, per (host, port), a stack of
idle connections and does nothing else: no proxies, TLS, redirects, cookies or compression
(runtimes on 127.0.0.x need none). A connection goes back to the pool only after a complete
exchange; leaving early (cancellation, an error) closes it, which is how a runtime learns that
its client went away.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Final, cast

import h11
import trio

log = logging.getLogger(__name__)

#: Bytes read from a runtime's socket at once.
READ_BYTES: Final = 65536
#: Closing a runtime connection, shielded: closing a loopback socket returns at once, so a second
#: is room to spare, and no shield waits forever.
CLOSE_TIMEOUT_S: Final = 1.0


class RuntimeHTTPError(Exception):
    """The runtime could not be reached, or broke the exchange (the caller knows whether it had answered)."""


class _Connection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(our_role=h11.CLIENT)
        #: trio clock time the last request on it was written.
        self.sent_at = 0.0
        #: The last read left nothing behind it (it was short): the next one waits for bytes first.
        self._drained = True

    async def aclose(self) -> None:
        """Close the socket, even in a cancelled scope (shielded, for at most CLOSE_TIMEOUT_S)."""
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True) as scope:
            await self.stream.aclose()
        if scope.cancelled_caught:
            log.warning("closing a runtime connection took over %g s; it was closed abruptly", CLOSE_TIMEOUT_S)

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise RuntimeHTTPError(f"the runtime broke HTTP/1.1: {exc}") from None
            if event is not h11.NEED_DATA:
                return cast("h11.Event | type[h11.PAUSED]", event)
            self.h11.receive_data(await self._receive())  # b"" at the end of the stream: h11 then reports it

    async def _receive(self) -> bytes:
        """The runtime's next bytes (b"" at the end of the stream), with one checkpoint, as trio's
        `receive_some`, and no more: a stream's runtime writes a token at a time, so each read but
        a full one empties the socket, and the next read would only fail (trio's tries it first,
        and its success costs a second schedule). After such a read this one waits for bytes
        first; after a full one it reads at once, behind a checkpoint. The socket is trio's,
        non-blocking, read by its descriptor (-1 once closed: an error, never another socket's)."""
        sock = self.stream.socket
        if self._drained:
            await trio.lowlevel.wait_readable(sock)
        else:
            await trio.lowlevel.checkpoint()
        while True:
            try:
                data = os.read(sock.fileno(), READ_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError as exc:
                raise RuntimeHTTPError(f"the runtime's connection broke: {exc}") from None
            self._drained = len(data) < READ_BYTES
            return data

    @property
    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE


class Response:
    """A runtime's answer: its status and headers now, its body as it arrives (read it once)."""

    def __init__(self, connection: _Connection, head: h11.Response) -> None:
        self._connection = connection
        self.status_code: int = head.status_code
        self.headers: list[tuple[bytes, bytes]] = list(head.headers)
        #: trio clock time the request was written (the node's overhead ends there).
        self.sent_at: float = connection.sent_at
        self._done = False

    def aiter_bytes(self) -> Response:
        """The body's pieces as they arrive. A plain async iterator, not a generator: leaving the
        loop early leaves nothing behind to finalize (the connection is closed by `post`)."""
        return self

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        while not self._done:
            event = await self._connection.next_event()
            if isinstance(event, h11.Data):
                return bytes(event.data)
            if isinstance(event, h11.EndOfMessage):
                self._done = True
            elif isinstance(event, h11.ConnectionClosed):
                raise RuntimeHTTPError("the runtime closed the connection before the end of its answer")
        raise StopAsyncIteration


class RuntimeClient:
    """POST (or GET, DELETE) to `http://host:port/path` with keep-alive connections, at most
    `max_idle` idle per port."""

    def __init__(self, *, connect_timeout_s: float, max_idle: int = 128) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    def post(
        self, host: str, port: int, path: str, body: bytes, headers: Sequence[tuple[str, str]] = ()
    ) -> contextlib.AbstractAsyncContextManager[Response]:
        """Send the request and yield the answer once its head arrived. RuntimeHTTPError when the
        runtime cannot be reached or breaks the exchange."""
        return self._request("POST", (host, port), path, body, headers)

    def request(
        self, host: str, port: int, path: str, body: bytes, headers: Sequence[tuple[str, str]] = (), *, method: str
    ) -> contextlib.AbstractAsyncContextManager[Response]:
        """`post` with another method (GET, DELETE: `body` empty), as `post` answers."""
        return self._request(method, (host, port), path, body, headers)

    async def get(self, host: str, port: int, path: str, *, timeout_s: float, max_bytes: int) -> tuple[int, bytes]:
        """GET `path` whole: its status and body. RuntimeHTTPError when the runtime cannot be
        reached, breaks the exchange, takes over `timeout_s` in all, or sends over `max_bytes`."""
        with trio.move_on_after(timeout_s) as scope:
            async with self._request("GET", (host, port), path, b"", ()) as response:
                body = bytearray()
                async for piece in response.aiter_bytes():
                    body += piece
                    if len(body) > max_bytes:
                        raise RuntimeHTTPError(f"the answer is over {max_bytes} bytes")
                return response.status_code, bytes(body)
        assert scope.cancelled_caught
        raise RuntimeHTTPError(f"no whole answer within {timeout_s:g} s")

    @contextlib.asynccontextmanager
    async def _request(
        self, method: str, key: tuple[str, int], path: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> AsyncIterator[Response]:
        host, port = key
        request = h11.Request(
            method=method,
            target=path,
            headers=[("Host", f"{host}:{port}"), ("Content-Length", str(len(body))), *headers],
        )
        connection, head = await self._exchange(key, request, body)
        try:
            response = Response(connection, head)
            yield response
            reusable = response._done and connection.reusable
        except BaseException:
            reusable = False
            raise
        finally:
            if reusable and len(self._idle.setdefault(key, [])) < self._max_idle:
                connection.h11.start_next_cycle()
                self._idle[key].append(connection)
            else:
                await connection.aclose()

    async def _exchange(
        self, key: tuple[str, int], request: h11.Request, body: bytes
    ) -> tuple[_Connection, h11.Response]:
        """Send on an idle connection (one the runtime closed meanwhile is retried on a new one), else a new one."""
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            try:
                return connection, await self._send(connection, request, body)
            except RuntimeHTTPError:
                # Closed by the runtime while idle (keep-alive timeout): nothing was answered, try again.
                await connection.aclose()
            except BaseException:
                await connection.aclose()  # cancelled before the head: ours alone now, close it
                raise
        connection = await self._connect(key)
        try:
            return connection, await self._send(connection, request, body)
        except BaseException:
            await connection.aclose()
            raise

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        try:
            with trio.fail_after(self._connect_timeout_s):
                stream = await trio.open_tcp_stream(*key)
        except (OSError, trio.TooSlowError) as exc:
            raise RuntimeHTTPError(f"cannot connect to the runtime on {key[0]}:{key[1]}: {exc}") from None
        return _Connection(stream)

    @staticmethod
    async def _send(connection: _Connection, request: h11.Request, body: bytes) -> h11.Response:
        wire = connection.h11.send(request) + connection.h11.send(h11.Data(data=body))
        wire += connection.h11.send(h11.EndOfMessage())
        try:
            await connection.stream.send_all(wire)
        except trio.BrokenResourceError as exc:
            raise RuntimeHTTPError(f"the runtime's connection broke: {exc}") from None
        connection.sent_at = trio.current_time()
        while True:
            event = await connection.next_event()
            if isinstance(event, h11.Response):
                return event
            if isinstance(event, h11.ConnectionClosed):
                raise RuntimeHTTPError("the runtime closed the connection without answering")
            # InformationalResponse (1xx): keep reading.

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                await connection.aclose()
        self._idle.clear()
