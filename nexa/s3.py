"""S3-compatible object storage: credentials, AWS Signature Version 4 and `S3Client`, the one
S3 client of `nexa models push`, the node's artifact cache and the controller's verification.
This is the only module that builds an httpx client for S3.

Requests are signed by `nexa.sigv4.sign_v4`, a small pure function over the stdlib (`hmac`,
`hashlib`); the manual (`nexa docs models`, "Why nexa signs S3 requests itself") says why botocore is not used.
Credentials come from a file (JSON or the AWS shared-credentials INI, re-read when it changes)
or the standard AWS environment variables, and are never logged.

The public names (`__all__`) are nexa's own: no httpx type is taken or given, and every httpx
failure becomes a nexa error here. (`S3Client(transport=…)` is the one exception, a seam for
fault-injection tests, as in httpx.)
"""

from __future__ import annotations

import configparser
import datetime
import hashlib
import html
import json
import logging
import re
import ssl
import stat
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Final, TypeAlias, cast, final
from urllib.parse import quote

import attrs
import httpcore
import httpx
import trio

from nexa.config import WatchedFile
from nexa.errors import (
    ArtifactError,
    ArtifactRefused,
    ArtifactSizeMismatch,
    ArtifactUnavailable,
    ConfigError,
)
from nexa.security import write_key_file
from nexa.sigv4 import EMPTY_PAYLOAD_SHA256, UNSIGNED_PAYLOAD, S3Credentials, sign_v4

__all__ = [
    "CONNECT_TIMEOUT_S",
    "MAX_PARTS",
    "MIN_PART_BYTES",
    "S3_READ_BYTES",
    "CredentialsSource",
    "InjectedTransport",
    "ObjectInfo",
    "ObjectStream",
    "ProgressFn",
    "S3Client",
    "load_s3_credentials",
    "object_url",
    "s3_credentials",
    "signed_headers_for",
    "split_s3_uri",
    "write_s3_credentials",
]

log = logging.getLogger(__name__)

#: How much of an error answer is read to find its S3 error code.
_ERROR_BODY_LIMIT: Final = 64 * 1024
_S3_ERROR_CODE_RE: Final = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")


# --- credentials ----------------------------------------------------------------------------------


#: The standard variables read when no credentials file is configured (`s3_credentials`).
ENV_ACCESS_KEY_ID: Final = "AWS_ACCESS_KEY_ID"
ENV_SECRET_ACCESS_KEY: Final = "AWS_SECRET_ACCESS_KEY"  # noqa: S105 (a variable's name, not a secret)
ENV_SESSION_TOKEN: Final = "AWS_SESSION_TOKEN"  # noqa: S105
#: Credentials as `S3Client` takes them: fixed, or a function asked before each request (a file
#: re-read when it changes, `config.WatchedFile.current`).
CredentialsSource: TypeAlias = "S3Credentials | Callable[[], S3Credentials]"


