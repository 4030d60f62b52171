"""stable-diffusion.cpp's `sd-server` as the `sdcpp` runtime (`nexa.adapters.sdcpp`): its command line
and container spec pinned to its own source, its bash readiness probe run for real against loopback
servers, and the gateway routing `/v1/images/generations` to it.

The source is leejet/stable-diffusion.cpp at 97d2990807fe6d558e395f8764198d7c7e7b411c: the flags from
examples/server/runtime.cpp (`SDSvrParams::get_options`) and examples/common/common.cpp, the image's
layout from docker/Dockerfile and docs/docker.md, the answer's shape from examples/server/routes_openai.cpp
(`POST /v1/images/generations`, lines 257-329: `{"created", "data": [{"b64_json"}], "output_format"}`).
No sd-server runs here (a large C++ build); the probe's bash does: this machine's, Debian 12's bash
5.2.15, whose packaging (network redirections on) Ubuntu 24.04's bash, the image's, comes from.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import trio

from nexa import adapters, container_spec
from nexa.adapters.sdcpp import SD_SERVER
from nexa.config import GatewayConfig
from nexa.contracts import codec, wire
from nexa.contracts.deployments import Replica, RuntimeOptions, ServingReplica, ServingSet
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, Capability
from nexa.contracts.models import ImageConfig, ImagePlatform, ModelFormat, RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.control import store as st
from nexa.control.datapath.admission import Admission
from nexa.control.datapath.calls import Work
from nexa.control.datapath.gateway import Gateway
from nexa.control.datapath.metering import Meter
from nexa.control.datapath.quotas import Quotas
from nexa.control.datapath.routing import Router
from nexa.control.deployments import assignment_for, views
from nexa.control.operations import qualify_steps
from nexa.errors import ApiNotServed, RuntimeFailed
from nexa.node.engines.docker import LABEL_PROBE, docker_create_body
from nexa.node.engines.libpod import create_body as libpod_create_body
from nexa.telemetry import Metrics
from tests.support.adapters import ARTIFACT, NODE_HOST, PORT, PROBE_HOST, deployment, model
from tests.support.gatewayrig import REF, FakeModels, FakeStream

IMAGE = "ghcr.io/leejet/stable-diffusion.cpp@sha256:" + "5" * 64
#: The published image's config (docker/Dockerfile): the CLI's wrapper as its entrypoint.
SD_IMAGE_CONFIG = ImageConfig(platform=ImagePlatform(os="linux", architecture="amd64"), entrypoint=["/sd-cli"])
ACME = TenantId("acme")


def sd_spec(settings: dict[str, object], *, extra_args: list[str] | None = None) -> tuple[wire.Assignment, object]:
    """The signed assignment of one sd-server replica (CPU only) and the container spec a node makes of it."""
    dep = deployment(RuntimeOptions(port=PORT, settings=settings, extra_args=extra_args or []))
    runtime = RuntimeRecord(
        name="sd", kind=RuntimeKind.SDCPP, version="master-97d2990", image=IMAGE, media_type="", registered_at=0,
        registered_by=None, image_configs=[SD_IMAGE_CONFIG],
    )  # fmt: skip
    replica = Replica(id="img-r1", node_id="n1", gpus=[], model=dep.model)
    signed = assignment_for(dep, replica, model("sdxl-turbo", ModelFormat.GGUF), runtime, PORT)
    assert codec.loads(codec.wire, codec.dumps(codec.wire, signed), type(signed)) == signed
    return signed, container_spec.container_spec("n1", signed, 2, ARTIFACT, host=NODE_HOST)


def test_sd_server_command_line_and_container_spec_are_pinned_to_its_source() -> None:
    signed, spec = sd_spec({"threads": 4, "steps": 4, "cfg_scale": 1.0, "vae_tiling": True})
    # The published image's entrypoint is the CLI (`/sd-cli`); the server runs as `/sd-server`
    # (docs/docker.md: `--entrypoint "/sd-server"`), which nexa sets over it.
    assert signed.runtime.entrypoint == ["/sd-server"]
    assert signed.runtime.command == [
        "--model",
        "/models/model",
        "--listen-ip",
        "{runtime_host}",
        "--listen-port",
        str(PORT),
        "--cfg-scale",
        "1.0",
        "--steps",
        "4",
        "--threads",
        "4",
        "--vae-tiling",
    ]
    assert isinstance(spec, container_spec.ContainerSpec)
    # In its own network namespace it binds every address there; the node fills in its own address.
    assert spec.entrypoint == ["/sd-server"] and spec.command[3] == "0.0.0.0"
    assert spec.devices == [] and spec.ro_mounts == [(str(ARTIFACT), "/models/model")]
    # The image has neither curl nor Python: bash's /dev/tcp under coreutils' timeout, on loopback.
    probe = spec.health.command
    assert probe[:4] == ["timeout", "5", "bash", "-c"]
    assert f"/dev/tcp/{PROBE_HOST}/{PORT}" in probe[4] and "GET /v1/models HTTP/1.0" in probe[4]
    assert "{runtime_host}" in signed.runtime.health.command[4]  # signed with the placeholder
    # Podman (libpod) and Docker create the same process, with the same probe for the agent to run.
    pod = libpod_create_body(spec)
    assert (pod["entrypoint"], pod["command"]) == (["/sd-server"], spec.command)
    docker = docker_create_body(spec)
    assert (docker["Entrypoint"], docker["Cmd"]) == (["/sd-server"], spec.command)
    assert json.loads(docker["Labels"][LABEL_PROBE])["command"] == probe


def test_sd_server_settings_and_extra_args_are_checked_against_its_flags() -> None:
    flags = {name: option.flag for name, option in SD_SERVER.options.items()}
    assert flags == {
        "threads": "--threads",
        "offload_to_cpu": "--offload-to-cpu",
        "mmap": "--mmap",
        "flash_attn": "--fa",
        "diffusion_fa": "--diffusion-fa",
        "vae_tiling": "--vae-tiling",
        "vae": "--vae",
        "width": "--width",
        "height": "--height",
        "steps": "--steps",
        "cfg_scale": "--cfg-scale",
        "sampling_method": "--sampling-method",
        "scheduler": "--scheduler",
        "seed": "--seed",
    }
    problems = adapters.settings_problems(
        RuntimeKind.SDCPP, {"steps": 0, "width": "512", "cfg": 7, "offload_to_cpu": 1}, accelerators=0
    )
    assert problems == [
        "settings.cfg: unknown option for sd-server (known: cfg_scale, diffusion_fa, flash_attn, height, mmap, "
        "offload_to_cpu, sampling_method, scheduler, seed, shm_bytes, steps, threads, vae, vae_tiling, width)",
        "settings.offload_to_cpu: true or false",
        "settings.steps: at least 1",
        "settings.width: an integer",
    ]
    # No GPU needed (the published image is a CPU build); one is given to the CUDA image's replicas.
    assert adapters.settings_problems(RuntimeKind.SDCPP, {}, accelerators=0) == []
    refused = adapters.extra_args_refusals(
        RuntimeKind.SDCPP,
        {},
        ["-m", "/x", "--listen-port", "1", "-l", "0.0.0.0", "--rpc-servers", "h:50052", "--lora-model-dir", "/l", "-v"],
    )
    assert [r.partition(":")[0] for r in refused] == ["-m", "--listen-port", "-l", "--rpc-servers", "--lora-model-dir"]
    # The VAE is a file of the model's own (signed) directory.
    vae = SD_SERVER.launch("m", {"vae": "vae/sdxl_vae.safetensors"}, [], PORT, model_path="/models/m/model.gguf",
                           model_dir="/models/m")  # fmt: skip
    assert vae.command[vae.command.index("--vae") + 1] == "/models/m/vae/sdxl_vae.safetensors"
    assert adapters.model_file_problems(RuntimeKind.SDCPP, {"vae": "vae.safetensors"}, ["model.gguf"])


def test_sd_server_serves_images_only_and_is_metered_in_images() -> None:
    assert SD_SERVER.serves(Capability.IMAGE, {})
    assert not any(SD_SERVER.serves(c, {}) for c in Capability if c is not Capability.IMAGE)
    assert adapters.serves(RuntimeKind.SDCPP, {}, Capability.IMAGE)
    assert SD_SERVER.metrics.path is None and SD_SERVER.overhead_bytes == 2 * 2**30
    assert adapters.image_runs(RuntimeKind.SDCPP, SD_IMAGE_CONFIG) == [("sd-server", ["/sd-server", "…"])]


# --- the probe, run by bash against real loopback servers ---------------------------------------


@contextlib.contextmanager
def raw_server(answer: bytes | None, *, delay_s: float = 0.0, endless: bool = False) -> Iterator[int]:
    """A loopback TCP server that answers each connection with `answer` (after `delay_s`), or streams
    bytes without a line end (`endless`), or says nothing (`answer` None); yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.recv(4096)
                stop.wait(delay_s)
                if endless:
                    while not stop.is_set():
                        conn.sendall(b"x" * 65536)
                elif answer is not None:
                    conn.sendall(answer)
                else:
                    stop.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def run_probe(port: int) -> tuple[int, float]:
    """sd-server's probe as a node runs it inside the container (here, on this machine's bash), with
    the node's runtime address filled in: its exit status and how long it took."""
    command = container_spec.with_host(SD_SERVER.probe(port).command, "127.0.0.1")
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, timeout=30, check=False)
    return done.returncode, time.monotonic() - started


