"""The parts of the OpenAPI document's route descriptions (`Op`, `Param`, the page query) and the
descriptions of the record routes (benchmark runs, jobs, release evidence, service objectives,
runtime qualifications) and of the retention routes.
Data only; `openapi` builds the document from them."""

from __future__ import annotations

from typing import Any, Final, Literal

import attrs

from nexa.contracts import pages
from nexa.contracts.deployments import DeploymentView
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
    ServiceObjectives,
)
from nexa.contracts.qualification import QualificationList, QualifyRequest, SignedQualification
from nexa.contracts.retention import (
    RetainedList,
    RetainedPayload,
    RetentionPolicy,
    RetentionPolicyList,
    RetentionPolicySet,
    RetentionPurge,
    RetentionPurged,
)
from nexa.errors import Conflict, NexaError, NotDeployable, NotFound, Unavailable

JSON: Final = "application/json"


@attrs.frozen(kw_only=True)
class Param:
    """A query or header parameter; `schema` is a type the walker knows, or a JSON Schema."""

    name: str
    schema: Any
    where: Literal["query", "header"] = "query"
    description: str = ""
    deprecated: bool = False


@attrs.frozen(kw_only=True)
class Op:
    """What the route table lacks about one route. Types are contract classes (walked into schemas)."""

    summary: str
    tag: str
    #: The JSON body: a contract class, or a JSON Schema (the OpenAI bodies, which are free-form).
    body: Any = None
    #: `optional`: no body (or `{}`) means every default; `empty`: the route takes none, or `{}`.
    body_kind: Literal["required", "optional", "empty", "none"] = "none"
    answer: Any = None
    status: int = 200
    #: Other media types the success answer may have (`text/event-stream` for streams, CSV, metrics).
    also: tuple[str, ...] = ()
    media: str = JSON
    params: tuple[Param, ...] = ()
    #: Errors particular to this route, over those every route of its kind can answer.
    errors: tuple[type[NexaError], ...] = ()


PAGE_QUERY: Final = (
    Param(
        name="cursor",
        schema={"type": "string", "minLength": 1, "maxLength": pages.MAX_CURSOR_CHARS},
        description="opaque: the next_cursor of the previous page; left out for the first page",
    ),
    Param(
        name="limit",
        schema={"type": "integer", "minimum": 1, "maximum": pages.MAX_LIMIT, "default": pages.DEFAULT_LIMIT},
        description="items per page",
    ),
)


def _choice(cls: type[JobKind] | type[JobState]) -> dict[str, Any]:
    return {"type": "string", "enum": [v.value for v in cls]}


def _takes(tag: str, summary: str, body: type, answer: type, **more: Any) -> Op:
    """A route that reads a required JSON body of `body` and answers `answer`."""
    return Op(summary=summary, tag=tag, body=body, body_kind="required", answer=answer, **more)


_MADE: Final = 201
_JOB_FILTERS: Final = (Param(name="kind", schema=_choice(JobKind)), Param(name="state", schema=_choice(JobState)))
_RUN_FILTER: Final = Param(name="deployment", schema=str, description="only this deployment's runs")

#: Descriptions of the record routes (`api_records`), merged into `openapi`'s table.
RECORD_OPERATIONS: Final[dict[tuple[str, str], Op]] = {
    ("POST", "/api/v1/deployments/<name>/objectives"): _takes(
        "deployments",
        "Set the service objectives a deployment's benchmark runs are judged against",
        ServiceObjectives,
        DeploymentView,
        errors=(NotFound,),
    ),
    ("POST", "/api/v1/benchmarks"): _takes(
        "benchmarks",
        "Record a benchmark run (`nexa bench`), judged",
        BenchRunCreate,
        BenchRun,
        status=_MADE,
        errors=(NotFound,),
    ),
    ("GET", "/api/v1/benchmarks"): Op(
        summary="Benchmark runs, newest first", tag="benchmarks", answer=BenchRunList, params=(*PAGE_QUERY, _RUN_FILTER)
    ),
    ("GET", "/api/v1/benchmarks/<run_id>"): Op(summary="One benchmark run", tag="benchmarks", answer=BenchRun),
    ("POST", "/api/v1/jobs"): _takes("jobs", "Start a client job (benchmark or sim)", JobCreate, Job, status=_MADE),
    ("GET", "/api/v1/jobs"): Op(
        summary="Jobs, newest first", tag="jobs", answer=JobList, params=(*PAGE_QUERY, *_JOB_FILTERS)
    ),
    ("GET", "/api/v1/jobs/<job_id>"): Op(summary="One job", tag="jobs", answer=Job),
    ("POST", "/api/v1/jobs/<job_id>"): _takes(
        "jobs", "Report a client job's progress or end (409 once finished)", JobUpdate, Job, errors=(Conflict,)
    ),
    ("POST", "/api/v1/evidence"): _takes(
        "evidence", "Sign a release-evidence manifest (`nexa evidence`)", EvidenceRequest, EvidenceSigned, status=_MADE
    ),
    ("POST", "/api/v1/runtimes/<name>/qualify"): _takes(
        "registry",
        "Qualify a runtime on a node (`nexa runtimes qualify`): answers the job that follows it",
        QualifyRequest,
        Job,
        status=202,
        errors=(NotFound, Conflict, NotDeployable, Unavailable),
    ),
    ("GET", "/api/v1/qualifications"): Op(
        summary="Signed runtime qualifications, newest first",
        tag="registry",
        answer=QualificationList,
        params=(*PAGE_QUERY, Param(name="runtime", schema=str, description="only this runtime's")),
    ),
    ("GET", "/api/v1/qualifications/<qualification_id>"): Op(
        summary="One signed runtime qualification", tag="registry", answer=SignedQualification
    ),
    # ---- payload retention (`api_retention`)
    ("GET", "/api/v1/retention/policies"): Op(
        summary="Retention policies", tag="retention", answer=RetentionPolicyList
    ),
    ("GET", "/api/v1/retention/policies/<name>"): Op(
        summary="One retention policy", tag="retention", answer=RetentionPolicy
    ),
    ("PUT", "/api/v1/retention/policies/<name>"): _takes(
        "retention", "Create or replace a retention policy (TTL, tenants)", RetentionPolicySet, RetentionPolicy
    ),
    ("DELETE", "/api/v1/retention/policies/<name>"): Op(
        summary="Delete a retention policy (what it kept stays until its TTL)", tag="retention", answer=RetentionPolicy
    ),
    ("GET", "/api/v1/retention/records"): Op(
        summary="Retained records (ids, sizes, times; never a payload), oldest first",
        tag="retention",
        answer=RetainedList,
        params=(
            *PAGE_QUERY,
            Param(name="request_id", schema=str, description="only this request id's"),
            Param(name="tenant", schema=str, description="only this tenant's"),
            Param(name="policy", schema=str, description="only this policy's"),
        ),
    ),
    ("GET", "/api/v1/retention/records/<record_id>"): Op(
        summary="A retained request and its answer, decrypted (audited)",
        tag="retention",
        answer=RetainedPayload,
        errors=(Unavailable,),
    ),
    ("POST", "/api/v1/retention/purge"): _takes(
        "retention",
        "Purge retained payloads now, by request id, tenant or policy (audited)",
        RetentionPurge,
        RetentionPurged,
    ),
}
