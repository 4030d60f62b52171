"""A DGX Spark's unified memory, honoured: what placement reserves becomes the runtime's own limit.

A GB10's GPU shares the host's LPDDR5x pool (the recorded fixture: MemTotal 125106396 KiB, the
"128 GB" of the data sheet). The fleet side is the real one: `snapshot_from` over `NodeLive`s
holding that inventory, `scheduler.place`, `assignment_for` (adapter -> signed spec) and the
node's `container_spec.container_spec`. The model is a Hugging Face directory, registered as a
manifest: three `*.safetensors` shards, their index, config and tokenizer files.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa import adapters, config, container_spec
from nexa.adapters.base import ENGINE_OVERHEAD_BYTES, LLAMA_SERVER
from nexa.cli.deployments import _print_decision as print_decision
from nexa.config import ControlConfig, PlacementConfig
from nexa.contracts import codec
from nexa.contracts.deployments import (
    Deployment,
    DeploymentCreate,
    PlacementSpec,
    Replica,
    Resources,
    RuntimeOptions,
)
from nexa.contracts.domain import Node, NodeId
from nexa.contracts.kvcache import GgufFigures
from nexa.contracts.manifest import ArtifactFile
from nexa.contracts.models import (
    ModelArtifact,
    ModelRecord,
    ModelRef,
    RuntimeRecord,
    Verification,
)
from nexa.contracts.node import RuntimeKind
from nexa.contracts.placement import MemoryLimit, MemoryShare, PlacementDecision, PlacementNode
from nexa.contracts.runtime import ContainerSpec, HealthProbe
from nexa.contracts.wire import Assignment, DesiredAssignments
from nexa.control.deployments import (
    artifact_ref,
    assignment_for,
    check_memory_limits,
    placement_request,
    snapshot_from,
    unified_pool_bytes,
)
from nexa.control.deployments.scheduler import place
from nexa.control.fleet.nodes import NodeLive
from nexa.control.http.common import status_for
from nexa.errors import ConfigError, MemoryOverReservation
from nexa.security import ReplayWindow
from tests.conftest import Controller, gb10_inventory
from tests.realparts import BuiltImages, S3Store
from tests.support.adapters import IMAGES, OFFLINE, SGLANG_ENV, VLLM_ENV, python_probe
from tests.support.adapters import model as adapter_model
from tests.support.api import assert_envelope, node_view, ok
from tests.support.deployments import fleet_image, names, online, set_where
from tests.support.models import LLAMA_8B, bring_to

# `dep_reg` and `dial` (tests/control/conftest.py) run a real controller and connect raw nodes
# reporting GB10 inventories.
GIB = 2**30
#: The recorded GB10's pool: MemTotal of tests/fixtures/meminfo/gb10_dgx_spark.meminfo.
POOL = 125106396 * 1024
HEADROOM = PlacementConfig().unified_host_headroom_bytes
SPARK_GPU = "nvidia.com/gpu=0"
NODE_HOST = "127.0.0.11"
NAME = "qwen2-7b"
#: What a fraction's `runtime_memory` holds besides (llama.cpp's context figures, unset).
FRACTION: dict[str, object] = {
    "batch_setting": "",
    "batch_flag": "",
    "batch": None,
    "kv_cache_bytes": None,
    "unbounded": "",
    "share_of": "pool",
}
#: Where the node assembled the manifest's directory (its digest names it).
ASSEMBLED = Path("/var/lib/nexa/node/models/" + "d" * 64)


def _file(path: str, size: int) -> ArtifactFile:
    return ArtifactFile(path=path, size_bytes=size, sha256=hashlib.sha256(path.encode()).hexdigest())


HF_FILES = [
    _file("config.json", 663),
    _file("generation_config.json", 243),
    _file("tokenizer.json", 7_031_645),
    _file("tokenizer_config.json", 1_289),
    _file("model.safetensors.index.json", 27_752),
    _file("model-00001-of-00003.safetensors", 3_945_441_440),
    _file("model-00002-of-00003.safetensors", 3_864_726_320),
    _file("model-00003-of-00003.safetensors", 3_556_377_672),
]
GGUF_FILES = [
    _file("qwen2-7b-q8_0-00001-of-00003.gguf", 3 * GIB),
    _file("qwen2-7b-q8_0-00002-of-00003.gguf", 3 * GIB),
    _file("qwen2-7b-q8_0-00003-of-00003.gguf", GIB),
]


def model(files: list[ArtifactFile] | None = None, entry: str = ".", *, memory: int = 40 * GIB) -> ModelRecord:
    """qwen2-7b@v1 as the registry holds it: a manifest under a prefix (or, with `files=[]`, one object)."""
    if files == []:
        artifact = ModelArtifact(uri=f"s3://models/{NAME}.tar", sha256="c" * 64, size_bytes=16 * GIB)
    else:
        files = HF_FILES if files is None else files
        manifest = ModelArtifact(uri=f"s3://models/{NAME}/v1/", files=files, entry=entry).manifest()
        artifact = ModelArtifact(
            uri=f"s3://models/{NAME}/v1/",
            sha256=manifest.digest,
            size_bytes=manifest.size_bytes,
            files=list(manifest.files),
            entry=entry,
        )
    return adapter_model(
        NAME, artifact=artifact, memory=memory, source="hf://Qwen/Qwen2-7B-Instruct", spdx_id="Apache-2.0"
    )


def runtime(kind: RuntimeKind) -> RuntimeRecord:
    return RuntimeRecord(
        name=str(kind), kind=kind, version="1", image=IMAGES[kind], media_type="", registered_at=0, registered_by=None
    )


def deployment(
    name: str, kind: RuntimeKind, *, replicas: int = 1, memory: int = 0, settings: dict[str, object] | None = None
) -> Deployment:
    return Deployment(
        name=name,
        runtime=str(kind),
        alias=None,
        model=ModelRef(model=NAME, version="v1"),
        replicas=replicas,
        resources=Resources(accelerators=1, memory_bytes=memory, cpus=8.0),
        options=RuntimeOptions(port=18000, settings=settings or {}),
        placement=PlacementSpec(),
        created_at=0,
        created_by=None,
        updated_at=0,
    )


def create(dep: Deployment) -> DeploymentCreate:
    return DeploymentCreate(
        name=dep.name,
        runtime=dep.runtime,
        model=dep.model,
        replicas=dep.replicas,
        resources=dep.resources,
        options=dep.options,
        placement=dep.placement,
    )


def spark(node_id: str = "spark-1") -> NodeLive:
    """An enrolled, reachable DGX Spark reporting the recorded GB10 inventory, running nothing yet."""
    node = Node(
        id=NodeId(node_id), hostname=node_id, signing_public_key="", curve_public_key="", labels={}, enrolled_at=0
    )
    return NodeLive(
        node=node,
        inventory=gb10_inventory(node_id),
        desired=DesiredAssignments(node_id=node_id, generation=1),
        window=ReplayWindow(),
        reachable=True,
    )


def h100(node_id: str = "h100-1") -> PlacementNode:
    """A discrete-GPU node: the reservation is its GPUs' memory, and no runtime is limited there."""
    return PlacementNode(
        id=node_id,
        state=spark().state,
        arch="amd64",
        runtimes=(RuntimeKind.VLLM, RuntimeKind.SGLANG),
        gpu_count=8,
        free_gpus=tuple(f"nvidia.com/gpu={i}" for i in range(8)),
        accelerator_memory_total_bytes=8 * 80 * GIB,
        accelerator_memory_free_bytes=8 * 80 * GIB,
        host_memory_total_bytes=2048 * GIB,
        host_memory_free_bytes=2048 * GIB,
    )


