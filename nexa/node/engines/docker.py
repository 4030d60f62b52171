"""DockerEngine: the node agent's way to Docker Engine (and to podman's Docker-compatible API) over the
engine's unix socket.

It shares the libpod driver's transport (`engines.http`) and what both APIs say alike (`engines.common`:
error translation, listing, start/stop/remove, events) and speaks the Docker Engine dialect where the
two differ: the create body, pulls (`/images/create`), inspect (digest proven from the image's
RepoDigests), and health probes run through `exec`. It asks for nothing the libpod driver would not:
a spec podman would refuse is refused here too.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import math
import time
from typing import Final
from urllib.parse import quote

import trio

from nexa.contracts.runtime import (
    NETWORK_PRIVATE,
    ContainerSpec,
    ContainerState,
    HealthProbe,
)
from nexa.errors import ContainerNotFound, ContractError, EngineError, ImageNotFound
from nexa.node.engines.common import (
    IMAGE_MISSING_MARKERS,
    SCRATCH_DIR,
    STREAM_READ_TIMEOUT_S,
    Credentials,
    EngineApi,
    EngineDriver,
    Json,
    container_path,
    container_state,
    digest_of,
    message_of,
    require_digest_reference,
    validate_spec,
)
from nexa.node.engines.http import EngineAnswer, EngineHttp, EngineTransport

log = logging.getLogger(__name__)

#: What messages call this engine.
ENGINE: Final = "docker"
#: Unversioned paths: the engine answers in its own newest dialect (Docker and podman both do).
DOCKER_BASE: Final = "http://d"
#: The oldest Docker Engine API this driver speaks (Docker 20.10, Debian 12's docker.io).
MIN_API_VERSION: Final = (1, 41)
#: How podman's Docker-compatible API names itself in /version's Components.
PODMAN_COMPONENT: Final = "Podman Engine"
#: Device requests with the "cdi" driver exist from API 1.44 (Docker 25) on.
CDI_API_VERSION: Final = (1, 44)
GPU_CDI: Final = "cdi"
GPU_NVIDIA_RUNTIME: Final = "nvidia-runtime"
GPU_METHODS: Final = (GPU_CDI, GPU_NVIDIA_RUNTIME)
#: The CDI kind the NVIDIA Container Toolkit generates; the NVIDIA runtime takes its device names.
NVIDIA_CDI_KIND: Final = "nvidia.com/gpu"
#: The label holding the probe (JSON: command, timeout_s) that `healthcheck` runs through `exec`.
#: Not the engine's Healthcheck: podman's Docker API gives its Test back split at spaces, and
#: Docker would also run it on its own schedule.
LABEL_PROBE: Final = "nexa.probe"
#: How often a probe's exec is polled for its exit code.
EXEC_POLL_S: Final = 0.05
DEFAULT_DOCKER_NETWORK: Final = "bridge"


def _api_version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    try:
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def _registry_of(image: str) -> str:
    first, sep, _ = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def _nvidia_request(devices: list[str]) -> Json:
    """The NVIDIA runtime's device request for CDI names `nvidia.com/gpu=<index|uuid|all>`."""
    ids: list[str] = []
    for device in devices:
        kind, _, name = device.partition("=")
        if kind != NVIDIA_CDI_KIND:
            raise ContractError(
                f"devices: {device!r} is not an NVIDIA GPU (the nvidia runtime takes {NVIDIA_CDI_KIND}=…)"
            )
        ids.append(name)
    request: Json = {"Driver": "nvidia", "Capabilities": [["gpu"]]}
    if "all" in ids:
        request["Count"] = -1
    else:
        request["DeviceIDs"] = ids
    return request


def _device_requests(spec: ContainerSpec, gpu_method: str) -> list[Json]:
    if not spec.devices:
        return []
    if gpu_method == GPU_NVIDIA_RUNTIME:
        return [_nvidia_request(spec.devices)]
    return [{"Driver": "cdi", "DeviceIDs": list(spec.devices)}]


def _probe_label(probe: HealthProbe) -> str:
    return json.dumps({"command": list(probe.command), "timeout_s": probe.timeout_s}, separators=(",", ":"))


