"""`nexa sim-runtime` as a real child process on a loopback port (port 0: it prints the address it
bound), its journal and faults files, and streams read with the official `openai` SDK's sync client
in a worker thread (its async stream leaves an async generator unfinished after `[DONE]`).
Used by tests/test_simruntime.py and tests/test_lora_runtime.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio

MODEL = "sim-model"


@attrs.define
class SimProcess:
    """One `python -m nexa sim-runtime` child and the files it writes."""

    tmp: Path
    proc: subprocess.Popen[str] | None = None
    url: str = ""

    @property
    def journal(self) -> Path:
        return self.tmp / "journal.jsonl"

    @property
    def faults(self) -> Path:
        return self.tmp / "faults.json"

    def start(self, *flags: str) -> SimProcess:
        argv = [sys.executable, "-m", "nexa", "sim-runtime", "--port", "0", "--model", MODEL]
        argv += ["--journal", str(self.journal), "--faults", str(self.faults), *flags]
        env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"}
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        self.url = line.split("listening on ")[1].split()[0]
        return self

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=10)

    async def stream(self, create: Callable[[openai.OpenAI], Any], *, timeout_s: float = 10) -> Streamed:
        """Run `create(client)` (a `stream=True` call) with the sync client in a thread and read it all."""
        return await trio.to_thread.run_sync(partial(_read_stream, self.url, create, timeout_s))

    def events(self) -> list[dict[str, object]]:
        if not self.journal.exists():
            return []
        return [json.loads(line) for line in self.journal.read_text().splitlines()]

    async def wait_event(self, event: str, rid: str) -> dict[str, object]:
        while True:
            for e in self.events():
                if e["event"] == event and e["id"] == rid:
                    return e
            await trio.sleep(0.02)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()


@attrs.define
class Streamed:
    chunks: list[Any]
    #: Seconds from the call to each chunk.
    times: list[float]
    error: Exception | None = None

    def text(self) -> str:
        """The streamed text: chat deltas' content, or completions' text."""
        out = []
        for chunk in self.chunks:
            for choice in chunk.choices:
                out.append((choice.delta.content or "") if chunk.object == "chat.completion.chunk" else choice.text)
        return "".join(out)


def _read_stream(url: str, create: Callable[[openai.OpenAI], Any], timeout_s: float) -> Streamed:
    out = Streamed(chunks=[], times=[])
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout_s) as client:
        sent_at = time.monotonic()
        try:
            with create(client) as stream:
                for chunk in stream:
                    out.times.append(time.monotonic() - sent_at)
                    out.chunks.append(chunk)
        except (openai.APIError, httpx.HTTPError) as exc:
            out.error = exc
    return out


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimProcess]:
    process = SimProcess(tmp_path)
    try:
        yield process
    finally:
        if process.proc is not None:
            process.stop()


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
