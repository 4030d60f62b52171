"""Benchmark runs: judged against their deployment's service objectives, then kept.

`judge` is pure: a step (`BenchPoint`) meets the objectives when each set p95 holds and its
error rate (errors / requests) is at most `max_error_rate`; the recommended concurrency per
replica is the largest concurrency whose step met everything, divided by the replicas (at least
1). `Benchmarks.record` judges a posted run, keeps it (with who recorded it and the objectives it
was judged against; audited `benchmark.record`) and finishes its job, if it names one.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections.abc import Callable

from nexa.contracts import pages
from nexa.contracts.domain import Actor
from nexa.contracts.evidence import (
    MAX_POINTS,
    BenchPoint,
    BenchRun,
    BenchRunCreate,
    BenchVerdict,
    JobKind,
    JobState,
    Percentiles,
    ServiceObjectives,
)
from nexa.contracts.models import name_problem
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.deployments import Deployments
from nexa.control.operations.jobs import Jobs
from nexa.errors import ContractError, NotFound
from nexa.telemetry import Metrics

#: The longest model name and client version a run may carry.
_MAX_MODEL_CHARS = 200
_MAX_VERSION_CHARS = 64
_JOB_ID_RE = re.compile(r"job_[0-9a-f]{16}")


def _step(point: BenchPoint) -> str:
    if point.concurrency is not None:
        return f"c={point.concurrency}"
    if point.rate_rps is not None:
        return f"rate {point.rate_rps:g}/s"
    return "step"


def point_broken(objectives: ServiceObjectives, point: BenchPoint) -> list[str]:
    """What in `point` breaks `objectives` ("c=16: ttft p95 812 ms > 500 ms"); empty when it meets them."""
    label, broken = _step(point), []
    checks: list[tuple[str, Percentiles, float | None]] = [
        ("ttft", point.ttft_ms, objectives.ttft_p95_ms),
        ("tpot", point.tpot_ms, objectives.tpot_p95_ms),
        ("e2e", point.e2e_ms, objectives.e2e_p95_ms),
    ]
    for name, figures, bound in checks:
        if bound is not None and figures.p95 is not None and figures.p95 > bound:
            broken.append(f"{label}: {name} p95 {figures.p95:.0f} ms > {bound:g} ms")
    errors = sum(point.errors.values())
    rate = errors / point.requests if point.requests else (1.0 if errors else 0.0)
    if rate > objectives.max_error_rate:
        broken.append(f"{label}: error rate {rate:.4f} > {objectives.max_error_rate:g}")
    return broken


def judge(objectives: ServiceObjectives, replicas: int, points: list[BenchPoint]) -> BenchVerdict:
    """The verdict on a run's steps (see the module docstring). Pure."""
    broken: list[str] = []
    best: int | None = None
    for point in points:
        why = point_broken(objectives, point)
        broken += why
        if not why and point.concurrency is not None:
            best = point.concurrency if best is None else max(best, point.concurrency)
    recommended = None if best is None else max(1, math.floor(best / max(1, replicas)))
    return BenchVerdict(meets_objectives=not broken, broken=broken, recommended_concurrency=recommended)


def run_problems(run: BenchRunCreate) -> list[str]:
    """What is wrong with a run's shape (whether the deployment exists is checked apart)."""
    problems = [p for p in (name_problem("deployment", run.deployment),) if p]
    if not run.model or len(run.model) > _MAX_MODEL_CHARS or not run.model.isprintable():
        problems.append(f"model: the model name called, 1 to {_MAX_MODEL_CHARS} printable characters")
    if len(run.client_version) > _MAX_VERSION_CHARS or not run.client_version.isprintable():
        problems.append(f"client_version: at most {_MAX_VERSION_CHARS} printable characters")
    if len(run.points) > MAX_POINTS:
        problems.append(f"points: at most {MAX_POINTS}")
    for i, point in enumerate(run.points):
        if (point.concurrency is None) == (point.rate_rps is None):
            problems.append(f"points[{i}]: give exactly one of concurrency and rate_rps")
        if any(not code or len(code) > 64 or not code.isprintable() or n < 0 for code, n in point.errors.items()):
            problems.append(f"points[{i}].errors: codes of 1 to 64 printable characters, counts 0 or more")
        if len(point.errors) > 32:
            problems.append(f"points[{i}].errors: at most 32 codes")
        if sum(point.errors.values()) > point.requests:
            problems.append(f"points[{i}].errors: more errors than requests")
    if run.job is not None and not _JOB_ID_RE.fullmatch(run.job):
        problems.append("job: the id `POST /api/v1/jobs` answered (job_ and 16 hex digits)")
    return problems


