"""`nexa.s3`'s SigV4 signer against the published AWS Signature Version 4 test suite.

Every case of `tests/fixtures/sigv4/` (see its README for the source) is signed and its canonical
request, string to sign, signature and authorization header compared with the published ones.
The suite signs for a generic service, so it runs with `GENERIC_STYLE` (with or without path
normalisation as the case says); the S3 style is checked by the cases below it and by the
SeaweedFS tests (`tests/node/test_artifacts.py`, `tests/test_push.py`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path
from typing import Any, Final

import pytest

from nexa.sigv4 import (
    EMPTY_PAYLOAD_SHA256,
    GENERIC_STYLE,
    S3_STYLE,
    S3Credentials,
    SigningStyle,
    canonical_query,
    canonical_uri,
    sign_request,
)

VECTORS: Final = Path(__file__).parent / "fixtures" / "sigv4"
CASES: Final = sorted(p.name for p in VECTORS.iterdir() if p.is_dir())


def _parse_request(raw: bytes) -> tuple[str, str, list[tuple[str, str]], bytes]:
    """`request.txt` → method, target (path and query as sent), headers in order, body."""
    head, _, body = raw.partition(b"\n\n")
    lines = head.decode("utf-8").split("\n")
    method, _, rest = lines[0].partition(" ")
    target = rest.removesuffix(" HTTP/1.1")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        if line[:1] in (" ", "\t") and headers:
            # A folded (multi-line) value continues the previous header.
            name, value = headers[-1]
            headers[-1] = (name, f"{value}\n{line}")
            continue
        name, _, value = line.partition(":")
        headers.append((name, value.lstrip()))
    return method, target, headers, body


def _case(name: str) -> tuple[dict[str, Any], bytes]:
    return json.loads((VECTORS / name / "context.json").read_text()), (VECTORS / name / "request.txt").read_bytes()


@pytest.mark.parametrize("name", CASES)
def test_signer_matches_the_aws_test_suite(name: str) -> None:
    context, raw = _case(name)
    method, target, headers, body = _parse_request(raw)
    path, _, query = target.partition("?")
    host = next(value for key, value in headers if key.lower() == "host")
    creds = context["credentials"]
    signed = sign_request(
        method=method,
        host=host,
        raw_path=path,
        raw_query=query,
        headers=[(k, v) for k, v in headers if k.lower() != "host"],
        payload_sha256=hashlib.sha256(body).hexdigest(),
        credentials=S3Credentials(creds["access_key_id"], creds["secret_access_key"]),
        region=context["region"],
        service=context["service"],
        now=datetime.datetime.fromisoformat(context["timestamp"].replace("Z", "+00:00")),
        style=SigningStyle(normalize_path=context["normalize"], double_encode=True),
        content_sha256_header=context["sign_body"],
        session_token=creds.get("token"),
    )
    expected = VECTORS / name
    assert signed.canonical_request == (expected / "header-canonical-request.txt").read_text()
    assert signed.string_to_sign == (expected / "header-string-to-sign.txt").read_text()
    assert signed.signature == (expected / "header-signature.txt").read_text().strip()
    wanted = next(
        line.partition(":")[2]
        for line in (expected / "header-signed-request.txt").read_text().split("\n")
        if line.lower().startswith("authorization:")
    )
    # The suite separates the three fields with ", ", nexa with "," (as the S3 documentation's
    # examples do); AWS accepts both. Everything else must be identical.
    assert signed.headers["authorization"] == wanted.replace(", ", ",")


def test_every_published_case_is_here() -> None:
    """The fixture folder holds the suite's v4 cases (so a lost folder cannot pass silently): all
    38 of them but `post-sts-header-after` (an unsigned header added after signing: see README)."""
    assert len(CASES) == 37
    assert {"get-vanilla-query-order-encoded", "get-utf8", "post-x-www-form-urlencoded-parameters"} <= set(CASES)


# --- the S3 style and the query string ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw_path", "s3", "generic"),
    [
        ("/bucket/a//b/./c", "/bucket/a//b/./c", "/bucket/a/b/c"),
        ("/bucket/sp%20ace", "/bucket/sp%20ace", "/bucket/sp%2520ace"),
        ("/bucket/x/../y", "/bucket/x/../y", "/bucket/y"),
        ("", "/", "/"),
    ],
)
def test_s3_style_signs_the_path_as_sent(raw_path: str, s3: str, generic: str) -> None:
    """S3 keys may hold `//`, `.` and `..`: S3 style neither normalises nor encodes twice."""
    assert canonical_uri(raw_path, S3_STYLE) == s3
    assert canonical_uri(raw_path, GENERIC_STYLE) == generic


@pytest.mark.parametrize(
    ("raw_query", "canonical"),
    [
        ("uploads", "uploads="),
        ("uploadId=abc%2Fdef&partNumber=2", "partNumber=2&uploadId=abc%2Fdef"),
        ("b=2&a=2&a=1", "a=1&a=2&b=2"),
        ("k=a+b&k2=a%20b&k3=caf%C3%A9", "k=a%2Bb&k2=a%20b&k3=caf%C3%A9"),
        ("list-type=2&prefix=models/llama/", "list-type=2&prefix=models%2Fllama%2F"),
        ("", ""),
    ],
)
def test_canonical_query_string(raw_query: str, canonical: str) -> None:
    assert canonical_query(raw_query) == canonical


def test_s3_request_signs_its_content_hash() -> None:
    """S3 style adds `x-amz-content-sha256` and signs it; the query is part of the signature."""
    creds = S3Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    now = datetime.datetime(2015, 8, 30, 12, 36, tzinfo=datetime.UTC)
    common: dict[str, Any] = {
        "method": "POST",
        "host": "127.0.0.1:8333",
        "raw_path": "/bucket/key",
        "payload_sha256": EMPTY_PAYLOAD_SHA256,
        "credentials": creds,
        "region": "us-east-1",
        "now": now,
    }
    plain = sign_request(**common)
    uploads = sign_request(**common, raw_query="uploads")
    assert plain.headers["x-amz-content-sha256"] == EMPTY_PAYLOAD_SHA256
    assert "x-amz-content-sha256" in plain.headers["authorization"]
    assert plain.canonical_request.split("\n")[2] == ""
    assert uploads.canonical_request.split("\n")[2] == "uploads="
    assert plain.signature != uploads.signature