def deploy(fleet: list[NodeLive], dep: Deployment, mod: ModelRecord, *, headroom: int = HEADROOM) -> PlacementDecision:
    """Place `dep` over the fleet as the controller does and put its assignments into the nodes'
    desired sets (ports from 18000 up on each node, as `Desired.commit` chooses them)."""
    rt = runtime(RuntimeKind(dep.runtime))
    decision = place(
        snapshot_from(fleet, unified_headroom_bytes=headroom),
        placement_request(dep, mod, rt, dep.replicas),
        existing=Counter(),
    )
    if not decision.feasible:
        return decision
    by_id = {live.node.id: live for live in fleet}
    for p in decision.placements:
        live = by_id[NodeId(p.node_id)]
        port = 18000 + len(live.desired.assignments)
        replica = Replica(id=f"{dep.name}-r{p.replica}", node_id=p.node_id, gpus=list(p.gpus), model=dep.model)
        a = assignment_for(dep, replica, mod, rt, port, unified_pool_bytes=unified_pool_bytes(live))
        # Signed and sent as JSON: what the node gets must survive the wire unchanged.
        assert codec.loads(codec.wire, codec.dumps(codec.wire, a), Assignment) == a
        live.desired = attrs.evolve(live.desired, assignments=[*live.desired.assignments, a])
    return decision


