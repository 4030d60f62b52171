"""vLLM (`vllm serve`): its adapter. Flags and series from vLLM's "Engine arguments" and "Production metrics".

Stored responses (OpenAI's Responses API `store`, `previous_response_id`, background, and the
routes vllm/entrypoints/openai/responses/api_router.py serves on one: `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel`, no `DELETE`): vLLM keeps them only when started with
`VLLM_ENABLE_RESPONSES_API_STORE=1` (vllm/envs.py: `bool(int(os.getenv(..., "0")))`), in the
server's memory, never evicted, and lost when it stops (vllm/entrypoints/openai/serving_responses.py,
`OpenAIServingResponses.__init__`: `self.enable_store = envs.VLLM_ENABLE_RESPONSES_API_STORE`).
Without it `create_responses` silently drops `store: true` (OpenAI's default) and serves the request
unstored, refuses `background: true` with a 400 naming the variable, and answers a
`previous_response_id` with a 404 (its store is empty). `settings.responses_store: true` sets the
variable (as does giving it in the deployment's `env`), and the gateway pins a conversation's
later turns, and a stored response's own routes, to the replica that keeps it (`control/datapath/stored.py`).
"""

from __future__ import annotations

from typing import Final

from nexa.adapters.args import (
    VLLM_CACHE_ENV,
    WHY_AUTH,
    WHY_CONFIG_FILE,
    WHY_GPUS,
    WHY_GROUP,
    WHY_HUB,
    WHY_MEMORY,
    WHY_TLS,
)
from nexa.adapters.base import DTYPES, GPU_SHM_BYTES, OFFLINE_ENV, Adapter, Metrics, NativeSleep, Option, Style
from nexa.contracts.capabilities import Capability
from nexa.contracts.node import RuntimeKind

#: vLLM keeps Responses API responses (in memory) only when started with this set to 1.
RESPONSES_STORE_ENV: Final = "VLLM_ENABLE_RESPONSES_API_STORE"

