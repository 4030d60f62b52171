"""Runtime routes: register, list and show runtime images, qualify one on a node, and the signed
qualifications. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

import attrs
from quart import Response, request

from nexa.contracts.domain import NodeState
from nexa.contracts.evidence import Job
from nexa.contracts.models import RuntimeCreate, RuntimeList, RuntimeRecord, RuntimeRegistered, name_problem
from nexa.contracts.qualification import QualificationList, QualifyRequest, SignedQualification
from nexa.control.deployments.scheduler import image_platform_warnings
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page
from nexa.control.http.declare import OPERATORS, PAGE_QUERY, Param, route
from nexa.control.http.state import AppState
from nexa.control.operations.jobs import Jobs
from nexa.control.operations.qualification import Qualifications
from nexa.errors import AlreadyExists, Conflict, ContractError, NotDeployable, NotFound, Unavailable, VerificationFailed


@route(
    "POST",
    "/api/v1/runtimes",
    roles=OPERATORS,
    summary="Register a runtime image",
    tag="registry",
    request=RuntimeCreate,
    answer=RuntimeRecord,
    status=201,
    errors=(AlreadyExists, VerificationFailed, Unavailable),
)
async def register_runtime(s: AppState) -> Response:
    runtime = await s.models.register_runtime(actor(), await body(RuntimeCreate))
    # Enrolled (not revoked) nodes that reported an inventory: could any of them run the image?
    archs = [
        live.inventory.arch for live in s.fleet if live.inventory is not None and live.state is not NodeState.REVOKED
    ]
    warnings = image_platform_warnings(runtime.image_archs, archs)
    return json_response(RuntimeRegistered(**attrs.asdict(runtime, recurse=False), warnings=warnings), 201)


@route("GET", "/api/v1/runtimes", roles=OPERATORS, summary="List runtimes", tag="registry", answer=RuntimeList)
async def list_runtimes(s: AppState) -> Response:
    return json_response(RuntimeList(runtimes=s.models.runtimes()))


@route(
    "GET", "/api/v1/runtimes/<name>", roles=OPERATORS, summary="Show a runtime", tag="registry", answer=RuntimeRecord
)
async def show_runtime(s: AppState, name: str) -> Response:
    return json_response(s.models.runtime(name))


@route(
    "POST",
    "/api/v1/runtimes/<name>/qualify",
    roles=OPERATORS,
    summary="Qualify a runtime on a node (`nexa runtimes qualify`): answers the job that follows it",
    tag="registry",
    request=QualifyRequest,
    answer=Job,
    status=202,
    errors=(NotFound, Conflict, NotDeployable, Unavailable),
)
async def qualify(s: AppState, name: str) -> Response:
    req = await body(QualifyRequest)
    job_id = await Qualifications.of(s.qualifications).start(actor(), name, req)
    return json_response(await Jobs.of(s.jobs).get(job_id), 202)


@route(
    "GET",
    "/api/v1/qualifications",
    roles=OPERATORS,
    summary="Signed runtime qualifications, newest first",
    tag="registry",
    answer=QualificationList,
    params=(*PAGE_QUERY, Param(name="runtime", schema=str, description="only this runtime's")),
)
async def list_qualifications(s: AppState) -> Response:
    runtime = request.args.get("runtime")
    if runtime is not None and (problem := name_problem("runtime", runtime)):
        raise ContractError(f"query {problem}", problems=("runtime: invalid",))
    after, limit = page("qualifications", (float, str))
    found, last = await Qualifications.of(s.qualifications).page(runtime, after, limit)
    return json_response(QualificationList(qualifications=found, next_cursor=next_cursor("qualifications", last)))


@route(
    "GET",
    "/api/v1/qualifications/<qualification_id>",
    roles=OPERATORS,
    summary="One signed runtime qualification",
    tag="registry",
    answer=SignedQualification,
)
async def show_qualification(s: AppState, qualification_id: str) -> Response:
    return json_response(await Qualifications.of(s.qualifications).get(qualification_id))
