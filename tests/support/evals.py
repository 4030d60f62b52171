"""Evaluation suites the sim runtime can pass: what it is taught, a case of each scorer, and
registering a suite through the CLI (tests/test_evals.py, tests/test_eval_replicas.py)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.support.api import ok
from tests.support.cluster import SimCluster
from tests.support.models import bring_to

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


async def slow_gated_canary(cluster: SimCluster) -> None:
    """Suite `qa` (three cases) registered; deployment chat-a (one replica of tiny@v1); tenant `evals`;
    tiny@v2 Approved and started as chat-a's canary with a suite gate the controller runs as `evals`;
    every answer on the canary's node taught and slowed 6 s, so the controller's run is in flight a while."""
    assert (await register(cluster, "qa", lines(CASES[:3]))).returncode == 0
    await cluster.deploy("chat-a", replicas=1)
    async with cluster.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "evals"}), 201)
        await bring_to(http, cluster.s3, "tiny", "v2", "Approved")
        canary = {
            "model": {"model": "tiny", "version": "v2"},
            "weight": 0.1,
            "suite": {"suite": "qa", "tenant": "evals"},
        }
        started = await ok(http.post("/api/v1/deployments/chat-a/canary", json=canary), 201)
    on = started["deployment"]["canary"]["placed"][0]["node_id"]
    for node in cluster.nodes:
        node.set_faults(taught=TAUGHT, **({"slow_ms": 6000} if node.node_id == on else {}))
