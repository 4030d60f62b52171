"""Runtime containers against real rootful podman (tests/realparts.py): their own network namespace
by default (issue 12, point 11), on every engine (libpod, podman's Docker API, dockerd: issue 14),
a container between states is not a crashed one (point 16), and each replica's writable cache on a
read-only root, kept for the next container of the same thing (issue 29, point 2).

The supervisor runs with the real `LibpodEngine`; only the artifact cache is a fake (no artifact).
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa import container_spec
from nexa.adapters.vllm import VLLM
from nexa.config import Seconds, SupervisorConfig
from nexa.contracts import wire
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import (
    NETWORK_HOST,
    NETWORK_PRIVATE,
    RUNTIME_CACHE_PATH,
    ContainerSpec,
    HealthProbe,
    RuntimeSpec,
)
from nexa.localparts import free_ports
from nexa.node.engines.interface import ContainerEngine
from nexa.node.engines.libpod import LibpodEngine
from nexa.node.runtime_cache import RuntimeCaches, cache_key
from nexa.node.supervisor import Supervisor
from tests.realparts import RUN_LABEL, BuiltImages, EngineUnderTest, PodmanService
from tests.support.supervisor import FakeArtifacts, small_spec

#: A loopback address the node's runtimes are NOT published on; the test listens there.
OUTSIDE_HOST = "127.0.0.77"
#: The node's runtime address in these tests.
RUNTIME_HOST = "127.0.0.66"
TIMEOUT_S = 60
MiB = 1024 * 1024


@pytest.fixture
def run_labels(podman_service: PodmanService) -> Iterator[dict[str, str]]:
    value = uuid.uuid4().hex[:12]
    try:
        yield {RUN_LABEL: value, container_spec.LABEL_NODE: f"n-{value}"}
    finally:
        podman_service.cli("rm", "--force", "--time", "0", "--filter", f"label={RUN_LABEL}={value}", check=False)


@pytest.fixture
async def podman(podman_socket: str, test_images: BuiltImages) -> AsyncIterator[ContainerEngine]:
    async with LibpodEngine(podman_socket, tls_verify=False) as client:
        await client.pull(test_images.busybox)
        yield client


@pytest.fixture
def engine_labels(container_engine: EngineUnderTest) -> Iterator[dict[str, str]]:
    value = uuid.uuid4().hex[:12]
    try:
        yield {RUN_LABEL: value, container_spec.LABEL_NODE: f"n-{value}"}
    finally:
        container_engine.remove_labelled(RUN_LABEL, value)


@pytest.fixture
def outside_listener() -> Iterator[int]:
    """A TCP listener on another loopback address of the node: what a runtime must not reach.
    It answers every connection with a line and closes it, so a client that got in ends at once."""
    with socket.socket() as s:
        s.bind((OUTSIDE_HOST, 0))
        s.listen(8)
        s.settimeout(0.2)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = s.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.sendall(b"reached\n")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield s.getsockname()[1]
        finally:
            stop.set()
            thread.join()


def _spec(image: str, labels: dict[str, str], command: list[str], **changes: Any) -> ContainerSpec:
    return small_spec(image, command=command, labels=labels, **changes)


async def _exit_code(podman: ContainerEngine, container_id: str) -> int:
    with trio.fail_after(TIMEOUT_S):
        while True:
            state = await podman.inspect(container_id)
            if state.exited:
                assert state.exit_code is not None
                return state.exit_code
            await trio.sleep(0.1)


def _probe_command(port: int) -> list[str]:
    # Exit 0 when the connection is made, 1 when it is refused or times out.
    return ["/bin/sh", "-c", f"nc -w 2 {OUTSIDE_HOST} {port} </dev/null | grep -q reached"]


async def test_a_runtime_in_its_own_namespace_cannot_reach_another_loopback_address_of_the_node(
    engine: ContainerEngine, test_images: BuiltImages, engine_labels: dict[str, str], outside_listener: int
) -> None:
    podman = engine
    spec = _spec(test_images.busybox, engine_labels, _probe_command(outside_listener))
    assert spec.network == NETWORK_PRIVATE  # the default
    cid = await podman.create(spec)
    await podman.start(cid)
    assert await _exit_code(podman, cid) == 1

    # The opt-in shows the same probe does reach it from the node's namespace: the listener is real.
    host = attrs.evolve(spec, name=spec.name + "-host", network=NETWORK_HOST)
    cid = await podman.create(host)
    await podman.start(cid)
    assert await _exit_code(podman, cid) == 0


async def test_the_port_is_published_on_the_runtime_address_only(
    engine: ContainerEngine, test_images: BuiltImages, engine_labels: dict[str, str]
) -> None:
    podman = engine
    (port,) = free_ports(1, RUNTIME_HOST)
    serve = f"mkdir -p /tmp/www && echo ok > /tmp/www/i && exec /bin/httpd -f -p 0.0.0.0:{port} -h /tmp/www"
    spec = _spec(
        test_images.busybox, engine_labels, ["/bin/sh", "-c", serve], publish_host=RUNTIME_HOST, publish_port=port
    )
    cid = await podman.create(spec)
    await podman.start(cid)
    async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
        with trio.fail_after(TIMEOUT_S):
            while True:
                try:
                    answer = await http.get(f"http://{RUNTIME_HOST}:{port}/i")
                    break
                except httpx.TransportError:
                    await trio.sleep(0.1)
        assert answer.text == "ok\n"
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{port}/i")
    assert (await podman.inspect(cid)).running


# --- a container between states (point 16) ------------------------------------------------------

CFG = SupervisorConfig(
    restart_backoff_initial_s=Seconds(0.2),
    restart_backoff_max_s=Seconds(1.0),
    crash_loop_restarts=10,
    reconcile_interval_s=Seconds(0.5),
)


def _stubborn_runtime(image: str, port: int) -> RuntimeSpec:
    # PID 1 ignores SIGTERM (as busybox httpd, or a runtime that takes its time): a stop ends in SIGKILL.
    serve = (
        "trap '' TERM; mkdir -p /tmp/www && echo ok > /tmp/www/i; "
        f"exec /bin/httpd -f -p {{runtime_host}}:{port} -h /tmp/www"
    )
    return RuntimeSpec(
        kind=RuntimeKind.LLAMACPP,
        image=image,
        command=["/bin/sh", "-c", serve],
        port=port,
        memory_bytes=64 * MiB,
        cpus=0.5,
        pids_limit=64,
        health=HealthProbe(
            command=["/bin/sh", "-c", f"wget -q -O /dev/null http://{{runtime_host}}:{port}/i"],
            interval_s=0.2,
            timeout_s=2.0,
            start_period_s=10.0,
            retries=1,
        ),
        stop_timeout_s=4.0,
    )


async def _stubborn_under_supervision(
    nursery: trio.Nursery, client: ContainerEngine, labels: dict[str, str], image: str
) -> tuple[Supervisor, int, Callable[[Any], Awaitable[wire.AssignmentStatus]], list[wire.AssignmentStatus]]:
    """A supervisor running `_stubborn_runtime` on `client`: it, the runtime's port, `until(check)` (poll
    the assignment's status until `check` holds; each status seen is kept in the list returned last)."""
    (port,) = free_ports(1, RUNTIME_HOST)
    sup = Supervisor(CFG, client, FakeArtifacts(), node_id=labels[container_spec.LABEL_NODE], runtime_host=RUNTIME_HOST)
    aid = f"a-{labels[RUN_LABEL]}"
    sup.update(1, [wire.Assignment(id=aid, deployment="d1", runtime=_stubborn_runtime(image, port))])
    await nursery.start(sup.run)
    seen: list[wire.AssignmentStatus] = []

    async def until(check: Any) -> wire.AssignmentStatus:
        with trio.fail_after(TIMEOUT_S):
            while True:
                (s,) = [s for s in sup.statuses() if s.assignment_id == aid]
                seen.append(s)
                if check(s):
                    return s
                await trio.sleep(0.05)

    return sup, port, until, seen


