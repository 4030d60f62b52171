"""`nexa eval run SUITE --model NAME@VERSION` end to end: the CLI as a subprocess against a controller
with `[models] approval_requires`, real `nexa node` agents and their `sim` runtimes (taught the
right answers through their faults file). A version not yet approved is measured on a short-lived
evaluation replica that clients cannot reach, then approved; the replica is gone after the run,
after a failed run and once its job is cancelled; bad input is refused, typed, leaving nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from nexa.config.control import ApprovalRequirement
from nexa.contracts import codec
from nexa.contracts.deployments import EVAL_PREFIX
from nexa.contracts.domain import parse_api_key
from nexa.contracts.evals import EvalRun
from nexa.contracts.evidence import JobState
from nexa.control.operations.evals import SWEEP_S
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SimCluster, new_key, sdk, sim_cluster, wait_until
from tests.support.evals import CASES, TAUGHT, lines, register
from tests.support.models import audit_events, bring_to, registry_config

pytestmark = pytest.mark.slow
Json = dict[str, Any]

#: Three `exact` cases and an embedding pair the replica under test embeds itself.
SUITE = lines([*CASES[:3], CASES[7]])


#: What `[models] approval_requires` asks in these tests: a measured `exact` pass rate of 0.9 by `qa`.
NEED = (ApprovalRequirement(suite="qa", metric="exact", min=0.9),)


@pytest.fixture
async def cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[SimCluster]:
    """Two sim nodes, `chat-a` serving tiny@v1 (the template `--like` names), suite `qa` registered,
    then `[models] approval_requires = NEED`. The requirement is set on the controller's own config
    once the cluster stands (the registry reads it at each approval), because the fixture's tiny@v1
    had to be approved first, with nothing measured, to deploy the template."""
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images) as c:
        for node in c.nodes:
            node.set_faults(taught=TAUGHT)
        await c.deploy("chat-a", replicas=1)
        assert (await register(c, "qa", SUITE)).returncode == 0
        object.__setattr__(cfg.models, "approval_requires", NEED)  # frozen config: see the docstring
        yield c


async def get(cluster: SimCluster, path: str) -> Json:
    async with cluster.client() as http:
        return await ok(http.get(path))


async def eval_deployments(cluster: SimCluster) -> list[str]:
    """Evaluation replicas the API lists, and those any node still reports running (a replica's id
    starts with its deployment's name)."""
    listed = [d["deployment"]["name"] for d in (await get(cluster, "/api/v1/deployments"))["deployments"]]
    nodes = (await get(cluster, "/api/v1/nodes"))["nodes"]
    held = [a["assignment_id"] for n in nodes for a in n["assignments"]]
    return [d for d in listed + held if d.startswith(EVAL_PREFIX)]


async def test_a_version_not_yet_approved_is_measured_on_a_hidden_replica_then_approved(cluster: SimCluster) -> None:
    async with cluster.client() as http:
        await bring_to(http, cluster.s3, "tiny", "v2", "Verified")
        refused = await http.post("/api/v1/models/tiny/v2/approve")
        assert refused.status_code == 409, refused.text  # Verified: nothing measured, nothing evaluated

    measured = await cluster.cli(
        "eval", "run", "qa", "--model", "tiny@v2", "--like", "chat-a", "--json",
        "--inference-key", cluster.inference_key,
    )  # fmt: skip
    assert measured.returncode == 0, measured.stderr
    run = codec.loads(codec.api, measured.stdout, EvalRun)
    assert run.passed and (run.model, run.version) == ("tiny", "v2")
    assert run.deployment.startswith(EVAL_PREFIX)
    assert {s.metric: s.pass_rate for s in run.summaries} == {"exact": 1.0, "cosine": 1.0}

    model = await get(cluster, "/api/v1/models/tiny/v2")
    [evaluation] = [e for e in model["evaluations"] if e["measured"]]
    assert evaluation["run"] == run.id and evaluation["deployment"] == run.deployment and evaluation["passed"]
    assert model["model"]["state"] == "Evaluated"  # the measured pass moved it on
    job = await get(cluster, f"/api/v1/jobs/{run.run.job}")
    assert job["state"] == JobState.SUCCEEDED and "tiny@v2" in job["title"]

    # The replica is gone: from the evaluation replicas and the deployments at once, then from every node.
    assert (await get(cluster, "/api/v1/eval/replicas"))["replicas"] == []
    await wait_until("no evaluation replica left", lambda: none_left(cluster))
    async with cluster.client() as http:
        actions = [(e["action"], e["target"]) for e in await audit_events(http)]
        assert ("eval.replica.start", f"deployment/{run.deployment}") in actions
        assert ("eval.replica.stop", f"deployment/{run.deployment}") in actions
        # `approval_requires` is met by the measured result: approval passes.
        approved = await ok(http.post("/api/v1/models/tiny/v2/approve"))
    assert approved["state"] == "Approved"


async def test_the_replica_serves_only_its_evaluation_key_and_goes_when_the_job_is_cancelled(
    cluster: SimCluster,
) -> None:
    key_id = parse_api_key(cluster.inference_key)
    async with cluster.client() as http:
        await bring_to(http, cluster.s3, "tiny", "v2", "Verified")
        job = await ok(http.post("/api/v1/jobs", json={"kind": "eval", "title": "by hand"}), 201)
        body = {"model": {"model": "tiny", "version": "v2"}, "suite": "qa", "job": job["id"], "key_id": key_id}
        replica = await ok(http.post("/api/v1/eval/replicas", json=dict(body, like="chat-a")), 201)
    name = replica["deployment"]
    assert name.startswith(EVAL_PREFIX) and replica["model"] == {"model": "tiny", "version": "v2"}
    await cluster.wait_ready(name, 1)

    bound = sdk(cluster)
    other = sdk(cluster, await new_key(cluster, "inference", cluster.tenant))
    messages: Any = [{"role": "user", "content": "capital of France?"}]

    def ask(client: openai.OpenAI, model: str) -> str | None:
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        return answer.choices[0].message.content

    assert await trio.to_thread.run_sync(ask, bound, name) == "Paris"
    with pytest.raises(openai.PermissionDeniedError, match="only its evaluation's key"):
        await trio.to_thread.run_sync(ask, other, name)
    for client in (bound, other):  # the version itself is served nowhere to clients
        with pytest.raises(openai.NotFoundError, match="has no deployment"):
            await trio.to_thread.run_sync(ask, client, "tiny:v2")
    listed = await trio.to_thread.run_sync(lambda: [m.id for m in bound.models.list()])
    assert name not in listed and "chat" in listed
    assert await trio.to_thread.run_sync(ask, bound, "chat") == "Paris"  # tiny@v1 serves on

    async with cluster.client() as http:
        await ok(http.post(f"/api/v1/jobs/{job['id']}", json={"state": "cancelled"}))
    with trio.fail_after(SWEEP_S * 10):
        await wait_until("the replica removed", lambda: _gone(cluster, name))
    async with cluster.client() as http:
        [stop] = [e for e in await audit_events(http) if e["action"] == "eval.replica.stop"]
    assert stop["target"] == f"deployment/{name}" and "cancelled" in stop["detail"]
    with pytest.raises(openai.NotFoundError):
        await trio.to_thread.run_sync(ask, bound, name)

    # The finished job takes no new replica (409); a bad shape is 400; neither starts anything.
    async with cluster.client() as http:
        finished = await http.post("/api/v1/eval/replicas", json=dict(body, like="chat-a"))
        assert finished.status_code == 409 and "cancelled" in finished.text
        job = await ok(http.post("/api/v1/jobs", json={"kind": "eval", "title": "short"}), 201)
        shaped = dict(body, job=job["id"], like="chat-a", key_id="nope", ttl_s=0)
        bad = await http.post("/api/v1/eval/replicas", json=shaped)
        assert bad.status_code == 400 and "key_id" in bad.text and "ttl_s" in bad.text
        # A replica whose time is up goes although its job still runs.
        short = await ok(http.post("/api/v1/eval/replicas", json=dict(shaped, key_id=key_id, ttl_s=1)), 201)
    with trio.fail_after(SWEEP_S * 10):
        await wait_until("the expired replica removed", lambda: _gone(cluster, short["deployment"]))
    async with cluster.client() as http:
        stops = [e for e in await audit_events(http) if e["action"] == "eval.replica.stop"]
    assert stops[-1]["target"] == f"deployment/{short['deployment']}" and "time was up" in stops[-1]["detail"]


async def _gone(cluster: SimCluster, name: str) -> bool:
    return not any(d.startswith(name) for d in await eval_deployments(cluster))


async def none_left(cluster: SimCluster) -> bool:
    return await eval_deployments(cluster) == []


async def test_bad_input_is_refused_typed_and_a_failed_run_leaves_no_replica(cluster: SimCluster) -> None:
    async with cluster.client() as http:
        await bring_to(http, cluster.s3, "tiny", "v2", "Verified")
        await bring_to(http, cluster.s3, "tiny", "v3", "Candidate")
        named = {
            "name": EVAL_PREFIX + "mine", "runtime": "sim", "model": {"model": "tiny", "version": "v1"},
            "resources": {"accelerators": 0, "memory_bytes": 64 * 2**20, "cpus": 0.5},
        }  # fmt: skip
        reserved = await http.post("/api/v1/deployments", json=named)
        assert reserved.status_code == 400 and "kept for evaluation replicas" in reserved.text

    async def run(*args: str, key: str | None = None) -> tuple[int, str]:
        done = await cluster.cli("eval", "run", *args, "--inference-key", key or cluster.inference_key)
        return done.returncode, done.stderr

    cases = [
        (("qa", "--model", "tiny@v9", "--like", "chat-a"), "model_unknown"),
        (("qa", "--model", "tiny@v3", "--like", "chat-a"), "model_not_verified"),
        (("qa", "--model", "tiny@v2", "--like", "nowhere"), "no deployment nowhere"),
        (("missing", "--model", "tiny@v2", "--like", "chat-a"), "no suite missing"),
        (("qa", "--model", "tiny", "--like", "chat-a"), "--model: NAME@VERSION"),
        (("qa", "--model", "tiny@v2"), "--like DEPLOYMENT"),
        (("qa", "--deployment", "chat-a", "--like", "chat-a"), "--like and --runtime go with --model"),
    ]
    for argv, needle in cases:
        code, stderr = await run(*argv)
        assert code != 0 and needle in stderr, (argv, stderr)

    # A key the gateway refuses stops the run (403): the replica it started is removed all the same.
    code, stderr = await run("qa", "--model", "tiny@v2", "--like", "chat-a", key=await new_key(cluster, "audit"))
    assert code == 1 and "forbidden" in stderr, stderr
    assert (await get(cluster, "/api/v1/eval/replicas"))["replicas"] == []
    await wait_until("no evaluation replica left", lambda: none_left(cluster))
    async with cluster.client() as http:
        starts = [e for e in await audit_events(http) if e["action"] == "eval.replica.start"]
    assert len(starts) == 1  # only the refused run's; every bad input started nothing
    jobs = (await get(cluster, "/api/v1/jobs?kind=eval"))["jobs"]
    assert JobState.FAILED in {j["state"] for j in jobs}
    model = await get(cluster, "/api/v1/models/tiny/v2")
    assert not any(e["measured"] for e in model["evaluations"]) and model["model"]["state"] == "Verified"
