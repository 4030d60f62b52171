"""`nexa.adapters`: the settings operators of each runtime set most, as the command lines they give
(pinned), chat templates from the model's directory, `extra_args` and the flags nexa owns, and
TensorRT-LLM's served-name flag by release."""

from __future__ import annotations

import pytest

from nexa import adapters
from nexa.adapters.args import MAX_EXTRA_ARGS, extra_args_problems
from nexa.adapters.base import Adapter
from nexa.adapters.llamacpp import LLAMA_SERVER_ADAPTER
from nexa.adapters.sglang import SGLANG
from nexa.adapters.trtllm import TRTLLM
from nexa.adapters.vllm import VLLM
from nexa.contracts.node import RuntimeKind

GPU = ["nvidia.com/gpu=0"]
PORT = 18000
HOST = "{runtime_host}"
MODEL = "/models/qwen3-8b"


def _tail(
    adapter: Adapter,
    settings: dict[str, object],
    *,
    model_path: str = MODEL,
    model_dir: str = "",
    extra_args: tuple[str, ...] = (),
    version: str = "",
) -> list[str]:
    """What follows nexa's own flags (model, served name, host, port, fixed, GPU arguments)."""
    command = adapter.launch(
        "qwen3-8b",
        settings,
        GPU,
        PORT,
        model_path=model_path,
        model_dir=model_dir,
        extra_args=extra_args,
        version=version,
    ).command
    start = command.index("--port") + 2 + len(adapter.fixed) + len(adapter.gpu_args)
    return command[start:]


def test_vllm_tool_calling_reasoning_and_a_template_of_the_model() -> None:
    settings: dict[str, object] = {
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
        "chat_template": "templates/tool_use.jinja",
        "generation_config": "vllm",
        "stream_interval": 4,
        "max_model_len": 32768,
        "kv_cache_dtype": "fp8",
        "quantization": "fp8",
    }
    assert adapters.settings_problems(RuntimeKind.VLLM, settings, accelerators=1) == []
    assert _tail(VLLM, settings, extra_args=("--max-log-len", "100")) == [
        "--chat-template", f"{MODEL}/templates/tool_use.jinja",
        "--enable-auto-tool-choice",
        "--generation-config", "vllm",
        "--kv-cache-dtype", "fp8",
        "--max-model-len", "32768",
        "--quantization", "fp8",
        "--reasoning-parser", "qwen3",
        "--stream-interval", "4",
        "--tool-call-parser", "hermes",
        "--max-log-len", "100",
    ]  # fmt: skip


def test_sglang_tool_calling_and_reasoning() -> None:
    settings: dict[str, object] = {
        "tool_call_parser": "qwen25",
        "reasoning_parser": "qwen3",
        "chat_template": "chat_template.jinja",
        "stream_interval": 8,
        "max_total_tokens": 65536,
    }
    assert adapters.settings_problems(RuntimeKind.SGLANG, settings, accelerators=1) == []
    assert _tail(SGLANG, settings) == [
        "--chat-template", f"{MODEL}/chat_template.jinja",
        "--max-total-tokens", "65536",
        "--reasoning-parser", "qwen3",
        "--stream-interval", "8",
        "--tool-call-parser", "qwen25",
    ]  # fmt: skip


def test_trtllm_parsers_beams_and_chunked_prefill() -> None:
    settings: dict[str, object] = {
        "reasoning_parser": "deepseek-r1",
        "tool_parser": "qwen3",
        "max_beam_width": 2,
        "enable_chunked_prefill": True,
    }
    assert adapters.settings_problems(RuntimeKind.TRTLLM, settings, accelerators=1) == []
    assert _tail(TRTLLM, settings, version="1.3.0") == [
        "--enable_chunked_prefill",
        "--max_beam_width", "2",
        "--reasoning_parser", "deepseek-r1",
        "--tool_parser", "qwen3",
    ]  # fmt: skip


def test_llama_server_jinja_reasoning_template_file_and_kv_cache_types() -> None:
    settings: dict[str, object] = {
        "jinja": True,
        "reasoning_format": "deepseek",
        "chat_template_file": "qwen3.jinja",
        "cont_batching": True,
        "cache_type_k": "q8_0",
        "cache_type_v": "q8_0",
    }
    assert adapters.settings_problems(RuntimeKind.LLAMACPP, settings, accelerators=1) == []
    # llama.cpp is given the entry file; a template file is named in the mounted directory.
    tail = _tail(LLAMA_SERVER_ADAPTER, settings, model_path=f"{MODEL}/q4.gguf", model_dir=MODEL)
    assert tail == [
        "--cache-type-k", "q8_0",
        "--cache-type-v", "q8_0",
        "--chat-template-file", f"{MODEL}/qwen3.jinja",
        "--cont-batching",
        "--jinja",
        "--reasoning-format", "deepseek",
    ]  # fmt: skip


