"""`S3Client`, the one S3 client of `nexa models push`, the node's artifact cache and the controller's
verification, and the signed requests it makes. With `nexa.s3.transport`, the only module that
builds an httpx client for S3.

Requests are signed by `nexa.sigv4.sign_v4`, a small pure function over the stdlib (`hmac`,
`hashlib`); the manual (`nexa docs models`, "Why nexa signs S3 requests itself") says why botocore is not used.
Credentials (`nexa.s3.credentials`) come from a file (JSON or the AWS shared-credentials INI,
re-read when it changes) or the standard AWS environment variables, and are never logged.

The public names (`__all__`) are nexa's own: no httpx type is taken or given, and every httpx
failure becomes a nexa error here. (`S3Client(transport=…)` is the one exception, a seam for
fault-injection tests, as in httpx.)
"""

from __future__ import annotations

import datetime
import hashlib
import html
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Final, TypeAlias, cast, final
from urllib.parse import quote

import attrs
import httpx
import trio

from nexa.errors import ArtifactError, ArtifactRefused, ArtifactSizeMismatch, ArtifactUnavailable, ConfigError
from nexa.s3.credentials import CredentialsSource
from nexa.s3.transport import large_read_transport
from nexa.sigv4 import EMPTY_PAYLOAD_SHA256, UNSIGNED_PAYLOAD, S3Credentials, sign_v4

__all__ = [
    "CONNECT_TIMEOUT_S",
    "MAX_PARTS",
    "MIN_PART_BYTES",
    "InjectedTransport",
    "ObjectInfo",
    "ObjectStream",
    "ProgressFn",
    "S3Client",
    "object_url",
    "signed_headers_for",
    "split_s3_uri",
]

log = logging.getLogger(__name__)

#: How much of an error answer is read to find its S3 error code.
_ERROR_BODY_LIMIT: Final = 64 * 1024
_S3_ERROR_CODE_RE: Final = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
#: How long connecting to the store may take (at most the client's `timeout_s`).
CONNECT_TIMEOUT_S: Final = 10.0


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
    `nexa.s3.transport.S3_READ_BYTES` at a time (`transport`, for fault-injection tests, replaces that). Every
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
            transport = large_read_transport(tls_verify=tls_verify, trust_env=trust_env)
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
