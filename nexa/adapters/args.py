"""What the runtime adapters (`nexa.adapters`) put around a runtime's own arguments: where its
caches go, the limits on `extra_args` and why a flag is refused there, how flags are spelled, and
how release versions compare. Pure: no I/O, no trio."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from nexa.contracts.runtime import RUNTIME_CACHE_PATH

#: The replica's writable cache (`RUNTIME_CACHE_PATH`, kept on the node's disk across restarts): the
#: root is read-only and /tmp a small tmpfs, so every cache a runtime writes at warm-up is pointed
#: there. `HOME` and `XDG_CACHE_HOME` catch what is written under `~` or `~/.cache` (Hugging Face,
#: FlashInfer's default, SGLang's `~/.cache/sglang`); the rest are each library's own variable:
#: Triton `TRITON_CACHE_DIR`, PyTorch Inductor `TORCHINDUCTOR_CACHE_DIR` and its C++ extensions
#: `TORCH_EXTENSIONS_DIR`, the CUDA driver's JIT cache `CUDA_CACHE_PATH`, FlashInfer's JIT
#: `FLASHINFER_WORKSPACE_BASE` (it appends `.cache/flashinfer`), Hugging Face `HF_HOME` (its
#: `trust_remote_code` modules).
CACHE_ENV: Final = {
    "HOME": RUNTIME_CACHE_PATH,
    "XDG_CACHE_HOME": f"{RUNTIME_CACHE_PATH}/xdg",
    "TRITON_CACHE_DIR": f"{RUNTIME_CACHE_PATH}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{RUNTIME_CACHE_PATH}/torchinductor",
    "TORCH_EXTENSIONS_DIR": f"{RUNTIME_CACHE_PATH}/torch_extensions",
    "CUDA_CACHE_PATH": f"{RUNTIME_CACHE_PATH}/cuda",
    "FLASHINFER_WORKSPACE_BASE": RUNTIME_CACHE_PATH,
    "HF_HOME": f"{RUNTIME_CACHE_PATH}/huggingface",
}
#: vLLM: `VLLM_CACHE_ROOT` (vllm/envs.py; torch.compile artefacts and its own kernels' caches).
VLLM_CACHE_ENV: Final = {**CACHE_ENV, "VLLM_CACHE_ROOT": f"{RUNTIME_CACHE_PATH}/vllm"}
#: SGLang: DeepGEMM's JIT kernels, `SGLANG_DG_CACHE_DIR` (python/sglang/srt/environ.py, default
#: `~/.cache/deep_gemm`), which it copies to DeepGEMM's own `DG_JIT_CACHE_DIR`.
SGLANG_CACHE_ENV: Final = {
    **CACHE_ENV,
    "SGLANG_DG_CACHE_DIR": f"{RUNTIME_CACHE_PATH}/deep_gemm",
    "DG_JIT_CACHE_DIR": f"{RUNTIME_CACHE_PATH}/deep_gemm",
}
#: llama.cpp writes no cache of its own; `HOME` still is somewhere writable.
LLAMA_CACHE_ENV: Final = {"HOME": RUNTIME_CACHE_PATH, "XDG_CACHE_HOME": f"{RUNTIME_CACHE_PATH}/xdg"}
#: What `extra_args` may hold: this many arguments, each at most this long.
MAX_EXTRA_ARGS: Final = 64
MAX_EXTRA_ARG_CHARS: Final = 4096
#: Why a flag nexa owns is refused in `extra_args` (`base.Adapter.refused_flags` maps flags to these).
WHY_HUB: Final = "it would reach a model hub; runtimes load only the signed, mounted artifact"
WHY_AUTH: Final = "the node's relay talks to the runtime without a key (the gateway authenticates clients)"
WHY_TLS: Final = "the node talks plain HTTP to the runtime on its own loopback"
WHY_CONFIG_FILE: Final = "a config file can set anything, the memory bound included; use settings and extra_args"
WHY_MEMORY: Final = "it would bypass the memory bound nexa derives from the reservation"
WHY_GPUS: Final = "nexa spreads a replica over the GPUs placement gave it"
WHY_GROUP: Final = "nexa sets it for each rank of a replica group, from the group's placement"


def extra_args_problems(extra_args: Sequence[str]) -> list[str]:
    """What is wrong with `extra_args`' shape: too many, too long, empty or with a NUL."""
    if len(extra_args) > MAX_EXTRA_ARGS:
        return [f"extra_args: at most {MAX_EXTRA_ARGS} arguments"]
    return [
        f"extra_args[{i}]: a non-empty argument of at most {MAX_EXTRA_ARG_CHARS} characters, without NUL"
        for i, arg in enumerate(extra_args)
        if not arg or len(arg) > MAX_EXTRA_ARG_CHARS or "\x00" in arg
    ]


def version_at_least(version: str, first: str) -> bool:
    """Whether release `version` (`1.2.0`, `1.3.0rc7`, `v1.3.0.post1`) is `first` or later;
    a version that reads as no release (`latest`, empty) counts as earlier."""
    mine, theirs = _release(version), _release(first)
    return mine is not None and theirs is not None and mine >= theirs


def _release(version: str) -> tuple[int, ...] | None:
    """(major, minor, patch, pre): a final release sorts after its release candidates."""
    match = _VERSION_RE.match(version.strip().lower())
    if match is None:
        return None
    major, minor, patch, rc = match.groups()
    return (int(major), int(minor), int(patch or 0), int(rc) if rc is not None else 1 << 30)


_VERSION_RE: Final = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?(?:rc|pre)(\d+))?")


def spelling(flag: str) -> str:
    """A flag as the servers compare it: vLLM's parser takes `_` for `-` and so does the check."""
    return flag.replace("_", "-")


def is_value(arg: str) -> bool:
    """`-1` is a value, not a flag."""
    try:
        float(arg)
    except ValueError:
        return False
    return True
