"""The controller's own checks against the outside world: OCI registry manifests and S3 artifacts.

The one httpx home in the controller. `Outbound.check_image` asks the image's registry whether it
holds the manifest with that digest (`HEAD /v2/<repo>/manifests/<digest>`, basic auth or the
bearer-token flow registries ask for with a 401 challenge). `Outbound.verify_artifact` streams a
model artifact from the S3-compatible store, hashing and counting it, stopping as soon as more
bytes than declared arrive; nothing is written to disk. Network failures become `Unavailable`
(retryable); answers that contradict the claim become `VerificationFailed` subclasses or
`ArtifactDigestMismatch`. Credentials are never logged, and never sent to anyone but the
registry's own token service or the configured store.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Final, cast

import attrs
import httpx
import trio

from nexa.config import ArtifactStoreConfig, OciConfig
from nexa.contracts.models import ImagePlatform, ModelArtifact
from nexa.errors import (
    ArtifactDigestMismatch,
    ArtifactMissing,
    ArtifactSizeMismatch,
    DigestUnknown,
    ManifestInvalid,
    Unavailable,
)
from nexa.oci import (
    MANIFEST_MEDIA_TYPES,
    MAX_MANIFEST_BYTES,
    ImageReference,
    RegistryCredentials,
    parse_config_platform,
    parse_image_reference,
    parse_manifest,
)
from nexa.s3 import S3Credentials, error_code, object_url, raw_chunks, signed_headers_for, split_s3_uri

log = logging.getLogger(__name__)

#: httpx guards single socket operations; the caller's cancel scope bounds a whole verification.
CONNECT_TIMEOUT_S: Final = 10.0
READ_TIMEOUT_S: Final = 60.0
#: Received bytes are hashed in a worker thread once this much has arrived, so the event loop
#: (which also serves the gateway) never hashes a large artifact itself.
HASH_BLOCK_BYTES: Final = 4 * 1024 * 1024
_CHALLENGE_PARAM_RE: Final = re.compile(r'([A-Za-z][A-Za-z0-9_-]*)\s*=\s*"([^"]*)"')


@attrs.frozen(kw_only=True)
class ManifestCheck:
    """The registry holds this manifest."""

    image: str
    digest: str
    media_type: str
    #: What the index or the manifest's config names; empty when an index names none.
    platforms: list[ImagePlatform] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class ArtifactCheck:
    """The store served exactly the declared bytes."""

    sha256: str
    size_bytes: int
    seconds: float


@attrs.frozen(kw_only=True)
class Challenge:
    """A parsed `WWW-Authenticate` header: the scheme (lower-case) and its parameters."""

    scheme: str
    params: dict[str, str]


def parse_challenge(header: str) -> Challenge:
    scheme, _, rest = header.strip().partition(" ")
    return Challenge(scheme=scheme.lower(), params={k.lower(): v for k, v in _CHALLENGE_PARAM_RE.findall(rest)})


class Outbound:
    """Use as `async with Outbound(...) as outbound:`; it owns two httpx clients and starts no tasks.

    The registry client follows `oci.tls_verify`; the store client follows `artifacts.s3_tls_verify`.
    """

    def __init__(
        self,
        oci: OciConfig,
        artifacts: ArtifactStoreConfig,
        *,
        registry_credentials: RegistryCredentials | None,
        s3_credentials: S3Credentials | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._oci = oci
        self._artifacts = artifacts
        self._registry_credentials = registry_credentials
        self._s3_credentials = s3_credentials
        self._transport = transport
        self._registry: httpx.AsyncClient | None = None
        self._store: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Outbound:
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        common = {"transport": self._transport, "timeout": timeout, "follow_redirects": False, "trust_env": False}
        self._registry = httpx.AsyncClient(verify=self._oci.tls_verify, **common)  # type: ignore[arg-type]
        self._store = httpx.AsyncClient(verify=self._artifacts.s3_tls_verify, **common)  # type: ignore[arg-type]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in (self._registry, self._store):
            if client is not None:
                await client.aclose()
        self._registry = self._store = None

    # --- OCI registry -----------------------------------------------------------------------------

    def manifest_url(self, ref: ImageReference) -> str:
        """HTTPS, except for a loopback registry when `oci.tls_verify` is off (a test registry)."""
        scheme = "http" if not self._oci.tls_verify and ref.loopback else "https"
        return f"{scheme}://{ref.registry}/v2/{ref.repository}/manifests/{ref.digest}"

    async def check_image(self, image: str) -> ManifestCheck:
        """Confirm the image's registry holds the manifest with its digest, and read its platforms.

        The manifest is fetched (`GET`) and its bytes must hash to the digest. An index (OCI or
        Docker manifest list) names its platforms; a single manifest's config blob (fetched and
        hashed too) names its one platform. Raises ContractError for a reference not pinned by
        digest, DigestUnknown when the registry answers that it has no such manifest (or
        repository, or config), ManifestInvalid when what it serves is not that manifest,
        Unavailable when the registry cannot be reached or refuses our credentials.
        """
        client = self._open(self._registry)
        ref = parse_image_reference(image)
        url = self.manifest_url(ref)
        headers = {"Accept": ", ".join(MANIFEST_MEDIA_TYPES)}
        try:
            response, body = await _get_capped(client, url, headers, image)
            if response.status_code == 401:
                headers["Authorization"] = await self._authorization(client, ref, response)
                response, body = await _get_capped(client, url, headers, image)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the registry {ref.registry} did not answer ({type(exc).__name__})") from exc
        self._refused(response, ref, image, f"manifest {ref.digest} in {ref.repository}")
        served = response.headers.get("docker-content-digest", ref.digest)
        if served != ref.digest:
            # A registry that answers a digest request with another manifest cannot be trusted.
            raise DigestUnknown(
                f"the registry {ref.registry} answered {ref.repository}@{ref.digest} with {served}", image=image
            )
        if _sha256(body) != ref.digest:
            raise ManifestInvalid(
                f"the registry {ref.registry} served bytes for {ref.repository}@{ref.digest} that have another digest",
                image=image,
            )
        header_type = response.headers.get("content-type", "").partition(";")[0].strip()
        parsed = parse_manifest(body, header_type, image=image)
        platforms = parsed.platforms
        if parsed.config_digest is not None:
            auth = {"Authorization": headers["Authorization"]} if "Authorization" in headers else {}
            platforms = [await self._config_platform(client, ref, parsed.config_digest, auth, image)]
        media_type = header_type or parsed.media_type
        log.info(
            "registry %s holds %s@%s (%s; %s)",
            ref.registry,
            ref.repository,
            ref.digest,
            media_type,
            ", ".join(map(str, platforms)) or "no platform named",
        )
        return ManifestCheck(image=image, digest=ref.digest, media_type=media_type, platforms=platforms)

    async def _config_platform(
        self, client: httpx.AsyncClient, ref: ImageReference, digest: str, headers: dict[str, str], image: str
    ) -> ImagePlatform:
        """Fetch a single manifest's config blob (registries may redirect to their storage), check its digest."""
        url = self.manifest_url(ref).rsplit("/manifests/", 1)[0] + f"/blobs/{digest}"
        try:
            # httpx drops the Authorization header when a redirect leaves the registry's origin.
            response, body = await _get_capped(client, url, headers, image, follow_redirects=True)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the registry {ref.registry} did not answer ({type(exc).__name__})") from exc
        self._refused(response, ref, image, f"config blob {digest} in {ref.repository}")
        if _sha256(body) != digest:
            raise ManifestInvalid(
                f"the registry {ref.registry} served a config for {ref.repository}@{ref.digest} with another digest",
                image=image,
            )
        return parse_config_platform(body, image=image)

    def _refused(self, response: httpx.Response, ref: ImageReference, image: str, what: str) -> None:
        """Raise for anything but 200: DigestUnknown for 404, Unavailable otherwise."""
        status = response.status_code
        if status == 200:
            return
        if status == 404:
            raise DigestUnknown(f"the registry {ref.registry} has no {what}", image=image)
        if status in {401, 403}:
            hint = "" if self._registry_credentials else " (no oci.credentials_file is configured)"
            raise Unavailable(f"the registry {ref.registry} refused access to {ref.repository} ({status}){hint}")
        raise Unavailable(f"the registry {ref.registry} answered {status} for {what}")

    async def _authorization(self, client: httpx.AsyncClient, ref: ImageReference, response: httpx.Response) -> str:
        """The Authorization header a 401 asks for: Basic, or a bearer token from the registry's realm."""
        challenge = parse_challenge(response.headers.get("www-authenticate", ""))
        creds = self._registry_credentials
        if challenge.scheme == "basic":
            if creds is None:
                raise Unavailable(
                    f"the registry {ref.registry} requires credentials; set oci.credentials_file in the controller"
                )
            return _basic(creds)
        if challenge.scheme != "bearer" or not challenge.params.get("realm"):
            raise Unavailable(f"the registry {ref.registry} asked for an authentication scheme nexa does not speak")
        realm = httpx.URL(challenge.params["realm"])
        if realm.scheme != "https" and not (realm.scheme == "http" and not self._oci.tls_verify):
            raise Unavailable(f"the registry {ref.registry} named a token service that is not https")
        params = {"scope": challenge.params.get("scope") or f"repository:{ref.repository}:pull"}
        if challenge.params.get("service"):
            params["service"] = challenge.params["service"]
        headers = {"Authorization": _basic(creds)} if creds else {}
        answer = await client.get(realm, params=params, headers=headers)
        if answer.status_code != 200:
            hint = "" if creds else "; it may need credentials (no oci.credentials_file is configured)"
            raise Unavailable(f"the token service of {ref.registry} refused a token ({answer.status_code}){hint}")
        try:
            data = answer.json()
            token = data.get("token") or data.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise Unavailable(f"the token service of {ref.registry} answered without a token")
        return f"Bearer {token}"

    # --- S3-compatible store --------------------------------------------------------------------

    async def verify_artifact(self, artifact: ModelArtifact) -> ArtifactCheck:
        """Stream the object, hash and count it; return only when sha256 and size both match.

        Raises ArtifactMissing (no such object or bucket), ArtifactSizeMismatch (more or fewer
        bytes than declared: the stream stops at the first byte too many), ArtifactDigestMismatch
        (other bytes), Unavailable (the store cannot be reached or refuses us).
        """
        client = self._open(self._store)
        if not self._artifacts.s3_endpoint:
            raise Unavailable("models cannot be verified: no S3 endpoint is configured (artifacts.s3_endpoint)")
        bucket, key = split_s3_uri(artifact.uri)
        url = object_url(self._artifacts.s3_endpoint, bucket, key)
        # identity: the digest is over the stored bytes, so nothing may decode them on the way.
        headers = {"accept-encoding": "identity"}
        if self._s3_credentials is not None:
            headers = signed_headers_for(
                "GET", url, credentials=self._s3_credentials, region=self._artifacts.s3_region, headers=headers
            )
        started = time.monotonic()
        try:
            async with client.stream("GET", url, headers=headers) as response:
                if response.status_code != 200:
                    raise await self._refusal(response, artifact)
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) != artifact.size_bytes:
                    raise ArtifactSizeMismatch(
                        f"{artifact.uri}: the store holds {int(declared)} bytes, the model declares "
                        f"{artifact.size_bytes}"
                    )
                sha256, received = await _digest(response, artifact)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the S3 store did not answer for {artifact.uri} ({type(exc).__name__})") from exc
        if received != artifact.size_bytes:
            raise ArtifactSizeMismatch(
                f"{artifact.uri}: the store sent {received} bytes, the model declares {artifact.size_bytes}"
            )
        if sha256 != artifact.sha256:
            raise ArtifactDigestMismatch(
                f"{artifact.uri}: the bytes have sha256 {sha256}, the model declares {artifact.sha256}"
            )
        seconds = time.monotonic() - started
        log.info("artifact %s verified: %d bytes in %.2f s", artifact.sha256, received, seconds)
        return ArtifactCheck(sha256=sha256, size_bytes=received, seconds=seconds)

    async def _refusal(self, response: httpx.Response, artifact: ModelArtifact) -> Exception:
        code = await error_code(response)
        status = f"{response.status_code} {code}"
        log.warning("S3 store answered %s for %s", status, artifact.uri)
        if code in {"NoSuchKey", "NoSuchBucket"} or response.status_code == 404:
            return ArtifactMissing(f"{artifact.uri} does not exist in the S3 store ({status})", uri=artifact.uri)
        if code in {"SignatureDoesNotMatch", "InvalidAccessKeyId"} or response.status_code == 403:
            hint = "" if self._s3_credentials else ": no artifacts.s3_credentials_file is configured"
            return Unavailable(f"the S3 store refused the controller's request for {artifact.uri} ({status}){hint}")
        return Unavailable(f"the S3 store failed to serve {artifact.uri} ({status})")

    @staticmethod
    def _open(client: httpx.AsyncClient | None) -> httpx.AsyncClient:
        if client is None:
            raise RuntimeError("Outbound is not open: use `async with`")
        return client


