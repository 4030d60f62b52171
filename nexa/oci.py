"""OCI images: references pinned by digest, the manifest media types, registry credentials.

Shared by the node (podman pulls with the credentials) and the controller (it checks that a
registry holds a runtime's manifest before the runtime is registered). Pure, except for reading
the credentials file (at start, and again when it changes); the password is never logged and never in a repr.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final

import attrs

from nexa.config import WatchedFile
from nexa.contracts.hosts import is_loopback_host
from nexa.contracts.models import ImageConfig, ImagePlatform
from nexa.contracts.runtime import IMAGE_BY_DIGEST_RE
from nexa.errors import ConfigError, ContractError, ManifestInvalid

log = logging.getLogger(__name__)

#: What a registry may answer for a manifest: single-platform manifests and multi-platform indexes,
#: OCI and Docker schema 2 alike. The digest of any of them pins the image.
MANIFEST_MEDIA_TYPES: Final = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
#: Docker Hub: references without a registry part name it, and it serves its API on another host.
DOCKER_HUB: Final = "docker.io"
DOCKER_HUB_API: Final = "registry-1.docker.io"


@attrs.frozen(kw_only=True)
class ImageReference:
    """`registry/repository@sha256:…`, split. `registry` is where the registry API answers."""

    registry: str
    repository: str
    #: `sha256:<64 hex>`
    digest: str

    @property
    def host(self) -> str:
        """The registry's host name or address, without port or brackets."""
        host = self.registry
        if host.startswith("["):
            return host[1:].partition("]")[0]
        return host.rpartition(":")[0] if host.count(":") == 1 else host

    @property
    def loopback(self) -> bool:
        """Whether the registry is on this machine (localhost, 127.0.0.0/8 or ::1)."""
        return is_loopback_host(self.host)


def parse_image_reference(image: str) -> ImageReference:
    """Split an image named by digest; ContractError for anything else (tags alone never pin an image).

    As with docker and podman, a first path component with a `.` or `:`, or `localhost`, names the
    registry; otherwise the image is on Docker Hub (`busybox` → `library/busybox`). A tag written
    before the digest is ignored: the digest decides.
    """
    if not IMAGE_BY_DIGEST_RE.match(image):
        raise ContractError(
            "image must be named by digest: registry/repository@sha256:<64 hex>",
            problems=("image: must be named by digest (repository@sha256:<64 hex>)",),
        )
    name, _, digest = image.partition("@")
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, name
    head, _, last = path.rpartition("/")
    last = last.partition(":")[0]  # drop a tag
    path = f"{head}/{last}" if head else last
    if registry == DOCKER_HUB:
        registry = DOCKER_HUB_API
        if "/" not in path:
            path = f"library/{path}"
    if not path or "//" in path or path.startswith("/") or path.endswith("/"):
        raise ContractError("image has an empty repository name", problems=("image: empty repository name",))
    return ImageReference(registry=registry, repository=path, digest=digest)


# --- registry credentials -----------------------------------------------------------------------

