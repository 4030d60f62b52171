"""`entrypoints.entrypoint_for`: which container entrypoint makes the adapter's command exactly the process,
from the image config the controller read at registration (issue 29, point 1). Pure; the real
containers are in tests/node/test_entrypoints.py.

The image entrypoints are the published ones: vLLM's `vllm/vllm-openai` `["vllm", "serve"]` (its
docker/Dockerfile), llama.cpp's server image `["/app/llama-server"]` (.devops/cpu.Dockerfile), NVIDIA's NGC
images `["/opt/nvidia/nvidia_entrypoint.sh"]`.
"""

from __future__ import annotations

import pytest

from nexa import adapters
from nexa.adapters import entrypoints
from nexa.adapters.llamacpp import LLAMA_CPP_PYTHON_ADAPTER, LLAMA_SERVER_ADAPTER
from nexa.contracts.models import ImageConfig, ImagePlatform
from nexa.contracts.node import RuntimeKind

AMD64 = ImagePlatform(os="linux", architecture="amd64")
VLLM_CMD = ["vllm", "serve", "/models/m", "--port", "8000"]
LLAMA_CMD = ["llama-server", "--model", "/models/model"]


def image(*entrypoint: str) -> ImageConfig:
    return ImageConfig(platform=AMD64, entrypoint=list(entrypoint), cmd=["--help"])


@pytest.mark.parametrize(
    ("command", "config", "entrypoint", "rest", "how"),
    [
        # The program itself: the image's path for it where it names one.
        (LLAMA_CMD, image("/app/llama-server"), ["/app/llama-server"], LLAMA_CMD[1:], "program"),
        (VLLM_CMD, image("vllm", "serve"), ["vllm"], VLLM_CMD[1:], "program"),
        # An exec wrapper stays in front of the whole command.
        (
            VLLM_CMD,
            image("/opt/nvidia/nvidia_entrypoint.sh"),
            ["/opt/nvidia/nvidia_entrypoint.sh"],
            VLLM_CMD,
            "wrapper",
        ),
        (VLLM_CMD, image("/usr/bin/tini", "--"), ["/usr/bin/tini", "--"], VLLM_CMD, "wrapper"),
        # None, or one that is neither: the adapter's program replaces it.
        (LLAMA_CMD, image(), ["llama-server"], LLAMA_CMD[1:], "set"),
        (LLAMA_CMD, image("/bin/sh", "-c"), ["llama-server"], LLAMA_CMD[1:], "set"),
        (LLAMA_CMD, image("/docker-entrypoint.sh"), ["llama-server"], LLAMA_CMD[1:], "set"),
        # No config recorded (a runtime registered before configs were read).
        (LLAMA_CMD, None, ["llama-server"], LLAMA_CMD[1:], "unknown"),
        # A path in the command is kept as written.
        (["/opt/x/llama-server", "-m", "m"], image("/app/llama-server"), ["/opt/x/llama-server"], ["-m", "m"], "set"),
    ],
)
def test_the_process_is_the_command_once(
    command: list[str], config: ImageConfig | None, entrypoint: list[str], rest: list[str], how: str
) -> None:
    got = entrypoints.entrypoint_for(command, config)
    assert (got.entrypoint, got.command, got.how) == (entrypoint, rest, how)
    process = [*got.entrypoint, *got.command]
    assert process.count(command[-1]) == 1
    # The program the supervisor names when it is missing.
    assert entrypoints.program_of(got.entrypoint, got.command) in {command[0], entrypoint[0]}


def test_the_metrics_variant_is_told_from_the_process_by_name_path_or_after_a_wrapper() -> None:
    server, python = LLAMA_SERVER_ADAPTER.metrics, LLAMA_CPP_PYTHON_ADAPTER.metrics
    kind = RuntimeKind.LLAMACPP
    assert adapters.metrics_for(kind, ["/app/llama-server", "--model", "m"]) is server
    assert (
        adapters.metrics_for(kind, ["/opt/nvidia/nvidia_entrypoint.sh", "python3", "-m", "llama_cpp.server"]) is python
    )
    assert adapters.metrics_for(kind, ["python3", "-m", "llama_cpp.server", "--model", "m"]) is python


def test_runtimes_show_names_what_each_variant_runs_in_the_image() -> None:
    runs = dict(adapters.image_runs(RuntimeKind.LLAMACPP, image("/app/llama-server")))
    assert runs == {
        "llama-server": ["/app/llama-server", "…"],
        "llama-cpp-python": ["python3", "-m", "llama_cpp.server", "…"],
    }
    assert adapters.image_runs(RuntimeKind.SIM, None) == []
    (only,) = adapters.image_runs(RuntimeKind.VLLM, image("/opt/nvidia/nvidia_entrypoint.sh"))
    assert only == ("vllm", ["/opt/nvidia/nvidia_entrypoint.sh", "vllm", "serve", "…"])
