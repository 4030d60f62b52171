"""`nexa demo` (what `bash .ci/dev run` starts): a whole local cluster, used as a person would use it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.conftest import free_port, require_tool

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 120


def _ours(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (the demo's own directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(cmdline)
    return found


def test_the_demo_runs_a_cluster_that_answers_and_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    require_tool("docker-registry")
    state = tmp_path / "demo"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "demo.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nexa", "demo", "--state-dir", str(state), "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S
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
        admin, inference = fields["admin key"], fields["inference key"]
        assert f"{url}/" in text and "curl -s" in text and "from openai import OpenAI" in text

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

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while _ours(str(state)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ours(str(state)) == []  # nodes, sim runtimes, registry and S3 store all stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        log.close()
