"""Model and alias routes: register model versions, record licenses and evaluations, verify,
approve and retire them; point aliases. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

from quart import Response, request

from nexa.contracts.models import (
    AliasDetail,
    AliasList,
    AliasPromote,
    AliasReceipt,
    EvaluationCreate,
    EvaluationResult,
    LicenseSet,
    ModelCreate,
    ModelDetail,
    ModelList,
    ModelRecord,
    ModelState,
    VerifyRequest,
)
from nexa.control.http.api_io import actor, body, json_response, no_body, optional_body, query_enum
from nexa.control.http.declare import OPERATORS, Param, route
from nexa.control.http.state import AppState
from nexa.errors import AlreadyExists, Conflict, LoraBaseInvalid, Unavailable, VerificationFailed

_MODEL = "/api/v1/models/<name>/<version>"


@route(
    "POST",
    "/api/v1/models",
    roles=OPERATORS,
    summary="Register a model version",
    tag="registry",
    request=ModelCreate,
    answer=ModelRecord,
    status=201,
    errors=(AlreadyExists, LoraBaseInvalid),
)
async def register_model(s: AppState) -> Response:
    model = await s.models.register_model(actor(), await body(ModelCreate))
    return json_response(model, 201)


@route(
    "GET",
    "/api/v1/models",
    roles=OPERATORS,
    summary="List model versions",
    tag="registry",
    answer=ModelList,
    params=(Param(name="name", schema=str), Param(name="state", schema=ModelState)),
)
async def list_models(s: AppState) -> Response:
    state = query_enum("state", ModelState)
    return json_response(ModelList(models=s.models.models(name=request.args.get("name"), state=state)))


@route("GET", _MODEL, roles=OPERATORS, summary="Show a model version", tag="registry", answer=ModelDetail)
async def show_model(s: AppState, name: str, version: str) -> Response:
    models = s.models
    detail = ModelDetail(
        model=models.model(name, version),
        evaluations=models.evaluations(name, version),
        aliases=models.aliases_of(name, version),
    )
    return json_response(detail)


@route(
    "POST",
    _MODEL + "/license",
    roles=OPERATORS,
    summary="Record a model's license",
    tag="registry",
    request=LicenseSet,
    answer=ModelRecord,
    errors=(Conflict,),
)
async def set_license(s: AppState, name: str, version: str) -> Response:
    return json_response(await s.models.set_license(actor(), name, version, await body(LicenseSet)))


@route(
    "POST",
    _MODEL + "/verify",
    roles=OPERATORS,
    summary="Verify a model's artifact (digest, size, signature)",
    tag="registry",
    request=VerifyRequest,
    body_kind="optional",
    answer=ModelRecord,
    errors=(Conflict, VerificationFailed, LoraBaseInvalid, Unavailable),
)
async def verify(s: AppState, name: str, version: str) -> Response:
    req = await optional_body(VerifyRequest)
    return json_response(await s.models.verify(actor(), name, version, req))


@route(
    "POST",
    _MODEL + "/evaluations",
    roles=OPERATORS,
    summary="Record an evaluation",
    tag="registry",
    request=EvaluationCreate,
    answer=EvaluationResult,
    status=201,
    errors=(Conflict,),
)
async def evaluate(s: AppState, name: str, version: str) -> Response:
    req = await body(EvaluationCreate)
    evaluation, model = await s.models.evaluate(actor(), name, version, req)
    return json_response(EvaluationResult(evaluation=evaluation, model=model), 201)


@route(
    "POST",
    _MODEL + "/approve",
    roles=OPERATORS,
    summary="Approve a model version",
    tag="registry",
    body_kind="empty",
    answer=ModelRecord,
    errors=(Conflict,),
)
async def approve(s: AppState, name: str, version: str) -> Response:
    await no_body()
    return json_response(await s.models.approve(actor(), name, version))


@route(
    "POST",
    _MODEL + "/retire",
    roles=OPERATORS,
    summary="Retire a model version",
    tag="registry",
    body_kind="empty",
    answer=ModelRecord,
    errors=(Conflict,),
)
async def retire(s: AppState, name: str, version: str) -> Response:
    await no_body()
    return json_response(await s.models.retire(actor(), name, version))


@route("GET", "/api/v1/aliases", roles=OPERATORS, summary="List aliases", tag="registry", answer=AliasList)
async def list_aliases(s: AppState) -> Response:
    return json_response(AliasList(aliases=s.models.aliases()))


@route(
    "GET",
    "/api/v1/aliases/<name>",
    roles=OPERATORS,
    summary="Show an alias and its history",
    tag="registry",
    answer=AliasDetail,
)
async def show_alias(s: AppState, name: str) -> Response:
    alias, history = s.models.alias(name)
    return json_response(AliasDetail(alias=alias, history=history))


@route(
    "POST",
    "/api/v1/aliases/<name>/promote",
    roles=OPERATORS,
    summary="Point an alias at an approved model version",
    tag="registry",
    request=AliasPromote,
    answer=AliasReceipt,
    errors=(Conflict, LoraBaseInvalid),
)
async def promote_alias(s: AppState, name: str) -> Response:
    return json_response(await s.models.promote(actor(), name, await body(AliasPromote)))


@route(
    "POST",
    "/api/v1/aliases/<name>/rollback",
    roles=OPERATORS,
    summary="Point an alias back at its previous target",
    tag="registry",
    body_kind="empty",
    answer=AliasReceipt,
    errors=(Conflict, LoraBaseInvalid),
)
async def rollback_alias(s: AppState, name: str) -> Response:
    await no_body()
    return json_response(await s.models.rollback(actor(), name))
