"""Configuration: frozen attrs classes read from TOML. Pure; no I/O beyond reading the file
(and the files config names: `WatchedFile`).

Rules: unknown keys are errors, every bad key is named (dotted path), durations end in `_s`,
sizes in `_bytes`. Command-line flags override the file with `attrs.evolve`.

The sections live by role: `config.control` (the controller's), `config.node` (the node agent's) and
`config.common` (the value types and checks both use); this module reads a file into either and
names the public classes in one place.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import cattrs

from nexa.config.common import (
    Bytes as Bytes,
)
from nexa.config.common import C
from nexa.config.common import (
    HostPort as HostPort,
)
from nexa.config.common import (
    LogConfig as LogConfig,
)
from nexa.config.common import (
    LogLevel as LogLevel,
)
from nexa.config.common import (
    PublicKeyB64 as PublicKeyB64,
)
from nexa.config.common import (
    Seconds as Seconds,
)
from nexa.config.common import (
    WatchedFile as WatchedFile,
)
from nexa.config.common import (
    bytes_hook as bytes_hook,
)
from nexa.config.common import (
    check_networks as check_networks,
)
from nexa.config.common import (
    host_port_hook as host_port_hook,
)
from nexa.config.common import (
    parse_host_port as parse_host_port,
)
from nexa.config.common import (
    positive_rate as positive_rate,
)
from nexa.config.common import (
    public_key_b64_hook as public_key_b64_hook,
)
from nexa.config.common import (
    seconds_hook as seconds_hook,
)
from nexa.config.common import (
    zmq_endpoint as zmq_endpoint,
)
from nexa.config.node import (
    DOCKER_SOCKET as DOCKER_SOCKET,
)
from nexa.config.node import (
    PODMAN_SOCKET as PODMAN_SOCKET,
)
from nexa.config.node import (
    ArtifactsConfig as ArtifactsConfig,
)
from nexa.config.node import (
    CacheConfig as CacheConfig,
)
from nexa.config.node import (
    ContainerConfig as ContainerConfig,
)
from nexa.config.node import (
    ControllerEndpoints as ControllerEndpoints,
)
from nexa.config.node import (
    FirewallConfig as FirewallConfig,
)
from nexa.config.node import (
    LeaseExpiryPolicy as LeaseExpiryPolicy,
)
from nexa.config.node import (
    MemoryConfig as MemoryConfig,
)
from nexa.config.node import (
    NodeConfig as NodeConfig,
)
from nexa.config.node import (
    RelayConfig as RelayConfig,
)
from nexa.config.node import (
    SupervisorConfig as SupervisorConfig,
)
from nexa.config.node import (
    controllers_hook as controllers_hook,
)
from nexa.config.node import (
    moved_podman_keys as moved_podman_keys,
)
from nexa.contracts import codec
from nexa.errors import ConfigError

if TYPE_CHECKING:  # the controller's sections, read when first named (`__getattr__`)
    from nexa.config.control import (
        ArtifactStoreConfig as ArtifactStoreConfig,
    )
    from nexa.config.control import (
        BackupConfig as BackupConfig,
    )
    from nexa.config.control import (
        BootstrapConfig as BootstrapConfig,
    )
    from nexa.config.control import (
        ChannelConfig as ChannelConfig,
    )
    from nexa.config.control import (
        ClusterConfig as ClusterConfig,
    )
    from nexa.config.control import (
        ControlConfig as ControlConfig,
    )
    from nexa.config.control import (
        EvidenceConfig as EvidenceConfig,
    )
    from nexa.config.control import (
        GatewayConfig as GatewayConfig,
    )
    from nexa.config.control import (
        HttpConfig as HttpConfig,
    )
    from nexa.config.control import (
        ModelsConfig as ModelsConfig,
    )
    from nexa.config.control import (
        NodesConfig as NodesConfig,
    )
    from nexa.config.control import (
        OciConfig as OciConfig,
    )
    from nexa.config.control import (
        PlacementConfig as PlacementConfig,
    )
    from nexa.config.control import (
        PriorityOverGrant as PriorityOverGrant,
    )
    from nexa.config.control import (
        RetentionConfig as RetentionConfig,
    )
    from nexa.config.control import (
        StoreConfig as StoreConfig,
    )
    from nexa.config.control import (
        TlsVersion as TlsVersion,
    )

#: The controller's sections, named here but imported from `config.control` when first used: the
#: node agent, which reads only its own, never loads them (its memory, `perf/node_memory.py`).
_CONTROL_NAMES: Final = frozenset(
    {
        "ArtifactStoreConfig",
        "BackupConfig",
        "BootstrapConfig",
        "ChannelConfig",
        "ClusterConfig",
        "ControlConfig",
        "EvidenceConfig",
        "GatewayConfig",
        "HttpConfig",
        "ModelsConfig",
        "NodesConfig",
        "OciConfig",
        "PlacementConfig",
        "PriorityOverGrant",
        "RetentionConfig",
        "StoreConfig",
        "TlsVersion",
    }
)


def __getattr__(name: str) -> object:
    if name in _CONTROL_NAMES:
        from nexa.config import control

        return getattr(control, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(Seconds, seconds_hook)
    conv.register_structure_hook(Bytes, bytes_hook)
    conv.register_structure_hook(HostPort, host_port_hook)
    conv.register_structure_hook(PublicKeyB64, public_key_b64_hook)
    conv.register_structure_hook(ControllerEndpoints, controllers_hook)
    codec.register_strict_hooks(conv)
    return conv


_CONV = _converter()


def structure_config(data: dict[str, Any], cls: type[C]) -> C:
    """Structure a parsed TOML table into `cls`, or raise ConfigError naming every bad key."""
    if cls is NodeConfig:
        data = moved_podman_keys(data)
    try:
        return _CONV.structure(data, cls)
    except Exception as exc:
        problems = codec.describe(exc)
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems), problems=problems) from None


def unstructure_config(cfg: object) -> dict[str, Any]:
    """The plain-dict form of a config object (the inverse of `structure_config`)."""
    data: dict[str, Any] = _CONV.unstructure(cfg)
    return data


def load(path: str | Path, cls: type[C]) -> C:
    """Read a TOML file into `cls`. Raises ConfigError on unreadable, malformed or invalid files."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}", problems=(str(exc),)) from None
    return structure_config(data, cls)


__all__ = (
    "DOCKER_SOCKET",
    "PODMAN_SOCKET",
    "ArtifactStoreConfig",
    "ArtifactsConfig",
    "BackupConfig",
    "BootstrapConfig",
    "Bytes",
    "CacheConfig",
    "ChannelConfig",
    "ClusterConfig",
    "ContainerConfig",
    "ControlConfig",
    "ControllerEndpoints",
    "EvidenceConfig",
    "FirewallConfig",
    "GatewayConfig",
    "HostPort",
    "HttpConfig",
    "LeaseExpiryPolicy",
    "LogConfig",
    "LogLevel",
    "MemoryConfig",
    "ModelsConfig",
    "NodeConfig",
    "NodesConfig",
    "OciConfig",
    "PlacementConfig",
    "PriorityOverGrant",
    "PublicKeyB64",
    "RelayConfig",
    "RetentionConfig",
    "Seconds",
    "StoreConfig",
    "SupervisorConfig",
    "TlsVersion",
    "WatchedFile",
    "bytes_hook",
    "check_networks",
    "controllers_hook",
    "host_port_hook",
    "load",
    "moved_podman_keys",
    "parse_host_port",
    "positive_rate",
    "public_key_b64_hook",
    "seconds_hook",
    "structure_config",
    "unstructure_config",
    "zmq_endpoint",
)
