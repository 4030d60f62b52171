"""The controller's outbound checks, for what the real registry and store in the other tests do not do:
registries that demand basic auth or the bearer-token flow, a store that streams without a length.
These use httpx.MockTransport (fault injection); `test_models.py` covers the real servers.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator

import httpx
import pytest

from nexa.config import ArtifactStoreConfig, OciConfig
from nexa.contracts.models import ModelArtifact
from nexa.control.registry.outbound import MAX_TOKEN_ANSWER_BYTES, Outbound, parse_challenge
from nexa.errors import ArtifactSizeMismatch, ContractError, DigestUnknown, RegistryAnswerRefused, Unavailable
from nexa.oci import MANIFEST_MEDIA_TYPES, OCI_MANIFEST, RegistryAuths, RegistryCredentials, parse_image_reference
from tests.support.oci import config_blob, index_of, manifest_for, sha

MANIFEST = "application/vnd.oci.image.index.v1+json"
#: A two-platform index, its manifests and their configs: what the fake registry serves (by digest).
CONFIGS = [config_blob("amd64"), config_blob("arm64", "v8")]
MANIFESTS = [manifest_for(c) for c in CONFIGS]
INDEX_BODY = index_of(
    [
        (MANIFESTS[0], {"os": "linux", "architecture": "amd64"}),
        (MANIFESTS[1], {"os": "linux", "architecture": "arm64", "variant": "v8"}),
    ]
)
SERVED = {
    f"/v2/team/vllm/manifests/{sha(INDEX_BODY)}": (MANIFEST, INDEX_BODY),
    **{f"/v2/team/vllm/manifests/{sha(m)}": (OCI_MANIFEST, m) for m in MANIFESTS},
    **{f"/v2/team/vllm/blobs/{sha(c)}": ("application/octet-stream", c) for c in CONFIGS},
}
DIGEST = "sha256:" + hashlib.sha256(INDEX_BODY).hexdigest()
IMAGE = f"registry.example.com/team/vllm@{DIGEST}"
#: The realm is on another host: named in `token_realms`, it may be sent the credentials.
CREDS = RegistryAuths.of(
    RegistryCredentials(
        registry="registry.example.com",
        username="puller",
        password="pa55-word",
        token_realms=frozenset({"auth.example.com"}),
    )
)


@pytest.mark.parametrize(
    ("image", "registry", "repository", "loopback"),
    [
        (f"registry.example.com/team/vllm@{DIGEST}", "registry.example.com", "team/vllm", False),
        (f"127.0.0.1:5000/nexa/busybox:test@{DIGEST}", "127.0.0.1:5000", "nexa/busybox", True),
        (f"localhost/x@{DIGEST}", "localhost", "x", True),
        (f"busybox@{DIGEST}", "registry-1.docker.io", "library/busybox", False),
        (f"vllm/vllm-openai@{DIGEST}", "registry-1.docker.io", "vllm/vllm-openai", False),
        (f"docker.io/vllm/vllm-openai@{DIGEST}", "registry-1.docker.io", "vllm/vllm-openai", False),
    ],
)
def test_image_references_split_like_podman_does(image: str, registry: str, repository: str, loopback: bool) -> None:
    ref = parse_image_reference(image)
    assert (ref.registry, ref.repository, ref.digest, ref.loopback) == (registry, repository, DIGEST, loopback)


@pytest.mark.parametrize("image", ["busybox:latest", f"busybox@{DIGEST[:-1]}", "", f"Upper/Case@{DIGEST}"])
def test_references_without_a_digest_are_contract_errors(image: str) -> None:
    with pytest.raises(ContractError):
        parse_image_reference(image)


def test_challenges_parse() -> None:
    c = parse_challenge(
        'Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a:pull"'
    )
    assert c.scheme == "bearer"
    assert c.params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:a:pull",
    }
    assert parse_challenge('Basic realm="Registry"').scheme == "basic"


class FakeRegistry:
    """A registry that answers 401 with a challenge unless the request carries what it asked for."""

    def __init__(self, scheme: str, *, known: bool = True) -> None:
        self.scheme = scheme
        self.known = known
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        basic = "Basic " + base64.b64encode(b"puller:pa55-word").decode()
        if request.url.host == "auth.example.com":
            assert request.url.params["scope"] == "repository:team/vllm:pull"
            assert request.url.params["service"] == "registry.example.com"
            if request.headers.get("authorization") != basic:
                return httpx.Response(401)
            return httpx.Response(200, json={"token": "tok-123", "expires_in": 300})
        assert request.method == "GET"
        assert request.url.path in SERVED
        assert request.url.scheme == "https"
        if "/manifests/" in request.url.path:
            assert set(request.headers["accept"].split(", ")) == set(MANIFEST_MEDIA_TYPES)
        wanted = "Bearer tok-123" if self.scheme == "bearer" else basic
        if request.headers.get("authorization") != wanted:
            challenge = (
                'Bearer realm="https://auth.example.com/token",service="registry.example.com",'
                'scope="repository:team/vllm:pull"'
                if self.scheme == "bearer"
                else 'Basic realm="Registry Realm"'
            )
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        if not self.known:
            return httpx.Response(404)
        media_type, body = SERVED[request.url.path]
        return httpx.Response(
            200, headers={"Content-Type": media_type, "Docker-Content-Digest": sha(body)}, content=body
        )


def make(handler: httpx.MockTransport, creds: RegistryAuths | None = CREDS) -> Outbound:
    return Outbound(
        OciConfig(),
        ArtifactStoreConfig(s3_endpoint="https://s3.example.com"),
        registry_credentials=creds,
        s3_credentials=None,
        transport=handler,
    )


@pytest.mark.parametrize("scheme", ["bearer", "basic"])
async def test_a_401_challenge_is_answered_with_credentials(scheme: str) -> None:
    registry = FakeRegistry(scheme)
    async with make(httpx.MockTransport(registry)) as out:
        check = await out.check_image(IMAGE)
    assert (check.digest, check.media_type) == (DIGEST, MANIFEST)
    assert [str(p) for p in check.platforms] == ["linux/amd64", "linux/arm64/v8"]
    assert [str(c.platform) for c in check.configs] == ["linux/amd64", "linux/arm64/v8"]
    hosts = [r.url.host for r in registry.requests]
    # The index, then each platform's manifest and config blob, all with the one authorization.
    then = ["registry.example.com"] * 5
    if scheme == "bearer":
        assert hosts == ["registry.example.com", "auth.example.com", *then]
    else:
        assert hosts == ["registry.example.com", *then]


async def test_a_digest_unknown_behind_auth_is_still_digest_unknown() -> None:
    async with make(httpx.MockTransport(FakeRegistry("bearer", known=False))) as out:
        with pytest.raises(DigestUnknown):
            await out.check_image(IMAGE)


@pytest.mark.parametrize("scheme", ["bearer", "basic"])
async def test_without_credentials_the_refusal_says_what_to_configure(scheme: str) -> None:
    async with make(httpx.MockTransport(FakeRegistry(scheme)), creds=None) as out:
        with pytest.raises(Unavailable) as info:
            await out.check_image(IMAGE)
    assert "credentials" in info.value.message
    assert "pa55" not in info.value.message


async def test_a_registry_answering_another_digest_is_not_trusted() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Type": MANIFEST, "Docker-Content-Digest": "sha256:" + "cd" * 32})

    async with make(httpx.MockTransport(handler)) as out:
        with pytest.raises(DigestUnknown):
            await out.check_image(IMAGE)


# httpx leaves its inner stream iterator to the garbage collector when one stops early
# (encode/httpx#3686), as in the artifact test below.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx\\.:ResourceWarning")
async def test_a_streamed_token_answer_is_cut_off_at_its_bound() -> None:
    """Without a Content-Length the answer is read until the bound, then refused."""

    async def endless() -> AsyncIterator[bytes]:
        yield b'{"token": "'
        for _ in range(MAX_TOKEN_ANSWER_BYTES // 1024 + 1):
            yield b"x" * 1024

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "auth.example.com":
            return httpx.Response(200, content=endless())
        challenge = 'Bearer realm="https://auth.example.com/token",service="x"'
        return httpx.Response(401, headers={"WWW-Authenticate": challenge})

    async with make(httpx.MockTransport(handler)) as out:
        with pytest.raises(RegistryAnswerRefused, match=f"more than {MAX_TOKEN_ANSWER_BYTES} bytes"):
            await out.check_image(IMAGE)


async def test_a_token_service_over_plain_http_is_refused_when_tls_is_verified() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        challenge = 'Bearer realm="http://auth.example.com/token",service="x"'
        return httpx.Response(401, headers={"WWW-Authenticate": challenge})

    async with make(httpx.MockTransport(handler)) as out:
        with pytest.raises(Unavailable, match="not https"):
            await out.check_image(IMAGE)


# httpx's own inner async generator (under MockTransport) is finalized by trio with a ResourceWarning
# (encode/httpx#3686); the verifier closes its iterator itself, which is what the test checks.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx\\.:ResourceWarning")
async def test_an_artifact_streamed_without_a_length_is_cut_off_at_the_first_byte_too_many() -> None:
    sent: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        for _ in range(1000):
            sent.append(1)
            yield b"x" * 1024

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())  # chunked: no Content-Length

    declared = ModelArtifact(uri="s3://models/m.gguf", sha256=hashlib.sha256(b"x" * 4096).hexdigest(), size_bytes=4096)
    async with make(httpx.MockTransport(handler)) as out:
        with pytest.raises(ArtifactSizeMismatch, match="more than the declared"):
            await out.verify_artifact(declared)
    assert len(sent) < 10  # stopped reading: never pulled the rest of the stream


@pytest.mark.parametrize(
    ("location", "refusal"),
    [
        ("http://registry.example.com/v2/team/vllm/plain", "which is not https"),  # a downgrade
        ("/v2/team/vllm/again", "more than 5 times"),  # a loop on the registry's own host
    ],
)
async def test_a_manifest_redirect_to_plain_http_or_in_a_loop_is_refused(location: str, refusal: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(307, headers={"Location": location})

    async with make(httpx.MockTransport(handler)) as out:
        with pytest.raises(RegistryAnswerRefused, match=refusal):
            await out.check_image(IMAGE)
    assert all(r.url.scheme == "https" for r in seen)
    assert len(seen) <= 6
