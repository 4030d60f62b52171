"""`nexa.control.cluster.forward`: a follower passes management writes to the leader, a fake leader app
served by hypercorn on loopback, the follower's forwarder in front of a "local" app served the same
way: what reaches the leader, what comes back, streaming both ways, and every refusal."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import attrs
import httpx
import hypercorn.config
import hypercorn.trio
import pytest
import trio

from nexa.control.cluster.forward import FORWARDED_HEADER, Forwarder, check_peer, forwarded
from nexa.errors import PlainHttpPeer
from nexa.telemetry import Metrics

LIMIT = 64 * 1024


@attrs.define
class FakeLeadership:
    is_leader: bool = False
    leader_address: str | None = None
    leader_id: str | None = "leader-1"


@attrs.define
class Leader:
    """The leader's app: echoes what it got as JSON (201), or streams `/stream`, or dies mid-answer."""

    seen: list[dict[str, Any]] = attrs.Factory(list)
    first_chunk_read: trio.Event = attrs.Factory(trio.Event)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append(
            {
                "method": scope["method"],
                "path": scope["path"],
                "query": scope["query_string"].decode(),
                "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
                "body": body,
            }
        )
        if scope["path"] == "/api/v1/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"first;", "more_body": True})
            with trio.fail_after(10):
                await self.first_chunk_read.wait()  # the client has it before the answer ends
            await send({"type": "http.response.body", "body": b"second", "more_body": False})
            return
        if scope["path"] == "/api/v1/die":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("the leader process dies")  # hypercorn cuts the connection
        answer = json.dumps({"got": len(body)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 201,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"x-leader-said", b"yes"),
                    (b"set-cookie", b"nexa_console=abc; HttpOnly"),
                    (b"content-length", str(len(answer)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer, "more_body": False})


@attrs.define
class Local:
    """The follower's own management app: answers 200 `local`."""

    calls: list[tuple[str, str]] = attrs.Factory(list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        self.calls.append((scope["method"], scope["path"]))
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"local", "more_body": False})


async def _lifespan(receive: Any, send: Any) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def _serve(app: Any, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, app, config, shutdown_trigger=trio.sleep_forever))
        task_status.started(binds[0])


@attrs.define
class Cluster:
    leader: Leader
    local: Local
    leadership: FakeLeadership
    forwarder: Forwarder
    url: str
    writes: list[int]

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10, trust_env=False)


@pytest.fixture
async def cluster(nursery: trio.Nursery) -> AsyncIterator[Cluster]:
    leader, local = Leader(), Local()
    leader_url = await nursery.start(_serve, leader)
    leadership = FakeLeadership(leader_address=leader_url)
    writes: list[int] = []

    async def after_write() -> None:
        writes.append(len(leader.seen))

    forwarder = Forwarder(
        local,
        leadership,
        controller_id="follower-1",
        max_body_bytes=LIMIT,
        after_write=after_write,
    )
    await nursery.start(forwarder.run)
    url = await nursery.start(_serve, forwarder)
    yield Cluster(leader, local, leadership, forwarder, url, writes)
    nursery.cancel_scope.cancel()


