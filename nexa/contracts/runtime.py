"""What a node runs for one assignment: the runtime spec the controller signs, and the container
spec the node's podman client creates from it. Pure data and validation; no I/O.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping
from typing import Final, Protocol
from urllib.parse import urlparse

import attrs

from nexa.contracts.node import RuntimeKind

#: `registry[:port]/repository@sha256:<64 hex>`: images are only ever named by digest.
IMAGE_BY_DIGEST_RE: Final = re.compile(r"^[a-z0-9][a-z0-9.:_/-]*@sha256:[0-9a-f]{64}$")
SHA256_RE: Final = re.compile(r"^[0-9a-f]{64}$")
#: CDI device names such as `nvidia.com/gpu=0` or `nvidia.com/gpu=all`.
CDI_NAME_RE: Final = re.compile(r"^[a-z0-9][a-z0-9.-]*/[a-z0-9][a-z0-9._-]*=[A-Za-z0-9._:-]+$")
#: Labels every container the agent creates carries; the supervisor adopts and removes by them.
LABEL_ASSIGNMENT: Final = "nexa.assignment"
LABEL_DEPLOYMENT: Final = "nexa.deployment"
LABEL_GENERATION: Final = "nexa.generation"
LABEL_SPEC: Final = "nexa.spec-sha256"
#: Written by the controller where a runtime's bind address goes (its command and health probe);
#: the node replaces it with its own `runtime_host` (several nodes may share one host's loopback).
RUNTIME_HOST: Final = "{runtime_host}"


def _image(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not IMAGE_BY_DIGEST_RE.match(value):
        raise ValueError(f"{attribute.name} must be an image named by digest: repository@sha256:<64 hex>")


def _sha256(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not SHA256_RE.match(value):
        raise ValueError(f"{attribute.name} must be 64 lower-case hex digits")


def _s3_uri(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    parsed = urlparse(value)
    if parsed.scheme != "s3" or not parsed.netloc or not parsed.path.strip("/"):
        raise ValueError(f"{attribute.name} must be s3://bucket/key")


@attrs.frozen(kw_only=True)
class ArtifactRef:
    """A model artifact in the S3-compatible store, pinned by digest and size."""

    uri: str = attrs.field(validator=_s3_uri)
    sha256: str = attrs.field(validator=_sha256)
    size_bytes: int = attrs.field(validator=attrs.validators.ge(0))
    #: Where the verified file appears inside the container, read-only.
    mount_path: str = "/models/model"


@attrs.frozen(kw_only=True)
class HealthProbe:
    """The agent's own readiness probe: a command run inside the container through podman."""

    command: list[str]
    interval_s: float = 2.0
    timeout_s: float = 2.0
    #: Failures during this long after start keep the runtime `Starting`, not `Unhealthy`.
    start_period_s: float = 60.0
    #: Consecutive failures (after the start period) before the runtime is `Unhealthy`.
    retries: int = 2


@attrs.frozen(kw_only=True)
class RuntimeSpec:
    """One runtime replica as the controller assigns it (part of the signed assignment set).

    `command` and `health.command` may hold `RUNTIME_HOST` (`{runtime_host}`) where the runtime's
    bind address goes: the controller does not know which loopback address a node gives its
    runtimes, so the node substitutes its `runtime_host` when it builds the container spec
    (`runtimes.container_spec`). The spec is signed and hashed with the placeholder in it.
    """

    kind: RuntimeKind
    image: str = attrs.field(validator=_image)
    command: list[str]
    #: Plain settings only: never keys, tokens or credentials (the agent refuses known secret names).
    env: dict[str, str] = attrs.field(factory=dict)
    #: The runtime listens on 127.0.0.1:port of the node (host network, loopback only).
    port: int = attrs.field(validator=[attrs.validators.ge(1), attrs.validators.le(65535)])
    artifact: ArtifactRef | None = None
    #: CDI device names, e.g. `nvidia.com/gpu=0`.
    gpus: list[str] = attrs.field(factory=list)
    memory_bytes: int = attrs.field(validator=attrs.validators.gt(0))
    cpus: float = attrs.field(validator=attrs.validators.gt(0))
    pids_limit: int = 4096
    shm_bytes: int = 0
    health: HealthProbe
    stop_timeout_s: float = 30.0


@attrs.frozen(kw_only=True)
class ContainerSpec:
    """Exactly what the podman client asks libpod to create (built by the supervisor)."""

    name: str
    image: str
    command: list[str]
    env: dict[str, str]
    labels: dict[str, str]
    memory_bytes: int
    cpus: float
    pids_limit: int
    shm_bytes: int
    #: CDI device names.
    devices: list[str]
    #: (host path, container path) pairs, always mounted read-only.
    ro_mounts: list[tuple[str, str]]
    health: HealthProbe
    stop_timeout_s: float
    #: "host" (the runtime binds 127.0.0.1) or "none".
    network: str = "host"


@attrs.frozen(kw_only=True)
class ContainerState:
    """What podman says about one container (from inspect, or from a listing)."""

    id: str
    name: str
    #: The image reference it was created from (`repo@sha256:…` for ours).
    image_name: str
    #: The manifest digest podman resolved the image to (`sha256:…`), "" if unknown.
    image_digest: str
    labels: dict[str, str]
    running: bool
    #: podman's status word: created, running, exited, stopped, …
    status: str
    exit_code: int | None = None
    #: Unix seconds, None if never started.
    started_at: float | None = None
    restart_count: int = 0


@attrs.frozen(kw_only=True)
class PodmanEvent:
    """One event from podman's event stream (container events only)."""

    container_id: str
    #: create, init, start, died, stop, remove, health_status, …
    action: str
    labels: dict[str, str] = attrs.field(factory=dict)


class ContainerDriver(Protocol):
    """What the node supervisor drives: the podman client (`node.podman`), the simulation-only
    process driver or the router between them (`node.processes`)."""

    async def pull(self, image: str) -> None: ...
    async def image_exists(self, image: str) -> bool: ...
    async def create(self, spec: ContainerSpec) -> str: ...
    async def start(self, container_id: str) -> None: ...
    async def inspect(self, container_id: str) -> ContainerState: ...
    async def healthcheck(self, container_id: str) -> bool: ...
    async def stop(self, container_id: str, *, timeout_s: float) -> None: ...
    async def remove(self, container_id: str, *, force: bool = False) -> None: ...
    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[ContainerState]: ...
