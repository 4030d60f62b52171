"""`nexa node` running real runtimes: real podman (rootful, per-run socket), a real OCI registry,
a real S3 store (SeaweedFS) and a CDI fake GPU. The controller is reduced to its channel
(`FakeController`, real CurveZMQ and a real controller key), because deployments come later.

The agent runs as its own process, so it can be killed with SIGKILL and started again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa.contracts import wire
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ArtifactRef, HealthProbe, RuntimeSpec
from nexa.localparts import free_ports
from tests.realparts import BuiltImages, EngineUnderTest, FakeGpu, PodmanService
from tests.support.agent_process import (
    PROBE_S,
    RS,
    TIMEOUT_S,
    AgentProcess,
    beat_until,
    busybox_runtime,
    podman,
    state_is,
    status,
)
from tests.support.nodes import FakeController, aset


@pytest.mark.slow
async def test_a_runtime_runs_hardened_survives_an_agent_kill_and_reports_truthfully(
    node: tuple[FakeController, AgentProcess],
    podman_service: PodmanService,
    test_images: BuiltImages,
    fake_gpu_cdi: FakeGpu,
    artifact: ArtifactRef,
) -> None:
    ctl, agent = node
    port = 18000 + os.getpid() % 1000
    spec = busybox_runtime(test_images.busybox, port, artifact, fake_gpu_cdi.device)
    with trio.fail_after(TIMEOUT_S):
        await ctl.next(wire.Hello)
        assert (
            await ctl.answer(aset(1, 1, assignments=[wire.Assignment(id="a1", deployment="d1", runtime=spec)]))
        ).accepted
    await beat_until(ctl, state_is("a1", RS.READY), "a1 Ready")

    # The container is what the assignment said, hardened, and holds no secrets.
    [info] = json.loads(podman(podman_service, "inspect", "nexa-a1"))
    digest = test_images.busybox.split("@", 1)[1]
    assert info["ImageDigest"] == digest
    labels = info["Config"]["Labels"]
    assert (labels["nexa.assignment"], labels["nexa.deployment"], labels["nexa.generation"]) == ("a1", "d1", "1")
    assert info["HostConfig"]["ReadonlyRootfs"] is True
    assert info["HostConfig"]["CapDrop"] and not info["EffectiveCaps"]
    assert "no-new-privileges" in " ".join(info["HostConfig"]["SecurityOpt"])
    assert info["HostConfig"]["Memory"] == 64 << 20 and info["HostConfig"]["PidsLimit"] == 64
    env = dict(item.split("=", 1) for item in info["Config"]["Env"])
    assert env["MODEL_PATH"] == "/models/model" and env["FAKE_GPU_INDEX"] == "0"
    assert not [k for k in env if any(word in k.upper() for word in ("KEY", "TOKEN", "SECRET", "PASSWORD"))]
    [model] = [m for m in info["Mounts"] if m["Destination"] == "/models/model"]
    assert model["RW"] is False
    # Its writable cache: a directory of the agent's state dir, read-write, nosuid and nodev.
    [cache] = [m for m in info["Mounts"] if m["Destination"] == "/var/cache/nexa-runtime"]
    assert cache["RW"] is True and {"nosuid", "nodev"} <= set(cache["Options"]), cache
    assert "/runtime-cache/" in cache["Source"]
    inside = podman(podman_service, "exec", "nexa-a1", "sha256sum", "/models/model")
    assert inside.split()[0] == artifact.sha256
    assert "nvidia0" in podman(podman_service, "exec", "nexa-a1", "ls", "/dev").split()

    # kill -9 of the agent: its successor adopts the running container without restarting it.
    started_at = info["State"]["StartedAt"]
    agent.kill(signal.SIGKILL)
    agent.start()
    restarted = time.time()  # heartbeats the killed agent left queued are older than this
    await beat_until(ctl, lambda b: b.ts > restarted and state_is("a1", RS.READY)(b), "a1 Ready after the restart")
    # The adopting agent holds the replica's cache again, and says so in its heartbeats.
    held = await beat_until(
        ctl, lambda b: b.runtime_cache is not None and b.runtime_cache.in_use == 1, "runtime cache in use"
    )
    assert held.runtime_cache is not None and held.runtime_cache.directories == 1
    [again] = json.loads(podman(podman_service, "inspect", "nexa-a1"))
    assert again["State"]["StartedAt"] == started_at
    assert again["Id"] == info["Id"]

    # A health flip is reported within two probe intervals (plus one heartbeat).
    podman(podman_service, "exec", "nexa-a1", "rm", "/tmp/ok")
    flipped = time.monotonic()
    await beat_until(ctl, state_is("a1", RS.UNHEALTHY), "a1 Unhealthy")
    assert time.monotonic() - flipped <= 2 * PROBE_S + 0.2 + 0.5  # two probes, one beat, scheduling slack
    podman(podman_service, "exec", "nexa-a1", "touch", "/tmp/ok")
    await beat_until(ctl, state_is("a1", RS.READY), "a1 Ready again")

    # A crash: the agent restarts it (with backoff) and counts the restart.
    podman(podman_service, "kill", "nexa-a1")
    beat = await beat_until(
        ctl, lambda b: (s := status(b, "a1")) is not None and s.restarts >= 1 and s.state is RS.READY, "restarted"
    )
    assert status(beat, "a1") is not None

    # Removing the assignment stops and removes the container.
    with trio.fail_after(TIMEOUT_S):
        assert (await ctl.answer(aset(1, 2, assignments=[]))).accepted
    await beat_until(ctl, lambda b: not b.assignments, "nothing assigned")
    assert not podman(podman_service, "ps", "-aq", "--filter", "label=nexa.assignment=a1").split()


@pytest.mark.slow
async def test_bad_images_and_artifacts_never_start_and_orphans_are_removed(
    node: tuple[FakeController, AgentProcess],
    podman_service: PodmanService,
    oci_registry: Any,
    test_images: BuiltImages,
    fake_gpu_cdi: FakeGpu,
    artifact: ArtifactRef,
) -> None:
    ctl, _agent = node
    # An orphan: a nexa-labelled container of this node that no assignment names.
    podman(
        podman_service,
        "run",
        "-d",
        "--name",
        "nexa-ghost",
        "--label",
        "nexa.node=n1",
        "--label",
        "nexa.assignment=ghost",
        test_images.busybox,
        "sleep",
        "600",
    )
    repo = test_images.busybox.split("@", 1)[0]
    missing_image = attrs.evolve(
        busybox_runtime(test_images.busybox, 18990, artifact, fake_gpu_cdi.device), image=f"{repo}@sha256:{'e' * 64}"
    )
    tampered = attrs.evolve(
        busybox_runtime(test_images.busybox, 18991, artifact, fake_gpu_cdi.device),
        artifact=attrs.evolve(artifact, sha256="f" * 64),
    )
    with trio.fail_after(TIMEOUT_S):
        await ctl.next(wire.Hello)
        sets = [
            wire.Assignment(id="a2", deployment="d2", runtime=missing_image),
            wire.Assignment(id="a3", deployment="d3", runtime=tampered),
        ]
        assert (await ctl.answer(aset(1, 1, assignments=sets))).accepted
    beat = await beat_until(
        ctl,
        lambda b: (
            state_is("a2", RS.FAILED, "image_not_found")(b) and state_is("a3", RS.FAILED, "artifact_digest_mismatch")(b)
        ),
        "both refused",
    )
    assert beat is not None
    names = podman(podman_service, "ps", "-a", "--format", "{{.Names}}", "--filter", "label=nexa.node=n1").split()
    assert "nexa-a2" not in names and "nexa-a3" not in names  # neither runtime ever started

    with trio.fail_after(TIMEOUT_S):
        while podman(podman_service, "ps", "-aq", "--filter", "name=nexa-ghost").strip():  # noqa: ASYNC110
            await trio.sleep(0.2)


# --- the same agent on every engine (issue 14): libpod, podman's Docker API, dockerd -----------------


@pytest.fixture
async def engine_node(
    nursery: trio.Nursery, tmp_path: Path, container_engine: EngineUnderTest
) -> AsyncIterator[tuple[FakeController, AgentProcess, str]]:
    """`nexa node` as its own process on `container_engine`; yields the node's label value too."""
    ctl = FakeController(nursery)
    await ctl.start()
    state_dir = tmp_path / "state"
    ctl.enroll(state_dir)
    table = "".join(f'{key} = "{value}"\n' for key, value in container_engine.container_table().items())
    config = tmp_path / "node.toml"
    config.write_text(
        f'state_dir = "{state_dir}"\ninventory_path = "{tmp_path / "inventory.json"}"\n'
        f'nvidia_smi = "{tmp_path / "no-nvidia-smi"}"\nheartbeat_interval_s = 0.2\nreconnect_max_s = 0.5\n'
        f"[container]\n{table}registry_tls_verify = false\n"
        "[supervisor]\nrestart_backoff_initial_s = 0.5\nrestart_backoff_max_s = 2\nreconcile_interval_s = 0.5\n"
    )
    agent = AgentProcess(config=config, log=tmp_path / "agent.log")
    agent.start()
    try:
        yield ctl, agent, "n1"
    finally:
        agent.kill()
        container_engine.remove_labelled("nexa.node", "n1")


