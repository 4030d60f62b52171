"""Every HTTP exchange with a real `nexa control` ends: an answer decided before the request's body
arrived, a body that stops arriving, a method a route does not take. Raw sockets, so the test
controls exactly when each byte is sent (as a keep-alive client that writes the head and the body
in two writes does: python-requests, behind schemathesis)."""

from __future__ import annotations

import random
import socket
import string
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ControllerProcess, running_controller

#: How long a test waits for an answer; the controller answers these in milliseconds.
ANSWER_S = 5.0


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length: status, headers (lower-case), body. Raises
    TimeoutError when the controller does not answer within the socket's timeout."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionResetError("closed before an answer")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def _connect(cp: ControllerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", cp.port))
    sock.settimeout(ANSWER_S)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the controller closed its end (EOF or reset), as opposed to holding it open silently."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture(name="inference_key")
def _inference_key(controller_process: ControllerProcess) -> str:
    headers = {"Authorization": f"Bearer {controller_process.admin_key}"}
    with httpx.Client(base_url=controller_process.url, headers=headers, timeout=10) as http:
        assert http.post("/api/v1/tenants", json={"id": "team"}).status_code == 201
        made = http.post("/api/v1/keys", json={"role": "inference", "name": "t", "tenant": "team"})
        assert made.status_code == 201, made.text
        return str(made.json()["key"])


@pytest.mark.parametrize(
    ("head", "status"),
    [
        # quart's management routes: refused from the head (no key; a method the route does not take).
        ("POST /api/v1/enrollment-tokens", 401),
        ("TRACE /api/v1/backups", 405),
        # The inference routes (plain ASGI in front of quart).
        ("POST /v1/chat/completions", 401),
    ],
)
def test_an_answer_sent_before_the_body_arrived_never_leaves_the_connection_hanging(
    controller_process: ControllerProcess, head: str, status: int
) -> None:
    """Before the fix, the late body and the next request on the connection were read and never
    answered: quart-trio cancelled hypercorn's close of the connection half-way (schemathesis saw
    9 requests time out after 10 s in an acceptance run)."""
    admin = controller_process.admin_key
    sock = _connect(controller_process)
    with sock:
        sock.sendall(
            f"{head} HTTP/1.1\r\nHost: nexa\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n".encode()
        )
        got, headers, _ = _read_response(sock)
        assert got == status
        # The unread body ends the connection, and the answer says so: the client does not reuse it.
        assert headers["connection"] == "close"
        if status == 405:
            assert headers["allow"] == "GET, HEAD, POST"
        time.sleep(0.05)  # the body comes after the answer, as a client writing head and body apart sends it
        try:
            sock.sendall(b"{}")
            sock.sendall(
                f"GET /api/v1/audit/head HTTP/1.1\r\nHost: nexa\r\nAuthorization: Bearer {admin}\r\n\r\n".encode()
            )
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed already: what a client must then do is open another connection
        # Never a silence: the connection is closed (it said `Connection: close`), not held open unanswered.
        assert _closed_by_server(sock)
    # ... and the next connection is answered at once.
    assert (
        httpx.get(
            f"{controller_process.url}/api/v1/audit/head",
            headers={"Authorization": f"Bearer {admin}"},
            timeout=ANSWER_S,
        ).status_code
        == 200
    )