def _probe_of(labels: object) -> tuple[list[str], float] | None:
    """The probe `_probe_label` stored; None when absent or not what this driver writes."""
    raw = labels.get(LABEL_PROBE) if isinstance(labels, dict) else None
    try:
        data = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    command, timeout_s = data.get("command"), data.get("timeout_s")
    if not isinstance(command, list) or not command or not all(isinstance(arg, str) for arg in command):
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= 3600:
        return None
    return command, float(timeout_s)


def docker_create_body(
    spec: ContainerSpec, *, gpu_method: str = GPU_CDI, network: str = DEFAULT_DOCKER_NETWORK
) -> Json:
    """The Docker Engine `ContainerCreateRequest` for `spec`, key for key what `podman.create_body` asks:

    * image by digest only; read-only root with a tmpfs /tmp (rw, nosuid, nodev) as the only scratch;
    * every capability dropped, `no-new-privileges`, not privileged, the engine's default seccomp;
    * memory with swap equal to it (no swap), NanoCpus, PidsLimit; ShmSize when asked;
    * read-only bind mounts for the model, a read-write one for the replica's cache (`rw_mounts`);
      no init, no restart policy, no auto-remove;
    * GPUs as device requests: CDI names (`Driver: cdi`, Docker ≥ 25) or the NVIDIA runtime's
      (`Driver: nvidia`, `Capabilities: [[gpu]]`), as `gpu_method` says;
    * by default the Docker network `network` (its own namespace), the port published on
      `publish_host` only; `host` or `none` where the spec says so;
    * the env exactly as given; SIGTERM, then SIGKILL after the stop timeout;
    * for a replica group with `--fabric rdma` only: its RDMA device nodes (`Devices`), `CAP_IPC_LOCK`
      added back and an unlimited `memlock` ulimit (-1, as `docker run --ulimit memlock=-1` gives it).
    """
    host: Json = {
        "ReadonlyRootfs": True,
        "Tmpfs": {SCRATCH_DIR: "rw,nosuid,nodev"},
        "Mounts": [
            {"Type": "bind", "Source": src, "Target": dst, "ReadOnly": True, "BindOptions": {"Propagation": "rprivate"}}
            for src, dst in spec.ro_mounts
        ]
        + [
            # The Engine API takes no nosuid/nodev for a bind mount; with every capability dropped
            # (no CAP_MKNOD) and no-new-privileges, no device node can be made there and no set-uid
            # file gains anything.
            {
                "Type": "bind",
                "Source": src,
                "Target": dst,
                "ReadOnly": False,
                "BindOptions": {"Propagation": "rprivate"},
            }
            for src, dst in spec.rw_mounts
        ],
        "CapDrop": ["ALL"],
        "CapAdd": [f"CAP_{cap}" for cap in spec.cap_add],
        "Privileged": False,
        "SecurityOpt": ["no-new-privileges"],
        "Memory": spec.memory_bytes,
        "MemorySwap": spec.memory_bytes,
        "NanoCpus": max(1_000_000, round(spec.cpus * 1_000_000_000)),
        "PidsLimit": spec.pids_limit,
        "RestartPolicy": {"Name": "no"},
        "AutoRemove": False,
        "Init": False,
        "PublishAllPorts": False,
        "NetworkMode": network if spec.network == NETWORK_PRIVATE else spec.network,
        "DeviceRequests": _device_requests(spec, gpu_method),
    }
    if spec.shm_bytes:
        host["ShmSize"] = spec.shm_bytes
    if spec.device_nodes:
        host["Devices"] = [
            {"PathOnHost": src, "PathInContainer": dst, "CgroupPermissions": "rwm"} for src, dst in spec.device_nodes
        ]
    if spec.memlock_unlimited:
        host["Ulimits"] = [{"Name": "memlock", "Soft": -1, "Hard": -1}]
    body: Json = {
        "Image": spec.image,
        "Cmd": list(spec.command),
        "Env": [f"{key}={value}" for key, value in spec.env.items()],
        "Labels": {**spec.labels, LABEL_PROBE: _probe_label(spec.health)},
        # No engine-run checks (nor the image's HEALTHCHECK): the agent runs the probe itself.
        "Healthcheck": {"Test": ["NONE"]},
        "StopSignal": "SIGTERM",
        "StopTimeout": math.ceil(spec.stop_timeout_s),
        "Tty": False,
        "OpenStdin": False,
        "AttachStdin": False,
        "HostConfig": host,
    }
    if spec.entrypoint:
        body["Entrypoint"] = list(spec.entrypoint)
    if spec.network == NETWORK_PRIVATE and spec.publish_port:
        port = f"{spec.publish_port}/tcp"
        body["ExposedPorts"] = {port: {}}
        host["PortBindings"] = {port: [{"HostIp": spec.publish_host, "HostPort": str(spec.publish_port)}]}
    return body


