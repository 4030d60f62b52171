"""The runtime adapters' common part: `Adapter` (one model server's command line, settings schema,
endpoints and what it can serve), its `Option`s, `Metrics` and `Launch`. Pure: no I/O, no trio.

Each model server family is one module of this package that builds its `Adapter` from these
(`vllm`, `sglang`, `trtllm`, `llamacpp`); the package (`nexa.adapters`) picks one (`adapter_for`).
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Final, TypeGuard

import attrs

from nexa.adapters.args import WHY_GPUS, is_value, spelling, version_at_least
from nexa.contracts.capabilities import Capability
from nexa.contracts.manifest import path_problem
from nexa.contracts.memory import MemoryLimit, MemoryShare, RuntimeMemory
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import RUNTIME_HOST, HealthProbe

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
#: The parallel sizes, settings of the adapters whose server takes them (`tensor_parallel_flag`,
#: `pipeline_parallel_flag`). Unset, a replica is tensor parallel over all its GPUs, on every node
#: of its group (NVIDIA's DGX Spark playbooks run TP 2 over two Sparks); set, their product must be
#: the replica's GPUs (per node, times its nodes).
TENSOR_PARALLEL_SETTING: Final = "tensor_parallel_size"
PIPELINE_PARALLEL_SETTING: Final = "pipeline_parallel_size"
MAX_PARALLEL: Final = 1024
#: Model servers load from the mounted artifact and must never reach a hub for weights or tokenizers.
OFFLINE_ENV: Final = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
#: The weight and activation types vLLM and SGLang take (`--dtype`).
DTYPES: Final = ("auto", "half", "float16", "bfloat16", "float32")
#: A big model on a slow disk takes minutes to load: failures this long after start keep it `Starting`.
_START_PERIOD_S: Final = 600.0
#: One word of a `Style.WORDS` setting.
_WORD: Final = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*")


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
    #: No argument: `flag` names an environment variable set to `1` when true (nothing when false),
    #: for a server switched on by its environment (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE`).
    ENV = "env"
    #: `--flag word word …`: a string of space-separated words, each its own argument (argparse
    #: `nargs`; SGLang's `--lora-target-modules q_proj v_proj`). Each word is letters, digits, `_`,
    #: `.` or `-`, and none starts with `-`.
    WORDS = "words"


@attrs.frozen(kw_only=True)
class Option:
    """One runtime setting: its JSON type, bounds or choices, and the flag it becomes."""

    flag: str
    type: type[int] | type[float] | type[str] | type[bool]
    help: str
    style: Style = Style.VALUE
    minimum: float | None = None
    maximum: float | None = None
    #: The values it takes, where the server takes only some (strings, or integers for an int).
    choices: tuple[str | int, ...] = ()

    def problem(self, name: str, value: object) -> str | None:
        """Why `value` is not acceptable for this option, or None."""
        wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[self.type]
        reason = None
        if not self._typed(value):
            reason = wanted
        elif _number(value) and self.minimum is not None and value < self.minimum:
            reason = f"at least {self.minimum:g}"
        elif _number(value) and self.maximum is not None and value > self.maximum:
            reason = f"at most {self.maximum:g}"
        elif self.choices and value not in self.choices:
            reason = f"one of {', '.join(map(str, self.choices))}"
        elif isinstance(value, str) and (not value or value.startswith("-") or "\x00" in value):
            reason = "a non-empty value that does not start with '-'"
        elif isinstance(value, str) and self.style is Style.MODEL_FILE and (bad := path_problem(value)):
            reason = f"a path inside the model's directory ({bad})"
        elif isinstance(value, str) and self.style is Style.WORDS and not _words(value):
            reason = "space-separated words of letters, digits, '_', '.' or '-', none starting with '-'"
        return None if reason is None else f"settings.{name}: {reason}"

    def _typed(self, value: object) -> bool:
        """JSON types, strictly: `true` is no number, `1` no boolean, `1.5` no integer."""
        if isinstance(value, bool) or self.type is bool:
            return isinstance(value, bool) and self.type is bool
        if self.type is float:
            return isinstance(value, int | float) and math.isfinite(value)
        return isinstance(value, self.type)

    def args(self, value: object, *, model_dir: str = "") -> list[str]:
        if self.style is Style.ENV:
            return []
        if self.style is Style.SWITCH:
            return [self.flag] if value else []
        if self.style is Style.BOOLEAN:
            return [self.flag, "true" if value else "false"]
        if self.style is Style.MODEL_FILE:
            return [self.flag, f"{model_dir}/{value}"]
        if self.style is Style.WORDS:
            return [self.flag, *str(value).split()]
        return [self.flag, str(value)]


def _number(value: object) -> TypeGuard[int | float]:
    """Whether `value` is a JSON number (a boolean is none)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _words(value: str) -> bool:
    """Whether `value` is one or more `Style.WORDS` words."""
    words = value.split()
    return bool(words) and all(_WORD.fullmatch(w) for w in words)


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """Whether `env` switches `name` on as vLLM reads its flags (`bool(int(value))`; not an integer: off)."""
    try:
        return bool(int(env.get(name, "0")))
    except ValueError:
        return False


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
class NativeSleep:
    """A runtime's own sleep: it keeps its process (and its container) and releases its
    accelerator memory on `sleep_path`, and takes it back on `wake_path`; `state_path` answers
    `{"is_sleeping": bool}`. Enabled by `flag` in the replica's command (an operator gives it in
    `extra_args`, or in a `sim` runtime's `command`); `env` is what the server needs besides."""

    flag: str
    #: Set in the container's environment when `flag` is given (vLLM serves the routes only then).
    env: Mapping[str, str] = attrs.field(factory=dict)
    sleep_path: str
    wake_path: str
    state_path: str
    #: The first release whose server answers the routes.
    since: str
    #: What a sleeping replica really releases, for placement: nothing is counted free while the
    #: weights stay in the node's memory (see `nexa/docs/deployments.md`).
    releases: str


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
    #: None: the server takes no name for its model (whisper.cpp's; it answers whatever `model` says).
    served_name_flag: str | None
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
    #: How the probe fetches it inside the image: `python` (urllib), `curl`, or `bash` (bash's own
    #: `/dev/tcp` under coreutils' `timeout`: for images with neither, such as stable-diffusion.cpp's).
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
    #: The flag of the pipeline parallel size (`PIPELINE_PARALLEL_SETTING`); None: the server has none.
    pipeline_parallel_flag: str | None = None
    #: Settings that shape the command of a replica group's other ranks rather than the server's
    #: own flags (llama.cpp: the RPC server's program); checked with the rest, never rendered as flags.
    group_settings: Mapping[str, Option] = attrs.field(factory=dict)
    #: APIs besides chat, completions and embeddings the server answers itself, by path, with the
    #: first release serving each (from its own source). The gateway passes `/v1/messages`,
    #: `/v1/messages/count_tokens` and `/v1/responses` through to such a runtime when every Ready
    #: replica of the model has one (`control/datapath/native.py`), and translates them otherwise.
    native_apis: Mapping[str, str] = attrs.field(factory=dict)
    #: The server's own sleep and wake (None: it has none; a sleeping replica's container stops).
    native_sleep: NativeSleep | None = None
    #: The setting (one of `options`, `Style.ENV`) that has the server keep Responses API responses
    #: (`store`, `previous_response_id`) in its memory; None: it never keeps them. The gateway routes
    #: a request continuing a stored response to the replica that keeps it (`keeps_responses`).
    responses_store: str | None = None

    def keeps_responses(self, settings: Mapping[str, object], env: Mapping[str, str] | None = None) -> bool:
        """Whether a replica started with `settings` and the deployment's `env` keeps Responses API
        responses: the `responses_store` setting true, or its variable given in `env` as the server
        reads it (an integer, not 0)."""
        if self.responses_store is None:
            return False
        variable = self.options[self.responses_store].flag
        return settings.get(self.responses_store) is True or env_flag(env or {}, variable)

    def owned_flags(self) -> dict[str, str]:
        """Every flag `extra_args` may not give, with why: what nexa sets itself, the memory bound,
        the typed settings (set them as settings), and `refused_flags`."""
        owned = {
            option.flag: f"a typed setting: give settings.{name} instead"
            for name, option in self.options.items()
            if option.style is not Style.ENV
        }
        nexa_sets = {
            self.model_flag: "nexa gives the mounted model's path",
            self.served_name_flag: "nexa serves the model under its registered name",
            self.host_flag: "nexa binds the runtime to the node's runtime address",
            self.port_flag: "nexa gives each replica its port",
            self.tensor_parallel_flag: f"{WHY_GPUS} (or give settings.{TENSOR_PARALLEL_SETTING})",
            self.pipeline_parallel_flag: f"{WHY_GPUS} (or give settings.{PIPELINE_PARALLEL_SETTING})",
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
        known = {spelling(option.flag) for option in self.options.values() if option.style is not Style.ENV}
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

    def problems(self, settings: Mapping[str, object], *, accelerators: int, nodes: int = 1) -> list[str]:
        """Everything wrong with `settings` (and the accelerator count, per node of the replica's
        `nodes`) for this adapter."""
        out = []
        parallel = self.parallel_options()
        for name, value in sorted(settings.items()):
            if name == SERVER_SETTING and self.kind is RuntimeKind.LLAMACPP:
                continue
            if name == SHM_SETTING:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    out.append(f"settings.{SHM_SETTING}: 0 or more bytes (an integer)")
                continue
            option = self.options.get(name) or parallel.get(name) or self.group_settings.get(name)
            if option is None:
                known = ", ".join(sorted([*self.options, *parallel, *self.group_settings, SHM_SETTING]))
                out.append(f"settings.{name}: unknown option for {self.name} (known: {known})")
            elif problem := option.problem(name, value):
                out.append(problem)
        if self.needs_gpu and accelerators < 1:
            out.append(f"resources.accelerators: {self.name} needs at least 1 GPU")
        given = [name for name in parallel if name in settings]
        if given and not out and accelerators >= 1:
            tp, pp = self.parallel_sizes(settings, gpus=accelerators, nodes=nodes)
            if tp * pp != accelerators * nodes:
                out.append(
                    f"settings.{', settings.'.join(given)}: tensor x pipeline parallel ({tp} x {pp}) must be the "
                    f"replica's {accelerators * nodes} GPUs ({accelerators} per node on {nodes} node(s))"
                )
        return out

    def parallel_options(self) -> dict[str, Option]:
        """The parallel-size settings this server takes (its flag for each)."""
        out = {}
        for name, flag in (
            (TENSOR_PARALLEL_SETTING, self.tensor_parallel_flag),
            (PIPELINE_PARALLEL_SETTING, self.pipeline_parallel_flag),
        ):
            if flag is not None:
                out[name] = Option(flag=flag, type=int, minimum=1, maximum=MAX_PARALLEL, help="parallel size")
        return out

    def parallel_sizes(self, settings: Mapping[str, object], *, gpus: int, nodes: int = 1) -> tuple[int, int]:
        """(tensor, pipeline) parallel sizes of a replica with `gpus` GPUs on each of its `nodes`:
        the settings' where given, else every GPU of the replica in tensor parallel (divided by the
        pipeline size where only that is given)."""
        pp = settings.get(PIPELINE_PARALLEL_SETTING, 1)
        pp = pp if isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 else 1
        tp = settings.get(TENSOR_PARALLEL_SETTING)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            tp = max(1, (gpus * nodes) // pp)
        return tp, pp

    def serves(self, capability: Capability, settings: Mapping[str, object], version: str = "") -> bool:
        """Whether a replica started with `settings` answers `capability`'s path; an API it serves
        natively (`native_apis`) from the release given there, `version` being the runtime's."""
        if capability.native:
            first = self.native_apis.get(capability.path)
            return first is not None and version_at_least(version, first)
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
        nodes: int = 1,
    ) -> Launch:
        """The command, env, probe and /dev/shm size of one replica (settings and `extra_args`
        already validated); `extra_args` come last, after every flag nexa and the settings give.

        `memory`: the replica's limit on a unified-memory node; a derived value is given as the
        setting would be had the operator set it (the operator's own value is in `settings`).
        `version`: the runtime's registered version (`served_name_since`). `model_dir`: where the
        model's directory is mounted, for settings naming one of its files (default `model_path`).
        `nodes`: the replica's nodes (a group's size), over which the parallel sizes spread."""
        if memory is not None and memory.derived and memory.value is not None and memory.setting in self.options:
            settings = {**settings, memory.setting: memory.value}
            if memory.batch is not None and memory.batch_setting in self.options:  # with a derived context
                settings = {memory.batch_setting: memory.batch, **settings}
        command = list(self.program)
        command += [model_path] if self.model_flag is None else [self.model_flag, model_path]
        named = self.served_name_since is None or version_at_least(version, self.served_name_since)
        if self.served_name_flag is not None and named:
            command += [self.served_name_flag, served_name]
        command += [self.host_flag, RUNTIME_HOST, self.port_flag, str(port)]
        command += self.fixed
        if gpus:
            command += self.gpu_args
            tp, pp = self.parallel_sizes(settings, gpus=len(gpus), nodes=nodes)
            if self.tensor_parallel_flag is not None and tp > 1:
                command += [self.tensor_parallel_flag, str(tp)]
            if self.pipeline_parallel_flag is not None and pp > 1:
                command += [self.pipeline_parallel_flag, str(pp)]
        for name, value in sorted(settings.items()):
            if option := self.options.get(name):
                command += option.args(value, model_dir=model_dir or model_path)
        command += extra_args
        shm = settings.get(SHM_SETTING, self.default_shm_bytes)
        assert isinstance(shm, int)
        env = dict(self.env)
        env.update(
            {o.flag: "1" for name, o in self.options.items() if o.style is Style.ENV and settings.get(name) is True}
        )
        if self.native_sleep is not None and self.native_sleep.flag in extra_args:
            env.update(self.native_sleep.env)
        return Launch(command=command, env=env, health=self.probe(port), shm_bytes=shm)

    def probe(self, port: int) -> HealthProbe:
        """GET the readiness path from inside the container, with what the image has."""
        url = f"http://{RUNTIME_HOST}:{port}{self.readiness_path}"
        if self.probe_tool == "curl":
            command = ["curl", "-fsS", "-o", "/dev/null", "--max-time", "5", url]
        elif self.probe_tool == "bash":
            command = bash_probe(port, self.readiness_path)
        else:
            command = ["python3", "-c", f"import urllib.request; urllib.request.urlopen({json.dumps(url)}, timeout=5)"]
        return HealthProbe(command=command, interval_s=2.0, timeout_s=6.0, start_period_s=_START_PERIOD_S, retries=3)


def bash_probe(port: int, path: str) -> list[str]:
    """A readiness probe needing only bash and coreutils: GET `path` over bash's `/dev/tcp`, as
    HTTP/1.0 (no chunked answer), passing on a `200` status line. `timeout` bounds the whole
    exchange (connect included) at 5 s and `read -n 64` the bytes read, so a slow or endless answer
    fails the probe inside the container; nothing of the answer but its status line is read."""
    script = (
        f"exec 3<>/dev/tcp/{RUNTIME_HOST}/{port} || exit 1\n"
        f"printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' >&3 || exit 1\n"
        "IFS= read -r -n 64 line <&3 || exit 1\n"
        'case $line in "HTTP/1."[01]" 200 "* | "HTTP/1."[01]" 200"$\'\\r\') exit 0 ;; esac\n'
        "exit 1\n"
    )
    return ["timeout", "5", "bash", "-c", script]


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
    # stable-diffusion.cpp's compute buffers (the UNet's, the VAE decode's: the largest, at the
    # image's full size unless `vae_tiling`), beyond the checkpoint's own bytes. An estimate, not
    # measured here: a deployment's `resources.overhead_bytes` replaces it.
    "sd-server": 2 * 1024**3,
}