def test_which_requests_a_follower_forwards() -> None:
    assert forwarded("POST", "/api/v1/keys")
    assert forwarded("DELETE", "/api/v1/deployments/chat")
    assert forwarded("PUT", "/api/v1/quotas/acme")
    assert forwarded("POST", "/api/v1/audit/verify")
    assert forwarded("GET", "/console/overview")  # the console: sessions live where they signed in
    assert forwarded("POST", "/console/login")
    assert forwarded("GET", "/")
    for method, path in [
        ("GET", "/api/v1/keys"),
        ("HEAD", "/api/v1/nodes"),
        ("OPTIONS", "/api/v1/keys"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("GET", "/api/v1/cluster"),
        ("POST", "/v1/chat/completions"),  # the inference gateway is always served locally
        ("POST", "/api/v1/workloads"),
        ("POST", "/api/v1/workloads/wl_1/cancel"),
        ("GET", "/console/static/app.css"),
        ("POST", "/not/management"),
    ]:
        assert not forwarded(method, path), (method, path)


async def test_a_write_goes_to_the_leader_with_its_body_and_headers(cluster: Cluster) -> None:
    body = json.dumps({"name": "ci", "role": "operator"}).encode()
    async with cluster.client() as client:
        response = await client.post(
            "/api/v1/keys?dry=1&x=%20y",
            content=body,
            headers={
                "Authorization": "Bearer nxk_test",
                "Idempotency-Key": "idem-1",
                "X-Request-Id": "req-abc",
                "Cookie": "nexa_console=sid",
                "Content-Type": "application/json",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "dropped",
                "Proxy-Authorization": "Basic secret",
            },
        )
    assert response.status_code == 201
    assert response.json() == {"got": len(body)}
    assert response.headers["x-leader-said"] == "yes"
    assert response.headers["set-cookie"] == "nexa_console=abc; HttpOnly"
    assert response.headers[FORWARDED_HEADER] == "leader-1"
    [seen] = cluster.leader.seen
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == ("POST", "/api/v1/keys", "dry=1&x=%20y", body)
    sent = seen["headers"]
    assert sent["authorization"] == "Bearer nxk_test"
    assert sent["idempotency-key"] == "idem-1"
    assert sent["x-request-id"] == "req-abc"
    assert sent["cookie"] == "nexa_console=sid"
    assert sent["content-type"] == "application/json"
    assert sent[FORWARDED_HEADER] == "follower-1"
    assert sent["x-forwarded-for"] == "127.0.0.1"
    assert sent["x-forwarded-proto"] == "http"
    assert "x-hop" not in sent
    assert "proxy-authorization" not in sent
    assert cluster.local.calls == []
    assert cluster.writes == [1]  # the change feed caught up before the answer was relayed


async def test_reads_and_the_gateway_are_served_here(cluster: Cluster) -> None:
    async with cluster.client() as client:
        for method, path in [
            ("GET", "/api/v1/keys"),
            ("GET", "/healthz"),
            ("GET", "/api/v1/cluster"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/api/v1/workloads"),
            ("GET", "/console/static/app.css"),
        ]:
            response = await client.request(method, path, content=b"{}" if method == "POST" else None)
            assert (response.status_code, response.text) == (200, "local"), path
            assert FORWARDED_HEADER not in response.headers
    assert cluster.leader.seen == []
    assert len(cluster.local.calls) == 6


async def test_the_leader_serves_its_writes_itself(cluster: Cluster) -> None:
    cluster.leadership.is_leader = True
    async with cluster.client() as client:
        response = await client.post("/api/v1/keys", content=b"{}")
    assert (response.status_code, response.text) == (200, "local")
    assert cluster.leader.seen == []


async def test_the_console_is_forwarded_with_its_cookies(cluster: Cluster) -> None:
    async with cluster.client() as client:
        response = await client.post(
            "/console/keys", content=b"csrf_token=t&name=x", headers={"Cookie": "nexa_console=sid"}
        )
    assert response.status_code == 201
    [seen] = cluster.leader.seen
    assert seen["path"] == "/console/keys"
    assert seen["headers"]["cookie"] == "nexa_console=sid"
    assert seen["body"] == b"csrf_token=t&name=x"


async def test_bodies_stream_both_ways(cluster: Cluster) -> None:
    chunks = [bytes([i]) * 4096 for i in range(8)]

    async def upload() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
            await trio.sleep(0.01)

    async with cluster.client() as client, client.stream("POST", "/api/v1/stream", content=upload()) as response:
        assert response.status_code == 200
        parts = response.aiter_raw()
        first = await parts.__anext__()
        assert first == b"first;"  # before the leader has finished its answer
        cluster.leader.first_chunk_read.set()
        rest = b"".join([chunk async for chunk in parts])
    assert rest == b"second"
    assert cluster.leader.seen[0]["body"] == b"".join(chunks)


def _not_leader(response: httpx.Response) -> None:
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    error = response.json()["error"]
    assert error["code"] == "not_leader"
    assert error["retryable"] is True
    assert "in a few seconds" in error["message"]


async def test_no_leader_known_is_a_retryable_refusal(cluster: Cluster) -> None:
    cluster.leadership.leader_address = None
    async with cluster.client() as client:
        response = await client.post("/api/v1/keys", content=b"{}", headers={"X-Request-Id": "req-1"})
    _not_leader(response)
    assert "election" in response.json()["error"]["message"]
    assert response.json()["error"]["request_id"] == "req-1"
    assert cluster.leader.seen == [] and cluster.local.calls == []
    assert cluster.writes == []


async def test_a_forwarded_request_is_never_forwarded_again(cluster: Cluster) -> None:
    async with cluster.client() as client:
        response = await client.post("/api/v1/keys", content=b"{}", headers={FORWARDED_HEADER: "follower-2"})
    _not_leader(response)
    assert "passed on already" in response.json()["error"]["message"]
    assert cluster.leader.seen == [] and cluster.local.calls == []


async def test_a_leader_that_does_not_answer_is_a_retryable_refusal(cluster: Cluster) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        cluster.leadership.leader_address = f"http://127.0.0.1:{port}"
        async with cluster.client() as client:
            response = await client.post("/api/v1/keys", content=b"{}")
    _not_leader(response)
    assert "could not be reached" in response.json()["error"]["message"]
    assert cluster.writes == []


async def test_a_leader_that_hangs_up_before_answering_may_have_made_the_change(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    async def hang_up(stream: trio.SocketStream) -> None:
        await stream.receive_some()  # the request arrived; the leader dies before it answers
        await stream.aclose()

    [listener] = await nursery.start(partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1"))
    cluster.leadership.leader_address = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
    async with cluster.client() as client:
        response = await client.post("/api/v1/keys", content=b"{}")
    _not_leader(response)
    assert "may or may not have been made" in response.json()["error"]["message"]
    assert "Idempotency-Key" in response.json()["error"]["message"]
    assert cluster.writes == []


async def test_a_leader_that_dies_mid_answer_cuts_the_connection(cluster: Cluster) -> None:
    async with cluster.client() as client:
        with pytest.raises(httpx.HTTPError):  # not a short body that looks whole
            await client.post("/api/v1/die", content=b"{}")


async def test_the_body_limit_holds_for_forwarded_writes(cluster: Cluster) -> None:
    async with cluster.client() as client:
        declared = await client.post("/api/v1/models", content=b"x" * (LIMIT + 1))

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield b"y" * (LIMIT // 2)

        streamed = await client.post("/api/v1/models", content=chunked())
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"
    assert cluster.leader.seen == []  # neither reached the leader
    assert cluster.writes == []


# ---- encrypted between hosts -------------------------------------------------------------------


def test_plain_http_is_refused_only_to_a_leader_on_another_host() -> None:
    for address in ("http://192.0.2.5:8470", "http://ctl-b.example.internal:8470", "http://[2001:db8::5]:8470"):
        with pytest.raises(PlainHttpPeer, match="allow_plain_http_peers") as refused:
            check_peer(address, allow_plain_http=False)
        assert refused.value.code == "plain_http_peer"
        check_peer(address, allow_plain_http=True)  # the operator said this network is trusted
        check_peer(address.replace("http:", "https:"), allow_plain_http=False)
    for address in ("http://127.0.0.1:8481", "http://127.0.0.7:8481", "http://[::1]:8481", "http://localhost:8481"):
        check_peer(address, allow_plain_http=False)  # one host: several workers on loopback


async def test_a_write_is_not_sent_in_clear_to_a_leader_on_another_host(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """The decision only: the address is never connected to (the transport fails the test if it is)."""
    sent: list[httpx.Request] = []

    def leader(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201, stream=httpx.ByteStream(b"{}"))

    async def local(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a follower served a write itself")

    metrics = Metrics()
    lead = FakeLeadership(leader_address="http://ctl-a.example:8470")
    refusing = Forwarder(
        local, lead, controller_id="b", max_body_bytes=1024, transport=httpx.MockTransport(leader), metrics=metrics
    )
    allowed = Forwarder(
        local,
        lead,
        controller_id="b",
        max_body_bytes=1024,
        transport=httpx.MockTransport(leader),
        allow_plain_http_peers=True,
    )
    for forwarder in (refusing, allowed):
        await nursery.start(forwarder.run)
    refusing_url, allowed_url = await nursery.start(_serve, refusing), await nursery.start(_serve, allowed)

    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        with caplog.at_level(logging.ERROR, logger="nexa.control.cluster.forward"):
            for _ in range(2):
                answer = await client.post(f"{refusing_url}/api/v1/tenants", json={"id": "acme"})
                assert answer.status_code == 503
                assert answer.json()["error"]["code"] == "not_leader"
                assert "plain http" in answer.json()["error"]["message"]
        assert sent == []
        [line] = [r for r in caplog.records if "plain http" in r.getMessage()]  # once per address, not per request
        assert "http://ctl-a.example:8470" in line.getMessage() and "tls_cert_file" in line.getMessage()
        refused = metrics.registry.get_sample_value("nexa_forwarded_requests_total", {"result": "plain_http_refused"})
        assert refused == 2.0

        assert (await client.post(f"{allowed_url}/api/v1/tenants", json={"id": "acme"})).status_code == 201
    assert [str(r.url) for r in sent] == ["http://ctl-a.example:8470/api/v1/tenants"]
