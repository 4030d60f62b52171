"""`nexa eval` end to end: the CLI as a subprocess against a controller, a real `nexa node` agent on
127.0.0.11 and its `sim` runtime (taught the right answers through its faults file, then told to
answer wrong); suites registered, runs recorded as the model version's measured evaluation, shown
and compared; bad suites refused naming the line; a key that may not call the gateway refused."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa.config import ModelsConfig
from nexa.config.control import ApprovalRequirement
from nexa.contracts import codec
from nexa.contracts.evals import EvalRun
from nexa.contracts.evidence import JobState
from nexa.contracts.models import EvaluationRecord
from nexa.control.registry.models import ModelRegistry
from tests.conftest import Controller, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SimCluster, gateway_cluster, new_key, wait_until
from tests.support.console import sign_in
from tests.support.evals import CASES, TAUGHT, lines, register
from tests.support.models import bring_to, registry_config

pytestmark = pytest.mark.slow
Json = dict[str, Any]


@pytest.fixture
async def cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[SimCluster]:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as c:
        c.nodes[0].set_faults(taught=TAUGHT)
        c.nodes[1].set_faults(taught=TAUGHT)
        await c.deploy("chat-a", replicas=1)
        yield c


async def run(cluster: SimCluster, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    return await cluster.cli(
        "eval", "run", "qa", "--deployment", "chat-a", "--inference-key", key or cluster.inference_key, *args
    )


async def get(cluster: SimCluster, path: str) -> Json:
    async with cluster.client() as http:
        return await ok(http.get(path))


async def versions_answering(cluster: SimCluster, n: int) -> dict[str, int]:
    """Send `n` chat completions for the deployment's alias as a client does; the model versions that
    answered them, by the tenant's usage (its requests before and after)."""

    async def requests() -> dict[str, int]:
        rows = (await get(cluster, "/api/v1/usage"))["rows"]
        return {r["model"]: r["requests"] for r in rows if r["tenant"] == "acme"}

    before = await requests()
    async with cluster.client(cluster.inference_key) as http:
        for i in range(n):
            body = {"model": "chat", "messages": [{"role": "user", "content": f"question {i}"}]}
            await ok(http.post("/v1/chat/completions", json=body))
    after = await requests()
    return {m: k - before.get(m, 0) for m, k in after.items() if k != before.get(m, 0)}


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
    (lines([CASES[0]]) + '{"id": "x", "request": {"input": "a"}, "scorer": {"kind": "exact", "expected": "a"}}\n', "line 2: request: not a request"),  # noqa: E501
    ('\n{"id": "x", "request": {"prompt": "a"}, "scorer": {"kind": "bleu"}}\n', "line 2: scorer.kind: unknown scorer 'bleu'"),  # noqa: E501
    ('{"id": "x", "request": {"prompt": "a"}, "scorer": {"kind": "regex", "pattern": "(a"}}\n', "line 1: scorer.pattern: not a regular expression"),  # noqa: E501
    ('{"id": "x", "request": {"prompt": "a"}, "scorer": {"kind": "regex", "pattern": "(a+)+$"}}\n', "line 1: scorer.pattern: a nested quantifier"),  # noqa: E501
    ('{"id": "x", "request": {"prompt": "a"}, "scorer": {"kind": "json_schema", "schema": {"type": 7}}}\n', "line 1: scorer.schema: does not compile"),  # noqa: E501
    (lines([CASES[0], CASES[0]]), "line 2: id 'fr-1' is taken by line 1"),
    ("", "the suite has no cases"),
]  # fmt: skip


