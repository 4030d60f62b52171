"""Sleep-when-idle routes of a deployment: its idle settings, and waking or putting it to sleep by
hand (`control.deployments.idle`). Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

from quart import Response

from nexa.contracts.deployments import DeploymentView, IdleSettings
from nexa.control.http.api_io import actor, body, json_response, no_body
from nexa.control.http.declare import OPERATORS, route
from nexa.control.http.state import AppState
from nexa.errors import Conflict, NotFound

_ONE = "/api/v1/deployments/<name>"


@route(
    "POST",
    _ONE + "/idle",
    roles=OPERATORS,
    summary="Set when a deployment sleeps when idle, and whether swap on demand may put it to sleep",
    tag="deployments",
    request=IdleSettings,
    answer=DeploymentView,
    errors=(NotFound,),
)
async def idle(s: AppState, name: str) -> Response:
    await s.deployments.idle.set_idle(actor(), name, await body(IdleSettings))
    return json_response(s.deployments.show(name))


@route(
    "POST",
    _ONE + "/sleep",
    roles=OPERATORS,
    summary="Put a deployment to sleep now (its containers stop; the artifact stays on the node)",
    tag="deployments",
    body_kind="empty",
    answer=DeploymentView,
    errors=(NotFound, Conflict),
)
async def sleep(s: AppState, name: str) -> Response:
    await no_body()
    await s.deployments.idle.sleep(actor(), name)
    return json_response(s.deployments.show(name))


@route(
    "POST",
    _ONE + "/wake",
    roles=OPERATORS,
    summary="Wake a sleeping deployment now (answers at once; `sleep.state` is waking until a replica is Ready)",
    tag="deployments",
    body_kind="empty",
    answer=DeploymentView,
    status=202,
    errors=(NotFound,),
)
async def wake(s: AppState, name: str) -> Response:
    await no_body()
    await s.deployments.idle.wake(name)
    return json_response(s.deployments.show(name), 202)