@pytest.mark.slow
async def test_an_outside_podman_stop_is_waited_out_and_the_runtime_restarted(
    nursery: trio.Nursery,
    podman: ContainerEngine,
    podman_service: PodmanService,
    test_images: BuiltImages,
    run_labels: dict[str, str],
) -> None:
    node_id = run_labels[container_spec.LABEL_NODE]
    sup, port, until, seen = await _stubborn_under_supervision(nursery, podman, run_labels, test_images.busybox)
    await until(lambda s: s.state is wire.RuntimeState.READY)
    (first,) = await podman.list({container_spec.LABEL_NODE: node_id})
    # The podman CLI, as an operator would: blocks until SIGKILL after 4 s.
    nursery.start_soon(
        partial(trio.run_process, podman_service.argv("stop", "--time", "4", first.id), env=podman_service.env)
    )
    # podman shows `stopping` (not running, no exit) while the runtime ignores SIGTERM.
    with trio.fail_after(TIMEOUT_S):
        while not (await podman.inspect(first.id)).between_states:  # noqa: ASYNC110 - polling podman
            await trio.sleep(0.05)
    between = await until(lambda s: s.state is not wire.RuntimeState.READY)
    assert between.state is wire.RuntimeState.STARTING
    # Once it has exited, the supervisor starts it again and it is Ready.
    await until(lambda s: s.state is wire.RuntimeState.READY and sup.statistics().restarts >= 1)
    failed = [s for s in seen if s.state is wire.RuntimeState.FAILED]
    assert not failed, failed
    assert not any("improper" in (s.detail or "") for s in seen)
    (again,) = await podman.list({container_spec.LABEL_NODE: node_id})
    assert again.id == first.id and again.running
    async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
        assert (await http.get(f"http://{RUNTIME_HOST}:{port}/i")).text == "ok\n"