def container(live: NodeLive, index: int) -> ContainerSpec:
    a = live.desired.assignments[index]
    return container_spec.container_spec(live.node.id, a, 2, ASSEMBLED, host=NODE_HOST)


# --- point 5: the adapters take the directory ----------------------------------------------------


def test_a_manifest_is_mounted_at_models_name_and_a_legacy_object_where_it_always_was() -> None:
    ref = artifact_ref(model())
    manifest = model().artifact.manifest()
    assert ref.mount_path == f"/models/{NAME}" and ref.model_path == f"/models/{NAME}"
    assert (ref.sha256, ref.size_bytes, ref.entry) == (manifest.digest, manifest.size_bytes, ".")
    assert [f.path for f in ref.files] == sorted(f.path for f in HF_FILES)
    legacy = artifact_ref(model([]))
    assert (legacy.mount_path, legacy.model_path, legacy.files, legacy.entry) == (
        "/models/model",
        "/models/model",
        [],
        "",
    )
    # A split GGUF: llama.cpp is given the first shard, inside the mounted directory.
    gguf = artifact_ref(model(GGUF_FILES, "qwen2-7b-q8_0-00001-of-00003.gguf"))
    assert gguf.model_path == f"/models/{NAME}/qwen2-7b-q8_0-00001-of-00003.gguf"


def test_each_server_is_pointed_at_the_directory_or_its_entry_file() -> None:
    fleet = [spark()]
    deploy(fleet, deployment("v", RuntimeKind.VLLM, memory=20 * GIB), model())
    deploy(fleet, deployment("s", RuntimeKind.SGLANG, memory=20 * GIB), model())
    deploy(fleet, deployment("t", RuntimeKind.TRTLLM, memory=20 * GIB), model())
    deploy(fleet, deployment("l", RuntimeKind.LLAMACPP, memory=10 * GIB), model(GGUF_FILES, GGUF_FILES[0].path))
    vllm, sglang, trtllm, llama = (container(fleet[0], i).process for i in range(4))
    assert vllm[:3] == ["vllm", "serve", f"/models/{NAME}"]
    assert vllm[vllm.index("--served-model-name") + 1] == NAME
    assert sglang[sglang.index("--model-path") + 1] == f"/models/{NAME}"
    assert sglang[sglang.index("--served-model-name") + 1] == NAME
    assert trtllm[:2] == ["trtllm-serve", f"/models/{NAME}"]
    assert llama[llama.index("--model") + 1] == f"/models/{NAME}/qwen2-7b-q8_0-00001-of-00003.gguf"
    # llama.cpp has no memory fraction: it allocates what the model and its context need.
    assert not any("memory" in arg or "fraction" in arg for arg in llama)
    for i in range(4):
        spec = container(fleet[0], i)
        assert spec.ro_mounts == [(str(ASSEMBLED), f"/models/{NAME}")]
        if i < 3:  # the Python servers load through Hugging Face libraries: never from a hub
            assert {k: spec.env.get(k) for k in OFFLINE} == OFFLINE


