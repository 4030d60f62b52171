"""Evaluation suites the sim runtime can pass: what it is taught, a case of each scorer, and
registering a suite through the CLI (tests/test_evals.py, tests/test_eval_replicas.py)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.support.cluster import SimCluster

Json = dict[str, Any]

#: What the sim runtime is taught (`Faults.taught`): the judge's rubric first (its prompt holds the
#: question and the answer too), then each question's answer.
TAUGHT = {
    "RUBRIC-7": "score: 0.9",
    "capital of France": "Paris",
    "as JSON": '{"city": "Paris", "population": 2100000}',
    "two plus two": "The answer is 4.",
    "say ok": "ok ok ok",
}


def chat(text: str) -> Json:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8}


#: A case of each scorer (and three `exact` ones, so that pass rates move in steps of a third).
CASES: list[Json] = [
    {"id": "fr-1", "request": chat("capital of France?"), "scorer": {"kind": "exact", "expected": "Paris"}},
    {
        "id": "fr-2",
        "request": chat("the capital of France"),
        "scorer": {"kind": "exact", "expected": "paris", "ignore_case": True},
    },
    {
        "id": "fr-3",
        "request": {"prompt": "capital of France:", "max_tokens": 4},
        "scorer": {"kind": "exact", "expected": "Paris"},
    },
    {"id": "ok", "request": chat("say ok"), "scorer": {"kind": "contains", "expected": "ok"}},
    {
        "id": "ok-re",
        "request": chat("say ok"),
        "scorer": {"kind": "regex", "pattern": "^(ok ?){3}$"},
        "metric": "format",
    },
    {
        "id": "json",
        "request": chat("Paris as JSON"),
        "scorer": {
            "kind": "json_schema",
            "schema": {"type": "object", "required": ["city"], "properties": {"city": {"const": "Paris"}}},
        },
    },
    {"id": "sum", "request": chat("two plus two"), "scorer": {"kind": "number", "expected": 4, "tolerance": 0.01}},
    {
        "id": "same",
        "request": {"embedding_pair": ["a red apple", "a red apple"]},
        "scorer": {"kind": "cosine", "min": 0.99},
    },
    {
        "id": "near",
        "request": chat("capital of France, one word"),
        "scorer": {"kind": "cosine", "min": 0.99, "expected": "Paris", "deployment": "chat-a"},
    },
    {
        "id": "judged",
        "request": chat("capital of France?"),
        "scorer": {"kind": "judge", "deployment": "chat-a", "rubric": "RUBRIC-7: the answer names Paris", "min": 0.8},
    },
]


def lines(cases: list[Json]) -> str:
    return "".join(json.dumps(c) + "\n" for c in cases)


async def register(cluster: SimCluster, name: str, text: str) -> subprocess.CompletedProcess[str]:
    path = cluster.tmp / f"{name}.jsonl"
    path.write_text(text)
    return await cluster.cli("eval", "register", str(path), "--name", name)
