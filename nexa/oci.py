"""OCI images: references pinned by digest, the manifest media types, registry credentials.

Shared by the node (podman pulls with the credentials) and the controller (it checks that a
registry holds a runtime's manifest before the runtime is registered). Pure, except for reading
the credentials file once at start; the password is never logged and never in a repr.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import stat
from pathlib import Path
from typing import Final

import attrs

from nexa.contracts.runtime import IMAGE_BY_DIGEST_RE
from nexa.errors import ConfigError, ContractError

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
        host = self.host
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


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


@attrs.frozen
class RegistryCredentials:
    """A username and password for an OCI registry. The password is never shown."""

    username: str
    password: str = attrs.field(repr=False)


def load_registry_credentials(path: str | os.PathLike[str]) -> RegistryCredentials:
    """Read a JSON file `{"username": …, "password": …}`; ConfigError (never quoting the file) when it is bad."""
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
    problems: list[str] = []
    if not isinstance(data, dict):
        problems.append("expected a JSON object with username and password")
    else:
        for key in ("username", "password"):
            value = data.get(key)
            if not isinstance(value, str) or not value:
                problems.append(f"{key}: a non-empty string is required")
        problems.extend(f"{key}: unknown key" for key in sorted(set(data) - {"username", "password"}))
    if problems:
        raise ConfigError(
            f"the registry credentials file {where} is invalid: {'; '.join(problems)}", problems=tuple(problems)
        )
    return RegistryCredentials(username=data["username"], password=data["password"])
