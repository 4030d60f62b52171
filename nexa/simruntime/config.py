"""What `nexa sim-runtime` is started with (`SimConfig`, its flags) and the check it passes first."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Final

import attrs

from nexa.container_spec import SIMULATION_ENV
from nexa.contracts.gateway import Capability
from nexa.contracts.hosts import is_loopback_host
from nexa.errors import ConfigError
from nexa.simruntime.faults import Faults

#: Longest embedding asked for with `dimensions`.
MAX_EMBEDDING_DIM: Final = 8192
#: Most LoRA adapters `--max-loras` may allow.
MAX_LORAS: Final = 1024


@attrs.frozen(kw_only=True)
class SimConfig:
    """What `nexa sim-runtime` is started with (its flags); `check_config` validates it."""

    host: str = "127.0.0.1"
    #: 0: any free port (the bound address is printed).
    port: int = 0
    model: str = "sim"
    ttft_ms: float = 20.0
    tokens_per_s: float = 200.0
    output_tokens: int = 16
    embedding_dim: int = 384
    #: JSON-lines journal of requests and their outcomes; "" for none.
    journal: str = ""
    #: JSON faults file, re-read when it changes; when present it replaces `faults`. "" for none.
    faults_path: str = ""
    #: Faults in force while no faults file exists.
    faults: Faults = attrs.field(factory=Faults)
    #: The model artifact's host path (must exist when given); the simulator never reads it.
    artifact: str = ""
    #: Stop when the parent process goes away (the node agent's process driver asks for this).
    exit_with_parent: bool = False
    #: vLLM's sleep mode (`--enable-sleep-mode`): `POST /sleep?level=1|2`, `POST /wake_up`, `GET
    #: /is_sleeping`; asleep, inference answers 503. Off: those routes are 404, as in vLLM.
    sleep_mode: bool = False
    #: The gated capabilities served (`--serve`; `adapters.sim_serves`): rerank, score, tokenize,
    #: detokenize and media by default; the native Messages and Responses APIs only when named.
    serves: frozenset[Capability] = attrs.field(
        factory=lambda: frozenset(c for c in Capability if c.gated and not c.native)
    )
    #: LoRA adapters loaded at once through vLLM's run-time endpoints (`simruntime.lora`); 0: no endpoints.
    max_loras: int = 0


@attrs.frozen(kw_only=True)
class SimStarted:
    """What `serve_sim` reports once it listens."""

    urls: list[str]


def check_config(cfg: SimConfig, environ: Mapping[str, str]) -> None:
    """Raise ConfigError unless simulation is allowed here and `cfg` makes sense."""
    if environ.get(SIMULATION_ENV) != "1":
        raise ConfigError(f"nexa sim-runtime is a simulation: it runs only with {SIMULATION_ENV}=1 in its environment")
    problems: list[str] = []
    if not is_loopback_host(cfg.host):
        problems.append(f"--host {cfg.host!r}: a simulated runtime listens on a loopback address only")
    if not 0 <= cfg.port <= 65535:
        problems.append("--port: must be 0 to 65535")
    if not cfg.model:
        problems.append("--model: must not be empty")
    if not (math.isfinite(cfg.ttft_ms) and cfg.ttft_ms >= 0):
        problems.append("--ttft-ms: must be 0 or more")
    if not (math.isfinite(cfg.tokens_per_s) and cfg.tokens_per_s > 0):
        problems.append("--tokens-per-s: must be more than 0")
    if cfg.output_tokens < 0:
        problems.append("--output-tokens: must be 0 or more")
    if not 1 <= cfg.embedding_dim <= MAX_EMBEDDING_DIM:
        problems.append(f"--embedding-dim: must be 1 to {MAX_EMBEDDING_DIM}")
    problems += _fault_flag_problems(cfg.faults)
    if not 0 <= cfg.max_loras <= MAX_LORAS:
        problems.append(f"--max-loras: must be 0 to {MAX_LORAS}")
    if cfg.artifact and not os.path.exists(cfg.artifact):
        problems.append("--artifact: no such file")
    if problems:
        raise ConfigError("invalid sim-runtime flags: " + "; ".join(problems), problems=tuple(problems))


def _fault_flag_problems(faults: Faults) -> list[str]:
    problems = []
    if not 400 <= faults.status <= 599:
        problems.append("--fail-status: must be 400 to 599")
    if faults.after_tokens < 0:
        problems.append("--after-tokens: must be 0 or more")
    if faults.queue_depth < 0:
        problems.append("--queue-depth: must be 0 or more")
    if not 0.0 <= faults.kv_cache_usage <= 1.0:
        problems.append("--kv-cache-usage: must be 0 to 1")
    return problems
