"""LoRA adapters in a replica's signed assignment (issue 34, point 2): what `assignment_for` gives each runtime
kind for the adapters aliases serve on its model (`RuntimeSpec.loras`, the runtime's flags), and the container
spec the node makes of it (each adapter's verified files mounted read-only at `/models/lora/<alias>`).
Pure: the same path a real assignment takes (controller → wire → node), without I/O.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from nexa import container_spec
from nexa.adapters.lora import limit_flag, limit_in, lora_args
from nexa.contracts import codec
from nexa.contracts.deployments import Replica, RuntimeOptions
from nexa.contracts.models import ModelFormat, ModelKind, ModelRecord, ModelRef, RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.control.deployments import assignment_for
from tests.support.adapters import ARTIFACT, IMAGES, NODE_HOST, PORT, SPARK_GPU, deployment, model


def adapter(name: str, fmt: ModelFormat) -> ModelRecord:
    return attrs.evolve(model(name, fmt), kind=ModelKind.LORA, base=[ModelRef(model="llama-3-8b", version="v1")])


def assigned(kind: RuntimeKind, settings: dict[str, object], fmt: ModelFormat, names: tuple[str, ...]):  # type: ignore[no-untyped-def]
    dep = deployment(RuntimeOptions(port=PORT, settings=settings))
    runtime = RuntimeRecord(
        name="rt", kind=kind, version="1", image=IMAGES[kind], media_type="", registered_at=0, registered_by=None
    )
    replica = Replica(id="chat-r1", node_id="spark-1", gpus=[SPARK_GPU], model=dep.model)
    loras = [(name, adapter(f"{name}-lora", fmt)) for name in names]
    a = assignment_for(dep, replica, model("llama-3-8b", fmt), runtime, PORT, loras=loras)
    assert codec.loads(codec.wire, codec.dumps(codec.wire, a), type(a)) == a  # survives the wire
    return a


def test_llama_server_loads_every_adapter_at_start_at_scale_zero_and_the_node_mounts_each() -> None:
    a = assigned(RuntimeKind.LLAMACPP, {}, ModelFormat.GGUF, ("poet", "coder"))
    cmd = a.runtime.command
    # Loaded at scale 0: a request that names no adapter (the base's) gets none.
    assert cmd[-5:] == [
        "--lora-init-without-apply",
        "--lora-scaled",
        "/models/lora/poet:0",
        "--lora-scaled",
        "/models/lora/coder:0",
    ]
    assert [lo.name for lo in a.runtime.loras] == ["poet", "coder"]
    held = [Path("/var/lib/nexa/node/artifacts/" + c * 64) for c in "de"]
    spec = container_spec.container_spec("spark-1", a, 3, ARTIFACT, host=NODE_HOST, lora_paths=held)
    assert spec.ro_mounts[1:] == [(str(held[0]), "/models/lora/poet"), (str(held[1]), "/models/lora/coder")]
    with pytest.raises(ValueError, match="lora_paths"):
        container_spec.container_spec("spark-1", a, 3, ARTIFACT, host=NODE_HOST)


def test_vllm_enables_run_time_loading_within_max_loras() -> None:
    a = assigned(RuntimeKind.VLLM, {"max_loras": 2}, ModelFormat.SAFETENSORS, ("poet", "coder", "judge"))
    cmd = a.runtime.command
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-loras") + 1] == "2" and cmd.count("--max-loras") == 1
    assert "--lora-modules" not in cmd  # loaded at run time by the node, not at start
    assert a.runtime.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert limit_in(cmd) == 2
    # Given in the assignment, outside the spec, by `<alias>@<version>`; the runtime's default limit
    # has room for one version more than its aliases (a new one soaking beside the earlier one).
    default = assigned(RuntimeKind.VLLM, {}, ModelFormat.SAFETENSORS, ("poet", "coder", "judge"))
    assert limit_in(default.runtime.command) == 4
    assert default.runtime.live_loras and default.runtime.loras == []
    assert [lo.name for lo in default.loras] == ["poet@v1", "coder@v1", "judge@v1"]
    assert [lo.artifact.model_path for lo in default.loras] == [
        f"/models/lora/{n}@v1" for n in ("poet", "coder", "judge")
    ]


def test_a_new_adapter_version_beside_the_earlier_one_keeps_the_runtime_spec() -> None:
    """An adapter rollout in place: the same alias given twice (earlier and new version) changes the
    assignment's adapters, never its spec, so the node keeps the running replica."""
    one = assigned(RuntimeKind.VLLM, {}, ModelFormat.SAFETENSORS, ("poet",))
    dep = deployment(RuntimeOptions(port=PORT))
    runtime = RuntimeRecord(
        name="rt", kind=RuntimeKind.VLLM, version="1", image=IMAGES[RuntimeKind.VLLM], media_type="",
        registered_at=0, registered_by=None,
    )  # fmt: skip
    replica = Replica(id="chat-r1", node_id="spark-1", gpus=[SPARK_GPU], model=dep.model)
    a1 = adapter("poet-lora", ModelFormat.SAFETENSORS)
    a2 = attrs.evolve(a1, version="v2")
    both = assignment_for(
        dep, replica, model("llama-3-8b", ModelFormat.SAFETENSORS), runtime, PORT, loras=[("poet", a1), ("poet", a2)]
    )
    assert [lo.name for lo in both.loras] == ["poet@v1", "poet@v2"]
    assert container_spec.spec_sha256(both.runtime) == container_spec.spec_sha256(one.runtime)
    assert limit_in(both.runtime.command) == 2


