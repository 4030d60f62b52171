"""The controller's own checks against the outside world: OCI registry manifests and S3 artifacts.

The controller's httpx home for the registry; the S3-compatible store is asked through
`nexa.s3.client.S3Client` (the one S3 client), whose failures are worded here. `Outbound.check_image`
asks the image's registry whether it holds the manifest with that digest
(`HEAD /v2/<repo>/manifests/<digest>`, basic auth or the bearer-token flow registries ask for
with a 401 challenge). `Outbound.verify_artifact` streams a model artifact from the
S3-compatible store, hashing and counting it, stopping as soon as more bytes than declared
arrive; nothing is written to disk. Network failures become `Unavailable`
(retryable); answers that contradict the claim become `VerificationFailed` subclasses or
`ArtifactDigestMismatch`. Credentials are never logged, and never sent to anyone but the
configured store and the registry they are configured for (`oci.RegistryAuths`): a token service
on another host gets them only when the credentials file names it (`token_realms`).

Redirects: a manifest or token request follows a redirect only on the host it was sent to (with
its Authorization); one to another host is refused (`RegistryAnswerRefused`). A config blob
(content-addressed, its bytes checked against the digest) follows a redirect to another host, as
registries send blobs to their storage, but without the Authorization header. Token answers,
manifests and configs are read up to a bound.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Final, cast

import attrs
import httpx
import trio

from nexa.config import ArtifactStoreConfig, OciConfig
from nexa.contracts.bounds import declared_bytes
from nexa.contracts.hosts import is_loopback_host
from nexa.contracts.models import ImageConfig, ImagePlatform, ModelArtifact
from nexa.errors import (
    ArtifactDigestMismatch,
    ArtifactMissing,
    ArtifactRefused,
    ArtifactSizeMismatch,
    ArtifactUnavailable,
    DigestUnknown,
    ManifestInvalid,
    RegistryAnswerRefused,
    Unavailable,
    VerificationFailed,
)
from nexa.oci import (
    MANIFEST_MEDIA_TYPES,
    MAX_MANIFEST_BYTES,
    ImageReference,
    RegistryAuths,
    RegistryCredentials,
    parse_image_config,
    parse_image_reference,
    parse_manifest,
    url_authority,
)
from nexa.s3.client import ObjectStream, S3Client, split_s3_uri
from nexa.s3.credentials import CredentialsSource
from nexa.supervision import all_or_first_failure

log = logging.getLogger(__name__)

#: httpx guards single socket operations; the caller's cancel scope bounds a whole verification.
CONNECT_TIMEOUT_S: Final = 10.0
READ_TIMEOUT_S: Final = 60.0
#: Received bytes are hashed in a worker thread once this much has arrived, so the event loop
#: (which also serves the gateway) never hashes a large artifact itself.
HASH_BLOCK_BYTES: Final = 4 * 1024 * 1024
#: A manifest's files are checked this many at a time (each a stream or a HEAD).
VERIFY_PARALLEL: Final = 4
#: A token service's answer is a small JSON document (a JWT or two); more is refused.
MAX_TOKEN_ANSWER_BYTES: Final = 64 * 1024
#: Redirects followed for one registry request.
MAX_REDIRECTS: Final = 5
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
_CHALLENGE_PARAM_RE: Final = re.compile(r'([A-Za-z][A-Za-z0-9_-]*)\s*=\s*"([^"]*)"')


@attrs.frozen(kw_only=True)
class ManifestCheck:
    """The registry holds this manifest."""

    image: str
    digest: str
    media_type: str
    #: What the index or the manifest's config names; empty when an index names none.
    platforms: list[ImagePlatform] = attrs.Factory(list)
    #: Each platform's image config (what runs: entrypoint, command, user, env, …), in `platforms`' order.
    configs: list[ImageConfig] = attrs.Factory(list)


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
    """Use as `async with Outbound(...) as outbound:`; it owns an httpx client for registries and
    an `S3Client` for the store, and starts no tasks. `transport` replaces both clients' HTTP
    transport (fault-injection tests).

    The registry client follows `oci.tls_verify`; the store client follows `artifacts.s3_tls_verify`.
    """

    def __init__(
        self,
        oci: OciConfig,
        artifacts: ArtifactStoreConfig,
        *,
        registry_credentials: RegistryAuths | Callable[[], RegistryAuths] | None,
        s3_credentials: CredentialsSource | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._oci = oci
        self._artifacts = artifacts
        self._registry_credentials = registry_credentials
        self._s3_credentials = s3_credentials
        self._transport = transport
        self._registry: httpx.AsyncClient | None = None
        self._store: S3Client | None = None

    async def __aenter__(self) -> Outbound:
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self._registry = httpx.AsyncClient(
            verify=self._oci.tls_verify,
            transport=self._transport,
            timeout=timeout,
            follow_redirects=False,
            trust_env=False,
        )
        store = S3Client(
            self._artifacts.s3_endpoint,
            region=self._artifacts.s3_region,
            credentials=self._s3_credentials,
            tls_verify=self._artifacts.s3_tls_verify,
            timeout_s=READ_TIMEOUT_S,
            trust_env=False,
            transport=self._transport,
        )
        self._store = await store.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._registry is not None:
            await self._registry.aclose()
        if self._store is not None:
            await self._store.__aexit__(*exc)
        self._registry = self._store = None

    # --- OCI registry -----------------------------------------------------------------------------

    def manifest_url(self, ref: ImageReference) -> str:
        """HTTPS, except for a loopback registry when `oci.tls_verify` is off (a test registry)."""
        scheme = "http" if not self._oci.tls_verify and ref.loopback else "https"
        return f"{scheme}://{ref.registry}/v2/{ref.repository}/manifests/{ref.digest}"

    def _credentials(self, ref: ImageReference) -> RegistryCredentials | None:
        """The credentials of `ref`'s registry, or None. Asked at each use: the file is re-read
        when it changed (`oci.registry_credentials`)."""
        source = self._registry_credentials
        auths = source() if callable(source) else source
        return None if auths is None else auths.for_registry(ref.registry)

    def _plain_http_allowed(self, url: httpx.URL) -> bool:
        """Plain HTTP only to a loopback host with `oci.tls_verify` off (as `manifest_url`)."""
        return not self._oci.tls_verify and is_loopback_host(url.host)

    async def _get_capped(
        self,
        client: httpx.AsyncClient,
        url: str | httpx.URL,
        headers: dict[str, str],
        *,
        registry: str,
        what: str,
        limit: int,
        too_large: Callable[[], Exception],
        params: dict[str, str] | None = None,
        cross_host: bool = False,
    ) -> tuple[httpx.Response, bytes]:
        """GET, following redirects by hand, reading at most `limit` bytes of a 200's body
        (`too_large()` is raised beyond). A redirect on the first request's host keeps the headers;
        one to another host is followed only with `cross_host`, and then without Authorization;
        otherwise RegistryAnswerRefused. Never from https to plain http, save to a test registry."""
        target = httpx.URL(url).copy_merge_params(params) if params else httpx.URL(url)
        origin = url_authority(target.host, target.port)
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", target, headers=headers, follow_redirects=False) as response:
                location = response.headers.get("location")
                if response.status_code in _REDIRECTS and location:
                    target = response.url.join(location)
                    authority = url_authority(target.host, target.port)
                    if target.scheme != "https" and not (target.scheme == "http" and self._plain_http_allowed(target)):
                        raise RegistryAnswerRefused(
                            f"the registry {registry} redirected {what} to {target.scheme}://{authority}, "
                            "which is not https; nexa follows registry redirects over https only",
                            registry=registry,
                        )
                    if authority != origin:
                        if not cross_host:
                            raise RegistryAnswerRefused(
                                f"the registry {registry} redirected {what} to another host ({authority}); "
                                "nexa follows such redirects only on the same host, so that no credential "
                                "leaves it: if that host serves the registry, name it in the image reference",
                                registry=registry,
                            )
                        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
                    continue
                if response.status_code != 200:
                    return response, b""
                declared = declared_bytes(response.headers.get("content-length"))
                if declared is not None and declared > limit:
                    raise too_large()  # refused before a byte of the body is read
                chunks: list[bytes] = []
                size = 0
                # httpx's iterator is an async generator: close it here, not when trio finalizes it.
                async with aclosing(cast("AsyncGenerator[bytes, None]", response.aiter_bytes())) as body:
                    async for chunk in body:
                        size += len(chunk)
                        if size > limit:
                            raise too_large()
                        chunks.append(chunk)
            return response, b"".join(chunks)
        raise RegistryAnswerRefused(
            f"the registry {registry} redirected {what} more than {MAX_REDIRECTS} times; "
            "check the registry's configuration",
            registry=registry,
        )

    async def _get_document(
        self,
        client: httpx.AsyncClient,
        url: str,
        headers: dict[str, str],
        ref: ImageReference,
        image: str,
        *,
        what: str,
        cross_host: bool = False,
    ) -> tuple[httpx.Response, bytes]:
        """GET a manifest or config blob, at most MAX_MANIFEST_BYTES (ManifestInvalid beyond)."""

        def too_large() -> Exception:
            return ManifestInvalid(
                f"the registry {ref.registry} served more than {MAX_MANIFEST_BYTES} bytes for the {what} "
                f"of {image}; registries refuse manifests that large, so check that the reference "
                "names the registry you mean",
                image=image,
            )

        return await self._get_capped(
            client,
            url,
            headers,
            registry=ref.registry,
            what=f"the {what} of {image}",
            limit=MAX_MANIFEST_BYTES,
            too_large=too_large,
            cross_host=cross_host,
        )

    async def check_image(self, image: str) -> ManifestCheck:
        """Confirm the image's registry holds the manifest with its digest, and read what each
        platform runs.

        The manifest is fetched (`GET`) and its bytes must hash to the digest. An index (OCI or
        Docker manifest list) names its platforms, and each platform's manifest is fetched by the
        digest the index names (hashed too); a single manifest is its one platform's. Each
        platform's config blob (fetched and hashed) gives its platform and what runs: entrypoint,
        command, user, env, working directory, exposed ports. Raises ContractError for a
        reference not pinned by digest, DigestUnknown when the registry answers that it has no
        such manifest (or repository, or config), ManifestInvalid when what it serves is not that
        manifest, RegistryAnswerRefused for a redirect to another host or a token answer over its
        bound, Unavailable when the registry cannot be reached or refuses our credentials.
        """
        client = self._open(self._registry)
        ref = parse_image_reference(image)
        headers = {"Accept": ", ".join(MANIFEST_MEDIA_TYPES)}
        response, body = await self._manifest(client, ref, ref.digest, headers, image)
        header_type = response.headers.get("content-type", "").partition(";")[0].strip()
        parsed = parse_manifest(body, header_type, image=image)
        auth = {"Authorization": headers["Authorization"]} if "Authorization" in headers else {}
        if parsed.config_digest is not None:
            configs = [await self._config(client, ref, parsed.config_digest, auth, image)]
            platforms = [configs[0].platform]
        else:
            platforms = parsed.platforms
            configs = []
            for platform, digest in parsed.manifests:
                _, one = await self._manifest(client, ref, digest, dict(headers), image)
                single = parse_manifest(one, "", image=image)
                if single.config_digest is None:
                    raise ManifestInvalid(f"the index of {image} names an index for {platform}", image=image)
                config = await self._config(client, ref, single.config_digest, auth, image)
                # The index's platform decides (a config may leave the variant out).
                configs.append(attrs.evolve(config, platform=platform))
        media_type = header_type or parsed.media_type
        log.info(
            "registry %s holds %s@%s (%s; %s)",
            ref.registry,
            ref.repository,
            ref.digest,
            media_type,
            ", ".join(map(str, platforms)) or "no platform named",
        )
        return ManifestCheck(
            image=image, digest=ref.digest, media_type=media_type, platforms=platforms, configs=configs
        )

    async def _manifest(
        self, client: httpx.AsyncClient, ref: ImageReference, digest: str, headers: dict[str, str], image: str
    ) -> tuple[httpx.Response, bytes]:
        """GET the manifest (or index) with `digest` (answering a 401 challenge into `headers`) and
        check that its bytes hash to it."""
        url = self.manifest_url(ref).rsplit("/manifests/", 1)[0] + f"/manifests/{digest}"
        try:
            response, body = await self._get_document(client, url, headers, ref, image, what="manifest")
            if response.status_code == 401:
                headers["Authorization"] = await self._authorization(client, ref, response)
                response, body = await self._get_document(client, url, headers, ref, image, what="manifest")
        except httpx.HTTPError as exc:
            raise Unavailable(f"the registry {ref.registry} did not answer ({type(exc).__name__})") from exc
        self._refused(response, ref, image, f"manifest {digest} in {ref.repository}")
        served = response.headers.get("docker-content-digest", digest)
        if served != digest:
            # A registry that answers a digest request with another manifest cannot be trusted.
            raise DigestUnknown(
                f"the registry {ref.registry} answered {ref.repository}@{digest} with {served}", image=image
            )
        if _sha256(body) != digest:
            raise ManifestInvalid(
                f"the registry {ref.registry} served bytes for {ref.repository}@{digest} that have another digest",
                image=image,
            )
        return response, body

    async def _config(
        self, client: httpx.AsyncClient, ref: ImageReference, digest: str, headers: dict[str, str], image: str
    ) -> ImageConfig:
        """Fetch a manifest's config blob (registries may redirect to their storage), check its digest."""
        url = self.manifest_url(ref).rsplit("/manifests/", 1)[0] + f"/blobs/{digest}"
        try:
            # Registries may send blobs to their storage: followed, without the Authorization header.
            response, body = await self._get_document(client, url, headers, ref, image, what="config", cross_host=True)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the registry {ref.registry} did not answer ({type(exc).__name__})") from exc
        self._refused(response, ref, image, f"config blob {digest} in {ref.repository}")
        if _sha256(body) != digest:
            raise ManifestInvalid(
                f"the registry {ref.registry} served a config for {ref.repository}@{ref.digest} with another digest",
                image=image,
            )
        return parse_image_config(body, image=image)

    def _refused(self, response: httpx.Response, ref: ImageReference, image: str, what: str) -> None:
        """Raise for anything but 200: DigestUnknown for 404, Unavailable otherwise."""
        status = response.status_code
        if status == 200:
            return
        if status == 404:
            raise DigestUnknown(f"the registry {ref.registry} has no {what}", image=image)
        if status in {401, 403}:
            hint = (
                ""
                if self._credentials(ref) is not None
                else f" (the controller has no credentials for {ref.registry}: add it under auths in the file "
                "oci.credentials_file names)"
            )
            raise Unavailable(f"the registry {ref.registry} refused access to {ref.repository} ({status}){hint}")
        raise Unavailable(f"the registry {ref.registry} answered {status} for {what}")

    async def _authorization(self, client: httpx.AsyncClient, ref: ImageReference, response: httpx.Response) -> str:
        """The Authorization header a 401 asks for: Basic, or a bearer token from the registry's
        realm. Only the credentials of `ref`'s registry are used, and they go to a realm on another
        host only when the credentials file names it (`token_realms`); else the token is asked
        for without them."""
        challenge = parse_challenge(response.headers.get("www-authenticate", ""))
        creds = self._credentials(ref)
        if challenge.scheme == "basic":
            if creds is None:
                raise Unavailable(
                    f"the registry {ref.registry} requires credentials and the controller has none for it: "
                    "add it under auths in the file oci.credentials_file names"
                )
            return _basic(creds)
        if challenge.scheme != "bearer" or not challenge.params.get("realm"):
            raise Unavailable(f"the registry {ref.registry} asked for an authentication scheme nexa does not speak")
        realm = httpx.URL(challenge.params["realm"])
        if realm.scheme != "https" and not (realm.scheme == "http" and not self._oci.tls_verify):
            raise Unavailable(f"the registry {ref.registry} named a token service that is not https")
        realm_host = url_authority(realm.host, realm.port)
        params = {"scope": challenge.params.get("scope") or f"repository:{ref.repository}:pull"}
        if challenge.params.get("service"):
            params["service"] = challenge.params["service"]
        headers: dict[str, str] = {}
        withheld = ""
        if creds is not None and creds.may_get_token_from(realm_host):
            headers["Authorization"] = _basic(creds)
        elif creds is not None:
            withheld = (
                f"; the credentials of {ref.registry} were not sent to the token service at {realm_host}: if it "
                f'is that registry\'s, add it to auths["{ref.registry}"].token_realms in oci.credentials_file'
            )
            log.warning(
                "registry %s names a token service on another host (%s) not in its token_realms; asking it "
                "for a token without credentials",
                ref.registry,
                realm_host,
            )

        def too_large() -> Exception:
            return RegistryAnswerRefused(
                f"the token service at {realm_host} (named by the registry {ref.registry}) answered with more "
                f"than {MAX_TOKEN_ANSWER_BYTES} bytes; a token answer is a small JSON document: check that the "
                "registry is the one you mean",
                registry=ref.registry,
            )

        answer, body = await self._get_capped(
            client,
            realm,
            headers,
            params=params,
            registry=ref.registry,
            what=f"a token request to {realm_host}",
            limit=MAX_TOKEN_ANSWER_BYTES,
            too_large=too_large,
        )
        if answer.status_code != 200:
            hint = withheld or (
                "" if creds else f"; it may need credentials (the controller has none for {ref.registry})"
            )
            raise Unavailable(f"the token service of {ref.registry} refused a token ({answer.status_code}){hint}")
        try:
            data = json.loads(body)
            token = data.get("token") or data.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise Unavailable(f"the token service of {ref.registry} answered without a token")
        return f"Bearer {token}"

    # --- S3-compatible store --------------------------------------------------------------------

    def artifact_problem(self, artifact: ModelArtifact) -> str | None:
        """Why the artifact lies outside `[artifacts] allowed_prefixes` (asked before the store is), or None."""
        return self._artifacts.artifact_problem(artifact.uri)

    async def verify_artifact(self, artifact: ModelArtifact) -> ArtifactCheck:
        """Stream every object of the artifact, hash and count it; return only when each file's
        sha256 and size match (a single object: the artifact's own).

        Files are checked `VERIFY_PARALLEL` at a time; the first failure stops the rest. Raises
        ArtifactMissing (no such object or bucket), ArtifactSizeMismatch (more or fewer bytes than
        declared: the stream stops at the first byte too many), ArtifactDigestMismatch (other
        bytes), Unavailable (the store cannot be reached or refuses us); for a manifest, each
        message names the file.
        """
        store = self._open_store()
        if not self._artifacts.s3_endpoint:
            raise Unavailable("models cannot be verified: no S3 endpoint is configured (artifacts.s3_endpoint)")
        started = time.monotonic()
        manifest = artifact.manifest()
        if not artifact.files:
            await self._verify_object(store, _Object(artifact.uri, artifact.sha256, artifact.size_bytes, ""))
        else:
            objects = [_Object(artifact.object_uri(f.path), f.sha256, f.size_bytes, f.path) for f in manifest.files]
            await self._each(objects, lambda o: self._verify_object(store, o))
        seconds = time.monotonic() - started
        log.info(
            "artifact %s verified: %d file(s), %d bytes in %.2f s",
            artifact.sha256,
            len(manifest.files),
            manifest.size_bytes,
            seconds,
        )
        return ArtifactCheck(sha256=artifact.sha256, size_bytes=manifest.size_bytes, seconds=seconds)

    async def check_artifact_objects(self, artifact: ModelArtifact) -> None:
        """Before a manifest is registered: the store holds every file, with the declared size.

        One HEAD per file, `VERIFY_PARALLEL` at a time. Raises ArtifactMissing or
        ArtifactSizeMismatch naming the field (`artifact.files[i]`) and the file, Unavailable when the
        store cannot be asked. Does nothing without a configured store (verification will need one).
        """
        store = self._open_store()
        if not self._artifacts.s3_endpoint or not artifact.files:
            return
        objects = [
            _Object(artifact.object_uri(f.path), f.sha256, f.size_bytes, f"artifact.files[{i}] ({f.path})")
            for i, f in enumerate(artifact.files)
        ]
        await self._each(objects, lambda o: self._head_object(store, o))

    async def read_head(self, uri: str, limit: int) -> bytes:
        """The first `limit` bytes of an object (all of it when smaller), asked for as a range (a
        store that sends more is cut off there). Raises ArtifactMissing or Unavailable as
        `verify_artifact` does."""
        store = self._open_store()
        if not self._artifacts.s3_endpoint:
            raise Unavailable("no S3 endpoint is configured (artifacts.s3_endpoint)")
        bucket, key = split_s3_uri(uri)
        head = bytearray()
        try:
            async with store.stream(bucket, key, end=limit - 1) as response, aclosing(response.chunks()) as chunks:
                received = 0
                async for chunk in chunks:
                    head += chunk[: limit - len(head)]
                    received += len(chunk)
                    # The range is read to its end; a store that ignored it, or sends more, is cut off.
                    if received > limit or (len(head) >= limit and response.status != 206):
                        break
        except (ArtifactRefused, ArtifactUnavailable) as exc:
            raise self._refusal(exc, _Object(uri, "", 0, "")) from None
        return bytes(head)

    async def _each(self, objects: list[_Object], check: Callable[[_Object], Awaitable[None]]) -> None:
        """Run `check` on every object, a few at a time; the first failure cancels the others and
        is raised alone (not as an exception group)."""
        await all_or_first_failure(
            objects, check, catch=(VerificationFailed, ArtifactDigestMismatch, Unavailable), limit=VERIFY_PARALLEL
        )

    async def _head_object(self, store: S3Client, obj: _Object) -> None:
        bucket, key = split_s3_uri(obj.uri)
        try:
            info = await store.head(bucket, key)
        except (ArtifactRefused, ArtifactUnavailable) as exc:
            raise self._refusal(exc, obj) from None
        if info is None:
            raise self._refusal(ArtifactRefused("", status=404, s3_code="Not Found"), obj)
        if info.size_bytes != obj.size_bytes:
            raise ArtifactSizeMismatch(
                f"{obj.name}: the store holds {info.size_bytes} bytes at {obj.uri}, the manifest says {obj.size_bytes}"
            )

    async def _verify_object(self, store: S3Client, obj: _Object) -> None:
        what = f"file {obj.name!r} ({obj.uri})" if obj.name else obj.uri
        declares = "the manifest declares" if obj.name else "the model declares"
        bucket, key = split_s3_uri(obj.uri)
        try:
            async with store.stream(bucket, key) as response:
                if response.status != 200:  # a part, though none was asked for
                    raise Unavailable(f"the S3 store failed to serve {obj.uri} ({response.status})")
                declared = declared_bytes(response.headers.get("content-length"))
                if declared is not None and declared != obj.size_bytes:
                    raise ArtifactSizeMismatch(f"{what}: the store holds {declared} bytes, {declares} {obj.size_bytes}")
                sha256, received = await _digest(response, obj, what)
        except (ArtifactRefused, ArtifactUnavailable) as exc:
            raise self._refusal(exc, obj) from None
        if received != obj.size_bytes:
            raise ArtifactSizeMismatch(f"{what}: the store sent {received} bytes, {declares} {obj.size_bytes}")
        if sha256 != obj.sha256:
            raise ArtifactDigestMismatch(f"{what}: the bytes have sha256 {sha256}, {declares} {obj.sha256}")

    def _refusal(self, exc: ArtifactRefused | ArtifactUnavailable, obj: _Object) -> Exception:
        """The controller's error for the store's refusal (or silence) about one object."""
        if exc.status is None:  # no answer, or it broke off
            return Unavailable(exc.message)
        status = f"{exc.status} {exc.s3_code}"
        uri = obj.uri
        log.warning("S3 store answered %s for %s", status, uri)
        where = f"{obj.name}: " if obj.name else ""
        if exc.s3_code in {"NoSuchKey", "NoSuchBucket"} or exc.status == 404:
            return ArtifactMissing(f"{where}{uri} does not exist in the S3 store ({status})", uri=uri)
        if exc.s3_code in {"SignatureDoesNotMatch", "InvalidAccessKeyId"} or exc.status == 403:
            hint = "" if self._s3_credentials else ": no artifacts.s3_credentials_file is configured"
            return Unavailable(f"the S3 store refused the controller's request for {uri} ({status}){hint}")
        return Unavailable(f"the S3 store failed to serve {uri} ({status})")

    def _open_store(self) -> S3Client:
        if self._store is None:
            raise RuntimeError("Outbound is not open: use `async with`")
        return self._store

    @staticmethod
    def _open(client: httpx.AsyncClient | None) -> httpx.AsyncClient:
        if client is None:
            raise RuntimeError("Outbound is not open: use `async with`")
        return client


@attrs.frozen
class _Object:
    """One object to check: where it is, what it must be, and how to name it (a manifest's file
    path or field; empty for a single-object artifact, named by its URI)."""

    uri: str
    sha256: str
    size_bytes: int
    name: str


async def _digest(response: ObjectStream, obj: _Object, what: str) -> tuple[str, int]:
    """sha256 and length of the body, hashed block by block in a worker thread."""
    hasher = hashlib.sha256()
    received = 0
    block: list[bytes] = []
    block_bytes = 0
    async with aclosing(response.chunks()) as chunks:
        async for chunk in chunks:
            received += len(chunk)
            if received > obj.size_bytes:
                raise ArtifactSizeMismatch(
                    f"{what}: the store sent more than the declared {obj.size_bytes} bytes; stopped"
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


def _sha256(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _basic(creds: RegistryCredentials) -> str:
    return "Basic " + base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode("ascii")
