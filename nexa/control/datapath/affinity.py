"""The affinity key of a request (`Router.choose`'s `prefix`): what sends like requests to the same
replica, where the runtime already holds what they share (a prompt's prefix in its cache, a LoRA
adapter loaded)."""

from __future__ import annotations

import json

from nexa.config import GatewayConfig
from nexa.contracts.gateway import Capability
from nexa.control.datapath.calls import Work


def affinity_key(work: Work, cfg: GatewayConfig, *, lora: str = "") -> str | None:
    """The affinity key of a request: its tenant and the leading characters of its prompt; None for
    embeddings or an empty prompt. The tenant keeps one tenant's requests from being steered to the
    replica that holds another's prompt in its prefix cache (whose hits a timing probe could see).
    A request for an alias serving a LoRA adapter (`lora`) is keyed by its tenant and that alias: they
    go to the replica that loaded the adapter for them, loading it elsewhere only past the slack."""
    if lora and cfg.prefix_affinity:
        return f"{work.tenant}\x00lora\x00{lora}"
    text = _prompt_start(work, cfg)
    return None if text is None else f"{work.tenant}\x00{text}"


def _prompt_start(work: Work, cfg: GatewayConfig) -> str | None:
    if not cfg.prefix_affinity or not work.capability.streams:
        return None
    if work.capability is Capability.COMPLETION:
        prompt = work.body.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)[: cfg.affinity_prefix_chars]
        return text[: cfg.affinity_prefix_chars] or None
    parts: list[str] = []
    size = 0
    for message in work.body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        piece = content if isinstance(content, str) else json.dumps(content)
        parts.append(piece)
        size += len(piece)
        if size >= cfg.affinity_prefix_chars:
            break
    return "\x00".join(parts)[: cfg.affinity_prefix_chars] or None
