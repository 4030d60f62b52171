"""S3 credentials in the formats operators have (JSON, the AWS shared-credentials INI, the AWS_*
variables), and credentials files re-read when they change (`config.WatchedFile`), S3 and
registry alike (the node's pulls: a podman API answered by a MockTransport)."""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
from pathlib import Path

import httpx
import pytest
import trio

from nexa.config import WatchedFile
from nexa.errors import ConfigError
from nexa.node.engines.libpod import LibpodEngine
from nexa.oci import RegistryCredentials, registry_credentials
from nexa.s3.credentials import load_s3_credentials, s3_credentials
from nexa.sigv4 import EMPTY_PAYLOAD_SHA256, S3Credentials, sign_v4

INI = """\
[default]
aws_access_key_id = AKIDDEFAULT
aws_secret_access_key = default-s3cr3t%with-percent

[ci]
aws_access_key_id = AKIDCI
aws_secret_access_key = ci-s3cr3t
aws_session_token = ci-session-t0ken
region = ignored
"""


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` as operators' tools do: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)


def _file(tmp_path: Path, text: str, name: str = "credentials") -> Path:
    path = tmp_path / name
    _replace(path, text)
    return path


def test_the_aws_shared_credentials_file_is_read_with_its_profile(tmp_path: Path) -> None:
    path = _file(tmp_path, INI)
    assert load_s3_credentials(path) == S3Credentials("AKIDDEFAULT", "default-s3cr3t%with-percent")
    ci = load_s3_credentials(path, profile="ci")
    assert ci == S3Credentials("AKIDCI", "ci-s3cr3t", session_token="ci-session-t0ken")
    assert "s3cr3t" not in repr(ci) and "t0ken" not in repr(ci)


@pytest.mark.parametrize(
    ("content", "profile", "problem"),
    [
        (INI, "prod", "has no profile [prod]; set artifacts.s3_profile"),
        ("[default]\naws_access_key_id = AKID\n", "default", "[default] aws_secret_access_key is missing"),
        ("[default]\naws_access_key_id =\naws_secret_access_key = s3cr3t\n", "default", "aws_access_key_id is missing"),
        ("aws_access_key_id = AKID\naws_secret_access_key = s3cr3t\n", "default", "neither JSON nor an AWS"),
        ("[default]\n[default]\naws_secret_access_key = s3cr3t\n", "default", "neither JSON nor an AWS"),
        ("[s3cr3t-in-a-header\n", "default", "neither JSON nor an AWS"),
    ],
)
def test_a_bad_ini_file_is_refused_naming_the_problem_never_the_secret(
    tmp_path: Path, content: str, profile: str, problem: str
) -> None:
    path = _file(tmp_path, content)
    with pytest.raises(ConfigError) as info:
        load_s3_credentials(path, profile=profile)
    assert problem in info.value.message and str(path) in info.value.message
    assert "s3cr3t" not in info.value.message


def test_without_a_file_the_standard_aws_variables_are_used() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKIDENV", "AWS_SECRET_ACCESS_KEY": "env-s3cr3t"}
    assert s3_credentials("", environ=env) == S3Credentials("AKIDENV", "env-s3cr3t")
    with_token = s3_credentials("", environ={**env, "AWS_SESSION_TOKEN": "env-t0ken"})
    assert with_token == S3Credentials("AKIDENV", "env-s3cr3t", session_token="env-t0ken")
    assert s3_credentials("", environ={}) is None  # anonymous, as before
    for half in ({"AWS_ACCESS_KEY_ID": "AKIDENV"}, {"AWS_SECRET_ACCESS_KEY": "env-s3cr3t"}):
        with pytest.raises(ConfigError, match="set both, or neither") as info:
            s3_credentials("", environ=half)
        assert "s3cr3t" not in info.value.message


def test_a_configured_file_wins_over_the_variables(tmp_path: Path) -> None:
    path = _file(tmp_path, INI)
    source = s3_credentials(str(path), profile="ci", environ={"AWS_ACCESS_KEY_ID": "X", "AWS_SECRET_ACCESS_KEY": "Y"})
    assert callable(source) and source().access_key_id == "AKIDCI"


def test_a_session_token_is_sent_signed() -> None:
    def sign(creds: S3Credentials) -> dict[str, str]:
        return sign_v4(
            method="GET",
            host="s3.example:8333",
            raw_path="/bucket/key",
            headers={},
            payload_sha256=EMPTY_PAYLOAD_SHA256,
            credentials=creds,
            region="us-east-1",
            now=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        )

    plain = sign(S3Credentials("AKID", "s3cr3t"))
    temporary = sign(S3Credentials("AKID", "s3cr3t", session_token="t0ken"))
    assert "x-amz-security-token" not in plain
    assert temporary["x-amz-security-token"] == "t0ken"
    assert "x-amz-security-token" in temporary["authorization"].split("SignedHeaders=")[1]
    assert plain["authorization"] != temporary["authorization"]


def test_a_watched_file_is_reread_on_change_and_keeps_the_last_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _file(tmp_path, json.dumps({"access_key_id": "AKID1", "secret_access_key": "s3cr3t-1"}))
    invalid: list[int] = []
    source = s3_credentials(str(path), environ={}, on_invalid=lambda: invalid.append(1))
    assert callable(source)
    assert source().access_key_id == "AKID1"
    assert source() is source()  # unchanged: not parsed again

    _replace(path, INI)  # JSON to INI, a new inode
    assert source() == S3Credentials("AKIDDEFAULT", "default-s3cr3t%with-percent")
    caplog.set_level(logging.INFO)
    _replace(path, "[default]\naws_access_key_id = AKID3\n")  # no secret: refused
    assert source().access_key_id == "AKIDDEFAULT"
    assert source().access_key_id == "AKIDDEFAULT"
    assert invalid == [1]  # counted once per change, not once per use
    assert "keeping the credentials read before" in caplog.text
    path.unlink()  # gone: still the last good one
    assert source().access_key_id == "AKIDDEFAULT"
    assert invalid == [1, 1]
    _replace(path, json.dumps({"access_key_id": "AKID4", "secret_access_key": "s3cr3t-4"}))
    assert source() == S3Credentials("AKID4", "s3cr3t-4")
    assert "s3cr3t" not in caplog.text


def _auths(registry: str, username: str, password: str) -> str:
    """A registry credentials file (`oci.load_registry_credentials`: Docker's config.json shape)."""
    return json.dumps({"auths": {registry: {"username": username, "password": password}}})


def test_an_edit_in_place_is_seen_too(tmp_path: Path) -> None:
    path = _file(tmp_path, json.dumps({"username": "robot", "password": "pw-1"}))
    watched = WatchedFile(
        str(path), lambda p: RegistryCredentials(registry="r.example", **json.loads(Path(p).read_text()))
    )
    path.write_text(json.dumps({"username": "robot", "password": "pw-two"}))  # same inode, new size
    assert watched.current().password == "pw-two"
    assert watched.reloads == 1


def test_registry_credentials_follow_their_file(tmp_path: Path) -> None:
    assert registry_credentials("") is None
    path = _file(tmp_path, _auths("r.example", "robot", "pw-1"))
    source = registry_credentials(str(path))

    def password() -> str:
        assert source is not None
        entry = source().for_registry("r.example")
        assert entry is not None
        return entry.password

    assert password() == "pw-1"
    _replace(path, _auths("r.example", "robot", "pw-2"))
    assert password() == "pw-2"
    _replace(path, "{broken")
    assert password() == "pw-2"
    with pytest.raises(ConfigError, match="not valid JSON"):
        registry_credentials(str(path))  # bad at start: refused, as before


async def test_the_node_pulls_with_the_registry_credentials_its_file_holds_now(tmp_path: Path) -> None:
    path = _file(tmp_path, _auths("registry.example:5000", "puller", "pw-1"))
    pulls: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        pulls.append(json.loads(base64.urlsafe_b64decode(request.headers["X-Registry-Auth"])))
        return httpx.Response(200, text='{"images":["abc"],"id":"abc"}\n')

    image = f"registry.example:5000/nexa/busybox@sha256:{'b' * 64}"
    source = registry_credentials(str(path))
    async with LibpodEngine("/unused.sock", credentials=source, transport=httpx.MockTransport(handler)) as client:
        with trio.fail_after(10):
            await client.pull(image)
            _replace(path, _auths("registry.example:5000", "puller", "pw-2"))
            await client.pull(image)
    assert [p["password"] for p in pulls] == ["pw-1", "pw-2"]
