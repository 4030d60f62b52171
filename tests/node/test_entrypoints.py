"""The replica's process is exactly the adapter's command, whatever the image's ENTRYPOINT (issue 29,
point 1), on real podman (libpod and its Docker API) and real Docker Engine.

Images built here from the busybox test image (`podman build`, pushed to the run's registry), each with a
fake model server (a shell script, `FAKE_SERVER`) where the real image has its program:
* `llama.cpp`: `/app/llama-server`, `ENTRYPOINT ["/app/llama-server"]`, `WORKDIR /app` — as llama.cpp's
  published server image (`.devops/cpu.Dockerfile`, target `server`, in llama.cpp's source);
* `vllm`: `vllm` on PATH, `ENTRYPOINT ["vllm", "serve"]` — as the vLLM project's `vllm/vllm-openai`
  (`docker/Dockerfile`, its final stage);
* `ngc`: `vllm` on PATH behind `ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]`, a script that only
  `exec`s its arguments — as NVIDIA's NGC images (`nvcr.io/nvidia/vllm`, …) have it;
* `plain`: `llama-server` on PATH, no ENTRYPOINT (`CMD ["/bin/sh"]`), as the suite's other images.

The controller's own path decides the entrypoint: `Outbound.check_image` reads each image's config from the
real registry, `assignment_for` builds the signed spec, the real supervisor creates and starts it.
`/proc/1/cmdline` inside the running container then shows the adapter's command exactly once.
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa import adapters, container_spec
from nexa.adapters import entrypoints
from nexa.config import ArtifactStoreConfig, OciConfig, Seconds, SupervisorConfig
from nexa.contracts import wire
from nexa.contracts.deployments import Deployment, PlacementSpec, Replica, Resources, RuntimeOptions
from nexa.contracts.models import ModelRef, RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import RUNTIME_HOST as HOST_PLACEHOLDER
from nexa.control.deployments import assignment_for
from nexa.control.registry.outbound import Outbound
from nexa.localparts import build_image, free_ports
from nexa.node.engines.interface import ContainerEngine
from nexa.node.supervisor import Supervisor
from tests.realparts import RUN_LABEL, BuiltImages, EngineUnderTest, OciRegistry, PodmanService
from tests.support.adapters import model
from tests.support.supervisor import FakeArtifacts

RUNTIME_HOST = "127.0.0.66"
TIMEOUT_S = 90
MiB = 1024 * 1024
#: A model server as far as nexa sees one: it serves GET /health on the `--host`/`--port` its command line
#: names (busybox httpd, in the background) and stays the container's first process (its own cmdline is
#: what the test reads), ending on SIGTERM.
FAKE_SERVER = """#!/bin/sh
host=127.0.0.1; port=8080
while [ $# -gt 0 ]; do
  case "$1" in --host) host=$2; shift ;; --port) port=$2; shift ;; esac
  shift
