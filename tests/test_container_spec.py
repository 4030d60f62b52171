"""`nexa.container_spec`: assignment → container spec. Pure functions, plain sync tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from nexa import container_spec
from nexa.adapters.lora import LORA_MOUNT_ROOT
from nexa.contracts import codec, wire
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import (
    LABEL_ASSIGNMENT,
    LABEL_DEPLOYMENT,
    LABEL_GENERATION,
    LABEL_SPEC,
    ArtifactRef,
    ContainerState,
    HealthProbe,
    RuntimeSpec,
)
from nexa.errors import ContractError
from nexa.node.engines import docker, libpod
from tests.conftest import sample_runtime

#: sha256 of the canonical JSON of the spec built in `test_spec_hash_is_stable`. Changed on purpose
#: when `host_network` joined the spec (issue 12): runtimes that ran in the host namespace must be
#: recreated in a namespace of their own, so the upgrade replaces them instead of adopting them.
GOLDEN_SPEC_SHA256 = "c3cb63a7c71a48b7d29f7214c0096b5e2ac4a4df9b03b66e08ca03d49bfe3763"
ARTIFACT = Path("/var/lib/nexa/artifacts/" + "1" * 64)


def assignment(runtime: RuntimeSpec | None = None, aid: str = "a1") -> wire.Assignment:
    return wire.Assignment(id=aid, deployment="d1", runtime=runtime or sample_runtime())


def state(**kw: object) -> ContainerState:
    image = sample_runtime().image
    values: dict[str, object] = {
        "id": "c1",
        "name": "nexa-a1",
        "image_name": image,
        "image_digest": container_spec.image_digest(image),
        "labels": {},
        "running": True,
        "status": "running",
    }
    values.update(kw)
    return ContainerState(**values)  # type: ignore[arg-type]


def test_container_spec_carries_the_runtime_and_its_labels() -> None:
    rt = sample_runtime()
    spec = container_spec.container_spec("n1", assignment(rt), 7, ARTIFACT)
    assert spec.name == "nexa-a1"
    assert spec.image == rt.image
    assert spec.command == rt.command
    assert spec.labels == {
        container_spec.LABEL_NODE: "n1",
        LABEL_ASSIGNMENT: "a1",
        LABEL_DEPLOYMENT: "d1",
        LABEL_GENERATION: "7",
        LABEL_SPEC: container_spec.spec_sha256(rt),
        container_spec.LABEL_KIND: "llamacpp",
        container_spec.LABEL_PORT: "18300",
    }
    assert spec.devices == ["nvidia.com/gpu=0"]
    assert spec.ro_mounts == [(str(ARTIFACT), "/models/model")]
    assert (spec.memory_bytes, spec.cpus, spec.pids_limit, spec.shm_bytes) == (2 << 30, 2.0, 4096, 0)
    assert spec.health == rt.health
    assert spec.stop_timeout_s == rt.stop_timeout_s
    # Its own network namespace by default, the port published on the node's runtime address only.
    assert (spec.network, spec.publish_host, spec.publish_port) == ("private", "127.0.0.1", 18300)


def test_runtime_host_binds_every_address_inside_a_private_namespace_and_the_node_address_with_host_network() -> None:
    rt = attrs.evolve(
        sample_runtime(),
        command=["--host", "{runtime_host}", "--port", "18300"],
        health=attrs.evolve(sample_runtime().health, command=["curl", "http://{runtime_host}:18300/health"]),
    )
    private = container_spec.container_spec("n1", assignment(rt), 1, ARTIFACT, host="127.0.0.12")
    assert private.command == ["--host", "0.0.0.0", "--port", "18300"]
    assert private.health.command == ["curl", "http://127.0.0.1:18300/health"]
    assert (private.network, private.publish_host, private.publish_port) == ("private", "127.0.0.12", 18300)

    opted_in = container_spec.container_spec(
        "n1", assignment(attrs.evolve(rt, host_network=True)), 1, ARTIFACT, host="127.0.0.12"
    )
    assert opted_in.command == ["--host", "127.0.0.12", "--port", "18300"]
    assert opted_in.health.command == ["curl", "http://127.0.0.12:18300/health"]
    assert (opted_in.network, opted_in.publish_host, opted_in.publish_port) == ("host", "", 0)
    # The opt-in is part of the signed spec: changing it replaces the container.
    assert container_spec.spec_sha256(rt) != container_spec.spec_sha256(attrs.evolve(rt, host_network=True))


def test_env_is_exactly_the_specs() -> None:
    rt = attrs.evolve(sample_runtime(), env={"OMP_NUM_THREADS": "4", "HF_HUB_OFFLINE": "1"})
    spec = container_spec.container_spec("n1", assignment(rt), 1, ARTIFACT)
    assert spec.env == {"OMP_NUM_THREADS": "4", "HF_HUB_OFFLINE": "1"}


def test_no_artifact_no_mount() -> None:
    rt = attrs.evolve(sample_runtime(), artifact=None, gpus=[])
    spec = container_spec.container_spec("n1", assignment(rt), 1, None)
    assert spec.ro_mounts == []
    assert spec.devices == []


def sim_runtime(**change: Any) -> RuntimeSpec:
    rt = attrs.evolve(sample_runtime(port=18400), kind=RuntimeKind.SIM, command=["--ttft-ms", "5"], gpus=[])
    return attrs.evolve(rt, **change)


def test_a_sim_spec_runs_the_simulator_on_loopback_with_the_host_artifact_path() -> None:
    rt = sim_runtime()
    spec = container_spec.container_spec("n1", assignment(rt), 3, ARTIFACT)
    assert container_spec.is_simulated(rt)
    assert not container_spec.is_simulated(sample_runtime())
    # The deployment is the model name; the spec's flags follow; a process has no mounts.
    assert spec.command == [
        "--host", "127.0.0.1", "--port", "18400", "--model", "d1", "--ttft-ms", "5", "--artifact", str(ARTIFACT),
    ]  # fmt: skip
    assert spec.ro_mounts == []
    assert spec.labels[container_spec.LABEL_KIND] == "sim"
    assert spec.labels[container_spec.LABEL_PORT] == "18400"
    assert spec.labels[LABEL_SPEC] == container_spec.spec_sha256(rt)


def test_a_sim_spec_without_artifact_names_none() -> None:
    spec = container_spec.container_spec("n1", assignment(sim_runtime(artifact=None, command=[])), 1, None)
    assert spec.command == ["--host", "127.0.0.1", "--port", "18400", "--model", "d1"]


def test_artifact_path_must_match_the_spec() -> None:
    with pytest.raises(ValueError, match="artifact_path"):
        container_spec.container_spec("n1", assignment(), 1, None)
    with pytest.raises(ValueError, match="artifact_path"):
        container_spec.container_spec("n1", assignment(attrs.evolve(sample_runtime(), artifact=None)), 1, ARTIFACT)


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "OPENAI_API_KEY", "api_key", "Db_Password", "AWS_SECRET_ACCESS_KEY", "GOOGLE_CREDENTIALS", "hf_token"],
)
def test_secret_looking_env_is_refused(name: str) -> None:
    rt = attrs.evolve(sample_runtime(), env={"PLAIN": "1", name: "x"})
    with pytest.raises(ContractError) as info:
        container_spec.container_spec("n1", assignment(rt), 1, ARTIFACT)
    assert name in info.value.message
    assert info.value.problems == (f"runtime.env.{name}: looks like a secret",)
    assert "x" not in info.value.message.split(name)[-1]  # the value is never repeated


def test_every_secret_name_is_named() -> None:
    env = {"B_TOKEN": "1", "A_KEY": "2", "PLAIN": "3"}
    assert container_spec.secret_env_names(env) == ["A_KEY", "B_TOKEN"]
    with pytest.raises(ContractError, match="A_KEY, B_TOKEN"):
        container_spec.check_env(env)
    container_spec.check_env({"PLAIN": "3", "MODEL_PATH": "/models/model"})


def test_spec_hash_is_stable() -> None:
    # The hash is on every container's label: if this value changes, every running runtime is
    # replaced after an agent upgrade instead of adopted. Change it only on purpose.
    golden = RuntimeSpec(
        kind=RuntimeKind.VLLM,
        image="registry.local/vllm@sha256:" + "a" * 64,
        command=["vllm", "serve", "/models/model"],
        env={"VLLM_LOGGING_LEVEL": "INFO"},
        port=8000,
        artifact=ArtifactRef(uri="s3://models/m.safetensors", sha256="b" * 64, size_bytes=1000),
        gpus=["nvidia.com/gpu=all"],
        memory_bytes=1 << 30,
        cpus=4.0,
        health=HealthProbe(command=["true"]),
    )
    assert container_spec.spec_sha256(golden) == GOLDEN_SPEC_SHA256
    reordered = attrs.evolve(sample_runtime(), env={"B": "2", "A": "1"})
    assert container_spec.spec_sha256(reordered) == container_spec.spec_sha256(
        attrs.evolve(sample_runtime(), env={"A": "1", "B": "2"})
    )


@pytest.mark.parametrize(
    "change",
    [
        {"command": ["python3", "-m", "other"]},
        {"env": {"A": "1"}},
        {"gpus": ["nvidia.com/gpu=1"]},
        {"memory_bytes": 4 << 30},
        {"image": "127.0.0.1:5000/nexa/llamacpp@sha256:" + "2" * 64},
        {"stop_timeout_s": 5.0},
        {"entrypoint": ["/app/llama-server"]},
    ],
)
def test_spec_hash_detects_changes(change: dict[str, Any]) -> None:
    assert container_spec.spec_sha256(attrs.evolve(sample_runtime(), **change)) != container_spec.spec_sha256(
        sample_runtime()
    )


def test_a_set_signed_before_entrypoints_decodes_and_keeps_its_hash() -> None:
    """Its JSON has no `entrypoint`: the image's entrypoint stays, and the running container is adopted."""
    rt = sample_runtime()
    body = codec.wire.unstructure(rt)
    del body["entrypoint"]
    old = codec.loads(codec.wire, json.dumps(body), RuntimeSpec)
    assert old == rt and old.entrypoint == [] and old.process == rt.command
    assert container_spec.spec_sha256(old) == container_spec.spec_sha256(rt)
    assert container_spec.container_spec("n", assignment(old), 1, ARTIFACT).entrypoint == []