# --- point 6: unified memory is honoured ---------------------------------------------------------


def test_vllm_and_sglang_share_one_spark_each_held_to_its_reservation() -> None:
    """Two vLLM replicas (40 GiB each) and one SGLang replica (24 GiB) on one Spark, pinned."""
    fleet = [spark()]
    vllm = deploy(fleet, deployment("chat", RuntimeKind.VLLM, replicas=2, settings={"max_model_len": 8192}), model())
    assert [p.node_id for p in vllm.placements] == ["spark-1", "spark-1"]
    sglang = deploy(fleet, deployment("embed", RuntimeKind.SGLANG, memory=24 * GIB), model())
    assert [p.node_id for p in sglang.placements] == ["spark-1"]

    def expect(index: int, command: list[str], memory: int, env: dict[str, str]) -> ContainerSpec:
        a = fleet[0].desired.assignments[index]
        port = a.runtime.port
        return ContainerSpec(
            name=f"nexa-{a.id}",
            image=a.runtime.image,
            # The adapter's program is the container's entrypoint (no image config is known here).
            entrypoint=command[:1],
            command=command[1:],
            env=env,
            labels={
                "nexa.node": "spark-1",
                "nexa.assignment": a.id,
                "nexa.deployment": a.deployment,
                "nexa.generation": "2",
                "nexa.spec-sha256": container_spec.spec_sha256(a.runtime),
                "nexa.kind": a.runtime.kind.value,
                "nexa.port": str(port),
            },
            memory_bytes=memory,
            cpus=8.0,
            pids_limit=4096,
            shm_bytes=8 * GIB,
            devices=[SPARK_GPU],
            ro_mounts=[(str(ASSEMBLED), f"/models/{NAME}")],
            health=_probe(port),
            stop_timeout_s=30.0,
            network="private",
            publish_host=NODE_HOST,
            publish_port=port,
        )

    def vllm_command(port: int) -> list[str]:
        return [
            "vllm", "serve", f"/models/{NAME}", "--served-model-name", NAME, "--host", "0.0.0.0", "--port", str(port),
            # 40 GiB of the 119.3 GiB pool = 0.33526 -> 0.335 (rounded down: never above the reservation).
            "--gpu-memory-utilization", "0.335",
            "--max-model-len", "8192",
        ]  # fmt: skip

    for index, port in ((0, 18000), (1, 18001)):
        got = container(fleet[0], index)
        assert got == expect(index, vllm_command(port), 40 * GIB, VLLM_ENV)
    got = container(fleet[0], 2)
    sglang_command = [
        "python3", "-m", "sglang.launch_server", "--model-path", f"/models/{NAME}", "--served-model-name", NAME,
        "--host", "0.0.0.0", "--port", "18002", "--enable-metrics",
        # 24 GiB of the pool = 0.20115 -> 0.201.
        "--mem-fraction-static", "0.201",
    ]  # fmt: skip
    assert got == expect(2, sglang_command, 24 * GIB, SGLANG_ENV)

    # The placement explanation shows the derived value, and the API carries it as data.
    [e] = vllm.explanations
    assert e.replicas_placed == 2 and e.runtime_memory is not None
    assert (e.runtime_memory.setting, e.runtime_memory.value, e.runtime_memory.derived) == (
        "gpu_memory_utilization",
        0.335,
        True,
    )
    assert (e.runtime_memory.reserved_bytes, e.runtime_memory.pool_bytes) == (40 * GIB, POOL)
    assert e.runtime_memory.fits and e.runtime_memory.claim_bytes == POOL * 335 // 1000 <= 40 * GIB
    shown = codec.api.unstructure(sglang)["explanations"][0]["runtime_memory"]
    assert shown == {
        "setting": "mem_fraction_static",
        "flag": "--mem-fraction-static",
        "value": 0.201,
        "derived": True,
        "reserved_bytes": 24 * GIB,
        "pool_bytes": POOL,
        "claim_bytes": POOL * 201 // 1000,
        **FRACTION,
    }
    assert codec.loads(codec.api, codec.dumps(codec.api, sglang), PlacementDecision) == sglang