def test_the_bash_probe_passes_on_200_only() -> None:
    # What cpp-httplib answers for GET /v1/models once the model is loaded (routes_openai.cpp 250-255).
    models = b'{"data":[{"id":"sd-cpp-local","object":"model","owned_by":"local"}]}'
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 72\r\n\r\n" + models
    with raw_server(ok) as port:
        assert run_probe(port)[0] == 0
    with raw_server(b"HTTP/1.0 200\r\n\r\n") as port:
        assert run_probe(port)[0] == 0
    for bad in (
        b"HTTP/1.1 503 Service Unavailable\r\n\r\nloading",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"garbage\xff\x00 200 OK\r\n",
        b"",  # closed without a word
        b"HTTP/1.1 301 Moved\r\nLocation: http://elsewhere/\r\n\r\n",  # never followed
    ):
        with raw_server(bad) as port:
            assert run_probe(port)[0] != 0, bad


def test_the_bash_probe_fails_fast_on_nothing_listening_and_within_5_s_on_a_slow_or_endless_answer() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    status, took = run_probe(port)  # nothing listens there now
    assert status != 0 and took < 3
    with raw_server(None) as silent:
        status, took = run_probe(silent)
    assert status == 124 and 4.5 < took < 8  # coreutils' timeout
    with raw_server(b"", endless=True) as endless:
        status, took = run_probe(endless)
    assert status != 0 and took < 8  # 64 bytes read at most, never the whole stream


