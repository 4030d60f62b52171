"""TLS for nexa's HTTP: the controller's certificate (re-read when its files change) and the trust
its clients use (the operator CLI, `nexa node enroll` and `nexa node doctor`, a follower forwarding
writes to the leader). Pure `ssl`: the HTTP libraries take the contexts made here.

Clients verify against the system's CA store (OpenSSL's default locations, as
`ssl.create_default_context()` loads them, so the host's own CAs count; not a bundle shipped with
nexa), or against one CA file instead: `NEXA_CA_FILE` for the CLI and the node, `[cluster]
peer_ca_file` between controllers. A certificate that does not verify is refused
(`CertificateNotTrusted`, saying what to set); nothing turns verification off.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable, Mapping
from typing import Final

import attrs

from nexa.config import HttpConfig, TlsVersion, WatchedFile
from nexa.errors import CertificateNotTrusted, ConfigError

log = logging.getLogger(__name__)

#: The environment variable naming the CA file (PEM) the CLI and the node agent verify an https
#: controller with; unset or empty: the system's CA store.
CA_FILE_ENV: Final = "NEXA_CA_FILE"
#: What the CLI and the node say to do about a controller certificate they do not trust.
CLIENT_FIX: Final = (
    f"set {CA_FILE_ENV} to the PEM file of the CA that issued the controller's certificate "
    "(or install that CA in this host's store), and check that the URL's host name is one the certificate names"
)
#: What a follower's log says to do about a leader certificate it does not trust.
PEER_FIX: Final = (
    "set [cluster] peer_ca_file to the PEM file of the CA that issued the controllers' certificates, "
    "and check that each [cluster] address names a host its certificate is issued for"
)
_VERSIONS: Final = {TlsVersion.TLS_1_2: ssl.TLSVersion.TLSv1_2, TlsVersion.TLS_1_3: ssl.TLSVersion.TLSv1_3}
#: hypercorn's default (RFC 7540 §9.2.2: forward secrecy, AEAD), plus ChaCha20 for hosts without AES.
_CIPHERS: Final = "ECDHE+AESGCM:ECDHE+CHACHA20"


@attrs.frozen
class ClientTls:
    """How a client verifies https servers: `context` (for the HTTP library), the CA file it trusts
    ("" for the system's store) and what to tell an operator whose server it does not trust."""

    context: ssl.SSLContext
    ca_file: str
    fix: str

    @classmethod
    def load(cls, ca_file: str = "", *, named_by: str = CA_FILE_ENV, fix: str = CLIENT_FIX) -> ClientTls:
        """Verify against `ca_file`, or the system's CA store when it is empty; ConfigError (naming
        `named_by`) when the file cannot be read or holds no PEM certificate."""
        try:
            context = ssl.create_default_context(cafile=ca_file or None)
        except OSError as exc:
            raise ConfigError(f"cannot read {named_by} {ca_file}: {exc.strerror}") from None
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{named_by} {ca_file} holds no PEM CA certificate ({exc.reason or exc}): give the CA "
                "certificate(s) that issued the server's certificate, in PEM"
            ) from None
        return cls(context, ca_file, fix)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ClientTls:
        """The CLI's and the node's: `NEXA_CA_FILE`, or the system's store when it is unset or empty."""
        return cls.load(environ.get(CA_FILE_ENV, "").strip())

    def not_trusted(self, exc: BaseException, url: str) -> CertificateNotTrusted | None:
        """`CertificateNotTrusted` when `exc` (an HTTP library's connect error) comes from a
        certificate that did not verify, else None."""
        failure = verification_failure(exc)
        if failure is None:
            return None
        reason = failure.verify_message or failure.reason or "certificate verify failed"
        return CertificateNotTrusted(url=url, reason=reason, ca_file=self.ca_file, fix=self.fix)


