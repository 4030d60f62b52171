"""Runtime adapters: how each model server is started, probed and read. Pure: no I/O, no trio.

One `Adapter` per model server. `adapter_for(kind, settings)` picks it: `vllm` (`vllm serve`),
`sglang` (`python3 -m sglang.launch_server`), `trtllm` (`trtllm-serve`), and for `llamacpp` two
variants chosen by the `server` setting: `llama-server` (llama.cpp's own C++ server, the default)
or `llama-cpp-python` (`python3 -m llama_cpp.server`, the Python bindings' server). Both variants
are the same runtime kind, so a node that allows `llamacpp` may run either; the image decides
which binary is there, the `server` setting tells the adapter which arguments it takes.

`Adapter.launch(...)` turns (the model's registered name, the deployment's settings, the
replica's CDI GPUs, its port, the model's path) into what goes into the signed `RuntimeSpec`:
command, env, the readiness probe and the shared-memory size. The model path is the artifact's
`ArtifactRef.model_path`: a manifest's directory, mounted read-only at `/models/<name>`, or its
entry file below it; for an artifact registered as one object, that file at `/models/model`.
vLLM (`vllm serve DIR`, the positional model its documentation gives; `--model` is accepted
too), SGLang (`--model-path DIR`) and TensorRT-LLM (`trtllm-serve DIR`: an engine or checkpoint
directory) take the directory; llama.cpp takes the entry file: a GGUF, or a split GGUF's first
shard, and the server opens the other shards from beside it. The runtime serves the model
under its registered name (the gateway sends `model = <name>`); it binds `RUNTIME_HOST`
(`{runtime_host}`), which the node replaces by its own runtime loopback address
(`runtimes.container_spec`), so the controller never needs to know it.

Unified memory. On a node whose accelerator memory is the host's pool (a GB10), the memory
placement reserved for a replica becomes the runtime's own limit: `Adapter.memory_limit` names
the setting that bounds it (vLLM `gpu_memory_utilization`, SGLang `mem_fraction_static`,
TensorRT-LLM `kv_cache_free_gpu_memory_fraction`; `contracts.placement.MemoryLimit` says how
each fraction is derived), and `launch` adds the derived value where the operator set none.

Each adapter records, as data: its readiness and metrics endpoints, which Prometheus series
give waiting requests, running requests, KV-cache use, the prefix-cache hit rate and the TTFT
and TPOT histograms (for routing, capacity and export; `metrics_for` picks them on a node), the
OpenAI-compatible paths it serves, and whether a stream ends with a usage chunk when asked
(`stream_options.include_usage`). All of them speak the OpenAI API, so the canonical request
maps 1:1 onto `/v1/completions`, `/v1/chat/completions` and `/v1/embeddings`, and usage is
read back from the response's `usage` object (streams: the last chunk's).

Settings are validated against the adapter's schema (`Adapter.problems`): an unknown name or
a value of the wrong type or range is a problem, and `settings_problems` lists them all. A
deployment's `extra_args` follow every flag nexa and the settings give, as written; the flags
nexa owns (`Adapter.owned_flags`: model, served name, host, port, parallelism, the memory bound,
a typed setting's flag, anything reaching a hub) are refused there (`extra_args_refusals`);
each runtime's caches go to the replica's writable cache (`nexa.adapter_args.CACHE_ENV`).
Flags and endpoints are from each project's documentation: vLLM "Engine arguments" and
"Production metrics"; SGLang "Server arguments" and "Production metrics"; TensorRT-LLM
"trtllm-serve"; llama.cpp `tools/server/README.md`; llama-cpp-python "OpenAI compatible server".
"""

from __future__ import annotations

import enum
import json
import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from nexa.adapter_args import (
    CACHE_ENV,
    LLAMA_CACHE_ENV,
    SGLANG_CACHE_ENV,
    VLLM_CACHE_ENV,
    WHY_AUTH,
    WHY_CONFIG_FILE,
    WHY_GPUS,
    WHY_HUB,
    WHY_MEMORY,
    WHY_TLS,
    extra_args_problems,
    is_value,
    spelling,
    version_at_least,
)
from nexa.contracts.gateway import Capability
from nexa.contracts.manifest import path_problem
from nexa.contracts.models import ImageConfig
from nexa.contracts.node import RuntimeKind
from nexa.contracts.placement import MemoryLimit, MemoryShare, RuntimeMemory
from nexa.contracts.runtime import RUNTIME_HOST, HealthProbe
from nexa.entrypoints import entrypoint_for

#: Where an artifact registered as one object is mounted (read-only), as assignments have had it
#: since the first release; a manifest's directory is mounted at `/models/<model name>`.
MODEL_PATH: Final = "/models/model"
#: The setting that picks the llama.cpp variant.
SERVER_SETTING: Final = "server"
LLAMA_SERVER: Final = "llama-server"
LLAMA_CPP_PYTHON: Final = "llama-cpp-python"
#: Shared memory for the GPU servers' worker processes (NCCL, torch IPC); podman's default is 64 MiB.
GPU_SHM_BYTES: Final = 8 * 2**30
#: Every adapter takes this setting: the container's /dev/shm size in bytes (0: podman's default).
SHM_SETTING: Final = "shm_bytes"
#: Model servers load from the mounted artifact and must never reach a hub for weights or tokenizers.
_OFFLINE_ENV: Final = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
#: A big model on a slow disk takes minutes to load: failures this long after start keep it `Starting`.
_START_PERIOD_S: Final = 600.0


