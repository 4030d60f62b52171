"""`nexa sim-runtime` as a real process on a loopback port, driven with the official `openai` SDK.

Policy: loopback only, port 0 (the process prints the address it bound); every test bounded by
`trio.fail_after`; timings are asserted only as "not before the time to first token". Streams are
read with the SDK's sync client in a worker thread: its async stream leaves an async generator
unfinished after `[DONE]`, which trio reports as a ResourceWarning (an error here).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from nexa.adapters.vllm import RESPONSES_STORE_ENV
from nexa.contracts.gateway import Capability
from nexa.simruntime import WORDS, native
from nexa.simruntime.asgi import BadRequest
from tests.support.simprocess import MODEL, SimProcess, chat, sim

__all__ = ["sim"]  # the fixture, used by name

TIMEOUT_S = 20
CANARY = "zebra-canary-7f3a"


# --- refusals ------------------------------------------------------------------------------------


def test_refuses_to_start_without_the_simulation_switch() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NEXA_SIMULATION_ONLY"}
    argv = [sys.executable, "-m", "nexa", "sim-runtime", "--port", "0"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "NEXA_SIMULATION_ONLY=1" in result.stderr
    assert "listening" not in result.stdout
    # Set, but not to 1: still refused.
    result = subprocess.run(
        argv, env={**env, "NEXA_SIMULATION_ONLY": "yes"}, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 2


def test_refuses_a_non_loopback_host_and_bad_flags() -> None:
    env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"}
    argv = [sys.executable, "-m", "nexa", "sim-runtime", "--host", "0.0.0.0", "--port", "0", "--tokens-per-s", "0"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "loopback" in result.stderr
    assert "--tokens-per-s" in result.stderr


# --- the OpenAI API --------------------------------------------------------------------------------


async def test_chat_unary_is_deterministic_and_counts_tokens(sim: SimProcess) -> None:
    sim.start("--ttft-ms", "5", "--tokens-per-s", "1000", "--output-tokens", "8")
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            models = await client.models.list()
            first = await client.chat.completions.create(model=MODEL, messages=chat("one two three"), max_tokens=5)
            again = await client.chat.completions.create(model=MODEL, messages=chat("one two three"), max_tokens=5)
            other = await client.chat.completions.create(model=MODEL, messages=chat("something else"), max_tokens=5)
            full = await client.chat.completions.create(model=MODEL, messages=chat("one two three"))
    assert [m.id for m in models.data] == [MODEL]
    assert first.object == "chat.completion"
    assert first.model == MODEL
    text = first.choices[0].message.content
    assert text is not None
    assert len(text.split()) == 5
    assert all(word in WORDS for word in text.split())
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "length"  # max_tokens cut it short
    assert again.choices[0].message.content == text  # same prompt, same answer
    assert other.choices[0].message.content != text
    assert first.usage is not None
    # "be brief" + "one two three": five words.
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (5, 5, 10)
    assert full.choices[0].finish_reason == "stop"
    assert full.usage is not None
    assert full.usage.completion_tokens == 8
    assert (full.choices[0].message.content or "").startswith(text)


async def test_chat_stream_follows_openai_framing_with_and_without_usage(sim: SimProcess) -> None:
    ttft_s = 0.3
    sim.start("--ttft-ms", str(ttft_s * 1000), "--tokens-per-s", "500", "--output-tokens", "6")
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            unary = await client.chat.completions.create(model=MODEL, messages=chat("stream me"))
            with_usage = await sim.stream(
                lambda c: c.chat.completions.create(
                    model=MODEL, messages=chat("stream me"), stream=True, stream_options={"include_usage": True}
                )
            )
            plain = await sim.stream(
                lambda c: c.chat.completions.create(model=MODEL, messages=chat("stream me"), stream=True)
            )

    chunks = with_usage.chunks
    assert with_usage.error is None
    first_token = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    assert with_usage.times[first_token] >= ttft_s  # never before the time to first token
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert with_usage.text() == unary.choices[0].message.content
    # The last token chunk is followed by one with the finish reason, then a usage-only chunk.
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 6)
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage there is no usage chunk at all.
    assert plain.error is None
    assert all(c.usage is None and c.choices for c in plain.chunks)
    assert plain.chunks[-1].choices[0].finish_reason == "stop"
    assert plain.text() == with_usage.text()


async def test_chat_tool_calls_and_stop_strings_as_vllm_answers_them(sim: SimProcess) -> None:
    sim.start("--ttft-ms", "5", "--tokens-per-s", "1000", "--output-tokens", "8")
    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    tools: Any = [{"type": "function", "function": {"name": "weather", "parameters": params}}]
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            called = await client.chat.completions.create(model=MODEL, messages=chat("rain?"), tools=tools)
            streamed = await sim.stream(
                lambda c: c.chat.completions.create(model=MODEL, messages=chat("rain?"), tools=tools, stream=True)
            )
            answered = await client.chat.completions.create(
                model=MODEL,
                tools=tools,
                messages=[*chat("rain?"), {"role": "tool", "tool_call_id": "call_1", "content": "yes"}],  # type: ignore[list-item]
            )
            full = await client.chat.completions.create(model=MODEL, messages=chat("stop me"))
            words = (full.choices[0].message.content or "").split()
            stopped = await client.chat.completions.create(model=MODEL, messages=chat("stop me"), stop=[words[2]])
    [call] = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls" and called.choices[0].message.content is None
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "sim", "days": 1}  # type: ignore[union-attr]
    pieces = [tc for c in streamed.chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "weather"  # type: ignore[union-attr]
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments  # type: ignore[union-attr]
    assert streamed.chunks[-1].choices[0].finish_reason == "tool_calls"
    assert answered.choices[0].finish_reason == "stop" and answered.choices[0].message.content  # a tool result: text
    # vLLM's `stop_reason`: the stop string that ended the output, which leaves it out.
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra == {"stop_reason": words[2]}
    assert choice.message.content == " ".join(words[: words.index(words[2])])


async def test_completions_unary_and_streamed(sim: SimProcess) -> None:
    sim.start("--ttft-ms", "5", "--tokens-per-s", "1000", "--output-tokens", "4")
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            unary = await client.completions.create(model=MODEL, prompt="complete this please", max_tokens=3)
            batch = await client.completions.create(model=MODEL, prompt=["first prompt", "second one here"])
            streamed = await sim.stream(
                lambda c: c.completions.create(
                    model=MODEL,
                    prompt="complete this please",
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
    assert unary.object == "text_completion"
    assert len(unary.choices[0].text.split()) == 3
    assert unary.choices[0].finish_reason == "length"
    assert unary.usage is not None
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens) == (3, 3)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text != batch.choices[1].text
    assert batch.usage is not None
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (5, 8)
    assert streamed.error is None
    assert streamed.text() == unary.choices[0].text
    assert streamed.chunks[-2].choices[0].finish_reason == "length"
    assert streamed.chunks[-1].choices == []
    assert streamed.chunks[-1].usage is not None
    assert streamed.chunks[-1].usage.completion_tokens == 3


async def test_embeddings_batch_unit_norm_and_deterministic(sim: SimProcess) -> None:
    sim.start("--embedding-dim", "64")
    texts = ["the first text", "a second", "the first text"]
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            as_base64 = await client.embeddings.create(model=MODEL, input=texts)  # the SDK's default encoding
            as_floats = await client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
            single = await client.embeddings.create(model=MODEL, input="a second", encoding_format="float")
    assert [d.index for d in as_floats.data] == [0, 1, 2]
    vectors = [d.embedding for d in as_floats.data]
    assert all(len(v) == 64 for v in vectors)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-9 for v in vectors)
    assert vectors[0] == vectors[2]
    assert vectors[0] != vectors[1]
    assert single.data[0].embedding == vectors[1]
    for packed, exact in zip(as_base64.data, vectors, strict=True):  # float32 on the wire
        assert all(abs(a - b) < 1e-6 for a, b in zip(packed.embedding, exact, strict=True))
    assert as_floats.usage.prompt_tokens == 8  # words, each input at least one


async def test_bad_requests_get_openai_shaped_errors(sim: SimProcess) -> None:
    sim.start()
    async with sim.client() as client, httpx.AsyncClient(base_url=sim.url) as http:
        with trio.fail_after(TIMEOUT_S):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=MODEL, messages=[])
            bad_json = await http.post("/v1/completions", content=b"{not json")
            no_input = await http.post("/v1/embeddings", json={"model": MODEL})
            health = await http.get("/health")
            metrics = await http.get("/metrics")
    assert info.value.status_code == 400
    assert bad_json.status_code == 400
    error = bad_json.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == "invalid_request_error"
    assert no_input.json()["error"]["param"] == "input"
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 0' in metrics.text
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0' in metrics.text
    assert f'nexa_sim_requests_total{{model_name="{MODEL}"}} 3' in metrics.text


# --- faults and the journal --------------------------------------------------------------------------


async def test_faults_file_fail_before_then_fail_after_then_healthy(sim: SimProcess) -> None:
    sim.start("--ttft-ms", "5", "--tokens-per-s", "1000", "--output-tokens", "6")
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            sim.faults.write_text(json.dumps({"fail": "before"}))
            with pytest.raises(openai.InternalServerError):
                await client.chat.completions.create(
                    model=MODEL, messages=chat("x"), extra_headers={"X-Nexa-Request-Id": "r-fail"}
                )
            sim.faults.write_text(json.dumps({"fail": "before", "status": 503}))
            with pytest.raises(openai.APIStatusError) as info:
                await client.completions.create(model=MODEL, prompt="x")
            assert info.value.status_code == 503

            sim.faults.write_text(json.dumps({"fail": "after", "after_tokens": 2}))
            cut_off = await sim.stream(
                lambda c: c.chat.completions.create(
                    model=MODEL, messages=chat("x"), stream=True, extra_headers={"X-Nexa-Request-Id": "r-cut"}
                )
            )
            assert cut_off.error is not None  # the connection closed mid-body
            assert len(cut_off.text().split()) == 2  # two tokens, then nothing: no finish chunk
            assert all(choice.finish_reason is None for c in cut_off.chunks for choice in c.choices)

            sim.faults.unlink()
            ok = await client.chat.completions.create(model=MODEL, messages=chat("x"))
            assert ok.choices[0].finish_reason == "stop"
            cut = await sim.wait_event("failed", "r-cut")
    failed = [e for e in sim.events() if e["event"] == "failed"]
    assert {"id": "r-fail", "status": 500, "reason": "injected"}.items() <= failed[0].items()
    assert failed[1]["status"] == 503
    assert (cut["reason"], cut["tokens"]) == ("injected", 2)


async def test_a_hang_after_the_first_tokens_ends_when_the_client_gives_up_and_is_journaled(sim: SimProcess) -> None:
    sim.start("--ttft-ms", "5", "--tokens-per-s", "1000")
    sim.faults.write_text(json.dumps({"hang": "after", "after_tokens": 1}))
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            # The client's read timeout gives up on the silent stream and closes the connection.
            hung = await sim.stream(
                lambda c: c.chat.completions.create(
                    model=MODEL, messages=chat("x"), stream=True, extra_headers={"X-Nexa-Request-Id": "r-hang"}
                ),
                timeout_s=0.5,
            )
            assert isinstance(hung.error, openai.APITimeoutError | httpx.TimeoutException)
            assert len(hung.text().split()) == 1  # nothing came after the first token
            cancelled = await sim.wait_event("cancelled", "r-hang")

            # A unary request hangs before its answer: the SDK's timeout gives up, and that is seen too.
            with pytest.raises(openai.APITimeoutError):
                await client.with_options(timeout=0.3).chat.completions.create(
                    model=MODEL, messages=chat("x"), extra_headers={"X-Nexa-Request-Id": "r-hang-unary"}
                )
            await sim.wait_event("cancelled", "r-hang-unary")
    assert cancelled["tokens"] == 1
    assert [e["event"] for e in sim.events() if e["id"] == "r-hang"] == ["request", "cancelled"]


async def test_the_journal_holds_metadata_never_prompts_or_outputs(sim: SimProcess) -> None:
    sim.start("--ttft-ms", "1", "--tokens-per-s", "2000")
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            answer = await client.chat.completions.create(
                model=MODEL, messages=chat(f"secret {CANARY}"), extra_headers={"X-Nexa-Request-Id": "r-1"}
            )
            streamed = (
                await sim.stream(lambda c: c.completions.create(model=MODEL, prompt=CANARY, stream=True))
            ).text()
            await client.embeddings.create(model=MODEL, input=[CANARY, CANARY + "2"])
    assert sim.stop() == 0  # SIGTERM: a clean exit
    journal = sim.journal.read_text()
    assert CANARY not in journal
    assert answer.choices[0].message.content
    assert answer.choices[0].message.content not in journal
    assert streamed not in journal
    events = sim.events()
    assert [(e["event"], e["path"]) for e in events] == [
        ("request", "/v1/chat/completions"),
        ("completed", "/v1/chat/completions"),
        ("request", "/v1/completions"),
        ("completed", "/v1/completions"),
        ("request", "/v1/embeddings"),
        ("completed", "/v1/embeddings"),
    ]
    assert events[0]["id"] == "r-1"
    assert (events[0]["stream"], events[2]["stream"]) == (False, True)
    assert all(set(e) <= {"event", "id", "path", "stream", "at", "tokens", "status", "reason"} for e in events)


def test_with_exit_with_parent_it_stops_when_its_parent_dies(tmp_path: Path) -> None:
    # A stand-in agent that starts the runtime and is then killed without a chance to stop it.
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys\n"
        "argv = [sys.executable, '-m', 'nexa', 'sim-runtime', '--port', '0', '--exit-with-parent']\n"
        "subprocess.Popen(argv, stdout=sys.stdout).wait()\n"
    )
    env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"}
    proc = subprocess.Popen([sys.executable, str(parent)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        port = int(line.split("listening on http://127.0.0.1:")[1].split()[0])
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
        except httpx.TransportError:
            return  # gone
        time.sleep(0.1)
    raise AssertionError("the runtime outlived its parent")


async def test_a_slow_fault_delays_every_answer_and_bad_values_are_named() -> None:
    from nexa.errors import ConfigError
    from nexa.simruntime import Faults

    assert Faults.from_json({"slow_ms": 250}).slow_ms == 250.0
    for bad in ({"slow_ms": -1}, {"slow_ms": True}, {"slow_ms": "1s"}, {"slow_ms": 10**9}):
        with pytest.raises(ConfigError) as caught:
            Faults.from_json(bad)
        assert caught.value.problems[0].startswith("slow_ms:")


async def test_a_slow_engine_answers_only_after_its_delay(sim: SimProcess) -> None:
    sim.start("--ttft-ms", "5", "--tokens-per-s", "1000", "--output-tokens", "2")
    async with sim.client() as client:
        with trio.fail_after(TIMEOUT_S):
            sim.faults.write_text(json.dumps({"slow_ms": 400}))
            started = time.monotonic()
            slow = await client.chat.completions.create(model=MODEL, messages=chat("x"))
            slow_s = time.monotonic() - started
            streamed = await sim.stream(
                lambda c: c.chat.completions.create(model=MODEL, messages=chat("x"), stream=True)
            )
    assert slow.choices[0].finish_reason == "stop"  # slow, not broken
    assert slow_s >= 0.4 and streamed.times[0] >= 0.4  # no output before the delay (a lower bound only)
    assert streamed.error is None and streamed.text()


async def test_garble_faults_answer_200_with_what_the_api_does_not_promise(sim: SimProcess) -> None:
    sim.start("--ttft-ms", "1", "--tokens-per-s", "1000", "--output-tokens", "4")
    chat_body = {"model": MODEL, "messages": chat("x")}
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:
        with trio.fail_after(TIMEOUT_S):
            sim.faults.write_text(json.dumps({"garble": "html"}))
            page = await http.post("/v1/chat/completions", json=chat_body)
            assert page.status_code == 200 and page.headers["content-type"] == "text/html"
            assert page.text.startswith("<html>")

            sim.faults.write_text(json.dumps({"garble": "truncated", "after_tokens": 2}))
            cut = await http.post("/v1/chat/completions", json=chat_body)
            assert cut.status_code == 200
            with pytest.raises(json.JSONDecodeError):
                json.loads(cut.content)

            sim.faults.write_text(json.dumps({"garble": "shape", "after_tokens": 12}))
            shaped = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["a", "b"]})
            assert shaped.status_code == 200 and shaped.json()["data"] == [0, 1]
            streamed = await http.post("/v1/chat/completions", json={**chat_body, "stream": True})
            assert b"data: [1, 2, 3]\n\n" in streamed.content  # after the tokens before it

            sim.faults.write_text(json.dumps({"garble": "usage", "after_tokens": 123}))
            usage = (await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).json()["usage"]
            assert usage["prompt_tokens"] == 2**64 and usage["completion_tokens"] == -1

            sim.faults.write_text(json.dumps({"garble": "nonsense"}))  # refused: no faults until fixed
            fine = await http.post("/v1/chat/completions", json=chat_body)
            assert fine.json()["choices"][0]["message"]["content"]


# --- /metrics in vLLM's names --------------------------------------------------------------------


async def test_metrics_follow_the_faults_file_and_the_answers_given(sim: SimProcess) -> None:
    """Parsed the way a node reads it (the vLLM adapter's series): queue and KV cache from the
    faults file, prefix-cache hits from a repeated prompt, TTFT and TPOT from real answers."""
    from nexa.adapters import SIM_METRICS
    from nexa.telemetry.runtime_text import parse_runtime_metrics

    sim.start("--ttft-ms", "5", "--tokens-per-s", "1000", "--output-tokens", "4")
    async with sim.client() as client, httpx.AsyncClient(base_url=sim.url) as http:
        with trio.fail_after(TIMEOUT_S):
            before = parse_runtime_metrics((await http.get("/metrics")).content, SIM_METRICS)
            for _ in range(2):
                await client.chat.completions.create(model=MODEL, messages=chat("the same prompt"))
            await sim.stream(lambda c: c.chat.completions.create(model=MODEL, messages=chat("other"), stream=True))
            sim.faults.write_text(json.dumps({"queue_depth": 7, "kv_cache_usage": 0.5}))
            after = parse_runtime_metrics((await http.get("/metrics")).content, SIM_METRICS)
            sim.faults.write_text(json.dumps({"metrics_fail": True}))
            failing = await http.get("/metrics")
            still_serving = await client.chat.completions.create(model=MODEL, messages=chat("x"))
    assert (before.queue_depth, before.running, before.kv_cache_ratio) == (0.0, 0.0, 0.0)
    assert before.prefix_cache_hit_ratio is None  # nothing looked up yet
    assert before.ttft is not None
    assert before.ttft.count == 0
    assert (after.queue_depth, after.kv_cache_ratio) == (7.0, 0.5)
    assert after.prefix_cache_hit_ratio is not None
    assert 0 < after.prefix_cache_hit_ratio < 1  # the second of two same prompts hit; the third missed
    assert after.ttft is not None
    assert after.tpot is not None
    assert (after.ttft.count, after.tpot.count) == (3, 3)
    assert after.ttft.sum >= 3 * 0.005  # never before the configured time to first token
    assert failing.status_code == 503
    assert still_serving.choices[0].finish_reason == "stop"


async def test_bad_metrics_faults_are_named_and_ignored(sim: SimProcess) -> None:
    from nexa.errors import ConfigError
    from nexa.simruntime import Faults

    with pytest.raises(ConfigError) as caught:
        Faults.from_json({"queue_depth": -1, "kv_cache_usage": 1.5, "metrics_fail": "yes"})
    assert [p.split(":")[0] for p in caught.value.problems] == ["queue_depth", "kv_cache_usage", "metrics_fail"]
    for bad in ({"queue_depth": True}, {"queue_depth": 1.5}, {"kv_cache_usage": float("nan")}):
        with pytest.raises(ConfigError):
            Faults.from_json(bad)
    sim.start("--queue-depth", "3", "--kv-cache-usage", "0.25")
    async with httpx.AsyncClient(base_url=sim.url) as http:
        with trio.fail_after(TIMEOUT_S):
            flagged = (await http.get("/metrics")).text
            sim.faults.write_text(json.dumps({"queue_depth": "lots"}))  # broken: counts as no faults
            broken = (await http.get("/metrics")).text
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 3' in flagged
    assert f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.25' in flagged
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0' in broken


def test_refuses_bad_metrics_flags() -> None:
    env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"}
    argv = [sys.executable, "-m", "nexa", "sim-runtime", "--port", "0", "--queue-depth", "-1", "--kv-cache-usage", "2"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "--queue-depth" in result.stderr
    assert "--kv-cache-usage" in result.stderr


async def test_a_taught_runtime_answers_what_it_was_taught_and_a_wrong_one_answers_amiss(sim: SimProcess) -> None:
    """The faults file's `taught` and `wrong` (what evaluation suites are tested against)."""
    from nexa.errors import ConfigError
    from nexa.simruntime import Faults

    with pytest.raises(ConfigError) as caught:
        Faults.from_json({"taught": {"France": 7}, "wrong": "yes"})
    assert [p.split(":")[0] for p in caught.value.problems] == ["taught", "wrong"]
    sim.faults.write_text(json.dumps({"taught": {"France": "Paris", "Fr": "not this one"}}))
    sim.start()
    async with sim.client() as client:
        question = chat("The capital of France?")
        taught = await client.chat.completions.create(model=MODEL, messages=question, max_tokens=4)
        assert taught.choices[0].message.content == "Paris"  # the first entry that matches
        done = await client.completions.create(model=MODEL, prompt="France:", max_tokens=4)
        assert done.choices[0].text == "Paris"
        twice = [(await client.embeddings.create(model=MODEL, input="x")).data[0].embedding for _ in range(2)]
        assert twice[0] == twice[1]

        sim.faults.write_text(json.dumps({"taught": {"France": "Paris"}, "wrong": True}))
        amiss = await client.chat.completions.create(model=MODEL, messages=question, max_tokens=4)
        assert amiss.choices[0].message.content not in ("Paris", "")
        twice = [(await client.embeddings.create(model=MODEL, input="x")).data[0].embedding for _ in range(2)]
        assert twice[0] != twice[1]


async def test_sleep_mode_answers_as_vllm_documents_it(sim: SimProcess) -> None:
    """vLLM with `--enable-sleep-mode`: `POST /sleep?level=1`, `POST /wake_up`, `GET /is_sleeping`;
    asleep, the engine takes no request (503); awake again, it answers."""
    sim.start("--enable-sleep-mode")
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
        slept = await http.post("/sleep", params={"level": "1"})
        assert slept.status_code == 200
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        asleep = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("hi")})
        assert asleep.status_code == 503 and asleep.json()["error"]["code"] == "sleeping"
        assert (await http.post("/sleep", params={"level": "3"})).status_code == 400
        assert (await http.post("/wake_up")).status_code == 200
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
    async with sim.client() as client:
        answer = await client.chat.completions.create(model=MODEL, messages=chat("awake"), max_tokens=2)
    assert answer.choices[0].message.content


