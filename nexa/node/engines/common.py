"""What the engine drivers share: `EngineApi`, one engine's API as a driver calls it (requests whose
error answers become `nexa.errors`, and the calls libpod and the Docker Engine API make alike), and
the pure parts both dialects read and write alike (spec checks, answers' messages, timestamps, events).

Each driver (`engines.libpod`, `engines.docker`) holds an `EngineApi` over its own `EngineHttp`
(composition): what an answer means for that engine's own calls (a pull's streamed error, a create
that names a missing image) the driver says itself, with the helpers here.
"""

from __future__ import annotations

import builtins
import ipaddress
import json
import logging
import math
import os
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from contextlib import aclosing
from datetime import datetime
from types import TracebackType
from typing import Any, Final, Self, TypeAlias
from urllib.parse import quote

from nexa.contracts.runtime import (
    CAP_IPC_LOCK,
    CDI_NAME_RE,
    IMAGE_BY_DIGEST_RE,
    NETWORK_HOST,
    NETWORK_NONE,
    NETWORK_PRIVATE,
    RDMA_DEVICE_RE,
    STATUS_EXITED,
    ContainerSpec,
    ContainerState,
    EngineEvent,
)
from nexa.errors import ContainerNotFound, ContractError, EngineError, EngineUnavailable, ImageNotFound
from nexa.node.engines.http import READ_TIMEOUT_S, EngineAnswer, EngineHttp
from nexa.oci import RegistryAuths, RegistryCredentials, pull_credentials

log = logging.getLogger(__name__)

#: Pulls and the event stream may be silent for minutes (one big layer, a quiet node): no read timeout
#: (None). Their deadline is the caller's trio cancel scope; other requests wait `READ_TIMEOUT_S`.
STREAM_READ_TIMEOUT_S: Final = None
#: Extra time a stop request may take beyond its own grace period (SIGKILL, cleanup, unmounts).
STOP_MARGIN_S: Final = 30.0
#: What a runtime may write to: /tmp only (a tmpfs; its pages count against the memory limit).
SCRATCH_DIR: Final = "/tmp"  # noqa: S108 - a tmpfs mount point inside the container, not a host path
#: Registry answers that mean "no such repository or manifest" (distribution error codes, lower-cased).
IMAGE_MISSING_MARKERS: Final = ("manifest unknown", "name unknown", "manifest_unknown", "name_unknown")
#: The longest part of an engine's error message a nexa error carries.
MAX_MESSAGE_CHARS: Final = 400
#: Event attributes podman adds next to a container's labels.
_EVENT_ATTRIBUTES: Final = frozenset({"image", "name", "containerExitCode", "podId", "health_status"})
#: Go's zero time, which the engines report for "never".
_ZERO_TIME_PREFIX: Final = "0001-01-01"
#: libpod's `define.ErrNoSuchCtr`: podman answers it with 500, not 404, for a container it is
#: removing at that moment ("container … does not exist in database: no such container"), on its
#: libpod API and on its Docker-compatible one alike (Docker Engine itself answers 404).
_NO_SUCH_CONTAINER: Final = "no such container"

Json: TypeAlias = dict[str, Any]
#: Registry credentials as the drivers take them: fixed, or asked for at each pull.
Credentials: TypeAlias = RegistryAuths | Callable[[], RegistryAuths] | None


def require_digest_reference(image: str) -> None:
    if not IMAGE_BY_DIGEST_RE.match(image):
        raise ContractError(f"image must be named by digest (repository@sha256:<64 hex>), got {image[:200]!r}")