def _inspect(engine: EngineUnderTest, name: str) -> dict[str, Any] | None:
    """The engine's Docker-API inspect of `name` (podman's socket answers the Docker API too)."""
    transport = httpx.HTTPTransport(uds=engine.socket)
    with httpx.Client(transport=transport, base_url="http://d", trust_env=False, timeout=30) as api:
        answer = api.get(f"/containers/{name}/json")
        if answer.status_code == 404:
            return None
        answer.raise_for_status()
        data: dict[str, Any] = answer.json()
        return data


@pytest.mark.slow
async def test_the_agent_runs_a_hardened_runtime_on_every_engine(
    engine_node: tuple[FakeController, AgentProcess, str],
    container_engine: EngineUnderTest,
    test_images: BuiltImages,
) -> None:
    ctl, agent, _ = engine_node
    await container_engine.store_image(test_images.busybox)
    (port,) = free_ports(1, "127.0.0.1")
    # Its own network namespace (the default): it binds {runtime_host} (0.0.0.0 inside), the engine
    # publishes the port on the node's runtime address, 127.0.0.1.
    spec = RuntimeSpec(
        kind=RuntimeKind.LLAMACPP,
        image=test_images.busybox,
        command=["/bin/sh", "-c", f"touch /tmp/ok && exec /bin/httpd -f -p {{runtime_host}}:{port} -h /www"],
        port=port,
        memory_bytes=64 << 20,
        cpus=0.5,
        pids_limit=64,
        health=HealthProbe(
            command=["/bin/sh", "-c", f"wget -q -O /dev/null http://{{runtime_host}}:{port}/"],
            interval_s=PROBE_S,
            timeout_s=2.0,
            start_period_s=10.0,
            retries=1,
        ),
        stop_timeout_s=2.0,
    )
    with trio.fail_after(TIMEOUT_S):
        await ctl.next(wire.Hello)
        assert (
            await ctl.answer(aset(1, 1, assignments=[wire.Assignment(id="a1", deployment="d1", runtime=spec)]))
        ).accepted
    beat = await beat_until(ctl, state_is("a1", RS.READY), "a1 Ready")
    # The inventory names the engine, its version and the GPU method.
    want_engine = "docker" if container_engine.docker else "podman"
    assert beat.inventory.container_engine == want_engine
    assert beat.inventory.container_engine_version[:1].isdigit()
    assert beat.inventory.gpu_method == "cdi"

    info = _inspect(container_engine, "nexa-a1")
    assert info is not None
    host = info["HostConfig"]
    assert host["ReadonlyRootfs"] is True and host["Memory"] == 64 << 20 and host["PidsLimit"] == 64
    assert host["CapDrop"]
    assert "no-new-privileges" in " ".join(host["SecurityOpt"] or [])
    assert info["Config"]["Labels"]["nexa.assignment"] == "a1"
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as http:
        with trio.fail_after(TIMEOUT_S):
            while True:
                try:
                    answer = await http.get(f"http://127.0.0.1:{port}/")
                    break
                except httpx.TransportError:
                    await trio.sleep(0.2)
        assert answer.status_code == 200

    # kill -9 of the agent: its successor adopts the running container without restarting it.
    agent.kill(signal.SIGKILL)
    agent.start()
    restarted = time.time()
    await beat_until(ctl, lambda b: b.ts > restarted and state_is("a1", RS.READY)(b), "a1 Ready after the restart")
    # The adopting agent holds the replica's cache again, and says so in its heartbeats.
    held = await beat_until(
        ctl, lambda b: b.runtime_cache is not None and b.runtime_cache.in_use == 1, "runtime cache in use"
    )
    assert held.runtime_cache is not None and held.runtime_cache.directories == 1
    again = _inspect(container_engine, "nexa-a1")
    assert again is not None
    assert (again["Id"], again["State"]["StartedAt"]) == (info["Id"], info["State"]["StartedAt"])

    # Removing the assignment stops and removes the container.
    with trio.fail_after(TIMEOUT_S):
        assert (await ctl.answer(aset(1, 2, assignments=[]))).accepted
    await beat_until(ctl, lambda b: not b.assignments, "nothing assigned")
    with trio.fail_after(TIMEOUT_S):
        while _inspect(container_engine, "nexa-a1") is not None:  # noqa: ASYNC110 - polling the engine
            await trio.sleep(0.2)