class Style(enum.Enum):
    """How a setting becomes arguments."""

    #: `--flag value`.
    VALUE = "value"
    #: `--flag` when true, nothing when false (argparse `store_true`).
    SWITCH = "switch"
    #: `--flag true|false` (llama-cpp-python's pydantic settings).
    BOOLEAN = "boolean"
    #: `--flag <model directory>/<value>`: a file of the model's own directory (a chat template
    #: shipped with it), named relative to it; absolute paths and `..` are refused.
    MODEL_FILE = "model_file"


@attrs.frozen(kw_only=True)
class Option:
    """One runtime setting: its JSON type, bounds or choices, and the flag it becomes."""

    flag: str
    type: type[int] | type[float] | type[str] | type[bool]
    help: str
    style: Style = Style.VALUE
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()

    def problem(self, name: str, value: object) -> str | None:
        """Why `value` is not acceptable for this option, or None."""
        wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[self.type]
        reason = None
        if not self._typed(value):
            reason = wanted
        elif isinstance(value, int | float) and not isinstance(value, bool):
            if self.minimum is not None and value < self.minimum:
                reason = f"at least {self.minimum:g}"
            elif self.maximum is not None and value > self.maximum:
                reason = f"at most {self.maximum:g}"
        elif self.choices and value not in self.choices:
            reason = f"one of {', '.join(self.choices)}"
        elif isinstance(value, str) and (not value or value.startswith("-") or "\x00" in value):
            reason = "a non-empty value that does not start with '-'"
        elif isinstance(value, str) and self.style is Style.MODEL_FILE and (bad := path_problem(value)):
            reason = f"a path inside the model's directory ({bad})"
        return None if reason is None else f"settings.{name}: {reason}"

    def _typed(self, value: object) -> bool:
        """JSON types, strictly: `true` is no number, `1` no boolean, `1.5` no integer."""
        if isinstance(value, bool) or self.type is bool:
            return isinstance(value, bool) and self.type is bool
        if self.type is float:
            return isinstance(value, int | float) and math.isfinite(value)
        return isinstance(value, self.type)

    def args(self, value: object, *, model_dir: str = "") -> list[str]:
        if self.style is Style.SWITCH:
            return [self.flag] if value else []
        if self.style is Style.BOOLEAN:
            return [self.flag, "true" if value else "false"]
        if self.style is Style.MODEL_FILE:
            return [self.flag, f"{model_dir}/{value}"]
        return [self.flag, str(value)]


@attrs.frozen(kw_only=True)
class Metrics:
    """Where a runtime publishes its load, and which series feed routing and capacity (None: not exposed)."""

    path: str | None
    #: `prometheus` (text exposition) or `json` (TensorRT-LLM's per-iteration statistics).
    format: str = "prometheus"
    waiting: str | None = None
    running: str | None = None
    #: KV-cache use as a fraction 0..1; several names where versions renamed it (first found wins).
    kv_cache: tuple[str, ...] = ()
    #: Prefix-cache hits over lookups: (hits, queries) counter pairs, then gauges that give the
    #: ratio itself (first found wins, pairs before gauges).
    prefix_cache_counters: tuple[tuple[str, str], ...] = ()
    prefix_cache_ratio: tuple[str, ...] = ()
    #: Histograms (seconds) of time to first token and time per output token, by base name.
    ttft: tuple[str, ...] = ()
    tpot: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Launch:
    """What an adapter puts into one replica's `RuntimeSpec`."""

    command: list[str]
    env: dict[str, str]
    health: HealthProbe
    shm_bytes: int


