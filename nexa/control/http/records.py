"""Record routes: benchmark runs, client jobs and release evidence; each a thin adapter onto
`Benchmarks`, `Jobs`, `Evidence`. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

from typing import Any, Final

from quart import Response, request

from nexa.contracts.evidence import (
    BenchRun,
    BenchRunCreate,
    BenchRunList,
    EvidenceRequest,
    EvidenceSigned,
    Job,
    JobCreate,
    JobKind,
    JobList,
    JobState,
    JobUpdate,
)
from nexa.contracts.models import name_problem
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page, query_enum
from nexa.control.http.declare import OPERATORS, PAGE_QUERY, Param, route
from nexa.control.http.state import AppState
from nexa.control.operations.benchmarks import Benchmarks
from nexa.control.operations.jobs import Jobs
from nexa.errors import Conflict, ContractError, NotFound


def _choice(cls: type[JobKind] | type[JobState]) -> dict[str, Any]:
    return {"type": "string", "enum": [v.value for v in cls]}


_JOB_FILTERS: Final = (Param(name="kind", schema=_choice(JobKind)), Param(name="state", schema=_choice(JobState)))
_RUN_FILTER: Final = Param(name="deployment", schema=str, description="only this deployment's runs")

# ---- benchmark runs ----------------------------------------------------------------------------


@route(
    "POST",
    "/api/v1/benchmarks",
    roles=OPERATORS,
    summary="Record a benchmark run (`nexa bench`), judged",
    tag="benchmarks",
    request=BenchRunCreate,
    answer=BenchRun,
    status=201,
    errors=(NotFound,),
)
async def record_benchmark(s: AppState) -> Response:
    run = await Benchmarks.of(s.benchmarks).record(actor(), await body(BenchRunCreate))
    return json_response(run, 201)


@route(
    "GET",
    "/api/v1/benchmarks",
    roles=OPERATORS,
    summary="Benchmark runs, newest first",
    tag="benchmarks",
    answer=BenchRunList,
    params=(*PAGE_QUERY, _RUN_FILTER),
)
async def list_benchmarks(s: AppState) -> Response:
    deployment = request.args.get("deployment")
    if deployment is not None and (problem := name_problem("deployment", deployment)):
        raise ContractError(f"query {problem}", problems=("deployment: invalid",))
    after, limit = page("benchmarks", (float, str))
    runs, last = await Benchmarks.of(s.benchmarks).page(deployment, after, limit)
    return json_response(BenchRunList(runs=runs, next_cursor=next_cursor("benchmarks", last)))


@route(
    "GET",
    "/api/v1/benchmarks/<run_id>",
    roles=OPERATORS,
    summary="One benchmark run",
    tag="benchmarks",
    answer=BenchRun,
)
async def show_benchmark(s: AppState, run_id: str) -> Response:
    return json_response(await Benchmarks.of(s.benchmarks).get(run_id))


# ---- jobs --------------------------------------------------------------------------------------


@route(
    "POST",
    "/api/v1/jobs",
    roles=OPERATORS,
    summary="Start a client job (benchmark, sim or eval)",
    tag="jobs",
    request=JobCreate,
    answer=Job,
    status=201,
)
async def create_job(s: AppState) -> Response:
    return json_response(await Jobs.of(s.jobs).create(actor(), await body(JobCreate)), 201)


@route(
    "POST",
    "/api/v1/jobs/<job_id>",
    roles=OPERATORS,
    summary="Report a client job's progress or end (409 once finished)",
    tag="jobs",
    request=JobUpdate,
    answer=Job,
    errors=(Conflict,),
)
async def update_job(s: AppState, job_id: str) -> Response:
    return json_response(await Jobs.of(s.jobs).update(actor(), job_id, await body(JobUpdate)))


@route(
    "GET",
    "/api/v1/jobs",
    roles=OPERATORS,
    summary="Jobs, newest first",
    tag="jobs",
    answer=JobList,
    params=(*PAGE_QUERY, *_JOB_FILTERS),
)
async def list_jobs(s: AppState) -> Response:
    kind, state = query_enum("kind", JobKind), query_enum("state", JobState)
    after, limit = page("jobs", (float, str))
    jobs, last = await Jobs.of(s.jobs).page(kind, state, after, limit)
    return json_response(JobList(jobs=jobs, next_cursor=next_cursor("jobs", last)))


@route("GET", "/api/v1/jobs/<job_id>", roles=OPERATORS, summary="One job", tag="jobs", answer=Job)
async def show_job(s: AppState, job_id: str) -> Response:
    return json_response(await Jobs.of(s.jobs).get(job_id))


# ---- release evidence --------------------------------------------------------------------------


@route(
    "POST",
    "/api/v1/evidence",
    roles=OPERATORS,
    summary="Sign a release-evidence manifest (`nexa evidence`)",
    tag="evidence",
    request=EvidenceRequest,
    answer=EvidenceSigned,
    status=201,
)
async def sign_evidence(s: AppState) -> Response:
    evidence = s.evidence
    if evidence is None:
        raise NotFound("this controller signs no evidence")
    return json_response(await evidence.sign(actor(), await body(EvidenceRequest)), 201)