def test_a_request_whose_body_arrived_first_keeps_its_connection(controller_process: ControllerProcess) -> None:
    """Head and body together, then a second request on the same connection: keep-alive works as before."""
    admin = controller_process.admin_key
    sock = _connect(controller_process)
    with sock:
        request = (
            f"POST /api/v1/enrollment-tokens HTTP/1.1\r\nHost: nexa\r\nAuthorization: Bearer {admin}\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        )
        sock.sendall(request.encode())
        got, headers, _ = _read_response(sock)
        assert got == 201 and "connection" not in headers
        sock.sendall(f"GET /api/v1/audit/head HTTP/1.1\r\nHost: nexa\r\nAuthorization: Bearer {admin}\r\n\r\n".encode())
        assert _read_response(sock)[0] == 200


def test_a_method_the_inference_route_does_not_take_is_405_with_allow(controller_process: ControllerProcess) -> None:
    answer = httpx.request("DELETE", f"{controller_process.url}/v1/chat/completions", timeout=ANSWER_S)
    assert answer.status_code == 405
    assert answer.headers["allow"] == "POST"
    assert answer.json()["error"]["code"] == "method_not_allowed"
    workloads = httpx.request("PUT", f"{controller_process.url}/api/v1/workloads/wl_1", timeout=ANSWER_S)
    assert workloads.status_code == 405 and workloads.headers["allow"] == "GET"
    assert set(workloads.json()["error"]) == {"code", "message", "retryable", "request_id"}
    # A stalled event loop would be counted here (none was: these answered in milliseconds).
    headers = {"Authorization": f"Bearer {controller_process.admin_key}"}
    metrics = httpx.get(f"{controller_process.url}/metrics", headers=headers, timeout=ANSWER_S).text
    assert "\nnexa_event_loop_stalls_total 0.0\n" in metrics


@pytest.fixture(name="impatient_controller")
def _impatient_controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    with running_controller(tmp_path, "[http]\nbody_timeout_s = 1.0\nkeep_alive_timeout_s = 1.0\n") as cp:
        yield cp


@pytest.mark.parametrize("path", ["/api/v1/tenants", "/v1/chat/completions"])
def test_a_body_that_stops_arriving_is_answered_408_within_body_timeout(
    impatient_controller: ControllerProcess, path: str
) -> None:
    cp = impatient_controller
    headers = {"Authorization": f"Bearer {cp.admin_key}"}
    with httpx.Client(base_url=cp.url, headers=headers, timeout=10) as http:
        assert http.post("/api/v1/tenants", json={"id": "team"}).status_code == 201
        key = http.post("/api/v1/keys", json={"role": "inference", "name": "t", "tenant": "team"}).json()["key"]
    token = cp.admin_key if path.startswith("/api/") else key
    sock = _connect(cp)
    with sock:
        started = time.monotonic()
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: nexa\r\nAuthorization: Bearer {token}\r\n"
            'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"id": '.encode()
        )
        got, answer_headers, body = _read_response(sock)
        waited = time.monotonic() - started
    assert got == 408, body
    assert 0.9 <= waited < ANSWER_S
    assert answer_headers["connection"] == "close"
    assert b"request_timeout" in body and b"body_timeout_s" in body
    # Nothing was made of the half body.
    with httpx.Client(base_url=cp.url, headers=headers, timeout=10) as http:
        assert [t["id"] for t in http.get("/api/v1/tenants").json()["tenants"]] == ["team"]


@pytest.mark.parametrize(
    ("raw", "answer"),
    [
        # Malformed framing: answered (from the head, or h11's 400) and closed.
        (b"POST /api/v1/tenants HTTP/1.1\r\nHost: n\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}", 401),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: n\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: n\r\nBad Header\r\n\r\n", 400),
        # A head that never ends: closed after keep_alive_timeout_s (no request to answer).
        (b"GET /healthz HTTP/1.1\r\nHost: n\r\nX-Slow: ", None),
    ],
)
def test_malformed_framing_is_answered_or_closed_within_the_timeouts(
    impatient_controller: ControllerProcess, raw: bytes, answer: int | None
) -> None:
    sock = _connect(impatient_controller)
    with sock:
        sock.sendall(raw)
        if answer is not None:
            assert _read_response(sock)[0] == answer
        assert _closed_by_server(sock)  # within ANSWER_S, never held open
    assert httpx.get(f"{impatient_controller.url}/healthz", timeout=ANSWER_S).status_code == 200


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        kib = next(line.split()[1] for line in status if line.startswith("VmRSS:"))
    return int(kib) * 1024


def _random_methods(cp: ControllerProcess, count: int, rng: random.Random) -> None:
    """`count` requests with made-up methods on keep-alive connections (hypercorn closes one after
    1,000 requests), each answered 404 or 405."""
    for start in range(0, count, 500):
        with _connect(cp) as sock:
            for i in range(start, min(count, start + 500)):
                method = "".join(rng.choices(string.ascii_uppercase, k=rng.randint(3, 12)))
                path = ("/api/v1/nodes", "/v1/chat/completions", f"/api/v1/workloads/wl_{i}")[i % 3]
                sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: nexa\r\n\r\n".encode())
                status, headers, _ = _read_response(sock)
                assert status in (404, 405) and "connection" not in headers, (method, path, status)


@pytest.mark.slow
def test_twenty_thousand_made_up_methods_leave_metrics_and_memory_flat(
    controller_process: ControllerProcess,
) -> None:
    """A client's method never becomes a label: each is one more request under `other`, so /metrics
    keeps its series and the controller its memory (issue 30 point 5)."""
    cp = controller_process
    assert cp.proc is not None
    headers = {"Authorization": f"Bearer {cp.admin_key}"}
    rng = random.Random(30)

    def series() -> list[str]:
        text = httpx.get(f"{cp.url}/metrics", headers=headers, timeout=ANSWER_S).text
        return sorted(line.rsplit(" ", 1)[0] for line in text.splitlines() if line.startswith("nexa_http_"))

    _random_methods(cp, 2_000, rng)  # warm: every route's `other` series exists, allocators settled
    series()  # ... and /metrics' own
    before, rss_before = series(), _rss_bytes(cp.proc.pid)
    _random_methods(cp, 20_000, rng)
    after, rss_after = series(), _rss_bytes(cp.proc.pid)
    assert after == before
    assert any('method="other"' in s for s in after)
    assert rss_after - rss_before < 8 * 2**20, (rss_before, rss_after)
