"""S3-compatible object storage: credentials and AWS Signature Version 4, shared by the node's
artifact cache and the controller's artifact verification.

Requests are signed by `sign_v4`, a small pure function over the stdlib (`hmac`, `hashlib`).
botocore/boto3 are deliberately not used: they would add ~60 MB to the one-file binary for a
signed GET. Credentials come from a file and are never logged.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import re
import stat
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from pathlib import Path
from typing import Final, cast
from urllib.parse import quote

import attrs
import httpx

from nexa.errors import ConfigError

log = logging.getLogger(__name__)

#: sha256 of the empty string: the payload hash of a GET (S3 also accepts UNSIGNED-PAYLOAD).
EMPTY_PAYLOAD_SHA256: Final = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
UNSIGNED_PAYLOAD: Final = "UNSIGNED-PAYLOAD"
_ALGORITHM: Final = "AWS4-HMAC-SHA256"
#: How much of an error answer is read to find its S3 error code.
_ERROR_BODY_LIMIT: Final = 64 * 1024
_S3_ERROR_CODE_RE: Final = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")


# --- credentials ----------------------------------------------------------------------------------


@attrs.frozen
class S3Credentials:
    """An access key pair for the S3-compatible store. The secret never appears in a repr."""

    access_key_id: str
    secret_access_key: str = attrs.field(repr=lambda _: "'***'")


def load_s3_credentials(path: str | Path) -> S3Credentials:
    """Read `{"access_key_id": …, "secret_access_key": …}` from a JSON file.

    Raises ConfigError naming the file and the problem (unreadable, not JSON, a missing, empty
    or unknown key); the message never quotes the file's content. Sync: called once at start.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read S3 credentials file {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        # JSONDecodeError's message gives the position only, never the text around it.
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(f"S3 credentials file {path} is not valid JSON{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"S3 credentials file {path} must hold a JSON object")
    problems = [f"unknown key {key!r}" for key in sorted(data) if key not in {"access_key_id", "secret_access_key"}]
    for key in ("access_key_id", "secret_access_key"):
        value = data.get(key)
        if value is None:
            problems.append(f"{key} is missing")
        elif not isinstance(value, str) or not value.strip():
            problems.append(f"{key} must be a non-empty string")
    if problems:
        raise ConfigError(f"S3 credentials file {path}: " + "; ".join(problems), problems=tuple(problems))
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("S3 credentials file %s is readable by other users (mode %o); use 0600", path, mode & 0o777)
    return S3Credentials(access_key_id=data["access_key_id"].strip(), secret_access_key=data["secret_access_key"])


# --- AWS Signature Version 4 ------------------------------------------------------------------------


def canonical_request(
    *, method: str, raw_path: str, headers: Mapping[str, str], payload_sha256: str
) -> tuple[str, str]:
    """The SigV4 canonical request and its signed-headers list, for a request without a query.

    `raw_path` is the path exactly as sent, already URI-encoded once (S3 does not encode twice).
    Every header given is signed; names are lower-cased, values trimmed with inner runs of
    spaces folded to one.
    """
    canonical = {name.lower().strip(): " ".join(value.split()) for name, value in headers.items()}
    names = sorted(canonical)
    signed_headers = ";".join(names)
    lines = [method.upper(), raw_path, "", *(f"{name}:{canonical[name]}" for name in names), "", signed_headers]
    return "\n".join([*lines, payload_sha256]), signed_headers


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode("utf-8"), hashlib.sha256).digest()


def sign_v4(
    *,
    method: str,
    host: str,
    raw_path: str,
    headers: Mapping[str, str],
    payload_sha256: str,
    credentials: S3Credentials,
    region: str,
    now: datetime.datetime,
    service: str = "s3",
) -> dict[str, str]:
    """Sign one request with AWS Signature Version 4; return every header to send.

    The result holds `headers` plus `host`, `x-amz-date`, `x-amz-content-sha256` and
    `authorization`, all of them signed. `host` must be what the HTTP client sends (host, and
    `:port` unless it is the scheme's default). `payload_sha256` is the hex sha256 of the body,
    `EMPTY_PAYLOAD_SHA256` for a GET, or `UNSIGNED_PAYLOAD`. Pure: the clock is a parameter.
    """
    amz_date = now.astimezone(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    to_send = {
        **headers,
        "host": host,
        "x-amz-date": amz_date,
        "x-amz-content-sha256": payload_sha256,
    }
    creq, signed_headers = canonical_request(
        method=method, raw_path=raw_path, headers=to_send, payload_sha256=payload_sha256
    )
    scope = f"{day}/{region}/{service}/aws4_request"
    string_to_sign = "\n".join([_ALGORITHM, amz_date, scope, hashlib.sha256(creq.encode("utf-8")).hexdigest()])
    key = _hmac(("AWS4" + credentials.secret_access_key).encode("utf-8"), day)
    for part in (region, service, "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, string_to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
    to_send["authorization"] = (
        f"{_ALGORITHM} Credential={credentials.access_key_id}/{scope},"
        f"SignedHeaders={signed_headers},Signature={signature}"
    )
    return to_send


def object_url(endpoint: str, bucket: str, key: str) -> httpx.URL:
    """The path-style URL of an object: `<endpoint>/<bucket>/<key>`, the key URI-encoded once."""
    return httpx.URL(f"{endpoint.rstrip('/')}/{quote(bucket, safe='')}/{quote(key, safe='/')}")


def signed_headers_for(
    method: str,
    url: httpx.URL,
    *,
    credentials: S3Credentials,
    region: str,
    payload_sha256: str = EMPTY_PAYLOAD_SHA256,
    headers: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """`sign_v4` for an httpx URL with the current time (the host and path httpx will send)."""
    return sign_v4(
        method=method,
        host=url.netloc.decode("ascii"),
        raw_path=url.raw_path.decode("ascii"),
        headers=headers or {},
        payload_sha256=payload_sha256,
        credentials=credentials,
        region=region,
        now=datetime.datetime.now(datetime.UTC),
    )


def split_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/key` → ("bucket", "some/key")."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.lstrip("/")


def raw_chunks(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """`aiter_raw()` typed as what it is (an async generator), so that `aclosing` accepts it."""
    return cast("AsyncGenerator[bytes, None]", response.aiter_raw())


async def error_code(response: httpx.Response) -> str:
    """The S3 error code of a refused request (`NoSuchKey`, `SignatureDoesNotMatch`, …), read from
    at most 64 KiB of its body; the reason phrase when the body names none."""
    body = b""
    async with aclosing(raw_chunks(response)) as chunks:
        async for chunk in chunks:
            body += chunk
            if len(body) >= _ERROR_BODY_LIMIT:
                break
    match = _S3_ERROR_CODE_RE.search(body)
    return match.group(1).decode("ascii") if match else response.reason_phrase or "error"
