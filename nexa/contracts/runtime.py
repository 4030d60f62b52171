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

from nexa.contracts.groups import GroupRole
from nexa.contracts.manifest import (
    MAX_FILE_BYTES,
    ArtifactLocation,
    entry_path,
    manifest_problems,
    path_problem,
)
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
#: podman's status words (libpod `define.ContainerStatus`, lower case) that the supervisor acts on.
#: Any other word (`stopping`, `removing`, `unknown`, …) is a container between states.
STATUS_EXITED: Final = frozenset({"exited", "stopped"})
STATUS_PAUSED: Final = "paused"
STATUS_STARTABLE: Final = frozenset({"created", "configured", "exited", "stopped"})
#: The only capability a container gets back (`ContainerSpec.cap_add`): RDMA verbs lock the memory they register.
CAP_IPC_LOCK: Final = "IPC_LOCK"
#: The RDMA device nodes a group's container may be given (verbs and the connection manager; not
#: `umadN`/`issmN`, which manage the subnet), as the kernel names them under /dev/infiniband.
RDMA_DEVICE_RE: Final = re.compile(r"^/dev/infiniband/(?:uverbs[0-9]{1,4}|rdma_cm)$")
#: ContainerSpec.network values.
NETWORK_PRIVATE: Final = "private"
NETWORK_HOST: Final = "host"
NETWORK_NONE: Final = "none"
#: Written by the controller where a runtime's bind address goes (its command and health probe);
#: the node replaces it with its own `runtime_host` (several nodes may share one host's loopback).
RUNTIME_HOST: Final = "{runtime_host}"
#: Where each replica's writable cache is mounted (read-write, nosuid, nodev): a directory on the
#: node's disk kept across restarts (`node.runtime_cache`); the adapters point the runtimes'
#: caches there (`HOME`, `XDG_CACHE_HOME`, Triton's, Inductor's, …). The root stays read-only.
RUNTIME_CACHE_PATH: Final = "/var/cache/nexa-runtime"


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
class ArtifactRef(ArtifactLocation):
    """A model artifact in the S3-compatible store, pinned by digest and size: one object, or the
    files of a manifest under a prefix (`nexa.contracts.manifest`).

    With `files`, the node assembles them as a directory and mounts it read-only at `mount_path`
    (`/models/<model name>`); without, it mounts the one verified file there (`/models/model`, as
    assignments made before manifests have it). The runtime is given `model_path`.
    """

    #: Where the verified directory appears inside the container, read-only.
    mount_path: str = "/models/model"

    def __attrs_post_init__(self) -> None:
        _s3_uri(self, attrs.fields(ArtifactRef).uri, self.uri)
        _sha256(self, attrs.fields(ArtifactRef).sha256, self.sha256)
        if isinstance(self.size_bytes, bool) or not 0 <= self.size_bytes <= MAX_FILE_BYTES:
            raise ValueError("size_bytes must be a whole number of bytes from 0 to 2^53")
        if not self.mount_path.startswith("/models/") or path_problem(self.mount_path.removeprefix("/models/")):
            raise ValueError("mount_path must be a path below /models/")
        if self.files:
            problems = manifest_problems(self.files, self.entry, field="artifact")
            if problems:
                raise ValueError(problems[0])

    @property
    def model_path(self) -> str:
        """What the runtime is pointed at inside the container: for a manifest, the mounted
        directory or its entry below it; for one object (no `files`), the mounted file itself."""
        return entry_path(self.mount_path, self.entry) if self.files else self.mount_path


