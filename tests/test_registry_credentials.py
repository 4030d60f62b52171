"""Registry credentials go only to their registry: the controller's checks (`Outbound.check_image`)
and the node's pulls (podman's `X-Registry-Auth`), through real HTTP.

The parts: a real distribution registry that demands basic auth (`authed_oci_registry`, Debian
`docker-registry` with an htpasswd file) on 127.0.0.1, and a spy made here: one stdlib HTTP server
on 127.0.0.1 and one on 127.0.0.2 (a second host name on the loopback), which log the Authorization
header of every request and answer as each test scripts them (a hostile registry, a token service,
a storage host a blob is redirected to).
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import attrs
import pytest
import trio

from nexa.config import ArtifactStoreConfig, OciConfig
from nexa.control.registry.outbound import MAX_TOKEN_ANSWER_BYTES, Outbound
from nexa.errors import DigestUnknown, EngineError, ManifestInvalid, RegistryAnswerRefused, Unavailable
from nexa.node.engines.libpod import LibpodEngine
from nexa.oci import MAX_MANIFEST_BYTES, OCI_MANIFEST, RegistryAuths, registry_credentials
from tests.conftest import serving_http
from tests.realparts import AuthedRegistry, BuiltImages, PodmanService
from tests.support.oci import config_blob, manifest_for, push_index, sha

PLATFORMS = [{"os": "linux", "architecture": "amd64"}, {"os": "linux", "architecture": "arm64", "variant": "v8"}]


@attrs.frozen
class Seen:
    """One request a spy server received: on which of its addresses, the path, its Authorization."""

    server: str
    path: str
    authorization: str | None


Answer = tuple[int, dict[str, str], bytes]


@attrs.define
class Spy:
    """The two spy servers: `first` is 127.0.0.1:<port>, `second` 127.0.0.2:<port>. `answer` is
    asked for each request (default: 404)."""

    first: str = ""
    second: str = ""
    seen: list[Seen] = attrs.Factory(list)
    answer: Callable[[Seen], Answer] = lambda _seen: (404, {}, b"")
    lock: threading.Lock = attrs.Factory(threading.Lock)

    def at(self, server: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.server == server]


@pytest.fixture
def spy() -> Iterator[Spy]:
    found = Spy()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            address = self.server.server_address
            assert isinstance(address, tuple)
            seen = Seen(f"{address[0]}:{address[1]}", self.path, self.headers.get("Authorization"))
            with found.lock:
                found.seen.append(seen)
            status, headers, body = found.answer(seen)
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, format: str, *args: object) -> None:
            pass

    with ExitStack() as stack:
        found.first = stack.enter_context(serving_http(Handler, "127.0.0.1")).removeprefix("http://")
        found.second = stack.enter_context(serving_http(Handler, "127.0.0.2")).removeprefix("http://")
        yield found


def credentials_file(tmp_path: Path, auths: dict[str, object]) -> Callable[[], RegistryAuths]:
    """Write a credentials file and read it as the controller and the agent do."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "registry-credentials.json"
    path.write_text(json.dumps({"auths": auths}))
    path.chmod(0o600)
    source = registry_credentials(str(path))
    assert source is not None
    return source


def outbound(source: Callable[[], RegistryAuths]) -> Outbound:
    # tls_verify off: loopback registries are reached over plain HTTP (as in the other registry tests).
    return Outbound(
        OciConfig(tls_verify=False), ArtifactStoreConfig(), registry_credentials=source, s3_credentials=None
    )


def basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


# --- the controller ------------------------------------------------------------------------------