@attrs.frozen(kw_only=True)
class Adapter:
    """One model server: its command line, settings schema, endpoints and what it can serve."""

    kind: RuntimeKind
    #: The variant's name (`vllm`, `sglang`, `trtllm`, `llama-server`, `llama-cpp-python`).
    name: str
    #: The program and its fixed first arguments.
    program: tuple[str, ...]
    #: The flag that names the model (None: the path is positional, right after `program`).
    model_flag: str | None
    served_name_flag: str
    host_flag: str
    port_flag: str
    #: Arguments always given (e.g. enabling the metrics endpoint).
    fixed: tuple[str, ...] = ()
    #: The setting and the arguments that spread a replica over its GPUs, given the GPU count.
    tensor_parallel_flag: str | None = None
    #: Arguments added when the replica has any GPU (offloading every layer).
    gpu_args: tuple[str, ...] = ()
    #: The replica must have at least one GPU.
    needs_gpu: bool = True
    options: Mapping[str, Option]
    env: Mapping[str, str] = attrs.field(factory=dict)
    default_shm_bytes: int = 0
    #: The HTTP path answering 200 once the model is loaded.
    readiness_path: str
    #: How the probe fetches it inside the image: `python` (urllib) or `curl`.
    probe_tool: str = "python"
    metrics: Metrics
    capabilities: frozenset[Capability]
    #: A capability that needs a setting (llama.cpp serves embeddings only with `embedding: true`).
    capability_settings: Mapping[Capability, str] = attrs.field(factory=dict)
    #: Streams end with a usage chunk when the request sets `stream_options.include_usage`.
    stream_usage: bool = True
    #: The setting (one of `options`) that bounds the server's memory on a unified-memory node,
    #: and what its fraction is a share of; None: the server has none (llama.cpp allocates what
    #: the model and its context need).
    memory_setting: str | None = None
    memory_share: MemoryShare = MemoryShare.POOL
    #: Flags `extra_args` may not give, besides those nexa sets itself (`owned_flags`), each with why.
    refused_flags: Mapping[str, str] = attrs.field(factory=dict)
    #: The server's parser takes a long flag's unambiguous prefix for it (Python's argparse does,
    #: click and llama.cpp's own parser do not), so a prefix of an owned flag is refused as well.
    abbreviates: bool = False
    #: The first release whose server takes `served_name_flag` (None: every release). Before it,
    #: the flag is left out and the server names the model after its directory, which nexa mounts
    #: at `/models/<model name>`.
    served_name_since: str | None = None

    def owned_flags(self) -> dict[str, str]:
        """Every flag `extra_args` may not give, with why: what nexa sets itself, the memory bound,
        the typed settings (set them as settings), and `refused_flags`."""
        owned = {option.flag: f"a typed setting: give settings.{name} instead" for name, option in self.options.items()}
        nexa_sets = {
            self.model_flag: "nexa gives the mounted model's path",
            self.served_name_flag: "nexa serves the model under its registered name",
            self.host_flag: "nexa binds the runtime to the node's runtime address",
            self.port_flag: "nexa gives each replica its port",
            self.tensor_parallel_flag: WHY_GPUS,
        }
        owned.update({flag: why for flag, why in nexa_sets.items() if flag is not None})
        if self.memory_setting is not None:
            owned[self.options[self.memory_setting].flag] = (
                f"it is the memory bound (set settings.{self.memory_setting}, or leave it to be derived)"
            )
        owned.update(self.refused_flags)
        return owned

    def flag_refusals(self, extra_args: Sequence[str]) -> list[tuple[str, str]]:
        """(flag, why) for each argument of `extra_args` that gives a flag nexa owns, as
        `--flag value`, `--flag=value`, with `_` for `-` or, where the parser abbreviates, a prefix."""
        owned = {spelling(flag): (flag, why) for flag, why in self.owned_flags().items()}
        known = {spelling(option.flag) for option in self.options.values()}
        out = []
        for arg in extra_args:
            if not arg.startswith("-") or is_value(arg):
                continue
            given = spelling(arg.partition("=")[0])
            hit = owned.get(given)
            if hit is None and self.abbreviates and given.startswith("--") and len(given) > 3 and given not in known:
                hit = next((owned[f] for f in sorted(owned) if f.startswith(given)), None)
            if hit is None and self.abbreviates and not given.startswith("--"):
                # argparse reads `-tp4` as `-tp 4`.
                hit = next((owned[f] for f in sorted(owned) if not f.startswith("--") and given.startswith(f)), None)
            if hit is not None:
                flag = arg.partition("=")[0]
                out.append((flag, hit[1] if spelling(hit[0]) == given else f"{hit[1]} (it is taken as {hit[0]})"))
        return out

    @property
    def overhead_bytes(self) -> int:
        """The engine's own memory beyond its share (`ENGINE_OVERHEAD_BYTES`)."""
        return ENGINE_OVERHEAD_BYTES.get(self.name, 0)

    def problems(self, settings: Mapping[str, object], *, accelerators: int) -> list[str]:
        """Everything wrong with `settings` (and the accelerator count) for this adapter."""
        out = []
        for name, value in sorted(settings.items()):
            if name == SERVER_SETTING and self.kind is RuntimeKind.LLAMACPP:
                continue
            if name == SHM_SETTING:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    out.append(f"settings.{SHM_SETTING}: 0 or more bytes (an integer)")
                continue
            option = self.options.get(name)
            if option is None:
                known = ", ".join(sorted([*self.options, SHM_SETTING]))
                out.append(f"settings.{name}: unknown option for {self.name} (known: {known})")
            elif problem := option.problem(name, value):
                out.append(problem)
        if self.needs_gpu and accelerators < 1:
            out.append(f"resources.accelerators: {self.name} needs at least 1 GPU")
        return out

    def serves(self, capability: Capability, settings: Mapping[str, object]) -> bool:
        """Whether a replica started with `settings` answers `capability`'s path."""
        if capability not in self.capabilities:
            return False
        needed = self.capability_settings.get(capability)
        return needed is None or settings.get(needed) is True

    def memory_limit(self, settings: Mapping[str, object], *, weights_bytes: int) -> MemoryLimit | None:
        """How this server is held to its reservation on a unified-memory node (None: it cannot
        be); `weights_bytes` approximates the weights (the model artifact's size)."""
        if self.memory_setting is None:
            return None
        value = settings.get(self.memory_setting)
        return MemoryLimit(
            setting=self.memory_setting,
            flag=self.options[self.memory_setting].flag,
            share_of=self.memory_share,
            operator_value=float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None,
            weights_bytes=weights_bytes,
        )

    def launch(
        self,
        served_name: str,
        settings: Mapping[str, object],
        gpus: Sequence[str],
        port: int,
        *,
        model_path: str = MODEL_PATH,
        memory: RuntimeMemory | None = None,
        extra_args: Sequence[str] = (),
        version: str = "",
        model_dir: str = "",
    ) -> Launch:
        """The command, env, probe and /dev/shm size of one replica (settings and `extra_args`
        already validated); `extra_args` come last, after every flag nexa and the settings give.

        `memory`: the replica's limit on a unified-memory node; a derived value is given as the
        setting would be had the operator set it (the operator's own value is in `settings`).
        `version`: the runtime's registered version (`served_name_since`). `model_dir`: where the
        model's directory is mounted, for settings naming one of its files (default `model_path`)."""
        if memory is not None and memory.derived and memory.value is not None and memory.setting in self.options:
            settings = {**settings, memory.setting: memory.value}
            if memory.batch is not None and memory.batch_setting in self.options:  # with a derived context
                settings = {memory.batch_setting: memory.batch, **settings}
        command = list(self.program)
        command += [model_path] if self.model_flag is None else [self.model_flag, model_path]
        if self.served_name_since is None or version_at_least(version, self.served_name_since):
            command += [self.served_name_flag, served_name]
        command += [self.host_flag, RUNTIME_HOST, self.port_flag, str(port)]
        command += self.fixed
        if gpus:
            command += self.gpu_args
            if self.tensor_parallel_flag is not None and len(gpus) > 1:
                command += [self.tensor_parallel_flag, str(len(gpus))]
        for name, value in sorted(settings.items()):
            if option := self.options.get(name):
                command += option.args(value, model_dir=model_dir or model_path)
        command += extra_args
        shm = settings.get(SHM_SETTING, self.default_shm_bytes)
        assert isinstance(shm, int)
        return Launch(command=command, env=dict(self.env), health=self.probe(port), shm_bytes=shm)

    def probe(self, port: int) -> HealthProbe:
        """GET the readiness path from inside the container, with what the image has."""
        url = f"http://{RUNTIME_HOST}:{port}{self.readiness_path}"
        if self.probe_tool == "curl":
            command = ["curl", "-fsS", "-o", "/dev/null", "--max-time", "5", url]
        else:
            command = ["python3", "-c", f"import urllib.request; urllib.request.urlopen({json.dumps(url)}, timeout=5)"]
        return HealthProbe(command=command, interval_s=2.0, timeout_s=6.0, start_period_s=_START_PERIOD_S, retries=3)


