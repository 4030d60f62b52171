"""LoRA adapters on a runtime: the flags that load them beside the base model at start, and how a
request names one. What each runtime documents:

* llama.cpp's `llama-server` (tools/server/README.md, common/arg.cpp): `--lora-scaled FILE:0` once per
  adapter (ids 0, 1, … in that order) and `--lora-init-without-apply`: every adapter is loaded at
  scale 0, so a request without a `lora` field (which takes the server's scales) is the base's. A
  request applies one with its `lora` field, `[{"id": N, "scale": 1.0}]` (adapters it does not name
  get scale 0 for that request), which the node's relay writes (`nexa.node.lora`). Plain `--lora
  FILE` would load it at scale 1 and apply it to every request that names none.
* vLLM (docs/features/lora.md): `--enable-lora`, `--max-loras N` (how many are active at once), and
  with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` adapters loaded and unloaded at run time
  (`POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}`, `POST /v1/unload_lora_adapter`
  `{"lora_name"}`): the node loads one when a request first needs it, unloading the least recently
  used that no request is using when N are loaded (`nexa.node.lora.LoraSlots`), without restarting
  the replica; a request names the adapter as its `model`. `--max-lora-rank` (16 by default) bounds
  the adapters it can load (`max_lora_rank`).
* SGLang (docs/advanced_features/lora.md; python/sglang/srt/server_args.py, entrypoints/http_server.py,
  entrypoints/openai/serving_base.py): `--enable-lora`, `--max-loras-per-batch N`. A request names
  the adapter in its `lora_path` field (the form every release with LoRA on its OpenAI routes takes;
  newer ones also read `model: "<base>:<adapter>"`), its `model` staying the base's. Two ways:
  - at start, `--lora-paths name=path …`: fixed for the replica's life;
  - at run time, when the deployment sets `max_lora_rank` and `lora_target_modules`
    (`SGLANG_LIVE_SETTINGS`: SGLang needs the LoRA pool's shape at start when it starts with no
    adapter): loaded and unloaded as vLLM's are, at `POST /load_lora_adapter` `{"lora_name",
    "lora_path"}` and `POST /unload_lora_adapter` `{"lora_name"}` (200 on success, 400 with
    `{"success": false, "error_message"}` otherwise), within `--max-loaded-loras` where set.
* `sim` (`nexa sim-runtime`): vLLM's flags and endpoints, with its limit.

llama-cpp-python's server takes one `--lora_path` for the whole model (no per-request choice), and
TensorRT-LLM's is not wired here: a deployment on those runtimes loads no adapter, and a request for
an adapter's alias finds no replica that has it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from nexa.adapters.base import LLAMA_SERVER, Adapter
from nexa.contracts.node import RuntimeKind

#: The setting that bounds the adapters loaded at once (vLLM `--max-loras`, SGLang
#: `--max-loras-per-batch`; for `sim`, `--max-loras` in its command); unset: as many as the
#: deployment's aliases serve.
MAX_LORAS_SETTING: Final = "max_loras"
MAX_LORAS_FLAG: Final = "--max-loras"
#: SGLang's bound on the adapters loaded at once (its `--max-loras-per-batch` bounds one batch).
SGLANG_MAX_LOADED_FLAG: Final = "--max-loaded-loras"
#: SGLang's settings that fix the LoRA pool's shape at start, so it may start with no adapter and
#: load them at run time: with both set, its adapters are loaded at run time.
SGLANG_LIVE_SETTINGS: Final = ("max_lora_rank", "lora_target_modules")
#: vLLM's switch for its run-time load and unload endpoints.
RUNTIME_UPDATING_ENV: Final = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
#: Where an adapter's verified files are mounted in the container (`/models/lora/<name>`).
LORA_MOUNT_ROOT: Final = "/models/lora"


@attrs.frozen(kw_only=True)
class LoraEndpoints:
    """Where a runtime that loads adapters at run time takes a load and an unload."""

    load: str
    unload: str


#: vLLM's (vllm/entrypoints/openai/api_server.py), and so `sim`'s.
VLLM_ENDPOINTS: Final = LoraEndpoints(load="/v1/load_lora_adapter", unload="/v1/unload_lora_adapter")
#: SGLang's (python/sglang/srt/entrypoints/http_server.py): no `/v1`.
SGLANG_ENDPOINTS: Final = LoraEndpoints(load="/load_lora_adapter", unload="/unload_lora_adapter")


def loads_at_run_time(kind: RuntimeKind, settings: Mapping[str, object] | None = None) -> bool:
    """Whether the node loads a deployment's adapters at run time, not the command at start: vLLM and
    sim always, SGLang when its settings (`settings`) fix its LoRA pool's shape (`SGLANG_LIVE_SETTINGS`)."""
    if kind is RuntimeKind.SGLANG:
        return settings is not None and all(key in settings for key in SGLANG_LIVE_SETTINGS)
    return kind in {RuntimeKind.VLLM, RuntimeKind.SIM}


