"""PodmanClient: the node agent's only way to podman, the libpod REST API over podman's unix socket
(through `node.engine_http`, which turns transport failures into `nexa.errors`).

It turns a `ContainerSpec` into a hardened libpod create body and libpod answers into `contracts.runtime`
records, and it translates every podman error status into `nexa.errors` here. It never runs the podman
CLI and never pulls anything but `repo@sha256:…`.
"""

from __future__ import annotations

import base64
import builtins
import ipaddress
import json
import logging
import math
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import aclosing
from datetime import datetime
from types import TracebackType
from typing import Any, ClassVar, Final
from urllib.parse import quote

from nexa.contracts.runtime import (
    CDI_NAME_RE,
    IMAGE_BY_DIGEST_RE,
    NETWORK_HOST,
    NETWORK_NONE,
    NETWORK_PRIVATE,
    STATUS_EXITED,
    ContainerSpec,
    ContainerState,
    HealthProbe,
    PodmanEvent,
)
from nexa.errors import (
    ContainerNotFound,
    ContractError,
    ImageNotFound,
    PodmanError,
    PodmanUnavailable,
)
from nexa.node.engines.http import READ_TIMEOUT_S, EngineAnswer, EngineHttp, EngineTransport
from nexa.oci import RegistryAuths, RegistryCredentials, pull_credentials

log = logging.getLogger(__name__)

#: The libpod API under its versioned prefix; podman 4.0 and later answer it (the host part is ignored on a UDS).
API_BASE: Final = "http://d/v4.0.0/libpod"
#: Pulls and the event stream may be silent for minutes (one big layer, a quiet node): no read timeout
#: (None). Their deadline is the caller's trio cancel scope; other requests wait `READ_TIMEOUT_S`.
STREAM_READ_TIMEOUT_S: Final = None
#: Extra time a stop request may take beyond its own grace period (SIGKILL, cleanup, unmounts).
STOP_MARGIN_S: Final = 30.0
#: CFS period for the CPU limit: quota = cpus * period.
CPU_PERIOD_US: Final = 100_000
#: What a runtime may write to: /tmp only (a tmpfs; its pages count against the memory limit).
SCRATCH_DIR: Final = "/tmp"  # noqa: S108 - a tmpfs mount point inside the container, not a host path
SIGTERM: Final = 15
#: Event attributes podman adds next to a container's labels.
_PODMAN_EVENT_ATTRIBUTES: Final = frozenset({"image", "name", "containerExitCode", "podId", "health_status"})
#: Registry answers that mean "no such repository or manifest" (distribution error codes, lower-cased).
_IMAGE_MISSING_MARKERS: Final = ("manifest unknown", "name unknown", "manifest_unknown", "name_unknown")
#: How a runtime's own network namespace is made (`podman.private_network`). slirp4netns: a user-mode
#: stack per container, so runtimes cannot reach each other; "bridge": netavark's default network
#: (kernel forwarding, faster, but every runtime on it can reach the others' ports).
PRIVATE_SLIRP4NETNS: Final = "slirp4netns"
PRIVATE_BRIDGE: Final = "bridge"
PRIVATE_NETWORKS: Final = (PRIVATE_SLIRP4NETNS, PRIVATE_BRIDGE)
DEFAULT_PRIVATE_NETWORK: Final = PRIVATE_SLIRP4NETNS
#: Go's zero time, which podman reports for "never".
_ZERO_TIME_PREFIX: Final = "0001-01-01"
_MAX_MESSAGE_CHARS: Final = 400

_Json = dict[str, Any]


def _require_digest_reference(image: str) -> None:
    if not IMAGE_BY_DIGEST_RE.match(image):
        raise ContractError(f"image must be named by digest (repository@sha256:<64 hex>), got {image[:200]!r}")


def _nanoseconds(seconds: float) -> int:
    return round(seconds * 1_000_000_000)


def _healthconfig(probe: HealthProbe) -> _Json:
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


