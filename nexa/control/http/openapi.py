"""The OpenAPI 3.1 document of the controller's HTTP API (`GET /api/v1/openapi.json`). Pure; no I/O.

Generated, never written by hand, from the route declarations (`http.declare`): the management
routes of `http.resources` and the inference routes of `datapath.inference_routes`. Each declaration
gives its roles, the contract types it reads and answers, its query parameters and the errors
particular to it; the error statuses come from `http.STATUS`, and every body schema from the attrs
contract types, by walking their fields. A route cannot be declared without a description.

The route answers without a credential (like `/healthz`): the document holds shapes, roles and
error codes, which the source publishes anyway, and no state; it is built once at start
(`service.serve_control`) and served as bytes, so a request costs no more than `/healthz`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final

import attrs

from nexa import __version__
from nexa.contracts.api import ErrorEnvelope
from nexa.contracts.gateway import OpenAIError
from nexa.contracts.jsonschema import JsonSchemas
from nexa.control.datapath import inference_routes
from nexa.control.datapath.inference_routes import INFERENCE_ROUTES
from nexa.control.datapath.inference_routes import RESPONSE_HEADERS as INFERENCE_RESPONSE_HEADERS
from nexa.control.http import health, resources
from nexa.control.http.common import STATUS
from nexa.control.http.declare import JSON, PAGE_QUERY, Route
from nexa.control.operations.recovery import refused_while_recovering
from nexa.errors import (
    ContractError,
    Forbidden,
    NexaError,
    NotFound,
    PayloadTooLarge,
    Recovering,
    Unauthenticated,
)

Json = dict[str, Any]

OPENAPI_VERSION: Final = "3.1.0"
#: The route this document is served on (with no credential: it describes shapes, never state).
DOCUMENT_ROUTE: Final = health.openapi_document.key

_EMPTY: Final[Json] = {"type": "object", "maxProperties": 0, "description": "no body, or an empty object"}


def routes() -> tuple[Route, ...]:
    """Every HTTP route of the controller (console pages aside): management, then inference."""
    return (*resources.ROUTES, *inference_routes.ROUTES)


def document(declared: Iterable[Route] | None = None) -> Json:
    """The OpenAPI 3.1 document of every management and inference route (or of `declared`)."""
    table = routes() if declared is None else tuple(declared)
    if unpaged := [r.key for r in table if not _paged_alike(r)]:
        raise LookupError(f"openapi: answers a next_cursor without taking PAGE_QUERY first, or the reverse: {unpaged}")
    schemas = JsonSchemas()
    paths: Json = {}
    for r in table:
        paths.setdefault(_path(r.path), {})[r.method.lower()] = _operation(r, schemas)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "LunaNexa controller",
            "version": __version__,
            "description": (
                "Management (`/api/v1`) and inference (`/v1`, OpenAI-compatible; `/api/v1/workloads`) routes."
                " Every operation lists the roles that may call it in `x-nexa-roles` (empty: no credential)"
                " and the error codes it can answer in each error response's `x-nexa-error-codes`."
                " Errors come in nexa's envelope, on `/v1` in OpenAI's shape (on `/v1/messages`, Anthropic's;"
                " also on vLLM's own `/rerank`, `/v2/rerank`, `/score`, `/tokenize` and `/detokenize`)."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": schemas.components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "an API key (`nxk_...`)"},
            },
        },
    }


def _paged_alike(op: Route) -> bool:
    """Whether `op` answers a page (a `next_cursor`) exactly when it takes `PAGE_QUERY` first."""
    paged = attrs.has(op.answer) and "next_cursor" in attrs.fields_dict(op.answer)
    return paged == (op.params[: len(PAGE_QUERY)] == PAGE_QUERY)


def document_json() -> bytes:
    """`document()` as the bytes the route answers."""
    return json.dumps(document(), sort_keys=True, separators=(",", ":")).encode()


def _path(rule: str) -> str:
    return "/".join(f"{{{p[1:-1]}}}" if p.startswith("<") else p for p in rule.split("/"))


def _path_params(rule: str) -> list[str]:
    return [p[1:-1] for p in rule.split("/") if p.startswith("<")]


def _operation(op: Route, schemas: JsonSchemas) -> Json:
    method, rule, roles = op.method, op.path, op.roles
    openai = rule.startswith("/v1/")
    out: Json = {
        "operationId": _operation_id(method, rule),
        "summary": op.summary,
        "tags": [op.tag],
        "x-nexa-roles": sorted(r.value for r in roles or ()),
        "security": [{"bearer": []}] if roles is not None else [],
    }
    params: list[Json] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
        for name in _path_params(rule)
    ]
    for p in op.params:
        param: Json = {"name": p.name, "in": p.where, "required": False, "schema": schemas.of(p.schema)}
        if p.description:
            param["description"] = p.description
        if p.deprecated:
            param["deprecated"] = True
        params.append(param)
    params.append(
        {
            "name": "X-Request-Id",
            "in": "header",
            "required": False,
            "description": "a request id to echo (1-128 of A-Z a-z 0-9 . _ : -); otherwise one is made",
            "schema": {"type": "string"},
        }
    )
    out["parameters"] = params
    if op.body_kind != "none":
        body = _EMPTY if op.body_kind == "empty" else schemas.of(op.body)
        out["requestBody"] = {"required": op.body_kind == "required", "content": {op.body_media: {"schema": body}}}
    success: Json = {op.media: {"schema": schemas.of(op.answer)}}
    for media in op.also:
        success[media] = {"schema": {"type": "string"}}
    responses: Json = {str(op.status): {"description": op.summary, "content": success}}
    error_schema = schemas.of(op.error_shape or (OpenAIError if openai else ErrorEnvelope))
    for status, codes in sorted(_error_codes(op).items()):
        responses[str(status)] = {
            "description": "error: " + ", ".join(codes),
            "x-nexa-error-codes": codes,
            "content": {JSON: {"schema": error_schema}},
        }
    if op.key in INFERENCE_ROUTES:
        for response in responses.values():
            response["headers"] = dict(INFERENCE_RESPONSE_HEADERS)
    out["responses"] = responses
    return out


def _operation_id(method: str, rule: str) -> str:
    """From the method and path (`get_nodes_by_node_id`); OpenAI routes get `openai_`."""
    parts = [f"by_{p[1:-1]}" if p.startswith("<") else p for p in rule.strip("/").split("/") if p not in {"api", "v1"}]
    prefix = ["openai"] if rule.startswith("/v1/") else []
    return "_".join([method.lower(), *prefix, *parts]).replace("-", "_").replace(".", "_")


def _error_codes(op: Route) -> dict[int, list[str]]:
    """Status → the error codes a route can answer with it: those of its kind, then its own."""
    method, rule = op.method, op.path
    errors: list[type[NexaError]] = []
    if op.roles is not None:
        errors += [Unauthenticated, Forbidden]
    if op.body_kind != "none" or op.params:
        errors += [ContractError]
    if op.body_kind != "none" or method in {"POST", "PUT"}:
        errors += [PayloadTooLarge]
    if _path_params(rule):
        errors += [NotFound]
    if op.key not in INFERENCE_ROUTES and refused_while_recovering(method, rule):
        errors += [Recovering]
    errors += op.errors
    out: dict[int, list[str]] = {}
    for cls in errors:
        codes = out.setdefault(_status(cls), [])
        if cls.code not in codes:
            codes.append(cls.code)
    return out


def _status(cls: type[NexaError]) -> int:
    return next((STATUS[c] for c in cls.__mro__ if c in STATUS), 500)
