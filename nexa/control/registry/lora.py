"""LoRA adapters in the model registry: a model version of kind `lora` that names the base model
versions it applies to (`ModelCreate.base`). It has a model's whole governance (manifest in the
store, licence, provenance, verification, evaluations, approval, audit); what is its own is
checked here:

* at registration, every base is a registered model version (kind `model`, not Retired) in the
  adapter's format: a GGUF adapter is loaded by llama.cpp beside a GGUF base, a safetensors one by
  vLLM or SGLang beside a safetensors base;
* at verification of a GGUF adapter, its header says it is one (`general.type` `adapter`,
  `adapter.type` `lora`, as llama.cpp's `src/llama-adapter.cpp` requires) for the architecture its
  verified GGUF bases have (`general.architecture`).

Anything else is `LoraBaseInvalid` (422) and nothing is kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import trio

from nexa.contracts.models import AliasRecord, ModelFormat, ModelKind, ModelRecord, ModelRef, ModelState
from nexa.control.registry.outbound import Outbound
from nexa.errors import GgufInvalid, LoraBaseInvalid, ModelNotApproved, NotFound
from nexa.ggufmeta import HEADER_MIN_BYTES, MAX_HEADER_BYTES, read_header


def check_bases(
    adapter: str, kind: ModelKind, fmt: ModelFormat, base: list[ModelRef], lookup: Callable[[str, str], ModelRecord]
) -> None:
    """Raise LoraBaseInvalid unless every base of adapter `adapter` (`name@version`) can carry it."""
    if kind is not ModelKind.LORA:
        return
    for ref in base:
        try:
            model = lookup(ref.model, ref.version)
        except NotFound:
            raise LoraBaseInvalid(
                f"LoRA adapter {adapter}: no base model version {ref.key} is registered; register it first "
                "(`nexa models register`) or name a registered one",
                adapter=adapter,
                base=ref.key,
            ) from None
        if model.kind is not ModelKind.MODEL:
            raise LoraBaseInvalid(
                f"LoRA adapter {adapter}: {ref.key} is itself a LoRA adapter; name the base model it applies to",
                adapter=adapter,
                base=ref.key,
            )
        if model.state is ModelState.RETIRED:
            raise LoraBaseInvalid(
                f"LoRA adapter {adapter}: base {ref.key} is Retired; name a version that is served",
                adapter=adapter,
                base=ref.key,
            )
        if model.format is not fmt:
            raise LoraBaseInvalid(
                f"LoRA adapter {adapter} is {fmt.value} but base {ref.key} is {model.format.value}: a runtime "
                "loads an adapter only in its base's format (GGUF for llama.cpp, safetensors for vLLM and SGLang)",
                adapter=adapter,
                base=ref.key,
            )


async def check_adapter_file(
    outbound: Outbound, adapter: ModelRecord, lookup: Callable[[str, str], ModelRecord]
) -> str:
    """At verification of a GGUF LoRA adapter: its header must be a LoRA adapter's, for the
    architecture of every base whose verification read one. Returns the audit detail
    (`LoRA for llama`); "" for anything but a GGUF adapter. Raises LoraBaseInvalid."""
    if adapter.kind is not ModelKind.LORA or adapter.format is not ModelFormat.GGUF:
        return ""
    artifact = adapter.artifact
    if artifact.files:
        entry = next((f for f in artifact.files if f.path == artifact.entry), None)
        if entry is None:
            raise LoraBaseInvalid(
                f"LoRA adapter {adapter.key}: its manifest names no entry file; give the adapter's .gguf as the entry",
                adapter=adapter.key,
            )
        uri, size = artifact.object_uri(entry.path), entry.size_bytes
    else:
        uri, size = artifact.uri, artifact.size_bytes
    if size < HEADER_MIN_BYTES:
        raise LoraBaseInvalid(f"LoRA adapter {adapter.key}: too few bytes for a GGUF header", adapter=adapter.key)
    head = await outbound.read_head(uri, MAX_HEADER_BYTES)
    try:
        header = await trio.to_thread.run_sync(functools.partial(read_header, head, file_bytes=size))
    except GgufInvalid as exc:
        raise LoraBaseInvalid(f"LoRA adapter {adapter.key}: {exc.message}", adapter=adapter.key) from None
    meta = header.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoraBaseInvalid(
            f"LoRA adapter {adapter.key}: its GGUF header is not a LoRA adapter's (general.type "
            f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r}; llama.cpp needs "
            "'adapter' and 'lora': convert it with llama.cpp's convert_lora_to_gguf.py)",
            adapter=adapter.key,
        )
    arch = meta.get("general.architecture")
    for ref in adapter.base:
        base = lookup(ref.model, ref.version)
        figures = base.verification.gguf if base.verification else None
        if figures is not None and figures.architecture != arch:
            raise LoraBaseInvalid(
                f"LoRA adapter {adapter.key} is for architecture {arch!r} but base {ref.key} is "
                f"{figures.architecture!r}: llama.cpp refuses to load it there",
                adapter=adapter.key,
                base=ref.key,
            )
    return f"LoRA for {arch}"


def served_key(alias: AliasRecord) -> str:
    """What an alias serves, for audit details and listings: `base@v` or `base@v+adapter@a`."""
    return alias.target.key + (f"+{alias.adapter.key}" if alias.adapter else "")


def check_alias_adapter(
    alias: str, model: ModelRecord, adapter: ModelRef | None, lookup: Callable[[str, str], ModelRecord]
) -> ModelRef | None:
    """The adapter an alias may serve on `model` (None: none). An adapter is never served alone,
    and only an Approved LoRA adapter that names `model` among its bases is served on it:
    LoraBaseInvalid (422) or ModelNotApproved (409) otherwise."""
    if model.kind is ModelKind.LORA:
        raise LoraBaseInvalid(
            f"alias {alias}: {model.key} is a LoRA adapter and is served only on a base; promote with the base as "
            f"the model and the adapter as `adapter` (one of {', '.join(b.key for b in model.base)})",
            adapter=model.key,
        )
    if adapter is None:
        return None
    record = lookup(adapter.model, adapter.version)
    if record.kind is not ModelKind.LORA:
        raise LoraBaseInvalid(
            f"alias {alias}: {record.key} is not a LoRA adapter (kind {record.kind.value}); give an adapter version",
            adapter=record.key,
        )
    if record.state is not ModelState.APPROVED:
        raise ModelNotApproved(
            f"alias {alias} may serve only an Approved adapter; {record.key} is {record.state.value}", model=record.key
        )
    ref = ModelRef(model=model.name, version=model.version)
    if ref not in record.base:
        raise LoraBaseInvalid(
            f"alias {alias}: adapter {record.key} applies to {', '.join(b.key for b in record.base)}, not {ref.key}; "
            "register a version of the adapter for this base",
            adapter=record.key,
            base=ref.key,
        )
    return ModelRef(model=record.name, version=record.version)
