"""The node's parts, one builder each: what `agent.serve_node`, the composition root, wires together.

Each builder reads its own sections of `NodeConfig` and returns a part not yet running; the
composition root orders them and starts their loops in one nursery.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path
from typing import Final

import attrs
import trio

from nexa.config import NodeConfig
from nexa.contracts.node import ENGINE_FIELD_MAX
from nexa.errors import EngineError
from nexa.node.artifacts import ArtifactCache
from nexa.node.engines.configured import configured_engine
from nexa.node.engines.interface import ContainerEngine
from nexa.node.firewall import FabricFirewall
from nexa.node.identity import Fence, NodeIdentity, PendingKeys, load_fence, load_identity, resume_rotation
from nexa.node.inventory import InventoryWatcher, discover
from nexa.node.liveloras import LIVE_LORAS_DIR
from nexa.node.memory import ReplicaMemoryMeter, default_nvidia_smi
from nexa.node.processes import DriverRouter
from nexa.node.runtime_cache import RuntimeCaches
from nexa.node.runtime_metrics import RuntimeMetrics
from nexa.node.supervisor import Supervisor
from nexa.oci import registry_credentials as registry_credentials_source
from nexa.s3.credentials import s3_credentials as s3_credentials_source

log = logging.getLogger(__name__)

#: Longest wait at start for the container engine's version (a stuck engine must not stop the agent).
ENGINE_VERSION_S: Final = 5.0
#: With `leave_running_on_exit = false`, how long stopping every runtime may take at exit.
STOP_ALL_TIMEOUT_S: Final = 60.0


def load_state(state_dir: Path) -> tuple[NodeIdentity, Fence, PendingKeys | None]:
    pending = resume_rotation(state_dir)  # before the keys are read: a promotion may be unfinished
    return load_identity(state_dir), load_fence(state_dir), pending


async def engine_version(engine: ContainerEngine) -> str:
    """The engine's version for the inventory; "" when it does not answer within ENGINE_VERSION_S."""
    with trio.move_on_after(ENGINE_VERSION_S):
        try:
            return (await engine.version())[:ENGINE_FIELD_MAX]
        except EngineError as exc:
            log.warning("the container engine did not report its version: %s", exc)
    return ""


@attrs.frozen(kw_only=True)
class NodeRuntimes:
    """What runs the node's replicas and measures them (`runtimes_of`)."""

    supervisor: Supervisor
    caches: RuntimeCaches
    metrics: RuntimeMetrics
    meter: ReplicaMemoryMeter

    async def stop_all(self, generation: int) -> None:
        """`leave_running_on_exit = false`: stop every runtime before the agent exits (bounded)."""
        self.supervisor.update(generation, [])
        with trio.move_on_after(STOP_ALL_TIMEOUT_S):
            while self.supervisor.statuses():  # noqa: ASYNC110 - the supervisor reports, it does not signal
                await trio.sleep(0.1)


def inventory(cfg: NodeConfig) -> InventoryWatcher:
    return InventoryWatcher(
        cfg.inventory_path,
        discover=partial(discover, cfg.nvidia_smi or None, meminfo_path=cfg.meminfo_path, sysfs_path=cfg.sysfs_path),
        poll_interval_s=cfg.inventory_poll_interval_s,
        rediscover_interval_s=cfg.discovery_interval_s,
    )


async def container_engine(cfg: NodeConfig) -> ContainerEngine:
    """The driver of `[container] engine`, with the registry credentials."""
    # Re-read at each pull when the file changed (a bad rewrite keeps the last good).
    credentials = await trio.to_thread.run_sync(registry_credentials_source, cfg.container.registry_credentials_file)
    return configured_engine(cfg.container, credentials=credentials)


async def artifact_cache(cfg: NodeConfig, state_dir: Path) -> ArtifactCache:
    """The artifact cache, its S3 credentials re-read when their file changes (else the AWS_* variables)."""
    read = partial(
        s3_credentials_source, cfg.artifacts.s3_credentials_file, profile=cfg.artifacts.s3_profile, environ=os.environ
    )
    credentials = await trio.to_thread.run_sync(read)
    return ArtifactCache(cfg.artifacts, state_dir=state_dir, credentials=credentials)


def runtimes_of(
    cfg: NodeConfig,
    identity: NodeIdentity,
    watcher: InventoryWatcher,
    containers: DriverRouter,
    artifacts: ArtifactCache,
    *,
    state_dir: Path,
) -> NodeRuntimes:
    """The supervisor, the runtime cache, the runtime metrics and the memory meter."""
    caches = RuntimeCaches(
        Path(cfg.cache.runtime_cache_dir) if cfg.cache.runtime_cache_dir else state_dir / "runtime-cache",
        max_bytes=cfg.cache.runtime_cache_max_bytes,
        start_free_bytes=cfg.cache.runtime_cache_start_free_bytes,
    )
    supervisor = Supervisor(
        cfg.supervisor,
        containers,
        artifacts,
        node_id=identity.node_id,
        runtime_host=cfg.runtime_host,
        caches=caches,
        on_start=lambda aid: meter.on_start(aid),  # noqa: PLW0108 - the meter is made below
        # Beside the artifact cache (as its model directories): its files are hard-linked in.
        live_loras_dir=artifacts.directory.parent.absolute() / LIVE_LORAS_DIR,
        firewall=FabricFirewall(cfg.firewall.table, cfg.firewall.nft) if cfg.firewall.enabled else None,
    )
    metrics = RuntimeMetrics(supervisor, artifacts, cfg.runtime_metrics_interval_s, host=cfg.runtime_host)
    meter = ReplicaMemoryMeter(
        metrics,
        supervisor,
        inventory=watcher.current,
        interval_s=cfg.discovery_interval_s,
        floor_bytes=cfg.memory.pressure_floor_bytes,
        meminfo_path=cfg.meminfo_path,
        nvidia_smi=default_nvidia_smi(cfg.nvidia_smi),
    )
    return NodeRuntimes(supervisor=supervisor, caches=caches, metrics=metrics, meter=meter)
