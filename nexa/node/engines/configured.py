"""The engine driver `[container]` names, built once for the agent and the doctor alike."""

from __future__ import annotations

from nexa.config import ContainerConfig
from nexa.node.engines.common import Credentials
from nexa.node.engines.docker import DockerEngine
from nexa.node.engines.http import EngineTransport
from nexa.node.engines.interface import ContainerEngine
from nexa.node.engines.libpod import LibpodEngine


def configured_engine(
    container: ContainerConfig, *, credentials: Credentials = None, transport: EngineTransport | None = None
) -> ContainerEngine:
    """The driver of `[container] engine` on its socket, with the registry settings of `[container]`
    (`credentials`: the file's contents as `oci.registry_credentials_source` reads them)."""
    if container.engine == "docker":
        return DockerEngine(
            container.socket_path,
            tls_verify=container.registry_tls_verify,
            credentials=credentials,
            transport=transport,
            gpu_method=container.gpu_method,
            network=container.docker_network,
        )
    return LibpodEngine(
        container.socket_path,
        tls_verify=container.registry_tls_verify,
        credentials=credentials,
        transport=transport,
        private_network=container.private_network,
    )
