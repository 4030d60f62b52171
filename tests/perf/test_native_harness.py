"""The C harness of `perf/gateway.py`'s native mode, checked for correctness (never for timing): both
programs build from perf/c/ with the system's C compiler, the paced upstream's answers parse with the
official `openai` SDK, streamed and unary, and the load generator counts exactly the SSE events the
upstream says it wrote."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from nexa.localparts import free_ports
from perf.loadgen import Target
from perf.native import PacedUpstream, build, run_loadgen

pytestmark = [
    pytest.mark.slow,  # building the two programs takes seconds on a busy machine
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (apt-get install gcc)"),
]
HOST = "127.0.0.1"
EVENTS = 5
#: Fast, so each stream takes 25 ms: the test checks counts, not pacing.
RATE = 200.0
PATH = "/v1/chat/completions"
BODY = (
    b'{"model": "perf-model", "messages": [{"role": "user", "content": "hi"}], '
    b'"stream": true, "stream_options": {"include_usage": true}}'
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build cache for the module: the first test builds, the others reuse."""
    return tmp_path_factory.mktemp("c")


@pytest.fixture
def upstream(cache: Path) -> Iterator[PacedUpstream]:
    up = PacedUpstream(HOST, free_ports(1, HOST)[0], EVENTS, RATE, cache=cache)
    up.start()
    try:
        yield up
    finally:
        up.stop()


def test_both_programs_build_into_the_cache_once_per_source(cache: Path) -> None:
    for name in ("paced_upstream", "sse_loadgen"):
        built = build(name, cache)
        assert built.parent == cache and built.name.startswith(f"{name}-")
        assert built.stat().st_mode & 0o111
        assert build(name, cache) == built  # the same source: the same file, not built again
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["paced_upstream", "sse_loadgen"]


def test_the_paced_stream_parses_with_the_openai_sdk_as_chunks_usage_and_done(upstream: PacedUpstream) -> None:
    client = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="unused", max_retries=0, timeout=10)
    with client:
        chunks = list(
            client.chat.completions.create(
                model="perf-model",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        content = [c for c in chunks if c.choices]
        assert len(content) == EVENTS
        assert all(c.object == "chat.completion.chunk" and c.model == "perf-model" for c in chunks)
        assert content[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in content) == "tok " * EVENTS
        assert [c.choices[0].finish_reason for c in content] == [None] * (EVENTS - 1) + ["stop"]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == EVENTS

        # max_tokens, when given, is the number of content chunks (as a model's tokens)
        short = client.chat.completions.create(
            model="perf-model", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=2
        )
        assert [c.choices[0].delta.content for c in short if c.choices] == ["tok ", "tok "]

        unary = client.chat.completions.create(model="perf-model", messages=[{"role": "user", "content": "hi"}])
        assert unary.choices[0].message.content == " ".join(["tok"] * EVENTS)
        assert unary.usage is not None and unary.usage.total_tokens == 8 + EVENTS
    sent = upstream.stop()
    assert sent is not None and (sent.streams, sent.unary) == (2, 1)
    assert sent.events == EVENTS + 2 + 2 + 2  # each stream's content chunks, its usage chunk and [DONE]


def test_the_load_generator_counts_exactly_the_events_the_upstream_sent(upstream: PacedUpstream, cache: Path) -> None:
    conns, rounds = 7, 3
    target = Target("direct", HOST, upstream.port, PATH, "a-key")
    loaded = run_loadgen(target, BODY, conns, max_requests=rounds, cache=cache)
    sent = upstream.stop()
    assert sent is not None
    assert loaded.result.errors == {}
    assert loaded.requests == sent.streams == conns * rounds
    assert loaded.all_events == loaded.result.events == sent.events == conns * rounds * (EVENTS + 2)
    assert len(loaded.result.latencies) == len(loaded.result.ttfts) == conns * rounds
    assert all(0 <= first <= whole for first, whole in zip(loaded.result.ttfts, loaded.result.latencies, strict=True))


def test_the_load_generator_counts_answers_other_than_200_as_errors(upstream: PacedUpstream, cache: Path) -> None:
    target = Target("direct", HOST, upstream.port, "/v1/nothing-here", "")
    loaded = run_loadgen(target, BODY, 2, max_requests=2, cache=cache)
    assert loaded.result.errors == {"status 404": 4}
    assert loaded.error_body.startswith('{"error":')
    assert loaded.result.latencies == [] and loaded.all_events == 0