#: Names that mean Docker Hub in a credentials file (Docker's own config.json keys it by the first);
#: all of them stand for the host its API answers on.
_DOCKER_HUB_NAMES: Final = frozenset(
    {"index.docker.io", "docker.io", "registry-1.docker.io", "registry.hub.docker.com"}
)
_HOST_RE: Final = re.compile(r"^(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
#: What a credentials entry may hold: Docker's `auth` (base64 of user:password) or the two apart.
_ENTRY_KEYS: Final = frozenset({"username", "password", "auth", "token_realms"})
_FORMAT_HINT: Final = (
    'write it as {"auths": {"REGISTRY-HOST[:PORT]": {"username": "…", "password": "…"}}} '
    "(Docker's config.json shape), one entry per registry the credentials belong to"
)


def registry_authority(name: str) -> str:
    """`host[:port]` as credentials are matched: lower-case, without a scheme, path or the
    default port 443; IPv6 in brackets; Docker Hub's names (`docker.io`, `index.docker.io`, …)
    as the host its API answers on. ValueError for anything that names no host."""
    text = name.strip().lower()
    for scheme in ("https://", "http://"):
        text = text.removeprefix(scheme)
    text = text.partition("/")[0]
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else ("" if not rest else "x")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{name!r} is not a registry host") from None
        host = f"[{host}]"
    else:
        host, _, port = text.partition(":")
        if not _HOST_RE.match(host):
            raise ValueError(f"{name!r} is not a registry host")
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        raise ValueError(f"{name!r} has an invalid port")
    if port == "443":
        port = ""
    if host in _DOCKER_HUB_NAMES and not port:
        host = DOCKER_HUB_API
    return f"{host}:{port}" if port else host


def url_authority(host: str, port: int | None) -> str:
    """The authority (as `registry_authority` writes it) of a URL's host and explicit port."""
    bracketed = f"[{host}]" if ":" in host else host
    return registry_authority(f"{bracketed}:{port}" if port is not None else bracketed)


@attrs.frozen(kw_only=True)
class RegistryCredentials:
    """A username and password for one OCI registry. The password is never shown.

    They are sent to `registry` only, and to a token service (the realm of a registry's
    `WWW-Authenticate: Bearer` challenge) on another host only when that host is in `token_realms`.
    """

    #: `host[:port]`, as `registry_authority` writes it.
    registry: str
    username: str
    password: str = attrs.field(repr=False)
    #: Token services on other hosts (`host[:port]`) that may be sent these credentials.
    token_realms: frozenset[str] = frozenset()

    def may_get_token_from(self, authority: str) -> bool:
        """Whether these credentials may go to the token service at `authority` (`host[:port]`)."""
        return authority == self.registry or authority in self.token_realms


@attrs.frozen
class RegistryAuths:
    """A credentials file: credentials per registry host. `for_registry` is the only way to one."""

    entries: tuple[RegistryCredentials, ...] = ()

    @classmethod
    def of(cls, *entries: RegistryCredentials) -> RegistryAuths:
        return cls(tuple(entries))

    def for_registry(self, registry: str) -> RegistryCredentials | None:
        """The credentials of the registry at `registry` (`host[:port]` in any form
        `registry_authority` reads), or None: no credential is ever lent to another host."""
        try:
            authority = registry_authority(registry)
        except ValueError:
            return None
        return next((e for e in self.entries if e.registry == authority), None)

    def for_image(self, image: str) -> RegistryCredentials | None:
        """The credentials of the registry an image reference names (`parse_image_reference`), or None."""
        return self.for_registry(parse_image_reference(image).registry)

    def secrets(self) -> list[str]:
        """Every username and password, for scrubbing messages that may echo them."""
        return [s for e in self.entries for s in (e.password, e.username)]


def load_registry_credentials(path: str | os.PathLike[str]) -> RegistryAuths:
    """Read a JSON file `{"auths": {"HOST[:PORT]": {"username": …, "password": …}}}` (or Docker's
    `"auth": base64(user:password)`; `"token_realms": ["HOST[:PORT]", …]` names token services on
    other hosts that may be sent them); ConfigError (never quoting a secret) when it is bad."""
    where = os.fspath(path)
    try:
        raw = Path(where).read_bytes()
        mode = os.stat(where).st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read the registry credentials file {where}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("registry credentials file %s is readable by others than its owner; chmod 600 it", where)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        # The message says where, never what: the file holds a password.
        line = getattr(exc, "lineno", None)
        at = f" (line {line})" if line is not None else ""
        raise ConfigError(f"the registry credentials file {where} is not valid JSON{at}") from None
    if isinstance(data, dict) and "auths" not in data and {"username", "password"} & set(data):
        raise ConfigError(
            f"the registry credentials file {where} names no registry, so nexa cannot tell where its "
            f"credentials may go: {_FORMAT_HINT}",
            problems=("auths: required (credentials are sent only to the registry hosts named there)",),
        )
    problems: list[str] = []
    entries: list[RegistryCredentials] = []
    auths = data.get("auths") if isinstance(data, dict) else None
    if not isinstance(data, dict):
        problems.append(f"expected a JSON object: {_FORMAT_HINT}")
    elif not isinstance(auths, dict) or not auths:
        problems.append("auths: an object keyed by registry host with at least one entry is required")
    else:
        problems.extend(f"{key}: unknown key (only auths is read)" for key in sorted(set(data) - {"auths"}))
        seen: dict[str, str] = {}
        for name, entry in auths.items():
            found = _credentials_entry(name, entry, problems)
            if found is None:
                continue
            if found.registry in seen:
                problems.append(f"auths.{name}: the same registry as auths.{seen[found.registry]}")
                continue
            seen[found.registry] = name
            entries.append(found)
    if problems:
        raise ConfigError(
            f"the registry credentials file {where} is invalid: {'; '.join(problems)}", problems=tuple(problems)
        )
    return RegistryAuths(tuple(entries))


def _credentials_entry(name: str, entry: object, problems: list[str]) -> RegistryCredentials | None:
    """One `auths` entry, or None with its problems added (never quoting a secret)."""
    at = f"auths.{name}"
    before = len(problems)
    try:
        registry = registry_authority(name)
    except ValueError:
        problems.append(f"{at}: the key must be a registry host[:port] (e.g. registry.example.com:5000)")
        registry = ""
    if not isinstance(entry, dict):
        problems.append(f"{at}: expected an object with username and password")
        return None
    problems.extend(f"{at}.{key}: unknown key" for key in sorted(set(entry) - _ENTRY_KEYS))
    username, password = _entry_secret(entry, at, problems)
    realms = _token_realms(entry.get("token_realms", []), at, problems)
    if len(problems) > before:
        return None
    return RegistryCredentials(registry=registry, username=username, password=password, token_realms=realms)


def _entry_secret(entry: dict[str, object], at: str, problems: list[str]) -> tuple[str, str]:
    """The username and password of an entry: Docker's `auth` or the two keys."""
    if "auth" in entry:
        if "username" in entry or "password" in entry:
            problems.append(f"{at}: give auth or username and password, not both")
        try:
            decoded = base64.b64decode(str(entry["auth"]), validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            decoded = ""
        username, _, password = decoded.partition(":")
        if not username or not password:
            problems.append(f"{at}.auth: must be the base64 of username:password")
        return username, password
    found: list[str] = []
    for key in ("username", "password"):
        value = entry.get(key)
        if not isinstance(value, str) or not value:
            problems.append(f"{at}.{key}: a non-empty string is required")
        found.append(value if isinstance(value, str) else "")
    return found[0], found[1]


def _token_realms(raw: object, at: str, problems: list[str]) -> frozenset[str]:
    """The hosts of an entry's `token_realms`, as `registry_authority` writes them."""
    if not isinstance(raw, list) or not all(isinstance(r, str) for r in raw):
        problems.append(f"{at}.token_realms: a list of token service hosts (host[:port]) is required")
        return frozenset()
    realms: set[str] = set()
    for realm in raw:
        try:
            realms.add(registry_authority(realm))
        except ValueError:
            problems.append(f"{at}.token_realms: {realm!r} is not a host[:port]")
    return frozenset(realms)


def registry_credentials(
    path: str, *, on_invalid: Callable[[], None] | None = None
) -> Callable[[], RegistryAuths] | None:
    """The registry credentials in `path`, re-read whenever the file changes (a file that turns
    invalid keeps the last good ones: `config.WatchedFile`); None when no file is configured.
    ConfigError when the file is bad at start. Sync: call it off the event loop."""
    if not path:
        return None
    return WatchedFile(path, load_registry_credentials, on_invalid=on_invalid).current


def pull_credentials(
    source: RegistryAuths | Callable[[], RegistryAuths] | None, image: str
) -> RegistryCredentials | None:
    """The credentials a node hands its engine (podman, dockerd) to pull `image`: those of the
    registry the reference names, or None (no credential ever goes to another registry)."""
    auths = source() if callable(source) else source
    return None if auths is None else auths.for_image(image)


# --- platforms: what an index or a manifest's config says the image runs on ----------------------

OCI_INDEX: Final = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST: Final = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST: Final = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_MEDIA_TYPES: Final = frozenset({OCI_INDEX, DOCKER_LIST})
SINGLE_MEDIA_TYPES: Final = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
#: Registries refuse larger manifests (the distribution spec suggests 4 MiB); so do we, and configs too.
MAX_MANIFEST_BYTES: Final = 4 * 1024 * 1024
#: How the kernel (`uname -m`) and the container world name the same architectures.
_ARCH_ALIASES: Final = {"x86_64": "amd64", "x86-64": "amd64", "aarch64": "arm64", "armv8l": "arm64"}
_DIGEST_RE: Final = re.compile(r"^sha256:[0-9a-f]{64}$")
_PLATFORM_WORD_RE: Final = re.compile(r"^[a-z0-9][a-z0-9._-]{0,31}$")


def normalise_arch(machine: str) -> str:
    """An architecture as OCI names it: `aarch64` → `arm64`, `x86_64` → `amd64`, else lower-cased."""
    machine = machine.strip().lower()
    return _ARCH_ALIASES.get(machine, machine)


@attrs.frozen(kw_only=True)
class ParsedManifest:
    """What the bytes served for a digest say: an index's platforms, or a manifest's config to read."""

    media_type: str
    #: An index: the platforms of its manifests (attestations and `unknown/unknown` left out).
    platforms: list[ImagePlatform]
    #: A single manifest: the digest of its config blob, which names the platform.
    config_digest: str | None = None
    #: An index: each platform's manifest digest, in the index's order (the first per platform).
    manifests: list[tuple[ImagePlatform, str]] = attrs.Factory(list)


def parse_manifest(body: bytes, header_media_type: str, *, image: str) -> ParsedManifest:
    """Parse an OCI or Docker schema 2 manifest or index; ManifestInvalid for anything else.

    The document's own `mediaType` decides where it has one; the Content-Type header only where
    it has none (OCI makes the field optional).
    """
    doc = _json_object(body, image, "manifest")
    declared = doc.get("mediaType")
    media_type = declared if isinstance(declared, str) and declared else header_media_type
    if media_type in INDEX_MEDIA_TYPES or (not declared and "manifests" in doc):
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise ManifestInvalid(f"the index of {image} has no list of manifests", image=image)
        platforms: list[ImagePlatform] = []
        manifests: list[tuple[ImagePlatform, str]] = []
        for entry in entries:
            platform = entry.get("platform") if isinstance(entry, dict) else None
            if platform is None:
                continue  # an entry without a platform (OCI allows it) names no platform
            found = _platform(platform, image)
            if found is not None and found not in platforms:
                platforms.append(found)
                digest = entry.get("digest") if isinstance(entry, dict) else None
                if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
                    raise ManifestInvalid(f"the index of {image} names {found} without a sha256 digest", image=image)
                manifests.append((found, digest))
        return ParsedManifest(media_type=media_type or OCI_INDEX, platforms=platforms, manifests=manifests)
    if media_type in SINGLE_MEDIA_TYPES or (not declared and "config" in doc):
        config = doc.get("config")
        digest = config.get("digest") if isinstance(config, dict) else None
        if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
            raise ManifestInvalid(f"the manifest of {image} names no sha256 config digest", image=image)
        return ParsedManifest(media_type=media_type or OCI_MANIFEST, platforms=[], config_digest=digest)
    raise ManifestInvalid(f"{image} is not an OCI or Docker image manifest or index", image=image)


def parse_config_platform(body: bytes, *, image: str) -> ImagePlatform:
    """The platform an image config names (`os`, `architecture`, `variant`); ManifestInvalid if none."""
    found = _platform(_json_object(body, image, "config"), image)
    if found is None:
        raise ManifestInvalid(f"the config of {image} names no os and architecture", image=image)
    return found


#: Bounds on what an image config may hold for nexa to keep it (a registry's config is untrusted input).
MAX_CONFIG_LIST: Final = 1024
MAX_CONFIG_STRING: Final = 8192


def parse_image_config(body: bytes, *, image: str) -> ImageConfig:
    """The platform and what runs, from an image config blob (OCI image config, Docker's alike):
    `config.Entrypoint`, `Cmd`, `User`, `Env`, `WorkingDir`, `ExposedPorts`. ManifestInvalid when the
    config names no platform or holds a field of the wrong type."""
    doc = _json_object(body, image, "config")
    platform = _platform(doc, image)
    if platform is None:
        raise ManifestInvalid(f"the config of {image} names no os and architecture", image=image)
    run = doc.get("config")
    run = {} if run is None else run
    if not isinstance(run, dict):
        raise ManifestInvalid(f"the config of {image} has a `config` that is not an object", image=image)

    def strings(key: str) -> list[str]:
        value = run.get(key)
        value = [] if value is None else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(value) > MAX_CONFIG_LIST:
            raise ManifestInvalid(f"the config of {image} has a {key} that is not a list of strings", image=image)
        return [_bounded(v, key, image) for v in value]

    def text(key: str) -> str:
        value = run.get(key)
        value = "" if value is None else value
        if not isinstance(value, str):
            raise ManifestInvalid(f"the config of {image} has a {key} that is not a string", image=image)
        return _bounded(value, key, image)

    ports = run.get("ExposedPorts")
    ports = {} if ports is None else ports
    if not isinstance(ports, dict) or len(ports) > MAX_CONFIG_LIST:
        raise ManifestInvalid(f"the config of {image} has ExposedPorts that are not an object", image=image)
    return ImageConfig(
        platform=platform,
        entrypoint=strings("Entrypoint"),
        cmd=strings("Cmd"),
        user=text("User"),
        env=strings("Env"),
        working_dir=text("WorkingDir"),
        exposed_ports=sorted(_bounded(str(p), "ExposedPorts", image) for p in ports),
    )


def _bounded(value: str, key: str, image: str) -> str:
    if len(value) > MAX_CONFIG_STRING or "\x00" in value:
        raise ManifestInvalid(f"the config of {image} has a {key} entry too long or with a NUL", image=image)
    return value


def _json_object(body: bytes, image: str, what: str) -> dict[str, object]:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ManifestInvalid(f"the {what} of {image} is not JSON", image=image) from None
    if not isinstance(doc, dict):
        raise ManifestInvalid(f"the {what} of {image} is not a JSON object", image=image)
    return doc


def _platform(raw: object, image: str) -> ImagePlatform | None:
    """An ImagePlatform, or None for `unknown/unknown` (buildx's attestation entries)."""
    if not isinstance(raw, dict):
        raise ManifestInvalid(f"a platform of {image} is not an object", image=image)
    os_, arch, variant = raw.get("os"), raw.get("architecture"), raw.get("variant", "")
    if os_ == "unknown" and arch == "unknown":
        return None
    if not (isinstance(os_, str) and isinstance(arch, str)) or not all(
        _PLATFORM_WORD_RE.match(v.lower()) for v in (os_, arch)
    ):
        raise ManifestInvalid(f"a platform of {image} has no valid os and architecture", image=image)
    if not isinstance(variant, str) or (variant and not _PLATFORM_WORD_RE.match(variant.lower())):
        raise ManifestInvalid(f"a platform of {image} has an invalid variant", image=image)
    return ImagePlatform(os=os_.lower(), architecture=normalise_arch(arch), variant=variant.lower())