def test_llama_cpp_python_batches_and_flash_attention() -> None:
    settings: dict[str, object] = {"server": "llama-cpp-python", "n_ubatch": 256, "flash_attn": True}
    assert adapters.settings_problems(RuntimeKind.LLAMACPP, settings, accelerators=0) == []
    adapter = adapters.adapter_for(RuntimeKind.LLAMACPP, settings)
    assert _tail(adapter, settings) == ["--flash_attn", "true", "--n_ubatch", "256"]


def test_lora_pool_settings_become_their_flags_and_bad_values_are_refused_naming_the_setting() -> None:
    settings: dict[str, object] = {"max_lora_rank": 32, "lora_target_modules": "all", "max_loaded_loras": 4}
    assert adapters.settings_problems(RuntimeKind.SGLANG, settings, accelerators=1) == []
    tail = _tail(SGLANG, settings)
    assert tail[tail.index("--lora-target-modules") + 1] == "all" and "--max-loaded-loras" in tail
    for words in ("q_proj --api-key", "", "   ", "q_proj;rm", "-x"):
        problems = adapters.settings_problems(RuntimeKind.SGLANG, {"lora_target_modules": words}, accelerators=1)
        assert len(problems) == 1 and problems[0].startswith("settings.lora_target_modules: "), (words, problems)
    assert adapters.settings_problems(RuntimeKind.VLLM, {"max_lora_rank": 64}, accelerators=1) == []
    assert _tail(VLLM, {"max_lora_rank": 64})[-2:] == ["--max-lora-rank", "64"]
    # vLLM takes only its MaxLoRARanks (vllm/config/lora.py).
    problems = adapters.settings_problems(RuntimeKind.VLLM, {"max_lora_rank": 24}, accelerators=1)
    assert problems == ["settings.max_lora_rank: one of 1, 8, 16, 32, 64, 128, 256, 320, 512"]


@pytest.mark.parametrize("path", ["/etc/passwd", "../other/chat.jinja", "a/../../b", "", "a//b", "./x"])
def test_a_template_outside_the_model_directory_is_refused(path: str) -> None:
    for kind, name in ((RuntimeKind.VLLM, "chat_template"), (RuntimeKind.LLAMACPP, "chat_template_file")):
        problems = adapters.settings_problems(kind, {name: path}, accelerators=1)
        assert len(problems) == 1 and problems[0].startswith(f"settings.{name}: "), problems


