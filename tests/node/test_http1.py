"""The relay's HTTP/1.1 client against a real hypercorn server on loopback."""

from __future__ import annotations

import gc
import socket
import struct
import warnings
from functools import partial
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import pytest
import trio

from nexa.node.http1 import READ_BYTES, RuntimeClient, RuntimeHTTPError
from tests.support.relay import closed_port

TIMEOUT_S = 10


@attrs.define
class Server:
    """Answers every POST with its body reversed, in two chunks; counts the connections it saw."""

    peers: set[tuple[str, int]] = attrs.field(factory=set)
    disconnected: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.peers.add(tuple(scope["client"]))
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/hang":  # never answers, not even the head
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        if scope["method"] == "GET":
            # GET /slow never ends its answer; GET /big sends 1000 bytes; any other path comes back.
            path = scope["path"].encode()
            body = b"slow" if path == b"/slow" else (b"x" * 1000 if path == b"/big" else path)[::-1]
        if body == b"slow":
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
            return
        await send({"type": "http.response.body", "body": body[::-1][:2], "more_body": True})
        await send({"type": "http.response.body", "body": body[::-1][2:], "more_body": False})


async def serve(
    app: Server, keep_alive_s: float, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = keep_alive_s
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, app, config, shutdown_trigger=trio.sleep_forever))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


async def post(client: RuntimeClient, port: int, body: bytes) -> tuple[int, bytes]:
    async with client.post("127.0.0.1", port, "/v1/x", body, [("Content-Type", "text/plain")]) as resp:
        return resp.status_code, b"".join([chunk async for chunk in resp.aiter_bytes()])


async def test_answers_come_back_whole_and_connections_are_reused(nursery: trio.Nursery) -> None:
    app = Server()
    port = await nursery.start(serve, app, 30.0)
    client = RuntimeClient(connect_timeout_s=2)
    with trio.fail_after(TIMEOUT_S):
        for i in range(20):
            assert await post(client, port, f"request {i}".encode()) == (200, f"request {i}".encode()[::-1])
        assert len(app.peers) == 1  # one keep-alive connection served them all
        async with trio.open_nursery() as burst:
            for _ in range(5):
                burst.start_soon(post, client, port, b"together")
        assert len(app.peers) <= 6
    await client.aclose()


async def test_a_connection_the_runtime_closed_while_idle_is_replaced(nursery: trio.Nursery) -> None:
    app = Server()
    port = await nursery.start(serve, app, 0.2)  # the server drops idle connections after 0.2 s
    client = RuntimeClient(connect_timeout_s=2)
    with trio.fail_after(TIMEOUT_S):
        assert await post(client, port, b"one") == (200, b"eno")
        await trio.sleep(0.6)
        assert await post(client, port, b"two") == (200, b"owt")  # not an error: a fresh connection
        assert len(app.peers) == 2
    await client.aclose()


async def test_leaving_early_closes_the_connection_so_the_runtime_sees_it(nursery: trio.Nursery) -> None:
    app = Server()
    port = await nursery.start(serve, app, 30.0)
    client = RuntimeClient(connect_timeout_s=2)
    with trio.fail_after(TIMEOUT_S):
        async with client.post("127.0.0.1", port, "/v1/x", b"slow") as resp:
            async for chunk in resp.aiter_bytes():
                assert chunk == b"first"
                break
        await app.disconnected.wait()
        assert await post(client, port, b"after") == (200, b"retfa")  # a new connection, not the broken one
    await client.aclose()


async def test_a_runtime_that_is_not_listening_is_an_error() -> None:
    client = RuntimeClient(connect_timeout_s=2)
    with pytest.raises(RuntimeHTTPError, match="cannot connect"):
        await post(client, closed_port(), b"x")


async def test_get_reads_the_whole_answer_and_reuses_the_connection(nursery: trio.Nursery) -> None:
    app = Server()
    port = await nursery.start(serve, app, 30.0)
    client = RuntimeClient(connect_timeout_s=TIMEOUT_S)
    with trio.fail_after(TIMEOUT_S):
        assert await client.get("127.0.0.1", port, "/metrics", timeout_s=TIMEOUT_S, max_bytes=100) == (200, b"/metrics")
        assert await client.get("127.0.0.1", port, "/again", timeout_s=TIMEOUT_S, max_bytes=100) == (200, b"/again")
    assert len(app.peers) == 1
    await client.aclose()


