"""`nexa runtimes qualify` against real runtime images on real podman, through a real controller and
two real `nexa node` agents (`llama_cluster`, tests/support/realmodel.py), as an operator runs it.

A real llama.cpp image passes every step it can judge (the image is one parameter: the
llama-cpp-python variant `llama_image` now; a C++ `llama-server` image fixture joins the list with
its settings). An image with the wrong program fails at the `process` step, which names the
program and what to do: busybox registered as a llama.cpp runtime (no `/app/llama-server` in it),
and the Debian python image without llama_cpp (its `python3 -m llama_cpp.server` exits).
"""

from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from nexa import adapters
from nexa.contracts.node import RuntimeKind
from tests.conftest import Controller
from tests.realparts import BuiltImages, PodmanService, S3Store
from tests.support.api import ok
from tests.support.realmodel import Node, register_model, runtime_logs

pytestmark = pytest.mark.slow

#: (image fixture, the replica's settings for that llama.cpp variant).
LLAMA_IMAGES = [
    # llama.cpp's own C++ server (the default variant), laid out as its published image.
    pytest.param("llama_server_image", {"ctx_size": 512}, id="llama-server"),
    pytest.param("llama_image", {"server": "llama-cpp-python", "n_ctx": 512, "seed": 1}, id="llama-cpp-python"),
]


async def _cli(controller: Controller, *argv: str) -> tuple[int, str, str]:
    env = {**os.environ, "NEXA_URL": controller.url, "NEXA_TOKEN": controller.admin_key}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "nexa", *argv], capture_output=True, text=True, timeout=400, check=False, env=env
        )

    done = await trio.to_thread.run_sync(run)
    return done.returncode, done.stdout, done.stderr


async def _register(controller: Controller, name: str, image: str) -> None:
    async with controller.client() as http:
        body = {"name": name, "kind": "llamacpp", "version": "1", "image": image}
        await ok(http.post("/api/v1/runtimes", json=body), 201)


def _steps(stdout: str) -> dict[str, str]:
    return {
        line.split()[0]: line.split()[1] for line in stdout.splitlines()[1:] if line.startswith("  ") and line[2] != " "
    }


@pytest.mark.parametrize(("image_fixture", "settings"), LLAMA_IMAGES)
@pytest.mark.usefixtures("llama_build")  # its image fixture is taken by name, below
async def test_a_real_llama_cpp_image_qualifies_on_a_real_node(
    llama_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    tiny_gguf: Path,
    podman_service: PodmanService,
    request: pytest.FixtureRequest,
    image_fixture: str,
    settings: dict[str, Any],
) -> None:
    controller, _ = llama_cluster
    image: str = request.getfixturevalue(image_fixture)
    await _register(controller, "llama", image)
    await register_model(controller, s3_store, "tiny", tiny_gguf)
    code, out, err = await _cli(
        controller, "runtimes", "qualify", "llama", "--node", "cpu-1", "--model", "tiny",
        "--settings", json.dumps(settings), "--timeout", "180",
    )  # fmt: skip
    assert code == 0, f"{out}\n{err}\n{runtime_logs(podman_service)}"
    steps = _steps(out)
    assert list(steps) == ["placement", "process", "ready", "answer", "metrics", "cache", "memory", "stop"]
    for name in ("placement", "process", "ready", "answer", "stop"):
        assert steps[name] == "pass", out
    # The process as it ran: the adapter's program (as the image names it by path, llama.cpp's
    # `/app/llama-server`) and its arguments, exactly once.
    program = adapters.adapter_for(RuntimeKind.LLAMACPP, settings).program
    words = next(line for line in out.splitlines() if "ran: " in line).split("ran: ", 1)[1].split()
    assert posixpath.basename(words[0]) == program[0] and words[1 : len(program)] == list(program[1:]), out
    assert [posixpath.basename(w) for w in words].count(posixpath.basename(program[-1])) == 1, out
    assert words.count("--model") == 1, out
    assert steps["cache"] == "pass" and steps["memory"] == "pass", out  # its cache mounted, its memory measured
    async with controller.client() as http:
        [q] = (await ok(http.get("/api/v1/qualifications", params={"runtime": "llama"})))["qualifications"]
        record = q["qualification"]
        assert record["passed"] and record["node_id"] == "cpu-1" and record["gpu_model"] == "none"
        assert record["image_digest"] == image.rpartition("@")[2]
        ready = next(s for s in record["steps"] if s["name"] == "ready")
        assert 0 < ready["figures"]["time_to_ready_s"] < 180
        # The qualification replica is gone: no container of it is left on the node.
        node = await ok(http.get("/api/v1/nodes/cpu-1"))
        assert node["assignments"] == []
    names = podman_service.cli("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split()
    assert not [n for n in names if "qualify-llama" in n]


async def test_an_image_with_the_wrong_program_fails_at_the_step_that_names_it(
    llama_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    tiny_gguf: Path,
    test_images: BuiltImages,
    python_image: str,
) -> None:
    controller, _ = llama_cluster
    await register_model(controller, s3_store, "tiny", tiny_gguf)
    cases = [
        # busybox as llama.cpp's default server: no llama-server program in the image.
        ("busybox", test_images.busybox, {}),
        # Debian's python without llama_cpp: `python3 -m llama_cpp.server` exits at once.
        ("bare-python", python_image, {"server": "llama-cpp-python"}),
    ]
    for name, image, settings in cases:
        program = " ".join(adapters.adapter_for(RuntimeKind.LLAMACPP, settings).program)
        await _register(controller, name, image)
        code, out, err = await _cli(
            controller, "runtimes", "qualify", name, "--node", "cpu-2", "--model", "tiny",
            "--settings", json.dumps(settings), "--timeout", "120",
        )  # fmt: skip
        assert code == 1, out + err
        steps = _steps(out)
        assert steps["process"] == "fail", out
        assert [steps[s] for s in ("ready", "answer", "metrics", "cache", "memory")] == ["skipped"] * 5
        assert steps["stop"] == "pass", out
        assert f"nexa: error: qualification_failed: step process: program {program}: " in err, err
        assert f"what to do: check that image {image} runs the llamacpp adapter's program `{program}`" in err
        async with controller.client() as http:
            [q] = (await ok(http.get("/api/v1/qualifications", params={"runtime": name})))["qualifications"]
            assert q["qualification"]["passed"] is False and q["qualification"]["failed_step"] == "process"
            job = await ok(http.get(f"/api/v1/jobs/{q['qualification']['job']}"))
            assert job["state"] == "failed" and job["summary"].startswith("qualification_failed at step process: ")