async def cli(controller: Controller, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NEXA_URL": controller.url, "NEXA_TOKEN": controller.admin_key}
    argv = [sys.executable, "-m", "nexa", *args]
    run = functools.partial(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    return await trio.to_thread.run_sync(run)


@pytest.mark.parametrize(("text", "needle"), BAD_SUITES)
async def test_a_bad_suite_is_refused_naming_the_line_and_nothing_is_kept(
    controller: Controller, tmp_path: Path, text: str, needle: str
) -> None:
    (path := tmp_path / "bad.jsonl").write_text(text)
    refused = await cli(controller, "eval", "register", str(path), "--name", "bad")
    assert refused.returncode == 1
    assert "invalid_request" in refused.stderr and needle in refused.stderr, refused.stderr
    async with controller.client() as http:
        assert (await ok(http.get("/api/v1/eval/suites")))["suites"] == []
        audit = await ok(http.get("/api/v1/audit"))
    assert not any(e["action"] == "eval.suite.register" for e in audit["events"])


async def test_approval_without_a_measured_result_is_a_409_naming_the_suite(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    need = (ApprovalRequirement(suite="qa", metric="exact", min=0.9), ApprovalRequirement(suite="safety"))
    controller = await start_controller(
        nursery, attrs.evolve(cfg, models=attrs.evolve(cfg.models, approval_requires=need))
    )
    try:
        async with controller.client() as http:
            await bring_to(http, s3_store, "m", "v1", "Evaluated")  # on the operator's word only
            refused = await http.post("/api/v1/models/m/v1/approve")
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert error["code"] == "approval_requirements_unmet"
            assert "suite qa metric exact >= 0.9: no measured result" in error["message"]
            assert "suite safety passed: no measured result" in error["message"]
            assert (await ok(http.get("/api/v1/models/m/v1")))["model"]["state"] == "Evaluated"
        by_cli = await cli(controller, "models", "approve", "m", "v1")
        assert by_cli.returncode == 1 and "approval_requirements_unmet" in by_cli.stderr
    finally:
        controller.stopping.set()


def _measured(suite: str, passed: bool, metrics: dict[str, float], at: float) -> EvaluationRecord:
    return EvaluationRecord(
        id=f"eval_{at}", model="m", version="v1", suite=suite, metrics=metrics, passed=passed, evidence="",
        recorded_at=at, recorded_by=None, measured=True, suite_digest="0" * 64, deployment="d", run=f"evrun_{at}",
    )  # fmt: skip


def test_the_newest_measured_run_of_each_required_suite_decides() -> None:
    """Pure logic (the registry's check, without its store): which requirement is not met, and why."""
    need = (ApprovalRequirement(suite="qa", metric="exact", min=0.9), ApprovalRequirement(suite="safety"))
    word = attrs.evolve(_measured("qa", True, {"exact": 1.0}, 1.0), measured=False)  # an operator's: not counted
    evaluations = [
        word,
        _measured("qa", True, {"exact": 1.0}, 2.0),
        _measured("qa", False, {"exact": 0.5}, 3.0),  # newest: below 0.9
        _measured("safety", True, {"refusal": 1.0}, 4.0),
    ]
    registry = ModelRegistry(
        ModelsConfig(approval_requires=need), None, None, None,  # type: ignore[arg-type] -- never touched here
        runtimes=[], models=[], evaluations=evaluations, aliases=[], history=[],
    )  # fmt: skip
    assert registry.unmet_requirements("m", "v1") == [
        "suite qa metric exact >= 0.9: the newest measured run (evrun_3.0) has 0.5"
    ]
    assert registry.unmet_requirements("m", "v2") == [
        "suite qa metric exact >= 0.9: no measured result (run `nexa eval run qa --deployment ...`)",
        "suite safety passed: no measured result (run `nexa eval run safety --deployment ...`)",
    ]


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


async def test_a_canary_with_a_suite_is_promoted_only_once_the_suite_passed_against_its_replicas(
    cluster: SimCluster,
) -> None:
    assert (await register(cluster, "qa", lines(CASES[:3]))).returncode == 0
    canary = {
        "model": {"model": "tiny", "version": "v2"},
        "weight": 0.1,
        "suite": {"suite": "qa", "min_pass_rate": 0.9, "run_by": "operator"},
    }
    async with cluster.client() as http:
        await bring_to(http, cluster.s3, "tiny", "v2", "Approved")
        bad = await http.post(
            "/api/v1/deployments/chat-a/canary", json=dict(canary, suite={"suite": "qa", "min_pass_rate": 2})
        )
        assert bad.status_code == 400 and "suite.min_pass_rate" in bad.text
        await ok(http.post("/api/v1/deployments/chat-a/canary", json=canary), 201)

    async def canary_ready() -> bool:
        return bool((await get(cluster, "/api/v1/deployments/chat-a"))["canary_ready"])

    await wait_until("the canary Ready", canary_ready)
    # Before its suite passed, the canary takes none of the clients' requests (its share is held at 0).
    assert await versions_answering(cluster, 20) == {"tiny:v1": 20}
    async with cluster.client() as http:
        refused = await http.post("/api/v1/deployments/chat-a/promote")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "canary_suite_unmet"
    assert "nexa eval run qa --deployment chat-a --canary" in error["message"]

    # A run against the deployment measures its stable version (v1): it does not count for the canary.
    stable = codec.loads(codec.api, (await run(cluster, "--json")).stdout, EvalRun)
    assert (stable.version, stable.passed) == ("v1", True)
    async with cluster.client() as http:
        assert (await http.post("/api/v1/deployments/chat-a/promote")).status_code == 409

    # The canary run reaches the canary's replicas alone: the stable replica's node now answers wrong.
    dep = (await get(cluster, "/api/v1/deployments/chat-a"))["deployment"]
    stable, on = dep["placed"][0]["node_id"], dep["canary"]["placed"][0]["node_id"]
    assert stable != on  # spread over the two nodes
    next(n for n in cluster.nodes if n.node_id == stable).set_faults(taught=TAUGHT, wrong=True)
    measured = await run(cluster, "--canary", "--json")
    assert measured.returncode == 0, measured.stderr
    on_canary = codec.loads(codec.api, measured.stdout, EvalRun)
    assert (on_canary.model, on_canary.version, on_canary.deployment) == ("tiny", "v2", "chat-a")
    assert on_canary.passed
    # Once it passed, the canary takes its share (0.1: 2 of 20, the router's split being exact).
    next(n for n in cluster.nodes if n.node_id == stable).set_faults(taught=TAUGHT)
    assert await versions_answering(cluster, 20) == {"tiny:v1": 18, "tiny:v2": 2}
    async with cluster.client() as http:
        promoted = await ok(http.post("/api/v1/deployments/chat-a/promote"))
    assert promoted["deployment"]["deployment"]["model"] == {"model": "tiny", "version": "v2"}


async def test_the_controller_runs_a_canarys_suite_itself_and_its_run_gates_promotion(cluster: SimCluster) -> None:
    assert (await register(cluster, "qa", lines(CASES[:3]))).returncode == 0
    canary: Json = {"model": {"model": "tiny", "version": "v2"}, "weight": 0.1}
    async with cluster.client() as http:
        await bring_to(http, cluster.s3, "tiny", "v2", "Approved")
        await ok(http.post("/api/v1/tenants", json={"id": "evals"}), 201)
        # A tenant or a suite that does not exist: refused, nothing starts.
        for gate, said in (
            ({"suite": "qa", "tenant": "nobody"}, "no tenant nobody"),
            ({"suite": "nope", "tenant": "evals"}, "no suite nope"),
        ):
            refused = await http.post("/api/v1/deployments/chat-a/canary", json=dict(canary, suite=gate))
            assert refused.status_code == 404 and said in refused.json()["error"]["message"], refused.text
        untold = await http.post("/api/v1/deployments/chat-a/canary", json=dict(canary, suite={"suite": "qa"}))
        assert untold.status_code == 400 and "suite.tenant" in untold.text
        assert (await ok(http.get("/api/v1/deployments/chat-a")))["deployment"]["canary"] is None

    # Through the CLI: the controller runs the suite (as tenant evals) once the canary is Ready.
    started = await cluster.cli(
        "deployments", "canary", "chat-a", "--model", "tiny", "--version", "v2", "--weight", "0.1",
        "--suite", "qa", "--suite-tenant", "evals",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert (
        "suite    qa (every pass rate >= 1) before promotion: the controller runs it as tenant evals" in started.stdout
    )
    dep = (await get(cluster, "/api/v1/deployments/chat-a"))["deployment"]
    stable, on = dep["placed"][0]["node_id"], dep["canary"]["placed"][0]["node_id"]
    assert stable != on  # spread over the two nodes
    # The run reaches the canary's replicas alone: the stable replica's node answers wrong.
    next(n for n in cluster.nodes if n.node_id == stable).set_faults(taught=TAUGHT, wrong=True)
    async with cluster.client() as http:  # at once: its replica is not Ready yet, so no run was made
        early = await http.post("/api/v1/deployments/chat-a/promote")
    assert early.status_code == 409 and "the controller runs it as tenant evals" in early.text, early.text
    async with httpx.AsyncClient(base_url=cluster.controller.url, timeout=10) as browser:
        assert (await sign_in(browser, cluster.controller.admin_key)).status_code == 303
        page = (await browser.get("/console/deployments/chat-a")).text
    assert 'id="canary-suite"' in page and "the controller runs it as tenant evals" in page

    async def recorded() -> list[Json]:
        return [r for r in (await get(cluster, "/api/v1/eval/runs"))["runs"] if r["run"]["canary"]]

    [measured_run] = await wait_until("the controller's run against the canary", recorded)
    assert (measured_run["version"], measured_run["passed"], measured_run["recorded_by"]) == ("v2", True, None)
    jobs = (await get(cluster, "/api/v1/jobs?kind=eval"))["jobs"]
    assert any(j["state"] == JobState.SUCCEEDED and "canary (tiny@v2)" in j["title"] for j in jobs), jobs
    async with cluster.client() as http:
        promoted = await ok(http.post("/api/v1/deployments/chat-a/promote"))
    assert promoted["deployment"]["deployment"]["model"] == {"model": "tiny", "version": "v2"}

    async def rolled() -> bool:
        return (await get(cluster, "/api/v1/deployments/chat-a"))["deployment"]["rollout"] is None

    await wait_until("the promotion rolled out", rolled)

    # A canary whose run fails is not promoted; an operator's later run counts (the newest decides).
    for node in cluster.nodes:
        node.set_faults(taught=TAUGHT, wrong=True)
    back = {"model": {"model": "tiny", "version": "v1"}, "weight": 0.1, "suite": {"suite": "qa", "tenant": "evals"}}
    async with cluster.client() as http:
        await ok(http.post("/api/v1/deployments/chat-a/canary", json=back), 201)

    async def failed_run() -> list[Json]:
        return [r for r in await recorded() if r["version"] == "v1" and not r["passed"]]

    await wait_until("the controller's failing run against the canary", failed_run)
    async with cluster.client() as http:
        refused = await http.post("/api/v1/deployments/chat-a/promote")
    assert refused.status_code == 409 and "the newest run (evrun_" in refused.json()["error"]["message"], refused.text
    for node in cluster.nodes:
        node.set_faults(taught=TAUGHT)
    measured = await run(cluster, "--canary", "--json")
    assert measured.returncode == 0, measured.stderr
    async with cluster.client() as http:
        promoted = await ok(http.post("/api/v1/deployments/chat-a/promote"))
    assert promoted["deployment"]["deployment"]["model"] == {"model": "tiny", "version": "v1"}