@pytest.mark.parametrize(
    ("kind", "extra", "flag"),
    [
        (RuntimeKind.VLLM, ["--port", "9000"], "--port"),
        (RuntimeKind.VLLM, ["--port=9000"], "--port"),
        (RuntimeKind.VLLM, ["--served_model_name=x"], "--served_model_name"),
        (RuntimeKind.VLLM, ["--gpu-memory-util", "0.99"], "--gpu-memory-util"),  # argparse takes a prefix
        (RuntimeKind.VLLM, ["-tp", "2"], "-tp"),
        (RuntimeKind.VLLM, ["-tp2"], "-tp2"),
        (RuntimeKind.VLLM, ["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
        (RuntimeKind.VLLM, ["--kv-cache-memory-bytes=1"], "--kv-cache-memory-bytes"),
        (RuntimeKind.VLLM, ["--api-key", "k"], "--api-key"),
        (RuntimeKind.VLLM, ["--model", "hub/model"], "--model"),
        (RuntimeKind.SGLANG, ["--mem-fraction-static", "0.9"], "--mem-fraction-static"),
        (RuntimeKind.SGLANG, ["--tp", "2"], "--tp"),
        (RuntimeKind.TRTLLM, ["--free_gpu_memory_fraction=0.9"], "--free_gpu_memory_fraction"),
        (RuntimeKind.TRTLLM, ["--config", "/models/m/x.yaml"], "--config"),
        (RuntimeKind.TRTLLM, ["--served_model_name", "x"], "--served_model_name"),
        (RuntimeKind.LLAMACPP, ["-hf", "org/repo"], "-hf"),
        (RuntimeKind.LLAMACPP, ["--model-url=https://example.com/m.gguf"], "--model-url"),
        (RuntimeKind.LLAMACPP, ["-m", "/m.gguf"], "-m"),
        (RuntimeKind.LLAMACPP, ["--alias", "x"], "--alias"),
        # The context bounds llama.cpp's memory on a unified node: no short way around it.
        (RuntimeKind.LLAMACPP, ["-c", "131072"], "-c"),
        (RuntimeKind.LLAMACPP, ["--ctx-size=131072"], "--ctx-size"),
        (RuntimeKind.LLAMACPP, ["-b", "8192"], "-b"),
        (RuntimeKind.LLAMACPP, ["-ctk", "f32"], "-ctk"),
        (RuntimeKind.LLAMACPP, ["-ctv=f32"], "-ctv"),
    ],
)
def test_extra_args_giving_an_owned_flag_are_refused_naming_it(kind: RuntimeKind, extra: list[str], flag: str) -> None:
    refused = adapters.extra_args_refusals(kind, {}, extra)
    assert len(refused) == 1 and refused[0].startswith(f"{flag}: "), refused


def test_llama_cpp_pythons_kv_cache_type_is_refused_in_extra_args() -> None:
    """Its f16 cache sizes the derived context; argparse would also take a prefix of the flag."""
    python = {"server": "llama-cpp-python"}
    for extra in (["--type_k", "0"], ["--type-v=1"], ["--type_", "0"]):
        [refused] = adapters.extra_args_refusals(RuntimeKind.LLAMACPP, python, extra)
        assert "the KV cache's type sizes the context nexa derives" in refused, refused


def test_other_extra_args_pass_as_given_after_everything_else() -> None:
    extra = ["--max-log-len", "100", "--enable-prompt-tokens-details", "--seed=-1", "-1"]
    assert adapters.extra_args_refusals(RuntimeKind.VLLM, {}, extra) == []
    assert adapters.extra_args_refusals(RuntimeKind.LLAMACPP, {}, ["--mlock", "-md", "/models/d.gguf"]) == []
    assert extra_args_problems(["--x"] * (MAX_EXTRA_ARGS + 1)) == ["extra_args: at most 64 arguments"]
    assert extra_args_problems(["--ok", "", "a\x00b"])[0].startswith("extra_args[1]: ")
    # extra_args never take the memory bound off: the derived flag is still there, before them.
    memory = VLLM.memory_limit({}, weights_bytes=16 * 2**30)
    assert memory is not None
    limit = memory.on(40 * 2**30, 119 * 2**30)
    command = VLLM.launch("m", {}, GPU, PORT, memory=limit, extra_args=["--max-log-len", "1"]).command
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.336"
    assert command[-2:] == ["--max-log-len", "1"]
    # Beside a full command they would be ignored: refused; `sim` takes its flags from its command.
    assert adapters.settings_problems(RuntimeKind.VLLM, {}, accelerators=1, command=["x"], extra_args=["--y"])
    assert adapters.settings_problems(RuntimeKind.SIM, {}, accelerators=0, extra_args=["--y"])


@pytest.mark.parametrize(
    ("version", "named"),
    [("1.3.0rc7", True), ("1.3.0", True), ("v1.4.1", True), ("1.3.0rc6", False), ("1.2.0", False), ("latest", False)],
)
def test_trtllm_gets_the_served_name_flag_only_from_the_release_that_has_it(version: str, named: bool) -> None:
    command = TRTLLM.launch("qwen3-8b", {}, GPU, PORT, model_path=MODEL, version=version).command
    assert ("--served_model_name" in command) is named
    # Without it trtllm-serve names the model after its directory, which is the model's name.
    assert command[:2] == ["trtllm-serve", MODEL]


def test_a_template_must_be_a_file_of_the_model_version() -> None:
    files = ["config.json", "tokenizer.json", "templates/tool_use.jinja", "model.safetensors"]
    ok_settings: dict[str, object] = {"chat_template": "templates/tool_use.jinja", "max_model_len": 4096}
    assert adapters.model_file_problems(RuntimeKind.VLLM, ok_settings, files) == []
    [missing] = adapters.model_file_problems(RuntimeKind.VLLM, {"chat_template": "chat.jinja"}, files)
    assert missing == "settings.chat_template: the model version has no file 'chat.jinja' (its manifest lists 4)"
    [one_file] = adapters.model_file_problems(RuntimeKind.LLAMACPP, {"chat_template_file": "t.jinja"}, None)
    assert one_file.startswith("settings.chat_template_file: the model is one file, not a directory")
    # A built-in template name (llama-server's --chat-template) is no file of the model.
    assert adapters.model_file_problems(RuntimeKind.LLAMACPP, {"chat_template": "chatml"}, None) == []