async def test_the_credentials_reach_their_registry_and_no_other_host(
    tmp_path: Path, authed_oci_registry: AuthedRegistry, spy: Spy
) -> None:
    registry = authed_oci_registry
    image = push_index(registry.host, "nexa-test/creds", PLATFORMS, auth=registry.auth)
    source = credentials_file(tmp_path, {registry.host: {"username": registry.username, "password": registry.password}})
    reference = image.partition("/")[2]
    # The spy, named by an image reference, asks for basic auth as the registry does.
    spy.answer = lambda _seen: (401, {"WWW-Authenticate": 'Basic realm="nexa-test"'}, b"")
    async with outbound(source) as out:
        with trio.fail_after(30):
            check = await out.check_image(image)  # the real registry takes them
            assert [str(p) for p in check.platforms] == ["linux/amd64", "linux/arm64/v8"]
            for host in (spy.second, spy.first):
                with pytest.raises(Unavailable) as refused:
                    await out.check_image(f"{host}/{reference}")
                assert "has none for it: add it under auths" in refused.value.message
            # The same registry under another name (localhost for 127.0.0.1) is another host: nothing sent.
            other_name = registry.host.replace("127.0.0.1", "localhost")
            with pytest.raises(Unavailable, match=f"registry {other_name} requires credentials"):
                await out.check_image(f"{other_name}/{reference}")
    assert len(spy.seen) == 2
    assert [s.authorization for s in spy.seen] == [None, None]


async def test_a_token_service_on_another_host_gets_the_credentials_only_when_named(tmp_path: Path, spy: Spy) -> None:
    digest = sha(b"no such manifest")
    challenge = f'Bearer realm="http://{spy.second}/token",service="spy",scope="repository:team/app:pull"'

    def answer(seen: Seen) -> Answer:
        if seen.server == spy.second:  # the token service: a token only for credentials
            if seen.authorization is None:
                return 401, {}, b""
            return 200, {"Content-Type": "application/json"}, b'{"token": "tok-1"}'
        if seen.authorization != "Bearer tok-1":
            return 401, {"WWW-Authenticate": challenge}, b""
        return 404, {}, b""

    spy.answer = answer
    entry: dict[str, object] = {"username": "puller", "password": "pw-for-the-first"}
    image = f"{spy.first}/team/app@{digest}"
    async with outbound(credentials_file(tmp_path / "a", {spy.first: entry})) as out:
        with trio.fail_after(30), pytest.raises(Unavailable) as refused:
            await out.check_image(image)
    assert f'add it to auths["{spy.first}"].token_realms' in refused.value.message
    assert [s.authorization for s in spy.at(spy.second)] == [None]
    assert all(s.authorization is None for s in spy.at(spy.first))

    spy.seen.clear()
    named = credentials_file(tmp_path / "b", {spy.first: {**entry, "token_realms": [spy.second]}})
    async with outbound(named) as out:
        with trio.fail_after(30), pytest.raises(DigestUnknown):
            await out.check_image(image)  # a token, then the registry's 404
    assert [s.authorization for s in spy.at(spy.second)] == [basic("puller", "pw-for-the-first")]
    assert [s.authorization for s in spy.at(spy.first)] == [None, "Bearer tok-1"]


async def test_redirects_stay_on_the_host_or_go_on_without_credentials(tmp_path: Path, spy: Spy) -> None:
    """A manifest is redirected on its own host (followed, with the credentials) or to another
    (refused: nothing reaches it); a config blob is redirected to another host as to a registry's
    storage (followed without the Authorization header, its bytes checked against the digest)."""
    config = config_blob("arm64", "v8")
    manifest = manifest_for(config)
    good = f"{spy.first}/team/app@{sha(manifest)}"
    elsewhere = f"{spy.first}/team/elsewhere@{sha(manifest)}"
    creds = basic("puller", "pw-redirected")

    def answer(seen: Seen) -> Answer:
        if seen.server == spy.second:
            return 200, {}, config  # whatever is asked: it must not be asked with credentials
        if seen.authorization != creds:
            return 401, {"WWW-Authenticate": 'Basic realm="spy"'}, b""
        path = seen.path
        if path == f"/v2/team/app/manifests/{sha(manifest)}":
            return 307, {"Location": f"/mirror{path}"}, b""
        if path == f"/mirror/v2/team/app/manifests/{sha(manifest)}":
            return 200, {"Content-Type": OCI_MANIFEST}, manifest
        if path == f"/v2/team/elsewhere/manifests/{sha(manifest)}":
            return 307, {"Location": f"http://{spy.second}/stolen"}, b""
        if path.endswith(f"/blobs/{sha(config)}"):
            return 307, {"Location": f"http://{spy.second}/storage/blob"}, b""
        return 404, {}, b""

    spy.answer = answer
    source = credentials_file(tmp_path, {spy.first: {"username": "puller", "password": "pw-redirected"}})
    async with outbound(source) as out:
        with trio.fail_after(30):
            check = await out.check_image(good)
            assert [str(p) for p in check.platforms] == ["linux/arm64/v8"]
            assert [s.authorization for s in spy.at(spy.second)] == [None]  # the blob, without credentials
            with pytest.raises(RegistryAnswerRefused) as refused:
                await out.check_image(elsewhere)
    assert f"redirected the manifest of {elsewhere} to another host ({spy.second})" in refused.value.message
    assert [s.path for s in spy.at(spy.second)] == ["/storage/blob"]  # /stolen was never asked


