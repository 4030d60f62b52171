"""vLLM's run-time LoRA endpoints, simulated (vLLM `docs/features/lora.md`, "Dynamically serving
LoRA adapters"; `vllm/entrypoints/openai/serving_models.py`): with `--max-loras N` the sim runtime
answers

* `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}`: 200 and `Success: LoRA adapter
  '<name>' added successfully.`; 400 when either is missing, when the name is loaded already (`The
  lora adapter '<name>' has already been loaded.`), when the path does not exist, and, the sim's
  limit, when N are loaded (unload one first);
* `POST /v1/unload_lora_adapter` `{"lora_name"}`: 200 and `Success: LoRA adapter '<name>' removed
  successfully.`; 404 `The lora adapter '<name>' cannot be found.` for one not loaded.

A loaded adapter is listed by `GET /v1/models` (with its base as `parent`, as vLLM lists them) and
may be named as a request's `model`; an inference request naming an adapter that was loaded once
and is unloaded now is 404 (`The model '<name>' does not exist.`), as vLLM answers. Without
`--max-loras` both endpoints are 404, as vLLM's are without `VLLM_ALLOW_RUNTIME_LORA_UPDATING`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from nexa.simruntime.asgi import BadRequest


class SimLoras:
    """The adapters loaded now, in load order; `known`: every adapter ever loaded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.loaded: dict[str, str] = {}
        self.known: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def load(self, body: bytes) -> bytes:
        """Load the adapter the body names; BadRequest (400) as vLLM answers, or at the limit."""
        name, path = _fields(body, "lora_name", "lora_path")
        if not name or not path:
            raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if name in self.loaded:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if not os.path.exists(path):
            raise BadRequest(f"No adapter found for {path}", param="lora_path")
        if len(self.loaded) >= self.limit:
            raise BadRequest(
                f"{len(self.loaded)} LoRA adapters are loaded, the limit (--max-loras {self.limit}); unload one first",
                param="lora_name",
            )
        self.loaded[name] = path
        self.known.add(name)
        return f"Success: LoRA adapter '{name}' added successfully.".encode()

    def unload(self, body: bytes) -> bytes:
        """Unload the adapter the body names; BadRequest 404 for one not loaded."""
        (name,) = _fields(body, "lora_name")
        if not name:
            raise BadRequest("'lora_name' must be provided.", param="lora_name")
        if self.loaded.pop(name, None) is None:
            raise BadRequest(f"The lora adapter '{name}' cannot be found.", param="lora_name", status=404)
        return f"Success: LoRA adapter '{name}' removed successfully.".encode()

    def check_model(self, model: str) -> None:
        """An inference request's `model`: an adapter unloaded now is 404, as vLLM answers."""
        if model in self.known and model not in self.loaded:
            raise BadRequest(f"The model '{model}' does not exist.", param="model", status=404)

    def models(self, base: str, created: int, owned_by: str) -> list[dict[str, Any]]:
        """The loaded adapters as `GET /v1/models` lists them (vLLM: `root` the path, `parent` the base)."""
        return [
            {"id": name, "object": "model", "created": created, "owned_by": owned_by, "root": path, "parent": base}
            for name, path in self.loaded.items()
        ]


def _fields(body: bytes, *names: str) -> list[str]:
    try:
        payload = json.loads(body or b"{}")
    except ValueError:
        raise BadRequest("the body is not JSON") from None
    if not isinstance(payload, dict):
        raise BadRequest("the body is not a JSON object")
    values = [payload.get(name) or "" for name in names]
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, str):
            raise BadRequest(f"'{name}' must be a string", param=name)
    return [str(v) for v in values]
