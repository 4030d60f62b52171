"""`nexa control` serving https itself (`[http] tls_cert_file`, `tls_key_file`), with a CA and a
certificate this test makes (`tests.support.tls`): the official `openai` SDK and the `nexa` CLI
against it with the CA (served) and without it or with another CA (refused, saying what to set);
the console cookie `Secure`; the certificate re-read when its files change; a bad pair refused at
start; `nexa node doctor`'s controller check.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import attrs
import httpx
import openai
import pytest
import trio

from nexa import cli
from nexa.config import ControlConfig, HttpConfig, TlsVersion
from nexa.control.cluster.forward import FORWARDED_HEADER
from nexa.control.service import KEYS_DIR
from nexa.errors import CertificateNotTrusted, ConfigError
from nexa.node import identity
from nexa.node.doctor import DoctorOptions, check_controller, fetch_version
from nexa.tls import CA_FILE_ENV, ClientTls, ServerTls
from tests.conftest import Controller, local_config, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import make_key, metric
from tests.support.cluster import MESSAGES, sim_fleet
from tests.support.follow import cluster_config, until_leads
from tests.support.models import registry_config
from tests.support.postgres import pg_url_fixture, postgres_fixture  # noqa: F401 - fixtures
from tests.support.tls import Ca, ServerCert, issue, make_ca


@attrs.frozen
class HttpsController(Controller):
    """A controller serving https; its clients trust `ca`."""

    ca: Path

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key or self.admin_key}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10, verify=trusting(self.ca))


@attrs.frozen
class Pki:
    ca: Ca
    server: ServerCert
    #: Another CA, which issued nothing this controller serves.
    other: Ca


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def tls_http(cfg: HttpConfig, server: ServerCert) -> HttpConfig:
    return attrs.evolve(cfg, tls_cert_file=str(server.cert_path), tls_key_file=str(server.key_path))


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = make_ca(tmp_path / "pki")
    return Pki(ca, issue(ca, tmp_path / "pki"), make_ca(tmp_path / "pki", "another CA"))


@pytest.fixture
async def https(nursery: trio.Nursery, tmp_path: Path, pki: Pki) -> AsyncIterator[HttpsController]:
    cfg = local_config(tmp_path)
    started = await start_controller(nursery, attrs.evolve(cfg, http=tls_http(cfg.http, pki.server)))
    yield HttpsController(**attrs.asdict(started, recurse=False), ca=pki.ca.path)
    started.stopping.set()


def _cli_env(controller: Controller, ca_file: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {CA_FILE_ENV, "SSL_CERT_FILE", "SSL_CERT_DIR"}}
    env |= {"NEXA_URL": controller.url, "NEXA_TOKEN": controller.admin_key}
    if ca_file is not None:
        env[CA_FILE_ENV] = str(ca_file)
    return env


async def _cli(controller: Controller, ca_file: Path | None, *argv: str) -> subprocess.CompletedProcess[str]:
    run = partial(
        subprocess.run,
        [sys.executable, "-m", "nexa", *argv],
        env=_cli_env(controller, ca_file),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return await trio.to_thread.run_sync(run)


async def test_the_controller_serves_https_and_the_openai_sdk_needs_its_ca(https: HttpsController, pki: Pki) -> None:
    assert https.url.startswith("https://127.0.0.1:")
    key = await make_key(https, "inference", tenant="acme")

    def models(http_client: httpx.Client | None) -> list[str]:
        client = openai.OpenAI(base_url=f"{https.url}/v1", api_key=key, http_client=http_client, max_retries=0)
        try:
            return [m.id for m in client.models.list()]
        finally:
            client.close()

    # With the CA: served (an empty list: nothing is deployed).
    assert await trio.to_thread.run_sync(models, httpx.Client(verify=trusting(pki.ca.path))) == []
    # The SDK's own trust store, and another CA: the handshake is refused, nothing is served.
    for http_client in (None, httpx.Client(verify=trusting(pki.other.path))):
        with pytest.raises(openai.APIConnectionError) as refused:
            await trio.to_thread.run_sync(models, http_client)
        assert isinstance(ClientTls.load().not_trusted(refused.value, https.url), CertificateNotTrusted)
    # Plain http on the https port is not answered as http.
    async with httpx.AsyncClient(base_url=https.url.replace("https:", "http:"), timeout=5) as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get("/healthz")


@pytest.mark.slow
async def test_the_cli_verifies_the_controller_against_nexa_ca_file(https: HttpsController, pki: Pki) -> None:
    served = await _cli(https, pki.ca.path, "tenants", "list", "--json")
    assert served.returncode == 0, served.stderr

    for ca_file in (pki.other.path, None):
        refused = await _cli(https, ca_file, "tenants", "list")
        assert refused.returncode == 2, refused.stderr  # a configuration to fix, as for a bad config file
        assert f"the certificate of {https.url} is not trusted" in refused.stderr
        assert "set NEXA_CA_FILE to the PEM file of the CA" in refused.stderr
        against = f"the CA file {pki.other.path}" if ca_file else "the system's CA store"
        assert against in refused.stderr
        assert refused.stdout == ""

    unreadable = await _cli(https, pki.ca.path.parent / "missing.pem", "tenants", "list")
    assert unreadable.returncode == 2
    assert "cannot read NEXA_CA_FILE" in unreadable.stderr


async def test_the_console_cookies_are_secure_over_https(https: HttpsController) -> None:
    async with https.client() as http:
        form = await http.get("/console/login")  # no proxy header: the connection itself is https
    assert form.status_code == 200
    assert "; Secure" in form.headers["set-cookie"]


def _served_certificate(port: int, ca: Path) -> bytes:
    """The certificate a new connection to 127.0.0.1:`port` is served (DER), verified against `ca`."""
    context = trusting(ca)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _replace(src: Path, dst: Path) -> None:
    tmp = dst.with_suffix(".new")
    tmp.write_bytes(src.read_bytes())
    tmp.replace(dst)  # as certbot's or an operator's atomic rename


async def test_a_renewed_certificate_is_served_to_new_connections(
    https: HttpsController, pki: Pki, tmp_path: Path
) -> None:
    port = int(https.url.rsplit(":", 1)[1])
    assert await trio.to_thread.run_sync(_served_certificate, port, pki.ca.path) == pki.server.der
    async with https.client() as kept:  # a connection open before the renewal keeps working
        assert (await kept.get("/healthz")).status_code == 200

        # Renewed by another CA (the hardest case: the old CA no longer verifies it).
        ca2 = make_ca(tmp_path / "renewed", "renewed CA")
        renewed = issue(ca2, tmp_path / "renewed")
        # Copied one file at a time, the certificate first: in between, the new certificate and
        # the old key do not match, so the old pair is still served; the key's arrival completes it.
        _replace(renewed.cert_path, pki.server.cert_path)
        assert await trio.to_thread.run_sync(_served_certificate, port, pki.ca.path) == pki.server.der
        _replace(renewed.key_path, pki.server.key_path)
        assert await trio.to_thread.run_sync(_served_certificate, port, ca2.path) == renewed.der
        assert (await kept.get("/healthz")).status_code == 200

    # A broken rewrite (a key that is not the certificate's) keeps the last good pair, counted.
    _replace(issue(ca2, tmp_path / "stray", "stray").key_path, pki.server.key_path)
    assert await trio.to_thread.run_sync(_served_certificate, port, ca2.path) == renewed.der
    https2 = attrs.evolve(https, ca=ca2.path)
    assert await metric(https2, "nexa_credential_reload_failures_total", file="tls") == 2.0  # half-copied, stray


def _handshake(port: int, ca: Path, version: ssl.TLSVersion) -> str | None:
    """The TLS version a client limited to `version` agrees with 127.0.0.1:`port`."""
    context = trusting(ca)
    context.minimum_version = context.maximum_version = version
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return tls.version()


async def test_tls_min_version_refuses_older_clients(nursery: trio.Nursery, tmp_path: Path, pki: Pki) -> None:
    cfg = local_config(tmp_path)
    http = attrs.evolve(tls_http(cfg.http, pki.server), tls_min_version=TlsVersion.TLS_1_3)
    controller = await start_controller(nursery, attrs.evolve(cfg, http=http))
    port = int(controller.url.rsplit(":", 1)[1])
    assert await trio.to_thread.run_sync(_handshake, port, pki.ca.path, ssl.TLSVersion.TLSv1_3) == "TLSv1.3"
    with pytest.raises(ssl.SSLError):
        await trio.to_thread.run_sync(_handshake, port, pki.ca.path, ssl.TLSVersion.TLSv1_2)
    controller.stopping.set()


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("missing", "cannot read http.tls_cert_file"),
        ("garbage", "are not a PEM certificate"),
        ("mismatched", "is not the private key of the certificate in http.tls_cert_file"),
        ("encrypted", "is encrypted with a passphrase"),
    ],
)
def test_a_bad_certificate_or_key_is_refused_at_start(pki: Pki, tmp_path: Path, damage: str, says: str) -> None:
    cert, key = pki.server.cert_path, pki.server.key_path
    if damage == "missing":
        cert = tmp_path / "nowhere.pem"
    elif damage == "garbage":
        cert.write_text("not a certificate\n")
    elif damage == "mismatched":
        key = issue(pki.ca, tmp_path / "other").key_path
    else:
        key.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n")
    state = tmp_path / "state"
    config = tmp_path / "control.toml"
    config.write_text(f'[http]\nlisten = "127.0.0.1:0"\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\n')
    with pytest.raises(ConfigError, match=says):
        ServerTls(HttpConfig(tls_cert_file=str(cert), tls_key_file=str(key)))
    # Through the real interface: exit 2 (a configuration to fix), the reason on stderr, nothing written.
    done = subprocess.run(
        [sys.executable, "-m", "nexa", "control", "--config", str(config), "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert not state.exists()


def test_only_one_of_certificate_and_key_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"http\.tls_cert_file is set but http\.tls_key_file is not"):
        HttpConfig(tls_cert_file="/etc/nexa/tls/cert.pem")


async def test_a_node_enrolls_only_with_a_controller_whose_certificate_verifies(
    https: HttpsController,
    pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with https.client() as http:
        token = (await http.post("/api/v1/enrollment-tokens", json={"ttl_s": 60})).json()["token"]
    state_dir = tmp_path / "node"
    argv = ["node", "enroll", "--controller", https.url, "--token", token, "--state-dir", str(state_dir)]

    monkeypatch.setenv(CA_FILE_ENV, str(pki.other.path))
    assert await trio.to_thread.run_sync(cli.main, argv) == 2  # the token's secret never left the handshake
    assert "set NEXA_CA_FILE" in capsys.readouterr().err
    assert not identity.is_enrolled(state_dir)

    monkeypatch.setenv(CA_FILE_ENV, str(pki.ca.path))
    assert await trio.to_thread.run_sync(cli.main, argv) == 0
    assert identity.load_enrollment(state_dir).controller_url == https.url


async def test_node_doctor_checks_the_controller_certificate(
    https: HttpsController, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = DoctorOptions(controller_url=https.url)
    monkeypatch.setenv(CA_FILE_ENV, str(pki.ca.path))
    answered = await check_controller(opts, None, fetch_version)
    assert answered[0].status == "ok", answered[0]

    monkeypatch.setenv(CA_FILE_ENV, str(pki.other.path))
    refused = await check_controller(opts, None, fetch_version)
    assert refused[0].status == "fail"
    assert f"the certificate of {https.url} is not trusted" in refused[0].detail
    assert refused[0].fix is not None and "set NEXA_CA_FILE" in refused[0].fix


# ---- controllers forwarding to the leader over https --------------------------------------------------------------


def _https_member(tmp_path: Path, name: str, pg_url: str, ca: Ca, peer_ca: Path) -> ControlConfig:
    """Controller `name` of a cluster on `pg_url`, serving https with a certificate from `ca`, its
    address https://, verifying the leader's certificate with `peer_ca`."""
    cfg = cluster_config(tmp_path, name, pg_url)
    server = issue(ca, tmp_path / name / "tls")
    return attrs.evolve(
        cfg,
        http=tls_http(cfg.http, server),
        cluster=attrs.evolve(
            cfg.cluster, address=cfg.cluster.address.replace("http:", "https:"), peer_ca_file=str(peer_ca)
        ),
    )


