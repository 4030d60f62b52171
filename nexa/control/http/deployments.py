"""Deployment routes: create, list, show, delete, placement, scale, routing, canaries, service
objectives, and the capacity forecast. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

from quart import Response

from nexa.contracts import pages
from nexa.contracts.deployments import (
    CanaryCreate,
    DeploymentCreate,
    DeploymentList,
    DeploymentView,
    PlacementView,
    RolloutResult,
    RoutingWeights,
    ScaleRequest,
)
from nexa.contracts.evidence import ServiceObjectives
from nexa.contracts.placement import PlacementDecision
from nexa.control.http.api_io import actor, body, json_response, next_cursor, no_body, page
from nexa.control.http.declare import OPERATORS, PAGE_QUERY, route
from nexa.control.http.state import AppState
from nexa.errors import AlreadyExists, Conflict, NotDeployable, NotFound

_ONE = "/api/v1/deployments/<name>"


@route(
    "POST",
    "/api/v1/deployments",
    roles=OPERATORS,
    summary="Create a deployment",
    tag="deployments",
    request=DeploymentCreate,
    answer=DeploymentView,
    status=201,
    errors=(AlreadyExists, NotDeployable),
)
async def create(s: AppState) -> Response:
    return json_response(await s.deployments.create(actor(), await body(DeploymentCreate)), 201)


@route(
    "GET",
    "/api/v1/deployments",
    roles=OPERATORS,
    summary="List deployments",
    tag="deployments",
    answer=DeploymentList,
    params=PAGE_QUERY,
)
async def list_deployments(s: AppState) -> Response:
    after, limit = page("deployments", (str,))
    views, last = pages.page_of(s.deployments.all(), lambda v: (v.deployment.name,), after, limit)
    return json_response(DeploymentList(deployments=views, next_cursor=next_cursor("deployments", last)))


@route("GET", _ONE, roles=OPERATORS, summary="Show a deployment", tag="deployments", answer=DeploymentView)
async def show(s: AppState, name: str) -> Response:
    return json_response(s.deployments.show(name))


@route(
    "DELETE",
    _ONE,
    roles=OPERATORS,
    summary="Delete a deployment",
    tag="deployments",
    answer=DeploymentView,
    errors=(Conflict,),
)
async def delete(s: AppState, name: str) -> Response:
    return json_response(await s.deployments.delete(actor(), name))


@route(
    "GET",
    _ONE + "/placement",
    roles=OPERATORS,
    summary="Explain a deployment's placement",
    tag="deployments",
    answer=PlacementView,
)
async def placement(s: AppState, name: str) -> Response:
    return json_response(s.deployments.placement(name))


@route(
    "POST",
    _ONE + "/scale",
    roles=OPERATORS,
    summary="Scale a deployment",
    tag="deployments",
    request=ScaleRequest,
    answer=DeploymentView,
    errors=(Conflict, NotDeployable),
)
async def scale(s: AppState, name: str) -> Response:
    req = await body(ScaleRequest)
    return json_response(await s.deployments.scale(actor(), name, req.replicas))


@route(
    "POST",
    _ONE + "/routing",
    roles=OPERATORS,
    summary="Set a deployment's routing weights",
    tag="deployments",
    request=RoutingWeights,
    answer=DeploymentView,
)
async def routing(s: AppState, name: str) -> Response:
    return json_response(await s.deployments.set_routing(actor(), name, await body(RoutingWeights)))


@route(
    "POST",
    _ONE + "/canary",
    roles=OPERATORS,
    summary="Start a canary",
    tag="deployments",
    request=CanaryCreate,
    answer=DeploymentView,
    status=201,
    errors=(Conflict, NotDeployable),
)
async def canary(s: AppState, name: str) -> Response:
    req = await body(CanaryCreate)
    return json_response(await s.deployments.start_canary(actor(), name, req), 201)


@route(
    "POST",
    _ONE + "/promote",
    roles=OPERATORS,
    summary="Promote the canary",
    tag="deployments",
    body_kind="empty",
    answer=RolloutResult,
    errors=(Conflict,),
)
async def promote(s: AppState, name: str) -> Response:
    await no_body()
    return json_response(await s.deployments.promote(actor(), name))


@route(
    "POST",
    _ONE + "/rollback",
    roles=OPERATORS,
    summary="Roll the deployment back",
    tag="deployments",
    body_kind="empty",
    answer=RolloutResult,
    errors=(Conflict,),
)
async def rollback(s: AppState, name: str) -> Response:
    await no_body()
    return json_response(await s.deployments.rollback(actor(), name))


@route(
    "POST",
    _ONE + "/objectives",
    roles=OPERATORS,
    summary="Set the service objectives a deployment's benchmark runs are judged against",
    tag="deployments",
    request=ServiceObjectives,
    answer=DeploymentView,
    errors=(NotFound,),
)
async def objectives(s: AppState, name: str) -> Response:
    req = await body(ServiceObjectives)
    return json_response(await s.deployments.set_objectives(actor(), name, req))


@route(
    "POST",
    "/api/v1/capacity/forecast",
    roles=OPERATORS,
    summary="Where a deployment would be placed (changes nothing)",
    tag="deployments",
    request=DeploymentCreate,
    answer=PlacementDecision,
    errors=(NotDeployable,),
)
async def forecast(s: AppState) -> Response:
    return json_response(s.deployments.forecast(await body(DeploymentCreate)))