async def _digest(response: httpx.Response, artifact: ModelArtifact) -> tuple[str, int]:
    """sha256 and length of the body, hashed block by block in a worker thread."""
    hasher = hashlib.sha256()
    received = 0
    block: list[bytes] = []
    block_bytes = 0
    async with aclosing(raw_chunks(response)) as chunks:
        async for chunk in chunks:
            received += len(chunk)
            if received > artifact.size_bytes:
                raise ArtifactSizeMismatch(
                    f"{artifact.uri}: the store sent more than the declared {artifact.size_bytes} bytes; stopped"
                )
            block.append(chunk)
            block_bytes += len(chunk)
            if block_bytes >= HASH_BLOCK_BYTES:
                await trio.to_thread.run_sync(_update, hasher, block)
                block, block_bytes = [], 0
    if block:
        await trio.to_thread.run_sync(_update, hasher, block)
    return hasher.hexdigest(), received


def _update(hasher: hashlib._Hash, block: list[bytes]) -> None:
    for chunk in block:
        hasher.update(chunk)  # releases the GIL for large buffers


async def _get_capped(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], image: str, *, follow_redirects: bool = False
) -> tuple[httpx.Response, bytes]:
    """GET, reading at most MAX_MANIFEST_BYTES of the body (ManifestInvalid beyond that)."""
    async with client.stream("GET", url, headers=headers, follow_redirects=follow_redirects) as response:
        if response.status_code != 200:
            return response, b""
        chunks: list[bytes] = []
        size = 0
        # httpx's iterator is an async generator: close it here, not when trio finalizes it.
        async with aclosing(cast("AsyncGenerator[bytes, None]", response.aiter_bytes())) as body:
            async for chunk in body:
                size += len(chunk)
                if size > MAX_MANIFEST_BYTES:
                    raise ManifestInvalid(
                        f"the registry served more than {MAX_MANIFEST_BYTES} bytes for a manifest of {image}",
                        image=image,
                    )
                chunks.append(chunk)
    return response, b"".join(chunks)


def _sha256(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _basic(creds: RegistryCredentials) -> str:
    return "Basic " + base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode("ascii")
