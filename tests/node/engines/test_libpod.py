"""LibpodEngine against the real thing: rootful podman's libpod API, a registry, a CDI fake GPU.

The parts come from `tests/realparts.py` (one podman service, one registry per run). Every test labels
its containers with a value of its own, so runs and tests never see each other's containers, and removes
them when it ends. A few tests use an httpx MockTransport where the point is that *no* request is made,
or what exactly is sent (credentials).
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from nexa.contracts.runtime import LABEL_ASSIGNMENT, ContainerSpec, EngineEvent, HealthProbe
from nexa.errors import (
    ConfigError,
    ContainerNotFound,
    ContractError,
    EngineError,
    EngineUnavailable,
    ImageNotFound,
)
from nexa.node.engines import http as engine_http
from nexa.node.engines.http import EngineAnswer
from nexa.node.engines.libpod import API_BASE, LibpodEngine
from nexa.oci import RegistryAuths, RegistryCredentials, load_registry_credentials
from tests.realparts import RUN_LABEL, BuiltImages, FakeGpu, PodmanService

MiB = 1024 * 1024
#: PID 1 that exits 0 on SIGTERM (busybox sh runs the trap once `wait` is interrupted).
GRACEFUL = ["sh", "-c", "trap 'exit 0' TERM; sleep 600 & wait"]
#: PID 1 without a SIGTERM handler: the kernel ignores the signal, so only SIGKILL stops it.
STUBBORN = ["sleep", "600"]
#: What podman itself (containers.conf defaults, the image's passwd, the host network's name) puts in the env.
PODMAN_ENV = {"PATH", "TERM", "container", "HOME", "HOSTNAME"}
SECRET_NAME = re.compile(r"(?i)(key|token|secret|passw|credential|auth|proxy)")
TOKEN_VALUE = re.compile(r"^[A-Za-z0-9+/=_-]{24,}$")


@pytest.fixture
def run_labels(podman_service: PodmanService) -> Iterator[dict[str, str]]:
    """Labels unique to this test; every container carrying them is force-removed at the end."""
    value = uuid.uuid4().hex[:12]
    try:
        yield {RUN_LABEL: value}
    finally:
        podman_service.cli("rm", "--force", "--time", "0", "--filter", f"label={RUN_LABEL}={value}", check=False)


@pytest.fixture
async def podman(podman_socket: str) -> AsyncIterator[LibpodEngine]:
    async with LibpodEngine(podman_socket, tls_verify=False) as client:
        yield client


def make_spec(
    image: str,
    labels: dict[str, str],
    *,
    command: list[str] | None = None,
    health: HealthProbe | None = None,
    env: dict[str, str] | None = None,
    devices: list[str] | None = None,
    ro_mounts: list[tuple[str, str]] | None = None,
    network: str = "host",
    memory_bytes: int = 64 * MiB,
    cpus: float = 0.5,
    pids_limit: int = 64,
    shm_bytes: int = 0,
    stop_timeout_s: float = 5.0,
) -> ContainerSpec:
    return ContainerSpec(
        name=f"nexa-test-{uuid.uuid4().hex[:12]}",
        image=image,
        command=command or GRACEFUL,
        env=env or {},
        labels=labels,
        memory_bytes=memory_bytes,
        cpus=cpus,
        pids_limit=pids_limit,
        shm_bytes=shm_bytes,
        devices=devices or [],
        ro_mounts=ro_mounts or [],
        health=health or HealthProbe(command=["true"], timeout_s=5, start_period_s=0, retries=1),
        stop_timeout_s=stop_timeout_s,
        network=network,
    )


async def run_in(service: PodmanService, container_id: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
    """`podman exec` (the tests may use the CLI; the agent never does)."""
    return await trio.run_process(
        service.argv("exec", container_id, *argv),
        env=service.env,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def raw_inspect(socket_path: str, container_id: str) -> dict[str, Any]:
    """podman's own inspect document, to check what `LibpodEngine.create` asked for took effect."""
    transport = httpx.AsyncHTTPTransport(uds=socket_path)
    async with httpx.AsyncClient(transport=transport, base_url=API_BASE, trust_env=False) as http:
        response = await http.get(f"/containers/{container_id}/json")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data