@pytest.mark.slow
async def test_an_outside_stop_through_the_docker_api_is_waited_out_on_every_engine(
    nursery: trio.Nursery,
    engine: ContainerEngine,
    container_engine: EngineUnderTest,
    test_images: BuiltImages,
    engine_labels: dict[str, str],
) -> None:
    """`docker stop` as an operator would (the Docker API on each engine's socket): dockerd keeps the
    container `running` until it is killed, podman shows `stopping`; either way no Failed, and the
    supervisor starts the same container again."""
    node_id = engine_labels[container_spec.LABEL_NODE]
    sup, _, until, seen = await _stubborn_under_supervision(nursery, engine, engine_labels, test_images.busybox)
    await until(lambda s: s.state is wire.RuntimeState.READY)
    (first,) = await engine.list({container_spec.LABEL_NODE: node_id})

    def docker_stop() -> None:
        transport = httpx.HTTPTransport(uds=container_engine.socket)
        with httpx.Client(transport=transport, base_url="http://d", trust_env=False, timeout=60) as api:
            api.post(f"/containers/{first.id}/stop", params={"t": "4"}).raise_for_status()

    nursery.start_soon(partial(trio.to_thread.run_sync, docker_stop))
    await until(lambda s: s.state is not wire.RuntimeState.READY)
    await until(lambda s: s.state is wire.RuntimeState.READY and sup.statistics().restarts >= 1)
    failed = [s for s in seen if s.state is wire.RuntimeState.FAILED]
    assert not failed, failed
    (again,) = await engine.list({container_spec.LABEL_NODE: node_id})
    assert again.id == first.id and again.running


# --- each replica's writable cache (issue 29, point 2) ------------------------------------------


