"""TensorRT-LLM (`trtllm-serve`): its adapter. Flags from TensorRT-LLM's "trtllm-serve" documentation."""

from __future__ import annotations

from typing import Final

from nexa.adapters.args import CACHE_ENV, WHY_CONFIG_FILE, WHY_GPUS, WHY_HUB, WHY_MEMORY
from nexa.adapters.base import GPU_SHM_BYTES, OFFLINE_ENV, Adapter, Metrics, Option, Style
from nexa.contracts.capabilities import Capability
from nexa.contracts.memory import MemoryShare
from nexa.contracts.node import RuntimeKind

TRTLLM: Final = Adapter(
    kind=RuntimeKind.TRTLLM,
    name="trtllm",
    program=("trtllm-serve",),
    model_flag=None,
    served_name_flag="--served_model_name",
    host_flag="--host",
    port_flag="--port",
    tensor_parallel_flag="--tp_size",
    options={
        "backend": Option(flag="--backend", type=str, choices=("pytorch", "tensorrt"), help="engine backend"),
        "max_batch_size": Option(flag="--max_batch_size", type=int, minimum=1, help="requests scheduled at once"),
        "max_num_tokens": Option(flag="--max_num_tokens", type=int, minimum=1, help="batched input tokens"),
        "max_seq_len": Option(flag="--max_seq_len", type=int, minimum=1, help="prompt + output tokens"),
        "kv_cache_free_gpu_memory_fraction": Option(
            flag="--kv_cache_free_gpu_memory_fraction", type=float, minimum=0.05, maximum=1.0, help="KV cache share"
        ),
        "tokenizer": Option(flag="--tokenizer", type=str, help="tokenizer path (for an engine directory)"),
        "trust_remote_code": Option(flag="--trust_remote_code", type=bool, style=Style.SWITCH, help=""),
        # tensorrt_llm/commands/serve.py (the `serve` command's click options).
        "max_beam_width": Option(flag="--max_beam_width", type=int, minimum=1, help="beams for beam search"),
        "reasoning_parser": Option(flag="--reasoning_parser", type=str, help="e.g. deepseek-r1, qwen3"),
        "tool_parser": Option(flag="--tool_parser", type=str, help="tool-call parser (recent releases)"),
        "enable_chunked_prefill": Option(flag="--enable_chunked_prefill", type=bool, style=Style.SWITCH, help=""),
        "chat_template": Option(
            flag="--chat_template", type=str, style=Style.MODEL_FILE, help="a template file of the model's directory"
        ),
    },
    env={**OFFLINE_ENV, **CACHE_ENV},
    refused_flags=dict.fromkeys(
        ("--tensor_parallel_size", "--pp_size", "--pipeline_parallel_size", "--cp_size", "--context_parallel_size"),
        WHY_GPUS,
    )
    | {"--free_gpu_memory_fraction": WHY_MEMORY}
    | {"--revision": WHY_HUB}
    | dict.fromkeys(("--config", "--extra_llm_api_options"), WHY_CONFIG_FILE),
    # `--served_model_name` came with TensorRT-LLM 1.3.0rc7 (NVIDIA/TensorRT-LLM#11711, in the
    # v1.3.0rc7 release notes, 10 March 2026); before it the served name is the model directory's
    # base name (tensorrt_llm/serve/openai_server.py: `Path(model).name` for a directory).
    served_name_since="1.3.0rc7",
    default_shm_bytes=GPU_SHM_BYTES,
    readiness_path="/health",
    # trtllm-serve's /metrics (tensorrt_llm/serve/openai_server.py `get_iteration_stats`) is a JSON
    # list of the iteration statistics gathered since the last read (`get_stats_async(2)`), each the
    # executor's `IterationStats` as JSON: `numQueuedRequests` and `numActiveRequests` at the top,
    # `kvCacheStats.{usedNumBlocks,maxNumBlocks}`. With the PyTorch backend the list stays empty
    # unless `enable_iter_perf_stats` is set, and an idle engine adds none: then every figure is
    # unknown and routing counts the controller's own requests in flight.
    metrics=Metrics(
        path="/metrics",
        format="json",
        waiting="numQueuedRequests",
        running="numActiveRequests",
        kv_cache=("kvCacheStats.usedNumBlocks/maxNumBlocks",),
    ),
    capabilities=frozenset({Capability.COMPLETION, Capability.CHAT}),
    memory_setting="kv_cache_free_gpu_memory_fraction",
    memory_share=MemoryShare.FREE_AFTER_WEIGHTS,
    pipeline_parallel_flag="--pp_size",
)
