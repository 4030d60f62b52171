"""Enrollment pins what the operator expects (issue 12, point 10): the token `nexa tokens create`
prints carries the controller's key fingerprint, and `nexa node enroll` refuses an answer with other
keys. The impostor is a small HTTP server that answers the enrollment route with keys of its own.
"""

from __future__ import annotations

import http.server
import json
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import trio

from nexa import cli, security
from nexa.channel import links
from nexa.contracts.api import EnrollResponse
from nexa.errors import ConfigError, ControllerKeyMismatch
from nexa.node import identity
from tests.conftest import Controller, serving_http

IMPOSTOR_SIGNING = security.generate_signing_key()
IMPOSTOR_CURVE = links.generate_curve_keypair()


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Answers `POST /api/v1/enroll` as a controller would, with keys that are not the controller's."""

    seen: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        answer = json.dumps(
            {
                "node_id": "spark-1",
                "controller_signing_public_key": IMPOSTOR_SIGNING.public.b64,
                "controller_curve_public_key": IMPOSTOR_CURVE.public,
                "channel_endpoint": "tcp://127.0.0.1:1",
                "labels": {},
            }
        ).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def impostor() -> Iterator[str]:
    with serving_http(_Impostor) as url:
        yield url


def _enroll(url: str, token: str, state_dir: Path, *extra: str) -> int:
    return cli.main(["node", "enroll", "--controller", url, "--token", token, "--state-dir", str(state_dir), *extra])


async def test_a_node_refuses_an_impostor_controller_and_saves_nothing(
    controller: Controller, impostor: str, tmp_path: Path
) -> None:
    async with controller.client() as http_client:
        created = (await http_client.post("/api/v1/enrollment-tokens", json={"ttl_s": 60})).json()
        keys = (await http_client.get("/api/v1/receipts/public-key")).json()
    token, fingerprint = created["token"], created["controller_fingerprint"]
    assert token.endswith("." + fingerprint)
    assert len(fingerprint) == security.CONTROLLER_FINGERPRINT_HEX
    assert keys["public_key"]  # the controller's signing key is part of what the fingerprint covers
    state_dir = tmp_path / "node"

    code = await trio.to_thread.run_sync(_enroll, impostor, token, state_dir)
    assert code != 0
    assert not (state_dir / identity.ENROLLMENT_FILE).exists()
    assert not identity.is_enrolled(state_dir)
    # Only the secret part went out; the fingerprint stays with the node.
    assert _Impostor.seen[-1]["token"] == token.partition(".")[0]

    # The same token still enrolls the node with the real controller, whose keys match.
    code = await trio.to_thread.run_sync(_enroll, controller.url, token, state_dir)
    assert code == 0
    record = identity.load_enrollment(state_dir)
    assert (
        security.controller_fingerprint(record.controller_signing_public_key, record.controller_curve_public_key)
        == fingerprint
    )


async def test_the_fingerprint_flag_pins_a_token_that_carries_none(
    controller: Controller, impostor: str, tmp_path: Path
) -> None:
    async with controller.client() as http_client:
        created = (await http_client.post("/api/v1/enrollment-tokens", json={"ttl_s": 60})).json()
    bare = created["token"].partition(".")[0]
    fp = created["controller_fingerprint"]
    state_dir = tmp_path / "node"
    # No fingerprint at all: refused before anything is sent (no trust on first use).
    assert await trio.to_thread.run_sync(_enroll, controller.url, bare, state_dir) != 0
    assert not identity.is_enrolled(state_dir)
    assert await trio.to_thread.run_sync(_enroll, impostor, bare, state_dir, "--controller-fingerprint", fp) != 0
    assert not identity.is_enrolled(state_dir)
    upper = ":".join(fp[i : i + 4] for i in range(0, len(fp), 4)).upper()  # as an operator may type it
    assert (
        await trio.to_thread.run_sync(_enroll, controller.url, bare, state_dir, "--controller-fingerprint", upper) == 0
    )
    assert identity.is_enrolled(state_dir)


def _answer(signing: security.SigningKey, curve: links.CurveKeyPair) -> EnrollResponse:
    return EnrollResponse(
        node_id="n1",
        controller_signing_public_key=signing.public.b64,
        controller_curve_public_key=curve.public,
        channel_endpoint="tcp://127.0.0.1:8471",
        labels={},
    )


def test_save_enrollment_with_a_pin_refuses_other_keys_even_if_only_one_differs(tmp_path: Path) -> None:
    signing, curve = security.generate_signing_key(), links.generate_curve_keypair()
    pin = security.controller_fingerprint(signing.public.b64, curve.public)
    identity.create_keys(tmp_path)
    for wrong in (
        _answer(signing, links.generate_curve_keypair()),
        _answer(security.generate_signing_key(), curve),
    ):
        with pytest.raises(ControllerKeyMismatch) as info:
            identity.save_enrollment(tmp_path, wrong, pin=pin)
        assert info.value.code == "controller_key_mismatch"
        assert not (tmp_path / identity.ENROLLMENT_FILE).exists()
    identity.save_enrollment(tmp_path, _answer(signing, curve), pin=pin)
    assert identity.is_enrolled(tmp_path)


def test_token_and_flag_must_agree_and_be_well_formed() -> None:
    fp = security.controller_fingerprint(IMPOSTOR_SIGNING.public.b64, IMPOSTOR_CURVE.public)
    token = security.pinned_enrollment_token(security.new_enrollment_token(), fp)
    assert identity.expected_fingerprint(token) == fp
    assert identity.expected_fingerprint(token, "SHA256:" + fp.upper()) == fp
    assert identity.expected_fingerprint(token.partition(".")[0]) is None
    with pytest.raises(ConfigError, match="differs"):
        identity.expected_fingerprint(token, "0" * 64)
    with pytest.raises(ConfigError, match="malformed"):
        identity.expected_fingerprint(token[:-1])
    with pytest.raises(ConfigError, match="64 hex"):
        identity.expected_fingerprint(token.partition(".")[0], "abc")
