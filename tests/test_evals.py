"""`nexa eval` end to end: the CLI as a subprocess against a controller, a real `nexa node` agent on
127.0.0.11 and its `sim` runtime (taught the right answers through its faults file, then told to
answer wrong); suites registered, runs recorded as the model version's measured evaluation, shown
and compared; bad suites refused naming the line; a key that may not call the gateway refused."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from nexa.contracts import codec
from nexa.contracts.evals import EvalRun
from nexa.contracts.evidence import JobState
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SimCluster, gateway_cluster, new_key

pytestmark = pytest.mark.slow
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
    {"id": "fr-2", "request": chat("the capital of France"), "scorer": {"kind": "exact", "expected": "paris", "ignore_case": True}},
    {"id": "fr-3", "request": {"prompt": "capital of France:", "max_tokens": 4}, "scorer": {"kind": "exact", "expected": "Paris"}},
    {"id": "ok", "request": chat("say ok"), "scorer": {"kind": "contains", "expected": "ok"}},
    {"id": "ok-re", "request": chat("say ok"), "scorer": {"kind": "regex", "pattern": "^(ok ?){3}$"}, "metric": "format"},
    {
        "id": "json",
        "request": chat("Paris as JSON"),
        "scorer": {
            "kind": "json_schema",
            "schema": {"type": "object", "required": ["city"], "properties": {"city": {"const": "Paris"}}},
        },
    },
    {"id": "sum", "request": chat("two plus two"), "scorer": {"kind": "number", "expected": 4, "tolerance": 0.01}},
    {"id": "same", "request": {"embedding_pair": ["a red apple", "a red apple"]}, "scorer": {"kind": "cosine", "min": 0.99}},
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


@pytest.fixture
async def cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[SimCluster]:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as c:
        c.nodes[0].set_faults(taught=TAUGHT)
        c.nodes[1].set_faults(taught=TAUGHT)
        await c.deploy("chat-a", replicas=1)
        yield c


async def register(cluster: SimCluster, name: str, text: str) -> subprocess.CompletedProcess[str]:
    path = cluster.tmp / f"{name}.jsonl"
    path.write_text(text)
    return await cluster.cli("eval", "register", str(path), "--name", name)


async def run(cluster: SimCluster, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    return await cluster.cli(
        "eval", "run", "qa", "--deployment", "chat-a", "--inference-key", key or cluster.inference_key, *args
    )


async def get(cluster: SimCluster, path: str) -> Json:
    async with cluster.client() as http:
        return await ok(http.get(path))


async def test_a_suite_with_every_scorer_is_measured_through_the_gateway_and_compared(cluster: SimCluster) -> None:
    registered = await register(cluster, "qa", lines(CASES))
    assert registered.returncode == 0, registered.stderr
    assert "suite qa: 10 case(s)" in registered.stdout

    good = await run(cluster, "--json", "--concurrency", "3")
    assert good.returncode == 0, good.stderr
    a = codec.loads(codec.api, good.stdout, EvalRun)
    assert a.passed, a.run.cases
    assert (a.model, a.version) == ("tiny", "v1")
    by_metric = {s.metric: s for s in a.summaries}
    assert sorted(by_metric) == ["contains", "cosine", "exact", "format", "json_schema", "judge", "number"]
    assert by_metric["exact"].cases == 3 and by_metric["exact"].pass_rate == 1.0
    assert by_metric["exact"].pass_rate_ci[0] < 1.0 == by_metric["exact"].pass_rate_ci[1]  # Wilson, not [1, 1]
    assert by_metric["judge"].mean == 0.9 and by_metric["cosine"].mean > 0.99

    # The same record `models evaluate` writes, now measured, with the suite's digest and the deployment.
    model = await get(cluster, "/api/v1/models/tiny/v1")
    measured = [e for e in model["evaluations"] if e["measured"]]
    assert len(measured) == 1
    evaluation = measured[0]
    assert evaluation["id"] == a.evaluation and evaluation["run"] == a.id and evaluation["passed"]
    assert evaluation["suite_digest"] == a.digest and evaluation["deployment"] == "chat-a"
    assert evaluation["metrics"]["exact"] == 1.0 and evaluation["metrics"]["judge.mean"] == 0.9
    job = await get(cluster, f"/api/v1/jobs/{a.run.job}")
    assert job["kind"] == "eval" and job["state"] == JobState.SUCCEEDED and job["link"] == f"/api/v1/eval/runs/{a.id}"

    # Answers gone wrong (the sim runtime's `wrong`): every scorer fails, the run fails (exit 1).
    for node in cluster.nodes:
        node.set_faults(taught=TAUGHT, wrong=True)
    bad = await run(cluster, "--json")
    assert bad.returncode == 1, bad.stderr
    b = codec.loads(codec.api, bad.stdout, EvalRun)
    assert not b.passed
    assert all(s.pass_rate == 0.0 for s in b.summaries), b.summaries

    shown = await cluster.cli("eval", "show", b.id)
    assert shown.returncode == 0, shown.stderr
    assert "failed" in shown.stdout and "fr-1" in shown.stdout and "judge" in shown.stdout

    compared = await cluster.cli("eval", "compare", a.id, b.id)
    assert compared.returncode == 0, compared.stderr
    exact = next(line for line in compared.stdout.splitlines() if line.startswith("exact"))
    assert "-1.000" in exact  # B - A of the pass rate
    as_json = await cluster.cli("eval", "compare", a.id, b.id, "--json")
    diff = {d["metric"]: d for d in json.loads(as_json.stdout)["metrics"]}
    assert diff["exact"]["pass_rate_diff"] == -1.0 and diff["exact"]["significant"]
    lo, hi = diff["exact"]["pass_rate_diff_ci"]
    assert -1.0 <= lo < hi < 0.0
    assert not diff["number"]["significant"]  # one case each: the interval spans 0

    listed = await cluster.cli("eval", "runs", "--suite", "qa")
    assert listed.returncode == 0 and a.id in listed.stdout and b.id in listed.stdout


BAD_SUITES = [
    ("not json\n", "line 1: not JSON"),
    (lines([CASES[0]]) + '{"id": "x", "request": {"input": "a"}, "scorer": {"kind": "exact", "expected": "a"}}\n', "line 2: request: not a request"),
    ('\n{"id": "x", "request": {"prompt": "a"}, "scorer": {"kind": "bleu"}}\n', "line 2: scorer.kind: unknown scorer 'bleu'"),
    ('{"id": "x", "request": {"prompt": "a"}, "scorer": {"kind": "regex", "pattern": "(a"}}\n', "line 1: scorer.pattern: not a regular expression"),
    ('{"id": "x", "request": {"prompt": "a"}, "scorer": {"kind": "regex", "pattern": "(a+)+$"}}\n', "line 1: scorer.pattern: a nested quantifier"),
    ('{"id": "x", "request": {"prompt": "a"}, "scorer": {"kind": "json_schema", "schema": {"type": 7}}}\n', "line 1: scorer.schema: does not compile"),
    (lines([CASES[0], CASES[0]]), "line 2: id 'fr-1' is taken by line 1"),
    ("", "the suite has no cases"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "needle"), BAD_SUITES)
async def test_a_bad_suite_is_refused_naming_the_line_and_nothing_is_kept(
    cluster: SimCluster, text: str, needle: str
) -> None:
    refused = await register(cluster, "bad", text)
    assert refused.returncode == 1
    assert "invalid_request" in refused.stderr and needle in refused.stderr, refused.stderr
    suites = await get(cluster, "/api/v1/eval/suites")
    assert suites["suites"] == []


async def test_a_suite_naming_an_unknown_deployment_and_one_too_large_are_refused(cluster: SimCluster) -> None:
    judge = dict(CASES[-1], scorer={"kind": "judge", "deployment": "nowhere", "rubric": "r"})
    refused = await register(cluster, "qa", lines([judge]))
    assert refused.returncode == 1 and "no deployment nowhere" in refused.stderr
    huge = await register(cluster, "big", lines([dict(CASES[0], id=f"c{i}") for i in range(2001)]))
    assert huge.returncode == 1 and "more than 2000 cases" in huge.stderr, huge.stderr
    assert (await get(cluster, "/api/v1/eval/suites"))["suites"] == []


async def test_a_key_that_may_not_use_the_deployment_is_refused_and_nothing_is_recorded(cluster: SimCluster) -> None:
    assert (await register(cluster, "qa", lines(CASES[:3]))).returncode == 0
    auditor = await new_key(cluster, "audit")
    refused = await run(cluster, key=auditor)
    assert refused.returncode == 1
    assert "may not use deployment chat-a" in refused.stderr and "forbidden" in refused.stderr, refused.stderr
    assert (await get(cluster, "/api/v1/eval/runs"))["runs"] == []
    jobs = (await get(cluster, "/api/v1/jobs?kind=eval"))["jobs"]
    assert [j["state"] for j in jobs] == [JobState.FAILED]
    model = await get(cluster, "/api/v1/models/tiny/v1")
    assert not any(e["measured"] for e in model["evaluations"])