def _probe(port: int) -> HealthProbe:
    probe = python_probe("/health")
    return attrs.evolve(probe, command=[arg.replace(":18000", f":{port}") for arg in probe.command])


def test_the_replicas_on_one_spark_never_reserve_more_than_the_pool_less_the_host_headroom() -> None:
    assert HEADROOM == 8 * GIB
    fleet = [spark()]
    # 2 x 40 + 24 = 104 GiB reserved; the pool less 8 GiB is 111.3 GiB: 7.3 GiB are left.
    deploy(fleet, deployment("chat", RuntimeKind.VLLM, replicas=2), model())
    deploy(fleet, deployment("embed", RuntimeKind.SGLANG, memory=24 * GIB), model())
    [node] = snapshot_from(fleet, unified_headroom_bytes=HEADROOM)
    assert node.accelerator_memory_free_bytes == POOL - HEADROOM - 104 * GIB
    more = deploy(fleet, deployment("more", RuntimeKind.VLLM, memory=8 * GIB), model())
    assert not more.feasible
    [e] = more.explanations
    assert [(f.name, f.detail) for f in e.filters if not f.passed] == [
        # 8 GiB and vLLM's own 2 GiB overhead (ENGINE_OVERHEAD_BYTES).
        ("memory", "needs 10.0 GiB of unified memory, 7.3 GiB free")
    ]
    # Without the headroom the same replica would have fitted: the headroom is what refused it.
    assert deploy(list(fleet), deployment("more", RuntimeKind.VLLM, memory=8 * GIB), model(), headroom=0).feasible

    # Within one decision too: three 40 GiB replicas on an empty Spark are one too many.
    three = deploy([spark()], deployment("big", RuntimeKind.VLLM, replicas=3), model())
    assert not three.feasible and "only 2 of 3 replicas fit" in str(three.reason)
    # And what the placed replicas were told to claim adds up within the pool less the headroom.
    fleet = [spark()]
    deploy(fleet, deployment("chat", RuntimeKind.VLLM, replicas=2), model())
    deploy(fleet, deployment("embed", RuntimeKind.SGLANG, memory=24 * GIB), model())
    claims = []
    for a in fleet[0].desired.assignments:
        command = a.runtime.process
        flag = "--gpu-memory-utilization" if "vllm" in command else "--mem-fraction-static"
        claims.append(int(float(command[command.index(flag) + 1]) * POOL))
    assert sum(claims) <= POOL - HEADROOM


def test_tensorrt_llm_is_given_a_kv_cache_share_of_what_the_weights_leave() -> None:
    fleet = [spark()]
    weights = model().artifact.size_bytes  # 11.4 GB of shards, tokenizer and config
    decision = deploy(fleet, deployment("t", RuntimeKind.TRTLLM, memory=40 * GIB), model())
    command = fleet[0].desired.assignments[0].runtime.process
    fraction = float(command[command.index("--kv_cache_free_gpu_memory_fraction") + 1])
    # (reserved - weights) / (pool - weights), rounded down to 3 decimals.
    assert fraction == (40 * GIB - weights) * 1000 // (POOL - weights) / 1000 == 0.27
    assert weights + fraction * (POOL - weights) <= 40 * GIB
    memory = decision.explanations[0].runtime_memory
    assert memory is not None and memory.value == fraction and memory.fits
    # A reservation the weights alone fill leaves no KV cache: the Spark is filtered out, saying so.
    small = deploy([spark()], deployment("t", RuntimeKind.TRTLLM, memory=8 * GIB), model())
    assert not small.feasible
    [failed] = [f for f in small.explanations[0].filters if not f.passed]
    assert failed.name == "memory" and "settings.kv_cache_free_gpu_memory_fraction: no value" in failed.detail


