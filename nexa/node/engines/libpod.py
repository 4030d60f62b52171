"""LibpodEngine: the node agent's way to podman, the libpod REST API over podman's unix socket.

It turns a `ContainerSpec` into a hardened libpod create body and libpod answers into `contracts.runtime`
records, and it translates every podman error status into `nexa.errors` here (with `engines.common`,
which holds what both engine drivers share; `engines.http` turns transport failures into them). It
never runs the podman CLI and never pulls anything but `repo@sha256:…`.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
from typing import Final

from nexa.contracts.runtime import (
    NETWORK_PRIVATE,
    ContainerSpec,
    ContainerState,
    HealthProbe,
)
from nexa.errors import ContainerNotFound, ContractError, EngineError, ImageNotFound
from nexa.node.engines.common import (
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
from nexa.node.engines.http import EngineHttp, EngineTransport

log = logging.getLogger(__name__)

#: What messages call this engine.
ENGINE: Final = "podman"
#: The libpod API under its versioned prefix; podman 4.0 and later answer it (the host part is ignored on a UDS).
API_BASE: Final = "http://d/v4.0.0/libpod"
#: CFS period for the CPU limit: quota = cpus * period.
CPU_PERIOD_US: Final = 100_000
SIGTERM: Final = 15
#: An unlimited resource limit, as the kernel and the OCI runtime spec (uint64) write it.
RLIM_INFINITY: Final = 2**64 - 1
#: How a runtime's own network namespace is made (`[container] private_network`). slirp4netns: a
#: user-mode stack per container, so runtimes cannot reach each other; "bridge": netavark's default
#: network (kernel forwarding, faster, but every runtime on it can reach the others' ports).
PRIVATE_SLIRP4NETNS: Final = "slirp4netns"
PRIVATE_BRIDGE: Final = "bridge"
PRIVATE_NETWORKS: Final = (PRIVATE_SLIRP4NETNS, PRIVATE_BRIDGE)
DEFAULT_PRIVATE_NETWORK: Final = PRIVATE_SLIRP4NETNS


def _nanoseconds(seconds: float) -> int:
    return round(seconds * 1_000_000_000)


def _healthconfig(probe: HealthProbe) -> Json:
    # Interval 0 turns podman's own periodic runs off (they need systemd timers, and where systemd
    # exists they would run on top of the agent's probes). The agent calls `healthcheck()` on its
    # own schedule and keeps its own start period and retry count, so podman's are neutral: no
    # start period and one retry, and its stored status is simply the last run's result.
    return {
        "Test": ["CMD", *probe.command],
        "Interval": 0,
        "Timeout": _nanoseconds(probe.timeout_s),
        "StartPeriod": 0,
        "Retries": 1,
    }


def _network(spec: ContainerSpec, private_network: str) -> Json:
    """The namespace keys of the create body: `netns`, and for a private one its published port."""
    if spec.network != NETWORK_PRIVATE:
        return {"netns": {"nsmode": spec.network}}
    body: Json = {"netns": {"nsmode": private_network}}
    if private_network == PRIVATE_SLIRP4NETNS:
        # A user-mode stack per container: no path to other runtimes' namespaces, none to the node's
        # loopback (slirp4netns' alias for the host is turned off), no IPv6.
        body["network_options"] = {"slirp4netns": ["allow_host_loopback=false", "enable_ipv6=false"]}
    if spec.publish_port:
        body["portmappings"] = [
            {
                "host_ip": spec.publish_host,
                "host_port": spec.publish_port,
                "container_port": spec.publish_port,
                "protocol": "tcp",
            }
        ]
    return body


def create_body(spec: ContainerSpec, *, private_network: str = DEFAULT_PRIVATE_NETWORK) -> Json:
    """The libpod `SpecGenerator` for `spec`: hardened, with nothing the spec did not ask for.

    libpod silently ignores keys it does not know, so the tests prove each hardening key's effect on a
    running container (inspect, /proc, cgroups), not just that podman accepted the body.
    * image by digest only, with the spec's entrypoint where it sets one (then the image's own never
      runs in front of the command); the read-only root filesystem with a tmpfs /tmp as scratch space,
      and the replica's cache directory (`rw_mounts`: read-write, nosuid, nodev) where the spec has one;
    * every capability dropped, no_new_privileges, podman's default seccomp profile;
    * memory (swap equal to memory: no swap), CPU quota and pids limits; /dev/shm sized when asked;
    * CDI devices by name (`vendor/class=name`) and read-only, nosuid, nodev bind mounts;
    * by default its own network namespace (`private_network`: slirp4netns, or netavark's bridge),
      with the runtime's port published on the node's runtime address only (`publish_host`); the
      node's namespace ("host") only where the runtime registration opts in, or none at all;
      the proxy variables of podman's own environment are not passed in (`httpproxy`);
    * the env exactly as given: podman, the image and CDI devices may add their own (PATH, TERM,
      container, HOME, HOSTNAME, the device's variables), nexa adds nothing;
    * SIGTERM then, after `stop_timeout`, SIGKILL; no restart policy (the supervisor restarts with
      its own backoff); no image volumes persisted (they become tmpfs);
    * for a replica group with `--fabric rdma` only: its RDMA device nodes (`host:container:rwm`,
      parsed as `podman run --device` is), `CAP_IPC_LOCK` added back and RLIMIT_MEMLOCK unlimited.
    """
    limits: Json = {
        "memory": {"limit": spec.memory_bytes, "swap": spec.memory_bytes},
        "cpu": {"quota": max(1000, round(spec.cpus * CPU_PERIOD_US)), "period": CPU_PERIOD_US},
        "pids": {"limit": spec.pids_limit},
    }
    mounts: list[Json] = [
        {"destination": SCRATCH_DIR, "type": "tmpfs", "source": "tmpfs", "options": ["rw", "nosuid", "nodev"]}
    ]
    mounts.extend(
        {"destination": inside, "type": "bind", "source": host, "options": ["ro", "rbind", "nosuid", "nodev"]}
        for host, inside in spec.ro_mounts
    )
    mounts.extend(
        {"destination": inside, "type": "bind", "source": host, "options": ["rw", "rbind", "nosuid", "nodev"]}
        for host, inside in spec.rw_mounts
    )
    body: Json = {
        "name": spec.name,
        "image": spec.image,
        "command": list(spec.command),
        "env": dict(spec.env),
        "env_host": False,
        "httpproxy": False,
        "labels": dict(spec.labels),
        "read_only_filesystem": True,
        "mounts": mounts,
        "image_volume_mode": "tmpfs",
        "cap_drop": ["all"],
        "cap_add": [f"CAP_{cap}" for cap in spec.cap_add],
        "privileged": False,
        "no_new_privileges": True,
        "resource_limits": limits,
        "devices": [{"path": name} for name in spec.devices]
        + [{"path": f"{host}:{inside}:rwm"} for host, inside in spec.device_nodes],
        **_network(spec, private_network),
        "healthconfig": _healthconfig(spec.health),
        "stop_signal": SIGTERM,
        "stop_timeout": math.ceil(spec.stop_timeout_s),
        "restart_policy": "no",
        "systemd": "false",
        "terminal": False,
        "stdin": False,
        "remove": False,
    }
    if spec.shm_bytes:
        body["shm_size"] = spec.shm_bytes
    if spec.entrypoint:
        body["entrypoint"] = list(spec.entrypoint)
    if spec.memlock_unlimited:
        # libpod prefixes the type with RLIMIT_ (pkg/specgen/generate/oci.go); RLIM_INFINITY is all ones.
        body["r_limits"] = [{"type": "memlock", "hard": RLIM_INFINITY, "soft": RLIM_INFINITY}]
    return body


class LibpodEngine(EngineDriver):
    """libpod over its unix socket. Use as `async with LibpodEngine(socket) as podman:`.

    A `ContainerEngine` (`engines.interface`). Every method raises only `nexa.errors`: ContractError
    for a bad argument (before any request), EngineUnavailable when the socket does not answer,
    ContainerNotFound / ImageNotFound for a missing container or image, EngineError for every other
    refusal. Messages never carry credentials.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        tls_verify: bool = True,
        credentials: Credentials = None,
        transport: EngineTransport | None = None,
        private_network: str = DEFAULT_PRIVATE_NETWORK,
    ) -> None:
        if private_network not in PRIVATE_NETWORKS:
            raise ContractError(
                f"private_network must be one of {', '.join(PRIVATE_NETWORKS)}, not {private_network!r}"
            )
        self._private_network = private_network
        self._tls_verify = tls_verify
        self._http = EngineHttp(socket_path, base_url=API_BASE, engine=ENGINE, transport=transport)
        self._api = EngineApi(self._http, engine=ENGINE, credentials=credentials, stop_timeout_param="timeout")

    @property
    def name(self) -> str:
        return ENGINE

    async def version(self) -> str:
        """Podman's version (e.g. "4.3.1"); also the cheapest "is podman there" check."""
        data = self._api.json(await self._api.request("GET", "/version", what="version"), "version")
        version = data.get("Version") if isinstance(data, dict) else None
        if not isinstance(version, str):
            raise EngineError("version: podman's answer has no Version")
        return version

    async def pull(self, image: str) -> None:
        """Pull `repo@sha256:<64 hex>` from its registry into podman's store.

        The registry is always asked, so ImageNotFound means the registry has no such repository or
        manifest; layers already stored are not fetched again. EngineError for any other failure
        (registry down, TLS, authentication). To keep starting containers while the registry is down,
        check `image_exists` first. No read timeout: bound it with a cancel scope.
        """
        require_digest_reference(image)
        params = {
            "reference": image,
            "tlsVerify": "true" if self._tls_verify else "false",
            "quiet": "true",
            # "missing" would accept any stored image with this digest, whatever its repository.
            "policy": "always",
        }
        headers: dict[str, str] = {}
        # Only the credentials of the image's own registry (podman does the token exchange itself).
        credentials = self._api.pull_credentials(image)
        if credentials is not None:
            auth = json.dumps({"username": credentials.username, "password": credentials.password})
            headers["X-Registry-Auth"] = base64.urlsafe_b64encode(auth.encode()).decode()
        started = time.monotonic()
        what = f"pull {image}"
        response = await self._api.request(
            "POST",
            "/images/pull",
            what=what,
            missing=ImageNotFound,
            params=params,
            headers=headers,
            read_timeout_s=STREAM_READ_TIMEOUT_S,
        )
        # libpod answers 200 before it pulls; a failure arrives as {"error": …} in the streamed body.
        self._api.pull_failure(response.text, what)
        log.info("pulled %s in %.2f s", image, time.monotonic() - started)

    async def image_exists(self, image: str) -> bool:
        """Whether podman's store holds `repo@sha256:…` (no registry is asked)."""
        require_digest_reference(image)
        try:
            await self._api.request("GET", f"/images/{image}/exists", what=f"image {image}", missing=ImageNotFound)
        except ImageNotFound:
            return False
        return True

    async def create(self, spec: ContainerSpec) -> str:
        """Create (not start) the hardened container `create_body(spec)` describes; returns its id.

        The image must already be in the store (the API never pulls): ImageNotFound otherwise.
        """
        validate_spec(spec)
        what = f"create container {spec.name}"
        response = await self._http.request(
            "POST", "/containers/create", body=create_body(spec, private_network=self._private_network)
        )
        if response.status >= 400:
            message = self._api.scrub(message_of(response))
            if response.status == 404 or "image not known" in message:
                raise ImageNotFound(f"{what}: image {spec.image} is not in podman's store (pull it first)")
            raise EngineError(f"{what}: podman answered {response.status}: {message}")
        data = self._api.json(response, what)
        container_id = data.get("Id") if isinstance(data, dict) else None
        if not isinstance(container_id, str) or not container_id:
            raise EngineError(f"{what}: podman's answer has no Id")
        log.info("created container %s (%s) from %s", spec.name, container_id[:12], spec.image)
        return container_id

    async def start(self, container_id: str) -> None:
        """Start a created or stopped container; starting a running one does nothing."""
        await self._api.start(container_id)

    async def inspect(self, container_id: str) -> ContainerState:
        """The container's state, with the exact image digest it runs."""
        data = await self._api.inspect_data(container_id)
        state = data.get("State") or {}
        image_name = str(data.get("ImageName") or "")
        image_digest = str(data.get("ImageDigest") or "")
        wanted = digest_of(image_name)
        if wanted and image_digest != wanted and data.get("Image"):
            # A container keeps the digest its image had when first stored; if that image was also
            # stored under another manifest (compressed vs. not), the digest it was created by is
            # still proven when the image's RepoDigests hold exactly the reference (REAL_PARTS §2).
            repo_digests = await self._api.repo_digests(str(data["Image"]))
            if repo_digests is not None and image_name in repo_digests:
                image_digest = wanted
        return container_state(
            data,
            image_name=image_name,
            image_digest=image_digest,
            running=bool(state.get("Running")),
            status=str(state.get("Status") or "").lower(),
        )

    async def healthcheck(self, container_id: str) -> bool:
        """Run the container's probe once, now. True when this run passed; False when it failed or
        the container is not running. Counting failures against retries is the caller's job.
        """
        what = f"healthcheck {container_id}"
        response = await self._http.request("GET", container_path(container_id, "/healthcheck"))
        if response.status == 409 and "not running" in message_of(response):
            return False
        if response.status >= 400:
            raise self._api.error(response, what, missing=ContainerNotFound)
        data = self._api.json(response, what)
        if not isinstance(data, dict):
            return False
        # The run just made is the last log entry; its exit code is the answer (podman's overall
        # Status also folds in its own start period and retries).
        log_entries = data.get("Log")
        if isinstance(log_entries, list) and log_entries and isinstance(log_entries[-1], dict):
            return log_entries[-1].get("ExitCode") == 0
        return data.get("Status") == "healthy"