class Benchmarks:
    """Benchmark runs in the store (see the module docstring)."""

    def __init__(
        self,
        store: st.Store,
        metrics: Metrics,
        deployments: Deployments,
        jobs: Jobs,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._deployments = deployments
        self._jobs = jobs
        self._clock = clock

    @classmethod
    def of(cls, benchmarks: Benchmarks | None) -> Benchmarks:
        if benchmarks is None:
            raise NotFound("this controller keeps no benchmark runs")
        return benchmarks

    async def record(self, actor: Actor, req: BenchRunCreate) -> BenchRun:
        """Judge and keep a run; refused (400) with what is wrong, or 404 for an unknown deployment."""
        if problems := run_problems(req):
            raise ContractError("invalid benchmark run: " + "; ".join(problems), problems=tuple(problems))
        try:
            dep = self._deployments.show(req.deployment).deployment
        except NotFound:
            raise NotFound(
                f"no deployment {req.deployment}: benchmark a deployment `nexa deployments list` shows"
            ) from None
        job = None if req.job is None else await self._jobs.get(req.job)  # NotFound before anything is kept
        if job is not None and job.kind is not JobKind.BENCHMARK:
            raise ContractError(f"job {job.id} is a {job.kind.value} job, not a benchmark's", problems=("job: kind",))
        run = BenchRun(
            id="bench_" + secrets.token_hex(8),
            recorded_at=self._clock(),
            recorded_by=actor.key_id or "controller",
            replicas=dep.replicas,
            objectives=dep.objectives,
            verdict=judge(dep.objectives, dep.replicas, req.points),
            run=req,
        )
        verdict = "meets its objectives" if run.verdict.meets_objectives else f"breaks {len(run.verdict.broken)}"
        detail = f"{req.kind.value} on {req.deployment}: {len(req.points)} step(s), {verdict}"
        draft = audit_draft(actor, "benchmark.record", f"benchmark/{run.id}", None, run, detail=detail)
        event = await self._store.run(st.insert_bench_run, run, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        if job is not None:
            summary = f"{verdict}; recommended concurrency {run.verdict.recommended_concurrency or '-'} per replica"
            await self._jobs.finish(job.id, JobState.SUCCEEDED, summary, link=f"/api/v1/benchmarks/{run.id}")
        return run

    async def page(
        self, deployment: str | None, after: pages.Key | None, limit: int
    ) -> tuple[list[BenchRun], pages.Key | None]:
        """Runs newest first (of one deployment, or all); the page and the key to continue after."""
        key = None if after is None else (float(after[0]), str(after[1]))
        runs = await self._store.read(st.list_bench_runs, deployment, key, limit + 1)
        return pages.cut(runs, limit, lambda r: (r.recorded_at, r.id))

    async def get(self, run_id: str) -> BenchRun:
        run = await self._store.read(st.get_bench_run, run_id)
        if run is None:
            raise NotFound(f"no benchmark run {run_id}: list them with `nexa benchmarks list`")
        return run

    async def latest(self) -> list[BenchRun]:
        """The newest run of each deployment and kind (what the release evidence checks)."""
        return await self._store.read(st.latest_bench_runs)
