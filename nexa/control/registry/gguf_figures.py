"""A GGUF model's attention figures, read by the controller when it verifies the model version:
the first bytes of its file (a manifest's entry file) from the S3 store, read as a GGUF header
within bounds (`nexa.ggufmeta`). They size llama.cpp's context on unified-memory nodes."""

from __future__ import annotations

import functools

import trio

from nexa.contracts.kvcache import GgufFigures
from nexa.contracts.models import ModelFormat, ModelRecord
from nexa.control.registry.outbound import Outbound
from nexa.errors import GgufInvalid
from nexa.ggufmeta import HEADER_MIN_BYTES, MAX_HEADER_BYTES, attention_figures, read_header


async def read_figures(outbound: Outbound, model: ModelRecord) -> tuple[GgufFigures | None, str]:
    """(figures, "") for a GGUF model whose header gives them, (None, why) for one whose header
    does not, (None, "") for any other format. At most `MAX_HEADER_BYTES` are read; the header is
    parsed in a worker thread. A store that cannot serve the bytes raises as verification does
    (Unavailable, ArtifactMissing)."""
    if model.format is not ModelFormat.GGUF:
        return None, ""
    artifact = model.artifact
    if not artifact.files:
        uri, size, name = artifact.uri, artifact.size_bytes, "the artifact"
    else:
        entry = next((f for f in artifact.files if f.path == artifact.entry), None)
        if entry is None:
            return None, f"the manifest's entry {artifact.entry!r} is a directory, not a GGUF file"
        uri, size, name = artifact.object_uri(entry.path), entry.size_bytes, f"the entry file {entry.path!r}"
    if size < HEADER_MIN_BYTES:
        return None, f"{name}: {size} bytes, too few for a GGUF header"
    head = await outbound.read_head(uri, MAX_HEADER_BYTES)
    try:
        header = await trio.to_thread.run_sync(functools.partial(read_header, head, file_bytes=size))
        return attention_figures(header), ""
    except GgufInvalid as exc:
        return None, f"{name}: {exc.message}"