def test_an_operator_value_over_the_reservation_is_a_typed_422_and_under_it_is_kept() -> None:
    fleet = [spark()]
    over = deployment("chat", RuntimeKind.VLLM, memory=48 * GIB, settings={"gpu_memory_utilization": 0.7})
    decision = place(snapshot_from(fleet), placement_request(over, model(), runtime(RuntimeKind.VLLM), 1))
    with pytest.raises(MemoryOverReservation) as caught:
        check_memory_limits(create(over), decision)
    message = caught.value.message
    # The setting, the node and its pool, and both figures.
    assert "settings.gpu_memory_utilization 0.7 claims 83.5 GiB of the 119.3 GiB unified pool" in message
    assert "above the 48.0 GiB reserved" in message and "node spark-1" in message
    assert (caught.value.setting, caught.value.node_id, caught.value.code) == (
        "gpu_memory_utilization",
        "spark-1",
        "memory_over_reservation",
    )
    assert status_for(caught.value) == 422
    # 0.4 of the pool is 47.7 GiB: within 48 GiB, kept as the operator wrote it.
    under = deployment("chat", RuntimeKind.VLLM, memory=48 * GIB, settings={"gpu_memory_utilization": 0.4})
    decision = deploy(fleet, under, model())
    check_memory_limits(create(under), decision)
    assert decision.feasible and decision.explanations[0].runtime_memory is not None
    assert decision.explanations[0].runtime_memory.derived is False
    command = fleet[0].desired.assignments[0].runtime.process
    assert command.count("--gpu-memory-utilization") == 1
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.4"


def test_a_node_where_the_operator_value_would_be_over_is_filtered_out_with_that_reason() -> None:
    """The deployment was accepted on discrete GPUs; a Spark enrolled later must not take it."""
    dep = deployment("chat", RuntimeKind.VLLM, memory=48 * GIB, settings={"gpu_memory_utilization": 0.7})
    nodes = [h100(), *snapshot_from([spark("spark-9")])]
    decision = place(nodes, placement_request(dep, model(), runtime(RuntimeKind.VLLM), 1))
    assert [p.node_id for p in decision.placements] == ["h100-1"]
    by_node = {e.node_id: e for e in decision.explanations}
    assert by_node["h100-1"].runtime_memory is None  # discrete GPUs: the reservation is theirs
    failed = [(f.name, f.detail) for f in by_node["spark-9"].filters if not f.passed]
    assert failed == [
        (
            "memory",
            "settings.gpu_memory_utilization 0.7 claims 83.5 GiB of the 119.3 GiB unified pool, "
            "above the 48.0 GiB reserved",
        )
    ]


def test_a_full_command_is_the_operators_and_gets_no_derived_flag() -> None:
    dep = attrs.evolve(
        deployment("chat", RuntimeKind.VLLM, memory=40 * GIB),
        options=RuntimeOptions(port=18000, command=["vllm", "serve", "/models/x"]),
    )
    fleet = [spark()]
    decision = deploy(fleet, dep, model())
    assert decision.feasible and decision.explanations[0].runtime_memory is None
    assert fleet[0].desired.assignments[0].runtime.process == ["vllm", "serve", "/models/x"]


def test_a_legacy_artifact_keeps_its_mount_and_command_off_unified_nodes() -> None:
    """One object, on a node with no unified pool: the assignment as before manifests, byte for byte."""
    dep = deployment("chat", RuntimeKind.VLLM, memory=40 * GIB)
    a = assignment_for(
        dep, Replica(id="chat-r0", node_id="h100-1", gpus=[SPARK_GPU]), model([]), runtime(RuntimeKind.VLLM), 18000
    )
    assert a.runtime.artifact is not None and a.runtime.artifact.mount_path == "/models/model"
    assert a.runtime.process == [
        "vllm", "serve", "/models/model", "--served-model-name", NAME, "--host", "{runtime_host}", "--port", "18000",
    ]  # fmt: skip
    body = codec.wire.unstructure(a.runtime)["artifact"]
    assert body == {
        "uri": f"s3://models/{NAME}.tar",
        "sha256": "c" * 64,
        "size_bytes": 16 * GIB,
        "files": [],
        "entry": "",
        "mount_path": "/models/model",
    }