def test_names_are_sanitised_without_collisions() -> None:
    assert container_spec.container_name("a-1.b_2") == "nexa-a-1.b_2"
    slash, colon = container_spec.container_name("dep/a:1"), container_spec.container_name("dep:a/1")
    assert slash.startswith("nexa-dep-a-1-")
    assert slash != colon
    for name in (slash, colon, container_spec.container_name("/"), container_spec.container_name("")):
        assert container_spec._NAME_OK.match(name), name


def test_image_identity() -> None:
    image = sample_runtime().image
    assert container_spec.image_digest(image) == "sha256:" + "0" * 64
    assert container_spec.image_matches(state(), image)
    # The digest is what counts, under whatever name podman shows.
    assert container_spec.image_matches(state(image_name="other@sha256:" + "0" * 64), image)
    # A name is no proof: an unknown digest or another one does not match.
    assert not container_spec.image_matches(state(image_digest=""), image)
    assert not container_spec.image_matches(state(image_digest="sha256:" + "f" * 64), image)
    assert not container_spec.image_matches(
        state(image_name="127.0.0.1:5000/evil@sha256:" + "f" * 64, image_digest="sha256:" + "f" * 64), image
    )


def test_a_runtime_loading_its_adapters_at_run_time_mounts_its_adapter_directory_read_only() -> None:
    rt = attrs.evolve(sample_runtime(), kind=RuntimeKind.VLLM, live_loras=True)
    live = Path("/var/lib/nexa/loras/nexa-a1")
    spec = container_spec.container_spec("n1", assignment(rt), 1, ARTIFACT, live_lora_dir=live)
    assert container_spec.LIVE_LORA_MOUNT == LORA_MOUNT_ROOT == "/models/lora"
    assert spec.ro_mounts == [(str(ARTIFACT), "/models/model"), (str(live), "/models/lora")]
    # Read-only, with the same options as the model's, on both engines.
    (pod,) = [m for m in libpod.create_body(spec)["mounts"] if m["destination"] == "/models/lora"]
    assert pod == {
        "destination": "/models/lora",
        "type": "bind",
        "source": str(live),
        "options": ["ro", "rbind", "nosuid", "nodev"],
    }
    (engine,) = [m for m in docker.docker_create_body(spec)["HostConfig"]["Mounts"] if m["Target"] == "/models/lora"]
    assert engine["ReadOnly"] is True and engine["Source"] == str(live)
    # The directory is given exactly when the spec says so; without it nothing is mounted there.
    with pytest.raises(ValueError, match="live_lora_dir"):
        container_spec.container_spec("n1", assignment(rt), 1, ARTIFACT)
    with pytest.raises(ValueError, match="live_lora_dir"):
        container_spec.container_spec("n1", assignment(sample_runtime()), 1, ARTIFACT, live_lora_dir=live)
    plain = container_spec.container_spec("n1", assignment(attrs.evolve(rt, live_loras=False)), 1, ARTIFACT)
    assert [inside for _, inside in plain.ro_mounts] == ["/models/model"]