async def test_get_refuses_a_long_answer_and_gives_up_on_a_slow_one(nursery: trio.Nursery) -> None:
    app = Server()
    port = await nursery.start(serve, app, 30.0)
    client = RuntimeClient(connect_timeout_s=TIMEOUT_S)
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(RuntimeHTTPError, match="over 100 bytes"):
            await client.get("127.0.0.1", port, "/big", timeout_s=TIMEOUT_S, max_bytes=100)
        with pytest.raises(RuntimeHTTPError, match="no whole answer"):
            await client.get("127.0.0.1", port, "/slow", timeout_s=0.2, max_bytes=100)
        await app.disconnected.wait()  # the slow answer's connection was closed, not kept
        assert await client.get("127.0.0.1", port, "/ok", timeout_s=TIMEOUT_S, max_bytes=100) == (200, b"/ok")
    await client.aclose()


async def test_a_reused_connection_given_up_before_its_answer_is_closed_not_dropped(nursery: trio.Nursery) -> None:
    # A request cancelled (timed out) while it waits for the head on a connection taken from the
    # idle pool closes that connection; dropping it left the socket to the garbage collector.
    app = Server()
    port = await nursery.start(serve, app, 30.0)
    client = RuntimeClient(connect_timeout_s=TIMEOUT_S)
    with trio.fail_after(TIMEOUT_S):
        assert await client.get("127.0.0.1", port, "/first", timeout_s=TIMEOUT_S, max_bytes=100) == (200, b"/first")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with pytest.raises(RuntimeHTTPError, match="no whole answer"):
                await client.get("127.0.0.1", port, "/hang", timeout_s=0.2, max_bytes=100)
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
        await app.disconnected.wait()  # the runtime saw the connection go
        assert len(app.peers) == 1  # the timed-out request went over the reused connection
    await client.aclose()


# --- reads as a runtime writes: a peer at the socket level, so the test says what arrives when ----


async def raw_peer(answer: Any, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Accept one connection, read one request (its head and Content-Length body), then hand the
    stream to `answer`, which writes what the runtime says."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    async with listeners[0], await listeners[0].accept() as stream:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        head, _, body = request.partition(b"\r\n\r\n")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
        while len(body) < length:
            body += await stream.receive_some(65536)
        await answer(stream)


async def test_an_answer_larger_than_one_read_comes_whole(nursery: trio.Nursery) -> None:
    # After a full read (READ_BYTES) the next one reads at once, behind a checkpoint; after a short
    # one it waits for bytes first. A body of several full reads and a short one goes both ways.
    body = bytes(range(256)) * (5 * READ_BYTES // 256) + b"tail"

    async def answer(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    port = await nursery.start(raw_peer, answer)
    client = RuntimeClient(connect_timeout_s=TIMEOUT_S)
    with trio.fail_after(TIMEOUT_S):
        assert await post(client, port, b"x") == (200, body)
    await client.aclose()


async def test_each_piece_a_runtime_writes_is_read_as_it_arrives(nursery: trio.Nursery) -> None:
    # A runtime writes a token, then waits: the client gets each piece as it comes, without waiting
    # for more (the runtime here writes the next piece only once the client has the one before).
    got: list[bytes] = []
    took = [trio.Event() for _ in range(3)]

    async def answer(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i, piece in enumerate((b"data: one\n\n", b"data: two\n\n", b"data: three\n\n")):
            await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))
            await took[i].wait()
        await stream.send_all(b"0\r\n\r\n")

    port = await nursery.start(raw_peer, answer)
    client = RuntimeClient(connect_timeout_s=TIMEOUT_S)
    with trio.fail_after(TIMEOUT_S):
        async with client.post("127.0.0.1", port, "/v1/chat/completions", b"{}") as resp:
            async for piece in resp.aiter_bytes():
                got.append(piece)
                took[len(got) - 1].set()
    assert got == [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"]
    await client.aclose()


async def test_a_runtime_that_resets_its_connection_mid_answer_is_an_error(nursery: trio.Nursery) -> None:
    took_first = trio.Event()

    async def answer(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await took_first.wait()
        # SO_LINGER 0: closing sends a reset, not an orderly end; the client's next read fails.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()

    port = await nursery.start(raw_peer, answer)
    client = RuntimeClient(connect_timeout_s=TIMEOUT_S)
    got: list[bytes] = []

    async def read() -> None:
        async with client.post("127.0.0.1", port, "/v1/chat/completions", b"{}") as resp:
            async for piece in resp.aiter_bytes():
                got.append(piece)
                took_first.set()

    with trio.fail_after(TIMEOUT_S), pytest.raises(RuntimeHTTPError, match="connection broke"):
        await read()
    assert got == [b"first"]
    await client.aclose()