VLLM: Final = Adapter(
    kind=RuntimeKind.VLLM,
    name="vllm",
    program=("vllm", "serve"),
    model_flag=None,
    served_name_flag="--served-model-name",
    host_flag="--host",
    port_flag="--port",
    tensor_parallel_flag="--tensor-parallel-size",
    options={
        "max_model_len": Option(flag="--max-model-len", type=int, minimum=1, help="context length (tokens)"),
        "gpu_memory_utilization": Option(
            flag="--gpu-memory-utilization",
            type=float,
            minimum=0.05,
            maximum=1.0,
            help="share of GPU memory for weights and KV cache (set it below 1 on unified memory)",
        ),
        "max_num_seqs": Option(flag="--max-num-seqs", type=int, minimum=1, help="sequences per iteration"),
        "max_loras": Option(flag="--max-loras", type=int, minimum=1, help="LoRA adapters loaded at once"),
        # vllm/config/lora.py: MaxLoRARanks, 16 by default; an adapter of a larger rank is refused at load.
        "max_lora_rank": Option(
            flag="--max-lora-rank",
            type=int,
            choices=(1, 8, 16, 32, 64, 128, 256, 320, 512),
            help="largest LoRA rank it may load (16)",
        ),
        "max_num_batched_tokens": Option(flag="--max-num-batched-tokens", type=int, minimum=1, help="tokens/step"),
        "dtype": Option(flag="--dtype", type=str, choices=DTYPES, help="weight and activation type"),
        "kv_cache_dtype": Option(
            flag="--kv-cache-dtype", type=str, choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), help="KV cache type"
        ),
        "quantization": Option(flag="--quantization", type=str, help="quantization method (e.g. fp8, awq)"),
        "enable_prefix_caching": Option(flag="--enable-prefix-caching", type=bool, style=Style.SWITCH, help=""),
        "enforce_eager": Option(flag="--enforce-eager", type=bool, style=Style.SWITCH, help="no CUDA graphs"),
        "tokenizer": Option(flag="--tokenizer", type=str, help="tokenizer path inside the container"),
        "trust_remote_code": Option(flag="--trust-remote-code", type=bool, style=Style.SWITCH, help=""),
        # vllm/entrypoints/openai/cli_args.py (FrontendArgs).
        "enable_auto_tool_choice": Option(
            flag="--enable-auto-tool-choice", type=bool, style=Style.SWITCH, help="needs tool_call_parser"
        ),
        "tool_call_parser": Option(flag="--tool-call-parser", type=str, help="e.g. hermes, llama3_json, mistral"),
        "chat_template": Option(
            flag="--chat-template", type=str, style=Style.MODEL_FILE, help="a template file of the model's directory"
        ),
        # vllm/engine/arg_utils.py: StructuredOutputsConfig, ModelConfig and SchedulerConfig fields.
        "reasoning_parser": Option(flag="--reasoning-parser", type=str, help="e.g. deepseek_r1, qwen3"),
        "generation_config": Option(
            flag="--generation-config", type=str, help="auto (the model's), vllm (none), or a folder path"
        ),
        "stream_interval": Option(flag="--stream-interval", type=int, minimum=1, help="tokens per stream chunk"),
        # vllm/envs.py and vllm/entrypoints/openai/serving_responses.py (see the module docstring).
        "responses_store": Option(
            flag=RESPONSES_STORE_ENV,
            type=bool,
            style=Style.ENV,
            help="keep Responses API responses in memory (store, previous_response_id); lost on restart",
        ),
    },
    env={**OFFLINE_ENV, "VLLM_NO_USAGE_STATS": "1", **VLLM_CACHE_ENV},
    abbreviates=True,
    refused_flags={"--model": "nexa gives the mounted model's path"}
    | dict.fromkeys(("-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp"), WHY_GPUS)
    | dict.fromkeys(("--download-dir", "--hf-token", "--revision", "--code-revision", "--tokenizer-revision"), WHY_HUB)
    | {"--api-key": WHY_AUTH}
    | dict.fromkeys(("--ssl-keyfile", "--ssl-certfile"), WHY_TLS)
    | {"--uds": "nexa reaches the runtime on its port"}
    | {"--kv-cache-memory-bytes": WHY_MEMORY}
    | {"--config": WHY_CONFIG_FILE}
    # vllm/config/parallel.py (ParallelConfig: nnodes, node_rank, master_addr, master_port,
    # distributed_executor_backend) and `--headless` (vllm/entrypoints/cli/serve.py).
    | dict.fromkeys(
        ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless", "--distributed-executor-backend"),
        WHY_GROUP,
    ),
    default_shm_bytes=GPU_SHM_BYTES,
    memory_setting="gpu_memory_utilization",
    # vllm/entrypoints/anthropic/api_router.py: POST /v1/messages and /v1/messages/count_tokens
    # (Anthropic's Messages API, translated by vLLM to its chat serving), since 0.11.0.
    # vllm/entrypoints/openai/serving_responses.py: POST /v1/responses (OpenAI's Responses API, with
    # GET and cancel of a stored response, kept in the server's memory), since 0.10.0.
    native_apis={"/v1/messages": "0.11.0", "/v1/messages/count_tokens": "0.11.0", "/v1/responses": "0.10.0"},
    responses_store="responses_store",
    readiness_path="/health",
    metrics=Metrics(
        path="/metrics",
        waiting="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        kv_cache=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        # V1 counts prompt tokens looked up and found; 0.8-0.9 had them as gpu_…; V0 a hit-rate gauge.
        prefix_cache_counters=(
            ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
            ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
        ),
        prefix_cache_ratio=("vllm:gpu_prefix_cache_hit_rate",),
        ttft=("vllm:time_to_first_token_seconds",),
        # Renamed to inter-token latency in later releases.
        tpot=("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    ),
    # vllm/entrypoints/pooling (POST /rerank, /v1/rerank, /v2/rerank, /score, /v1/score: a pooling
    # model's, since 0.7) and vllm/entrypoints/serve/tokenize (POST /tokenize, /detokenize): every one;
    # and vllm/entrypoints/openai/speech_to_text (OpenAIServingTranscription, …Translation): POST
    # /v1/audio/transcriptions and /v1/audio/translations for speech-to-text models (Whisper,
    # Voxtral), the OpenAI request form; vLLM's "OpenAI-compatible server" lists both.
    capabilities=frozenset(c for c in Capability if not c.media) | {Capability.TRANSCRIPTION, Capability.TRANSLATION},
    pipeline_parallel_flag="--pipeline-parallel-size",
    # vLLM's docs/features/sleep_mode.md and vllm/entrypoints/openai/api_server.py: `--enable-sleep-mode`
    # with `POST /sleep?level=1` (level 1 offloads the weights to CPU RAM and discards the KV cache),
    # `POST /wake_up` and `GET /is_sleeping` -> {"is_sleeping": bool}. The routes sit under
    # `if envs.VLLM_SERVER_DEV_MODE:` (api_server.py, 0.8.x; `register_vllm_dev_api_routers` in later
    # releases): served only with VLLM_SERVER_DEV_MODE=1, which also serves the other dev routes
    # (/reset_prefix_cache, /collective_rpc, ...). The runtime listens only on the node's runtime
    # address, reached by the node agent alone, so they stay out of clients' reach.
    native_sleep=NativeSleep(
        flag="--enable-sleep-mode",
        env={"VLLM_SERVER_DEV_MODE": "1"},
        sleep_path="/sleep?level=1",
        wake_path="/wake_up",
        state_path="/is_sleeping",
        since="0.8.0",
        releases="level 1: the KV cache is discarded, the weights move to CPU RAM (the same pool on unified memory)",
    ),
)
