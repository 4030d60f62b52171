"""Runtime adapters (`nexa.adapters`): each one's container spec for a DGX Spark deployment, pinned.

A DGX Spark is a GB10: one GPU sharing 128 GB of unified memory with the arm64 host, so a replica
gets the single CDI device `nvidia.com/gpu=0` and no tensor parallelism. The spec goes the whole
way a real one does: the controller's `assignment_for` (adapter → signed `RuntimeSpec`), then the
node's `container_spec.container_spec` (the node's runtime address filled in, the artifact mounted).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from nexa import adapters, container_spec
from nexa.adapters.llamacpp import LLAMA_SERVER_ADAPTER
from nexa.adapters.sglang import SGLANG
from nexa.adapters.trtllm import TRTLLM
from nexa.adapters.vllm import VLLM
from nexa.contracts import codec
from nexa.contracts.deployments import Replica, RuntimeOptions
from nexa.contracts.gateway import Capability
from nexa.contracts.models import RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ContainerSpec, HealthProbe
from nexa.control.deployments import assignment_for
from tests.support.adapters import (
    ARTIFACT,
    GIB,
    IMAGES,
    LLAMA_ENV,
    NODE_HOST,
    PORT,
    PROBE_HOST,
    SGLANG_ENV,
    SPARK_GPU,
    TRTLLM_ENV,
    VLLM_ENV,
    deployment,
    model,
    python_probe,
)

#: Inside the runtime's own network namespace: it binds every address there; its probe asks loopback.
BIND_HOST = "0.0.0.0"


def spark_spec(
    kind: RuntimeKind,
    settings: dict[str, object],
    *,
    name: str = "llama-3-8b",
    version: str = "1",
    extra_args: list[str] | None = None,
) -> ContainerSpec:
    """The container spec a DGX Spark node creates for one replica of `kind` with `settings`."""
    dep = deployment(RuntimeOptions(port=PORT, settings=settings, extra_args=extra_args or []))
    runtime = RuntimeRecord(
        name="rt", kind=kind, version=version, image=IMAGES[kind], media_type="", registered_at=0, registered_by=None
    )
    replica = Replica(id="chat-r1", node_id="spark-1", gpus=[SPARK_GPU], model=dep.model)
    assignment = assignment_for(dep, replica, model(name), runtime, PORT)
    # The assignment is signed and sent as JSON: what the node gets must survive the wire unchanged.
    assert codec.loads(codec.wire, codec.dumps(codec.wire, assignment), type(assignment)) == assignment
    return container_spec.container_spec("spark-1", assignment, 3, ARTIFACT, host=NODE_HOST)


def expect(kind: RuntimeKind, **over: Any) -> ContainerSpec:
    base = ContainerSpec(
        name="nexa-chat-r1",
        image=IMAGES[kind],
        command=[],
        env={},
        labels={
            "nexa.node": "spark-1",
            "nexa.assignment": "chat-r1",
            "nexa.deployment": "chat",
            "nexa.generation": "3",
            "nexa.spec-sha256": "",
            "nexa.kind": str(kind),
            "nexa.port": str(PORT),
        },
        memory_bytes=48 * GIB,
        cpus=8.0,
        pids_limit=4096,
        shm_bytes=8 * GIB,
        devices=[SPARK_GPU],
        ro_mounts=[(str(ARTIFACT), "/models/model")],
        health=python_probe("/health"),
        stop_timeout_s=30.0,
        network="private",
        publish_host=NODE_HOST,
        publish_port=PORT,
    )
    return attrs.evolve(base, **over)


def same(got: ContainerSpec, want: ContainerSpec) -> None:
    assert got.labels.pop("nexa.spec-sha256")  # a digest of the signed spec, pinned in test_container_spec
    want.labels.pop("nexa.spec-sha256")
    # The process is exactly the adapter's command: its program is set as the container's entrypoint
    # (no image config is known here), its arguments are the container's command.
    assert (got.entrypoint, got.command) == (want.command[:1], want.command[1:])
    assert attrs.evolve(got, entrypoint=[], command=want.command) == want


def test_vllm_on_a_dgx_spark() -> None:
    got = spark_spec(RuntimeKind.VLLM, {"max_model_len": 8192, "gpu_memory_utilization": 0.7})
    want = expect(
        RuntimeKind.VLLM,
        command=[
            "vllm",
            "serve",
            "/models/model",
            "--served-model-name",
            "llama-3-8b",
            "--host",
            BIND_HOST,
            "--port",
            "18000",
            "--gpu-memory-utilization",
            "0.7",
            "--max-model-len",
            "8192",
        ],
        env=VLLM_ENV,
    )
    same(got, want)


def test_sglang_on_a_dgx_spark() -> None:
    got = spark_spec(RuntimeKind.SGLANG, {"context_length": 8192, "mem_fraction_static": 0.6, "shm_bytes": 4 * GIB})
    want = expect(
        RuntimeKind.SGLANG,
        command=[
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/models/model",
            "--served-model-name",
            "llama-3-8b",
            "--host",
            BIND_HOST,
            "--port",
            "18000",
            "--enable-metrics",
            "--context-length",
            "8192",
            "--mem-fraction-static",
            "0.6",
        ],
        env=SGLANG_ENV,
        shm_bytes=4 * GIB,
    )
    same(got, want)


def test_trtllm_on_a_dgx_spark() -> None:
    got = spark_spec(
        RuntimeKind.TRTLLM, {"backend": "pytorch", "kv_cache_free_gpu_memory_fraction": 0.5}, version="1.3.0rc7"
    )
    want = expect(
        RuntimeKind.TRTLLM,
        command=[
            "trtllm-serve",
            "/models/model",
            "--served_model_name",
            "llama-3-8b",
            "--host",
            BIND_HOST,
            "--port",
            "18000",
            "--backend",
            "pytorch",
            "--kv_cache_free_gpu_memory_fraction",
            "0.5",
        ],
        env=TRTLLM_ENV,
    )
    same(got, want)


def test_llama_server_on_a_dgx_spark() -> None:
    got = spark_spec(RuntimeKind.LLAMACPP, {"ctx_size": 8192, "parallel": 4, "flash_attn": "on"})
    want = expect(
        RuntimeKind.LLAMACPP,
        command=[
            "llama-server",
            "--model",
            "/models/model",
            "--alias",
            "llama-3-8b",
            "--host",
            BIND_HOST,
            "--port",
            "18000",
            "--metrics",
            "--n-gpu-layers",
            "999",
            "--ctx-size",
            "8192",
            "--flash-attn",
            "on",
            "--parallel",
            "4",
        ],
        env=LLAMA_ENV,
        shm_bytes=0,
        health=HealthProbe(
            command=["curl", "-fsS", "-o", "/dev/null", "--max-time", "5", f"http://{PROBE_HOST}:{PORT}/health"],
            interval_s=2.0,
            timeout_s=6.0,
            start_period_s=600.0,
            retries=3,
        ),
    )
    same(got, want)


def test_llama_cpp_python_on_a_dgx_spark() -> None:
    got = spark_spec(
        RuntimeKind.LLAMACPP, {"server": "llama-cpp-python", "n_ctx": 4096, "embedding": True}, name="minilm"
    )
    want = expect(
        RuntimeKind.LLAMACPP,
        command=[
            "python3",
            "-m",
            "llama_cpp.server",
            "--model",
            "/models/model",
            "--model_alias",
            "minilm",
            "--host",
            BIND_HOST,
            "--port",
            "18000",
            "--n_gpu_layers",
            "-1",
            "--embedding",
            "true",
            "--n_ctx",
            "4096",
        ],
        env=LLAMA_ENV,
        shm_bytes=0,
        health=python_probe("/v1/models"),
    )
    same(got, want)


def test_the_signed_spec_keeps_the_placeholder_and_each_node_fills_in_its_own_address() -> None:
    dep = deployment(RuntimeOptions(port=PORT))
    runtime = RuntimeRecord(
        name="rt", kind=RuntimeKind.VLLM, version="1", image=IMAGES[RuntimeKind.VLLM], media_type="", registered_at=0,
        registered_by=None,
    )  # fmt: skip
    replica = Replica(id="r", node_id="n", gpus=[SPARK_GPU])
    signed = assignment_for(dep, replica, model(), runtime, PORT).runtime
    assert "{runtime_host}" in signed.command and "{runtime_host}" in signed.health.command[-1]
    a = container_spec.container_spec(
        "n", assignment_for(dep, replica, model(), runtime, PORT), 1, ARTIFACT, host="127.0.0.12"
    )
    # In its own namespace it binds every address there; podman publishes the port on the node's.
    assert BIND_HOST in a.command and "{runtime_host}" not in " ".join(a.command)
    assert f"{PROBE_HOST}:18000/health" in a.health.command[-1]
    assert (a.publish_host, a.publish_port) == ("127.0.0.12", PORT)


def test_several_gpus_are_tensor_parallel() -> None:
    gpus = [f"nvidia.com/gpu={i}" for i in range(4)]
    for adapter, flag in ((VLLM, "--tensor-parallel-size"), (SGLANG, "--tp-size")):
        command = adapter.launch("m", {}, gpus, PORT).command
        assert command[command.index(flag) + 1] == "4"
    assert "--tp_size" in TRTLLM.launch("m", {}, gpus, PORT).command
    # One GPU: no flag at all (the server's default is 1).
    assert "--tensor-parallel-size" not in VLLM.launch("m", {}, gpus[:1], PORT).command
    # llama.cpp on the CPU: no offload arguments.
    assert "--n-gpu-layers" not in LLAMA_SERVER_ADAPTER.launch("m", {}, [], PORT).command


def test_an_explicit_command_and_probe_replace_the_adapters() -> None:
    options = RuntimeOptions(port=PORT, command=["llama-server", "-m", "/models/model"], health_command=["true"])
    runtime = RuntimeRecord(
        name="rt", kind=RuntimeKind.LLAMACPP, version="1", image=IMAGES[RuntimeKind.LLAMACPP], media_type="",
        registered_at=0, registered_by=None,
    )  # fmt: skip
    spec = assignment_for(deployment(options), Replica(id="r", node_id="n"), model(), runtime, PORT).runtime
    assert spec.process == ["llama-server", "-m", "/models/model"]
    assert spec.health.command == ["true"]


@pytest.mark.parametrize(
    ("kind", "settings", "problem"),
    [
        (RuntimeKind.VLLM, {"max_model_length": 8192}, "settings.max_model_length: unknown option for vllm"),
        (RuntimeKind.VLLM, {"max_model_len": "8192"}, "settings.max_model_len: an integer"),
        (RuntimeKind.VLLM, {"max_model_len": True}, "settings.max_model_len: an integer"),
        (RuntimeKind.VLLM, {"gpu_memory_utilization": 1.5}, "settings.gpu_memory_utilization: at most 1"),
        (RuntimeKind.VLLM, {"enforce_eager": 1}, "settings.enforce_eager: true or false"),
        (RuntimeKind.VLLM, {"dtype": "int3"}, "settings.dtype: one of auto, half"),
        (RuntimeKind.VLLM, {"tokenizer": "--evil"}, "settings.tokenizer: a non-empty value"),
        (RuntimeKind.VLLM, {"shm_bytes": -1}, "settings.shm_bytes: 0 or more"),
        (RuntimeKind.SGLANG, {"ctx_size": 1}, "settings.ctx_size: unknown option for sglang"),
        (RuntimeKind.TRTLLM, {"backend": "onnx"}, "settings.backend: one of pytorch, tensorrt"),
        (RuntimeKind.LLAMACPP, {"n_ctx": 512}, "settings.n_ctx: unknown option for llama-server"),
        (RuntimeKind.LLAMACPP, {"server": "ollama"}, "settings.server: one of llama-server, llama-cpp-python"),
        (RuntimeKind.LLAMACPP, {"server": "llama-cpp-python", "ctx_size": 1}, "unknown option for llama-cpp-python"),
        (RuntimeKind.SIM, {"x": 1}, "settings.x: the sim runtime takes no settings"),
    ],
)
def test_bad_settings_are_named(kind: RuntimeKind, settings: dict[str, object], problem: str) -> None:
    problems = adapters.settings_problems(kind, settings, accelerators=1)
    assert len(problems) == 1 and problem in problems[0], problems


def test_gpu_servers_need_a_gpu_and_llama_cpp_does_not() -> None:
    for kind in (RuntimeKind.VLLM, RuntimeKind.SGLANG, RuntimeKind.TRTLLM):
        assert adapters.settings_problems(kind, {}, accelerators=0) == [
            f"resources.accelerators: {kind} needs at least 1 GPU"
        ]
    assert adapters.settings_problems(RuntimeKind.LLAMACPP, {}, accelerators=0) == []
    assert adapters.settings_problems(RuntimeKind.SIM, {}, accelerators=0) == []
    # Settings beside a full command would be ignored: refused.
    assert adapters.settings_problems(RuntimeKind.VLLM, {"enforce_eager": True}, accelerators=1, command=["x"])


def test_each_adapter_knows_its_endpoints_metrics_and_capabilities() -> None:
    vllm = adapters.adapter_for(RuntimeKind.VLLM, {})
    assert (vllm.readiness_path, vllm.metrics.path) == ("/health", "/metrics")
    assert (vllm.metrics.waiting, vllm.metrics.running) == ("vllm:num_requests_waiting", "vllm:num_requests_running")
    assert "vllm:kv_cache_usage_perc" in vllm.metrics.kv_cache
    sglang = adapters.adapter_for(RuntimeKind.SGLANG, {})
    assert sglang.metrics.waiting == "sglang:num_queue_reqs" and "--enable-metrics" in sglang.fixed
    assert adapters.adapter_for(RuntimeKind.TRTLLM, {}).metrics.format == "json"
    llama = adapters.adapter_for(RuntimeKind.LLAMACPP, {})
    assert llama.metrics.running == "llamacpp:requests_processing" and "--metrics" in llama.fixed
    python = adapters.adapter_for(RuntimeKind.LLAMACPP, {"server": "llama-cpp-python"})
    assert python.metrics.path is None and python.readiness_path == "/v1/models"
    # Embeddings only where the server was started for them.
    assert not llama.serves(Capability.EMBEDDING, {}) and llama.serves(Capability.EMBEDDING, {"embedding": True})
    assert vllm.serves(Capability.EMBEDDING, {})
    assert not TRTLLM.serves(Capability.EMBEDDING, {})
    text = [a for a in adapters.ADAPTERS.values() if a.kind not in (RuntimeKind.WHISPERCPP, RuntimeKind.SDCPP)]
    assert all(a.serves(Capability.CHAT, {}) for a in text)
    with pytest.raises(KeyError):
        adapters.adapter_for(RuntimeKind.SIM, {})


def test_rerank_score_and_tokenizer_paths_are_served_where_each_runtime_documents_them() -> None:
    gated = [c for c in Capability if c.gated and not c.native and not c.media]
    assert {c.path for c in gated} == {"/v1/rerank", "/v1/score", "/tokenize", "/detokenize"}
    # Media is gated too: an LLM's replicas never get a transcription.
    assert all(c.gated for c in Capability if c.media)
    # vLLM serves every one (a pooling model's rerank and score; the runtime refuses them for others).
    assert all(adapters.serves(RuntimeKind.VLLM, {}, c) for c in gated)
    # llama-server: tokenize and detokenize always, rerank only started with --reranking, never score.
    assert adapters.serves(RuntimeKind.LLAMACPP, {}, Capability.TOKENIZE)
    assert adapters.serves(RuntimeKind.LLAMACPP, {}, Capability.DETOKENIZE)
    assert not adapters.serves(RuntimeKind.LLAMACPP, {}, Capability.RERANK)
    assert adapters.serves(RuntimeKind.LLAMACPP, {"reranking": True}, Capability.RERANK)
    assert not adapters.serves(RuntimeKind.LLAMACPP, {"reranking": True}, Capability.SCORE)
    launch = adapters.adapter_for(RuntimeKind.LLAMACPP, {}).launch("m", {"reranking": True}, [], 18000)
    assert "--reranking" in launch.command
    assert adapters.extra_args_refusals(RuntimeKind.LLAMACPP, {}, ["--rerank"])
    # llama-cpp-python's tokenizer is another path and shape; SGLang's and TensorRT-LLM's are not vLLM's.
    for kind, settings in ((RuntimeKind.LLAMACPP, {"server": "llama-cpp-python"}), (RuntimeKind.SGLANG, {})):
        assert not any(adapters.serves(kind, settings, c) for c in gated)
    assert not any(adapters.serves(RuntimeKind.TRTLLM, {}, c) for c in gated)
    # Chat, completions and embeddings are not gated: every replica gets them, as before.
    assert not any(c.gated for c in (Capability.CHAT, Capability.COMPLETION, Capability.EMBEDDING))


def test_the_sim_runtime_serves_what_its_serve_flag_names() -> None:
    assert adapters.sim_serves([]) == frozenset(c for c in Capability if c.gated and not c.native)
    assert adapters.sim_serves(["--ttft-ms", "5", "--serve", "tokenize,rerank"]) == {
        Capability.TOKENIZE,
        Capability.RERANK,
    }
    assert adapters.sim_serves(["--serve=none"]) == frozenset()
    assert adapters.sim_serves(["--serve", "chat"]) is None
    assert adapters.serves(RuntimeKind.SIM, {}, Capability.CHAT, command=["--serve", "none"])
    assert not adapters.serves(RuntimeKind.SIM, {}, Capability.SCORE, command=["--serve", "tokenize"])


def test_native_apis_are_served_from_the_release_each_adapter_records() -> None:
    assert adapters.serves(RuntimeKind.VLLM, {}, Capability.MESSAGES, version="0.11.0")
    assert adapters.serves(RuntimeKind.VLLM, {}, Capability.MESSAGE_TOKENS, version="v0.12.1")
    assert not adapters.serves(RuntimeKind.VLLM, {}, Capability.MESSAGES, version="0.10.2")
    assert adapters.serves(RuntimeKind.VLLM, {}, Capability.RESPONSES, version="0.10.0")
    assert not adapters.serves(RuntimeKind.VLLM, {}, Capability.RESPONSES, version="latest")  # no release: not assumed
    assert not any(adapters.serves(RuntimeKind.LLAMACPP, {}, c, version="9.9.9") for c in Capability if c.native)
    # The sim runtime serves them only when told to (its translated tests need it not to).
    assert not adapters.serves(RuntimeKind.SIM, {}, Capability.MESSAGES)
    assert adapters.serves(RuntimeKind.SIM, {}, Capability.RESPONSES, command=["--serve", "responses"])


def test_media_runtimes_record_the_media_apis_they_serve_from_their_own_docs() -> None:
    whisper = adapters.adapter_for(RuntimeKind.WHISPERCPP, {})
    # whisper.cpp's server transcribes at one path, set to OpenAI's; it is ready once /health answers 200.
    assert whisper.serves(Capability.TRANSCRIPTION, {}) and not whisper.serves(Capability.CHAT, {})
    assert not whisper.serves(Capability.TRANSLATION, {}) and whisper.readiness_path == "/health"
    launch = whisper.launch(
        "whisper-tiny", {"threads": 2}, gpus=[], port=18500, model_path="/models/whisper-tiny/model.bin"
    )
    assert launch.command[:1] == ["whisper-server"]
    assert launch.command[launch.command.index("--inference-path") + 1] == Capability.TRANSCRIPTION.path
    assert "--threads" in launch.command and "--model" in launch.command
    assert adapters.extra_args_refusals(RuntimeKind.WHISPERCPP, {}, ["--inference-path", "/x"])
    # Pinned to whisper.cpp's examples/server/server.cpp (v1.8.5, as pywhispercpp 1.5.1 vendors it; the
    # server tests/e2e/test_whisper_server.py builds): the flags its argument loop reads, `--host`
    # (127.0.0.1 by default, so nexa always gives it), `--port`, `--model`; flash attention is on by
    # default (`flash_attn = true`), so only `--no-flash-attn` turns it off.
    assert [launch.command[launch.command.index(f) + 1] for f in ("--port", "--model")] == [
        "18500",
        "/models/whisper-tiny/model.bin",
    ]
    assert "--host" in launch.command
    flags = {name: option.flag for name, option in whisper.options.items()}
    assert flags == {
        "threads": "--threads",
        "processors": "--processors",
        "language": "--language",
        "convert": "--convert",
        "no_gpu": "--no-gpu",
        "flash_attn": "--flash-attn",
        "no_flash_attn": "--no-flash-attn",
    }
    off = whisper.launch("w", {"no_flash_attn": True, "language": "auto"}, gpus=[], port=1, model_path="/m")
    assert "--no-flash-attn" in off.command and off.command[off.command.index("--language") + 1] == "auto"
    # vLLM serves Whisper's transcription and translation; the LLM servers no media.
    vllm = adapters.adapter_for(RuntimeKind.VLLM, {})
    assert vllm.serves(Capability.TRANSCRIPTION, {}) and vllm.serves(Capability.TRANSLATION, {})
    for kind in (RuntimeKind.SGLANG, RuntimeKind.LLAMACPP, RuntimeKind.TRTLLM):
        served = adapters.adapter_for(kind, {}).capabilities
        assert not any(c.media for c in served), kind


def test_vllm_keeps_responses_with_the_responses_store_setting_as_its_variable() -> None:
    """`settings.responses_store: true` is no flag but vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1
    (vllm/envs.py): the one switch that has it keep Responses API responses."""
    got = spark_spec(RuntimeKind.VLLM, {"responses_store": True})
    assert got.env == {**VLLM_ENV, "VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    assert "VLLM_ENABLE_RESPONSES_API_STORE" not in " ".join(got.command)
    assert spark_spec(RuntimeKind.VLLM, {"responses_store": False}).env == VLLM_ENV
    assert "VLLM_ENABLE_RESPONSES_API_STORE" not in VLLM.owned_flags()
    assert VLLM.problems({"responses_store": "yes"}, accelerators=1) == ["settings.responses_store: true or false"]
    # What the gateway reads per replica: the setting, or the variable given in the deployment's env.
    assert adapters.keeps_responses(RuntimeKind.VLLM, {"responses_store": True})
    assert adapters.keeps_responses(RuntimeKind.VLLM, {}, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    assert not adapters.keeps_responses(RuntimeKind.VLLM, {}, env={"VLLM_ENABLE_RESPONSES_API_STORE": "0"})
    assert not adapters.keeps_responses(RuntimeKind.VLLM, {})
    assert not adapters.keeps_responses(RuntimeKind.SGLANG, {}, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    # The sim runtime keeps them as vLLM does, by the same variable.
    assert adapters.keeps_responses(RuntimeKind.SIM, {}, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    assert not adapters.keeps_responses(RuntimeKind.SIM, {}, env={"VLLM_ENABLE_RESPONSES_API_STORE": "on"})