async def test_without_sleep_mode_the_sleep_routes_are_not_there(sim: SimProcess) -> None:
    sim.start()
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as http:
        assert (await http.post("/sleep")).status_code == 404
        assert (await http.get("/is_sleeping")).status_code == 404


# --- vLLM's other endpoints ----------------------------------------------------------------------------


async def test_serve_names_the_pooling_tokenizer_and_native_apis_it_answers(sim: SimProcess) -> None:
    sim.start("--serve", "tokenize,messages")
    async with httpx.AsyncClient(base_url=sim.url) as http:
        with trio.fail_after(TIMEOUT_S):
            tokens = await http.post("/tokenize", json={"model": MODEL, "prompt": "amber river"})
            rerank = await http.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["d"]})
            bad = await http.post("/tokenize", json={"model": MODEL})
            message = await http.post(
                "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": chat("hi")[1:]}
            )
            responses = await http.post("/v1/responses", json={"model": MODEL, "input": "hi"})
    assert tokens.json()["count"] == 2 and tokens.json()["max_model_len"] > 0
    assert rerank.status_code == 404  # not named: not served, as a runtime without the route
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert message.json()["type"] == "message" and message.json()["usage"] == {"input_tokens": 1, "output_tokens": 4}
    assert responses.status_code == 404