async def test_a_follower_forwards_writes_to_the_leader_over_verified_https(
    nursery: trio.Nursery, tmp_path: Path, pg_url: str, pki: Pki
) -> None:
    with trio.fail_after(90):
        a = await start_controller(nursery, _https_member(tmp_path, "a", pg_url, pki.ca, pki.ca.path))
        leader = HttpsController(**attrs.asdict(a, recurse=False), ca=pki.ca.path)
        for name in ("b", "c"):
            shutil.copytree(leader.state_dir / KEYS_DIR, tmp_path / name / "state" / KEYS_DIR)
        # b trusts the controllers' CA; c was given another CA for its peers.
        b = await start_controller(
            nursery, _https_member(tmp_path, "b", pg_url, pki.ca, pki.ca.path), admin_key=leader.admin_key
        )
        c = await start_controller(
            nursery, _https_member(tmp_path, "c", pg_url, pki.ca, pki.other.path), admin_key=leader.admin_key
        )
        follower, mistrusting = (HttpsController(**attrs.asdict(x, recurse=False), ca=pki.ca.path) for x in (b, c))
        async with leader.client() as http:
            await until_leads(http)
        async with follower.client() as http:
            made = await http.post("/api/v1/tenants", json={"id": "acme"})
            assert made.status_code == 201, made.text
            assert made.headers[FORWARDED_HEADER] == "a"  # the leader answered, over https
        async with mistrusting.client() as http:
            refused = await http.post("/api/v1/tenants", json={"id": "globex"})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "not_leader"
        assert "certificate is not trusted" in refused.json()["error"]["message"]
        assert await metric(mistrusting, "nexa_forwarded_requests_total", result="leader_untrusted") == 1.0
        async with leader.client() as http:
            tenants = {t["id"] for t in (await http.get("/api/v1/tenants")).json()["tenants"]}
        assert "acme" in tenants and "globex" not in tenants
        for x in (c, b, a):
            x.stopping.set()


