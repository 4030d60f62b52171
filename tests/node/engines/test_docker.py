"""The Docker Engine driver (`nexa.node.engines.docker`): its create body (pure), its refusals (fault injection
with httpx.MockTransport), and the driver against the real engines (tests/realparts.py): Debian's
dockerd, podman's Docker-compatible API and, for the driver-neutral checks, libpod.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa import config
from nexa.contracts import codec
from nexa.contracts.node import NodeInventory
from nexa.contracts.runtime import NETWORK_HOST, NETWORK_NONE, ContainerSpec, HealthProbe
from nexa.errors import ConfigError, ContainerNotFound, ContractError, EngineError, ImageNotFound
from nexa.node.engines.docker import (
    GPU_NVIDIA_RUNTIME,
    LABEL_PROBE,
    DockerEngine,
    docker_create_body,
)
from nexa.node.engines.interface import ContainerEngine
from nexa.node.engines.libpod import create_body as libpod_create_body
from nexa.oci import RegistryAuths, RegistryCredentials
from tests.realparts import RUN_LABEL, BuiltImages, EngineUnderTest
from tests.support.supervisor import small_spec

MiB = 1024 * 1024
DIGEST = "sha256:" + "ab" * 32
IMAGE = f"registry.example:5000/nexa/runtime@{DIGEST}"
RUNTIME_HOST = "127.0.0.67"
TIMEOUT_S = 60


def _spec(image: str = IMAGE, labels: dict[str, str] | None = None, **changes: Any) -> ContainerSpec:
    fields: dict[str, Any] = {"command": ["/bin/sh", "-c", "exec sleep 600"], "env": {"A": "1"}} | changes
    return small_spec(image, labels=labels or {"nexa.assignment": "a1"}, **fields)


# --- the create body: hardening, key for key --------------------------------------------------------


def test_the_create_body_is_hardened_like_the_libpod_one() -> None:
    spec = _spec(
        ro_mounts=[("/var/lib/nexa/models/m1", "/models/model")],
        shm_bytes=256 * MiB,
        publish_host="127.0.0.1",
        publish_port=18080,
    )
    body = docker_create_body(spec, network="nexa-runtimes")
    host = body["HostConfig"]
    assert body["Image"] == IMAGE and body["Cmd"] == spec.command and body["Env"] == ["A=1"]
    assert body["Labels"] == {**spec.labels, LABEL_PROBE: '{"command":["true"],"timeout_s":5}'}
    assert host["CapDrop"] == ["ALL"] and host["CapAdd"] == [] and host["Privileged"] is False
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["ReadonlyRootfs"] is True and host["Tmpfs"] == {"/tmp": "rw,nosuid,nodev"}
    assert host["Memory"] == host["MemorySwap"] == 64 * MiB
    assert host["NanoCpus"] == 500_000_000 and host["PidsLimit"] == 64 and host["ShmSize"] == 256 * MiB
    assert host["Mounts"] == [
        {
            "Type": "bind",
            "Source": "/var/lib/nexa/models/m1",
            "Target": "/models/model",
            "ReadOnly": True,
            "BindOptions": {"Propagation": "rprivate"},
        }
    ]
    assert host["RestartPolicy"] == {"Name": "no"} and host["AutoRemove"] is False
    assert host["NetworkMode"] == "nexa-runtimes" and host["PublishAllPorts"] is False
    assert host["PortBindings"] == {"18080/tcp": [{"HostIp": "127.0.0.1", "HostPort": "18080"}]}
    assert body["ExposedPorts"] == {"18080/tcp": {}}
    assert body["StopSignal"] == "SIGTERM" and body["StopTimeout"] == 1
    # No engine-run health checks (nor the image's): the agent runs the labelled probe itself.
    assert body["Healthcheck"] == {"Test": ["NONE"]}
    assert host["DeviceRequests"] == []


def test_the_entrypoint_is_set_only_where_the_spec_sets_one() -> None:
    """Both engines' bodies: Docker `Entrypoint`, libpod `entrypoint` (the image's own where it is empty)."""
    spec = _spec(entrypoint=["/app/llama-server"], command=["--model", "/models/model"])
    assert docker_create_body(spec)["Entrypoint"] == ["/app/llama-server"]
    assert docker_create_body(spec)["Cmd"] == ["--model", "/models/model"]
    assert libpod_create_body(spec)["entrypoint"] == ["/app/llama-server"]
    assert "Entrypoint" not in docker_create_body(_spec()) and "entrypoint" not in libpod_create_body(_spec())


def test_host_and_none_networks_publish_nothing() -> None:
    for network in (NETWORK_HOST, NETWORK_NONE):
        body = docker_create_body(_spec(network=network))
        assert body["HostConfig"]["NetworkMode"] == network
        assert "PortBindings" not in body["HostConfig"] and "ExposedPorts" not in body


def test_gpus_by_cdi_name_or_through_the_nvidia_runtime() -> None:
    spec = _spec(devices=["nvidia.com/gpu=0", "nvidia.com/gpu=GPU-1234"])
    cdi = docker_create_body(spec)["HostConfig"]["DeviceRequests"]
    assert cdi == [{"Driver": "cdi", "DeviceIDs": ["nvidia.com/gpu=0", "nvidia.com/gpu=GPU-1234"]}]
    nvidia = docker_create_body(spec, gpu_method=GPU_NVIDIA_RUNTIME)["HostConfig"]["DeviceRequests"]
    assert nvidia == [{"Driver": "nvidia", "Capabilities": [["gpu"]], "DeviceIDs": ["0", "GPU-1234"]}]
    every = docker_create_body(_spec(devices=["nvidia.com/gpu=all"]), gpu_method=GPU_NVIDIA_RUNTIME)
    assert every["HostConfig"]["DeviceRequests"] == [{"Driver": "nvidia", "Capabilities": [["gpu"]], "Count": -1}]
    with pytest.raises(ContractError, match="not an NVIDIA GPU"):
        docker_create_body(_spec(devices=["nexa-test.test/gpu=0"]), gpu_method=GPU_NVIDIA_RUNTIME)


# --- config -------------------------------------------------------------------------------------


def test_the_container_table_selects_the_engine_and_old_configs_stay_valid(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text('[podman]\nsocket = "/run/p.sock"\n')
    cfg = config.load(str(old), config.NodeConfig)
    assert cfg.container.engine == "podman" and cfg.container.socket_path == "/run/p.sock"
    new = tmp_path / "new.toml"
    new.write_text('[container]\nengine = "docker"\ngpu_method = "nvidia-runtime"\n')
    cfg = config.load(str(new), config.NodeConfig)
    assert cfg.container.socket_path == "/var/run/docker.sock"
    assert cfg.container.gpu_method == "nvidia-runtime" and cfg.container.docker_network == "bridge"


@pytest.mark.parametrize(
    "table",
    [
        'engine = "containerd"',
        'gpu_method = "nvidia-runtime"',  # podman takes CDI names only
        'engine = "docker"\ngpu_method = "magic"',
        'engine = "docker"\ndocker_network = "host"',
        'engine = "docker"\nsocket_path = "/x"',
    ],
)
def test_a_bad_container_table_is_a_config_error(tmp_path: Path, table: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f"[container]\n{table}\n")
    with pytest.raises(ConfigError):
        config.load(str(path), config.NodeConfig)


def test_units_node_toml_names_the_container_table() -> None:
    cfg = config.load(str(Path(__file__).resolve().parents[3] / "units" / "node.toml"), config.NodeConfig)
    assert cfg.container == config.ContainerConfig()


# --- refusals, by fault injection ---------------------------------------------------------------


class FakeDocker:
    """Answers the few Docker Engine calls a refusal needs; records every request."""

    def __init__(self, *, api: str = "1.41", insecure: list[str] | None = None) -> None:
        self.api = api
        self.insecure = insecure if insecure is not None else ["127.0.0.0/8"]
        self.requests: list[httpx.Request] = []
        self.pull_stream: list[dict[str, Any]] = [{"status": "Pulling"}]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/version":
            return httpx.Response(200, json={"Version": "20.10.24", "ApiVersion": self.api})
        if path == "/info":
            return httpx.Response(
                200, json={"RegistryConfig": {"InsecureRegistryCIDRs": self.insecure, "IndexConfigs": {}}}
            )
        if path == "/images/create":
            return httpx.Response(200, text="\n".join(json.dumps(item) for item in self.pull_stream))
        if path == "/containers/create":
            return httpx.Response(201, json={"Id": "c" * 64})
        return httpx.Response(404, json={"message": "no such thing"})

    def paths(self) -> list[str]:
        return [r.url.path for r in self.requests]


async def test_with_tls_verify_a_registry_docker_treats_as_insecure_is_refused() -> None:
    fake = FakeDocker()
    async with DockerEngine("/x.sock", transport=httpx.MockTransport(fake)) as docker:
        with pytest.raises(EngineError, match="insecure"):
            await docker.pull(f"127.0.0.1:5000/nexa/r@{DIGEST}")
        assert "/images/create" not in fake.paths()
        # A registry the daemon verifies is pulled.
        await docker.pull(IMAGE)
    assert fake.paths()[-1] == "/images/create"
    assert fake.requests[-1].url.params["fromImage"] == IMAGE


async def test_the_pull_sends_credentials_in_x_registry_auth_and_never_in_errors() -> None:
    fake = FakeDocker()
    fake.pull_stream = [{"error": "unauthorized: user s3cret-user with s3cret-pass"}]
    creds = RegistryAuths.of(
        RegistryCredentials(registry="registry.example:5000", username="s3cret-user", password="s3cret-pass")
    )
    async with DockerEngine("/x.sock", transport=httpx.MockTransport(fake), credentials=creds) as docker:
        with pytest.raises(EngineError) as failed:
            await docker.pull(IMAGE)
    assert "s3cret" not in str(failed.value)
    auth = json.loads(base64.urlsafe_b64decode(fake.requests[-1].headers["X-Registry-Auth"]))
    assert auth == {"username": "s3cret-user", "password": "s3cret-pass", "serveraddress": "registry.example:5000"}
    # An image on another registry: dockerd is handed no credentials for it.
    fake.pull_stream = []
    other = IMAGE.replace("registry.example:5000", "127.0.0.2:5000")
    async with DockerEngine(
        "/x.sock", transport=httpx.MockTransport(fake), credentials=creds, tls_verify=False
    ) as docker:
        await docker.pull(other)
    assert fake.requests[-1].url.params["fromImage"] == other
    assert "X-Registry-Auth" not in fake.requests[-1].headers
    fake.pull_stream = [{"error": "manifest unknown: manifest unknown"}]
    async with DockerEngine("/x.sock", transport=httpx.MockTransport(fake), tls_verify=False) as docker:
        with pytest.raises(ImageNotFound):
            await docker.pull(IMAGE)


async def test_bad_input_is_refused_before_any_request() -> None:
    fake = FakeDocker()
    async with DockerEngine("/x.sock", transport=httpx.MockTransport(fake)) as docker:
        with pytest.raises(ContractError):
            await docker.pull("busybox:latest")
        with pytest.raises(ContractError):
            await docker.create(_spec(devices=["not a cdi name"]))
        with pytest.raises(ContractError):
            await docker.create(_spec(publish_host="localhost", publish_port=80))
    assert fake.requests == []
    with pytest.raises(ContractError):
        DockerEngine("/x.sock", gpu_method="magic")
    with pytest.raises(ContractError):
        DockerEngine("/x.sock", network="host")


async def test_cdi_gpus_on_an_engine_without_cdi_device_requests_are_refused() -> None:
    fake = FakeDocker(api="1.43")
    async with DockerEngine("/x.sock", transport=httpx.MockTransport(fake)) as docker:
        with pytest.raises(EngineError, match="gpu_method = nvidia-runtime"):
            await docker.create(_spec(devices=["nvidia.com/gpu=0"]))
        assert "/containers/create" not in fake.paths()
        await docker.create(_spec())  # no GPUs: no CDI needed
    fake = FakeDocker(api="1.44")
    async with DockerEngine("/x.sock", transport=httpx.MockTransport(fake)) as docker:
        await docker.create(_spec(devices=["nvidia.com/gpu=0"]))
    body = json.loads(fake.requests[-1].content)
    assert body["HostConfig"]["DeviceRequests"] == [{"Driver": "cdi", "DeviceIDs": ["nvidia.com/gpu=0"]}]


# --- the real engines -----------------------------------------------------------------------------


async def _wait_exit(client: ContainerEngine, container_id: str) -> int:
    with trio.fail_after(TIMEOUT_S):
        while True:
            state = await client.inspect(container_id)
            if state.exited:
                assert state.exit_code is not None
                return state.exit_code
            await trio.sleep(0.1)


async def test_pull_by_digest_and_digest_exact_readiness(
    engine: ContainerEngine, container_engine: EngineUnderTest, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    assert await engine.image_exists(test_images.busybox)
    other = test_images.busybox.rpartition("@")[0] + "@sha256:" + "0" * 64
    assert not await engine.image_exists(other)
    # podman 4.3's Docker API cannot pull from a plain-HTTP registry (`EngineUnderTest.store_image`).
    with pytest.raises(EngineError if container_engine.name == "podman-docker-api" else ImageNotFound):
        await engine.pull(other)
    with pytest.raises(ImageNotFound):
        await engine.create(_spec(other, run_labels))
    cid = await engine.create(_spec(test_images.busybox, run_labels))
    state = await engine.inspect(cid)
    assert state.image_name == test_images.busybox
    assert state.image_digest == test_images.busybox_digest
    assert state.labels[RUN_LABEL] == run_labels[RUN_LABEL]
    assert state.status == "created" and state.startable and state.exit_code is None


async def test_a_container_runs_hardened(
    engine: ContainerEngine, test_images: BuiltImages, run_labels: dict[str, str], tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "weights").write_text("w")
    script = (
        "grep -q '^CapEff:\t0000000000000000' /proc/self/status || exit 11; "
        "grep -q '^NoNewPrivs:\t1' /proc/self/status || exit 12; "
        "touch /rootfs-write 2>/dev/null && exit 13; "
        "touch /tmp/ok || exit 14; "
        "grep -q w /models/weights || exit 15; "
        "touch /models/new 2>/dev/null && exit 16; "
        "grep -q ' /tmp tmpfs .*nosuid' /proc/mounts || exit 17; "
        'test "$A" = 1 || exit 18; '
        "exit 0"
    )
    spec = _spec(
        test_images.busybox,
        run_labels,
        command=["/bin/sh", "-c", script],
        ro_mounts=[(str(models), "/models")],
        network=NETWORK_NONE,
    )
    cid = await engine.create(spec)
    await engine.start(cid)
    assert await _wait_exit(engine, cid) == 0


async def test_probe_list_stop_and_remove(
    engine: ContainerEngine, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    probe = HealthProbe(command=["/bin/sh", "-c", "test -e /tmp/ready"], timeout_s=5, start_period_s=0, retries=1)
    spec = _spec(
        test_images.busybox,
        run_labels,
        command=["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 0.3; touch /tmp/ready; while :; do sleep 0.1; done"],
        health=probe,
        network=NETWORK_NONE,
    )
    cid = await engine.create(spec)
    assert not await engine.healthcheck(cid)  # not running
    await engine.start(cid)
    with trio.fail_after(TIMEOUT_S):
        while not await engine.healthcheck(cid):  # noqa: ASYNC110 - polling the engine
            await trio.sleep(0.1)
    (listed,) = await engine.list(run_labels)
    assert listed.id == cid and listed.running and listed.name == spec.name
    assert await engine.list({RUN_LABEL: "nobody"}) == []
    await engine.stop(cid, timeout_s=5)
    state = await engine.inspect(cid)
    assert state.exited and state.exit_code == 0
    await engine.remove(cid)
    with pytest.raises(ContainerNotFound):
        await engine.inspect(cid)
    assert await engine.list(run_labels) == []


async def test_a_paused_container_is_paused_not_running(
    engine: ContainerEngine, container_engine: EngineUnderTest, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    cid = await engine.create(_spec(test_images.busybox, run_labels, network=NETWORK_NONE))
    await engine.start(cid)
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=container_engine.socket)) as api:
        assert (await api.post(f"http://d/containers/{cid}/pause")).status_code == 204
        try:
            state = await engine.inspect(cid)
            assert state.paused and not state.running and not state.between_states and not state.exited
            assert not await engine.healthcheck(cid)  # a paused container's probe cannot run
        finally:
            await api.post(f"http://d/containers/{cid}/unpause")


async def test_each_engine_reports_its_version(container_engine: EngineUnderTest) -> None:
    async with container_engine.client() as client:
        assert (await client.version())[0].isdigit()


# --- the inventory contract -----------------------------------------------------------------------


def _inventory_record() -> dict[str, Any]:
    return {
        "hostname": "spark-1",
        "arch": "aarch64",
        "cpu_count": 20,
        "memory_total_bytes": 128 << 30,
        "memory_available_bytes": 100 << 30,
        "gpus": [],
        "labels": {},
        "taints": [],
        "data_classes": ["public"],
        "runtimes": ["llamacpp"],
        "accelerator_memory_bytes": 0,
        "discovered_at": 1.0,
    }


def test_inventory_records_from_before_load_and_engine_fields_round_trip() -> None:
    old = codec.structure(codec.store, _inventory_record(), NodeInventory)
    assert (old.container_engine, old.container_engine_version, old.gpu_method) == ("", "", "")
    new = attrs.evolve(old, container_engine="docker", container_engine_version="28.3.3", gpu_method="cdi")
    again = codec.structure(codec.wire, codec.wire.unstructure(new), NodeInventory)
    assert again == new
    with pytest.raises(ContractError):
        codec.structure(codec.wire, {**_inventory_record(), "container_engine_version": "9" * 65}, NodeInventory)


async def _create_and_start(client: ContainerEngine, spec: ContainerSpec) -> None:
    await client.start(await client.create(spec))


async def test_a_gpu_the_engine_cannot_give_is_refused_never_dropped(
    container_engine: EngineUnderTest, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    """No NVIDIA runtime and no CDI device requests here: each GPU method must fail the create (or the
    start), never run the runtime without its GPU."""
    if not container_engine.docker:
        return  # libpod takes CDI names: tests/node/test_runtimes_e2e.py runs one with a CDI fake GPU
    await container_engine.store_image(test_images.busybox)
    for method in ("cdi", GPU_NVIDIA_RUNTIME):
        client = DockerEngine(
            container_engine.socket, tls_verify=False, gpu_method=method, network=container_engine.network
        )
        async with client:
            spec = _spec(test_images.busybox, run_labels, devices=["nvidia.com/gpu=0"], network=NETWORK_NONE)
            with pytest.raises(EngineError) as refused:
                await _create_and_start(client, spec)
            if container_engine.name == "podman-docker-api":
                assert 'engine = "podman"' in str(refused.value)
            elif method == "cdi":  # Debian's Docker 20.10: API 1.41, no CDI device requests
                assert "gpu_method = nvidia-runtime" in str(refused.value)
            else:
                assert 'device driver "nvidia"' in str(refused.value)
    async with container_engine.client() as client:
        assert not [state for state in await client.list(run_labels) if state.running]
