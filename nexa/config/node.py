"""The node agent's configuration (`nexa node --config`): `NodeConfig` and its sections, and the
old `[podman]` keys read into `[container]`."""

from __future__ import annotations

import enum
import ipaddress
import logging
import math
import re
from typing import Any, NewType

import attrs
import cattrs

from nexa.config.common import Bytes, LogConfig, Seconds, zmq_endpoint
from nexa.errors import ConfigError

log = logging.getLogger(__name__)


class LeaseExpiryPolicy(enum.StrEnum):
    """What a node does with its runtimes when its assignment lease lapses without renewal."""

    KEEP_SERVING = "keep_serving"
    STOP = "stop"


def _gpu_method(instance: ContainerConfig, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in ("cdi", "nvidia-runtime"):
        raise ValueError(f"{attribute.name} must be 'cdi' or 'nvidia-runtime', not {value!r}")
    if instance.engine == "podman" and value != "cdi":
        raise ValueError(f"{attribute.name}: podman takes GPUs by CDI name only (gpu_method = 'cdi')")


@attrs.frozen(kw_only=True)
class ContainerConfig:
    """The container engine that runs the runtimes (`[container]`): which one, where its socket is,
    how GPUs and networks reach runtimes, and the registry it pulls their images from. The keys of
    the old `[podman]` table are read too (`moved_podman_keys`)."""

    #: "podman" (libpod REST API) or "docker" (Docker Engine API; also podman's Docker-compatible one).
    engine: str = attrs.field(default="podman", validator=attrs.validators.in_(("podman", "docker")))
    #: The engine's unix socket. Empty: /run/podman/podman.sock for podman (rootful), /var/run/docker.sock for docker.
    socket: str = ""
    #: "cdi" (CDI device names; Docker 25 or later with CDI enabled) or "nvidia-runtime" (Docker's
    #: NVIDIA runtime device requests, `nvidia.com/gpu=<index|uuid|all>` names only). docker only.
    gpu_method: str = attrs.field(default="cdi", validator=_gpu_method)
    #: With docker: the Docker network private runtimes join (their own namespace; the port is
    #: published on runtime_host only). Not "host" or "none".
    docker_network: str = attrs.field(
        default="bridge", validator=attrs.validators.not_(attrs.validators.in_(("", "host", "none")))
    )

    #: Verify the registry's TLS certificate when pulling (turn off only for a loopback test registry).
    registry_tls_verify: bool = True
    #: Optional JSON file {"auths": {"HOST[:PORT]": {"username": …, "password": …}}} (as `[oci]
    #: credentials_file`); the engine is handed an entry only to pull from that registry. Never logged.
    registry_credentials_file: str = ""
    #: Leave runtime containers running when the agent stops (they are adopted on its next start).
    leave_running_on_exit: bool = True
    #: podman only: how each runtime's own network namespace is made: "slirp4netns" (a user-mode
    #: stack per container: runtimes cannot reach each other) or "bridge" (netavark's default
    #: network: kernel forwarding, but runtimes on it reach each other's ports). Runtimes registered
    #: with `host_network` use the node's namespace instead.
    private_network: str = attrs.field(default="slirp4netns", validator=attrs.validators.in_(("slirp4netns", "bridge")))

    @property
    def socket_path(self) -> str:
        if self.socket:
            return self.socket
        return PODMAN_SOCKET if self.engine == "podman" else DOCKER_SOCKET


#: The engines' sockets where `[container] socket` is empty.
PODMAN_SOCKET = "/run/podman/podman.sock"
DOCKER_SOCKET = "/var/run/docker.sock"
#: The keys of the deprecated `[podman]` table, each now a `[container]` key of the same name.
_PODMAN_KEYS = (
    "socket",
    "registry_tls_verify",
    "registry_credentials_file",
    "leave_running_on_exit",
    "private_network",
)


def moved_podman_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A node config with the deprecated `[podman]` table's keys moved into `[container]`, logging
    one deprecation line per key. ConfigError for a key set in both tables, or one `[podman]` never had.

    `[podman] socket` was podman's socket only: with `engine = "docker"` it was never read, so it
    is dropped (with a line saying so) rather than pointing Docker at podman's socket.
    """
    if "podman" not in data:
        return data
    podman, container = data["podman"], data.get("container", {})
    if not isinstance(podman, dict) or not isinstance(container, dict):
        return data  # not tables: structuring names the bad value
    problems = [
        f"podman.{key}: unknown key ([podman] is deprecated: write the engine's settings in [container])"
        for key in podman
        if key not in _PODMAN_KEYS
    ]
    problems.extend(
        f"podman.{key}: also set as container.{key}: [podman] is deprecated, keep only [container] {key}"
        for key in podman
        if key in _PODMAN_KEYS and key in container
    )
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems), problems=tuple(problems))
    moved = dict(container)
    for key, value in podman.items():
        if key == "socket" and container.get("engine") == "docker":
            log.warning('[podman] socket is deprecated and not read with [container] engine = "docker": delete it')
            continue
        log.warning("[podman] %s is deprecated: write it as [container] %s", key, key)
        moved[key] = value
    rest = {key: value for key, value in data.items() if key != "podman"}
    return {**rest, "container": moved}


@attrs.frozen(kw_only=True)
class ArtifactsConfig:
    """Where model artifacts come from (an S3-compatible store) and where they are cached."""

    #: Empty means `<state_dir>/artifacts`.
    cache_dir: str = ""
    #: Least-recently-used artifacts are evicted above this size (ones in use are kept).
    cache_max_bytes: Bytes = Bytes(500 * 1024**3)
    #: e.g. https://s3.internal:8333; path-style requests.
    s3_endpoint: str = ""
    s3_region: str = "us-east-1"
    #: JSON {"access_key_id": …, "secret_access_key": …} or an AWS shared-credentials (INI) file;
    #: re-read when it changes, never logged. Empty: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, else anonymous.
    s3_credentials_file: str = ""
    #: The profile (section) of an INI credentials file.
    s3_profile: str = "default"
    s3_tls_verify: bool = True
    #: Files of one model (and of all models being fetched) downloaded at once.
    parallel_downloads: int = attrs.field(default=4, validator=[attrs.validators.ge(1), attrs.validators.le(64)])


@attrs.frozen(kw_only=True)
class CacheConfig:
    """Each replica's writable cache (`node.runtime_cache`), kept on the node's disk across restarts."""

    #: Empty means `<state_dir>/runtime-cache`.
    runtime_cache_dir: str = ""
    #: Least-recently-used caches no replica holds are removed above this size.
    runtime_cache_max_bytes: Bytes = Bytes(100 * 1024**3)
    #: A replica starts only with this much free on the caches' filesystem (after eviction).
    runtime_cache_start_free_bytes: Bytes = Bytes(2 * 1024**3)
    #: How often the caches are measured (and evicted above the bound).
    runtime_cache_measure_interval_s: Seconds = Seconds(30.0)


@attrs.frozen(kw_only=True)
class SupervisorConfig:
    """Runtime supervision: probes, restarts, crash loops."""

    #: First wait before restarting a crashed runtime; doubles up to the maximum.
    restart_backoff_initial_s: Seconds = Seconds(1.0)
    restart_backoff_max_s: Seconds = Seconds(60.0)
    #: This many crashes within `crash_loop_window_s` is reported as a crash loop.
    crash_loop_restarts: int = 5
    crash_loop_window_s: Seconds = Seconds(300.0)
    #: How often desired and actual containers are compared even without a change.
    reconcile_interval_s: Seconds = Seconds(5.0)


def _loopback(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    try:
        loopback = ipaddress.ip_address(value).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{attribute.name} must be a loopback IP address (127.0.0.0/8 or ::1)")


@attrs.frozen(kw_only=True)
class RelayConfig:
    """The node's inference relay: controller requests to local runtimes over loopback HTTP."""

    #: Requests the node relays at once; more are refused with `node_busy` (the controller retries elsewhere).
    max_inflight: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    #: Connecting to a local runtime.
    connect_timeout_s: Seconds = Seconds(2.0)
    #: Most bytes of runtime output coalesced into one chunk frame.
    max_chunk_bytes: Bytes = Bytes(65536)
    #: Streams: how long runtime output that arrives after a stream's first chunk is held, to go on
    #: with what follows it in one chunk (seconds; 0: every read goes on at once). The first chunk
    #: always goes at once. Fewer, larger chunks cost the node and the controller less CPU per token.
    flush_window_s: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    #: Wake-up moderation while streams are relayed (seconds; 0: off): once the agent woke up, it
    #: looks for I/O again only this long after, and takes all that arrived meanwhile in one pass
    #: (`nexa.moderation`). Off while a request waits for its runtime's first bytes (`NodeRelay.gathering`).
    gather_s: float = attrs.field(default=0.005, validator=[attrs.validators.ge(0.0), attrs.validators.le(0.1)])


#: The controllers' channel endpoints a node dials (`NodeConfig.controllers`), each `tcp://HOST:PORT`.
ControllerEndpoints = NewType("ControllerEndpoints", tuple[str, ...])


def _dial_endpoint(value: object) -> str:
    """One endpoint a node dials: `zmq_endpoint`'s syntax, with a named host and port (never `*`)."""
    if not isinstance(value, str) or not value:
        raise ValueError("expected a channel address: tcp://HOST:PORT")
    endpoint = zmq_endpoint(value)
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if "*" in (host, port):
        raise ValueError(f"{value!r} is a listening address: a node dials a controller's host and port")
    return endpoint


def _endpoint_problems(values: tuple[object, ...] | list[object]) -> tuple[list[str], list[tuple[int, ValueError]]]:
    """The endpoints, and what is wrong with the others (by index): not an address, or listed twice."""
    endpoints: list[str] = []
    problems: list[tuple[int, ValueError]] = []
    for i, value in enumerate(values):
        try:
            endpoint = _dial_endpoint(value)
        except ValueError as exc:
            problems.append((i, exc))
            continue
        if endpoint in endpoints:
            problems.append((i, ValueError(f"{endpoint} is listed twice: name each controller once")))
            continue
        endpoints.append(endpoint)
    return endpoints, problems


def _controller_endpoints(value: object) -> ControllerEndpoints:
    """`NodeConfig.controllers` built in code; ValueError naming `controllers[i]`."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ValueError("controllers: expected a list of channel addresses (tcp://HOST:PORT)")
    endpoints, problems = _endpoint_problems(value)
    if problems:
        i, exc = problems[0]
        raise ValueError(f"controllers[{i}]: {exc}")
    return ControllerEndpoints(tuple(endpoints))


def controllers_hook(value: object, _: type) -> ControllerEndpoints:
    """`NodeConfig.controllers` from a file: every bad entry reported at its index (`controllers[i]`)."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ValueError("expected a list of channel addresses (tcp://HOST:PORT)")
    endpoints, problems = _endpoint_problems(value)
    if problems:
        errors = []
        for i, exc in problems:
            exc.add_note(cattrs.errors.IterableValidationNote(f"Structuring controllers @ index {i}", i, str))
            errors.append(exc)
        raise cattrs.IterableValidationError("invalid controllers", errors, tuple)
    return ControllerEndpoints(tuple(endpoints))


@attrs.frozen(kw_only=True)
class MemoryConfig:
    """The memory-pressure guard of a unified-memory node (a GB10: GPU allocations come out of
    the host's pool, invisible to the container's memory limit)."""

    #: When MemAvailable falls under this, the most recently started replica is stopped
    #: (`Failed(memory_pressure)`) and the node reports the pressure, so nothing more is placed on
    #: it until MemAvailable is back above. 0 turns the guard off. Nodes with discrete GPUs only
    #: are never guarded (their runtimes' memory is the GPUs').
    pressure_floor_bytes: int = attrs.field(default=4 * 1024**3, validator=attrs.validators.ge(0))


#: nftables' identifier: a letter, then letters, digits, `_`, `-`, `.` (what nft's scanner takes).
_NFT_TABLE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


def table_problem(name: str) -> str | None:
    """Why `name` is no nftables table name nexa writes, or None."""
    if isinstance(name, str) and _NFT_TABLE_RE.match(name):
        return None
    return "a table name is a letter, then up to 63 letters, digits, '_', '-' or '.' (e.g. nexa)"


def _table(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if (problem := table_problem(value)) is not None:
        raise ValueError(f"{attribute.name}: {problem}")


@attrs.frozen(kw_only=True)
class FirewallConfig:
    """The fabric firewall (nexa.node.firewall): a replica group member's worker or rendezvous port
    reachable on its fabric address only."""

    #: Close each group member's port, in the node's nftables, to every destination but its fabric
    #: address before its container runs (torch's rendezvous store on the head listens on every
    #: address and has no authentication). Off: the host's own firewall must do it.
    enabled: bool = True
    #: The agent's own nftables table (`inet` family), rewritten whole at each change.
    table: str = attrs.field(default="nexa", validator=_table)
    #: The nft program (a path, or a name on PATH).
    nft: str = "nft"


@attrs.frozen(kw_only=True)
class NodeConfig:
    """Everything `nexa node` reads (`/etc/nexa/node.toml`)."""

    #: Keys, the enrollment record and the accepted (epoch, generation) live here.
    state_dir: str = "/var/lib/nexa/node"
    inventory_path: str = "/etc/nexa/inventory.json"
    #: How often inventory.json is checked for edits.
    inventory_poll_interval_s: Seconds = Seconds(2.0)
    #: Path of nvidia-smi; empty means look it up on PATH (none found: no GPUs).
    nvidia_smi: str = ""
    #: How often the agent says it is alive: a tiny beat the channel authenticates, or its signed
    #: state when that is due. The controller marks a node Unreachable after `[nodes] lease_s`
    #: without either.
    heartbeat_interval_s: Seconds = Seconds(1.0)
    #: The longest the agent goes without sending its signed state (inventory, free memory,
    #: replicas and their load, the accepted set); it sends it at once when it changes. At most
    #: `wire.MAX_STATE_INTERVAL_S`; at or under `heartbeat_interval_s`, with every beat.
    state_interval_s: Seconds = attrs.field(default=Seconds(30.0), validator=attrs.validators.le(Seconds(3600.0)))
    #: Local address to dial the controller from (e.g. one of several loopback addresses).
    source_address: str = ""
    #: The loopback address runtimes listen on and the relay reaches them at. Several nodes sharing
    #: one host (tests, demos) each take their own, e.g. 127.0.0.11; a real node keeps 127.0.0.1.
    runtime_host: str = attrs.field(default="127.0.0.1", validator=_loopback)
    on_lease_expiry: LeaseExpiryPolicy = LeaseExpiryPolicy.KEEP_SERVING
    #: Longest wait between reconnection attempts to the controller.
    reconnect_max_s: Seconds = Seconds(5.0)
    #: The channel endpoints of every controller to keep a channel to (several `nexa control` on one
    #: store, sharing their keys), each `tcp://HOST:PORT` (a bare `HOST:PORT` means the same); empty
    #: (or `[]`): the one the node enrolled with. Heartbeats go to each; assignment sets are taken
    #: from whichever has the highest epoch; inference is answered on the channel it came on.
    controllers: ControllerEndpoints = attrs.field(default=ControllerEndpoints(()), converter=_controller_endpoints)
    container: ContainerConfig = ContainerConfig()
    artifacts: ArtifactsConfig = ArtifactsConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    relay: RelayConfig = RelayConfig()
    #: Run `sim` runtimes as local processes (tests and demos only). Refused unless the agent's
    #: environment has NEXA_SIMULATION_ONLY=1; a node without it reports sim assignments Failed.
    simulation: bool = False
    #: How often each Ready replica's metrics endpoint is read for the heartbeat's load figures
    #: (seconds; 0 turns the scrape off).
    runtime_metrics_interval_s: float = attrs.field(
        default=5.0, validator=[attrs.validators.ge(0.0), attrs.validators.lt(math.inf)]
    )
    log: LogConfig = LogConfig()
    cache: CacheConfig = CacheConfig()
    #: How often nvidia-smi and meminfo are read again (GPU utilisation, temperature, power and
    #: memory, the host's MemAvailable), for heartbeats, placement and the memory guard. A hung
    #: nvidia-smi is killed after its timeout; the last GPU figures are kept, marked stale.
    discovery_interval_s: Seconds = Seconds(5.0)
    #: The meminfo file read for host memory (a test points it at a file it rewrites).
    meminfo_path: str = "/proc/meminfo"
    memory: MemoryConfig = MemoryConfig()
    firewall: FirewallConfig = FirewallConfig()
    #: Where sysfs is mounted: the RDMA devices (`class/infiniband`) and the interfaces they sit on
    #: (`class/net`) are read under it at every discovery (tests point it at a fixture tree).
    sysfs_path: str = "/sys"
