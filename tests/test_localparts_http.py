"""`nexa.localparts.http`, the local parts' one HTTP client: a part that does not answer yet is False or
None (the caller polls again), and a failed image push is `Unavailable`, never an httpx error."""

from __future__ import annotations

import http.server

import pytest

from nexa.errors import Unavailable
from nexa.localparts import http as local_http
from tests.conftest import free_port, serving_http


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A registry that refuses every upload, and answers GETs with 200."""

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self._answer(200)

    def do_POST(self) -> None:
        self._answer(403)

    def do_PUT(self) -> None:
        self._answer(403)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_part_that_does_not_answer_yet_is_false_or_none() -> None:
    url = f"http://127.0.0.1:{free_port()}/"
    assert local_http.answers(url) is False
    assert local_http.put_status(url, {}, timeout_s=2) is None


def test_a_part_that_answers() -> None:
    with serving_http(_Refusing) as url:
        assert local_http.answers(f"{url}/v2/") is True
        assert local_http.put_status(f"{url}/bucket", {}, timeout_s=2) == 403


def test_a_refused_or_unanswered_push_is_unavailable() -> None:
    with serving_http(_Refusing) as url, pytest.raises(Unavailable, match="pushing nexa/x to the registry"):
        local_http.push_image(url, "nexa/x", b"{}", b"{}", "application/vnd.oci.image.manifest.v1+json")
    with pytest.raises(Unavailable, match="pushing nexa/x"):
        local_http.push_image(f"http://127.0.0.1:{free_port()}", "nexa/x", b"{}", b"{}", "application/json")
