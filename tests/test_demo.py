"""`nexa demo` (what `bash .ci/dev run` starts): a whole local cluster, used as a person would use it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from nexa.localparts import LocalPodman, cache_dir, llama_parts_missing
from tests.conftest import IN_CI, free_port, require_tool
from tests.realparts import CONTAINERS_CONF

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 120
#: The first real run builds the python root filesystem (~1 min) and both images; then two replicas load.
REAL_START_TIMEOUT_S = 600


def _ours(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (the demo's own directory)."""
    return list(_our_processes(marker).values())


def _our_processes(marker: str) -> dict[int, str]:
    """Live processes that mention `marker`, by PID: the parts of the demo this test started."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found[int(proc.name)] = cmdline
    return found


def _start(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """`nexa demo` in the background with its state in `tmp_path/demo`; the process and its URL."""
    port = free_port()
    with (tmp_path / "demo.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nexa",
                "demo",
                "--state-dir",
                str(tmp_path / "demo"),
                "--listen",
                f"127.0.0.1:{port}",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    return proc, f"http://127.0.0.1:{port}"


def _banner(proc: subprocess.Popen[str], tmp_path: Path, url: str, timeout_s: float) -> tuple[str, str, list[str]]:
    """Read the demo's output up to the end of its banner: the admin key, the inference key and the lines."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if line.startswith("Ctrl-C stops everything"):
            break
    text = "\n".join(lines)
    assert "Ctrl-C stops everything" in text, text + (tmp_path / "demo.log").read_text()[-3000:]
    fields = {
        line.split()[0] + " " + line.split()[1]: line.split()[2]
        for line in lines
        if line.startswith("  ") and len(line.split()) > 2
    }
    assert f"{url}/" in text and "curl -s" in text and "from openai import OpenAI" in text
    return fields["admin key"], fields["inference key"], lines


def _ctrl_c(proc: subprocess.Popen[str], state: Path) -> None:
    """SIGINT: the demo exits 0 and, soon after, no process mentions its state dir."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 15
    while _ours(str(state)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ours(str(state)) == []


def _finish(proc: subprocess.Popen[str], state: Path) -> None:
    """After a test that failed half-way: Ctrl-C first (the demo stops its parts), then SIGKILL to the
    demo and to any part of it still running (by PID: each was started by this test's demo)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in _our_processes(str(state)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.stdout is not None:
        proc.stdout.close()


def test_the_demo_runs_a_cluster_that_answers_and_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    require_tool("docker-registry")
    state = tmp_path / "demo"
    proc, url = _start(tmp_path)
    try:
        admin, inference, _ = _banner(proc, tmp_path, url, START_TIMEOUT_S)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=inference, max_retries=0)
        try:
            answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
        finally:
            client.close()
        assert answer.choices[0].message.content and answer.usage is not None and answer.usage.completion_tokens == 32

        env = {**os.environ, "NEXA_URL": url, "NEXA_TOKEN": admin}
        listed = subprocess.run(
            [sys.executable, "-m", "nexa", "nodes", "list", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        nodes = json.loads(listed.stdout)["nodes"]
        assert sorted(n["id"] for n in nodes) == ["demo-1", "demo-2", "demo-3", "demo-4"]
        assert {n["state"] for n in nodes} == {"Ready"}
        assert _ours(str(state)), "the demo's parts should be running"
        _ctrl_c(proc, state)  # nodes, sim runtimes, registry and S3 store all stopped
    finally:
        _finish(proc, state)


def test_the_real_demo_serves_llama_cpp_from_podman_and_ctrl_c_removes_its_containers(tmp_path: Path) -> None:
    require_tool("docker-registry")
    if missing := llama_parts_missing(cache_dir()):
        if IN_CI:
            pytest.fail(f"required in CI for `nexa demo --real`: {missing}", pytrace=False)
        pytest.skip(f"`nexa demo --real` needs {missing}")
    state = tmp_path / "demo"
    proc, url = _start(tmp_path, "--real")
    podman = LocalPodman(state / "podman", containers_conf=CONTAINERS_CONF)
    try:
        _admin, inference, lines = _banner(proc, tmp_path, url, REAL_START_TIMEOUT_S)
        assert any(line.startswith("building the llama-cpp-python image") for line in lines), lines
        running = podman.run("ps", "--format", "{{.Image}}").stdout.split()
        assert len(running) == 2 and all("/nexa-demo/llama-cpp-python@sha256:" in image for image in running)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=inference, max_retries=0, timeout=60)
        try:
            answer = client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hello world"}], max_tokens=8, temperature=0
            )
        finally:
            client.close()
        assert answer.model == "tiny-llama"  # what llama-cpp-python names the GGUF it loaded
        assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 8
        assert answer.choices[0].finish_reason in {"length", "stop"}

        _ctrl_c(proc, state)  # nodes, the podman service, conmon, registry and S3 store all stopped
        assert podman.run("ps", "--all", "--quiet").stdout.split() == []
    finally:
        _finish(proc, state)
        if state.exists():  # what the demo could not remove, and what the podman CLI made here
            podman.run("rm", "--all", "--force", "--time", "0", check=False)
            podman.release()


def test_the_real_demo_refuses_in_one_line_when_a_part_is_missing(tmp_path: Path) -> None:
    """No podman on PATH: exit 2 before anything starts, naming it and saying how to get it."""
    bare = tmp_path / "bin"
    bare.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "nexa", "demo", "--real", "--state-dir", str(tmp_path / "demo")],
        env={**os.environ, "PATH": str(bare)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--real" in done.stderr and "podman" in done.stderr
    assert "apt-get install podman" in done.stderr and "pip install -e '.[real]'" in done.stderr
    assert not (tmp_path / "demo").exists()
