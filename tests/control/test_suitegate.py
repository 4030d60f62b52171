"""The controller's own suite-gate runs (`nexa.control.operations.suitegate.GateRuns`) with their
collaborators faked: each case through `Gateway.call` as the gate's tenant (no key), the run
recorded once; a run a previous leader left in flight failed and run again; a run without a result
(its tenant gone) failed, shown and retried after a backoff; a run no longer wanted cancelled with
its job. Which gates want a run, and the runs end to end against real replicas, are in
tests/e2e/test_suite_gate_runs.py and tests/test_evals.py."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from nexa.contracts.deployments import CanarySuite
from nexa.contracts.evidence import JobKind, JobState
from nexa.control.operations import suitegate
from nexa.control.operations.suitegate import GateRuns, Want
from nexa.errors import QuotaExceeded
from tests.support.evals import CASES, TAUGHT, lines

Json = dict[str, Any]
GATE = CanarySuite(suite="qa", tenant="evals")
WANT = Want(
    deployment="chat-a",
    against="rollout",
    gate=GATE,
    subject="suite-gate/chat-a/rollout/1.000000/r1",
    what="chat-a's new replicas (replica r1)",
)


class Jobs:
    def __init__(self) -> None:
        self.jobs: dict[str, Json] = {}

    async def record(self, kind: JobKind, title: str, *, subject: str, progress: float) -> str:
        job_id = f"job_{len(self.jobs)}"
        self.jobs[job_id] = {"kind": kind, "title": title, "subject": subject, "state": JobState.RUNNING}
        return job_id

    async def running_of(self, kind: JobKind, subject: str) -> Any:
        found = [i for i, j in self.jobs.items() if j["subject"] == subject and j["state"] is JobState.RUNNING]
        return SimpleNamespace(id=found[-1]) if found else None

    async def progress(self, job_id: str, progress: float, summary: str = "") -> None:
        self.jobs[job_id]["progress"] = progress

    async def finish(self, job_id: str, state: JobState, summary: str = "", link: str | None = None) -> None:
        self.jobs[job_id] |= {"state": state, "summary": summary}


class Evals:
    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self.recorded: list[Any] = []

    async def suite(self, name: str) -> Any:
        return SimpleNamespace(content=lines(CASES[:3]))

    async def record(self, actor: Any, create: Any) -> Any:  # as Evals.record: kept, its job finished
        self.recorded.append((actor, create))
        await self.jobs.finish(create.job, JobState.SUCCEEDED, "passed")
        return SimpleNamespace(id="evrun_1", passed=all(c.passed for c in create.cases))


class Gateway:
    """Answers as the taught sim runtime; `hold` makes every call wait until cancelled."""

    def __init__(self) -> None:
        self.works: list[Any] = []
        self.hold = False
        #: Refuse every call for the tenant's quota, as `Quotas.admit` does (429 `quota_exceeded`).
        self.over_quota = False

    @contextlib.asynccontextmanager
    async def call(self, work: Any) -> AsyncIterator[Any]:
        self.works.append(work)
        if self.hold:
            await trio.sleep_forever()
        if self.over_quota:
            raise QuotaExceeded(
                "tenant evals: requests per minute used up", limit="requests_per_minute", retry_after_s=60
            )
        prompt = json.dumps(work.body)
        content = next((a for text, a in TAUGHT.items() if text in prompt), "?")
        body = json.dumps({"choices": [{"message": {"content": content}}]}).encode()

        async def read_all() -> bytes:
            return body

        yield SimpleNamespace(read_all=read_all, error=None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    wants = [WANT]
    monkeypatch.setattr(suitegate, "wanted", lambda _deployments: list(wants))
    dep = SimpleNamespace(name="chat-a", alias="chat", model=SimpleNamespace(model="tiny"), canary=None)
    ready = ["r1"]
    deployments = SimpleNamespace(
        recovering=False,
        desired=SimpleNamespace(entry=lambda _name: SimpleNamespace(deployment=dep)),
        show=lambda _name: SimpleNamespace(deployment=dep),
        serving=lambda _version, alias: SimpleNamespace(replicas=list(ready) if alias == WANT.model else []),
    )
    jobs = Jobs()
    evals = Evals(jobs)
    gateway = Gateway()
    tenants = {"evals"}
    clock = Clock()
    audited: list[tuple[Any, ...]] = []

    async def audit(actor: Any, action: str, target: str, *, detail: str) -> None:
        audited.append((actor.key_id, action, target, detail))

    runs = GateRuns(
        deployments,  # type: ignore[arg-type]
        evals,  # type: ignore[arg-type]
        jobs,  # type: ignore[arg-type]
        gateway,  # type: ignore[arg-type]
        tenant_exists=lambda t: t in tenants,
        audit=audit,
        deadline_s=30.0,
        clock=clock,
    )
    return SimpleNamespace(
        runs=runs,
        audited=audited,
        wants=wants,
        jobs=jobs,
        evals=evals,
        gateway=gateway,
        tenants=tenants,
        clock=clock,
        ready=ready,
    )


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def test_a_run_goes_through_the_gateway_as_the_tenant_and_is_recorded_once(parts: SimpleNamespace) -> None:
    async with trio.open_nursery() as nursery:
        # A previous leader's run was cut off before its result: failed, and run again.
        left = await parts.jobs.record(JobKind.EVAL, "eval qa", subject=WANT.subject, progress=0.0)
        assert parts.runs.check(nursery) == [WANT.subject]
        assert parts.runs.check(nursery) == []  # one run in flight per gate
        await settle()
    assert parts.jobs.jobs[left]["state"] is JobState.FAILED
    assert parts.jobs.jobs[left]["summary"].startswith("interrupted: its controller stopped")
    [(actor, create)] = parts.evals.recorded
    assert actor.key_id is None  # the controller itself
    assert (create.suite, create.deployment, create.model) == ("qa", "chat-a", "nexa-eval-rollout.chat-a")
    assert create.rollout and not create.canary and create.min_pass_rate == 1.0
    assert all(c.passed for c in create.cases) and len(create.cases) == 3
    [job] = [j for j in parts.jobs.jobs.values() if j["state"] is JobState.SUCCEEDED]
    assert job["title"] == "eval qa on chat-a's new replicas (replica r1), by the controller as tenant evals"
    assert {(w.tenant, w.key_id, w.model, w.stream) for w in parts.gateway.works} == {
        ("evals", "controller", "nexa-eval-rollout.chat-a", False)
    }
    assert all("model" not in w.body for w in parts.gateway.works)
    assert parts.runs.running() == []
    [(who, action, target, detail)] = parts.audited  # the start, by the controller
    assert (who, action, target) == (None, "eval.gate.run", "deployment/chat-a")
    assert detail.startswith("eval qa on chat-a's new replicas (replica r1), by the controller as tenant evals (job ")


async def test_a_run_without_a_result_is_failed_shown_and_tried_again_after_a_backoff(
    parts: SimpleNamespace,
) -> None:
    parts.tenants.clear()  # the gate's tenant was deleted since
    async with trio.open_nursery() as nursery:
        parts.runs.check(nursery)
        await settle()
        [failed] = parts.jobs.jobs.values()
        assert failed["state"] is JobState.FAILED
        assert failed["summary"].startswith("no result: no tenant evals for suite qa's runs: create it")
        assert failed["summary"].endswith("tried again in 5 s")
        assert parts.runs.check(nursery) == []  # backing off
        parts.clock.now += 5
        assert parts.runs.check(nursery) == [WANT.subject]
        await settle()
        said = [j["summary"].rsplit("; ", 1)[1] for j in parts.jobs.jobs.values()]
        assert said == ["tried again in 5 s", "tried again in 10 s"]  # doubling
        parts.tenants.add("evals")
        parts.clock.now += 10
        parts.runs.check(nursery)
        await settle()
    assert len(parts.evals.recorded) == 1 and parts.gateway.works
    assert [j["state"] for j in parts.jobs.jobs.values()] == [JobState.FAILED, JobState.FAILED, JobState.SUCCEEDED]


async def test_a_case_the_tenants_quota_refuses_is_no_result_not_a_failing_run(parts: SimpleNamespace) -> None:
    """A refusal for capacity says nothing of the replicas' answers: no run is recorded (a failing one
    would revert the rollout); the job says why and what to do, and the gate is tried again later."""
    parts.gateway.over_quota = True
    async with trio.open_nursery() as nursery:
        parts.runs.check(nursery)
        await settle()
        [failed] = parts.jobs.jobs.values()
        assert failed["state"] is JobState.FAILED
        assert failed["summary"].startswith("no result: the quota or rate limit of tenant evals refused a case")
        assert "`nexa quotas set`" in failed["summary"] and failed["summary"].endswith("tried again in 5 s")
        assert parts.evals.recorded == [] and parts.gateway.works  # asked, and nothing recorded
        parts.gateway.over_quota = False  # room again
        parts.clock.now += 5
        parts.runs.check(nursery)
        await settle()
    [(_, create)] = parts.evals.recorded
    assert all(c.passed for c in create.cases)


async def test_no_ready_replica_to_measure_is_no_result_and_nothing_is_sent(parts: SimpleNamespace) -> None:
    parts.ready.clear()  # the new replica went between its soak and the run
    async with trio.open_nursery() as nursery:
        parts.runs.check(nursery)
        await settle()
    [job] = parts.jobs.jobs.values()
    assert job["state"] is JobState.FAILED
    assert job["summary"] == (
        "no result: deployment chat-a has no Ready rollout replica to run suite qa on; tried again in 5 s"
    )
    assert parts.gateway.works == [] and parts.evals.recorded == []


async def test_a_run_no_longer_wanted_is_cancelled_with_its_job(parts: SimpleNamespace) -> None:
    parts.gateway.hold = True
    async with trio.open_nursery() as nursery:
        parts.runs.check(nursery)
        await settle()
        assert parts.runs.running() == [WANT.subject]
        parts.wants.clear()  # the replica passed by an operator's run, or the rollout ended
        assert parts.runs.check(nursery) == []
        await settle()
    [job] = parts.jobs.jobs.values()
    assert job["state"] is JobState.CANCELLED and job["summary"].startswith("stopped: no longer wanted")
    assert parts.evals.recorded == [] and parts.runs.running() == []


def test_the_model_name_reaches_only_the_gated_replicas() -> None:
    assert WANT.model == "nexa-eval-rollout.chat-a"
    canary = Want(deployment="chat-a", against="canary", gate=GATE, subject="s", what="w")
    assert canary.model == "nexa-eval-canary.chat-a"
