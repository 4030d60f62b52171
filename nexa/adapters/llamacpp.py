"""llama.cpp: its two variants, one runtime kind (`llamacpp`), picked by the `server` setting:
`llama-server` (llama.cpp's own C++ server, the default; flags from `tools/server/README.md`) and
`llama-cpp-python` (`python3 -m llama_cpp.server`, the Python bindings' server; "OpenAI compatible
server"). The image decides which binary is there; the setting tells the adapter which arguments it takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from nexa.adapters.args import LLAMA_CACHE_ENV, WHY_AUTH, WHY_CONFIG_FILE, WHY_GROUP, WHY_HUB, WHY_TLS
from nexa.adapters.base import LLAMA_CPP_PYTHON, LLAMA_SERVER, Adapter, Metrics, Option, Style
from nexa.contracts.capabilities import TEXT_CAPABILITIES, Capability
from nexa.contracts.node import RuntimeKind

#: KV-cache types llama.cpp takes (common/arg.cpp `kv_cache_types`).
_GGML_KV_TYPES: Final = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: The setting naming the program a llama.cpp replica group's other ranks run, and its default.
RPC_SERVER_SETTING: Final = "rpc_server"
RPC_SERVER_PROGRAM: Final = "/app/ggml-rpc-server"
#: llama-server's short flags for typed settings (common/arg.cpp).
_LLAMA_SHORT: Final = {"-c": "ctx_size", "-b": "batch_size", "-ctk": "cache_type_k", "-ctv": "cache_type_v"}

LLAMA_SERVER_ADAPTER: Final = Adapter(
    kind=RuntimeKind.LLAMACPP,
    name=LLAMA_SERVER,
    program=("llama-server",),
    model_flag="--model",
    served_name_flag="--alias",
    host_flag="--host",
    port_flag="--port",
    fixed=("--metrics",),
    gpu_args=("--n-gpu-layers", "999"),
    needs_gpu=False,
    options={
        "ctx_size": Option(flag="--ctx-size", type=int, minimum=0, help="context length (0: the model's)"),
        "parallel": Option(flag="--parallel", type=int, minimum=1, help="slots (concurrent requests)"),
        "batch_size": Option(flag="--batch-size", type=int, minimum=1, help="logical batch size"),
        "threads": Option(flag="--threads", type=int, minimum=1, help="CPU threads"),
        "n_gpu_layers": Option(flag="--n-gpu-layers", type=int, minimum=0, help="layers on the GPU (999: all)"),
        "flash_attn": Option(flag="--flash-attn", type=str, choices=("on", "off", "auto"), help=""),
        "embedding": Option(flag="--embedding", type=bool, style=Style.SWITCH, help="serve /v1/embeddings only"),
        "pooling": Option(flag="--pooling", type=str, choices=("none", "mean", "cls", "last", "rank"), help=""),
        "chat_template": Option(flag="--chat-template", type=str, help="a built-in template name"),
        # common/arg.cpp (the options llama-server takes).
        "jinja": Option(flag="--jinja", type=bool, style=Style.SWITCH, help="the model's Jinja chat template"),
        "chat_template_file": Option(
            flag="--chat-template-file", type=str, style=Style.MODEL_FILE, help="a template file beside the model"
        ),
        "reasoning_format": Option(
            flag="--reasoning-format", type=str, choices=("none", "deepseek", "deepseek-legacy", "auto"), help=""
        ),
        "cont_batching": Option(flag="--cont-batching", type=bool, style=Style.SWITCH, help="(on by default)"),
        "cache_type_k": Option(flag="--cache-type-k", type=str, choices=_GGML_KV_TYPES, help="K cache type"),
        "cache_type_v": Option(flag="--cache-type-v", type=str, choices=_GGML_KV_TYPES, help="V cache type"),
        # common/arg.cpp: `--rerank, --reranking` sets embedding on and pooling `rank` (a reranker model).
        "reranking": Option(flag="--reranking", type=bool, style=Style.SWITCH, help="serve /v1/rerank"),
    },
    env=dict(LLAMA_CACHE_ENV),
    refused_flags={"-m": "nexa gives the mounted model's path"}
    | {"-a": "nexa serves the model under its registered name"}
    | {"--rerank": "a typed setting: give settings.reranking instead"}
    | dict.fromkeys(
        (
            "-hf",
            "-hfr",
            "--hf-repo",
            "-hff",
            "--hf-file",
            "-hft",
            "--hf-token",
            "-hfd",
            "-hfrd",
            "--hf-repo-draft",
            "-mu",
            "--model-url",
            "-dr",
            "--docker-repo",
        ),
        WHY_HUB,
    )
    | dict.fromkeys(("--api-key", "--api-key-file"), WHY_AUTH)
    | dict.fromkeys(("--ssl-key-file", "--ssl-cert-file"), WHY_TLS)
    # The short spellings of the settings that size the KV cache (the context bounds its memory).
    | {f: f"a typed setting: give settings.{n} instead" for f, n in _LLAMA_SHORT.items()}
    | {"--rpc": WHY_GROUP},
    readiness_path="/health",
    probe_tool="curl",
    metrics=Metrics(
        path="/metrics",
        waiting="llamacpp:requests_deferred",
        running="llamacpp:requests_processing",
        # As llama.cpp's tools/server/server-task.cpp names them (checked against the source the
        # llama-cpp-python 0.3.36 sdist vendors): `llamacpp:` + requests_processing, requests_deferred,
        # prompt_tokens_total, tokens_predicted_total, …. The KV-cache gauge is exported by older
        # builds only. No prefix-cache pair (cached prompt tokens are counted apart from the
        # processed ones, not as hits over lookups) and no latency histograms (token-rate gauges).
        kv_cache=("llamacpp:kv_cache_usage_ratio",),
    ),
    # tools/server/server.cpp: /v1/rerank (and /rerank, /reranking) with `--reranking`, /tokenize and
    # /detokenize always (`content` in, `{"tokens"}` out; `tokens` in, `{"content"}` out); no /score,
    # no media; the native APIs from the releases `native_apis` names.
    capabilities=TEXT_CAPABILITIES
    | {Capability.RERANK, Capability.TOKENIZE, Capability.DETOKENIZE}
    | {c for c in Capability if c.native},
    capability_settings={Capability.EMBEDDING: "embedding", Capability.RERANK: "reranking"},
    group_settings={
        # The program a group's other ranks run (`nexa.adapters.groups`): `ggml-rpc-server` since
        # llama.cpp renamed `rpc-server` (ggml-org/llama.cpp#25045, June 2026; the llama.cpp that
        # llama-cpp-python 0.3.36 vendors builds it as `ggml-rpc-server`, tools/rpc/CMakeLists.txt).
        # llama.cpp's images copy every built binary to /app (.devops/*.Dockerfile, `full`), which is
        # not on PATH: give the path (`/app/rpc-server` for images built before the rename).
        RPC_SERVER_SETTING: Option(flag="", type=str, help="the RPC server's program (a path or a name on PATH)"),
    },
)

LLAMA_CPP_PYTHON_ADAPTER: Final = Adapter(
    kind=RuntimeKind.LLAMACPP,
    name=LLAMA_CPP_PYTHON,
    program=("python3", "-m", "llama_cpp.server"),
    model_flag="--model",
    served_name_flag="--model_alias",
    host_flag="--host",
    port_flag="--port",
    gpu_args=("--n_gpu_layers", "-1"),
    needs_gpu=False,
    options={
        "n_ctx": Option(flag="--n_ctx", type=int, minimum=0, help="context length (0: the model's)"),
        "n_batch": Option(flag="--n_batch", type=int, minimum=1, help="prompt batch size"),
        "n_threads": Option(flag="--n_threads", type=int, minimum=1, help="CPU threads"),
        "n_gpu_layers": Option(flag="--n_gpu_layers", type=int, minimum=-1, help="layers on the GPU (-1: all)"),
        "embedding": Option(flag="--embedding", type=bool, style=Style.BOOLEAN, help="serve /v1/embeddings"),
        "chat_format": Option(flag="--chat_format", type=str, help="chat template name (default: the model's)"),
        "seed": Option(flag="--seed", type=int, minimum=0, help="sampling seed"),
        # llama_cpp/server/settings.py (ModelSettings).
        "n_ubatch": Option(flag="--n_ubatch", type=int, minimum=1, help="physical batch size"),
        "flash_attn": Option(flag="--flash_attn", type=bool, style=Style.BOOLEAN, help="flash attention"),
    },
    env=dict(LLAMA_CACHE_ENV),
    abbreviates=True,
    refused_flags=dict.fromkeys(("--hf_pretrained_model_name_or_path", "--hf_model_repo_id"), WHY_HUB)
    | {"--api_key": WHY_AUTH}
    | dict.fromkeys(("--ssl_keyfile", "--ssl_certfile"), WHY_TLS)
    | {"--config_file": WHY_CONFIG_FILE}
    | dict.fromkeys(("--type_k", "--type_v"), "the KV cache's type sizes the context nexa derives (f16 is taken)"),
    # /v1/models answers once the model is loaded (the server loads it before listening).
    readiness_path="/v1/models",
    # No metrics endpoint: routing falls back to the gateway's own in-flight counts.
    metrics=Metrics(path=None),
    # Its tokenizer routes are /extras/tokenize and /extras/detokenize (another shape); no rerank or score.
    capabilities=TEXT_CAPABILITIES,
    capability_settings={Capability.EMBEDDING: "embedding"},
    # 0.3.x ignores `stream_options`: a stream carries no usage chunk (count from the chunks instead).
    stream_usage=False,
)

#: The llama.cpp variants by the `server` setting's value (`SERVER_SETTING`); the first is the default.
LLAMACPP_VARIANTS: Final[Mapping[str, Adapter]] = {
    LLAMA_SERVER: LLAMA_SERVER_ADAPTER,
    LLAMA_CPP_PYTHON: LLAMA_CPP_PYTHON_ADAPTER,
}