done
mkdir -p /tmp/www && echo ok > /tmp/www/health
httpd -p "$host:$port" -h /tmp/www
trap 'exit 0' TERM
sleep 2147483647 &
wait
"""
#: NVIDIA's entrypoint in its NGC images prints a banner, sets up the environment, then `exec "$@"`.
EXEC_WRAPPER = """#!/bin/sh
echo "== fake NGC container =="
exec "$@"
"""
WRAPPER = "/opt/nvidia/nvidia_entrypoint.sh"
#: name → (Containerfile lines after FROM, {path in the image: script}).
IMAGES: dict[str, tuple[str, dict[str, str]]] = {
    "llama.cpp": ('WORKDIR /app\nENTRYPOINT ["/app/llama-server"]\n', {"/app/llama-server": FAKE_SERVER}),
    "vllm": ('ENTRYPOINT ["vllm", "serve"]\n', {"/usr/local/bin/vllm": FAKE_SERVER}),
    "ngc": (f'ENTRYPOINT ["{WRAPPER}"]\n', {WRAPPER: EXEC_WRAPPER, "/usr/local/bin/vllm": FAKE_SERVER}),
    "plain": ('CMD ["/bin/sh"]\n', {"/usr/local/bin/llama-server": FAKE_SERVER}),
    # The llama.cpp layout without its program: what an image built for another adapter looks like.
    "empty-app": ('WORKDIR /app\nENTRYPOINT ["/app/llama-server"]\n', {}),
}
CFG = SupervisorConfig(
    restart_backoff_initial_s=Seconds(0.2),
    restart_backoff_max_s=Seconds(1.0),
    crash_loop_restarts=3,
    crash_loop_window_s=Seconds(60.0),
    reconcile_interval_s=Seconds(0.5),
)


@pytest.fixture(scope="module")
def entrypoint_images(
    podman_service: PodmanService,
    oci_registry: OciRegistry,
    test_images: BuiltImages,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str]:
    """Each of `IMAGES` built on the busybox test image and pushed: name → `repo@sha256:…`."""
    built = {}
    for name, (tail, files) in IMAGES.items():
        context = tmp_path_factory.mktemp(f"image-{name}")
        copies = ""
        for index, (path, text) in enumerate(files.items()):
            source = context / f"file{index}"
            source.write_text(text)
            source.chmod(0o755)
            copies += f"COPY {source.name} {path}\n"
        (context / "Containerfile").write_text(f"FROM {test_images.busybox}\n{copies}{tail}")
        repo = f"{oci_registry.host}/nexa-test/entrypoint-{name.replace('.', '')}"
        built[name] = build_image(podman_service.local, context, repo)
    return built


@pytest.fixture
def engine_labels(container_engine: EngineUnderTest) -> Iterator[dict[str, str]]:
    value = uuid.uuid4().hex[:12]
    try:
        yield {RUN_LABEL: value, container_spec.LABEL_NODE: f"n-{value}"}
    finally:
        container_engine.remove_labelled(container_spec.LABEL_NODE, f"n-{value}")


@pytest.fixture
async def engine(
    container_engine: EngineUnderTest, entrypoint_images: dict[str, str]
) -> AsyncIterator[ContainerEngine]:
    """The driver of each engine in turn (libpod, podman's Docker API, dockerd), every image stored."""
    for image in entrypoint_images.values():
        await container_engine.store_image(image)
    async with container_engine.client() as client:
        yield client


async def registered(image: str, kind: RuntimeKind) -> RuntimeRecord:
    """The runtime record the controller keeps for `image`: its configs read from the real registry."""
    async with Outbound(
        OciConfig(tls_verify=False), ArtifactStoreConfig(), registry_credentials=None, s3_credentials=None
    ) as out:
        check = await out.check_image(image)
    return RuntimeRecord(
        name="rt",
        kind=kind,
        version="1",
        image=image,
        media_type=check.media_type,
        registered_at=0,
        registered_by=None,
        platforms=check.platforms,
        image_configs=check.configs,
    )


def assignment(runtime: RuntimeRecord, port: int, aid: str) -> wire.Assignment:
    """One replica of a deployment of `runtime`, as the controller signs it (no artifact: the fake server
    reads none), probed with busybox's wget (the images have no curl or python)."""
    probe = ["wget", "-q", "-O", "/dev/null", f"http://{HOST_PLACEHOLDER}:{port}/health"]
    dep = Deployment(
        name="d1",
        runtime="rt",
        alias="chat",
        model=ModelRef(model="tiny", version="v1"),
        replicas=1,
        resources=Resources(accelerators=0, memory_bytes=64 * MiB, cpus=0.5),
        options=RuntimeOptions(port=port, health_command=probe),
        placement=PlacementSpec(),
        created_at=0,
        created_by=None,
        updated_at=0,
    )
    signed = assignment_for(dep, Replica(id=aid, node_id="n1", model=dep.model), model("tiny"), runtime, port)
    spec = attrs.evolve(signed.runtime, artifact=None, pids_limit=64, stop_timeout_s=2.0)
    return attrs.evolve(signed, runtime=attrs.evolve(spec, health=attrs.evolve(spec.health, start_period_s=20.0)))


def read_file(engine: EngineUnderTest, container_id: str, path: str) -> bytes:
    """`cat path` inside the container through the Docker API on the engine's socket (all three speak it),
    with a TTY so the answer is the raw bytes."""
    transport = httpx.HTTPTransport(uds=engine.socket)
    with httpx.Client(transport=transport, base_url="http://d", trust_env=False, timeout=30) as api:
        created = api.post(
            f"/containers/{container_id}/exec", json={"Cmd": ["cat", path], "AttachStdout": True, "Tty": True}
        )
        created.raise_for_status()
        answer = api.post(f"/exec/{created.json()['Id']}/start", json={"Detach": False, "Tty": True})
        answer.raise_for_status()
        return answer.content


async def supervised(
    nursery: trio.Nursery, client: ContainerEngine, labels: dict[str, str], a: wire.Assignment
) -> tuple[Supervisor, Any]:
    sup = Supervisor(CFG, client, FakeArtifacts(), node_id=labels[container_spec.LABEL_NODE], runtime_host=RUNTIME_HOST)
    sup.update(1, [a])
    await nursery.start(sup.run)

    async def until(check: Any) -> wire.AssignmentStatus:
        with trio.fail_after(TIMEOUT_S):
            while True:
                (s,) = [s for s in sup.statuses() if s.assignment_id == a.id]
                if check(s):
                    return s
                await trio.sleep(0.1)

    return sup, until


@pytest.mark.slow
@pytest.mark.parametrize(
    ("image", "kind", "entrypoint", "how"),
    [
        ("llama.cpp", RuntimeKind.LLAMACPP, ["/app/llama-server"], "program"),
        ("vllm", RuntimeKind.VLLM, ["vllm"], "program"),
        ("ngc", RuntimeKind.VLLM, [WRAPPER], "wrapper"),
        ("plain", RuntimeKind.LLAMACPP, ["llama-server"], "set"),
    ],
)
async def test_the_process_is_the_adapters_command_exactly_once_whatever_the_entrypoint(
    nursery: trio.Nursery,
    engine: ContainerEngine,
    container_engine: EngineUnderTest,
    entrypoint_images: dict[str, str],
    engine_labels: dict[str, str],
    image: str,
    kind: RuntimeKind,
    entrypoint: list[str],
    how: str,
) -> None:
    runtime = await registered(entrypoint_images[image], kind)
    (config,) = runtime.image_configs
    assert config.entrypoint == {"llama.cpp": ["/app/llama-server"], "vllm": ["vllm", "serve"], "ngc": [WRAPPER]}.get(
        image, []
    )
    (port,) = free_ports(1, RUNTIME_HOST)
    a = assignment(runtime, port, f"a-{engine_labels[RUN_LABEL]}")
    adapter = adapters.adapter_for(kind, {})
    wanted = adapter.launch("tiny", {}, [], port, model_path="/models/model").command
    # The signed spec: the entrypoint is set, and it and the command are the adapter's command once.
    assert a.runtime.entrypoint == entrypoint
    assert entrypoints.entrypoint_for(wanted, config).how == how
    process = [w for w in a.runtime.process if w != WRAPPER]
    assert [posixpath.basename(process[0]), *process[1:]] == wanted
    sup, until = await supervised(nursery, engine, engine_labels, a)
    await until(lambda s: s.state is wire.RuntimeState.READY)
    (state,) = await engine.list({container_spec.LABEL_NODE: engine_labels[container_spec.LABEL_NODE]})
    cmdline = read_file(container_engine, state.id, "/proc/1/cmdline").rstrip(b"\0").split(b"\0")
    # The kernel runs the script as `/bin/sh <its path> <arguments>`: its path is the adapter's program
    # (by PATH or as the image's entrypoint names it), then exactly the adapter's arguments, once.
    argv = [w.decode() for w in cmdline]
    assert argv[0] == "/bin/sh" and posixpath.basename(argv[1]) == wanted[0], argv
    assert argv[2:] == [w.replace(HOST_PLACEHOLDER, container_spec.PRIVATE_BIND_HOST) for w in wanted[1:]], argv
    assert argv.count("/models/model") == 1
    assert sup.statistics().restarts == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("image", "kind", "program"),
    [
        # The entrypoint set to a program the image lacks: the engine cannot start the container.
        ("empty-app", RuntimeKind.LLAMACPP, "/app/llama-server"),
        # The image's exec wrapper runs, and its `exec "$@"` finds no such program: exit code 127.
        ("ngc", RuntimeKind.SGLANG, "python3"),
    ],
)
async def test_an_image_without_the_adapters_program_fails_with_a_typed_reason_not_a_restart_loop(
    nursery: trio.Nursery,
    engine: ContainerEngine,
    entrypoint_images: dict[str, str],
    engine_labels: dict[str, str],
    image: str,
    kind: RuntimeKind,
    program: str,
) -> None:
    runtime = await registered(entrypoint_images[image], kind)
    (port,) = free_ports(1, RUNTIME_HOST)
    sup, until = await supervised(
        nursery, engine, engine_labels, assignment(runtime, port, f"a-{engine_labels[RUN_LABEL]}")
    )
    failed = await until(lambda s: s.state is wire.RuntimeState.FAILED)
    assert failed.reason == "runtime_program_missing", failed
    assert f"program {program} is not in the image" in failed.detail
    # It stays Failed: nothing is started again (the image is pinned, the spec signed).
    await trio.sleep(3 * CFG.restart_backoff_max_s)
    (still,) = sup.statuses()
    assert (still.state, still.reason, still.restarts) == (wire.RuntimeState.FAILED, "runtime_program_missing", 0)
    assert sup.statistics().restarts == 0