def test_refuses_an_unknown_serve_name() -> None:
    env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"}
    argv = [sys.executable, "-m", "nexa", "sim-runtime", "--port", "0", "--serve", "tokenize,chat"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "--serve" in result.stderr


# --- stored responses, as vLLM keeps them with VLLM_ENABLE_RESPONSES_API_STORE=1 -----------------------


def respond(body: dict[str, Any], stored: native.Stored | None, serial: int = 1) -> dict[str, Any]:
    raw = json.dumps({"model": MODEL, **body}).encode()
    out, _ = native.answer(Capability.RESPONSES, MODEL, raw, serial=serial, output_tokens=4, stored=stored)
    assert isinstance(out, bytes)
    answer: dict[str, Any] = json.loads(out)
    return answer


def test_kept_responses_continue_with_the_earlier_turn_in_the_prompt() -> None:
    assert native.STORE_ENV == RESPONSES_STORE_ENV  # the variable vLLM reads (nexa.adapters.vllm)
    assert native.store_enabled({RESPONSES_STORE_ENV: "1"}) and not native.store_enabled({RESPONSES_STORE_ENV: "x"})
    stored = native.Stored()
    first = respond({"input": "hello there"}, stored)  # `store` left out: OpenAI's default, true
    assert first["usage"]["input_tokens"] == 2
    second = respond({"input": "and then", "previous_response_id": first["id"]}, stored, serial=2)
    # The kept conversation (2 words asked, 4 answered) comes before the new input (2 words).
    assert second["usage"]["input_tokens"] == 2 + 4 + 2 and second["id"] != first["id"]
    unkept = respond({"input": "hi", "store": False}, stored, serial=3)
    with pytest.raises(BadRequest) as lost:
        respond({"input": "hi", "previous_response_id": unkept["id"]}, stored)
    assert lost.value.status == 404 and lost.value.param == "previous_response_id"
    # Ids differ between two processes that both answer their first request.
    assert respond({"input": "hi"}, native.Stored())["id"] != respond({"input": "hi"}, native.Stored())["id"]


def test_without_the_store_variable_store_is_dropped_and_state_refused_as_vllm_does() -> None:
    assert respond({"input": "hi", "store": True}, None)["id"] == "resp_sim1"  # served, not kept
    with pytest.raises(BadRequest) as unknown:
        respond({"input": "hi", "previous_response_id": "resp_sim1"}, None)
    assert unknown.value.status == 404
    with pytest.raises(BadRequest) as background:
        respond({"input": "hi", "background": True}, None)
    assert background.value.status == 400 and RESPONSES_STORE_ENV in background.value.message


def test_a_kept_responses_own_routes_answer_as_vllms_router() -> None:
    """`GET /v1/responses/{id}`: the kept Response object; `POST …/cancel`: 400 (only a background
    response, queued or running, cancels); an unknown id, an unkept one and a streamed retrieve: 404;
    `DELETE`: 405 (vLLM serves none); `/input_items` is no route of a kept response."""
    stored = native.Stored()
    first = respond({"input": "hello there"}, stored)
    unkept = respond({"input": "hi", "store": False}, stored, serial=2)
    path = f"/v1/responses/{first['id']}"
    assert native.stored_path(path) and native.stored_path(path + "/cancel")
    assert not native.stored_path(path + "/input_items") and not native.stored_path("/v1/responses")
    status, body = native.stored_route(stored, "GET", path, "")
    assert status == 200 and json.loads(body) == first
    status, body = native.stored_route(stored, "POST", path + "/cancel", "")
    assert (status, json.loads(body)["error"]["message"]) == (400, "Cannot cancel a synchronous response.")
    for method, where, query in (
        ("GET", f"/v1/responses/{unkept['id']}", ""),
        ("GET", "/v1/responses/resp_never", ""),
        ("POST", "/v1/responses/resp_never/cancel", ""),
        ("GET", path, "stream=true&starting_after=2"),
    ):
        status, body = native.stored_route(stored, method, where, query)
        error = json.loads(body)["error"]
        assert (status, error["param"]) == (404, "response_id") and "not found" in error["message"], where
    assert native.stored_route(None, "GET", path, "")[0] == 404  # a server that keeps none: nothing found
    status, body = native.stored_route(stored, "DELETE", path, "")
    assert (status, json.loads(body)) == (405, {"detail": "Method Not Allowed"})