# --- the gateway routes images to it -----------------------------------------------------------


#: sd-server's answer to `{"prompt", "n": 2}` (routes_openai.cpp 282-319; a 1x1 PNG stands in for its images).
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII=")
SD_ANSWER_B64 = base64.b64encode(PNG).decode()
SD_ANSWER = json.dumps(
    {"created": 1767225600, "data": [{"b64_json": SD_ANSWER_B64}] * 2, "output_format": "png"}
).encode()


class Relay:
    """Each node answers with `answers[node]`; records which node each request went to, and its body."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.sent: list[tuple[str, str, bytes]] = []

    @contextlib.asynccontextmanager
    async def open(self, node_id: str, request_id: str, head: wire.InferHead, body: bytes) -> AsyncIterator[FakeStream]:
        self.sent.append((node_id, head.path, body))
        yield FakeStream([self.answer], wire.EndHead(status=wire.EndStatus.OK), hang=False)


@attrs.define
class Deployments:
    """`images` on one sd-server replica (node `sd`) and one llama-server replica (node `llm`)."""

    kinds: dict[str, RuntimeKind]

    def serving(self, ref: object, *, alias: str | None = None) -> ServingSet:
        replicas = [
            ServingReplica(
                replica_id=f"r-{node}",
                node_id=node,
                deployment="images",
                model=REF,
                serves=frozenset(c for c in Capability if c.gated and adapters.serves(kind, {}, c)),
            )
            for node, kind in self.kinds.items()
        ]
        return ServingSet(model=REF, replicas=replicas, deployments=["images"])


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, nursery: trio.Nursery, relay: Relay, kinds: dict[str, RuntimeKind]
) -> AsyncIterator[tuple[Gateway, list[object]]]:
    async with st.open_store(tmp_path / "state") as store:
        metrics, cfg = Metrics(), GatewayConfig(retries=0)
        meter = Meter(cfg, store, metrics)
        records: list[object] = []
        gw = Gateway(
            cfg,
            models=FakeModels(),  # type: ignore[arg-type]
            deployments=Deployments(kinds),  # type: ignore[arg-type]
            relay=relay,  # type: ignore[arg-type]
            quotas=Quotas(store, metrics, lambda tenant: True, []),
            admission=Admission(cfg, metrics),
            router=Router(cfg),
            meter=meter,
        )
        real_record = meter.record
        meter.record = lambda rec: (records.append(rec), real_record(rec))[1]  # type: ignore[method-assign]
        await nursery.start(gw.run)
        yield gw, records


def image_work(n: int = 2) -> Work:
    return Work(
        request_id="img-1",
        api=Api.OPENAI,
        tenant=ACME,
        key_id=KeyId("k1"),
        capability=Capability.IMAGE,
        model="chat",
        body={"prompt": "a red square", "n": n, "size": "512x512"},
        stream=False,
        deadline_at=time.time() + 30,
    )


async def test_images_go_to_the_sd_server_replica_and_are_metered_in_images(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    relay = Relay(SD_ANSWER)
    async with gateway(tmp_path, nursery, relay, {"sd": RuntimeKind.SDCPP, "llm": RuntimeKind.LLAMACPP}) as (gw, rec):
        for _ in range(4):  # never to the llama-server replica, however the router would balance
            call = gw.call(image_work())
            call.progress.units = 2.0  # as the media route sets it: the images asked for
            async with call as answer:
                assert await answer.read_all() == SD_ANSWER
            assert call.outcome is not None and call.outcome.status == "ok"
        assert {node for node, _, _ in relay.sent} == {"sd"}
        _, path, body = relay.sent[0]
        # sd-server reads `prompt`, `n`, `size` (and ignores `model`) at OpenAI's path.
        assert path == "/v1/images/generations"
        sent = json.loads(body)
        assert (sent["prompt"], sent["n"], sent["size"]) == ("a red square", 2, "512x512")
        assert [r.units for r in rec] == [2.0] * 4  # type: ignore[attr-defined]


async def test_images_on_no_image_runtime_are_refused_naming_sd_server(tmp_path: Path, nursery: trio.Nursery) -> None:
    relay = Relay(SD_ANSWER)
    async with gateway(tmp_path, nursery, relay, {"llm": RuntimeKind.LLAMACPP}) as (gw, _):
        with pytest.raises(ApiNotServed, match="sd-server images"):
            async with gw.call(image_work()):
                pass
    assert relay.sent == []


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        # sd-server drops an image it could not encode (routes_openai.cpp 309-312): none left is no answer.
        (b'{"created": 1, "data": [], "output_format": "png"}', "`data` is not a list of image objects"),
        (b'{"created": 1, "data": "not a list"}', "`data` is not a list of image objects"),
        (b"<html>not JSON</html>", "not a JSON object"),
    ],
)
async def test_an_image_answer_not_in_sd_servers_shape_is_a_typed_error(
    tmp_path: Path, nursery: trio.Nursery, answer: bytes, why: str
) -> None:
    async with gateway(tmp_path, nursery, Relay(answer), {"sd": RuntimeKind.SDCPP}) as (gw, _):

        async def attempt() -> None:
            async with gw.call(image_work(1)) as got:
                await got.read_all()
                if got.error is not None:
                    raise got.error

        with pytest.raises(RuntimeFailed) as failed:
            await attempt()
        assert failed.value.code == "runtime_failed" and f"unusable ({why})" in str(failed.value)


def test_a_qualification_of_sd_server_asks_for_one_small_image_and_checks_its_shape() -> None:
    run = SimpleNamespace(request=SimpleNamespace(settings={}), runtime=SimpleNamespace(kind=RuntimeKind.SDCPP))
    capability, body = qualify_steps._probe_request(run)  # type: ignore[arg-type]
    assert capability is Capability.IMAGE and body == {"prompt": "nexa qualification", "n": 1, "size": "256x256"}
    assert qualify_steps._answer_problem(Capability.IMAGE, SD_ANSWER) == ("", {})
    for bad in (b'{"data": []}', b'{"data": [{"url": "http://x/"}]}', b'{"error": "prompt required"}'):
        assert qualify_steps._answer_problem(Capability.IMAGE, bad)[0] == "no image in `data[0].b64_json`"


def test_a_deployment_on_an_sdcpp_runtime_is_served_images_only() -> None:
    """What the serving sets record of a deployment's replicas (`views._served`, from the registered
    runtime's kind): the gateway's capability filter routes images to them and nothing else gated."""
    record = RuntimeRecord(
        name="sd", kind=RuntimeKind.SDCPP, version="master-97d2990", image=IMAGE, media_type="", registered_at=0,
        registered_by=None,
    )  # fmt: skip
    desired = SimpleNamespace(models=SimpleNamespace(runtime=lambda name: record))
    dep = SimpleNamespace(runtime="sd", options=RuntimeOptions(port=PORT, settings={"steps": 4}))
    assert views._served(desired, dep) == frozenset({Capability.IMAGE})  # type: ignore[arg-type]