def _cache_writing_runtime(image: str, port: int) -> RuntimeSpec:
    """A runtime that, like vLLM at warm-up, writes under $HOME and each cache variable the vLLM
    adapter sets, notes whether it found its first start's file, and tries the read-only root. Its
    port is an argument of its own, as the adapters give it (the cache key leaves it out)."""
    script = (
        "set -e; mkdir -p /tmp/www; "
        'for d in "$HOME" "$XDG_CACHE_HOME" "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" "$CUDA_CACHE_PATH" '
        '"$VLLM_CACHE_ROOT" "$HF_HOME" "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer"; do '
        'mkdir -p "$d"; echo compiled > "$d/kernel.bin"; done; '
        'if [ -f "$HOME/first-start" ]; then echo warm > /tmp/www/state; '
        'else echo cold > /tmp/www/state; echo once > "$HOME/first-start"; fi; '
        "if touch /root-is-writable 2>/dev/null; then echo writable > /tmp/www/root; "
        "else echo read-only > /tmp/www/root; fi; "
        f"grep ' {RUNTIME_CACHE_PATH} ' /proc/mounts > /tmp/www/mount || true; "
        'exec /bin/httpd -f -p "$1:$2" -h /tmp/www'
    )
    return RuntimeSpec(
        kind=RuntimeKind.VLLM,
        image=image,
        command=["/bin/sh", "-c", script, "sh", "{runtime_host}", str(port)],
        env={k: v for k, v in VLLM.env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
        port=port,
        memory_bytes=64 * MiB,
        cpus=0.5,
        pids_limit=64,
        health=HealthProbe(
            command=["/bin/sh", "-c", f"wget -q -O /dev/null http://{{runtime_host}}:{port}/state"],
            interval_s=0.2,
            timeout_s=2.0,
            start_period_s=10.0,
            retries=1,
        ),
        stop_timeout_s=1.0,
    )


@pytest.mark.slow
async def test_a_runtime_writes_its_caches_on_a_read_only_root_and_its_replacement_finds_them(
    nursery: trio.Nursery,
    engine: ContainerEngine,
    container_engine: EngineUnderTest,
    test_images: BuiltImages,
    engine_labels: dict[str, str],
    tmp_path: Path,
) -> None:
    """On each engine: the replica writes $HOME and every cache variable, its root stays read-only,
    and a new container for the same (image, model, settings) — here a replacement assignment on
    another port — starts warm from what the first one wrote."""
    (port, port2) = free_ports(2, RUNTIME_HOST)
    caches = RuntimeCaches(tmp_path / "runtime-cache", max_bytes=2**30, start_free_bytes=1)
    node_id = engine_labels[container_spec.LABEL_NODE]
    sup = Supervisor(CFG, engine, FakeArtifacts(), node_id=node_id, runtime_host=RUNTIME_HOST, caches=caches)
    first = wire.Assignment(
        id=f"a-{engine_labels[RUN_LABEL]}", deployment="d1", runtime=_cache_writing_runtime(test_images.busybox, port)
    )
    sup.update(1, [first])
    await nursery.start(sup.run)

    async def ready(aid: str) -> None:
        with trio.fail_after(TIMEOUT_S):
            while not any(s.assignment_id == aid and s.state is wire.RuntimeState.READY for s in sup.statuses()):  # noqa: ASYNC110 - polling statuses
                await trio.sleep(0.05)

    async def page(p: int, name: str) -> str:
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as http:
            return (await http.get(f"http://{RUNTIME_HOST}:{p}/{name}")).text.strip()

    await ready(first.id)
    assert await page(port, "state") == "cold"
    assert await page(port, "root") == "read-only"
    mount = await page(port, "mount")
    assert " rw," in f" {mount.split()[3]}," or mount.split()[3].startswith("rw"), mount
    if container_engine.name == "podman-libpod":
        assert {"nosuid", "nodev"} <= set(mount.split()[3].split(",")), mount
    [directory] = [d for d in (tmp_path / "runtime-cache").iterdir()]
    assert directory.name == cache_key(first.runtime)
    written = {p.relative_to(directory).as_posix() for p in directory.rglob("kernel.bin")}
    assert written == {
        "kernel.bin", "xdg/kernel.bin", "triton/kernel.bin", "torchinductor/kernel.bin", "cuda/kernel.bin",
        "vllm/kernel.bin", "huggingface/kernel.bin", ".cache/flashinfer/kernel.bin",
    }  # fmt: skip
    await caches.measure()
    disk = caches.disk()
    assert disk is not None and disk.directories == 1 and disk.in_use == 1 and disk.used_bytes > 0

    # The same thing again on another port (a replacement): a new container, the same directory, warm.
    again = wire.Assignment(
        id=f"b-{engine_labels[RUN_LABEL]}", deployment="d1", runtime=_cache_writing_runtime(test_images.busybox, port2)
    )
    assert cache_key(again.runtime) == cache_key(first.runtime)
    sup.update(2, [again])
    await ready(again.id)
    assert await page(port2, "state") == "warm"
    with trio.fail_after(TIMEOUT_S):
        while len(await engine.list({container_spec.LABEL_NODE: node_id})) != 1:  # noqa: ASYNC110 - polling the engine
            await trio.sleep(0.05)
    assert [d.name for d in (tmp_path / "runtime-cache").iterdir()] == [directory.name]