@pytest.mark.slow
async def test_a_streamed_completion_is_encrypted_from_the_sdk_to_the_node(
    nursery: trio.Nursery,
    tmp_path: Path,
    s3_store: S3Store,
    test_images: BuiltImages,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The official SDK over https to the controller, CurveZMQ on to a real `nexa node` (which
    enrolled over https, verifying the controller with NEXA_CA_FILE) and its sim runtime."""
    cfg = registry_config(tmp_path, s3_store)
    monkeypatch.setenv(CA_FILE_ENV, str(pki.ca.path))  # for `nexa node enroll`
    started = await start_controller(nursery, attrs.evolve(cfg, http=tls_http(cfg.http, pki.server)))
    controller = HttpsController(**attrs.asdict(started, recurse=False), ca=pki.ca.path)
    try:
        async with sim_fleet(controller, tmp_path, s3_store, test_images, nodes=1) as cluster:
            await cluster.deploy("chat-a", replicas=1)

            def chat() -> str:
                with httpx.Client(verify=trusting(pki.ca.path)) as http_client:
                    client = openai.OpenAI(
                        base_url=cluster.base_url, api_key=cluster.inference_key, http_client=http_client
                    )
                    stream = client.chat.completions.create(model="chat", messages=MESSAGES, stream=True)
                    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

            assert await trio.to_thread.run_sync(chat)
    finally:
        controller.stopping.set()