def test_memory_fractions_round_down_and_never_claim_more_than_reserved() -> None:
    limit = MemoryLimit(setting="gpu_memory_utilization", flag="--gpu-memory-utilization", share_of=MemoryShare.POOL)
    for reserved in (GIB, 7 * GIB + 1, 40 * GIB, 64 * GIB, POOL - 1, POOL, 2 * POOL):
        on = limit.on(reserved, POOL)
        assert on.value is not None and on.fits and on.value <= 1.0
        assert on.claim_bytes is not None and on.claim_bytes <= reserved
        # The next step up would claim more than reserved (or the whole pool is given).
        assert on.value == 1.0 or limit.claim_bytes(on.value + 0.001, POOL) > reserved
    assert limit.on(POOL // 2000, POOL).value is None  # under a thousandth of the pool: no value fits
    kv = attrs.evolve(limit, share_of=MemoryShare.FREE_AFTER_WEIGHTS, weights_bytes=16 * GIB)
    assert kv.derived(16 * GIB, POOL) is None and kv.derived(POOL, POOL) == 1.0
    assert adapters.adapter_for(RuntimeKind.LLAMACPP, {}).memory_limit({}, weights_bytes=GIB) is None


def test_the_host_headroom_is_a_controller_setting(tmp_path: Path) -> None:
    path = tmp_path / "control.toml"
    path.write_text("[placement]\nunified_host_headroom_bytes = 17179869184\n")
    assert config.load(path, ControlConfig).placement.unified_host_headroom_bytes == 16 * GIB
    assert ControlConfig().placement.unified_host_headroom_bytes == 8 * GIB
    for bad in ("0", "-1", '"8G"'):
        path.write_text(f"[placement]\nunified_host_headroom_bytes = {bad}\n")
        with pytest.raises(ConfigError, match=r"placement\.unified_host_headroom_bytes"):
            config.load(path, ControlConfig)
    path.write_text("[placement]\nheadroom = 1\n")
    with pytest.raises(ConfigError, match="headroom"):
        config.load(path, ControlConfig)


async def test_over_the_api_an_operator_value_over_the_reservation_is_refused_and_nothing_changes(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    """A real controller and a raw node heartbeating the GB10 inventory over the real channel."""
    n1 = await online(dep_reg, dial, nursery, "n1")
    async with dep_reg.client() as http:
        vllm = {"name": "vllm", "kind": "vllm", "version": "1", "image": fleet_image(test_images)}
        await ok(http.post("/api/v1/runtimes", json=vllm), 201)
        await bring_to(http, s3_store, "tiny", "v1", "Approved")
        body: dict[str, Any] = {
            "name": "chat-v",
            "runtime": "vllm",
            "model": {"model": "tiny", "version": "v1"},
            "resources": {"accelerators": 1, "memory_bytes": 48 * GIB},
            "options": {"port": 18100, "settings": {"gpu_memory_utilization": 0.7}},
        }
        err = assert_envelope(await http.post("/api/v1/deployments", json=body), 422, "memory_over_reservation")
        message = str(err["message"])
        assert "node n1" in message and "settings.gpu_memory_utilization 0.7 claims 83.5 GiB" in message
        assert "of the 119.3 GiB unified pool, above the 48.0 GiB reserved" in message
        # The forecast shows the same verdict as data, and changes nothing either.
        forecast = await ok(http.post("/api/v1/capacity/forecast", json=body))
        [e] = forecast["explanations"]
        assert e["runtime_memory"]["derived"] is False and e["runtime_memory"]["value"] == 0.7
        assert (await ok(http.get("/api/v1/deployments")))["deployments"] == []
        assert (await node_view(dep_reg, "n1"))["desired_generation"] == 1

        # Left out, it is derived from the reservation: 48 GiB of the pool is 0.402.
        body["options"] = {"port": 18100}
        await ok(http.post("/api/v1/deployments", json=body), 201)
        placement = await ok(http.get("/api/v1/deployments/chat-v/placement"))
    [e] = placement["decision"]["explanations"]
    assert e["runtime_memory"] == {
        "setting": "gpu_memory_utilization",
        "flag": "--gpu-memory-utilization",
        "value": 0.402,
        "derived": True,
        "reserved_bytes": 48 * GIB,
        "pool_bytes": POOL,
        "claim_bytes": POOL * 402 // 1000,
        **FRACTION,
    }
    pushed = await set_where(n1.node, lambda s: "chat-v" in names(s))
    [a] = pushed.assignments
    command = a.runtime.process
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.402"
    assert a.runtime.memory_bytes == 48 * GIB


# --- point 6: llama.cpp's context, sized by the model's GGUF figures (tests/control/test_llama_context.py) --


def _with_figures(mod: ModelRecord, figures: GgufFigures) -> ModelRecord:
    check = Verification(
        verified_at=0, verified_by=None, sha256="", size_bytes=0, signature_key=None, seconds=0.0, gguf=figures
    )
    return attrs.evolve(mod, verification=check)


def test_cache_types_and_the_python_variant_size_the_context_as_llama_cpp_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Placement and the signed command, for a split 7 GiB GGUF with a 128k context, on a Spark."""
    mod = _with_figures(model(GGUF_FILES, GGUF_FILES[0].path), LLAMA_8B)
    weights = mod.artifact.size_bytes
    assert weights == 7 * GIB
    cases = [
        # 10 GiB declared: 3 GiB of f16 KV cache at 128 KiB a token = 24576 tokens.
        ({}, "--ctx-size", 24576, "--batch-size", 2048),
        # q8_0 keys and values take 34/64 of that a token: 46080 of 46261 tokens, rounded down to 256.
        ({"cache_type_k": "q8_0", "cache_type_v": "q8_0"}, "--ctx-size", 46080, "--batch-size", 2048),
        ({"server": "llama-cpp-python"}, "--n_ctx", 24576, "--n_batch", 512),
        # An operator's batch is kept; only the context is derived.
        ({"batch_size": 4096}, "--ctx-size", 24576, "--batch-size", 4096),
    ]
    for settings, ctx_flag, ctx, batch_flag, batch in cases:
        fleet = [spark()]
        decision = deploy(fleet, deployment("l", RuntimeKind.LLAMACPP, memory=10 * GIB, settings=settings), mod)
        assert decision.feasible, settings
        command = fleet[0].desired.assignments[0].runtime.command
        assert command[command.index(ctx_flag) + 1] == str(ctx), settings
        assert command[command.index(batch_flag) + 1] == str(batch), settings
        memory = decision.explanations[0].runtime_memory
        assert memory is not None and memory.fits and memory.claim_bytes is not None
        assert memory.claim_bytes <= memory.reserved_bytes == 10 * GIB + ENGINE_OVERHEAD_BYTES[LLAMA_SERVER]
        # `nexa deployments placement` prints the flags given, with the KV cache they leave room for.
        print_decision(decision)
        line = capsys.readouterr().out.splitlines()[-1]
        derived_batch = "" if "batch_size" in settings else f" {batch_flag} {batch}"  # an operator's is in settings
        assert f"; {ctx_flag} {ctx}{derived_batch} (derived from the reservation, a " in line
    # The weights alone fill 7 GiB: no context fits, and the Spark is filtered out, saying so.
    small = deploy([spark()], deployment("l", RuntimeKind.LLAMACPP, memory=7 * GIB), mod)
    assert not small.feasible
    [failed] = [f for f in small.explanations[0].filters if not f.passed]
    assert failed.name == "memory" and failed.detail.startswith("settings.ctx_size: no context keeps llama.cpp within")
    # On a discrete-GPU node nothing is derived: the reservation is its GPUs'.
    dep = deployment("l", RuntimeKind.LLAMACPP, memory=10 * GIB)
    replica = Replica(id="l-r0", node_id="h100-1", gpus=["nvidia.com/gpu=0"])
    a = assignment_for(dep, replica, mod, runtime(RuntimeKind.LLAMACPP), 18000)
    assert "--ctx-size" not in a.runtime.command and "--batch-size" not in a.runtime.command