def _familiar(reference: str) -> str:
    """Docker shows Docker Hub references without `docker.io/` (and `library/`)."""
    for prefix in ("docker.io/library/", "docker.io/"):
        if reference.startswith(prefix):
            return reference[len(prefix) :]
    return reference


class DockerEngine(EngineDriver):
    """Docker Engine over its unix socket. Use as `async with DockerEngine(socket) as docker:`.

    A `ContainerEngine` (`engines.interface`) raising only `nexa.errors`, exactly as `LibpodEngine`.
    `tls_verify` cannot be passed per pull (the daemon owns TLS: `insecure-registries`,
    `/etc/docker/certs.d`), so with it on a pull from a registry the daemon treats as insecure is
    refused instead of made.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        tls_verify: bool = True,
        credentials: Credentials = None,
        transport: EngineTransport | None = None,
        gpu_method: str = GPU_CDI,
        network: str = DEFAULT_DOCKER_NETWORK,
    ) -> None:
        if gpu_method not in GPU_METHODS:
            raise ContractError(f"gpu_method must be one of {', '.join(GPU_METHODS)}, not {gpu_method!r}")
        if not network or network in ("host", "none"):
            raise ContractError(f"network must name a Docker network for private runtimes, not {network!r}")
        self._tls_verify = tls_verify
        self._http = EngineHttp(socket_path, base_url=DOCKER_BASE, engine=ENGINE, transport=transport)
        self._api = EngineApi(self._http, engine=ENGINE, credentials=credentials, stop_timeout_param="t")
        self._gpu_method = gpu_method
        self._network = network
        self._api_seen: tuple[int, int] | None = None
        self._is_podman = False

    @property
    def name(self) -> str:
        return ENGINE

    @property
    def gpu_method(self) -> str:
        return self._gpu_method

    async def version(self) -> str:
        """The engine's version (e.g. "20.10.24"); EngineError for an API older than 1.41."""
        data = self._api.json(await self._api.request("GET", "/version", what="version"), "version")
        version = data.get("Version") if isinstance(data, dict) else None
        api = data.get("ApiVersion") if isinstance(data, dict) else None
        if not isinstance(version, str) or not isinstance(api, str):
            raise EngineError("version: docker's answer has no Version and ApiVersion")
        self._api_seen = _api_version(api)
        components = data.get("Components")
        self._is_podman = isinstance(components, list) and any(
            isinstance(c, dict) and c.get("Name") == PODMAN_COMPONENT for c in components
        )
        if self._api_seen < MIN_API_VERSION:
            raise EngineError(f"version: Docker Engine API {api} is older than 1.41 (Docker 20.10)")
        return version

    async def _api_version(self) -> tuple[int, int]:
        if self._api_seen is None:
            await self.version()
        assert self._api_seen is not None
        return self._api_seen

    async def _refuse_insecure(self, image: str) -> None:
        """With tls_verify on, refuse a registry the daemon would reach without verified TLS."""
        registry = _registry_of(image)
        data = self._api.json(await self._api.request("GET", "/info", what="info"), "info")
        config = (data.get("RegistryConfig") or {}) if isinstance(data, dict) else {}
        index = (config.get("IndexConfigs") or {}).get(registry)
        insecure = isinstance(index, dict) and index.get("Secure") is False
        if index is None:
            host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
            host = "127.0.0.1" if host == "localhost" else host.strip("[]")
            try:
                address = ipaddress.ip_address(host)
            except ValueError:
                address = None
            if address is not None:
                for cidr in config.get("InsecureRegistryCIDRs") or []:
                    with_cidr = ipaddress.ip_network(str(cidr), strict=False)
                    if address.version == with_cidr.version and address in with_cidr:
                        insecure = True
        if insecure:
            raise EngineError(
                f"pull {image}: docker treats registry {registry} as insecure (plain HTTP or unverified TLS) "
                "but registry_tls_verify is on"
            )

    async def pull(self, image: str) -> None:
        """Pull `repo@sha256:<64 hex>` (the registry is always asked, as with podman's `policy=always`)."""
        require_digest_reference(image)
        if self._tls_verify:
            await self._refuse_insecure(image)
        headers: dict[str, str] = {}
        # Only the credentials of the image's own registry (dockerd does the token exchange itself).
        credentials = self._api.pull_credentials(image)
        if credentials is not None:
            auth = json.dumps(
                {
                    "username": credentials.username,
                    "password": credentials.password,
                    "serveraddress": _registry_of(image),
                }
            )
            headers["X-Registry-Auth"] = base64.urlsafe_b64encode(auth.encode()).decode()
        started = time.monotonic()
        what = f"pull {image}"
        response = await self._api.request(
            "POST",
            "/images/create",
            what=what,
            missing=ImageNotFound,
            # tlsVerify: podman's Docker API honours it (Docker ignores it; its daemon owns TLS).
            params={"fromImage": image, "tlsVerify": "true" if self._tls_verify else "false"},
            headers=headers,
            read_timeout_s=STREAM_READ_TIMEOUT_S,
        )
        # 200 first, then progress objects; a failure is an {"error": …} object in the stream.
        self._api.pull_failure(response.text, what, missing_markers=(*IMAGE_MISSING_MARKERS, "not found"))
        log.info("pulled %s in %.2f s", image, time.monotonic() - started)

    async def image_exists(self, image: str) -> bool:
        """Whether the engine stores `repo@sha256:…` under exactly that reference (no registry is asked)."""
        require_digest_reference(image)
        try:
            response = await self._api.request(
                "GET", f"/images/{quote(image, safe='')}/json", what=f"image {image}", missing=ImageNotFound
            )
        except ImageNotFound:
            return False
        data = self._api.json(response, f"image {image}")
        digests = data.get("RepoDigests") if isinstance(data, dict) else None
        return isinstance(digests, list) and _familiar(image) in {_familiar(str(d)) for d in digests}

    async def create(self, spec: ContainerSpec) -> str:
        """Create (not start) the hardened container `docker_create_body(spec)` describes; returns its id."""
        validate_spec(spec)
        what = f"create container {spec.name}"
        body = docker_create_body(spec, gpu_method=self._gpu_method, network=self._network)
        if spec.devices:
            await self._api_version()  # also learns whether podman answers
        if spec.devices and self._is_podman:
            # podman's Docker API drops NVIDIA device requests and has no CDI ones: the runtime would
            # run without its GPU. libpod takes CDI names.
            raise EngineError(f'{what}: podman\'s Docker API cannot give GPUs: set [container] engine = "podman"')
        if spec.devices and self._gpu_method == GPU_CDI and await self._api_version() < CDI_API_VERSION:
            # An older engine would refuse the driver, or (podman's Docker API) drop the devices.
            raise EngineError(
                f"{what}: this engine's API has no CDI device requests (Docker 25 and later): "
                "upgrade it or set [container] gpu_method = nvidia-runtime"
            )
        response = await self._http.request("POST", "/containers/create", params={"name": spec.name}, body=body)
        if response.status >= 400:
            message = self._api.scrub(message_of(response))
            if response.status == 404 and "image" in message.lower():
                raise ImageNotFound(f"{what}: image {spec.image} is not in docker's store (pull it first)")
            raise EngineError(f"{what}: docker answered {response.status}: {message}")
        data = self._api.json(response, what)
        container_id = data.get("Id") if isinstance(data, dict) else None
        if not isinstance(container_id, str) or not container_id:
            raise EngineError(f"{what}: docker's answer has no Id")
        log.info("created container %s (%s) from %s", spec.name, container_id[:12], spec.image)
        return container_id

    async def start(self, container_id: str) -> None:
        """Start a created or stopped container; starting a running one does nothing."""
        await self._api.start(container_id)

    async def inspect(self, container_id: str) -> ContainerState:
        """The container's state, with the image digest it runs where the image proves it."""
        data = await self._api.inspect_data(container_id)
        state = data.get("State") or {}
        image_name = str((data.get("Config") or {}).get("Image") or "")
        image_digest = ""
        if digest_of(image_name) and data.get("Image"):
            # Docker keeps no manifest digest on the container: it is proven only when the image it
            # runs (by id) is stored under exactly the reference it was created from (Docker Hub
            # references come back in their short, "familiar", form).
            repo_digests = await self._api.repo_digests(str(data["Image"]))
            if repo_digests is not None and _familiar(image_name) in {_familiar(str(d)) for d in repo_digests}:
                image_digest = digest_of(image_name)
        # Docker counts a paused container as running; podman (and the supervisor) do not.
        paused = bool(state.get("Paused"))
        return container_state(
            data,
            image_name=image_name,
            image_digest=image_digest,
            running=bool(state.get("Running")) and not paused,
            status="paused" if paused else str(state.get("Status") or "").lower(),
        )

    async def healthcheck(self, container_id: str) -> bool:
        """Run the container's stored probe once, now, through `exec`: True when it exited 0 within
        its timeout; False when it failed, timed out or the container is not running.
        """
        what = f"healthcheck {container_id}"
        data = await self._api.inspect_data(container_id)
        config = data.get("Config") or {}
        probe = _probe_of(config.get("Labels"))
        if probe is None:
            raise EngineError(f"{what}: the container has no {LABEL_PROBE} label (not created by this driver)")
        command, timeout_s = probe
        state = data.get("State") or {}
        if not state.get("Running") or state.get("Paused"):
            return False
        response = await self._http_checked(
            "POST",
            container_path(container_id, "/exec"),
            what,
            {"Cmd": command, "AttachStdout": True, "AttachStderr": True, "Tty": False},
        )
        if response is None:
            return False
        exec_id = self._api.json(response, what).get("Id")
        if not isinstance(exec_id, str) or not exec_id:
            raise EngineError(f"{what}: docker's answer has no exec Id")
        exec_path = f"/exec/{quote(exec_id, safe='')}"
        with trio.move_on_after(timeout_s):
            # Attached (not detached): the answer ends when the probe does (podman 4.3's Docker API
            # never marks a detached exec as ended). Its output is read and dropped, never kept.
            if not await self._run_attached(f"{exec_path}/start", what):
                return False
            while True:
                result = self._api.json(await self._api.request("GET", f"{exec_path}/json", what=what), what)
                if isinstance(result, dict) and not result.get("Running") and result.get("ExitCode") is not None:
                    return result.get("ExitCode") == 0
                await trio.sleep(EXEC_POLL_S)
        return False

    async def _run_attached(self, path: str, what: str) -> bool:
        """Start an exec attached and read its output stream to the end; False on 409 (cannot run)."""
        async with self._http.stream("POST", path, body={"Detach": False, "Tty": False}) as response:
            if response.status == 409:
                return False
            if response.status >= 400:
                raise self._api.error(await response.read(), what, missing=ContainerNotFound)
            await response.drain()
        return True

    async def _http_checked(self, method: str, path: str, what: str, body: Json) -> EngineAnswer | None:
        """A request whose 409 ("is not running", "is paused") means the probe cannot run: None."""
        response = await self._http.request(method, path, body=body)
        if response.status == 409:
            return None
        if response.status >= 400:
            raise self._api.error(response, what, missing=ContainerNotFound)
        return response

    async def cdi_spec_dirs(self) -> list[str] | None:
        """`CDISpecDirs` of `GET /info`: where the daemon reads CDI specs, empty when CDI is off
        (Docker 25-27 without `"features": {"cdi": true}`); None from a daemon that predates it."""
        data = self._api.json(await self._api.request("GET", "/info", what="info"), "info")
        dirs = data.get("CDISpecDirs") if isinstance(data, dict) else None
        if not isinstance(dirs, list):
            return None
        return [str(d) for d in dirs]