@attrs.frozen(kw_only=True)
class LoraSpec:
    """A LoRA adapter a replica's runtime is given beside its base model (`nexa.contracts.lora`): the
    name requests use for it (the alias that serves it) and its verified artifact, mounted read-only
    at `/models/lora/<name>` like the base's."""

    name: str
    artifact: ArtifactRef


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
    (`nexa.container_spec`). The spec is signed and hashed with the placeholder in it.
    """

    kind: RuntimeKind
    image: str = attrs.field(validator=_image)
    command: list[str]
    #: Plain settings only: never keys, tokens or credentials (the agent refuses known secret names).
    env: dict[str, str] = attrs.field(factory=dict)
    #: The node reaches the runtime at its `runtime_host`:port. In its own network namespace (the
    #: default) the runtime listens on this port inside it and podman publishes it on that address
    #: only; with `host_network` it binds `runtime_host`:port in the node's namespace itself.
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
    #: The runtime registration's explicit opt-in to the node's own network namespace (it can then
    #: bind any address of the node and reach everything the node reaches). Off by default.
    host_network: bool = False
    #: The container's entrypoint, set explicitly so the process is exactly `entrypoint + command`
    #: whatever the image's own entrypoint: the adapter's program as the image has it (`command`
    #: is then its arguments), or a wrapper of the image that only `exec`s its arguments, such as
    #: NVIDIA's (`command` is then the program and its arguments). The controller decides it from
    #: the image config it read at registration (`entrypoints.entrypoint_for`). Empty: the image's
    #: entrypoint stays and `command` replaces its command (sets signed before entrypoints were
    #: set, and `sim`, which is a process).
    entrypoint: list[str] = attrs.field(factory=list)
    #: This replica's rank in a replica group (one model over several nodes): the group, its
    #: members' fabric addresses and ports, and the fabric access the runtime opted into. None: a
    #: replica on one node (sets signed before groups existed decode and hash as they did).
    group: GroupRole | None = None
    #: The LoRA adapters the node fetches and mounts beside the model, in the order the runtime's
    #: command names them (llama.cpp's adapter ids). Empty: none (sets signed before adapters hash as they did).
    loras: list[LoraSpec] = attrs.field(factory=list)
    #: The runtime loads the adapters of its assignment's `Assignment.loras` at run time (vLLM,
    #: `sim`): the node keeps each one's verified files in the assignment's own adapter directory,
    #: mounted read-only at `/models/lora` (entries `/models/lora/<name>`), and a change of them
    #: never restarts the runtime. False: none, or those of `loras`, fixed at start.
    live_loras: bool = False

    @property
    def process(self) -> list[str]:
        """What runs (the image's own entrypoint in front when `entrypoint` is empty)."""
        return [*self.entrypoint, *self.command]


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
    #: NETWORK_PRIVATE (its own namespace; `publish_port` published on `publish_host` only),
    #: NETWORK_HOST (the node's namespace: an explicit per-runtime opt-in) or NETWORK_NONE.
    network: str = "private"
    #: With NETWORK_PRIVATE: the node address (its `runtime_host`) the port is published on.
    publish_host: str = ""
    #: With NETWORK_PRIVATE: the port published, the same inside and on `publish_host`; 0: none.
    publish_port: int = 0
    #: (host path, container path) pairs mounted read-write, nosuid, nodev: the replica's cache.
    rw_mounts: list[tuple[str, str]] = attrs.Factory(list)
    #: The container's entrypoint (libpod `entrypoint`, Docker `Entrypoint`); empty: the image's.
    entrypoint: list[str] = attrs.field(factory=list)
    #: (host path, container path) device nodes mapped in (read, write, mknod in the device cgroup):
    #: only a replica group's RDMA devices (`/dev/infiniband/uverbsN`, `rdma_cm`), with `--fabric rdma`.
    device_nodes: list[tuple[str, str]] = attrs.Factory(list)
    #: Capabilities added back after all are dropped: only `IPC_LOCK` (`CAP_IPC_LOCK`), with `--fabric rdma`.
    cap_add: list[str] = attrs.Factory(list)
    #: An unlimited locked-memory limit (RLIMIT_MEMLOCK), which RDMA verbs need to register memory.
    memlock_unlimited: bool = False

    @property
    def process(self) -> list[str]:
        """What runs (the image's own entrypoint in front when `entrypoint` is empty)."""
        return [*self.entrypoint, *self.command]


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
    #: Set only once the container has exited (`exited`/`stopped`): None while it runs or stops.
    exit_code: int | None = None
    #: Unix seconds, None if never started.
    started_at: float | None = None
    restart_count: int = 0
    #: The host pid of its main process while it runs (podman and Docker inspect `State.Pid`);
    #: None when stopped or unknown. The node measures the replica's memory through it.
    pid: int | None = None

    @property
    def exited(self) -> bool:
        """It ran and has ended (`exited` or `stopped`): the only state that counts as an exit."""
        return not self.running and self.status in STATUS_EXITED

    @property
    def paused(self) -> bool:
        return self.status == STATUS_PAUSED

    @property
    def startable(self) -> bool:
        """podman accepts `start` only in these states (else 500 "container state improper")."""
        return not self.running and self.status in STATUS_STARTABLE

    @property
    def between_states(self) -> bool:
        """On its way from one state to another (`stopping`, `removing`, …): to be waited out."""
        return not self.running and not self.paused and self.status not in STATUS_STARTABLE


@attrs.frozen(kw_only=True)
class EngineEvent:
    """One event from a container engine's event stream (container events only)."""

    container_id: str
    #: create, init, start, died, stop, remove, health_status, …
    action: str
    labels: dict[str, str] = attrs.field(factory=dict)


class ContainerDriver(Protocol):
    """What the node supervisor drives: a container engine (`node.engines`, whose
    `ContainerEngine` adds what only an engine has), the simulation-only process driver or the
    router between them (`node.processes`)."""

    async def pull(self, image: str) -> None: ...
    async def image_exists(self, image: str) -> bool: ...
    async def create(self, spec: ContainerSpec) -> str: ...
    async def start(self, container_id: str) -> None: ...
    async def inspect(self, container_id: str) -> ContainerState: ...
    async def healthcheck(self, container_id: str) -> bool: ...
    async def stop(self, container_id: str, *, timeout_s: float) -> None: ...
    async def remove(self, container_id: str, *, force: bool = False) -> None: ...
    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[ContainerState]: ...