_DTYPES: Final = ("auto", "half", "float16", "bfloat16", "float32")
#: KV-cache types llama.cpp takes (common/arg.cpp `kv_cache_types`).
_GGML_KV_TYPES: Final = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: llama-server's short flags for typed settings (common/arg.cpp).
_LLAMA_SHORT: Final = {"-c": "ctx_size", "-b": "batch_size", "-ctk": "cache_type_k", "-ctv": "cache_type_v"}
_TEXT: Final = frozenset({Capability.COMPLETION, Capability.CHAT})
_ALL: Final = frozenset(Capability)

VLLM: Final = Adapter(
    kind=RuntimeKind.VLLM,
    name="vllm",
    program=("vllm", "serve"),
    model_flag=None,
    served_name_flag="--served-model-name",
    host_flag="--host",
    port_flag="--port",
    tensor_parallel_flag="--tensor-parallel-size",
    options={
        "max_model_len": Option(flag="--max-model-len", type=int, minimum=1, help="context length (tokens)"),
        "gpu_memory_utilization": Option(
            flag="--gpu-memory-utilization",
            type=float,
            minimum=0.05,
            maximum=1.0,
            help="share of GPU memory for weights and KV cache (set it below 1 on unified memory)",
        ),
        "max_num_seqs": Option(flag="--max-num-seqs", type=int, minimum=1, help="sequences per iteration"),
        "max_num_batched_tokens": Option(flag="--max-num-batched-tokens", type=int, minimum=1, help="tokens/step"),
        "dtype": Option(flag="--dtype", type=str, choices=_DTYPES, help="weight and activation type"),
        "kv_cache_dtype": Option(
            flag="--kv-cache-dtype", type=str, choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), help="KV cache type"
        ),
        "quantization": Option(flag="--quantization", type=str, help="quantization method (e.g. fp8, awq)"),
        "enable_prefix_caching": Option(flag="--enable-prefix-caching", type=bool, style=Style.SWITCH, help=""),
        "enforce_eager": Option(flag="--enforce-eager", type=bool, style=Style.SWITCH, help="no CUDA graphs"),
        "tokenizer": Option(flag="--tokenizer", type=str, help="tokenizer path inside the container"),
        "trust_remote_code": Option(flag="--trust-remote-code", type=bool, style=Style.SWITCH, help=""),
        # vllm/entrypoints/openai/cli_args.py (FrontendArgs).
        "enable_auto_tool_choice": Option(
            flag="--enable-auto-tool-choice", type=bool, style=Style.SWITCH, help="needs tool_call_parser"
        ),
        "tool_call_parser": Option(flag="--tool-call-parser", type=str, help="e.g. hermes, llama3_json, mistral"),
        "chat_template": Option(
            flag="--chat-template", type=str, style=Style.MODEL_FILE, help="a template file of the model's directory"
        ),
        # vllm/engine/arg_utils.py: StructuredOutputsConfig, ModelConfig and SchedulerConfig fields.
        "reasoning_parser": Option(flag="--reasoning-parser", type=str, help="e.g. deepseek_r1, qwen3"),
        "generation_config": Option(
            flag="--generation-config", type=str, help="auto (the model's), vllm (none), or a folder path"
        ),
        "stream_interval": Option(flag="--stream-interval", type=int, minimum=1, help="tokens per stream chunk"),
    },
    env={**_OFFLINE_ENV, "VLLM_NO_USAGE_STATS": "1", **VLLM_CACHE_ENV},
    abbreviates=True,
    refused_flags={"--model": "nexa gives the mounted model's path"}
    | dict.fromkeys(("-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp"), WHY_GPUS)
    | dict.fromkeys(("--download-dir", "--hf-token", "--revision", "--code-revision", "--tokenizer-revision"), WHY_HUB)
    | {"--api-key": WHY_AUTH}
    | dict.fromkeys(("--ssl-keyfile", "--ssl-certfile"), WHY_TLS)
    | {"--uds": "nexa reaches the runtime on its port"}
    | {"--kv-cache-memory-bytes": WHY_MEMORY}
    | {"--config": WHY_CONFIG_FILE},
    default_shm_bytes=GPU_SHM_BYTES,
    memory_setting="gpu_memory_utilization",
    readiness_path="/health",
    metrics=Metrics(
        path="/metrics",
        waiting="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        kv_cache=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        # V1 counts prompt tokens looked up and found; 0.8-0.9 had them as gpu_…; V0 a hit-rate gauge.
        prefix_cache_counters=(
            ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
            ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
        ),
        prefix_cache_ratio=("vllm:gpu_prefix_cache_hit_rate",),
        ttft=("vllm:time_to_first_token_seconds",),
        # Renamed to inter-token latency in later releases.
        tpot=("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    ),
    capabilities=_ALL,
)

SGLANG: Final = Adapter(
    kind=RuntimeKind.SGLANG,
    name="sglang",
    program=("python3", "-m", "sglang.launch_server"),
    model_flag="--model-path",
    served_name_flag="--served-model-name",
    host_flag="--host",
    port_flag="--port",
    fixed=("--enable-metrics",),
    tensor_parallel_flag="--tp-size",
    options={
        "context_length": Option(flag="--context-length", type=int, minimum=1, help="context length (tokens)"),
        "mem_fraction_static": Option(
            flag="--mem-fraction-static", type=float, minimum=0.05, maximum=1.0, help="share for weights + KV pool"
        ),
        "max_running_requests": Option(flag="--max-running-requests", type=int, minimum=1, help=""),
        "chunked_prefill_size": Option(flag="--chunked-prefill-size", type=int, minimum=-1, help="-1: off"),
        "dtype": Option(flag="--dtype", type=str, choices=_DTYPES, help="weight and activation type"),
        "kv_cache_dtype": Option(
            flag="--kv-cache-dtype", type=str, choices=("auto", "fp8_e4m3", "fp8_e5m2"), help="KV cache type"
        ),
        "quantization": Option(flag="--quantization", type=str, help="quantization method"),
        "is_embedding": Option(flag="--is-embedding", type=bool, style=Style.SWITCH, help="serve embeddings"),
        "tokenizer": Option(flag="--tokenizer-path", type=str, help="tokenizer path inside the container"),
        "trust_remote_code": Option(flag="--trust-remote-code", type=bool, style=Style.SWITCH, help=""),
        # python/sglang/srt/server_args.py (ServerArgs.add_cli_args).
        "tool_call_parser": Option(flag="--tool-call-parser", type=str, help="e.g. qwen25, llama3, mistral"),
        "reasoning_parser": Option(flag="--reasoning-parser", type=str, help="e.g. deepseek-r1, qwen3"),
        "chat_template": Option(
            flag="--chat-template", type=str, style=Style.MODEL_FILE, help="a template file of the model's directory"
        ),
        "stream_interval": Option(flag="--stream-interval", type=int, minimum=1, help="tokens per stream chunk"),
        "max_total_tokens": Option(flag="--max-total-tokens", type=int, minimum=1, help="KV pool size (tokens)"),
    },
    env={**_OFFLINE_ENV, **SGLANG_CACHE_ENV},
    abbreviates=True,
    refused_flags={"--model": "nexa gives the mounted model's path"}
    | dict.fromkeys(
        (
            "--tp",
            "--tensor-parallel-size",
            "--pp-size",
            "--pipeline-parallel-size",
            "--dp-size",
            "--data-parallel-size",
        ),
        WHY_GPUS,
    )
    | dict.fromkeys(("--download-dir", "--revision"), WHY_HUB)
    | {"--api-key": WHY_AUTH}
    | dict.fromkeys(("--ssl-keyfile", "--ssl-certfile"), WHY_TLS)
    | {"--config": WHY_CONFIG_FILE},
    default_shm_bytes=GPU_SHM_BYTES,
    readiness_path="/health",
    metrics=Metrics(
        path="/metrics",
        waiting="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv_cache=("sglang:token_usage",),
        prefix_cache_ratio=("sglang:cache_hit_rate",),
        ttft=("sglang:time_to_first_token_seconds",),
        tpot=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    ),
    capabilities=_ALL,
    capability_settings={Capability.EMBEDDING: "is_embedding"},
    memory_setting="mem_fraction_static",
)

TRTLLM: Final = Adapter(
    kind=RuntimeKind.TRTLLM,
    name="trtllm",
    program=("trtllm-serve",),
    model_flag=None,
    served_name_flag="--served_model_name",
    host_flag="--host",
    port_flag="--port",
    tensor_parallel_flag="--tp_size",
    options={
        "backend": Option(flag="--backend", type=str, choices=("pytorch", "tensorrt"), help="engine backend"),
        "max_batch_size": Option(flag="--max_batch_size", type=int, minimum=1, help="requests scheduled at once"),
        "max_num_tokens": Option(flag="--max_num_tokens", type=int, minimum=1, help="batched input tokens"),
        "max_seq_len": Option(flag="--max_seq_len", type=int, minimum=1, help="prompt + output tokens"),
        "kv_cache_free_gpu_memory_fraction": Option(
            flag="--kv_cache_free_gpu_memory_fraction", type=float, minimum=0.05, maximum=1.0, help="KV cache share"
        ),
        "tokenizer": Option(flag="--tokenizer", type=str, help="tokenizer path (for an engine directory)"),
        "trust_remote_code": Option(flag="--trust_remote_code", type=bool, style=Style.SWITCH, help=""),
        # tensorrt_llm/commands/serve.py (the `serve` command's click options).
        "max_beam_width": Option(flag="--max_beam_width", type=int, minimum=1, help="beams for beam search"),
        "reasoning_parser": Option(flag="--reasoning_parser", type=str, help="e.g. deepseek-r1, qwen3"),
        "tool_parser": Option(flag="--tool_parser", type=str, help="tool-call parser (recent releases)"),
        "enable_chunked_prefill": Option(flag="--enable_chunked_prefill", type=bool, style=Style.SWITCH, help=""),
        "chat_template": Option(
            flag="--chat_template", type=str, style=Style.MODEL_FILE, help="a template file of the model's directory"
        ),
    },
    env={**_OFFLINE_ENV, **CACHE_ENV},
    refused_flags=dict.fromkeys(
        ("--tensor_parallel_size", "--pp_size", "--pipeline_parallel_size", "--cp_size", "--context_parallel_size"),
        WHY_GPUS,
    )
    | {"--free_gpu_memory_fraction": WHY_MEMORY}
    | {"--revision": WHY_HUB}
    | dict.fromkeys(("--config", "--extra_llm_api_options"), WHY_CONFIG_FILE),
    # `--served_model_name` came with TensorRT-LLM 1.3.0rc7 (NVIDIA/TensorRT-LLM#11711, in the
    # v1.3.0rc7 release notes, 10 March 2026); before it the served name is the model directory's
    # base name (tensorrt_llm/serve/openai_server.py: `Path(model).name` for a directory).
    served_name_since="1.3.0rc7",
    default_shm_bytes=GPU_SHM_BYTES,
    readiness_path="/health",
    # trtllm-serve's /metrics (tensorrt_llm/serve/openai_server.py `get_iteration_stats`) is a JSON
    # list of the iteration statistics gathered since the last read (`get_stats_async(2)`), each the
    # executor's `IterationStats` as JSON: `numQueuedRequests` and `numActiveRequests` at the top,
    # `kvCacheStats.{usedNumBlocks,maxNumBlocks}`. With the PyTorch backend the list stays empty
    # unless `enable_iter_perf_stats` is set, and an idle engine adds none: then every figure is
    # unknown and routing counts the controller's own requests in flight.
    metrics=Metrics(
        path="/metrics",
        format="json",
        waiting="numQueuedRequests",
        running="numActiveRequests",
        kv_cache=("kvCacheStats.usedNumBlocks/maxNumBlocks",),
    ),
    capabilities=_TEXT,
    memory_setting="kv_cache_free_gpu_memory_fraction",
    memory_share=MemoryShare.FREE_AFTER_WEIGHTS,
)

LLAMA_SERVER_ADAPTER: Final = Adapter(
    kind=RuntimeKind.LLAMACPP,
    name=LLAMA_SERVER,
    program=("llama-server",),
    model_flag="--model",
    served_name_flag="--alias",
    host_flag="--host",
    port_flag="--port",
    fixed=("--metrics",),
    gpu_args=("--n-gpu-layers", "999"),
    needs_gpu=False,
    options={
        "ctx_size": Option(flag="--ctx-size", type=int, minimum=0, help="context length (0: the model's)"),
        "parallel": Option(flag="--parallel", type=int, minimum=1, help="slots (concurrent requests)"),
        "batch_size": Option(flag="--batch-size", type=int, minimum=1, help="logical batch size"),
        "threads": Option(flag="--threads", type=int, minimum=1, help="CPU threads"),
        "n_gpu_layers": Option(flag="--n-gpu-layers", type=int, minimum=0, help="layers on the GPU (999: all)"),
        "flash_attn": Option(flag="--flash-attn", type=str, choices=("on", "off", "auto"), help=""),
        "embedding": Option(flag="--embedding", type=bool, style=Style.SWITCH, help="serve /v1/embeddings only"),
        "pooling": Option(flag="--pooling", type=str, choices=("none", "mean", "cls", "last", "rank"), help=""),
        "chat_template": Option(flag="--chat-template", type=str, help="a built-in template name"),
        # common/arg.cpp (the options llama-server takes).
        "jinja": Option(flag="--jinja", type=bool, style=Style.SWITCH, help="the model's Jinja chat template"),
        "chat_template_file": Option(
            flag="--chat-template-file", type=str, style=Style.MODEL_FILE, help="a template file beside the model"
        ),
        "reasoning_format": Option(
            flag="--reasoning-format", type=str, choices=("none", "deepseek", "deepseek-legacy", "auto"), help=""
        ),
        "cont_batching": Option(flag="--cont-batching", type=bool, style=Style.SWITCH, help="(on by default)"),
        "cache_type_k": Option(flag="--cache-type-k", type=str, choices=_GGML_KV_TYPES, help="K cache type"),
        "cache_type_v": Option(flag="--cache-type-v", type=str, choices=_GGML_KV_TYPES, help="V cache type"),
    },
    env=dict(LLAMA_CACHE_ENV),
    refused_flags={"-m": "nexa gives the mounted model's path"}
    | {"-a": "nexa serves the model under its registered name"}
    | dict.fromkeys(
        (
            "-hf",
            "-hfr",
            "--hf-repo",
            "-hff",
            "--hf-file",
            "-hft",
            "--hf-token",
            "-hfd",
            "-hfrd",
            "--hf-repo-draft",
            "-mu",
            "--model-url",
            "-dr",
            "--docker-repo",
        ),
        WHY_HUB,
    )
    | dict.fromkeys(("--api-key", "--api-key-file"), WHY_AUTH)
    | dict.fromkeys(("--ssl-key-file", "--ssl-cert-file"), WHY_TLS)
    # The short spellings of the settings that size the KV cache (the context bounds its memory).
    | {f: f"a typed setting: give settings.{n} instead" for f, n in _LLAMA_SHORT.items()},
    readiness_path="/health",
    probe_tool="curl",
    metrics=Metrics(
        path="/metrics",
        waiting="llamacpp:requests_deferred",
        running="llamacpp:requests_processing",
        # As llama.cpp's tools/server/server-task.cpp names them (checked against the source the
        # llama-cpp-python 0.3.36 sdist vendors): `llamacpp:` + requests_processing, requests_deferred,
        # prompt_tokens_total, tokens_predicted_total, …. The KV-cache gauge is exported by older
        # builds only. No prefix-cache pair (cached prompt tokens are counted apart from the
        # processed ones, not as hits over lookups) and no latency histograms (token-rate gauges).
        kv_cache=("llamacpp:kv_cache_usage_ratio",),
    ),
    capabilities=_ALL,
    capability_settings={Capability.EMBEDDING: "embedding"},
)

LLAMA_CPP_PYTHON_ADAPTER: Final = Adapter(
    kind=RuntimeKind.LLAMACPP,
    name=LLAMA_CPP_PYTHON,
    program=("python3", "-m", "llama_cpp.server"),
    model_flag="--model",
    served_name_flag="--model_alias",
    host_flag="--host",
    port_flag="--port",
    gpu_args=("--n_gpu_layers", "-1"),
    needs_gpu=False,
    options={
        "n_ctx": Option(flag="--n_ctx", type=int, minimum=0, help="context length (0: the model's)"),
        "n_batch": Option(flag="--n_batch", type=int, minimum=1, help="prompt batch size"),
        "n_threads": Option(flag="--n_threads", type=int, minimum=1, help="CPU threads"),
        "n_gpu_layers": Option(flag="--n_gpu_layers", type=int, minimum=-1, help="layers on the GPU (-1: all)"),
        "embedding": Option(flag="--embedding", type=bool, style=Style.BOOLEAN, help="serve /v1/embeddings"),
        "chat_format": Option(flag="--chat_format", type=str, help="chat template name (default: the model's)"),
        "seed": Option(flag="--seed", type=int, minimum=0, help="sampling seed"),
        # llama_cpp/server/settings.py (ModelSettings).
        "n_ubatch": Option(flag="--n_ubatch", type=int, minimum=1, help="physical batch size"),
        "flash_attn": Option(flag="--flash_attn", type=bool, style=Style.BOOLEAN, help="flash attention"),
    },
    env=dict(LLAMA_CACHE_ENV),
    abbreviates=True,
    refused_flags=dict.fromkeys(("--hf_pretrained_model_name_or_path", "--hf_model_repo_id"), WHY_HUB)
    | {"--api_key": WHY_AUTH}
    | dict.fromkeys(("--ssl_keyfile", "--ssl_certfile"), WHY_TLS)
    | {"--config_file": WHY_CONFIG_FILE}
    | dict.fromkeys(("--type_k", "--type_v"), "the KV cache's type sizes the context nexa derives (f16 is taken)"),
    # /v1/models answers once the model is loaded (the server loads it before listening).
    readiness_path="/v1/models",
    # No metrics endpoint: routing falls back to the gateway's own in-flight counts.
    metrics=Metrics(path=None),
    capabilities=_ALL,
    capability_settings={Capability.EMBEDDING: "embedding"},
    # 0.3.x ignores `stream_options`: a stream carries no usage chunk (count from the chunks instead).
    stream_usage=False,
)

ADAPTERS: Final[Mapping[RuntimeKind, Adapter]] = {
    RuntimeKind.VLLM: VLLM,
    RuntimeKind.SGLANG: SGLANG,
    RuntimeKind.TRTLLM: TRTLLM,
    RuntimeKind.LLAMACPP: LLAMA_SERVER_ADAPTER,
}
LLAMACPP_VARIANTS: Final[Mapping[str, Adapter]] = {
    LLAMA_SERVER: LLAMA_SERVER_ADAPTER,
    LLAMA_CPP_PYTHON: LLAMA_CPP_PYTHON_ADAPTER,
}


#: Each engine's own memory beyond the share its memory setting bounds (the CUDA context, CUDA
#: graphs, activations and sampler buffers; llama.cpp's compute buffers), by adapter name. Placement
#: reserves it on top of a replica's memory (`Adapter.overhead_bytes`); a deployment's
#: `resources.overhead_bytes` replaces it.
ENGINE_OVERHEAD_BYTES: Final[Mapping[str, int]] = {
    "vllm": 2 * 1024**3,
    "sglang": 2 * 1024**3,
    "trtllm": 2 * 1024**3,
    LLAMA_SERVER: 1024**3,
    LLAMA_CPP_PYTHON: 1024**3,
}


#: The `sim` runtime (`nexa sim-runtime`) exports vLLM's names.
SIM_METRICS: Final = VLLM.metrics


def image_runs(kind: RuntimeKind, config: ImageConfig | None) -> list[tuple[str, list[str]]]:
    """What a replica of `kind` runs in the image `config` describes, for each of its adapter's
    variants: (the variant, the process: entrypoint, then the program's fixed arguments and `…`)."""
    if not has_adapter(kind):
        return []
    variants = LLAMACPP_VARIANTS.values() if kind is RuntimeKind.LLAMACPP else [ADAPTERS[kind]]
    out = []
    for variant in variants:
        split = entrypoint_for([*variant.program, "…"], config)
        out.append((variant.name, [*split.entrypoint, *split.command]))
    return out


def metrics_for(kind: RuntimeKind, process: Sequence[str]) -> Metrics:
    """Where a replica of `kind`, running `process` (entrypoint and command), publishes its load: the
    node knows the signed spec only, so the llama.cpp variant is told from its program, by name or
    path, first or after an exec wrapper (llama-server's otherwise)."""
    if kind is RuntimeKind.SIM:
        return SIM_METRICS
    if kind is RuntimeKind.LLAMACPP:
        for variant in LLAMACPP_VARIANTS.values():
            first, rest = variant.program[0], variant.program[1:]
            for at in range(min(2, len(process))):
                if (
                    posixpath.basename(process[at]) == first
                    and tuple(process[at + 1 : at + len(variant.program)]) == rest
                ):
                    return variant.metrics
    adapter = ADAPTERS.get(kind)
    return adapter.metrics if adapter is not None else Metrics(path=None)


def has_adapter(kind: RuntimeKind) -> bool:
    """Every kind but `sim` (a local process the node's simulation driver runs) has an adapter."""
    return kind in ADAPTERS


def adapter_for(kind: RuntimeKind, settings: Mapping[str, object]) -> Adapter:
    """The adapter for `kind`; for `llamacpp` the `server` setting's variant (default `llama-server`).
    Raises KeyError for `sim` and ValueError for an unknown variant (see `settings_problems`)."""
    if kind is RuntimeKind.LLAMACPP and SERVER_SETTING in settings:
        variant = settings[SERVER_SETTING]
        if not isinstance(variant, str) or variant not in LLAMACPP_VARIANTS:
            raise ValueError(f"unknown llama.cpp server {variant!r}")
        return LLAMACPP_VARIANTS[variant]
    return ADAPTERS[kind]


def settings_problems(
    kind: RuntimeKind,
    settings: Mapping[str, object],
    *,
    accelerators: int,
    command: Sequence[str] = (),
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Everything wrong with a deployment's runtime settings and `extra_args` for `kind` (the
    flags `extra_args` may not give are `extra_args_refusals`', a 422 of their own).

    `sim` takes no settings. A non-empty `command` replaces the adapter's command line entirely
    (the operator's escape hatch), so settings or extra_args beside it would be silently
    ignored: refused.
    """
    if not has_adapter(kind):
        return [f"settings.{name}: the {kind} runtime takes no settings" for name in sorted(settings)] + (
            [f"extra_args: the {kind} runtime takes its flags from command"] if extra_args else []
        )
    if command and (settings or extra_args):
        return ["settings, extra_args: give settings and extra_args, or a full command, not both"]
    if problems := extra_args_problems(extra_args):
        return problems
    if kind is RuntimeKind.LLAMACPP and SERVER_SETTING in settings:
        variant = settings[SERVER_SETTING]
        if not isinstance(variant, str) or variant not in LLAMACPP_VARIANTS:
            return [f"settings.{SERVER_SETTING}: one of {', '.join(LLAMACPP_VARIANTS)}"]
    problems = adapter_for(kind, settings).problems(settings, accelerators=accelerators)
    if command:
        # A full command says nothing the adapter could check about GPUs: the operator owns it.
        problems = [p for p in problems if not p.startswith("resources.")]
    return problems


def model_file_problems(kind: RuntimeKind, settings: Mapping[str, object], files: Sequence[str] | None) -> list[str]:
    """Each setting naming a file of the model's directory (`Style.MODEL_FILE`) whose file the
    model version does not have; `files`: the manifest's paths, None for a model registered as one
    object (no directory to hold one)."""
    if not has_adapter(kind):
        return []
    try:
        adapter = adapter_for(kind, settings)
    except ValueError:
        return []
    out = []
    for name, value in sorted(settings.items()):
        option = adapter.options.get(name)
        if option is None or option.style is not Style.MODEL_FILE or not isinstance(value, str):
            continue
        if files is None:
            out.append(f"settings.{name}: the model is one file, not a directory; register it as a manifest")
        elif value not in files:
            out.append(f"settings.{name}: the model version has no file {value!r} (its manifest lists {len(files)})")
    return out


def extra_args_refusals(kind: RuntimeKind, settings: Mapping[str, object], extra_args: Sequence[str]) -> list[str]:
    """Each argument of `extra_args` that gives a flag nexa owns, as `FLAG: why` (see
    `Adapter.flag_refusals`); empty for `sim` and for a llama.cpp variant that does not exist
    (`settings_problems` says so)."""
    if not has_adapter(kind) or not extra_args:
        return []
    try:
        adapter = adapter_for(kind, settings)
    except ValueError:
        return []
    return [f"{flag}: {why}" for flag, why in adapter.flag_refusals(extra_args)]
