"""Evaluation routes: suites (`nexa eval register`), measured runs (`nexa eval run`, `show`,
`compare`) and evaluation replicas (`nexa eval run --model`); each a thin adapter onto `Evals`.
Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

from typing import Final

from quart import Response, request

from nexa.contracts.evals import (
    EvalCompare,
    EvalReplica,
    EvalReplicaCreate,
    EvalReplicaList,
    EvalRun,
    EvalRunCreate,
    EvalRunList,
    Suite,
    SuiteCreate,
    SuiteDetail,
    SuiteList,
)
from nexa.contracts.models import name_problem
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page
from nexa.control.http.declare import OPERATORS, PAGE_QUERY, Param, route
from nexa.control.http.state import AppState
from nexa.control.operations.evals import Evals
from nexa.errors import Conflict, ContractError, NotDeployable, NotFound

_SUITE_FILTER: Final = Param(name="suite", schema=str, description="only this suite's runs")
_DIGEST: Final = Param(name="digest", schema=str, description="that registration's sha256 (default: the newest)")
_PAIR: Final = (
    Param(name="a", schema=str, description="the run compared against (required)"),
    Param(name="b", schema=str, description="the run compared (required)"),
)


@route(
    "POST",
    "/api/v1/eval/suites",
    roles=OPERATORS,
    summary="Register an evaluation suite (JSON Lines; every bad line named)",
    tag="evals",
    request=SuiteCreate,
    answer=Suite,
    status=201,
    errors=(NotFound,),
)
async def register_suite(s: AppState) -> Response:
    return json_response(await Evals.of(s.evals).register(actor(), await body(SuiteCreate)), 201)


@route("GET", "/api/v1/eval/suites", roles=OPERATORS, summary="Evaluation suites", tag="evals", answer=SuiteList)
async def list_suites(s: AppState) -> Response:
    return json_response(SuiteList(suites=await Evals.of(s.evals).suites()))


@route(
    "GET",
    "/api/v1/eval/suites/<name>",
    roles=OPERATORS,
    summary="One evaluation suite and its file",
    tag="evals",
    answer=SuiteDetail,
    params=(_DIGEST,),
)
async def show_suite(s: AppState, name: str) -> Response:
    return json_response(await Evals.of(s.evals).suite(name, request.args.get("digest")))


@route(
    "POST",
    "/api/v1/eval/runs",
    roles=OPERATORS,
    summary="Record a measured evaluation run (`nexa eval run`) as the model version's evaluation",
    tag="evals",
    request=EvalRunCreate,
    answer=EvalRun,
    status=201,
    errors=(NotFound,),
)
async def record_run(s: AppState) -> Response:
    return json_response(await Evals.of(s.evals).record(actor(), await body(EvalRunCreate)), 201)


@route(
    "GET",
    "/api/v1/eval/runs",
    roles=OPERATORS,
    summary="Measured evaluation runs, newest first",
    tag="evals",
    answer=EvalRunList,
    params=(*PAGE_QUERY, _SUITE_FILTER),
)
async def list_runs(s: AppState) -> Response:
    suite = request.args.get("suite")
    if suite is not None and (problem := name_problem("suite", suite)):
        raise ContractError(f"query {problem}", problems=("suite: invalid",))
    after, limit = page("eval-runs", (float, str))
    runs, last = await Evals.of(s.evals).page(suite, after, limit)
    return json_response(EvalRunList(runs=runs, next_cursor=next_cursor("eval-runs", last)))


@route("GET", "/api/v1/eval/runs/<run_id>", roles=OPERATORS, summary="One evaluation run", tag="evals", answer=EvalRun)
async def show_run(s: AppState, run_id: str) -> Response:
    return json_response(await Evals.of(s.evals).run(run_id))


@route(
    "GET",
    "/api/v1/eval/compare",
    roles=OPERATORS,
    summary="Two runs compared per metric, with 95% intervals of the differences",
    tag="evals",
    answer=EvalCompare,
    params=_PAIR,
    errors=(NotFound,),
)
async def compare_runs(s: AppState) -> Response:
    a, b = request.args.get("a"), request.args.get("b")
    if not a or not b:
        raise ContractError("give both runs: ?a=RUN&b=RUN", problems=("a, b: required",))
    return json_response(await Evals.of(s.evals).compare(a, b))


@route(
    "POST",
    "/api/v1/eval/replicas",
    roles=OPERATORS,
    summary="Start an evaluation replica of a model version, served only to the evaluation's key (`eval run --model`)",
    tag="evals",
    request=EvalReplicaCreate,
    answer=EvalReplica,
    status=201,
    errors=(NotFound, Conflict, NotDeployable),
)
async def start_replica(s: AppState) -> Response:
    return json_response(await Evals.of(s.evals).start_replica(actor(), await body(EvalReplicaCreate)), 201)


@route(
    "GET", "/api/v1/eval/replicas", roles=OPERATORS, summary="Evaluation replicas", tag="evals", answer=EvalReplicaList
)
async def list_replicas(s: AppState) -> Response:
    return json_response(EvalReplicaList(replicas=await Evals.of(s.evals).replicas()))


@route(
    "DELETE",
    "/api/v1/eval/replicas/<name>",
    roles=OPERATORS,
    summary="Remove an evaluation replica",
    tag="evals",
    answer=EvalReplica,
    errors=(NotFound,),
)
async def stop_replica(s: AppState, name: str) -> Response:
    return json_response(await Evals.of(s.evals).stop_replica(actor(), name))
