"""The management API's record routes: benchmark runs, jobs, release evidence, a deployment's
service objectives and runtime qualifications. `RecordHandlers` is a mixin of `api._Handlers` (one
method per route, named after it, as there); each is a thin adapter onto `Benchmarks`, `Jobs`,
`Evidence`, `Deployments`, `Qualifications`.
"""

from __future__ import annotations

from typing import Protocol

from quart import Response, request

from nexa.contracts.evidence import (
    BenchRunCreate,
    BenchRunList,
    EvidenceRequest,
    JobCreate,
    JobKind,
    JobList,
    JobState,
    JobUpdate,
    ServiceObjectives,
)
from nexa.contracts.models import name_problem
from nexa.contracts.qualification import QualificationList, QualifyRequest
from nexa.control.deployments import Deployments
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page, query_enum
from nexa.control.operations.benchmarks import Benchmarks
from nexa.control.operations.evidence import Evidence
from nexa.control.operations.jobs import Jobs
from nexa.control.operations.qualification import Qualifications
from nexa.errors import ContractError, NotFound


class RecordState(Protocol):
    """What these routes need of `api.AppState`."""

    deployments: Deployments
    benchmarks: Benchmarks | None
    jobs: Jobs | None
    evidence: Evidence | None
    qualifications: Qualifications | None


class RecordHandlers:
    _s: RecordState

    # ---- benchmark runs ------------------------------------------------------------------------

    async def post_benchmarks(self) -> Response:
        run = await Benchmarks.of(self._s.benchmarks).record(actor(), await body(BenchRunCreate))
        return json_response(run, 201)

    async def get_benchmarks(self) -> Response:
        deployment = request.args.get("deployment")
        if deployment is not None and (problem := name_problem("deployment", deployment)):
            raise ContractError(f"query {problem}", problems=("deployment: invalid",))
        after, limit = page("benchmarks", (float, str))
        runs, last = await Benchmarks.of(self._s.benchmarks).page(deployment, after, limit)
        return json_response(BenchRunList(runs=runs, next_cursor=next_cursor("benchmarks", last)))

    async def get_benchmarks_by_run_id(self, run_id: str) -> Response:
        return json_response(await Benchmarks.of(self._s.benchmarks).get(run_id))

    # ---- jobs ----------------------------------------------------------------------------------

    async def post_jobs(self) -> Response:
        return json_response(await Jobs.of(self._s.jobs).create(actor(), await body(JobCreate)), 201)

    async def post_jobs_by_job_id(self, job_id: str) -> Response:
        return json_response(await Jobs.of(self._s.jobs).update(actor(), job_id, await body(JobUpdate)))

    async def get_jobs(self) -> Response:
        kind, state = query_enum("kind", JobKind), query_enum("state", JobState)
        after, limit = page("jobs", (float, str))
        jobs, last = await Jobs.of(self._s.jobs).page(kind, state, after, limit)
        return json_response(JobList(jobs=jobs, next_cursor=next_cursor("jobs", last)))

    async def get_jobs_by_job_id(self, job_id: str) -> Response:
        return json_response(await Jobs.of(self._s.jobs).get(job_id))

    # ---- release evidence and service objectives -----------------------------------------------

    async def post_evidence(self) -> Response:
        evidence = self._s.evidence
        if evidence is None:
            raise NotFound("this controller signs no evidence")
        return json_response(await evidence.sign(actor(), await body(EvidenceRequest)), 201)

    async def post_deployments_by_name_objectives(self, name: str) -> Response:
        objectives = await body(ServiceObjectives)
        return json_response(await self._s.deployments.set_objectives(actor(), name, objectives))

    # ---- runtime qualifications ----------------------------------------------------------------

    async def post_runtimes_by_name_qualify(self, name: str) -> Response:
        req = await body(QualifyRequest)
        job_id = await Qualifications.of(self._s.qualifications).start(actor(), name, req)
        return json_response(await Jobs.of(self._s.jobs).get(job_id), 202)

    async def get_qualifications(self) -> Response:
        runtime = request.args.get("runtime")
        if runtime is not None and (problem := name_problem("runtime", runtime)):
            raise ContractError(f"query {problem}", problems=("runtime: invalid",))
        after, limit = page("qualifications", (float, str))
        found, last = await Qualifications.of(self._s.qualifications).page(runtime, after, limit)
        return json_response(QualificationList(qualifications=found, next_cursor=next_cursor("qualifications", last)))

    async def get_qualifications_by_qualification_id(self, qualification_id: str) -> Response:
        return json_response(await Qualifications.of(self._s.qualifications).get(qualification_id))