def validate_spec(spec: ContainerSpec) -> None:
    """ContractError naming every field of `spec` no engine driver accepts (before any request)."""
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
    problems.extend(
        f"device_nodes: {host!r} -> {inside!r} must be a device under /dev mapped to an RDMA device node"
        for host, inside in spec.device_nodes
        if not (host.startswith("/dev/") and os.path.normpath(host) == host and RDMA_DEVICE_RE.match(inside))
    )
    problems.extend(
        f"cap_add: {cap!r} is never added back (only {CAP_IPC_LOCK})" for cap in spec.cap_add if cap != CAP_IPC_LOCK
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


def container_path(container_id: str, suffix: str = "") -> str:
    if not container_id:
        raise ContractError("a container id or name is required")
    return f"/containers/{quote(container_id, safe='')}{suffix}"


def label_filters(labels: Mapping[str, str] | None) -> list[str]:
    return [f"{key}={value}" for key, value in sorted((labels or {}).items())]


def labels_match(have: Mapping[str, str], want: Mapping[str, str] | None) -> bool:
    return all(have.get(key) == value for key, value in (want or {}).items())


def digest_of(reference: str) -> str:
    """The `sha256:…` of `repo@sha256:…`; "" for a reference without one."""
    _, sep, digest = reference.partition("@")
    return digest if sep else ""


def _pid(value: object) -> int | None:
    """inspect's `State.Pid`: a positive int, else None (0 while not running; nonsense is unknown)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 22:
        return None
    return value


def _timestamp(value: object) -> float | None:
    """Go's RFC 3339 (nanoseconds, `Z` or an offset) as Unix seconds; None for the zero time."""
    if not isinstance(value, str) or not value or value.startswith(_ZERO_TIME_PREFIX):
        return None
    # Python 3.11 takes at most 6 fractional digits in every form; the engines write 9.
    trimmed = re.sub(r"(\.\d{6})\d+", r"\1", value)
    try:
        return datetime.fromisoformat(trimmed.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def container_state(data: Json, *, image_name: str, image_digest: str, running: bool, status: str) -> ContainerState:
    """An inspect answer (libpod's or Docker's: they agree on these keys) as a `ContainerState`,
    with what the driver found out itself: the image and its proven digest, whether it runs."""
    state = data.get("State") or {}
    config = data.get("Config") or {}
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


def message_of(answer: EngineAnswer) -> str:
    """An error answer's message (libpod's and Docker's `message`, libpod's `cause`), bounded."""
    try:
        data = answer.json()
    except ValueError:
        return answer.text.strip()[:MAX_MESSAGE_CHARS] or f"HTTP {answer.status}"
    if isinstance(data, dict):
        for key in ("message", "cause", "error"):
            if isinstance(data.get(key), str) and data[key]:
                return str(data[key])[:MAX_MESSAGE_CHARS]
    return f"HTTP {answer.status}"


def _vanished(answer: EngineAnswer) -> bool:
    """A 500 whose cause is libpod's "no such container": the container went while we asked."""
    if answer.status != 500:
        return False
    try:
        data = answer.json()
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("cause") == _NO_SUCH_CONTAINER


def json_objects(text: str, engine: str) -> Iterable[Json]:
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
            raise EngineError(f"{engine} answered with a body that is not JSON") from None
        if isinstance(value, dict):
            yield value


def _event(line: str) -> EngineEvent | None:
    line = line.strip()
    if not line:
        return None
    try:
        data = json.loads(line)
    except ValueError:
        log.warning("skipping an event line from the engine that is not JSON (%d bytes)", len(line))
        return None
    if not isinstance(data, dict) or data.get("Type", "container") != "container":
        return None
    actor = data.get("Actor") or {}
    attributes = actor.get("Attributes") or {}
    container_id = actor.get("ID") or data.get("id")
    action = data.get("Action") or data.get("status")
    if not isinstance(container_id, str) or not isinstance(action, str):
        return None
    return EngineEvent(
        container_id=container_id,
        action=action,
        labels={str(k): str(v) for k, v in attributes.items() if k not in _EVENT_ATTRIBUTES},
    )


async def states_of(ids: Iterable[str], inspect: Callable[[str], Awaitable[ContainerState]]) -> list[ContainerState]:
    """Each container inspected; one removed meanwhile is left out."""
    states: list[ContainerState] = []
    for container_id in ids:
        try:
            states.append(await inspect(container_id))
        except ContainerNotFound:
            continue
    return states


class EngineApi:
    """One engine's API as its driver calls it, over the driver's `EngineHttp`.

    `request` turns an error answer into `nexa.errors` (404, or libpod's "no such container" 500,
    into the caller's `missing` type; anything else EngineError naming the status); messages never
    carry a registry credential. The calls both APIs make alike (start, stop, remove, listing, the
    event stream, an image's RepoDigests) are here once.
    """

    def __init__(self, http: EngineHttp, *, engine: str, credentials: Credentials, stop_timeout_param: str) -> None:
        self.http = http
        self.engine = engine
        self._credentials_source = credentials
        self._stop_timeout_param = stop_timeout_param

    def pull_credentials(self, image: str) -> RegistryCredentials | None:
        """The credentials of `image`'s own registry, or None (`oci.pull_credentials`). Asked at
        each pull: a credentials file is re-read when it changed (`oci.registry_credentials`)."""
        return pull_credentials(self._credentials_source, image)

    def scrub(self, message: str) -> str:
        source = self._credentials_source
        auths = source() if callable(source) else source
        for secret in auths.secrets() if auths is not None else ():
            message = message.replace(secret, "***")
        return message

    def error(self, answer: EngineAnswer, what: str, *, missing: type[EngineError] = EngineError) -> EngineError:
        message = self.scrub(message_of(answer))
        if answer.status == 404 or _vanished(answer):
            return missing(f"{what}: {message}")
        return EngineError(f"{what}: {self.engine} answered {answer.status}: {message}")

    def pull_failure(self, text: str, what: str, *, missing_markers: Iterable[str] = IMAGE_MISSING_MARKERS) -> None:
        """Raise the failure a pull's streamed answer reports as an {"error": …} object, if any:
        ImageNotFound where the registry has no such image, else EngineError."""
        for item in json_objects(text, self.engine):
            error = item.get("error")
            if isinstance(error, str) and error:
                message = self.scrub(error)[:MAX_MESSAGE_CHARS]
                if any(marker in error.lower() for marker in missing_markers):
                    raise ImageNotFound(f"{what}: the registry has no such image: {message}")
                raise EngineError(f"{what} failed: {message}")

    async def request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        missing: type[EngineError] = EngineError,
        params: Mapping[str, str] | None = None,
        body: Json | None = None,
        read_timeout_s: float | None = READ_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
    ) -> EngineAnswer:
        answer = await self.http.request(
            method, path, params=params, body=body, headers=headers, read_timeout_s=read_timeout_s
        )
        if answer.status >= 400:
            raise self.error(answer, what, missing=missing)
        return answer

    def json(self, answer: EngineAnswer, what: str) -> Any:
        try:
            return answer.json()
        except ValueError:
            raise EngineError(f"{what}: {self.engine} answered with a body that is not JSON") from None

    async def inspect_data(self, container_id: str) -> Json:
        """A container's inspect document (`GET /containers/{id}/json` in either dialect)."""
        what = f"inspect {container_id}"
        path = container_path(container_id, "/json")
        data = self.json(await self.request("GET", path, what=what, missing=ContainerNotFound), what)
        if not isinstance(data, dict):
            raise EngineError(f"{what}: unexpected answer")
        return data

    async def repo_digests(self, image_id: str) -> list[object] | None:
        """The RepoDigests of a stored image, None when it cannot be inspected (EngineUnavailable
        still raises: the engine is gone, not the image)."""
        try:
            answer = await self.request("GET", f"/images/{quote(image_id, safe='')}/json", what="inspect image")
        except EngineUnavailable:
            raise
        except EngineError:
            return None
        data = self.json(answer, "inspect image")
        repo_digests = data.get("RepoDigests") if isinstance(data, dict) else None
        return repo_digests if isinstance(repo_digests, list) else None

    async def start(self, container_id: str) -> None:
        path = container_path(container_id, "/start")
        await self.request("POST", path, what=f"start {container_id}", missing=ContainerNotFound)
        log.info("started container %s", container_id[:12])

    async def stop(self, container_id: str, *, seconds: int) -> None:
        path = container_path(container_id, "/stop")
        await self.request(
            "POST",
            path,
            what=f"stop {container_id}",
            missing=ContainerNotFound,
            params={self._stop_timeout_param: str(seconds)},
            read_timeout_s=seconds + STOP_MARGIN_S,
        )
        log.info("stopped container %s", container_id[:12])

    async def remove(self, container_id: str, *, force: bool) -> None:
        params = {"force": "true" if force else "false", "v": "true"}
        if force:
            params["timeout"] = "0"
        path = container_path(container_id)
        await self.request("DELETE", path, what=f"remove {container_id}", missing=ContainerNotFound, params=params)
        log.info("removed container %s", container_id[:12])

    async def container_ids(self, labels: Mapping[str, str] | None) -> list[str]:
        """The ids of every container (running or not) carrying all of `labels`."""
        params = {"all": "true"}
        if labels:
            params["filters"] = json.dumps({"label": label_filters(labels)})
        data = self.json(await self.request("GET", "/containers/json", what="list", params=params), "list")
        return [
            str(entry.get("Id") or "")
            for entry in (data if isinstance(data, list) else [])
            if isinstance(entry, dict) and labels_match(entry.get("Labels") or {}, labels)
        ]

    async def events(self, labels: Mapping[str, str], *, since: float | None) -> AsyncGenerator[EngineEvent, None]:
        filters: dict[str, list[str]] = {"type": ["container"]}
        if labels:
            # The engines OR the values of one filter key; every label is checked again below (AND).
            filters["label"] = label_filters(labels)
        params = {"stream": "true", "filters": json.dumps(filters)}
        if since is not None:
            params["since"] = f"{since:.9f}"
        async with self.http.stream("GET", "/events", params=params) as response:
            if response.status >= 400:
                raise self.error(await response.read(), "events")
            async with aclosing(response.lines()) as lines:
                async for line in lines:
                    event = _event(line)
                    if event is not None and labels_match(event.labels, labels):
                        yield event
        raise EngineUnavailable(f"{self.engine}'s event stream ended")


class EngineDriver:
    """What both drivers do through their transport and `EngineApi` alone: enter and leave the
    transport, stop, remove, list and stream events. A driver sets `_http` and `_api` and defines
    `inspect` (each engine reads a container its own way)."""

    _http: EngineHttp
    _api: EngineApi

    async def inspect(self, container_id: str) -> ContainerState:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self._http.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        await self._http.__aexit__(exc_type, exc, tb)

    async def stop(self, container_id: str, *, timeout_s: float) -> None:
        """SIGTERM (the stop signal), then SIGKILL after `timeout_s`; returns once it has exited.
        Stopping a stopped container does nothing.
        """
        if timeout_s < 0:
            raise ContractError("timeout_s must not be negative")
        await self._api.stop(container_id, seconds=math.ceil(timeout_s))

    async def remove(self, container_id: str, *, force: bool = False) -> None:
        """Remove a stopped container (and its anonymous volumes). `force` kills a running one at once."""
        await self._api.remove(container_id, force=force)

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[ContainerState]:
        """Every container (running or not) carrying all of `labels`, each as `inspect` would report it.
        A container removed while listing is left out.
        """
        return await states_of(await self._api.container_ids(labels), self.inspect)

    def events(self, labels: Mapping[str, str], *, since: float | None = None) -> AsyncGenerator[EngineEvent, None]:
        """Container events of containers carrying all of `labels`, as the engine streams them.

        Runs until the caller stops iterating (use `contextlib.aclosing`) or the engine goes away
        (EngineUnavailable). `since` (Unix seconds) replays events from then on first, so a caller
        that resubscribes misses nothing.
        """
        return self._api.events(labels, since=since)
