"""Evaluation suites and measured runs (`nexa eval`).

`register` checks a suite file (`contracts.evals.parse_suite`: every bad line named, nothing kept)
and keeps it by name and sha256 digest, audited `eval.suite.register`; a scorer that calls a
deployment nobody may call (no such deployment) is refused (404). `record` takes a run the CLI made
through the gateway (each case's score), checks it against the registered suite (the digest, every
case id once, each case's metric), recomputes the summaries here (pass rate with its Wilson
interval, mean with its t interval), keeps it (`eval.run.record`) and records it as the model
version's evaluation, marked measured (`ModelRegistry.record_measured`), then finishes its job.

`start_replica` places an evaluation replica for a running `eval` job (`nexa eval run --model`:
`control.deployments.evalreplica`), `stop_replica` removes it, and `run_sweeps` (a leader loop) removes
every one whose job is no longer running (finished, failed, cancelled, gone stale) or whose time is
up, audited `eval.replica.stop` by the controller with the reason: an evaluation that dies leaves
nothing running for longer than `SWEEP_S`.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import Final

import trio

from nexa.contracts import evals as ev
from nexa.contracts import pages
from nexa.contracts.deployments import Deployment, DeploymentView
from nexa.contracts.domain import SYSTEM, Actor
from nexa.contracts.evidence import JobKind, JobState
from nexa.contracts.models import EvaluationRecord, name_problem
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.deployments import Deployments
from nexa.control.operations.jobs import Jobs
from nexa.control.registry.models import ModelRegistry
from nexa.errors import Conflict, ContractError, NoCanary, NoRollout, NotFound
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: How often evaluation replicas are looked at for their job's end or their time (seconds).
SWEEP_S: Final = 2.0
_KEY_ID_RE: Final = re.compile(r"^[0-9a-f]{12}$")


class Evals:
    """Suites and runs in the store (see the module docstring)."""

    def __init__(
        self,
        store: st.Store,
        metrics: Metrics,
        deployments: Deployments,
        models: ModelRegistry,
        jobs: Jobs,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._deployments = deployments
        self._models = models
        self._jobs = jobs
        self._clock = clock

    @classmethod
    def of(cls, evals: Evals | None) -> Evals:
        if evals is None:
            raise NotFound("this controller keeps no evaluation suites")
        return evals

    async def register(self, actor: Actor, req: ev.SuiteCreate) -> ev.Suite:
        """Check and keep a suite; 400 naming each bad line, 404 for a deployment a scorer names."""
        if problem := name_problem("name", req.name):
            raise ContractError(f"invalid suite: {problem}", problems=(problem,))
        parsed, problems = ev.parse_suite(req.content)
        if parsed is None:
            raise ContractError(
                f"invalid suite {req.name}: " + "; ".join(problems[:20]) + ("; ..." if len(problems) > 20 else ""),
                problems=tuple(problems),
            )
        for name in parsed.deployments:
            self._deployment(name, "a scorer of the suite names")
        suite = ev.Suite(
            name=req.name,
            digest=parsed.digest,
            cases=len(parsed.cases),
            metrics=parsed.metrics,
            deployments=parsed.deployments,
            registered_at=self._clock(),
            registered_by=actor.key_id,
        )
        detail = f"{suite.name} sha256:{suite.digest[:16]}: {suite.cases} case(s), {', '.join(suite.metrics)}"
        draft = audit_draft(actor, "eval.suite.register", f"suite/{suite.name}", None, suite, detail=detail[:300])
        event = await self._store.run(st.insert_suite, suite, req.content, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        return suite

    async def suite(self, name: str, digest: str | None = None) -> ev.SuiteDetail:
        found = await self._store.read(st.get_suite, name, digest)
        if found is None:
            at = "" if digest is None else f" at sha256 {digest[:16]}"
            raise NotFound(f"no suite {name}{at}: register it with `nexa eval register FILE --name {name}`")
        return ev.SuiteDetail(suite=found[0], content=found[1])

    async def suites(self) -> list[ev.Suite]:
        return await self._store.read(st.list_suites)

    async def record(self, actor: Actor, req: ev.EvalRunCreate) -> ev.EvalRun:
        """Check, summarize and keep a run; record it as the served version's measured evaluation."""
        if problems := ev.run_problems(req):
            raise ContractError("invalid evaluation run: " + "; ".join(problems), problems=tuple(problems))
        detail = await self.suite(req.suite, req.digest)
        parsed, _ = ev.parse_suite(detail.content)
        assert parsed is not None  # it was checked when it was registered
        if problems := _case_problems(parsed, req.cases):
            raise ContractError("the run does not match its suite: " + "; ".join(problems), problems=tuple(problems))
        dep = self._deployment(req.deployment, "the run names")
        version = dep.model
        if req.canary:
            if dep.canary is None:
                raise NoCanary(f"deployment {dep.name} runs no canary: the run against its canary cannot be recorded")
            version = dep.canary.model
        if req.rollout and dep.rollout is None:
            raise NoRollout(
                f"deployment {dep.name} has no rollout in progress: the run against its new replicas cannot be recorded"
            )
        job = None if req.job is None else await self._jobs.get(req.job)
        if job is not None and job.kind is not JobKind.EVAL:
            raise ContractError(f"job {job.id} is a {job.kind.value} job, not an evaluation's", problems=("job: kind",))
        summaries = ev.summarize(req.cases)
        passed = all(s.pass_rate >= req.min_pass_rate for s in summaries)
        now = self._clock()
        run_id = "evrun_" + secrets.token_hex(8)
        metrics: dict[str, float] = {}
        for s in summaries:
            metrics[s.metric] = s.pass_rate
            metrics[f"{s.metric}.mean"] = s.mean
        evaluation = EvaluationRecord(
            id="eval_" + secrets.token_hex(8),
            model=version.model,
            version=version.version,
            suite=req.suite,
            metrics=metrics,
            passed=passed,
            evidence=f"/api/v1/eval/runs/{run_id}",
            recorded_at=now,
            recorded_by=actor.key_id,
            measured=True,
            suite_digest=req.digest,
            deployment=req.deployment,
            run=run_id,
            rollout=req.rollout,
        )
        kept = await self._models.record_measured(actor, evaluation)
        run = ev.EvalRun(
            id=run_id,
            suite=req.suite,
            digest=req.digest,
            deployment=req.deployment,
            model=version.model,
            version=version.version,
            passed=passed,
            summaries=summaries,
            evaluation=None if kept is None else kept.id,
            recorded_at=now,
            recorded_by=actor.key_id,
            run=req,
        )
        verdict = "passed" if passed else "failed"
        line = ", ".join(f"{s.metric} {s.pass_rate:.3f}" for s in summaries)
        which = ", canary" if req.canary else ", new replicas" if req.rollout else ""
        what = f"{req.suite} on {req.deployment} ({version.key}{which}): {verdict}; {line}"
        draft = audit_draft(actor, "eval.run.record", f"eval-run/{run.id}", None, run, detail=what[:300])
        event = await self._store.run(st.insert_eval_run, run, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        if job is not None:
            await self._jobs.finish(
                job.id, JobState.SUCCEEDED, f"{verdict}; {line}"[:500], f"/api/v1/eval/runs/{run.id}"
            )
        return run

    async def run(self, run_id: str) -> ev.EvalRun:
        run = await self._store.read(st.get_eval_run, run_id)
        if run is None:
            raise NotFound(f"no evaluation run {run_id}: list them with `nexa eval runs`")
        return run

    async def page(
        self, suite: str | None, after: pages.Key | None, limit: int
    ) -> tuple[list[ev.EvalRun], pages.Key | None]:
        key = None if after is None else (float(after[0]), str(after[1]))
        runs = await self._store.read(st.list_eval_runs, suite, key, limit + 1)
        return pages.cut(runs, limit, lambda r: (r.recorded_at, r.id))

    async def compare(self, a: str, b: str) -> ev.EvalCompare:
        return ev.compare(await self.run(a), await self.run(b))

    # ---- evaluation replicas ---------------------------------------------------------------------

    async def start_replica(self, actor: Actor, req: ev.EvalReplicaCreate) -> ev.EvalReplica:
        """Place an evaluation replica for a running `eval` job and a registered suite; typed
        refusals change nothing (400 shape, 404 suite, job or `like`, 409 job not running, 422
        the version may not run or does not fit)."""
        problems = []
        if not _KEY_ID_RE.match(req.key_id):
            problems.append("key_id: an API key's public id (the 12 hex digits after nxk_)")
        if not 0 < req.ttl_s <= ev.MAX_REPLICA_TTL_S:
            problems.append(f"ttl_s: above 0 and at most {ev.MAX_REPLICA_TTL_S:g}")
        if problems:
            raise ContractError("invalid evaluation replica: " + "; ".join(problems), problems=tuple(problems))
        await self.suite(req.suite)
        job = await self._jobs.get(req.job)
        if job.kind is not JobKind.EVAL:
            raise ContractError(f"job {job.id} is a {job.kind.value} job, not an evaluation's", problems=("job: kind",))
        if job.state is not JobState.RUNNING:
            raise Conflict(f"job {job.id} is {job.state.value}: start an evaluation replica for a running job")
        view = await self._deployments.start_eval_replica(actor, req)
        return _replica(view)

    async def replicas(self) -> list[ev.EvalReplica]:
        return [_replica(self._deployments.show(d.name)) for d in self._deployments.eval_replicas()]

    async def stop_replica(self, actor: Actor, name: str, why: str = "its evaluation ended") -> ev.EvalReplica:
        """Remove evaluation replica `name` (404 when there is none by that name)."""
        view = self._replica_view(name)
        if not await self._deployments.stop_eval_replica(actor, name, why):
            raise NotFound(f"no evaluation replica {name}: it was removed already")
        return _replica(view)

    def _replica_view(self, name: str) -> DeploymentView:
        try:
            view = self._deployments.show(name)
        except NotFound:
            view = None
        if view is None or view.deployment.eval is None:
            raise NotFound(f"no evaluation replica {name}: `nexa eval replicas` lists them")
        return view

    async def run_sweeps(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every `SWEEP_S`, `sweep` (a leader loop): until cancelled."""
        task_status.started()
        while True:
            await self.sweep()
            await trio.sleep(SWEEP_S)

    async def sweep(self) -> list[str]:
        """Remove each evaluation replica whose job is not running or whose time is up; their names."""
        if self._deployments.recovering:
            return []
        removed = []
        for dep in self._deployments.eval_replicas():
            binding = dep.eval
            assert binding is not None
            why = None
            if self._clock() >= binding.expires_at:
                why = "its time was up (ttl_s)"
            else:
                try:
                    job = await self._jobs.get(binding.job)
                except NotFound:
                    why = f"its job {binding.job} is gone"
                else:
                    if job.state is not JobState.RUNNING:
                        why = f"its job {job.id} is {job.state.value}"
            if why is not None and await self._deployments.stop_eval_replica(SYSTEM, dep.name, why):
                log.info("evaluation replica %s removed: %s", dep.name, why)
                removed.append(dep.name)
        return removed

    def _deployment(self, name: str, who: str) -> Deployment:
        try:
            return self._deployments.show(name).deployment
        except NotFound:
            raise NotFound(f"no deployment {name} ({who}): `nexa deployments list` shows them") from None


def _replica(view: DeploymentView) -> ev.EvalReplica:
    dep = view.deployment
    assert dep.eval is not None
    return ev.EvalReplica(
        deployment=dep.name,
        model=dep.model,
        suite=dep.eval.suite,
        job=dep.eval.job,
        expires_at=dep.eval.expires_at,
        ready=view.ready,
    )


def _case_problems(parsed: ev.ParsedSuite, cases: list[ev.CaseResult]) -> list[str]:
    want = {c.id: c.metric for c in parsed.cases}
    got: dict[str, int] = {}
    problems = []
    for c in cases:
        got[c.id] = got.get(c.id, 0) + 1
        if c.id not in want:
            problems.append(f"case {c.id[:64]!r}: not in the suite")
        elif c.metric != want[c.id]:
            problems.append(f"case {c.id}: metric {c.metric[:64]!r}, the suite says {want[c.id]!r}")
    problems += [f"case {i}: given {n} times" for i, n in got.items() if n > 1 and i in want]
    problems += [f"case {i}: no result" for i in want if i not in got]
    return problems[:50]