def verification_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification error behind `exc`, if any (its causes, as httpx chains them)."""
    seen: BaseException | None = exc
    for _ in range(16):  # a cause chain is short; a cycle must not hang us
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def server_context(cert_file: str, key_file: str, min_version: TlsVersion = TlsVersion.TLS_1_2) -> ssl.SSLContext:
    """The listening context for a certificate and its key; ConfigError saying what to fix when the
    files cannot be read, are not PEM, the key is encrypted, or the key is not the certificate's."""
    for key, path in (("tls_cert_file", cert_file), ("tls_key_file", key_file)):
        try:
            with open(path, "rb") as f:
                head = f.read(64 * 1024)
        except OSError as exc:
            raise ConfigError(
                f"cannot read http.{key} {path}: {exc.strerror}: the controller's user must be able to read it"
            ) from None
        if key == "tls_key_file" and (b"ENCRYPTED PRIVATE KEY" in head or b"Proc-Type: 4,ENCRYPTED" in head):
            raise ConfigError(
                f"http.tls_key_file {path} is encrypted with a passphrase: give the key unencrypted "
                "(`openssl pkey -in KEY -out KEY.plain`, mode 0600), as the controller starts unattended"
            )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[min_version]
    ctx.options |= ssl.OP_NO_COMPRESSION
    ctx.set_ciphers(_CIPHERS)
    # HTTP/1.1 only, as over plain http: the management and inference routes are h11's.
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        ctx.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(
                f"http.tls_key_file {key_file} is not the private key of the certificate in http.tls_cert_file "
                f"{cert_file}: give the key the certificate was issued for (or the certificate issued for this key)"
            ) from None
        raise ConfigError(
            f"http.tls_cert_file {cert_file} and http.tls_key_file {key_file} are not a PEM certificate "
            f"(then its chain) and its PEM private key ({exc.reason or exc}): give them in PEM, "
            "as a CA or `certbot` writes them (fullchain.pem and privkey.pem)"
        ) from None
    return ctx


def _no_passphrase() -> bytes:
    raise ConfigError("the key is encrypted")  # OpenSSL would otherwise prompt on a terminal


class _CertificatePair(WatchedFile[ssl.SSLContext]):
    """`WatchedFile` over the certificate and its key: either file changing loads the pair again."""

    def __init__(self, cfg: HttpConfig, *, on_invalid: Callable[[], None] | None) -> None:
        self._key_file = cfg.tls_key_file

        def load(cert_file: str) -> ssl.SSLContext:
            return server_context(cert_file, cfg.tls_key_file, cfg.tls_min_version)

        super().__init__(cfg.tls_cert_file, load, on_invalid=on_invalid)

    def _stamp(self) -> tuple[int, int, int] | None:
        cert = super()._stamp()
        try:
            key = os.stat(self._key_file)
        except OSError:
            return None
        if cert is None:
            return None
        # One stamp for both (WatchedFile compares stamps for equality only): a key replaced under
        # an unchanged certificate is noticed too.
        return (hash((cert, key.st_mtime_ns, key.st_size, key.st_ino)), 0, 0)


class ServerTls:
    """The controller's https: `context` is what its listeners wrap connections with.

    At each handshake (the context's SNI callback, which OpenSSL runs for every ClientHello, with a
    server name or without) the certificate and key files are stat'ed; when either changed, the pair
    is loaded again and this connection and every later one use it. Connections already open keep
    the certificate they began with. A pair that cannot be loaded (half-copied, mismatched) keeps
    the last good one: logged once per change, counted by `on_invalid`. The first load is at
    construction, and its ConfigError is raised: a bad pair stops the controller's start.
    """

    def __init__(self, cfg: HttpConfig, *, on_invalid: Callable[[], None] | None = None) -> None:
        self._pair = _CertificatePair(cfg, on_invalid=on_invalid)
        self.context = self._pair.current()
        self.context.sni_callback = self._choose

    def _choose(self, conn: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        newest = self._pair.current()
        if newest is not self.context:
            conn.context = newest
