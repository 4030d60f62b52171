"""The gateway's request rules (pure): token reservations, the fields it refuses, latency classes."""

from __future__ import annotations

import math

import attrs
import pytest

from nexa.contracts.gateway import (
    API_VERSION,
    Capability,
    LatencyClass,
    Priority,
    WorkloadCreate,
    body_problems,
    token_reservation,
    usage_bounds,
    workload_problems,
)


def req(**changes: object) -> WorkloadCreate:
    base = WorkloadCreate(
        version=API_VERSION,
        idempotency_key="k/1",
        workload_id="w1",
        capability=Capability.CHAT,
        model="chat",
        payload={"messages": [{"role": "user", "content": "x" * 40}]},
    )
    return attrs.evolve(base, **changes)


def test_the_reservation_is_the_prompt_estimate_plus_the_completion_asked_for() -> None:
    messages = {"messages": [{"role": "user", "content": "x" * 40}]}  # 44 characters of strings
    assert token_reservation(Capability.CHAT, messages, default_completion=1000) == 12 + 1000
    assert token_reservation(Capability.CHAT, {**messages, "max_tokens": 50}, default_completion=1000) == 12 + 50
    both = {**messages, "max_tokens": 50, "max_completion_tokens": 70, "n": 3}
    assert token_reservation(Capability.CHAT, both, default_completion=1000) == 12 + 70 * 3
    assert token_reservation(Capability.COMPLETION, {"prompt": "y" * 8}, default_completion=16) == 3 + 16
    assert token_reservation(Capability.EMBEDDING, {"input": ["ab" * 10, "cd" * 10]}, default_completion=99) == 11


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"temperature": math.nan}, "temperature: a finite number"),
        ({"messages": [{"x": [math.inf]}]}, "messages[0].x[0]: a finite number"),
        ({"max_tokens": 0}, "max_tokens: an integer"),
        ({"max_tokens": 2.5}, "max_tokens: an integer"),
        ({"max_completion_tokens": 2**31}, "max_completion_tokens: an integer"),
        ({"n": False}, "n: an integer"),
    ],
)
def test_bodies_with_unusable_numbers_are_refused(body: dict[str, object], problem: str) -> None:
    [found] = body_problems(Capability.CHAT, body)
    assert found.startswith(problem)


def test_latency_class_sets_the_priority_and_must_agree_with_it() -> None:
    assert req().admission_priority is Priority.STANDARD
    assert req(latency_class=LatencyClass.REALTIME).admission_priority is Priority.INTERACTIVE
    assert req(latency_class=LatencyClass.BATCH).admission_priority is Priority.BATCH
    assert req(priority=Priority.BATCH, latency_class=LatencyClass.BATCH).admission_priority is Priority.BATCH
    assert workload_problems(req(priority=Priority.BATCH, latency_class=LatencyClass.BATCH)) == []
    [problem] = workload_problems(req(priority=Priority.INTERACTIVE, latency_class=LatencyClass.BATCH))
    assert problem.startswith("latency_class: batch means priority batch")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"workload_id": "a/b"}, "workload_id"),
        ({"deadline_at": math.nan}, "deadline_at"),
        ({"deadline_at": math.inf}, "deadline_at"),
        ({"model": "m" * 257}, "model"),
        ({"data_class": "Top Secret"}, "data_class"),
        ({"payload": {"stream_options": {"include_usage": True}}}, "payload.stream_options"),
    ],
)
def test_envelope_fields_the_gateway_cannot_honour_are_named(changes: dict[str, object], field: str) -> None:
    [problem] = workload_problems(req(**changes))
    assert problem.startswith(field + ":")
    assert workload_problems(req(idempotency_key="tenant/batch-7", data_class="confidential")) == []


def test_rerank_score_and_tokenizer_bodies_are_reserved_bounded_and_checked() -> None:
    rerank = {"query": "q" * 8, "documents": ["d" * 8, "e" * 8]}
    assert token_reservation(Capability.RERANK, rerank, default_completion=999) == 24 // 4 + 1  # nothing generated
    assert usage_bounds(Capability.RERANK, rerank)[1] == 0
    assert usage_bounds(Capability.RERANK, rerank)[0] >= 4 * 24
    assert token_reservation(Capability.DETOKENIZE, {"tokens": [1, 2, 3]}, default_completion=999) == 4
    assert usage_bounds(Capability.DETOKENIZE, {"tokens": [1, 2, 3]}) == (3, 0)
    assert body_problems(Capability.RERANK, rerank) == []
    assert body_problems(Capability.RERANK, {"documents": []}) == ["query: a string", "documents: a non-empty list"]
    assert body_problems(Capability.SCORE, {"text_1": "a"}) == ["text_2: a string or a list"]
    assert body_problems(Capability.TOKENIZE, {"content": "llama.cpp's name"}) == []
    assert body_problems(Capability.TOKENIZE, {})[0].startswith("prompt:")
    assert body_problems(Capability.DETOKENIZE, {"tokens": [True]})[0].startswith("tokens:")
    # max_tokens and n mean nothing here: not checked.
    assert body_problems(Capability.TOKENIZE, {"prompt": "x", "max_tokens": 0}) == []
    assert not Capability.RERANK.streams and Capability.CHAT.streams and not Capability.EMBEDDING.streams


def test_a_native_api_is_no_workload_capability() -> None:
    for capability in (Capability.MESSAGES, Capability.RESPONSES, Capability.MESSAGE_TOKENS):
        assert any(
            p.startswith(f"capability: {capability.value} is served at /v1/")
            for p in workload_problems(req(capability=capability))
        )
    assert workload_problems(req(capability=Capability.RERANK, payload={"query": "q", "documents": ["d"]})) == []