def _validate_spec(spec: ContainerSpec) -> None:
    problems: list[str] = []
    if not IMAGE_BY_DIGEST_RE.match(spec.image):
        problems.append("image: must be repository@sha256:<64 hex>")
    if not spec.command or not spec.health.command:
        problems.append("command and health.command: must not be empty")
    if spec.network not in (NETWORK_PRIVATE, NETWORK_HOST, NETWORK_NONE):
        problems.append(f"network: must be 'private', 'host' or 'none', not {spec.network!r}")
    if spec.network == NETWORK_PRIVATE and spec.publish_port:
        if not 1 <= spec.publish_port <= 65535:
            problems.append("publish_port: must be from 1 to 65535")
        if not _is_ip(spec.publish_host):
            problems.append(f"publish_host: must be an IP address, not {spec.publish_host[:100]!r}")
    elif spec.publish_port or spec.publish_host:
        problems.append("publish_host and publish_port: only with the 'private' network")
    problems.extend(f"devices: {d!r} is not a CDI device name" for d in spec.devices if not CDI_NAME_RE.match(d))
    problems.extend(
        f"{field}: {host!r} -> {inside!r} must both be absolute paths"
        for field, pairs in (("ro_mounts", spec.ro_mounts), ("rw_mounts", spec.rw_mounts))
        for host, inside in pairs
        if not (os.path.isabs(host) and os.path.isabs(inside))
    )
    if spec.memory_bytes <= 0 or spec.cpus <= 0 or spec.pids_limit <= 0 or spec.shm_bytes < 0:
        problems.append("memory_bytes, cpus and pids_limit must be positive; shm_bytes must not be negative")
    if spec.stop_timeout_s < 0:
        problems.append("stop_timeout_s: must not be negative")
    if problems:
        raise ContractError(f"container spec {spec.name!r} is invalid: {'; '.join(problems)}", problems=tuple(problems))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _network(spec: ContainerSpec, private_network: str) -> _Json:
    """The namespace keys of the create body: `netns`, and for a private one its published port."""
    if spec.network != NETWORK_PRIVATE:
        return {"netns": {"nsmode": spec.network}}
    body: _Json = {"netns": {"nsmode": private_network}}
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


def create_body(spec: ContainerSpec, *, private_network: str = DEFAULT_PRIVATE_NETWORK) -> _Json:
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
      its own backoff); no image volumes persisted (they become tmpfs).
    """
    limits: _Json = {
        "memory": {"limit": spec.memory_bytes, "swap": spec.memory_bytes},
        "cpu": {"quota": max(1000, round(spec.cpus * CPU_PERIOD_US)), "period": CPU_PERIOD_US},
        "pids": {"limit": spec.pids_limit},
    }
    mounts: list[_Json] = [
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
    body: _Json = {
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
        "cap_add": [],
        "privileged": False,
        "no_new_privileges": True,
        "resource_limits": limits,
        "devices": [{"path": name} for name in spec.devices],
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
    return body


def _label_filters(labels: Mapping[str, str] | None) -> list[str]:
    return [f"{key}={value}" for key, value in sorted((labels or {}).items())]


def _pid(value: object) -> int | None:
    """inspect's `State.Pid`: a positive int, else None (0 while not running; nonsense is unknown)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 22:
        return None
    return value


def _timestamp(value: object) -> float | None:
    """Go's RFC 3339 (nanoseconds, `Z` or an offset) as Unix seconds; None for the zero time."""
    if not isinstance(value, str) or not value or value.startswith(_ZERO_TIME_PREFIX):
        return None
    # Python 3.11 takes at most 6 fractional digits in every form; podman writes 9.
    trimmed = re.sub(r"(\.\d{6})\d+", r"\1", value)
    try:
        return datetime.fromisoformat(trimmed.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _digest_of(reference: str) -> str:
    _, sep, digest = reference.partition("@")
    return digest if sep else ""


def _labels_match(have: Mapping[str, str], want: Mapping[str, str] | None) -> bool:
    return all(have.get(key) == value for key, value in (want or {}).items())


def _podman_message(response: EngineAnswer) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:_MAX_MESSAGE_CHARS] or f"HTTP {response.status}"
    if isinstance(data, dict):
        for key in ("message", "cause", "error"):
            if isinstance(data.get(key), str) and data[key]:
                return str(data[key])[:_MAX_MESSAGE_CHARS]
    return f"HTTP {response.status}"


