"""What every config section shares: the value types (durations, sizes, addresses, keys), files
config names (`WatchedFile`) and the checks several sections use. Pure."""

from __future__ import annotations

import base64
import binascii
import enum
import ipaddress
import logging
import math
import os
import re
from collections.abc import Callable
from typing import Generic, NewType, TypeVar

import attrs

from nexa.errors import ConfigError

Seconds = NewType("Seconds", float)
Bytes = NewType("Bytes", int)
HostPort = NewType("HostPort", str)
#: An Ed25519 public key: standard base64 of its raw 32 bytes ("" where none is configured).
PublicKeyB64 = NewType("PublicKeyB64", str)

C = TypeVar("C")
F = TypeVar("F")

log = logging.getLogger(__name__)


class WatchedFile(Generic[F]):
    """A file that config names (S3 or registry credentials), re-read when it changes.

    `current()` stats the file (one syscall) and parses it again only when its (mtime, size,
    inode) moved: an operator's atomic rename or an edit in place is picked up at the next use,
    with no restart. A file that turns unreadable or invalid keeps the last good value; the
    problem is logged once per change (the loader's message, never the content) and reported to
    `on_invalid` (a metric). The first load happens here, and its ConfigError is raised.
    """

    def __init__(self, path: str, load: Callable[[str], F], *, on_invalid: Callable[[], None] | None = None) -> None:
        self.path = path
        self._load = load
        self._on_invalid = on_invalid
        self._seen = self._stamp()
        self._value = load(path)
        #: How often a changed file was taken, and refused (`statistics`, tests).
        self.reloads = 0
        self.refusals = 0

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> F:
        stamp = self._stamp()
        if stamp == self._seen:
            return self._value
        self._seen = stamp
        try:
            value = self._load(self.path)
        except ConfigError as exc:
            self.refusals += 1
            log.warning("%s; keeping the credentials read before", exc.message)
            if self._on_invalid is not None:
                self._on_invalid()
            return self._value
        self._value = value
        self.reloads += 1
        log.info("re-read %s", self.path)
        return value


def check_networks(values: tuple[str, ...]) -> None:
    for value in values:
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address or network") from None


#: A host in a channel endpoint: an address, a name (a host's or an interface's), or `*` (any).
_ENDPOINT_HOST = re.compile(r"[A-Za-z0-9*][A-Za-z0-9._-]*")


def zmq_endpoint(value: object) -> str:
    """`tcp://HOST:PORT` for `tcp://HOST:PORT` or a bare `HOST:PORT` (as `http.listen` takes);
    HOST may be `[v6]`, PORT `*` (any free port). Anything else is refused here, not by zmq later."""
    text = str(value)
    if not text:
        return text
    host_port = text.removeprefix("tcp://")
    host, sep, port = host_port.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            host = ""
    elif not _ENDPOINT_HOST.fullmatch(host):
        host = ""
    if not (sep and host and (port == "*" or (port.isdigit() and int(port) <= 65535))):
        raise ValueError(f"{text!r} is not a channel address: use HOST:PORT or tcp://HOST:PORT")
    return f"tcp://{host_port}"


def positive_rate(attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive, finite rate per second")


def seconds_hook(value: object, _: type) -> Seconds:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("expected a duration in seconds (a number)")
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive number of seconds")
    return Seconds(float(value))


def bytes_hook(value: object, _: type) -> Bytes:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("expected a size in bytes (an integer)")
    if value <= 0:
        raise ValueError("must be a positive number of bytes")
    return Bytes(value)


def parse_host_port(value: str) -> tuple[str, int]:
    """Split `host:port` or `[v6]:port`; raise ValueError with the reason."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host:
        raise ValueError("expected HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        ipaddress.IPv6Address(host)
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError("port must be a number from 0 to 65535")
    return host, int(port_s)


def host_port_hook(value: object, _: type) -> HostPort:
    if not isinstance(value, str):
        raise ValueError("expected a string HOST:PORT")
    parse_host_port(value)
    return HostPort(value)


def public_key_b64_hook(value: object, _: type) -> PublicKeyB64:
    if not isinstance(value, str):
        raise ValueError("expected a string: an Ed25519 public key in base64")
    if value:
        try:
            raw = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("not valid base64") from None
        if len(raw) != 32:
            raise ValueError(f"an Ed25519 public key is 32 bytes, this is {len(raw)}")
    return PublicKeyB64(value.strip())


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@attrs.frozen(kw_only=True)
class LogConfig:
    level: LogLevel = LogLevel.INFO