def endpoints(kind: RuntimeKind) -> LoraEndpoints:
    """Where a runtime of `kind` that loads adapters at run time takes loads and unloads."""
    return SGLANG_ENDPOINTS if kind is RuntimeKind.SGLANG else VLLM_ENDPOINTS


def limit_flag(kind: RuntimeKind) -> str:
    """The flag of a runtime's command that bounds the adapters it holds loaded at once."""
    return SGLANG_MAX_LOADED_FLAG if kind is RuntimeKind.SGLANG else MAX_LORAS_FLAG


def loads_loras(kind: RuntimeKind, adapter: Adapter | None) -> bool:
    """Whether replicas of this runtime are given LoRA adapters (`adapter`: None for `sim`)."""
    if kind is RuntimeKind.SIM:
        return True
    if adapter is None:
        return False
    return (kind is RuntimeKind.LLAMACPP and adapter.name == LLAMA_SERVER) or kind in {
        RuntimeKind.VLLM,
        RuntimeKind.SGLANG,
    }


def lora_args(
    kind: RuntimeKind,
    settings: Mapping[str, object],
    command: Sequence[str],
    loras: Sequence[tuple[str, str]],
    *,
    spare: int = 0,
    live: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """The flags (after the adapter's `command`) and environment that give a runtime of `kind` the
    adapters `loras` ((name, path in the container) each, in order); ([], {}) when there are none.
    The limit is the `max_loras` setting's (the adapter writes its flag), else `--max-loras` in a sim's
    command, else the number of adapters and `spare` more (room for a new version beside its
    earlier one while an adapter rollout in place soaks). `live`: the node loads them at run time
    (`Assignment.loras`), so SGLang starts without `--lora-paths`."""
    if not loras:
        return [], {}
    given = [MAX_LORAS_FLAG, str(len(loras) + spare)]
    limit = [] if MAX_LORAS_SETTING in settings or MAX_LORAS_FLAG in command else given
    if kind is RuntimeKind.LLAMACPP:
        scaled = (arg for _, path in loras for arg in ("--lora-scaled", f"{path}:0"))
        return ["--lora-init-without-apply", *scaled], {}
    if kind is RuntimeKind.VLLM:
        return ["--enable-lora", *limit], dict(RUNTIME_UPDATING_ENV)
    if kind is RuntimeKind.SGLANG:
        limit = [] if MAX_LORAS_SETTING in settings else ["--max-loras-per-batch", str(len(loras) + spare)]
        at_start = [] if live else ["--lora-paths", *(f"{name}={path}" for name, path in loras)]
        return ["--enable-lora", *limit, *at_start], {}
    if kind is RuntimeKind.SIM:
        return limit, {}
    return [], {}


def limit_in(command: Sequence[str], flag: str = MAX_LORAS_FLAG) -> int | None:
    """The `--max-loras N` (or `--max-loras=N`; `flag`: another runtime's, `limit_flag`) a runtime's
    command gives, None when it gives none."""
    for i, arg in enumerate(command):
        value = command[i + 1] if arg == flag and i + 1 < len(command) else None
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return None
