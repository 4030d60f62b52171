"""Errors of a config file or flag, and of what a controller checks in its set-up at start."""

from __future__ import annotations

from nexa.errors.base import NexaError


class ConfigError(NexaError):
    code = "invalid_config"

    def __init__(self, message: str, *, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class ControllerKeysDiffer(ConfigError):
    """At start: the fingerprint of this controller's keys directory is not the one stored in the
    database by the controllers before it. Several controllers on one store sign for one another
    (nodes pin one set of keys), so they must share the same keys; the store is left as it was."""

    code = "controller_keys_differ"

    def __init__(self, *, stored: str, got: str, keys_dir: str = "") -> None:
        where = f" in {keys_dir}" if keys_dir else ""
        super().__init__(
            f"the controller keys{where} have fingerprint {got}, but the store holds {stored}: "
            "every controller on one store must share the same controller keys; copy the keys directory "
            "of a controller already on this store (its <state_dir>/keys, mode 0700) over this one's and start again"
        )
        self.stored = stored
        self.got = got
        self.keys_dir = keys_dir


class CertificateNotTrusted(ConfigError):
    """An https peer (the controller, for the CLI and `nexa node doctor`; the leader, for a follower)
    presented a certificate that does not verify against the CAs in use: the system's store, or
    the CA file named (`ca_file`: NEXA_CA_FILE, `[cluster] peer_ca_file`). Never skipped."""

    code = "certificate_not_trusted"

    def __init__(self, *, url: str, reason: str, ca_file: str, fix: str) -> None:
        against = f"the CA file {ca_file}" if ca_file else "the system's CA store"
        super().__init__(f"the certificate of {url} is not trusted ({reason}) by {against}: {fix}")
        self.url = url
        self.reason = reason
        self.ca_file = ca_file


class PlainHttpPeer(ConfigError):
    """A follower would forward a write (API keys, cookies, bodies) to a leader off this host over
    plain http; refused unless `[cluster] allow_plain_http_peers` says the network is trusted."""

    code = "plain_http_peer"

    def __init__(self, *, url: str) -> None:
        super().__init__(
            f"the leader's address {url} is plain http to another host, and writes are not forwarded "
            "unencrypted: serve https on every controller ([http] tls_cert_file and tls_key_file) and give "
            "[cluster] address as an https:// URL, or set [cluster] allow_plain_http_peers = true on a "
            "network you trust"
        )
        self.url = url
