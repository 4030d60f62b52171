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
(`nexa.container_spec`), so the controller never needs to know it.

Unified memory. On a node whose accelerator memory is the host's pool (a GB10), the memory
placement reserved for a replica becomes the runtime's own limit: `Adapter.memory_limit` names
the setting that bounds it (vLLM `gpu_memory_utilization`, SGLang `mem_fraction_static`,
TensorRT-LLM `kv_cache_free_gpu_memory_fraction`; `contracts.placement.MemoryLimit` says how
each fraction is derived), and `launch` adds the derived value where the operator set none.

Each adapter records, as data: its readiness and metrics endpoints, which Prometheus series
give waiting requests, running requests, KV-cache use, the prefix-cache hit rate and the TTFT
and TPOT histograms (for routing, capacity and export; `metrics_for` picks them on a node), the
OpenAI-compatible paths it serves (`capabilities`: text, and the media routes — transcription,
translation, speech, images — a server answers itself), and whether a stream ends with a usage chunk when asked
(`stream_options.include_usage`). All of them speak the OpenAI API, so the canonical request
maps 1:1 onto `/v1/completions`, `/v1/chat/completions` and `/v1/embeddings`, and usage is
read back from the response's `usage` object (streams: the last chunk's).

Settings are validated against the adapter's schema (`Adapter.problems`): an unknown name or
a value of the wrong type or range is a problem, and `settings_problems` lists them all. A
deployment's `extra_args` follow every flag nexa and the settings give, as written; the flags
nexa owns (`Adapter.owned_flags`: model, served name, host, port, parallelism, the memory bound,
a typed setting's flag, anything reaching a hub) are refused there (`extra_args_refusals`);
each runtime's caches go to the replica's writable cache (`args.CACHE_ENV`).
Flags and endpoints are from each project's documentation: vLLM "Engine arguments" and
"Production metrics"; SGLang "Server arguments" and "Production metrics"; TensorRT-LLM
"trtllm-serve"; llama.cpp `tools/server/README.md`; llama-cpp-python "OpenAI compatible server";
the media runtimes' from their servers' source (cited in `whispercpp` and `sdcpp`).

The package, one module per job (each imports only those below it in this list): this module,
the catalog (`ADAPTERS`, `adapter_for` and the checks made through it); one module per model
server family, `vllm`, `sglang`, `trtllm`, `llamacpp` (both variants) and the media runtimes
`whispercpp` (whisper.cpp's `whisper-server`, speech to text) and `sdcpp` (stable-diffusion.cpp's
`sd-server`, text to image); `base`, the `Adapter`
they are built from; `args` (caches, `extra_args` limits, flag spelling, versions) and
`entrypoints` (which image entrypoint a command runs behind). `groups` (each rank's command line in
a replica group over several nodes) sits between the families and this module. "Runtime adapters" names this
package only; the container spec a node creates from a signed assignment is `nexa.container_spec`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Final

from nexa.adapters.args import extra_args_problems
from nexa.adapters.base import SERVER_SETTING, Adapter, Metrics, NativeSleep, Style, env_flag
from nexa.adapters.entrypoints import entrypoint_for
from nexa.adapters.groups import group_problems
from nexa.adapters.llamacpp import LLAMA_SERVER_ADAPTER, LLAMACPP_VARIANTS
from nexa.adapters.sdcpp import SD_SERVER
from nexa.adapters.sglang import SGLANG
from nexa.adapters.trtllm import TRTLLM
from nexa.adapters.vllm import RESPONSES_STORE_ENV, VLLM
from nexa.adapters.whispercpp import WHISPER_SERVER
from nexa.contracts.capabilities import Capability
from nexa.contracts.models import ImageConfig
from nexa.contracts.node import RuntimeKind

#: The adapter of each runtime kind but `sim`; for `llamacpp` its default variant (`LLAMACPP_VARIANTS`).
ADAPTERS: Final[Mapping[RuntimeKind, Adapter]] = {
    RuntimeKind.VLLM: VLLM,
    RuntimeKind.SGLANG: SGLANG,
    RuntimeKind.TRTLLM: TRTLLM,
    RuntimeKind.LLAMACPP: LLAMA_SERVER_ADAPTER,
    RuntimeKind.WHISPERCPP: WHISPER_SERVER,
    RuntimeKind.SDCPP: SD_SERVER,
}


#: The `sim` runtime (`nexa sim-runtime`) exports vLLM's names.
SIM_METRICS: Final = VLLM.metrics
#: The `sim` runtime's flag naming the gated capabilities (`Capability.gated`) it serves,
#: comma-separated, or `none`; without it, rerank, score, tokenize, detokenize and the media APIs. The
#: native APIs (`messages`, `responses`, `message_tokens`: vLLM's own) only when named.
SIM_SERVE_FLAG: Final = "--serve"


def sim_serves(command: Sequence[str]) -> frozenset[Capability] | None:
    """The gated capabilities a `sim` runtime started with `command` serves (`SIM_SERVE_FLAG`);
    None when its value names something else (the sim runtime refuses to start then)."""
    value = None
    for at, arg in enumerate(command):
        if arg == SIM_SERVE_FLAG and at + 1 < len(command):
            value = command[at + 1]
        elif arg.startswith(SIM_SERVE_FLAG + "="):
            value = arg.partition("=")[2]
    gated = {c.value: c for c in Capability if c.gated}
    if value is None:
        return frozenset(c for c in gated.values() if not c.native)
    if value == "none":
        return frozenset()
    names = value.split(",")
    if not all(name in gated for name in names):
        return None
    return frozenset(gated[name] for name in names)


def serves(
    kind: RuntimeKind,
    settings: Mapping[str, object],
    capability: Capability,
    *,
    command: Sequence[str] = (),
    version: str = "",
) -> bool:
    """Whether a replica of `kind` release `version` started with `settings` (or, for `sim`,
    `command`) answers `capability`'s path: what its adapter records (`Adapter.serves`)."""
    if kind is RuntimeKind.SIM:
        return not capability.gated or capability in (sim_serves(command) or ())
    try:
        adapter = adapter_for(kind, settings)
    except (KeyError, ValueError):
        return False
    return adapter.serves(capability, settings, version)


def keeps_responses(
    kind: RuntimeKind,
    settings: Mapping[str, object],
    *,
    env: Mapping[str, str] | None = None,
) -> bool:
    """Whether a replica of `kind` started with `settings` and the deployment's `env` keeps
    Responses API responses (`Adapter.keeps_responses`); `sim` as vLLM, by its variable in `env`."""
    if kind is RuntimeKind.SIM:
        return env_flag(env or {}, RESPONSES_STORE_ENV)
    try:
        adapter = adapter_for(kind, settings)
    except (KeyError, ValueError):
        return False
    return adapter.keeps_responses(settings, env)


#: And answers vLLM's sleep routes with `--enable-sleep-mode` (`nexa.simruntime.app`).
SIM_SLEEP: Final = VLLM.native_sleep


def native_sleep_for(kind: RuntimeKind, process: Sequence[str]) -> NativeSleep | None:
    """The runtime's own sleep when a replica of `kind` running `process` (its command, or a
    deployment's `command` or `extra_args`) has it enabled; None: it sleeps by stopping its container."""
    sleep = SIM_SLEEP if kind is RuntimeKind.SIM else (a.native_sleep if (a := ADAPTERS.get(kind)) else None)
    return sleep if sleep is not None and sleep.flag in process else None


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
    nodes: int = 1,
) -> list[str]:
    """Everything wrong with a deployment's runtime settings and `extra_args` for `kind` (the
    flags `extra_args` may not give are `extra_args_refusals`', a 422 of their own), for a replica
    on `nodes` nodes (a replica group when more than one: `groups.group_problems`).

    `sim` takes no settings. A non-empty `command` replaces the adapter's command line entirely
    (the operator's escape hatch), so settings or extra_args beside it would be silently
    ignored: refused.
    """
    if not has_adapter(kind):
        return (
            [f"settings.{name}: the {kind} runtime takes no settings" for name in sorted(settings)]
            + ([f"extra_args: the {kind} runtime takes its flags from command"] if extra_args else [])
            + ([f"nodes_per_replica: the {kind} runtime runs on one node (set it to 1)"] if nodes > 1 else [])
        )
    if command and (settings or extra_args):
        return ["settings, extra_args: give settings and extra_args, or a full command, not both"]
    if problems := extra_args_problems(extra_args):
        return problems
    if kind is RuntimeKind.LLAMACPP and SERVER_SETTING in settings:
        variant = settings[SERVER_SETTING]
        if not isinstance(variant, str) or variant not in LLAMACPP_VARIANTS:
            return [f"settings.{SERVER_SETTING}: one of {', '.join(LLAMACPP_VARIANTS)}"]
    adapter = adapter_for(kind, settings)
    problems = adapter.problems(settings, accelerators=accelerators, nodes=nodes) + group_problems(
        adapter, settings, nodes=nodes
    )
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
