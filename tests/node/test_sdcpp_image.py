"""stable-diffusion.cpp's image layout on real engines (podman's libpod, its Docker API, Docker Engine):
the `sdcpp` adapter's command runs as `/sd-server` over the image's `/sd-cli` entrypoint, and its bash
probe, the adapter's own, makes the replica Ready inside the hardened container.

The image is built here on the suite's Debian bookworm image (its bash and coreutils are the packages
Ubuntu 24.04's come from) laid out as stable-diffusion.cpp's `docker/Dockerfile` lays out its runtime stage
(at 97d2990807fe6d558e395f8764198d7c7e7b411c): the build's `bin/` at `/sd.cpp/bin`, `/sd-cli` and
`/sd-server` as `#!/bin/sh` wrappers that `exec` it, `ENTRYPOINT [ "/sd-cli" ]`. The server in `bin/` is a
stand-in (no C++ build here): a Python script that binds `--listen-ip`/`--listen-port` and answers
`GET /v1/models` and `POST /v1/images/generations` in the shapes of its examples/server/routes_openai.cpp.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator

import attrs
import httpx
import pytest
import trio

from nexa import container_spec
from nexa.config import ArtifactStoreConfig, OciConfig, Seconds, SupervisorConfig
from nexa.contracts import wire
from nexa.contracts.deployments import Deployment, PlacementSpec, Replica, Resources, RuntimeOptions
from nexa.contracts.models import ModelRef, RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.control.deployments import assignment_for
from nexa.control.registry.outbound import Outbound
from nexa.localparts import build_image, free_ports
from nexa.node.engines.interface import ContainerEngine
from nexa.node.supervisor import Supervisor
from tests.realparts import RUN_LABEL, EngineUnderTest, OciRegistry, PodmanService
from tests.support.adapters import model
from tests.support.supervisor import FakeArtifacts

pytestmark = pytest.mark.slow

RUNTIME_HOST = "127.0.0.67"
TIMEOUT_S = 120
MiB = 1024 * 1024
#: The stand-in for `/sd.cpp/bin/sd-server`: its flags, its routes, its answers' shapes.
FAKE_SD_SERVER = r"""#!/usr/bin/python3
import base64, http.server, json, sys, time
args, host, port = sys.argv[1:], "127.0.0.1", 1234
for i, a in enumerate(args):
    if a == "--listen-ip": host = args[i + 1]
    if a == "--listen-port": port = int(args[i + 1])
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
class H(http.server.BaseHTTPRequestHandler):
    def send(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/v1/models":
            self.send(200, {"data": [{"id": "sd-cpp-local", "object": "model", "owned_by": "local"}]})
        else:
            self.send(404, {"error": "not found"})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not req.get("prompt"):
            return self.send(400, {"error": "prompt required"})
        n = max(1, req.get("n", 1))
        self.send(200, {"created": int(time.time()), "data": [{"b64_json": PNG}] * n, "output_format": "png"})
    def log_message(self, *a):
        pass
http.server.HTTPServer((host, port), H).serve_forever()
"""
WRAPPERS = {
    "/sd-cli": '#!/bin/sh\nexec /sd.cpp/bin/sd-cli "$@"\n',
    "/sd-server": '#!/bin/sh\nexec /sd.cpp/bin/sd-server "$@"\n',
}
CFG = SupervisorConfig(
    restart_backoff_initial_s=Seconds(0.2),
    restart_backoff_max_s=Seconds(1.0),
    crash_loop_restarts=3,
    crash_loop_window_s=Seconds(60.0),
    reconcile_interval_s=Seconds(0.5),
)


@pytest.fixture(scope="module")
def sd_image(
    podman_service: PodmanService,
    oci_registry: OciRegistry,
    python_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """stable-diffusion.cpp's runtime layout on the Debian image, pushed: `repo@sha256:…`."""
    context = tmp_path_factory.mktemp("image-sdcpp")
    files = {**WRAPPERS, "/sd.cpp/bin/sd-server": FAKE_SD_SERVER, "/sd.cpp/bin/sd-cli": "#!/bin/sh\nexit 1\n"}
    copies = ""
    for index, (path, text) in enumerate(files.items()):
        source = context / f"file{index}"
        source.write_text(text)
        source.chmod(0o755)
        copies += f"COPY {source.name} {path}\n"
    (context / "Containerfile").write_text(f'FROM {python_image}\n{copies}ENTRYPOINT [ "/sd-cli" ]\n')
    return build_image(podman_service.local, context, f"{oci_registry.host}/nexa-test/sdcpp")


@pytest.fixture
def engine_labels(container_engine: EngineUnderTest) -> Iterator[dict[str, str]]:
    value = uuid.uuid4().hex[:12]
    try:
        yield {RUN_LABEL: value, container_spec.LABEL_NODE: f"n-{value}"}
    finally:
        container_engine.remove_labelled(container_spec.LABEL_NODE, f"n-{value}")


@pytest.fixture
async def engine(container_engine: EngineUnderTest, sd_image: str) -> AsyncIterator[ContainerEngine]:
    await container_engine.store_image(sd_image)
    async with container_engine.client() as client:
        yield client


async def test_sd_server_runs_over_the_images_cli_entrypoint_and_its_bash_probe_makes_it_ready(
    nursery: trio.Nursery, engine: ContainerEngine, engine_labels: dict[str, str], sd_image: str
) -> None:
    async with Outbound(
        OciConfig(tls_verify=False), ArtifactStoreConfig(), registry_credentials=None, s3_credentials=None
    ) as out:
        check = await out.check_image(sd_image)
    runtime = RuntimeRecord(
        name="sd", kind=RuntimeKind.SDCPP, version="master-97d2990", image=sd_image, media_type=check.media_type,
        registered_at=0, registered_by=None, platforms=check.platforms, image_configs=check.configs,
    )  # fmt: skip
    assert [c.entrypoint for c in runtime.image_configs] == [["/sd-cli"]]
    (port,) = free_ports(1, RUNTIME_HOST)
    dep = Deployment(
        name="images",
        runtime="sd",
        alias="images",
        model=ModelRef(model="tiny", version="v1"),
        replicas=1,
        resources=Resources(accelerators=0, memory_bytes=256 * MiB, cpus=0.5),
        options=RuntimeOptions(port=port, settings={"steps": 4}),
        placement=PlacementSpec(),
        created_at=0,
        created_by=None,
        updated_at=0,
    )
    aid = f"a-{engine_labels[RUN_LABEL]}"
    signed = assignment_for(dep, Replica(id=aid, node_id="n1", model=dep.model), model("tiny"), runtime, port)
    # No artifact (the stand-in reads none); the adapter's own probe, started sooner than a real model loads.
    spec = attrs.evolve(signed.runtime, artifact=None, pids_limit=64, stop_timeout_s=2.0)
    spec = attrs.evolve(spec, health=attrs.evolve(spec.health, start_period_s=30.0))
    assert spec.entrypoint == ["/sd-server"] and spec.health.command[:3] == ["timeout", "5", "bash"]
    a = attrs.evolve(signed, runtime=spec)
    sup = Supervisor(
        CFG, engine, FakeArtifacts(), node_id=engine_labels[container_spec.LABEL_NODE], runtime_host=RUNTIME_HOST
    )
    sup.update(1, [a])
    await nursery.start(sup.run)
    with trio.fail_after(TIMEOUT_S):
        while True:
            (status,) = sup.statuses()
            assert status.state is not wire.RuntimeState.FAILED, status
            if status.state is wire.RuntimeState.READY:
                break
            await trio.sleep(0.2)
    assert sup.statistics().restarts == 0
    # What the node's relay then reaches: the published port on the node's runtime address.
    async with httpx.AsyncClient(base_url=f"http://{RUNTIME_HOST}:{port}", trust_env=False, timeout=30) as http:
        made = await http.post("/v1/images/generations", json={"model": "images", "prompt": "a red square", "n": 2})
        refused = await http.post("/v1/images/generations", json={"model": "images"})
    assert made.status_code == 200 and len(made.json()["data"]) == 2
    assert refused.status_code == 400 and json.loads(refused.content) == {"error": "prompt required"}