def load_s3_credentials(path: str | Path, profile: str = "default") -> S3Credentials:
    """Read S3 credentials from `path`: JSON `{"access_key_id": …, "secret_access_key": …}` (a file
    that starts with `{`, or parses as JSON), else an AWS shared-credentials file (INI: `[profile]`
    with `aws_access_key_id`, `aws_secret_access_key`, optionally `aws_session_token`).

    Raises ConfigError naming the file and the problem (unreadable, not JSON or INI, no such
    profile, a missing, empty or unknown key); the message never quotes the file's content. Sync.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read S3 credentials file {path}: {exc.strerror}") from None
    credentials = _json_credentials(path, raw) if _is_json(raw) else _ini_credentials(path, raw, profile)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("S3 credentials file %s is readable by other users (mode %o); use 0600", path, mode & 0o777)
    return credentials


def _is_json(raw: bytes) -> bool:
    start = raw.lstrip()[:1]
    if start == b"{":
        return True
    if start != b"[":  # `[profile]` starts an INI file, and `[...]` a JSON array
        return False
    try:
        json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _json_credentials(path: Path, raw: bytes) -> S3Credentials:
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
    return S3Credentials(access_key_id=data["access_key_id"].strip(), secret_access_key=data["secret_access_key"])


def _ini_credentials(path: Path, raw: bytes, profile: str) -> S3Credentials:
    """The AWS CLI's shared-credentials format, read by `configparser` (no interpolation: a `%`
    in a secret is the secret's)."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(raw.decode("utf-8"), source=str(path))
    except (configparser.Error, UnicodeDecodeError) as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line is not None else ""
        raise ConfigError(
            f"S3 credentials file {path} is neither JSON nor an AWS shared-credentials (INI) file{where}"
        ) from None
    if not parser.has_section(profile):
        # The sections it has are not named: a mangled file could hold a secret in a header.
        raise ConfigError(f"S3 credentials file {path} has no profile [{profile}]; set artifacts.s3_profile")
    section = parser[profile]
    keys = ("aws_access_key_id", "aws_secret_access_key")
    problems = [f"[{profile}] {key} is missing or empty" for key in keys if not section.get(key, "").strip()]
    if problems:
        raise ConfigError(f"S3 credentials file {path}: " + "; ".join(problems), problems=tuple(problems))
    token = section.get("aws_session_token", "").strip() or None
    return S3Credentials(
        access_key_id=section["aws_access_key_id"].strip(),
        secret_access_key=section["aws_secret_access_key"].strip(),
        session_token=token,
    )


def s3_credentials(
    path: str,
    *,
    profile: str = "default",
    environ: Mapping[str, str],
    on_invalid: Callable[[], None] | None = None,
) -> CredentialsSource | None:
    """The credentials an S3 client should use, as config and the environment give them.

    A file (`path`): re-read whenever it changes; a file that turns invalid keeps the last good
    credentials (`config.WatchedFile`). No file: `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`
    (with `AWS_SESSION_TOKEN` if set), read once. Neither: None (anonymous requests). Raises
    ConfigError when the file is bad at start, or when only one of the two variables is set.
    Sync: call it off the event loop.
    """
    if path:
        return WatchedFile(path, partial(load_s3_credentials, profile=profile), on_invalid=on_invalid).current
    key_id = environ.get(ENV_ACCESS_KEY_ID, "").strip()
    secret = environ.get(ENV_SECRET_ACCESS_KEY, "").strip()
    if not key_id and not secret:
        return None
    if not (key_id and secret):
        present, missing = (
            (ENV_ACCESS_KEY_ID, ENV_SECRET_ACCESS_KEY) if key_id else (ENV_SECRET_ACCESS_KEY, ENV_ACCESS_KEY_ID)
        )
        raise ConfigError(f"{present} is set but {missing} is not; set both, or neither (then requests are anonymous)")
    token = environ.get(ENV_SESSION_TOKEN, "").strip() or None
    return S3Credentials(access_key_id=key_id, secret_access_key=secret, session_token=token)


def write_s3_credentials(path: Path, credentials: S3Credentials) -> Path:
    """Write `credentials` to `path` as `load_s3_credentials` reads them, owner-only (0600); `path`.
    For the local parts nexa starts itself (`nexa demo`, tests, benchmarks). Sync."""
    keys = {"access_key_id": credentials.access_key_id, "secret_access_key": credentials.secret_access_key}
    # Atomic (a reader, such as a running controller's `WatchedFile`, never sees half a file), 0600 from the start.
    write_key_file(path, json.dumps(keys).encode(), private=True, overwrite=True)
    return path


def object_url(endpoint: str, bucket: str, key: str) -> str:
    """The path-style URL of an object: `<endpoint>/<bucket>/<key>`, the key URI-encoded once."""
    return f"{endpoint.rstrip('/')}/{quote(bucket, safe='')}/{quote(key, safe='/')}"


