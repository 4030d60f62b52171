"""Fixtures of the node tests: `artifact`, a 1 MiB object in the run's S3 store, and `node`, a
`nexa node` process (tests/support/agent_process.py) on the run's podman and S3 store, enrolled with
a `FakeController`; its containers are removed when the test ends. For the container engine tests:
`engine`, the driver of each engine in turn with the busybox test image stored, and `run_labels`,
the test's own `RUN_LABEL`, whose containers are removed when it ends."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from nexa.config import NodeConfig
from nexa.contracts.runtime import ArtifactRef
from nexa.node.engines.interface import ContainerEngine
from tests.realparts import RUN_LABEL, BuiltImages, EngineUnderTest, PodmanService, S3Store
from tests.support.agent_process import AgentProcess, podman
from tests.support.nodes import FakeController, node_config
from tests.support.s3 import write_credentials


@pytest.fixture
async def artifact(s3_store: S3Store) -> ArtifactRef:
    data = os.urandom(1 << 20)
    uri = await s3_store.put(f"models/tiny-{time.monotonic_ns()}.bin", data)
    return ArtifactRef(uri=uri, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


@pytest.fixture
async def node(
    nursery: trio.Nursery,
    tmp_path: Path,
    podman_service: PodmanService,
    s3_store: S3Store,
) -> AsyncIterator[tuple[FakeController, AgentProcess]]:
    ctl = FakeController(nursery)
    await ctl.start()
    state_dir = tmp_path / "state"
    ctl.enroll(state_dir)
    credentials = write_credentials(tmp_path / "s3.json", s3_store)
    config = tmp_path / "node.toml"
    config.write_text(
        f'state_dir = "{state_dir}"\ninventory_path = "{tmp_path / "inventory.json"}"\n'
        f'nvidia_smi = "{tmp_path / "no-nvidia-smi"}"\nheartbeat_interval_s = 0.2\nreconnect_max_s = 0.5\n'
        f'[container]\nsocket = "{podman_service.socket}"\nregistry_tls_verify = false\n'
        f'[artifacts]\ns3_endpoint = "{s3_store.endpoint}"\ns3_region = "{s3_store.region}"\n'
        f's3_credentials_file = "{credentials}"\n'
        "[supervisor]\nrestart_backoff_initial_s = 0.5\nrestart_backoff_max_s = 2\nreconcile_interval_s = 0.5\n"
    )
    agent = AgentProcess(config=config, log=tmp_path / "agent.log")
    agent.start()
    try:
        yield ctl, agent
    finally:
        agent.kill()
        for cid in podman(podman_service, "ps", "-aq", "--filter", "label=nexa.node=n1").split():
            podman(podman_service, "rm", "-f", cid)


# The agent protocol tests (test_agent, test_controller_keys): a node state directory, its config
# and a FakeController the node is enrolled with.


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def cfg(tmp_path: Path, state_dir: Path) -> NodeConfig:
    # No podman behind its socket: these tests are about the protocol, not the runtimes.
    return node_config(tmp_path, state_dir, {"labels": {"rack": "r1"}})


@pytest.fixture
async def ctl(nursery: trio.Nursery, state_dir: Path) -> FakeController:
    controller = FakeController(nursery)
    with trio.fail_after(60):
        await controller.start()
    controller.enroll(state_dir)
    return controller


@pytest.fixture
def run_labels(container_engine: EngineUnderTest) -> Iterator[dict[str, str]]:
    value = uuid.uuid4().hex[:12]
    try:
        yield {RUN_LABEL: value}
    finally:
        container_engine.remove_labelled(RUN_LABEL, value)


@pytest.fixture
async def engine(container_engine: EngineUnderTest, test_images: BuiltImages) -> AsyncIterator[ContainerEngine]:
    """The driver of each engine in turn (libpod, podman's Docker API, dockerd), the image stored."""
    await container_engine.store_image(test_images.busybox)
    async with container_engine.client() as client:
        yield client
