"""`x-nexa-overhead-ms` end to end: the official `openai` SDK against a controller, two real `nexa node`
agents and their `sim` runtimes (tests/e2e/conftest.py `cluster`). Every answer carries a figure
that parses, is finite, not negative and below the request's own time, and the gateway's
`nexa_gateway_overhead_seconds` histogram counts each one (read with a monitoring key)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster import MESSAGES, SimCluster, new_key

pytestmark = pytest.mark.slow
T = TypeVar("T")
HEADER = "x-nexa-overhead-ms"


def _figure(headers: object, elapsed_s: float) -> float:
    value = headers.get(HEADER)  # type: ignore[attr-defined]
    assert value is not None, f"no {HEADER} header"
    ms = float(value)
    assert math.isfinite(ms) and 0.0 <= ms < elapsed_s * 1000.0, (ms, elapsed_s)
    return ms


async def _overhead_count(cluster: SimCluster, key: str) -> float:
    async with cluster.client(key) as http:
        text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "nexa_gateway_overhead_seconds":
            return sum(s.value for s in family.samples if s.name.endswith("_count") and s.labels.get("model") == "chat")
    return 0.0


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


async def test_every_answer_says_its_overhead_and_the_gateway_histogram_counts_it(cluster: SimCluster) -> None:
    monitoring = await new_key(cluster, "monitoring")
    before = await _overhead_count(cluster, monitoring)
    client = openai.OpenAI(base_url=cluster.base_url, api_key=cluster.inference_key, max_retries=0, timeout=30)
    cluster.on_close.append(client.close)

    def scenario() -> list[float]:
        figures = []
        raw, elapsed = _timed(lambda: client.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES))
        assert raw.parse().choices[0].message.content
        figures.append(_figure(raw.headers, elapsed))

        # A stream's header comes with its response head: the overhead up to the first byte.
        started = time.perf_counter()
        with client.chat.completions.with_streaming_response.create(
            model="chat", messages=MESSAGES, stream=True
        ) as streamed:
            chunks = list(streamed.parse())
            elapsed = time.perf_counter() - started
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            figures.append(_figure(streamed.headers, elapsed))

        raw_embedding, elapsed = _timed(
            lambda: client.embeddings.with_raw_response.create(model="chat", input=["alpha", "beta"])
        )
        assert [d.index for d in raw_embedding.parse().data] == [0, 1]
        figures.append(_figure(raw_embedding.headers, elapsed))
        return figures

    figures = await trio.to_thread.run_sync(scenario)
    assert len(figures) == 3

    # The canonical envelope route, unary: the same header.
    envelope = {
        "version": "nexa.v1",
        "capability": "chat",
        "model": "chat",
        "payload": {"messages": MESSAGES},
        "idempotency_key": "overhead-1",
        "workload_id": "wl-overhead-1",
    }
    async with cluster.client(cluster.inference_key) as http:
        started = time.perf_counter()
        answer = await http.post("/api/v1/workloads", json=envelope)
        elapsed = time.perf_counter() - started
        assert answer.status_code == 200, answer.text
        _figure(answer.headers, elapsed)
        # A refusal (an unknown model: the gateway resolves no model) carries it too.
        started = time.perf_counter()
        refused = await http.post("/v1/chat/completions", json={"model": "no-such", "messages": MESSAGES})
        assert refused.status_code == 404
        _figure(refused.headers, time.perf_counter() - started)

    # One observation per gateway call answered: chat, stream, embeddings and the workload (model `chat`).
    async def counted() -> float:
        return await _overhead_count(cluster, monitoring)

    with trio.fail_after(60):
        while await counted() < before + 4:  # noqa: ASYNC110 - the histogram is observed as heads are written
            await trio.sleep(0.05)
