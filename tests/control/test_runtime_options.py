"""What operators set for a runtime, through a real controller: typed settings reach the signed command
line, and `options.extra_args` passes any other flag but refuses, with a 422 naming it, every flag
nexa owns (over the HTTP API and through `nexa deployments create`).

`dep_reg` and `dial` (tests/control/conftest.py) run a real controller and connect raw nodes that
heartbeat GB10 inventories over the real channel; the runtimes are registered by digest against
the run's OCI registry (`fleet_image`), never pulled.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import trio

from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, node_view, ok
from tests.support.deployments import fleet_image, names, online, set_where
from tests.support.models import bring_to

GIB = 2**30


async def _registry(http: Any, s3: S3Store, images: BuiltImages) -> None:
    image = fleet_image(images)
    for kind in ("vllm", "sglang"):
        await ok(http.post("/api/v1/runtimes", json={"name": kind, "kind": kind, "version": "1", "image": image}), 201)
    await bring_to(http, s3, "tiny", "v1", "Approved")


def _body(name: str, runtime: str, port: int, **options: Any) -> dict[str, Any]:
    return {
        "name": name,
        "runtime": runtime,
        "model": {"model": "tiny", "version": "v1"},
        "resources": {"accelerators": 1, "memory_bytes": 24 * GIB},
        "options": {"port": port, **options},
    }


async def _cli(c: Controller, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "NEXA_URL": c.url, "NEXA_TOKEN": c.admin_key}
    done = await trio.run_process(
        [sys.executable, "-m", "nexa", *args], capture_stdout=True, capture_stderr=True, env=env, check=False
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.mark.slow
async def test_extra_args_giving_a_flag_nexa_owns_is_a_422_naming_it_and_nothing_changes(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    await online(dep_reg, dial, nursery, "n1")
    async with dep_reg.client() as http:
        await _registry(http, s3_store, test_images)
        refusals = {
            # --flag=value, and --flag value, and vLLM's underscore spelling of a flag
            "--port": ["--max-log-len=100", "--port=9000"],
            "--served-model-name": ["--served-model-name", "other"],
            "--download-dir": ["--download_dir", "/tmp/hub"],
            # the memory bound: extra_args never turns the unified-memory guard off
            "--gpu-memory-utilization": ["--gpu-memory-utilization=0.95"],
            "--tool-call-parser": ["--tool-call-parser", "hermes"],
        }
        for flag, extra in refusals.items():
            refused = await http.post("/api/v1/deployments", json=_body("chat-v", "vllm", 18100, extra_args=extra))
            err = assert_envelope(refused, 422, "runtime_flag_owned")
            assert flag.replace("-", "_") in str(err["message"]).replace("-", "_"), err
        # The message says what to do instead.
        err = assert_envelope(
            await http.post(
                "/api/v1/deployments", json=_body("chat-v", "vllm", 18100, extra_args=["--tool-call-parser=hermes"])
            ),
            422,
            "runtime_flag_owned",
        )
        assert "give settings.tool_call_parser instead" in str(err["message"])
        # A shape problem is a 400 before any flag is looked at; beside a full command, a 400 too.
        assert_envelope(
            await http.post("/api/v1/deployments", json=_body("chat-v", "vllm", 18100, extra_args=[""])),
            400,
            "invalid_request",
        )
        both = _body("chat-v", "vllm", 18100, extra_args=["--max-log-len=1"], command=["vllm", "serve", "/m"])
        assert_envelope(await http.post("/api/v1/deployments", json=both), 400, "invalid_request")
        # A chat template names a file of the model's directory: tiny@v1 is one object, it has none.
        template = _body("chat-v", "vllm", 18100, settings={"chat_template": "chat.jinja"})
        err = assert_envelope(await http.post("/api/v1/deployments", json=template), 400, "invalid_request")
        assert "settings.chat_template: the model is one file, not a directory" in str(err["message"])
        assert (await ok(http.get("/api/v1/deployments")))["deployments"] == []
    assert (await node_view(dep_reg, "n1"))["desired_generation"] == 1

    # The CLI: `--extra-arg=--flag` passes it; a flag nexa owns is refused with the API's code and words.
    rc, _, err_text = await _cli(
        dep_reg, "deployments", "create", "chat-v", "--runtime", "vllm", "--model", "tiny:v1",
        "--accelerators", "1", "--memory-bytes", str(24 * GIB), "--port", "18100",
        "--extra-arg=--hf-token", "--extra-arg=abc",
    )  # fmt: skip
    assert rc == 1 and "runtime_flag_owned" in err_text and "--hf-token" in err_text, err_text
    assert "model hub" in err_text
    async with dep_reg.client() as http:
        assert (await ok(http.get("/api/v1/deployments")))["deployments"] == []


@pytest.mark.slow
async def test_a_tool_call_parser_reaches_the_signed_vllm_and_sglang_command_lines(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    n1 = await online(dep_reg, dial, nursery, "n1")
    async with dep_reg.client() as http:
        await _registry(http, s3_store, test_images)
        vllm = _body(
            "chat-v",
            "vllm",
            18100,
            settings={"enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
            extra_args=["--max-log-len", "100"],
        )
        await ok(http.post("/api/v1/deployments", json=vllm), 201)
        pushed = await set_where(n1.node, lambda s: "chat-v" in names(s))
    [a] = pushed.assignments
    command = [*a.runtime.entrypoint, *a.runtime.command]  # the process: `vllm` is the container's entrypoint
    assert command[:3] == ["vllm", "serve", "/models/model"]  # tiny@v1 is one object
    # Settings in name order after nexa's flags (the derived memory bound among them), extra_args last.
    assert command[command.index("--port") + 2 :] == [
        "--enable-auto-tool-choice",
        "--gpu-memory-utilization", "0.201",
        "--reasoning-parser", "qwen3",
        "--tool-call-parser", "hermes",
        "--max-log-len", "100",
    ]  # fmt: skip

    rc, _, err_text = await _cli(
        dep_reg, "deployments", "create", "chat-s", "--runtime", "sglang", "--model", "tiny:v1",
        "--accelerators", "1", "--memory-bytes", str(24 * GIB), "--port", "18200",
        "--set", "tool_call_parser=qwen25", "--set", "stream_interval=4", "--extra-arg=--log-level=warning",
    )  # fmt: skip
    assert rc == 0, err_text
    pushed = await set_where(n1.node, lambda s: "chat-s" in names(s))
    [s] = [x for x in pushed.assignments if x.deployment == "chat-s"]
    command = s.runtime.command
    assert command[command.index("--enable-metrics") + 1 :] == [
        "--mem-fraction-static", "0.201",
        "--stream-interval", "4",
        "--tool-call-parser", "qwen25",
        "--log-level=warning",
    ]  # fmt: skip
    async with dep_reg.client() as http:
        shown = await ok(http.get("/api/v1/deployments/chat-s"))
    options = shown["deployment"]["options"]
    assert options["settings"] == {"tool_call_parser": "qwen25", "stream_interval": 4}
    assert options["extra_args"] == ["--log-level=warning"]
