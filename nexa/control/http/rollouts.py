"""Rollout routes: a change of a deployment's runtime or settings rolled out under watch, and an
operator's hand on a rollout in progress (status, pause, resume, undo): `deployments.watch`."""

from __future__ import annotations

from quart import Response

from nexa.contracts.deployments import DeploymentChange, DeploymentView, RolloutStatus
from nexa.control.http.api_io import actor, body, json_response, no_body
from nexa.control.http.declare import OPERATORS, route
from nexa.control.http.state import AppState
from nexa.errors import Conflict, NoRollout, NotDeployable, NotFound, RolloutAlreadyPaused, RolloutNotPaused

_ONE = "/api/v1/deployments/<name>"


@route(
    "POST",
    _ONE + "/change",
    roles=OPERATORS,
    summary="Change a deployment's runtime or settings (rolled out under watch) or its rollout policy",
    tag="deployments",
    request=DeploymentChange,
    answer=DeploymentView,
    errors=(NotFound, Conflict, NotDeployable),
)
async def change(s: AppState, name: str) -> Response:
    return json_response(await s.deployments.change(actor(), name, await body(DeploymentChange)))


@route(
    "GET",
    _ONE + "/rollout",
    roles=OPERATORS,
    summary="Show a deployment's rollout and its steps",
    tag="deployments",
    answer=RolloutStatus,
    errors=(NotFound,),
)
async def status(s: AppState, name: str) -> Response:
    return json_response(s.deployments.rollout_status(name))


@route(
    "POST",
    _ONE + "/rollout/pause",
    roles=OPERATORS,
    summary="Pause a rollout (no further replica is replaced; watching goes on)",
    tag="deployments",
    body_kind="empty",
    answer=RolloutStatus,
    errors=(NotFound, NoRollout, RolloutAlreadyPaused),
)
async def pause(s: AppState, name: str) -> Response:
    await no_body()
    return json_response(await s.deployments.pause_rollout(actor(), name))


@route(
    "POST",
    _ONE + "/rollout/resume",
    roles=OPERATORS,
    summary="Resume a paused rollout",
    tag="deployments",
    body_kind="empty",
    answer=RolloutStatus,
    errors=(NotFound, NoRollout, RolloutNotPaused),
)
async def resume(s: AppState, name: str) -> Response:
    await no_body()
    return json_response(await s.deployments.resume_rollout(actor(), name))


@route(
    "POST",
    _ONE + "/rollout/undo",
    roles=OPERATORS,
    summary="Undo a rollout: its changed replicas go back to the last good spec",
    tag="deployments",
    body_kind="empty",
    answer=RolloutStatus,
    errors=(NotFound, NoRollout),
)
async def undo(s: AppState, name: str) -> Response:
    await no_body()
    return json_response(await s.deployments.undo_rollout(actor(), name))