async def test_oversized_token_answers_and_manifests_are_refused(tmp_path: Path, spy: Spy) -> None:
    big_manifest = b" " * (MAX_MANIFEST_BYTES + 1)
    token_image = f"{spy.first}/team/token@{sha(b'x')}"
    manifest_image = f"{spy.first}/team/big@{sha(big_manifest)}"

    def answer(seen: Seen) -> Answer:
        if seen.path.startswith("/token"):
            padding = "x" * MAX_TOKEN_ANSWER_BYTES
            return 200, {"Content-Type": "application/json"}, json.dumps({"token": "t", "pad": padding}).encode()
        if "/team/token/" in seen.path:
            return 401, {"WWW-Authenticate": f'Bearer realm="http://{spy.first}/token",service="spy"'}, b""
        return 200, {"Content-Type": OCI_MANIFEST}, big_manifest

    spy.answer = answer
    source = credentials_file(tmp_path, {spy.first: {"username": "puller", "password": "pw-big"}})
    async with outbound(source) as out:
        with trio.fail_after(30):
            with pytest.raises(RegistryAnswerRefused) as token:
                await out.check_image(token_image)
            with pytest.raises(ManifestInvalid) as manifest:
                await out.check_image(manifest_image)
    assert f"answered with more than {MAX_TOKEN_ANSWER_BYTES} bytes" in token.value.message
    assert f"more than {MAX_MANIFEST_BYTES} bytes for the manifest" in manifest.value.message
    # The token service is the registry's own host: the credentials went there, and only there.
    assert {s.authorization for s in spy.at(spy.first) if s.path.startswith("/token")} == {basic("puller", "pw-big")}
    assert spy.at(spy.second) == []


# --- the node --------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_podman_is_handed_the_credentials_only_for_their_registry(
    tmp_path: Path,
    podman_service: PodmanService,
    test_images: BuiltImages,
    authed_oci_registry: AuthedRegistry,
    spy: Spy,
) -> None:
    """A real pull from the registry that demands them succeeds; a pull of an image on the spy's
    host (which asks for basic auth as well) carries none, so the spy never sees them."""
    registry = authed_oci_registry
    digest_file = tmp_path / "digest"
    podman_service.cli("pull", "--tls-verify=false", test_images.busybox)
    podman_service.cli(
        "push",
        "--tls-verify=false",
        "--creds",
        f"{registry.username}:{registry.password}",
        "--digestfile",
        str(digest_file),
        test_images.busybox,
        f"{registry.host}/nexa-test/authed-busybox:test",
    )
    image = f"{registry.host}/nexa-test/authed-busybox@{digest_file.read_text().strip()}"
    podman_service.cli("rmi", "--force", test_images.busybox, check=False)
    spy.answer = lambda _seen: (401, {"WWW-Authenticate": 'Basic realm="spy"'}, b"")
    source = credentials_file(tmp_path, {registry.host: {"username": registry.username, "password": registry.password}})
    async with LibpodEngine(podman_service.socket, tls_verify=False, credentials=source) as podman:
        with trio.fail_after(120):
            await podman.pull(image)
            assert await podman.image_exists(image)
            with pytest.raises(EngineError):
                await podman.pull(f"{spy.second}/nexa-test/authed-busybox@{image.partition('@')[2]}")
    podman_service.cli("rmi", "--force", image, check=False)
    assert spy.at(spy.second), "podman never asked the spy"
    # podman asks with none, or with empty ones (libpod without X-Registry-Auth sends `Basic Og==`, ":").
    assert {s.authorization for s in spy.seen} <= {None, basic("", "")}, spy.seen