def signed_headers_for(
    method: str,
    url: str,
    *,
    credentials: S3Credentials,
    region: str,
    payload_sha256: str = EMPTY_PAYLOAD_SHA256,
    headers: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """`sign_v4` for `url` with the current time (the host, path and query httpx will send)."""
    return _signed_headers(
        method, httpx.URL(url), credentials=credentials, region=region, payload_sha256=payload_sha256, headers=headers
    )


def _signed_headers(
    method: str,
    url: httpx.URL,
    *,
    credentials: S3Credentials,
    region: str,
    payload_sha256: str,
    headers: Mapping[str, str] | None,
) -> dict[str, str]:
    path, _, query = url.raw_path.decode("ascii").partition("?")
    return sign_v4(
        method=method,
        host=url.netloc.decode("ascii"),
        raw_path=path,
        raw_query=query,
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


def _raw_chunks(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """`aiter_raw()` typed as what it is (an async generator), so that `aclosing` accepts it."""
    return cast("AsyncGenerator[bytes, None]", response.aiter_raw())


async def _error_code(response: httpx.Response) -> str:
    """The S3 error code of a refused request (`NoSuchKey`, `SignatureDoesNotMatch`, …), read from
    at most 64 KiB of its body; the reason phrase when the body names none."""
    body = b""
    if response.is_stream_consumed:  # an answer made whole (a test's), or already streamed
        try:
            body = response.content[:_ERROR_BODY_LIMIT]
        except httpx.ResponseNotRead:
            body = b""
    else:
        async with aclosing(_raw_chunks(response)) as chunks:
            async for chunk in chunks:
                body += chunk
                if len(body) >= _ERROR_BODY_LIMIT:
                    break
    match = _S3_ERROR_CODE_RE.search(body)
    return match.group(1).decode("ascii") if match else response.reason_phrase or "error"


@final
class ObjectStream:
    """An answer of `S3Client.stream` (a 200 or a 206) whose body is still to be read.

    `headers` are the answer's, their names lower-case (`content-length`, `content-range`, …).
    """

    def __init__(
        self,
        uri: str,
        status: int,
        reason: str,
        headers: Mapping[str, str],
        body: Callable[[], AsyncGenerator[bytes, None]],
    ) -> None:
        self.uri = uri
        self.status = status
        self.reason = reason
        self.headers = headers
        self._body = body

    def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives, undecoded; a transport failure midway is ArtifactUnavailable
        naming the object. Use under `aclosing`, inside the `stream` block."""
        return self._body()


async def _body_chunks(response: httpx.Response, uri: str) -> AsyncGenerator[bytes, None]:
    try:
        async with aclosing(_raw_chunks(response)) as chunks:
            async for chunk in chunks:
                yield chunk
    except httpx.HTTPError as exc:
        raise ArtifactUnavailable(f"the S3 store did not answer for {uri} ({type(exc).__name__})") from None


# --- large socket reads ---------------------------------------------------------------------------

#: What one socket read of an S3 answer asks for. httpcore asks for 64 KiB, and at a few GB/s the
#: per-read cost (h11 event, httpx chunk, trio checkpoint) is what limits a download. On loopback
#: (`perf/artifacts.py`, 2 CPUs) 256 KiB reads took the node's fetch from ~56 % to ~70 % of
#: parallel curl, as 1 MiB reads did, but with a peak RSS of 55 MiB instead of 72 MiB: each
#: download holds a few received chunks, and a chunk is at most one read.
S3_READ_BYTES: Final = 256 * 1024
CONNECT_TIMEOUT_S: Final = 10.0
#: httpx's defaults (`httpx.Limits()`), for the connection pool built here.
_MAX_CONNECTIONS: Final = 100
_MAX_KEEPALIVE: Final = 20
_KEEPALIVE_EXPIRY_S: Final = 5.0


class _LargeReadStream(httpcore.AsyncNetworkStream):
    """A connection whose reads ask for at least `S3_READ_BYTES` (a read still returns what the
    socket holds, so small answers are not delayed)."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109 - httpcore's signature
        return await self._inner.read(max(max_bytes, S3_READ_BYTES), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 - httpcore's signature
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
    ) -> httpcore.AsyncNetworkStream:
        return _LargeReadStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> object:
        return self._inner.get_extra_info(info)


class _LargeReads(httpcore.AsyncNetworkBackend):
    """httpcore's trio backend (nexa runs under trio only), its connections `_LargeReadStream`s:
    httpcore's documented extension point for the network layer."""

    def __init__(self) -> None:
        self._inner = httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _LargeReadStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _LargeReadStream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def _large_read_transport(*, tls_verify: bool, trust_env: bool) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose connections read `S3_READ_BYTES` at a time.

    httpx has no public way to give its transport a network backend, so this replaces the
    transport's private connection pool (`_pool`) with one built on `_LargeReads`: the one
    private attribute used, here only. `tests/test_s3_client.py` fails if an httpx or httpcore
    upgrade drops it (a body of several MiB must arrive in reads larger than 64 KiB).
    """
    # trust_env: SSL_CERT_FILE and SSL_CERT_DIR name the CA certificates, as for any httpx client.
    ssl_context = httpx.create_ssl_context(verify=tls_verify, trust_env=trust_env)
    transport = httpx.AsyncHTTPTransport(verify=ssl_context)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=ssl_context,
        max_connections=_MAX_CONNECTIONS,
        max_keepalive_connections=_MAX_KEEPALIVE,
        keepalive_expiry=_KEEPALIVE_EXPIRY_S,
        network_backend=_LargeReads(),
    )
    return transport


# --- the client -----------------------------------------------------------------------------------

#: S3's smallest part, for every part of a multipart upload but the last; and its most parts.
MIN_PART_BYTES: Final = 5 * 1024**2
MAX_PARTS: Final = 10_000
#: How much of a file is read (in a worker thread) per chunk sent.
_FILE_CHUNK: Final = 1024**2
_XML_VALUE_RE: Final = re.compile(rb"<(UploadId|ETag)>([^<]{1,1024})</\1>")
#: Aborting a failed multipart upload, shielded: one small request; past this the store's own
#: lifecycle rules remove the parts.
_ABORT_TIMEOUT_S: Final = 10.0


@attrs.frozen
class ObjectInfo:
    """What a HEAD says about an object: its size, ETag (`"<md5>"`, or `"<md5>-N"` when it
    was uploaded in N parts) and user metadata (`x-amz-meta-<name>` → name, lower-case)."""

    size_bytes: int
    etag: str
    metadata: dict[str, str]


ProgressFn = Callable[[int], None]
#: What `S3Client(transport=…)` (and the callers that pass it on) take: an httpx transport, a seam
#: for fault-injection tests only. Production code never passes one.
InjectedTransport: TypeAlias = httpx.AsyncBaseTransport


def _ignore(_: int) -> None:
    pass


async def _file_chunks(path: Path, offset: int, length: int, on_bytes: ProgressFn) -> AsyncIterator[bytes]:
    """`length` bytes of `path` from `offset`, 1 MiB at a time: the body of an upload, never
    the whole file in memory. A file that shrank meanwhile fails the request."""
    try:
        f = await trio.open_file(path, "rb")
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc.strerror or exc}") from None
    async with f:
        await f.seek(offset)
        left = length
        while left:
            try:
                chunk = await f.read(min(_FILE_CHUNK, left))
            except OSError as exc:
                raise ArtifactError(f"cannot read {path}: {exc.strerror or exc}") from None
            if not chunk:
                raise ArtifactSizeMismatch(f"{path} shrank while it was being uploaded")
            left -= len(chunk)
            on_bytes(len(chunk))
            yield chunk


def _xml_values(body: bytes) -> dict[str, str]:
    """`UploadId` and `ETag` of an S3 XML answer (the only values read from one)."""
    return {m.group(1).decode("ascii"): html.unescape(m.group(2).decode("utf-8")) for m in _XML_VALUE_RE.finditer(body)}


def _failure(what: str, status: int, s3_code: str) -> ArtifactRefused | ArtifactUnavailable:
    """The error for an answer with `status`: refused for a 4xx, unavailable otherwise."""
    message = f"S3 {what}: {status} {s3_code}"
    if 400 <= status < 500:
        return ArtifactRefused(message, status=status, s3_code=s3_code)
    return ArtifactUnavailable(message, status=status, s3_code=s3_code)


def _query(**params: str | int) -> str:
    return "&".join(f"{quote(k, safe='')}={quote(str(v), safe='')}" if v != "" else k for k, v in params.items())


class S3Client:
    """The one S3 client: path-style requests to one endpoint, SigV4-signed (S3 style) with the
    credentials given (or asked for before each request), or unsigned (anonymous) without them.

    An async context manager that owns one `httpx.AsyncClient`, whose connections read
    `S3_READ_BYTES` at a time (`transport`, for fault-injection tests, replaces that). Every
    failure is a nexa error: `ArtifactRefused` for a 4xx, `ArtifactUnavailable` for a 5xx or a
    transport failure, both carrying the HTTP status and S3 error code (`status`, `s3_code`) so
    that callers word their own hints. Bodies are streamed, never read whole; credentials never
    appear in a message or a log line. `timeout_s` bounds each socket operation (connecting: at
    most `CONNECT_TIMEOUT_S`); callers bound a whole transfer with a cancel scope. Proxies from
    the environment are not used (the store is the operator's own).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        region: str = "us-east-1",
        credentials: CredentialsSource | None = None,
        tls_verify: bool = True,
        timeout_s: float = 60.0,
        trust_env: bool = True,
        transport: InjectedTransport | None = None,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.region = region
        self._credentials = credentials
        self.anonymous = credentials is None
        if transport is None:
            transport = _large_read_transport(tls_verify=tls_verify, trust_env=trust_env)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S)),
            transport=transport,
            follow_redirects=False,
            trust_env=trust_env,
        )

    async def __aenter__(self) -> S3Client:
        await self._http.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    # --- requests ---

    def _url(self, bucket: str, key: str, query: str = "") -> httpx.URL:
        url = object_url(self.endpoint, bucket, key)
        return httpx.URL(f"{url}?{query}" if query else url)

    def _headers(self, method: str, url: httpx.URL, payload_sha256: str, headers: Mapping[str, str]) -> dict[str, str]:
        if self._credentials is None:
            return dict(headers)
        source = self._credentials
        return _signed_headers(
            method,
            url,
            credentials=source if isinstance(source, S3Credentials) else source(),
            region=self.region,
            payload_sha256=payload_sha256,
            headers=headers,
        )

    async def _request(
        self,
        method: str,
        url: httpx.URL,
        *,
        what: str,
        payload_sha256: str = EMPTY_PAYLOAD_SHA256,
        headers: Mapping[str, str] | None = None,
        content: bytes | AsyncIterator[bytes] | None = None,
        ok: Sequence[int] = (200,),
    ) -> httpx.Response:
        """Send one request; return its (read) answer if its status is in `ok`, else raise."""
        sent = self._headers(method, url, payload_sha256, headers or {})
        try:
            request = self._http.build_request(method, url, headers=sent, content=content)
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ArtifactUnavailable(f"S3 {what}: cannot reach {self.endpoint}: {type(exc).__name__}") from None
        try:
            if response.status_code in ok:
                await response.aread()
                return response
            code = await _error_code(response) if method != "HEAD" else response.reason_phrase
        except httpx.HTTPError as exc:
            raise ArtifactUnavailable(f"S3 {what}: the answer broke off: {type(exc).__name__}") from None
        finally:
            await response.aclose()
        raise _failure(what, response.status_code, code)

    async def head(self, bucket: str, key: str) -> ObjectInfo | None:
        """The object's size, ETag and user metadata; None when there is no such object."""
        response = await self._request("HEAD", self._url(bucket, key), what=f"HEAD {bucket}/{key}", ok=(200, 404))
        if response.status_code == 404:
            return None
        metadata = {
            name.removeprefix("x-amz-meta-"): value
            for name, value in response.headers.items()
            if name.startswith("x-amz-meta-")
        }
        return ObjectInfo(
            size_bytes=int(response.headers.get("content-length", "0")),
            etag=response.headers.get("etag", ""),
            metadata=metadata,
        )

    @asynccontextmanager
    async def stream(self, bucket: str, key: str, *, start: int = 0, end: int = 0) -> AsyncIterator[ObjectStream]:
        """GET an object from byte `start` on, to byte `end` (included; 0: its last) (`Range`), its body
        streamed: read it with `ObjectStream.chunks` in the `async with`; leaving closes the answer.

        Gives the answer for a 200 or a 206 (a store may answer a range with the whole object:
        the caller checks which); the body is never decoded (`accept-encoding: identity`: a
        digest is over the stored bytes). Any other status raises `ArtifactRefused` (4xx) or
        `ArtifactUnavailable` (5xx) with its `status` and `s3_code`; no answer at all raises
        `ArtifactUnavailable` naming the object.
        """
        url = self._url(bucket, key)
        headers = {"accept-encoding": "identity"}
        if start or end:
            headers["range"] = f"bytes={start}-{end or ''}"
        uri = f"s3://{bucket}/{key}"
        try:
            request = self._http.build_request(
                "GET", url, headers=self._headers("GET", url, EMPTY_PAYLOAD_SHA256, headers)
            )
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ArtifactUnavailable(f"the S3 store did not answer for {uri} ({type(exc).__name__})") from None
        try:
            if response.status_code not in (200, 206):
                try:
                    code = await _error_code(response)
                except httpx.HTTPError:
                    code = response.reason_phrase or "error"
                raise _failure(f"GET {bucket}/{key}", response.status_code, code)
            yield ObjectStream(
                uri,
                response.status_code,
                response.reason_phrase,
                dict(response.headers.items()),
                partial(_body_chunks, response, uri),
            )
        finally:
            await response.aclose()

    async def put_bytes(
        self, bucket: str, key: str, data: bytes, *, content_type: str = "application/octet-stream"
    ) -> str:
        """Upload a small object held in memory (a manifest); returns its ETag."""
        sha256 = hashlib.sha256(data).hexdigest()
        headers = {"content-type": content_type, "x-amz-meta-sha256": sha256}
        response = await self._request(
            "PUT",
            self._url(bucket, key),
            what=f"PUT {bucket}/{key}",
            payload_sha256=sha256,
            headers=headers,
            content=data,
        )
        return str(response.headers.get("etag", ""))

    async def delete(self, bucket: str, key: str) -> None:
        """Delete an object (retention's purges); one that is not there is no error."""
        await self._request("DELETE", self._url(bucket, key), what=f"DELETE {bucket}/{key}", ok=(200, 204, 404))

    async def put_file(
        self,
        bucket: str,
        key: str,
        path: Path,
        *,
        size_bytes: int,
        sha256: str | None,
        on_bytes: ProgressFn = _ignore,
    ) -> str:
        """Upload a file in one PUT, streamed from disk; returns the ETag.

        `sha256` (the file's, computed beforehand) is the signed payload hash, so the store
        refuses bytes that changed since, and it is kept as `x-amz-meta-sha256`; None sends
        `UNSIGNED-PAYLOAD`.
        """
        headers = {"content-length": str(size_bytes), "content-type": "application/octet-stream"}
        if sha256:
            headers["x-amz-meta-sha256"] = sha256
        response = await self._request(
            "PUT",
            self._url(bucket, key),
            what=f"PUT {bucket}/{key}",
            payload_sha256=sha256 or UNSIGNED_PAYLOAD,
            headers=headers,
            content=_file_chunks(path, 0, size_bytes, on_bytes),
        )
        return str(response.headers.get("etag", ""))

    # --- multipart ---

    async def create_multipart(self, bucket: str, key: str, *, sha256: str | None = None) -> str:
        """Start a multipart upload (`POST ?uploads`); returns its upload id."""
        headers = {"content-type": "application/octet-stream"}
        if sha256:
            headers["x-amz-meta-sha256"] = sha256
        response = await self._request(
            "POST", self._url(bucket, key, "uploads"), what=f"create multipart {bucket}/{key}", headers=headers
        )
        upload_id = _xml_values(response.content).get("UploadId")
        if not upload_id:
            raise ArtifactUnavailable(f"S3 create multipart {bucket}/{key}: the answer names no UploadId")
        return upload_id

    async def upload_part(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        part_number: int,
        path: Path,
        *,
        offset: int,
        length: int,
        on_bytes: ProgressFn = _ignore,
    ) -> str:
        """Upload bytes `offset … offset+length` of `path` as part `part_number`; returns its ETag."""
        url = self._url(bucket, key, _query(partNumber=part_number, uploadId=upload_id))
        response = await self._request(
            "PUT",
            url,
            what=f"upload part {part_number} of {bucket}/{key}",
            payload_sha256=UNSIGNED_PAYLOAD,
            headers={"content-length": str(length)},
            content=_file_chunks(path, offset, length, on_bytes),
        )
        etag = str(response.headers.get("etag", ""))
        if not etag:
            raise ArtifactUnavailable(f"S3 upload part {part_number} of {bucket}/{key}: no ETag in the answer")
        return etag

    async def complete_multipart(self, bucket: str, key: str, upload_id: str, etags: Sequence[str]) -> str:
        """Join the parts (ETags in part order); returns the object's ETag."""
        body = "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{html.escape(etag)}</ETag></Part>"
            for n, etag in enumerate(etags, start=1)
        )
        data = f"<CompleteMultipartUpload>{body}</CompleteMultipartUpload>".encode()
        response = await self._request(
            "POST",
            self._url(bucket, key, _query(uploadId=upload_id)),
            what=f"complete multipart {bucket}/{key}",
            payload_sha256=hashlib.sha256(data).hexdigest(),
            headers={"content-type": "application/xml"},
            content=data,
        )
        # S3 may answer 200 and report the failure in the body.
        if b"<Error>" in response.content:
            match = _S3_ERROR_CODE_RE.search(response.content)
            code = match.group(1).decode("ascii") if match else "error"
            raise ArtifactUnavailable(f"S3 complete multipart {bucket}/{key}: {code}")
        return _xml_values(response.content).get("ETag", "")

    async def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        """Drop an unfinished multipart upload and its parts."""
        await self._request(
            "DELETE",
            self._url(bucket, key, _query(uploadId=upload_id)),
            what=f"abort multipart {bucket}/{key}",
            ok=(200, 204, 404),
        )

    async def put_file_multipart(
        self,
        bucket: str,
        key: str,
        path: Path,
        *,
        size_bytes: int,
        sha256: str | None,
        part_size: int,
        limiter: trio.CapacityLimiter | None = None,
        on_bytes: ProgressFn = _ignore,
    ) -> tuple[str, int]:
        """Upload a file as a multipart upload, its parts in parallel (each holding `limiter`);
        returns the ETag and the number of parts. Any failure, cancellation included, aborts the
        upload so that no parts are left behind."""
        if part_size < MIN_PART_BYTES:
            raise ConfigError(f"a part must hold at least {MIN_PART_BYTES} bytes (5 MiB), not {part_size}")
        count = max(1, -(-size_bytes // part_size))
        if count > MAX_PARTS:
            raise ConfigError(f"{path}: {count} parts of {part_size} bytes; S3 allows {MAX_PARTS}: use larger parts")
        limiter = limiter or trio.CapacityLimiter(4)
        upload_id = await self.create_multipart(bucket, key, sha256=sha256)
        etags = [""] * count

        async def one(n: int) -> None:
            offset = n * part_size
            async with limiter:
                etags[n] = await self.upload_part(
                    bucket,
                    key,
                    upload_id,
                    n + 1,
                    path,
                    offset=offset,
                    length=min(part_size, size_bytes - offset),
                    on_bytes=on_bytes,
                )

        try:
            async with trio.open_nursery() as nursery:
                for n in range(count):
                    nursery.start_soon(one, n)
            etag = await self.complete_multipart(bucket, key, upload_id, etags)
        except BaseException:
            with trio.move_on_after(_ABORT_TIMEOUT_S, shield=True):
                try:
                    await self.abort_multipart(bucket, key, upload_id)
                except ArtifactError as exc:
                    log.warning("could not abort the multipart upload of %s/%s: %s", bucket, key, exc.message)
            raise
        return etag, count
