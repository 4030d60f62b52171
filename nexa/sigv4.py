"""AWS Signature Version 4 (header-based), as S3 and every other AWS service verify it. Pure: the
clock is a parameter; stdlib only (`hmac`, `hashlib`, `urllib.parse`), no I/O.

`sign_request` gives every step (canonical request, string to sign, signature) so that the
published AWS test-suite vectors check each one (`tests/test_sigv4.py`); `sign_v4` is the S3
form that `nexa.s3` sends. The secret never appears in a repr or a message.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Final
from urllib.parse import quote, unquote

import attrs

#: sha256 of the empty string: the payload hash of a GET (S3 also accepts UNSIGNED-PAYLOAD).
EMPTY_PAYLOAD_SHA256: Final = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
UNSIGNED_PAYLOAD: Final = "UNSIGNED-PAYLOAD"
_ALGORITHM: Final = "AWS4-HMAC-SHA256"


@attrs.frozen
class S3Credentials:
    """An access key pair for the S3-compatible store. The secret never appears in a repr."""

    access_key_id: str
    secret_access_key: str = attrs.field(repr=lambda _: "'***'")
    #: A temporary credential's token (AWS_SESSION_TOKEN), sent signed as `x-amz-security-token`.
    session_token: str | None = attrs.field(default=None, repr=lambda v: "None" if v is None else "'***'")


# --- AWS Signature Version 4 ------------------------------------------------------------------------


@attrs.frozen
class SigningStyle:
    """How the canonical URI is made from the path as sent.

    S3 (`S3_STYLE`) signs the path exactly as sent: no normalisation (`a//b` and `./` are
    distinct keys) and no second encoding. Every other AWS service (`GENERIC_STYLE`, the style
    of the published test suite) removes dot segments and empty segments, then URI-encodes the
    path once more.
    """

    normalize_path: bool
    double_encode: bool


S3_STYLE: Final = SigningStyle(normalize_path=False, double_encode=False)
GENERIC_STYLE: Final = SigningStyle(normalize_path=True, double_encode=True)
#: RFC 3986 unreserved characters: never percent-encoded in a canonical request.
_UNRESERVED: Final = "-._~"


def _uri_encode(text: str, *, keep_slash: bool) -> str:
    return quote(text, safe=_UNRESERVED + ("/" if keep_slash else ""))


def _normalize(path: str) -> str:
    """RFC 3986 dot-segment removal plus collapsing of empty segments (`//`), as SigV4 does it."""
    kept: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if kept:
                kept.pop()
            continue
        kept.append(segment)
    trailing = path.endswith("/") and bool(kept)
    return "/" + "/".join(kept) + ("/" if trailing else "")


def canonical_uri(raw_path: str, style: SigningStyle = S3_STYLE) -> str:
    """The canonical URI of `raw_path`, the path exactly as sent (already URI-encoded once)."""
    path = raw_path or "/"
    if style.normalize_path:
        path = _normalize(path)
    return _uri_encode(path, keep_slash=True) if style.double_encode else path


def canonical_query(raw_query: str) -> str:
    """The canonical query string: each name and value decoded once, RFC 3986-encoded again
    (`+` stays a literal plus), sorted by name then value; a bare name is `name=` (`?uploads`)."""
    pairs = []
    for item in raw_query.split("&"):
        if not item:
            continue
        name, _, value = item.partition("=")
        pairs.append((_uri_encode(unquote(name), keep_slash=False), _uri_encode(unquote(value), keep_slash=False)))
    return "&".join(f"{name}={value}" for name, value in sorted(pairs))


def _header_items(headers: Mapping[str, str] | Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    return list(headers.items()) if isinstance(headers, Mapping) else headers


def canonical_headers(headers: Mapping[str, str] | Sequence[tuple[str, str]]) -> tuple[str, str]:
    """The canonical header lines (each ending in a line break) and the signed-headers list.

    Names are lower-cased; values trimmed with inner runs of white space (line folds included)
    made one space; a name given more than once keeps its values in order, joined by commas.
    """
    merged: dict[str, list[str]] = {}
    for name, value in _header_items(headers):
        merged.setdefault(name.lower().strip(), []).append(" ".join(value.split()))
    names = sorted(merged)
    return "".join(f"{name}:{','.join(merged[name])}\n" for name in names), ";".join(names)


def canonical_request(
    *,
    method: str,
    raw_path: str,
    headers: Mapping[str, str] | Sequence[tuple[str, str]],
    payload_sha256: str,
    raw_query: str = "",
    style: SigningStyle = S3_STYLE,
) -> tuple[str, str]:
    """The SigV4 canonical request and its signed-headers list. Every header given is signed.

    `raw_path` and `raw_query` are exactly as sent (the query without its `?`).
    """
    header_lines, signed_headers = canonical_headers(headers)
    parts = [
        method.upper(),
        canonical_uri(raw_path, style),
        canonical_query(raw_query),
        header_lines,
        signed_headers,
        payload_sha256,
    ]
    return "\n".join(parts), signed_headers


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode("utf-8"), hashlib.sha256).digest()


@attrs.frozen
class SignedRequest:
    """A signature and the steps that made it (the test-suite vectors check each step)."""

    canonical_request: str
    string_to_sign: str
    signature: str
    #: Every header to send: the caller's, `host`, `x-amz-date`, maybe `x-amz-content-sha256`
    #: and `x-amz-security-token`, and `authorization`.
    headers: dict[str, str]


def sign_request(
    *,
    method: str,
    host: str,
    raw_path: str,
    raw_query: str = "",
    headers: Mapping[str, str] | Sequence[tuple[str, str]] = (),
    payload_sha256: str,
    credentials: S3Credentials,
    region: str,
    now: datetime.datetime,
    service: str = "s3",
    style: SigningStyle = S3_STYLE,
    content_sha256_header: bool = True,
    session_token: str | None = None,
) -> SignedRequest:
    """Sign one request with AWS Signature Version 4 (header-based). Pure: the clock is a parameter.

    `host` must be what the HTTP client sends (host, and `:port` unless it is the scheme's
    default). `payload_sha256` is the hex sha256 of the body, `EMPTY_PAYLOAD_SHA256` for no
    body, or `UNSIGNED_PAYLOAD`. S3 requires the `x-amz-content-sha256` header
    (`content_sha256_header`); other services take the hash in the canonical request only.
    """
    amz_date = now.astimezone(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    items = [*_header_items(headers), ("host", host), ("x-amz-date", amz_date)]
    if content_sha256_header:
        items.append(("x-amz-content-sha256", payload_sha256))
    if session_token is not None:
        items.append(("x-amz-security-token", session_token))
    creq, signed_headers = canonical_request(
        method=method,
        raw_path=raw_path,
        raw_query=raw_query,
        headers=items,
        payload_sha256=payload_sha256,
        style=style,
    )
    scope = f"{day}/{region}/{service}/aws4_request"
    string_to_sign = "\n".join([_ALGORITHM, amz_date, scope, hashlib.sha256(creq.encode("utf-8")).hexdigest()])
    key = _hmac(("AWS4" + credentials.secret_access_key).encode("utf-8"), day)
    for part in (region, service, "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, string_to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
    to_send: dict[str, str] = {}
    for name, value in items:
        # Repeated names are sent once, comma-joined, as they were signed.
        to_send[name] = f"{to_send[name]},{value}" if name in to_send else value
    to_send["authorization"] = (
        f"{_ALGORITHM} Credential={credentials.access_key_id}/{scope},"
        f"SignedHeaders={signed_headers},Signature={signature}"
    )
    return SignedRequest(canonical_request=creq, string_to_sign=string_to_sign, signature=signature, headers=to_send)


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
    raw_query: str = "",
) -> dict[str, str]:
    """`sign_request` in S3 style; returns every header to send, all of them signed."""
    return sign_request(
        method=method,
        host=host,
        raw_path=raw_path,
        raw_query=raw_query,
        headers=headers,
        payload_sha256=payload_sha256,
        credentials=credentials,
        region=region,
        now=now,
        service=service,
        session_token=credentials.session_token,
    ).headers