def test_sglang_loads_its_adapters_at_start_by_name() -> None:
    a = assigned(RuntimeKind.SGLANG, {}, ModelFormat.SAFETENSORS, ("poet",))
    cmd = a.runtime.command
    assert cmd[cmd.index("--lora-paths") + 1] == "poet=/models/lora/poet" and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-loras-per-batch") + 1] == "1"


def test_sglang_with_its_lora_pool_shape_set_loads_its_adapters_at_run_time() -> None:
    """SGLang can start with no adapter only when its LoRA pool's shape is given (`--max-lora-rank`,
    `--lora-target-modules`); then its adapters are the assignment's, loaded by the node, and a new
    version of one leaves the spec as it is (an in-place canary, as on vLLM)."""
    settings: dict[str, object] = {"max_lora_rank": 64, "lora_target_modules": "q_proj k_proj v_proj o_proj"}
    a = assigned(RuntimeKind.SGLANG, settings, ModelFormat.SAFETENSORS, ("poet", "coder"))
    cmd = a.runtime.command
    assert "--lora-paths" not in cmd and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "64"
    i = cmd.index("--lora-target-modules")
    assert cmd[i + 1 : i + 5] == ["q_proj", "k_proj", "v_proj", "o_proj"]  # argparse nargs: one word each
    assert cmd[cmd.index("--max-loras-per-batch") + 1] == "3"  # its aliases and one version more
    assert a.runtime.live_loras and a.runtime.loras == []
    assert [lo.name for lo in a.loras] == ["poet@v1", "coder@v1"]
    assert a.runtime.env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") is None
    # One of the two alone is not enough for SGLang to start without adapters: loaded at start.
    half = assigned(RuntimeKind.SGLANG, {"max_lora_rank": 64}, ModelFormat.SAFETENSORS, ("poet",))
    assert half.loras == [] and "--lora-paths" in half.runtime.command
    assert lora_args(RuntimeKind.SGLANG, settings, [], [("poet", "/models/lora/poet")], live=False)[0][-2:] == [
        "--lora-paths",
        "poet=/models/lora/poet",
    ]  # a node of an earlier release: in the spec, as before
    assert limit_in(["--max-loaded-loras", "4"], limit_flag(RuntimeKind.SGLANG)) == 4


def test_a_runtime_that_loads_no_adapters_gets_none_and_a_replica_without_any_is_unchanged() -> None:
    python = assigned(RuntimeKind.LLAMACPP, {"server": "llama-cpp-python"}, ModelFormat.GGUF, ("poet",))
    assert python.runtime.loras == [] and "--lora-scaled" not in python.runtime.command
    plain = assigned(RuntimeKind.LLAMACPP, {}, ModelFormat.GGUF, ())
    assert plain.runtime.loras == [] and "--lora-init-without-apply" not in plain.runtime.command
    # A spec without adapters hashes as specs did before them (an upgraded node adopts what it runs).
    body = codec.wire.unstructure(plain.runtime)
    del body["loras"]
    assert container_spec.spec_sha256(plain.runtime) == container_spec.spec_sha256(
        codec.structure(codec.wire, body, type(plain.runtime))
    )
    assert lora_args(RuntimeKind.TRTLLM, {}, [], [("poet", "/models/lora/poet")]) == ([], {})