def cgroup_value(pid: int, controller: str, v1_file: str, v2_file: str) -> str:
    """A cgroup limit of `pid` as the kernel holds it (v1 controller hierarchy, else the v2 one)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return (Path("/sys/fs/cgroup") / controllers / path.lstrip("/") / v1_file).read_text().strip()
    path = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
    return (Path("/sys/fs/cgroup") / path.lstrip("/") / v2_file).read_text().strip()


def mount_info(pid: int, mount_point: str) -> tuple[str, set[str]]:
    """The file system type and the (mount and super block) options of `mount_point` in the container."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == mount_point:
            separator = fields.index("-")
            options = set(fields[5].split(",")) | set(fields[separator + 3].split(","))
            return fields[separator + 1], options
    raise AssertionError(f"{mount_point} is not mounted in the container")


def mount_options(pid: int, mount_point: str) -> set[str]:
    return mount_info(pid, mount_point)[1]


def proc_status(pid: int) -> dict[str, str]:
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        status[key] = value.strip()
    return status


def proc_environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if entry)


# -- pull, create, start, inspect --------------------------------------------------------------


async def test_pull_by_digest_then_create_start_inspect_shows_that_digest_and_labels(
    podman: LibpodEngine, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    with trio.fail_after(60):
        await podman.pull(test_images.busybox)
        assert await podman.image_exists(test_images.busybox)
        await podman.pull(test_images.busybox)  # present: nothing to do, no error

        labels = {**run_labels, LABEL_ASSIGNMENT: "a-1"}
        spec = make_spec(test_images.busybox, labels)
        before = time.time()
        container_id = await podman.create(spec)
        created = await podman.inspect(container_id)
        assert created.status == "created"
        assert not created.running
        assert created.started_at is None
        assert created.exit_code is None

        await podman.start(container_id)
        state = await podman.inspect(container_id)
        assert state.id == container_id
        assert state.name == spec.name
        assert state.image_name == test_images.busybox
        assert state.image_digest == test_images.busybox_digest
        assert state.labels == labels
        assert state.running
        assert state.status == "running"
        assert state.exit_code is None
        assert state.started_at is not None
        assert before - 2 <= state.started_at <= time.time() + 2
        assert state.restart_count == 0
        assert await podman.inspect(spec.name) == state  # by name as well as by id


async def test_a_digest_the_registry_does_not_have_is_image_not_found(
    podman: LibpodEngine, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    repository = test_images.busybox.partition("@")[0]
    absent = f"{repository}@sha256:{'0' * 64}"
    with trio.fail_after(30):
        with pytest.raises(ImageNotFound, match="no such image"):
            await podman.pull(absent)
        with pytest.raises(ImageNotFound):
            await podman.pull(f"{repository}-never-pushed@{test_images.busybox_digest}")
        assert not await podman.image_exists(absent)
        with pytest.raises(ImageNotFound, match="pull it first"):
            await podman.create(make_spec(absent, run_labels))


async def test_an_unreachable_registry_is_an_engine_error_not_image_not_found(podman: LibpodEngine) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on: bound by the OS, then released
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with trio.fail_after(30), pytest.raises(EngineError) as caught:
        await podman.pull(f"127.0.0.1:{port}/nexa-test/busybox@sha256:{'1' * 64}")
    assert not isinstance(caught.value, ImageNotFound | EngineUnavailable)


async def test_a_reference_not_by_digest_is_refused_before_any_request() -> None:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(500, json={"message": "must not be reached"})

    digest = "a" * 64
    async with LibpodEngine("/nonexistent.sock", transport=httpx.MockTransport(handler)) as client:
        with trio.fail_after(5):
            for image in (
                "busybox",
                "busybox:latest",
                "127.0.0.1:5000/nexa/busybox:1",
                "127.0.0.1:5000/nexa/busybox@sha256:abc",
                f"127.0.0.1:5000/nexa/busybox@sha512:{digest}",
                f"127.0.0.1:5000/nexa/busybox:1@sha256:{digest.upper()}",
            ):
                with pytest.raises(ContractError):
                    await client.pull(image)
                with pytest.raises(ContractError):
                    await client.image_exists(image)
                with pytest.raises(ContractError):
                    await client.create(make_spec(image, {RUN_LABEL: "x"}))
            good = f"127.0.0.1:5000/nexa/busybox@sha256:{digest}"
            with pytest.raises(ContractError, match="network"):
                await client.create(make_spec(good, {RUN_LABEL: "x"}, network="bridge"))
            with pytest.raises(ContractError, match="CDI"):
                await client.create(make_spec(good, {RUN_LABEL: "x"}, devices=["/dev/nvidia0"]))
            with pytest.raises(ContractError, match="absolute"):
                await client.create(make_spec(good, {RUN_LABEL: "x"}, ro_mounts=[("models/x", "/models/model")]))
    assert requests == []


# -- hardening ---------------------------------------------------------------------------------


async def test_a_running_container_is_hardened_as_the_spec_says(
    podman: LibpodEngine,
    podman_service: PodmanService,
    test_images: BuiltImages,
    fake_gpu_cdi: FakeGpu,
    run_labels: dict[str, str],
    tmp_path: Path,
) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights\n")
    env = {"NEXA_RUNTIME_PORT": "18555", "LOG_LEVEL": "info", "EMPTY": ""}
    probe = HealthProbe(command=["wget", "-q", "-O", "/dev/null", "http://127.0.0.1:18555/"], timeout_s=3, retries=3)
    spec = make_spec(
        test_images.busybox,
        run_labels,
        env=env,
        devices=[fake_gpu_cdi.device],
        ro_mounts=[(str(model), "/models/model")],
        memory_bytes=96 * MiB,
        cpus=0.5,
        pids_limit=48,
        shm_bytes=16 * MiB,
        health=probe,
        stop_timeout_s=7.5,
    )
    with trio.fail_after(60):
        await podman.pull(test_images.busybox)
        container_id = await podman.create(spec)
        await podman.start(container_id)
        doc = await raw_inspect(podman_service.socket, container_id)
        pid = int(doc["State"]["Pid"])
        host, config = doc["HostConfig"], doc["Config"]

        # Image by digest, labels as given.
        assert doc["ImageName"] == test_images.busybox
        assert doc["ImageDigest"] == test_images.busybox_digest
        assert config["Labels"] == run_labels

        # Read-only root filesystem; /tmp is the writable scratch tmpfs.
        assert host["ReadonlyRootfs"] is True
        assert "ro" in mount_options(pid, "/")
        assert (await run_in(podman_service, container_id, "sh", "-c", "echo x > /written")).returncode != 0
        scratch = await run_in(podman_service, container_id, "sh", "-c", "echo x > /tmp/w && cat /tmp/w")
        assert scratch.returncode == 0 and scratch.stdout == b"x\n"
        assert mount_info(pid, "/tmp")[0] == "tmpfs"

        # No capabilities at all, no privilege gain, seccomp on: as the kernel holds it for PID 1.
        status = proc_status(pid)
        for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[caps], 16) == 0, (caps, status[caps])
        assert status["NoNewPrivs"] == "1"
        assert status["Seccomp"] == "2"
        assert host["CapAdd"] == []
        assert "no-new-privileges" in host["SecurityOpt"]
        assert host["Privileged"] is False

        # Limits, in podman's record and in the kernel's cgroups.
        assert host["Memory"] == 96 * MiB
        assert host["MemorySwap"] == 96 * MiB
        assert host["PidsLimit"] == 48
        assert (host["CpuQuota"], host["CpuPeriod"]) == (50_000, 100_000)
        assert host["ShmSize"] == 16 * MiB
        assert int(cgroup_value(pid, "memory", "memory.limit_in_bytes", "memory.max")) == 96 * MiB
        assert cgroup_value(pid, "pids", "pids.max", "pids.max") == "48"
        quota = cgroup_value(pid, "cpu", "cpu.cfs_quota_us", "cpu.max").split()[0]
        period = cgroup_value(pid, "cpu", "cpu.cfs_period_us", "cpu.max").split()[-1]
        assert (int(quota), int(period)) == (50_000, 100_000)
        assert "size=16384k" in mount_options(pid, "/dev/shm")

        # The CDI fake GPU: /dev/zero shows up as /dev/nvidia0, usable; its env variable is set.
        device = os.stat(f"/proc/{pid}/root{fake_gpu_cdi.path}")
        assert stat.S_ISCHR(device.st_mode)
        assert (os.major(device.st_rdev), os.minor(device.st_rdev)) == (1, 5)
        read = await run_in(podman_service, container_id, "sh", "-c", f"head -c 4 {fake_gpu_cdi.path} | wc -c")
        assert read.stdout.strip() == b"4"

        # The env: exactly the spec's, plus only what podman, the image and the CDI device add.
        environ = proc_environ(pid)
        assert {key: environ.get(key) for key in env} == env
        assert set(environ) - set(env) <= PODMAN_ENV | set(fake_gpu_cdi.env)
        assert environ["FAKE_GPU_INDEX"] == "0"
        assert [key for key in environ if SECRET_NAME.search(key)] == []
        assert [key for key, value in environ.items() if TOKEN_VALUE.match(value)] == []
        assert sorted(config["Env"]) == sorted(f"{k}={v}" for k, v in environ.items())

        # The model file: visible read-only, not writable even by root inside.
        assert (await run_in(podman_service, container_id, "cat", "/models/model")).stdout == b"weights\n"
        assert (await run_in(podman_service, container_id, "sh", "-c", "echo x >> /models/model")).returncode != 0
        assert "ro" in mount_options(pid, "/models/model")
        assert model.read_bytes() == b"weights\n"

        # Host network namespace (the runtime binds 127.0.0.1); no restart policy; SIGTERM then SIGKILL.
        assert host["NetworkMode"] == "host"
        assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
        assert host["RestartPolicy"]["Name"] in ("", "no")
        assert config["StopSignal"] == 15
        assert config["StopTimeout"] == math.ceil(spec.stop_timeout_s)

        # The probe is stored for on-demand runs; podman's own periodic runs are off (Interval 0),
        # and its start period and retries are neutral: the agent keeps its own.
        health = config["Healthcheck"]
        assert health["Test"] == ["CMD", *probe.command]
        assert health["Timeout"] == 3_000_000_000
        assert health.get("StartPeriod", 0) == 0
        assert health.get("Retries", 1) == 1
        assert health.get("Interval", 0) == 0

        # network "none": no network namespace shared with the host.
        isolated = await podman.create(make_spec(test_images.busybox, run_labels, network="none"))
        assert (await raw_inspect(podman_service.socket, isolated))["HostConfig"]["NetworkMode"] == "none"


# -- health, stop, remove ----------------------------------------------------------------------


async def test_healthcheck_runs_the_probe_now_and_follows_what_it_checks(
    podman: LibpodEngine, podman_service: PodmanService, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    probe = HealthProbe(command=["test", "-f", "/tmp/ok"], timeout_s=5, start_period_s=0, retries=1)
    with trio.fail_after(60):
        await podman.pull(test_images.busybox)
        container_id = await podman.create(make_spec(test_images.busybox, run_labels, health=probe))
        await podman.start(container_id)
        assert await podman.healthcheck(container_id) is False
        assert (await run_in(podman_service, container_id, "touch", "/tmp/ok")).returncode == 0
        assert await podman.healthcheck(container_id) is True
        assert await podman.healthcheck(container_id) is True
        assert (await run_in(podman_service, container_id, "rm", "/tmp/ok")).returncode == 0
        assert await podman.healthcheck(container_id) is False
        await podman.stop(container_id, timeout_s=5)
        assert await podman.healthcheck(container_id) is False  # not running is not healthy


async def test_stop_honours_its_timeout_then_remove_removes(
    podman: LibpodEngine, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    with trio.fail_after(90):
        await podman.pull(test_images.busybox)
        graceful = await podman.create(make_spec(test_images.busybox, run_labels, command=GRACEFUL))
        stubborn = await podman.create(make_spec(test_images.busybox, run_labels, command=STUBBORN, stop_timeout_s=30))
        await podman.start(graceful)
        await podman.start(stubborn)
        await podman.start(graceful)  # already running: nothing to do

        started = time.monotonic()
        await podman.stop(graceful, timeout_s=20)
        assert time.monotonic() - started < 5  # it handled SIGTERM; no waiting for the timeout
        state = await podman.inspect(graceful)
        assert (state.running, state.status, state.exit_code) == (False, "exited", 0)
        await podman.stop(graceful, timeout_s=20)  # already stopped: nothing to do

        started = time.monotonic()
        await podman.stop(stubborn, timeout_s=1.5)  # rounded up to 2 s, then SIGKILL
        elapsed = time.monotonic() - started
        assert 1.5 <= elapsed < 10, elapsed
        state = await podman.inspect(stubborn)
        assert (state.running, state.exit_code) == (False, 137)

        await podman.remove(graceful)
        with pytest.raises(ContainerNotFound):
            await podman.inspect(graceful)
        with pytest.raises(ContainerNotFound):
            await podman.remove(graceful)

        await podman.start(stubborn)
        with pytest.raises(EngineError, match="running"):
            await podman.remove(stubborn)  # running, and not forced
        started = time.monotonic()
        await podman.remove(stubborn, force=True)
        assert time.monotonic() - started < 10  # force kills at once, not after its 30 s stop timeout
        with pytest.raises(ContainerNotFound):
            await podman.inspect(stubborn)


# -- list and events ---------------------------------------------------------------------------


async def test_list_returns_every_container_with_all_the_labels(
    podman: LibpodEngine, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    with trio.fail_after(60):
        await podman.pull(test_images.busybox)
        a = await podman.create(make_spec(test_images.busybox, {**run_labels, "nexa-test.role": "a"}))
        b = await podman.create(make_spec(test_images.busybox, {**run_labels, "nexa-test.role": "b"}))
        await podman.start(a)

        states = {state.id: state for state in await podman.list(run_labels)}
        assert set(states) == {a, b}
        assert states[a].running and states[a].status == "running"
        assert not states[b].running and states[b].status == "created"
        assert {state.image_digest for state in states.values()} == {test_images.busybox_digest}
        assert states[a] == await podman.inspect(a)

        assert [s.id for s in await podman.list({**run_labels, "nexa-test.role": "a"})] == [a]
        assert await podman.list({RUN_LABEL: f"nobody-{uuid.uuid4().hex}"}) == []
        everything = {state.id for state in await podman.list()}
        assert {a, b} <= everything


#: What podman 4 answered in CI when `list` inspected a container that was being removed at that
#: moment: a 500 (not a 404) whose cause is libpod's `define.ErrNoSuchCtr`.
_REMOVING_ANSWER = {
    "cause": "no such container",
    "message": "container {id} does not exist in database: no such container",
    "response": 500,
}


async def test_a_container_removed_while_listing_is_left_out_even_when_podman_answers_500(
    podman: LibpodEngine, test_images: BuiltImages, run_labels: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(60):
        await podman.pull(test_images.busybox)
        kept = await podman.create(make_spec(test_images.busybox, {**run_labels, "nexa-test.role": "kept"}))
        going = await podman.create(make_spec(test_images.busybox, {**run_labels, "nexa-test.role": "going"}))
        real_request = podman._http.request

        async def removing(method: str, path: str, **kwargs: Any) -> EngineAnswer:
            if method == "GET" and path == f"/containers/{going}/json":
                body = {**_REMOVING_ANSWER, "message": _REMOVING_ANSWER["message"].format(id=going)}
                return EngineAnswer(500, json.dumps(body).encode())
            return await real_request(method, path, **kwargs)

        monkeypatch.setattr(podman._http, "request", removing)
        assert [state.id for state in await podman.list(run_labels)] == [kept]
        with pytest.raises(ContainerNotFound, match="no such container"):
            await podman.inspect(going)
        # Any other 500 is still an engine failure, not a missing container.
        monkeypatch.setattr(
            podman._http, "request", lambda *a, **k: _answer(EngineAnswer(500, b'{"cause": "database is locked"}'))
        )
        with pytest.raises(EngineError, match="answered 500") as failed:
            await podman.inspect(kept)
        assert not isinstance(failed.value, ContainerNotFound)


async def _answer(answer: EngineAnswer) -> EngineAnswer:
    return answer


async def test_events_stream_start_and_died_for_the_labelled_container_only(
    podman: LibpodEngine, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    watched_labels = {**run_labels, "nexa-test.role": "watched"}
    since = time.time() - 1  # replays anything between subscribing and podman streaming
    with trio.fail_after(60):
        await podman.pull(test_images.busybox)
        send, receive = trio.open_memory_channel[EngineEvent](100)

        async def watch() -> None:
            async with aclosing(podman.events(watched_labels, since=since)) as events, send:
                async for event in events:
                    await send.send(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            # Same run label, another role: libpod ORs label filters, the client must AND them.
            other = await podman.create(
                make_spec(test_images.busybox, {**run_labels, "nexa-test.role": "other"}, command=["true"])
            )
            await podman.start(other)
            watched = await podman.create(
                make_spec(test_images.busybox, watched_labels, command=["sh", "-c", "sleep 0.3; exit 3"])
            )
            await podman.start(watched)

            seen: list[EngineEvent] = []
            async for event in receive:
                seen.append(event)
                if event.action == "died":
                    break
            nursery.cancel_scope.cancel()

    actions = [event.action for event in seen]
    assert {event.container_id for event in seen} == {watched}, seen
    assert "create" in actions
    assert actions.index("start") < actions.index("died")
    assert all(event.labels == watched_labels for event in seen)
    state = await podman.inspect(watched)
    assert (state.running, state.exit_code) == (False, 3)

    # A new subscription from `since` replays that history; leaving a stream early is clean (no
    # unclosed generators for trio to warn about, with warnings as errors).
    with trio.fail_after(20):
        async with aclosing(podman.events(watched_labels, since=since)) as events:
            async for event in events:
                assert (event.container_id, event.action) == (watched, "create")
                break


# -- failures ----------------------------------------------------------------------------------


async def test_a_socket_that_does_not_exist_is_engine_unavailable(tmp_path: Path) -> None:
    async with LibpodEngine(str(tmp_path / "absent.sock")) as client:
        with trio.fail_after(10):
            with pytest.raises(EngineUnavailable, match="does not answer"):
                await client.version()
            with pytest.raises(EngineUnavailable):
                await client.pull(f"127.0.0.1:5000/nexa/busybox@sha256:{'a' * 64}")
            with pytest.raises(EngineUnavailable):
                await client.inspect("anything")
            with pytest.raises(EngineUnavailable):
                await client.list()
            with pytest.raises(EngineUnavailable):
                async with aclosing(client.events({RUN_LABEL: "x"})) as events:
                    await events.__anext__()


async def test_an_unknown_container_is_container_not_found(podman: LibpodEngine) -> None:
    absent = f"nexa-test-absent-{uuid.uuid4().hex}"
    with trio.fail_after(20):
        with pytest.raises(ContainerNotFound):
            await podman.inspect(absent)
        with pytest.raises(ContainerNotFound):
            await podman.start(absent)
        with pytest.raises(ContainerNotFound):
            await podman.stop(absent, timeout_s=1)
        with pytest.raises(ContainerNotFound):
            await podman.remove(absent, force=True)
        with pytest.raises(ContainerNotFound):
            await podman.healthcheck(absent)
        with pytest.raises(LookupError):
            await podman.inspect(absent)


async def test_version_answers(podman: LibpodEngine) -> None:
    with trio.fail_after(10):
        assert re.match(r"^\d+\.\d+", await podman.version())


# -- registry credentials ----------------------------------------------------------------------


async def test_an_answer_larger_than_the_bound_is_refused_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runaway answer (fault injection: a socket that never stops talking) ends as an EngineError."""
    monkeypatch.setattr(engine_http, "MAX_ANSWER_BYTES", 4096)
    sizes = {"/v4.0.0/libpod/version": 4096, "/v4.0.0/libpod/containers/json": 4097}

    def handler(request: httpx.Request) -> httpx.Response:
        size = sizes[request.url.path]
        body = json.dumps({"Version": "4.3.1"} if "version" in request.url.path else []).encode()
        return httpx.Response(200, content=b" " * (size - len(body)) + body)  # JSON may start with spaces

    async with LibpodEngine("/unused.sock", transport=httpx.MockTransport(handler)) as client:
        with trio.fail_after(5):
            assert await client.version() == "4.3.1"  # exactly at the bound: read
            with pytest.raises(
                EngineError, match=r"podman answered GET /v4.0.0/libpod/containers/json with more than 4096 bytes"
            ):
                await client.list()


async def test_credentials_go_only_into_the_pull_auth_header_and_never_into_errors() -> None:
    credentials = RegistryAuths.of(
        RegistryCredentials(registry="registry.example:5000", username="puller", password="s3cr3t-Pa55word")
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if "broken" in str(request.url):
            # A registry error that echoes what it was given: the client must not pass it on.
            return httpx.Response(200, text='{"error":"unauthorized: puller/s3cr3t-Pa55word rejected"}\n')
        return httpx.Response(200, text='{"images":["abc"],"id":"abc"}\n')

    image = f"registry.example:5000/nexa/busybox@sha256:{'b' * 64}"
    transport = httpx.MockTransport(handler)
    async with LibpodEngine("/unused.sock", credentials=credentials, transport=transport) as client:
        with trio.fail_after(5):
            await client.pull(image)
            with pytest.raises(EngineError) as caught:
                await client.pull(image.replace("busybox", "broken"))
            await client.image_exists(image)

    pull = seen[0]
    auth = json.loads(base64.urlsafe_b64decode(pull.headers["X-Registry-Auth"]))
    assert auth == {"username": "puller", "password": "s3cr3t-Pa55word"}
    assert pull.url.params["reference"] == image
    assert pull.url.params["tlsVerify"] == "true"
    assert "s3cr3t" not in str(pull.url)
    assert "s3cr3t" not in str(caught.value) and "puller" not in str(caught.value)
    assert "X-Registry-Auth" not in seen[2].headers  # only pulls carry it
    assert "s3cr3t" not in repr(credentials)


def test_load_registry_credentials(tmp_path: Path) -> None:
    good = tmp_path / "registry.json"
    docker_auth = base64.b64encode(b"hub-user:hub-pw-9").decode()
    good.write_text(
        json.dumps(
            {
                "auths": {
                    "Registry.Example:5000": {"username": "puller", "password": "pw-123"},
                    "https://index.docker.io/v1/": {"auth": docker_auth, "token_realms": ["auth.docker.io"]},
                    "[::1]:5000": {"username": "v6", "password": "pw-6"},
                }
            }
        )
    )
    good.chmod(0o600)
    auths = load_registry_credentials(good)
    assert auths.for_registry("registry.example:5000") == RegistryCredentials(
        registry="registry.example:5000", username="puller", password="pw-123"
    )
    hub = auths.for_image(f"busybox@sha256:{'a' * 64}")
    assert hub is not None
    assert (hub.registry, hub.username, hub.password) == ("registry-1.docker.io", "hub-user", "hub-pw-9")
    assert hub.may_get_token_from("auth.docker.io")
    assert not hub.may_get_token_from("auth.example.com")
    assert auths.for_registry("[::1]:5000") is not None
    # Another port, or another name for the same address, is another registry.
    assert auths.for_registry("registry.example") is None
    assert auths.for_registry("registry.example:5001") is None
    assert "pw-123" not in repr(auths)

    bad = {
        "not-json.json": '{"auths": {"r.example": {"username": "puller", "password": "pw-123"}}',
        "no-password.json": json.dumps({"auths": {"r.example": {"username": "puller"}}}),
        "empty-user.json": json.dumps({"auths": {"r.example": {"username": "", "password": "pw-123"}}}),
        "extra.json": json.dumps({"auths": {"r.example": {"username": "u", "password": "pw-123", "token": "t"}}}),
        "list.json": json.dumps(["puller", "pw-123"]),
        "no-auths.json": json.dumps({"auths": {}}),
        "bad-host.json": json.dumps({"auths": {"r example/x": {"username": "u", "password": "pw-123"}}}),
        "wildcard.json": json.dumps({"auths": {"*.example.com": {"username": "u", "password": "pw-123"}}}),
        "bad-auth.json": json.dumps({"auths": {"r.example": {"auth": "pw-123"}}}),
        "bad-realms.json": json.dumps(
            {"auths": {"r.example": {"username": "u", "password": "pw-123", "token_realms": "a"}}}
        ),
        "twice.json": json.dumps(
            {"auths": {"docker.io": {"username": "u", "password": "pw-123"}, "index.docker.io": {"auth": docker_auth}}}
        ),
        "other-top.json": json.dumps({"auths": {"r.example": {"username": "u", "password": "p"}}, "credsStore": "x"}),
    }
    for name, text in bad.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_registry_credentials(path)
        assert "pw-123" not in str(caught.value), name
        assert "hub-pw-9" not in str(caught.value), name
    with pytest.raises(ConfigError, match="cannot read"):
        load_registry_credentials(tmp_path / "absent.json")


def test_a_credentials_file_naming_no_registry_is_refused_saying_how_to_name_one(tmp_path: Path) -> None:
    """The older `{"username", "password"}` file cannot say where its credentials may go."""
    old = tmp_path / "registry.json"
    old.write_text(json.dumps({"username": "puller", "password": "pw-123"}))
    with pytest.raises(ConfigError) as caught:
        load_registry_credentials(old)
    assert "names no registry" in caught.value.message
    assert '{"auths": {"REGISTRY-HOST[:PORT]"' in caught.value.message
    assert "pw-123" not in caught.value.message


@pytest.mark.parametrize(
    ("image", "sent"),
    [
        (f"registry.example:5000/nexa/busybox@sha256:{'b' * 64}", True),
        (f"registry.example:5001/nexa/busybox@sha256:{'b' * 64}", False),  # another port
        (f"registry.example/nexa/busybox@sha256:{'b' * 64}", False),  # another port (443)
        (f"evil.example/registry.example:5000/busybox@sha256:{'b' * 64}", False),  # another host
        (f"127.0.0.2:5000/nexa/busybox@sha256:{'b' * 64}", False),
        (f"busybox@sha256:{'b' * 64}", False),  # Docker Hub
    ],
)
async def test_a_pull_carries_credentials_only_for_their_own_registry(image: str, sent: bool) -> None:
    """The decision both engines make (podman's libpod and the Docker API): X-Registry-Auth only
    when the image's registry is the credentials' host."""
    credentials = RegistryAuths.of(
        RegistryCredentials(registry="registry.example:5000", username="puller", password="s3cr3t-Pa55word")
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, text='{"images":["abc"],"id":"abc"}\n')

    async with LibpodEngine(
        "/unused.sock", credentials=lambda: credentials, transport=httpx.MockTransport(handler)
    ) as client:
        with trio.fail_after(5):
            await client.pull(image)
    assert ("X-Registry-Auth" in seen[-1].headers) is sent
