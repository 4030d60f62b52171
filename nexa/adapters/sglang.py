"""SGLang (`python3 -m sglang.launch_server`): its adapter. Flags and series from SGLang's "Server arguments"
and "Production metrics"."""

from __future__ import annotations

from typing import Final

from nexa.adapters.args import SGLANG_CACHE_ENV, WHY_AUTH, WHY_CONFIG_FILE, WHY_GPUS, WHY_GROUP, WHY_HUB, WHY_TLS
from nexa.adapters.base import DTYPES, GPU_SHM_BYTES, OFFLINE_ENV, Adapter, Metrics, Option, Style
from nexa.contracts.capabilities import TEXT_CAPABILITIES, Capability
from nexa.contracts.node import RuntimeKind

SGLANG: Final = Adapter(
    kind=RuntimeKind.SGLANG,
    name="sglang",
    program=("python3", "-m", "sglang.launch_server"),
    model_flag="--model-path",
    served_name_flag="--served-model-name",
    host_flag="--host",
    port_flag="--port",
    fixed=("--enable-metrics",),
    tensor_parallel_flag="--tp-size",
    options={
        "context_length": Option(flag="--context-length", type=int, minimum=1, help="context length (tokens)"),
        "mem_fraction_static": Option(
            flag="--mem-fraction-static", type=float, minimum=0.05, maximum=1.0, help="share for weights + KV pool"
        ),
        "max_running_requests": Option(flag="--max-running-requests", type=int, minimum=1, help=""),
        "max_loras": Option(flag="--max-loras-per-batch", type=int, minimum=1, help="LoRA adapters in one batch"),
        # python/sglang/srt/server_args.py: with both of these the LoRA pool's shape is fixed at start
        # without adapters, and nexa loads them at run time (`nexa.adapters.lora.SGLANG_LIVE_SETTINGS`).
        "max_lora_rank": Option(flag="--max-lora-rank", type=int, minimum=1, help="largest LoRA rank it may load"),
        "lora_target_modules": Option(
            flag="--lora-target-modules",
            type=str,
            style=Style.WORDS,
            help="modules adapters may target, space-separated (e.g. q_proj k_proj v_proj o_proj, or all)",
        ),
        "max_loaded_loras": Option(
            flag="--max-loaded-loras", type=int, minimum=1, help="LoRA adapters held in CPU memory at once"
        ),
        "chunked_prefill_size": Option(flag="--chunked-prefill-size", type=int, minimum=-1, help="-1: off"),
        "dtype": Option(flag="--dtype", type=str, choices=DTYPES, help="weight and activation type"),
        "kv_cache_dtype": Option(
            flag="--kv-cache-dtype", type=str, choices=("auto", "fp8_e4m3", "fp8_e5m2"), help="KV cache type"
        ),
        "quantization": Option(flag="--quantization", type=str, help="quantization method"),
        "is_embedding": Option(flag="--is-embedding", type=bool, style=Style.SWITCH, help="serve embeddings"),
        "tokenizer": Option(flag="--tokenizer-path", type=str, help="tokenizer path inside the container"),
        "trust_remote_code": Option(flag="--trust-remote-code", type=bool, style=Style.SWITCH, help=""),
        # python/sglang/srt/server_args.py (ServerArgs.add_cli_args).
        "tool_call_parser": Option(flag="--tool-call-parser", type=str, help="e.g. qwen25, llama3, mistral"),
        "reasoning_parser": Option(flag="--reasoning-parser", type=str, help="e.g. deepseek-r1, qwen3"),
        "chat_template": Option(
            flag="--chat-template", type=str, style=Style.MODEL_FILE, help="a template file of the model's directory"
        ),
        "stream_interval": Option(flag="--stream-interval", type=int, minimum=1, help="tokens per stream chunk"),
        "max_total_tokens": Option(flag="--max-total-tokens", type=int, minimum=1, help="KV pool size (tokens)"),
    },
    env={**OFFLINE_ENV, **SGLANG_CACHE_ENV},
    abbreviates=True,
    refused_flags={"--model": "nexa gives the mounted model's path"}
    | dict.fromkeys(
        (
            "--tp",
            "--tensor-parallel-size",
            "--pp-size",
            "--pipeline-parallel-size",
            "--dp-size",
            "--data-parallel-size",
        ),
        WHY_GPUS,
    )
    | dict.fromkeys(("--download-dir", "--revision"), WHY_HUB)
    | {"--api-key": WHY_AUTH}
    | dict.fromkeys(("--ssl-keyfile", "--ssl-certfile"), WHY_TLS)
    | {"--config": WHY_CONFIG_FILE}
    # python/sglang/srt/server_args.py: dist_init_addr (alias --nccl-init-addr), nnodes, node_rank.
    | dict.fromkeys(("--nnodes", "--node-rank", "--dist-init-addr", "--nccl-init-addr"), WHY_GROUP),
    default_shm_bytes=GPU_SHM_BYTES,
    readiness_path="/health",
    metrics=Metrics(
        path="/metrics",
        waiting="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv_cache=("sglang:token_usage",),
        prefix_cache_ratio=("sglang:cache_hit_rate",),
        ttft=("sglang:time_to_first_token_seconds",),
        tpot=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    ),
    # Its rerank, score and tokenizer routes are not vLLM's shapes: chat, completions and embeddings only.
    capabilities=TEXT_CAPABILITIES,
    capability_settings={Capability.EMBEDDING: "is_embedding"},
    memory_setting="mem_fraction_static",
    pipeline_parallel_flag="--pp-size",
)
