"""`nexa.node.probe`: the node's HTTP probes answer with nexa types, and a peer that does not answer is
`Unavailable` naming the failure, never an httpx error."""

from __future__ import annotations

import http.server

import pytest

from nexa.errors import Unavailable
from nexa.node.probe import HttpProbe, http_url_host
from tests.conftest import free_port, serving_http


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"ok": true}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Probe", "yes")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


async def test_a_probe_reads_the_answer_whole() -> None:
    with serving_http(_Healthy) as url:
        async with HttpProbe(timeout_s=5) as probe:
            answer = await probe.get(f"{url}/health")
            missing = await probe.get(f"{url}/nothing")
    assert (answer.status, answer.content, answer.headers["x-probe"]) == (200, b'{"ok": true}', "yes")
    assert missing.status == 404


async def test_no_answer_is_unavailable_naming_the_failure() -> None:
    async with HttpProbe(timeout_s=5) as probe:
        with pytest.raises(Unavailable) as caught:
            await probe.get(f"http://127.0.0.1:{free_port()}/health")
    assert caught.value.message == "ConnectError"


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://control.lab:8470/", "control.lab"),
        ("http://127.0.0.1:8470", "127.0.0.1"),
        ("http://", ""),
        ("control.lab:8470", ""),
        ("tcp://control.lab:8471", ""),
        ("http://[::1", ""),  # not a URL at all: no host, and no httpx error
    ],
)
def test_the_host_of_an_http_url(url: str, host: str) -> None:
    assert http_url_host(url) == host
