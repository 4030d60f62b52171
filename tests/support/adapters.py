"""What a runtime adapter is given: the images by runtime kind, an Approved model version, the
health probe and the offline environment a Python runtime gets."""

from __future__ import annotations

from pathlib import Path

from nexa.contracts.deployments import Deployment, PlacementSpec, Resources, RuntimeOptions
from nexa.contracts.models import (
    LicenseRecord,
    ModelArtifact,
    ModelFormat,
    ModelRecord,
    ModelRef,
    ModelState,
    Provenance,
)
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import HealthProbe

GIB = 2**30
#: Inside the runtime's own network namespace its probe asks loopback, on the adapter's port.
PROBE_HOST = "127.0.0.1"
PORT = 18000
SHA = "c" * 64
IMAGES = {
    RuntimeKind.VLLM: "nvcr.io/nvidia/vllm@sha256:" + "1" * 64,
    RuntimeKind.SGLANG: "docker.io/lmsysorg/sglang@sha256:" + "2" * 64,
    RuntimeKind.TRTLLM: "nvcr.io/nvidia/tensorrt-llm/release@sha256:" + "3" * 64,
    RuntimeKind.LLAMACPP: "ghcr.io/ggml-org/llama.cpp@sha256:" + "4" * 64,
}


def model(
    name: str = "llama-3-8b",
    fmt: ModelFormat = ModelFormat.SAFETENSORS,
    *,
    artifact: ModelArtifact | None = None,
    memory: int = 40 * GIB,
    source: str = "hf://meta-llama/Meta-Llama-3-8B-Instruct",
    spdx_id: str = "llama3",
) -> ModelRecord:
    """An Approved model version (the artifact by default one 16 GiB object)."""
    return ModelRecord(
        name=name,
        version="v1",
        artifact=artifact or ModelArtifact(uri=f"s3://models/{name}.tar", sha256=SHA, size_bytes=16 * GIB),
        format=fmt,
        memory_bytes=memory,
        provenance=Provenance(source=source),
        license=LicenseRecord(
            spdx_id=spdx_id, terms_sha256=None, accepted_by="ops", expires_at=None, recorded_at=0, recorded_by=None
        ),
        signature=None,
        state=ModelState.APPROVED,
        registered_at=0,
        registered_by=None,
        state_changed_at=0,
        state_changed_by=None,
    )


def python_probe(path: str) -> HealthProbe:
    url = f'"http://{PROBE_HOST}:{PORT}{path}"'
    return HealthProbe(
        command=["python3", "-c", f"import urllib.request; urllib.request.urlopen({url}, timeout=5)"],
        interval_s=2.0,
        timeout_s=6.0,
        start_period_s=600.0,
        retries=3,
    )


OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
#: The replica's writable cache and the variables pointing each runtime's caches there
#: (`nexa.adapters`), written out so that a change shows in the pinned specs.
CACHE = "/var/cache/nexa-runtime"
CACHE_ENV = {
    "HOME": CACHE,
    "XDG_CACHE_HOME": f"{CACHE}/xdg",
    "TRITON_CACHE_DIR": f"{CACHE}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE}/torchinductor",
    "TORCH_EXTENSIONS_DIR": f"{CACHE}/torch_extensions",
    "CUDA_CACHE_PATH": f"{CACHE}/cuda",
    "FLASHINFER_WORKSPACE_BASE": CACHE,
    "HF_HOME": f"{CACHE}/huggingface",
}
VLLM_ENV = {**OFFLINE, "VLLM_NO_USAGE_STATS": "1", **CACHE_ENV, "VLLM_CACHE_ROOT": f"{CACHE}/vllm"}
SGLANG_ENV = {
    **OFFLINE,
    **CACHE_ENV,
    "SGLANG_DG_CACHE_DIR": f"{CACHE}/deep_gemm",
    "DG_JIT_CACHE_DIR": f"{CACHE}/deep_gemm",
}
TRTLLM_ENV = {**OFFLINE, **CACHE_ENV}
LLAMA_ENV = {"HOME": CACHE, "XDG_CACHE_HOME": f"{CACHE}/xdg"}


#: A DGX Spark's one GPU, as its CDI device; the node's address; a verified artifact's path on it.
SPARK_GPU = "nvidia.com/gpu=0"
NODE_HOST = "127.0.0.11"
ARTIFACT = Path("/var/lib/nexa/node/artifacts/" + "c" * 64)


def deployment(options: RuntimeOptions, *, accelerators: int = 1) -> Deployment:
    return Deployment(
        name="chat",
        runtime="rt",
        alias="chat",
        model=ModelRef(model="llama-3-8b", version="v1"),
        replicas=1,
        resources=Resources(accelerators=accelerators, memory_bytes=48 * GIB, cpus=8.0),
        options=options,
        placement=PlacementSpec(),
        created_at=0,
        created_by=None,
        updated_at=0,
    )