#: libpod's `define.ErrNoSuchCtr`: podman answers it with 500, not 404, for a container it is
#: removing at that moment ("container … does not exist in database: no such container").
_NO_SUCH_CONTAINER = "no such container"


def _vanished(response: EngineAnswer) -> bool:
    """A 500 whose cause is libpod's "no such container": the container went while we asked."""
    if response.status != 500:
        return False
    try:
        data = response.json()
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("cause") == _NO_SUCH_CONTAINER


def _json_objects(text: str) -> Iterable[_Json]:
    """Each JSON object in a stream of them (newline-separated or not); other values are skipped."""
    decoder = json.JSONDecoder()
    index = 0
    while index < len(text):
        while index < len(text) and text[index].isspace():
            index += 1
        if index >= len(text):
            return
        try:
            value, index = decoder.raw_decode(text, index)
        except ValueError:
            raise PodmanError("podman answered with a body that is not JSON") from None
        if isinstance(value, dict):
            yield value


class PodmanClient:
    """libpod over its unix socket. Use as `async with PodmanClient(socket) as podman:`.

    Every method raises only `nexa.errors`: ContractError for a bad argument (before any request),
    PodmanUnavailable when the socket does not answer, ContainerNotFound / ImageNotFound for a
    missing container or image, PodmanError for every other refusal. Messages never carry credentials.
    """

    #: What messages call the engine and where its API lives: `node.docker` speaks the Docker
    #: Engine dialect over this same transport and error translation.
    ENGINE: ClassVar[str] = "podman"
    BASE_URL: ClassVar[str] = API_BASE
    #: The stop request's grace-period parameter (libpod `timeout`, Docker `t`).
    STOP_TIMEOUT_PARAM: ClassVar[str] = "timeout"

    def __init__(
        self,
        socket_path: str,
        *,
        tls_verify: bool = True,
        credentials: RegistryAuths | Callable[[], RegistryAuths] | None = None,
        transport: EngineTransport | None = None,
        private_network: str = DEFAULT_PRIVATE_NETWORK,
    ) -> None:
        if private_network not in PRIVATE_NETWORKS:
            raise ContractError(
                f"private_network must be one of {', '.join(PRIVATE_NETWORKS)}, not {private_network!r}"
            )
        self._private_network = private_network
        self._socket = socket_path
        self._tls_verify = tls_verify
        self._credentials_source = credentials
        self._http = EngineHttp(socket_path, base_url=self.BASE_URL, engine=self.ENGINE, transport=transport)

    async def __aenter__(self) -> PodmanClient:
        await self._http.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        await self._http.__aexit__(exc_type, exc, tb)

    # -- plumbing ---------------------------------------------------------------------------------

    def _pull_credentials(self, image: str) -> RegistryCredentials | None:
        """The credentials of `image`'s own registry, or None (`oci.pull_credentials`). Asked at
        each pull: a credentials file is re-read when it changed (`oci.registry_credentials`)."""
        return pull_credentials(self._credentials_source, image)

    def _scrub(self, message: str) -> str:
        source = self._credentials_source
        auths = source() if callable(source) else source
        for secret in auths.secrets() if auths is not None else ():
            message = message.replace(secret, "***")
        return message

    def _error(self, response: EngineAnswer, what: str, *, missing: type[PodmanError] = PodmanError) -> PodmanError:
        message = self._scrub(_podman_message(response))
        if response.status == 404 or _vanished(response):
            return missing(f"{what}: {message}")
        return PodmanError(f"{what}: {self.ENGINE} answered {response.status}: {message}")

    async def _request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        missing: type[PodmanError] = PodmanError,
        params: Mapping[str, str] | None = None,
        body: _Json | None = None,
        read_timeout_s: float | None = READ_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
    ) -> EngineAnswer:
        response = await self._http.request(
            method, path, params=params, body=body, headers=headers, read_timeout_s=read_timeout_s
        )
        if response.status >= 400:
            raise self._error(response, what, missing=missing)
        return response

    def _json(self, response: EngineAnswer, what: str) -> Any:
        try:
            return response.json()
        except ValueError:
            raise PodmanError(f"{what}: podman answered with a body that is not JSON") from None

    @staticmethod
    def _container_path(container_id: str, suffix: str = "") -> str:
        if not container_id:
            raise ContractError("a container id or name is required")
        return f"/containers/{quote(container_id, safe='')}{suffix}"

    # -- the API ----------------------------------------------------------------------------------

    async def version(self) -> str:
        """Podman's version (e.g. "4.3.1"); also the cheapest "is podman there" check."""
        data = self._json(await self._request("GET", "/version", what="version"), "version")
        version = data.get("Version") if isinstance(data, dict) else None
        if not isinstance(version, str):
            raise PodmanError("version: podman's answer has no Version")
        return version

    async def pull(self, image: str) -> None:
        """Pull `repo@sha256:<64 hex>` from its registry into podman's store.

        The registry is always asked, so ImageNotFound means the registry has no such repository or
        manifest; layers already stored are not fetched again. PodmanError for any other failure
        (registry down, TLS, authentication). To keep starting containers while the registry is down,
        check `image_exists` first. No read timeout: bound it with a cancel scope.
        """
        _require_digest_reference(image)
        params = {
            "reference": image,
            "tlsVerify": "true" if self._tls_verify else "false",
            "quiet": "true",
            # "missing" would accept any stored image with this digest, whatever its repository.
            "policy": "always",
        }
        headers: dict[str, str] = {}
        # Only the credentials of the image's own registry (podman does the token exchange itself).
        credentials = self._pull_credentials(image)
        if credentials is not None:
            auth = json.dumps({"username": credentials.username, "password": credentials.password})
            headers["X-Registry-Auth"] = base64.urlsafe_b64encode(auth.encode()).decode()
        started = time.monotonic()
        what = f"pull {image}"
        response = await self._request(
            "POST",
            "/images/pull",
            what=what,
            missing=ImageNotFound,
            params=params,
            headers=headers,
            read_timeout_s=STREAM_READ_TIMEOUT_S,
        )
        # libpod answers 200 before it pulls; a failure arrives as {"error": …} in the streamed body.
        for item in _json_objects(response.text):
            error = item.get("error")
            if isinstance(error, str) and error:
                message = self._scrub(error)[:_MAX_MESSAGE_CHARS]
                if any(marker in error.lower() for marker in _IMAGE_MISSING_MARKERS):
                    raise ImageNotFound(f"{what}: the registry has no such image: {message}")
                raise PodmanError(f"{what} failed: {message}")
        log.info("pulled %s in %.2f s", image, time.monotonic() - started)

    async def image_exists(self, image: str) -> bool:
        """Whether podman's store holds `repo@sha256:…` (no registry is asked)."""
        _require_digest_reference(image)
        try:
            await self._request("GET", f"/images/{image}/exists", what=f"image {image}", missing=ImageNotFound)
        except ImageNotFound:
            return False
        return True

    async def create(self, spec: ContainerSpec) -> str:
        """Create (not start) the hardened container `create_body(spec)` describes; returns its id.

        The image must already be in the store (the API never pulls): ImageNotFound otherwise.
        """
        _validate_spec(spec)
        what = f"create container {spec.name}"
        response = await self._http.request(
            "POST", "/containers/create", body=create_body(spec, private_network=self._private_network)
        )
        if response.status >= 400:
            message = self._scrub(_podman_message(response))
            if response.status == 404 or "image not known" in message:
                raise ImageNotFound(f"{what}: image {spec.image} is not in podman's store (pull it first)")
            raise PodmanError(f"{what}: podman answered {response.status}: {message}")
        data = self._json(response, what)
        container_id = data.get("Id") if isinstance(data, dict) else None
        if not isinstance(container_id, str) or not container_id:
            raise PodmanError(f"{what}: podman's answer has no Id")
        log.info("created container %s (%s) from %s", spec.name, container_id[:12], spec.image)
        return container_id

    async def start(self, container_id: str) -> None:
        """Start a created or stopped container; starting a running one does nothing."""
        path = self._container_path(container_id, "/start")
        await self._request("POST", path, what=f"start {container_id}", missing=ContainerNotFound)
        log.info("started container %s", container_id[:12])

    async def inspect(self, container_id: str) -> ContainerState:
        """The container's state, with the exact image digest it runs."""
        what = f"inspect {container_id}"
        path = self._container_path(container_id, "/json")
        data = self._json(await self._request("GET", path, what=what, missing=ContainerNotFound), what)
        if not isinstance(data, dict):
            raise PodmanError(f"{what}: unexpected answer")
        return await self._state(data)

    async def _state(self, data: _Json) -> ContainerState:
        state = data.get("State") or {}
        config = data.get("Config") or {}
        image_name, image_digest = await self._image_of(data)
        running, status = self._run_state(state)
        finished = _timestamp(state.get("FinishedAt"))
        # While podman stops a container it shows `stopping`, Running false and no finish time (or
        # the finish time of an earlier run): not an exit, so no exit code until it is `exited`.
        has_exited = not running and status in STATUS_EXITED and finished is not None
        return ContainerState(
            id=str(data.get("Id") or ""),
            name=str(data.get("Name") or "").lstrip("/"),  # the Docker API names it "/name"
            image_name=image_name,
            image_digest=image_digest,
            labels={str(k): str(v) for k, v in (config.get("Labels") or {}).items()},
            running=running,
            status=status,
            exit_code=int(state.get("ExitCode") or 0) if has_exited else None,
            started_at=_timestamp(state.get("StartedAt")),
            restart_count=int(data.get("RestartCount") or 0),
            pid=_pid(state.get("Pid")) if running else None,
        )

    async def _image_of(self, data: _Json) -> tuple[str, str]:
        """The reference a container was created from, and the digest it proves it runs."""
        image_name = str(data.get("ImageName") or "")
        image_digest = str(data.get("ImageDigest") or "")
        wanted = _digest_of(image_name)
        if wanted and image_digest != wanted and data.get("Image"):
            # A container keeps the digest its image had when first stored; if that image was also
            # stored under another manifest (compressed vs. not), the digest it was created by is
            # still proven when the image's RepoDigests hold exactly the reference (REAL_PARTS §2).
            image_digest = await self._verified_digest(str(data["Image"]), image_name) or image_digest
        return image_name, image_digest

    def _run_state(self, state: _Json) -> tuple[bool, str]:
        """Whether the container runs, and its status (lower case) as this driver reports it."""
        return bool(state.get("Running")), str(state.get("Status") or "").lower()

    async def _verified_digest(self, image_id: str, reference: str) -> str | None:
        try:
            response = await self._request("GET", f"/images/{quote(image_id, safe='')}/json", what="inspect image")
        except PodmanUnavailable:
            raise
        except PodmanError:
            return None
        data = self._json(response, "inspect image")
        repo_digests = data.get("RepoDigests") if isinstance(data, dict) else None
        if isinstance(repo_digests, list) and self._lists(repo_digests, reference):
            return _digest_of(reference)
        return None

    def _lists(self, repo_digests: list[object], reference: str) -> bool:
        """Whether an image's RepoDigests hold exactly `reference`."""
        return reference in repo_digests

    async def healthcheck(self, container_id: str) -> bool:
        """Run the container's probe once, now. True when this run passed; False when it failed or
        the container is not running. Counting failures against retries is the caller's job.
        """
        what = f"healthcheck {container_id}"
        path = self._container_path(container_id, "/healthcheck")
        response = await self._http.request("GET", path)
        if response.status == 409 and "not running" in _podman_message(response):
            return False
        if response.status >= 400:
            raise self._error(response, what, missing=ContainerNotFound)
        data = self._json(response, what)
        if not isinstance(data, dict):
            return False
        # The run just made is the last log entry; its exit code is the answer (podman's overall
        # Status also folds in its own start period and retries).
        log_entries = data.get("Log")
        if isinstance(log_entries, list) and log_entries and isinstance(log_entries[-1], dict):
            return log_entries[-1].get("ExitCode") == 0
        return data.get("Status") == "healthy"

    async def stop(self, container_id: str, *, timeout_s: float) -> None:
        """SIGTERM (the stop signal), then SIGKILL after `timeout_s`; returns once it has exited.
        Stopping a stopped container does nothing.
        """
        if timeout_s < 0:
            raise ContractError("timeout_s must not be negative")
        seconds = math.ceil(timeout_s)
        path = self._container_path(container_id, "/stop")
        await self._request(
            "POST",
            path,
            what=f"stop {container_id}",
            missing=ContainerNotFound,
            params={self.STOP_TIMEOUT_PARAM: str(seconds)},
            read_timeout_s=seconds + STOP_MARGIN_S,
        )
        log.info("stopped container %s", container_id[:12])

    async def remove(self, container_id: str, *, force: bool = False) -> None:
        """Remove a stopped container (and its anonymous volumes). `force` kills a running one at once."""
        params = {"force": "true" if force else "false", "v": "true"}
        if force:
            params["timeout"] = "0"
        path = self._container_path(container_id)
        await self._request("DELETE", path, what=f"remove {container_id}", missing=ContainerNotFound, params=params)
        log.info("removed container %s", container_id[:12])

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[ContainerState]:
        """Every container (running or not) carrying all of `labels`, each as `inspect` would report it.
        A container removed while listing is left out.
        """
        params = {"all": "true"}
        if labels:
            params["filters"] = json.dumps({"label": _label_filters(labels)})
        data = self._json(await self._request("GET", "/containers/json", what="list", params=params), "list")
        states: builtins.list[ContainerState] = []
        for entry in data if isinstance(data, list) else []:
            if not isinstance(entry, dict) or not _labels_match(entry.get("Labels") or {}, labels):
                continue
            try:
                states.append(await self.inspect(str(entry.get("Id") or "")))
            except ContainerNotFound:
                continue
        return states

    async def events(self, labels: Mapping[str, str], *, since: float | None = None) -> AsyncIterator[PodmanEvent]:
        """Container events of containers carrying all of `labels`, as podman streams them (NDJSON).

        Runs until the caller stops iterating (use `contextlib.aclosing`) or podman goes away
        (PodmanUnavailable). `since` (Unix seconds) replays events from then on first, so a caller
        that resubscribes misses nothing.
        """
        filters: dict[str, list[str]] = {"type": ["container"]}
        if labels:
            # libpod ORs the values of one filter key; every label is checked again below (AND).
            filters["label"] = _label_filters(labels)
        params = {"stream": "true", "filters": json.dumps(filters)}
        if since is not None:
            params["since"] = f"{since:.9f}"
        async with self._http.stream("GET", "/events", params=params) as response:
            if response.status >= 400:
                raise self._error(await response.read(), "events")
            async with aclosing(response.lines()) as lines:
                async for line in lines:
                    event = _event(line)
                    if event is not None and _labels_match(event.labels, labels):
                        yield event
        raise PodmanUnavailable("podman's event stream ended")


def _event(line: str) -> PodmanEvent | None:
    line = line.strip()
    if not line:
        return None
    try:
        data = json.loads(line)
    except ValueError:
        log.warning("skipping an event line from podman that is not JSON (%d bytes)", len(line))
        return None
    if not isinstance(data, dict) or data.get("Type", "container") != "container":
        return None
    actor = data.get("Actor") or {}
    attributes = actor.get("Attributes") or {}
    container_id = actor.get("ID") or data.get("id")
    action = data.get("Action") or data.get("status")
    if not isinstance(container_id, str) or not isinstance(action, str):
        return None
    return PodmanEvent(
        container_id=container_id,
        action=action,
        labels={str(k): str(v) for k, v in attributes.items() if k not in _PODMAN_EVENT_ATTRIBUTES},
    )
