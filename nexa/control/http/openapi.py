"""The OpenAPI 3.1 document of the controller's HTTP API (`GET /api/v1/openapi.json`). Pure; no I/O.

Generated, never written by hand: the operations come from the route tables (`routes.ROUTE_ROLES`,
`inference.INFERENCE_ROUTES`), their roles and error statuses from those tables and
`http.STATUS`, and every body schema from the attrs contract types, by walking their fields.
`_OPERATIONS` below is data only: for each route, the contract types it reads and answers, its
query parameters and the errors particular to it. A route without an entry there (or an entry
without a route) fails `document()`, so a new route cannot go undescribed.

The route answers without a credential (like `/healthz`): the document holds shapes, roles and
error codes, which the source publishes anyway, and no state; it is built once at start
(`service.serve_control`) and served as bytes, so a request costs no more than `/healthz`.
"""

from __future__ import annotations

import json
from typing import Any, Final

import attrs

from nexa import __version__
from nexa.contracts.api import (
    AuditPage,
    AuditVerdict,
    AuditVerifyRequest,
    ClusterView,
    ControllerKeysRotated,
    EnrollmentTokenCreate,
    EnrollmentTokenCreated,
    EnrollRequest,
    EnrollResponse,
    ErrorEnvelope,
    Health,
    KeyCreate,
    KeyCreated,
    KeyList,
    KeyRotate,
    KeyRotated,
    KeyView,
    NodeList,
    NodeView,
    Readiness,
    ReceiptPublicKey,
    SignedAuditCheckpoint,
    TenantCreate,
    TenantList,
    TenantView,
    VersionInfo,
)
from nexa.contracts.backup import BackupList, BackupView
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
from nexa.contracts.domain import Role
from nexa.contracts.gateway import (
    MAX_CHOICES,
    MAX_MODEL_CHARS,
    MAX_REQUEST_TOKENS,
    OpenAIError,
    Priority,
    QuotaLimits,
    QuotaList,
    QuotaView,
    SignedReceipt,
    UsageReport,
    WorkloadCreate,
    WorkloadList,
    WorkloadView,
)
from nexa.contracts.jsonschema import JsonSchemas
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
    RuntimeCreate,
    RuntimeList,
    RuntimeRecord,
    VerifyRequest,
)
from nexa.contracts.placement import PlacementDecision
from nexa.contracts.recovery import RecoveryFinished, RecoveryPlan
from nexa.control.datapath.inference import (
    DATA_CLASS_HEADER,
    DEADLINE_HEADER,
    INFERENCE_ROUTES,
    OVERHEAD_HEADER,
    PRIORITY_HEADER,
    RETENTION_HEADER,
)
from nexa.control.http.common import STATUS
from nexa.control.http.openapi_ops import JSON as _JSON
from nexa.control.http.openapi_ops import PAGE_QUERY as _PAGE_QUERY
from nexa.control.http.openapi_ops import RECORD_OPERATIONS
from nexa.control.http.openapi_ops import Op as _Op
from nexa.control.http.openapi_ops import Param as _Param
from nexa.control.http.routes import ROUTE_ROLES
from nexa.control.operations.recovery import refused_while_recovering
from nexa.errors import (
    AlreadyExists,
    AuthError,
    BackupNotConfigured,
    Cancelled,
    CheckpointRejected,
    Conflict,
    ContractError,
    DeadlineExceeded,
    FieldNotSupported,
    Forbidden,
    IdempotencyKeyReused,
    IllegalTransition,
    ModelNotServed,
    NexaError,
    NodeUnreachable,
    NoReadyReplica,
    NoReplicaForDataClass,
    NotDeployable,
    NotFound,
    NotRecovering,
    Overloaded,
    PayloadTooLarge,
    QueueFull,
    QuotaExceeded,
    Recovering,
    RetentionNotPermitted,
    RetentionUnavailable,
    RuntimeFailed,
    RuntimeRejected,
    Unauthenticated,
    Unavailable,
    VerificationFailed,
    WorkloadAlreadyActive,
)

Json = dict[str, Any]

OPENAPI_VERSION: Final = "3.1.0"
#: The route this document is served on (with no credential: it describes shapes, never state).
DOCUMENT_ROUTE: Final = ("GET", "/api/v1/openapi.json")
_SSE: Final = "text/event-stream"
#: Media types of answers that are not JSON.
_TEXT: Final = "text/plain"
_CSV: Final = "text/csv"


_EMPTY: Final[Json] = {"type": "object", "maxProperties": 0, "description": "no body, or an empty object"}
_ANY_OBJECT: Final[Json] = {"type": "object"}
_OPENAI_MODELS: Final[Json] = {
    "type": "object",
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                },
                "required": ["id", "object", "created", "owned_by"],
            },
        },
    },
    "required": ["object", "data"],
}


def _openai_body(prompt: str, prompt_schema: Json, *, generates: bool) -> Json:
    """An OpenAI request body: free-form (passed to the runtime), with the fields the gateway checks."""
    props: Json = {
        "model": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS, "description": "an alias"},
        prompt: prompt_schema,
    }
    if generates:
        tokens = {"type": "integer", "minimum": 1, "maximum": MAX_REQUEST_TOKENS}
        props |= {
            "stream": {"type": "boolean", "default": False},
            "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
            "max_tokens": tokens,
            "max_completion_tokens": tokens,
            "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
        }
    return {"type": "object", "properties": props, "required": ["model", prompt], "additionalProperties": True}


_CHAT_BODY: Final = _openai_body(
    "messages", {"type": "array", "items": {"type": "object"}, "minItems": 1}, generates=True
)
_COMPLETION_BODY: Final = _openai_body("prompt", {"type": ["string", "array"]}, generates=True)
_EMBEDDING_BODY: Final = _openai_body("input", {"type": ["string", "array"]}, generates=False)

_UNIX_S: Final[Json] = {"type": "number", "description": "Unix seconds"}
#: Every list route that can grow pages the same way (`contracts.pages`); the answer's `next_cursor`.
_AUDIT_QUERY: Final = (
    *_PAGE_QUERY,
    _Param(
        name="after",
        schema={"type": "integer", "minimum": 0, "maximum": 2**62},
        description="deprecated (send cursor): the seq of the last event seen (a cursor is read too)",
        deprecated=True,
    ),
    _Param(name="action", schema=str),
    _Param(name="actor", schema=str, description="an API key id"),
    _Param(name="target", schema=str),
    _Param(name="since", schema=_UNIX_S),
    _Param(name="until", schema=_UNIX_S),
)
_USAGE_QUERY: Final = (
    *_PAGE_QUERY,
    _Param(name="since", schema=_UNIX_S, description="default: 30 days before until (page with the answer's)"),
    _Param(name="until", schema=_UNIX_S, description="default: now (page with the answer's)"),
    _Param(name="format", schema={"enum": ["json", "csv"], "default": "json"}),
    _Param(name="tenant", schema=str),
    _Param(name="model", schema=str),
)
_INFERENCE_HEADERS: Final = (
    _Param(name=PRIORITY_HEADER, schema=Priority, where="header", description="admission priority"),
    _Param(
        name=DEADLINE_HEADER,
        schema={"type": "integer", "minimum": 1},
        where="header",
        description="milliseconds from now (at most the gateway's max_deadline_s)",
    ),
    _Param(name=DATA_CLASS_HEADER, schema=str, where="header", description="only nodes allowed it serve it"),
    _Param(
        name=RETENTION_HEADER,
        schema=str,
        where="header",
        description="ephemeral (default: nothing kept), or a retention policy the tenant may use",
    ),
)
_SERVING: Final = (
    ModelNotServed,
    Overloaded,
    QuotaExceeded,
    QueueFull,
    NoReadyReplica,
    NoReplicaForDataClass,
    RuntimeFailed,
    RuntimeRejected,
    DeadlineExceeded,
    FieldNotSupported,
    RetentionNotPermitted,
    RetentionUnavailable,
)
_NODE_ACTION: Final = (IllegalTransition,)

#: Every route's bodies, parameters and particular errors (data; see the module docstring).
_OPERATIONS: Final[dict[tuple[str, str], _Op]] = {
    # ---- health and meta
    ("GET", "/healthz"): _Op(summary="Liveness", tag="meta", answer=Health),
    ("GET", "/readyz"): _Op(summary="Readiness, role and epoch", tag="meta", answer=Readiness, errors=(Unavailable,)),
    ("GET", "/version"): _Op(summary="Version and store epoch", tag="meta", answer=VersionInfo),
    ("GET", "/api/v1/cluster"): _Op(
        summary="The controllers on this store and which one leads", tag="meta", answer=ClusterView
    ),
    ("GET", "/metrics"): _Op(summary="Prometheus metrics", tag="meta", answer={"type": "string"}, media=_TEXT),
    DOCUMENT_ROUTE: _Op(summary="This OpenAPI document", tag="meta", answer=_ANY_OBJECT),
    # ---- keys, tenants, enrollment
    ("POST", "/api/v1/keys"): _Op(
        summary="Create an API key (its secret is shown once)",
        tag="keys",
        body=KeyCreate,
        body_kind="required",
        answer=KeyCreated,
        status=201,
        errors=(NotFound,),
    ),
    ("GET", "/api/v1/keys"): _Op(summary="List API keys", tag="keys", answer=KeyList, params=_PAGE_QUERY),
    ("GET", "/api/v1/keys/<key_id>"): _Op(summary="One API key", tag="keys", answer=KeyView, errors=(NotFound,)),
    ("DELETE", "/api/v1/keys/<key_id>"): _Op(
        summary="Revoke an API key", tag="keys", answer=KeyView, errors=(Conflict,)
    ),
    ("POST", "/api/v1/keys/<key_id>/rotate"): _Op(
        summary="Issue a successor key (its secret is shown once); the old key expires after the grace period",
        tag="keys",
        body=KeyRotate,
        body_kind="optional",
        answer=KeyRotated,
        status=201,
        errors=(NotFound, Conflict),
    ),
    ("POST", "/api/v1/tenants"): _Op(
        summary="Create a tenant",
        tag="tenants",
        body=TenantCreate,
        body_kind="required",
        answer=TenantView,
        status=201,
        errors=(AlreadyExists,),
    ),
    ("GET", "/api/v1/tenants"): _Op(summary="List tenants", tag="tenants", answer=TenantList, params=_PAGE_QUERY),
    ("POST", "/api/v1/enrollment-tokens"): _Op(
        summary="Create a one-time node enrollment token",
        tag="nodes",
        body=EnrollmentTokenCreate,
        body_kind="required",
        answer=EnrollmentTokenCreated,
        status=201,
    ),
    ("POST", "/api/v1/enroll"): _Op(
        summary="Enroll a node (authenticated by the one-time token in the body)",
        tag="nodes",
        body=EnrollRequest,
        body_kind="required",
        answer=EnrollResponse,
        status=201,
        errors=(AuthError,),
    ),
    # ---- nodes
    ("GET", "/api/v1/nodes"): _Op(summary="List nodes", tag="nodes", answer=NodeList, params=_PAGE_QUERY),
    ("GET", "/api/v1/nodes/<node_id>"): _Op(summary="Show a node", tag="nodes", answer=NodeView),
    ("POST", "/api/v1/nodes/<node_id>/cordon"): _Op(
        summary="Cordon a node", tag="nodes", answer=NodeView, errors=_NODE_ACTION
    ),
    ("POST", "/api/v1/nodes/<node_id>/uncordon"): _Op(
        summary="Uncordon a node", tag="nodes", answer=NodeView, errors=_NODE_ACTION
    ),
    ("POST", "/api/v1/nodes/<node_id>/drain"): _Op(
        summary="Drain a node", tag="nodes", answer=NodeView, errors=_NODE_ACTION
    ),
    ("POST", "/api/v1/nodes/<node_id>/revoke"): _Op(
        summary="Revoke a node's credentials", tag="nodes", answer=NodeView, errors=_NODE_ACTION
    ),
    ("POST", "/api/v1/nodes/<node_id>/rotate-keys"): _Op(
        summary="Ask a node over its channel to rotate its keys (it sends the new ones, signed with the old)",
        tag="nodes",
        answer=NodeView,
        errors=(NotFound, Conflict, NodeUnreachable),
    ),
    # ---- audit
    ("GET", "/api/v1/audit"): _Op(
        summary="Page through the audit chain", tag="audit", answer=AuditPage, params=_AUDIT_QUERY
    ),
    ("POST", "/api/v1/audit/verify"): _Op(
        summary="Verify the audit chain, optionally against a signed checkpoint",
        tag="audit",
        body=AuditVerifyRequest,
        body_kind="optional",
        answer=AuditVerdict,
        errors=(CheckpointRejected,),
    ),
    ("GET", "/api/v1/audit/head"): _Op(
        summary="The chain's head, signed (keep it to verify against later)", tag="audit", answer=SignedAuditCheckpoint
    ),
    # ---- runtimes, models, aliases
    ("POST", "/api/v1/runtimes"): _Op(
        summary="Register a runtime image",
        tag="registry",
        body=RuntimeCreate,
        body_kind="required",
        answer=RuntimeRecord,
        status=201,
        errors=(AlreadyExists, VerificationFailed, Unavailable),
    ),
    ("GET", "/api/v1/runtimes"): _Op(summary="List runtimes", tag="registry", answer=RuntimeList),
    ("GET", "/api/v1/runtimes/<name>"): _Op(summary="Show a runtime", tag="registry", answer=RuntimeRecord),
    ("POST", "/api/v1/models"): _Op(
        summary="Register a model version",
        tag="registry",
        body=ModelCreate,
        body_kind="required",
        answer=ModelRecord,
        status=201,
        errors=(AlreadyExists,),
    ),
    ("GET", "/api/v1/models"): _Op(
        summary="List model versions",
        tag="registry",
        answer=ModelList,
        params=(_Param(name="name", schema=str), _Param(name="state", schema=ModelState)),
    ),
    ("GET", "/api/v1/models/<name>/<version>"): _Op(summary="Show a model version", tag="registry", answer=ModelDetail),
    ("POST", "/api/v1/models/<name>/<version>/license"): _Op(
        summary="Record a model's license",
        tag="registry",
        body=LicenseSet,
        body_kind="required",
        answer=ModelRecord,
        errors=(Conflict,),
    ),
    ("POST", "/api/v1/models/<name>/<version>/verify"): _Op(
        summary="Verify a model's artifact (digest, size, signature)",
        tag="registry",
        body=VerifyRequest,
        body_kind="optional",
        answer=ModelRecord,
        errors=(Conflict, VerificationFailed, Unavailable),
    ),
    ("POST", "/api/v1/models/<name>/<version>/evaluations"): _Op(
        summary="Record an evaluation",
        tag="registry",
        body=EvaluationCreate,
        body_kind="required",
        answer=EvaluationResult,
        status=201,
        errors=(Conflict,),
    ),
    ("POST", "/api/v1/models/<name>/<version>/approve"): _Op(
        summary="Approve a model version", tag="registry", body_kind="empty", answer=ModelRecord, errors=(Conflict,)
    ),
    ("POST", "/api/v1/models/<name>/<version>/retire"): _Op(
        summary="Retire a model version", tag="registry", body_kind="empty", answer=ModelRecord, errors=(Conflict,)
    ),
    ("GET", "/api/v1/aliases"): _Op(summary="List aliases", tag="registry", answer=AliasList),
    ("GET", "/api/v1/aliases/<name>"): _Op(summary="Show an alias and its history", tag="registry", answer=AliasDetail),
    ("POST", "/api/v1/aliases/<name>/promote"): _Op(
        summary="Point an alias at an approved model version",
        tag="registry",
        body=AliasPromote,
        body_kind="required",
        answer=AliasReceipt,
        errors=(Conflict,),
    ),
    ("POST", "/api/v1/aliases/<name>/rollback"): _Op(
        summary="Point an alias back at its previous target",
        tag="registry",
        body_kind="empty",
        answer=AliasReceipt,
        errors=(Conflict,),
    ),
    # ---- deployments and capacity
    ("POST", "/api/v1/deployments"): _Op(
        summary="Create a deployment",
        tag="deployments",
        body=DeploymentCreate,
        body_kind="required",
        answer=DeploymentView,
        status=201,
        errors=(AlreadyExists, NotDeployable),
    ),
    ("GET", "/api/v1/deployments"): _Op(
        summary="List deployments", tag="deployments", answer=DeploymentList, params=_PAGE_QUERY
    ),
    ("GET", "/api/v1/deployments/<name>"): _Op(summary="Show a deployment", tag="deployments", answer=DeploymentView),
    ("DELETE", "/api/v1/deployments/<name>"): _Op(
        summary="Delete a deployment", tag="deployments", answer=DeploymentView, errors=(Conflict,)
    ),
    ("GET", "/api/v1/deployments/<name>/placement"): _Op(
        summary="Explain a deployment's placement", tag="deployments", answer=PlacementView
    ),
    ("POST", "/api/v1/deployments/<name>/scale"): _Op(
        summary="Scale a deployment",
        tag="deployments",
        body=ScaleRequest,
        body_kind="required",
        answer=DeploymentView,
        errors=(Conflict, NotDeployable),
    ),
    ("POST", "/api/v1/deployments/<name>/routing"): _Op(
        summary="Set a deployment's routing weights",
        tag="deployments",
        body=RoutingWeights,
        body_kind="required",
        answer=DeploymentView,
    ),
    ("POST", "/api/v1/deployments/<name>/canary"): _Op(
        summary="Start a canary",
        tag="deployments",
        body=CanaryCreate,
        body_kind="required",
        answer=DeploymentView,
        status=201,
        errors=(Conflict, NotDeployable),
    ),
    ("POST", "/api/v1/deployments/<name>/promote"): _Op(
        summary="Promote the canary", tag="deployments", body_kind="empty", answer=RolloutResult, errors=(Conflict,)
    ),
    ("POST", "/api/v1/deployments/<name>/rollback"): _Op(
        summary="Roll the deployment back",
        tag="deployments",
        body_kind="empty",
        answer=RolloutResult,
        errors=(Conflict,),
    ),
    ("POST", "/api/v1/capacity/forecast"): _Op(
        summary="Where a deployment would be placed (changes nothing)",
        tag="deployments",
        body=DeploymentCreate,
        body_kind="required",
        answer=PlacementDecision,
        errors=(NotDeployable,),
    ),
    # ---- usage, quotas, receipts
    ("GET", "/api/v1/usage"): _Op(
        summary="Usage by tenant, model and UTC day", tag="usage", answer=UsageReport, also=(_CSV,), params=_USAGE_QUERY
    ),
    ("GET", "/api/v1/quotas"): _Op(summary="Every tenant's quota and use", tag="usage", answer=QuotaList),
    ("GET", "/api/v1/quotas/<tenant>"): _Op(summary="A tenant's quota and use", tag="usage", answer=QuotaView),
    ("PUT", "/api/v1/quotas/<tenant>"): _Op(
        summary="Set a tenant's quota", tag="usage", body=QuotaLimits, body_kind="required", answer=QuotaView
    ),
    ("GET", "/api/v1/receipts/public-key"): _Op(
        summary="The key workload receipts are signed with, and every current and retired key by id",
        tag="usage",
        answer=ReceiptPublicKey,
    ),
    ("POST", "/api/v1/controller/rotate-keys"): _Op(
        summary="New controller keys, announced to every node signed with the current one",
        tag="keys",
        body_kind="empty",
        answer=ControllerKeysRotated,
        # Conflict: a rotation's overlap is still running, other controllers run on the store, or the second
        # channel endpoint cannot be bound (nothing changed); Unavailable: no keyring (not configured).
        errors=(Conflict, Unavailable),
    ),
    # ---- backups
    ("POST", "/api/v1/backups"): _Op(
        summary="Back up the state now (database and controller keys, encrypted and signed) into backup.dir",
        tag="backups",
        body_kind="empty",
        answer=BackupView,
        status=201,
        errors=(BackupNotConfigured,),
    ),
    ("GET", "/api/v1/backups"): _Op(
        summary="List the backups in backup.dir, oldest first", tag="backups", answer=BackupList, params=_PAGE_QUERY
    ),
    ("GET", "/api/v1/backups/<name>"): _Op(
        summary="Download one backup file (`nexa backup --out`; restore it with `nexa restore`)",
        tag="backups",
        answer={"type": "string", "contentMediaType": "application/octet-stream"},
        media="application/octet-stream",
        errors=(NotFound,),
    ),
    # ---- recovery
    ("GET", "/api/v1/recovery/plan"): _Op(
        summary="What ending recovery would change (empty outside recovery)", tag="recovery", answer=RecoveryPlan
    ),
    ("POST", "/api/v1/recovery/finish"): _Op(
        summary="End recovery: an epoch above every node's, then every node's set is pushed",
        tag="recovery",
        body_kind="empty",
        answer=RecoveryFinished,
        errors=(NotRecovering,),
    ),
    # ---- inference
    ("GET", "/v1/models"): _Op(summary="Served models (OpenAI)", tag="openai", answer=_OPENAI_MODELS),
    ("POST", "/v1/chat/completions"): _Op(
        summary="Chat completion (OpenAI)",
        tag="openai",
        body=_CHAT_BODY,
        body_kind="required",
        answer=_ANY_OBJECT,
        also=(_SSE,),
        params=_INFERENCE_HEADERS,
        errors=_SERVING,
    ),
    ("POST", "/v1/completions"): _Op(
        summary="Completion (OpenAI)",
        tag="openai",
        body=_COMPLETION_BODY,
        body_kind="required",
        answer=_ANY_OBJECT,
        also=(_SSE,),
        params=_INFERENCE_HEADERS,
        errors=_SERVING,
    ),
    ("POST", "/v1/embeddings"): _Op(
        summary="Embeddings (OpenAI)",
        tag="openai",
        body=_EMBEDDING_BODY,
        body_kind="required",
        answer=_ANY_OBJECT,
        params=_INFERENCE_HEADERS,
        errors=_SERVING,
    ),
    ("POST", "/api/v1/workloads"): _Op(
        summary="Run a workload (the nexa.v1 envelope)",
        tag="workloads",
        body=WorkloadCreate,
        body_kind="required",
        answer=WorkloadView,
        also=(_SSE,),
        errors=(*_SERVING, IdempotencyKeyReused, WorkloadAlreadyActive, Cancelled),
    ),
    ("GET", "/api/v1/workloads"): _Op(
        summary="Your tenant's workloads, oldest first", tag="workloads", answer=WorkloadList, params=_PAGE_QUERY
    ),
    ("GET", "/api/v1/workloads/<workload_id>"): _Op(summary="A workload's state", tag="workloads", answer=WorkloadView),
    ("POST", "/api/v1/workloads/<workload_id>/cancel"): _Op(
        summary="Cancel a workload", tag="workloads", answer=WorkloadView, status=202
    ),
    ("GET", "/api/v1/workloads/<workload_id>/receipt"): _Op(
        summary="A finished workload's signed receipt", tag="workloads", answer=SignedReceipt, errors=(Conflict,)
    ),
    **RECORD_OPERATIONS,
}


def routes() -> dict[tuple[str, str], frozenset[Role] | None]:
    """Every HTTP route of the controller (console pages aside) and the roles that may call it."""
    return {**ROUTE_ROLES, **INFERENCE_ROUTES}


def document() -> Json:
    """The OpenAPI 3.1 document of every management and inference route."""
    table = routes()
    missing = sorted(set(table) - set(_OPERATIONS))
    stale = sorted(set(_OPERATIONS) - set(table))
    if missing or stale:
        raise LookupError(f"openapi: routes without a description {missing}; descriptions without a route {stale}")
    if unpaged := [route for route, op in _OPERATIONS.items() if not _paged_alike(op)]:
        raise LookupError(f"openapi: answers a next_cursor without taking _PAGE_QUERY first, or the reverse: {unpaged}")
    schemas = JsonSchemas()
    paths: Json = {}
    for (method, rule), roles in table.items():
        path = _path(rule)
        paths.setdefault(path, {})[method.lower()] = _operation(
            method, rule, roles, _OPERATIONS[(method, rule)], schemas
        )
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "LunaNexa controller",
            "version": __version__,
            "description": (
                "Management (`/api/v1`) and inference (`/v1`, OpenAI-compatible; `/api/v1/workloads`) routes."
                " Every operation lists the roles that may call it in `x-nexa-roles` (empty: no credential)"
                " and the error codes it can answer in each error response's `x-nexa-error-codes`."
                " Errors come in nexa's envelope, on `/v1` in OpenAI's shape."
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


def _paged_alike(op: _Op) -> bool:
    """Whether `op` answers a page (a `next_cursor`) exactly when it takes `_PAGE_QUERY` first."""
    paged = attrs.has(op.answer) and "next_cursor" in attrs.fields_dict(op.answer)
    return paged == (op.params[: len(_PAGE_QUERY)] == _PAGE_QUERY)


def document_json() -> bytes:
    """`document()` as the bytes the route answers."""
    return json.dumps(document(), sort_keys=True, separators=(",", ":")).encode()


def _path(rule: str) -> str:
    return "/".join(f"{{{p[1:-1]}}}" if p.startswith("<") else p for p in rule.split("/"))


def _path_params(rule: str) -> list[str]:
    return [p[1:-1] for p in rule.split("/") if p.startswith("<")]


def _operation(method: str, rule: str, roles: frozenset[Role] | None, op: _Op, schemas: JsonSchemas) -> Json:
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
        out["requestBody"] = {"required": op.body_kind == "required", "content": {_JSON: {"schema": body}}}
    success: Json = {op.media: {"schema": schemas.of(op.answer)}}
    for media in op.also:
        success[media] = {"schema": {"type": "string"}}
    responses: Json = {str(op.status): {"description": op.summary, "content": success}}
    error_schema = schemas.of(OpenAIError if openai else ErrorEnvelope)
    for status, codes in sorted(_error_codes(method, rule, roles, op).items()):
        responses[str(status)] = {
            "description": "error: " + ", ".join(codes),
            "x-nexa-error-codes": codes,
            "content": {_JSON: {"schema": error_schema}},
        }
    if (method, rule) in INFERENCE_ROUTES:
        for response in responses.values():
            response["headers"] = dict(_INFERENCE_RESPONSE_HEADERS)
    out["responses"] = responses
    return out


#: What every answer of the inference routes carries (`inference._Exchange` writes every one).
_INFERENCE_RESPONSE_HEADERS: Final[Json] = {
    OVERHEAD_HEADER: {
        "description": (
            "nexa's own time in this response, in ms (two decimals): the controller's time from the"
            " request's arrival to this response head, less admission queueing and the time it waited"
            " for the node's answer (a stream: its first output; otherwise the whole answer), plus the"
            " node's own time outside the runtime. A stream's figure is the overhead up to its first byte."
        ),
        "schema": {"type": "string", "pattern": r"^[0-9]+\.[0-9]{2}$"},
    },
}


def _operation_id(method: str, rule: str) -> str:
    """As `api._view_name` names handlers (`get_nodes_by_node_id`); OpenAI routes get `openai_`."""
    parts = [f"by_{p[1:-1]}" if p.startswith("<") else p for p in rule.strip("/").split("/") if p not in {"api", "v1"}]
    prefix = ["openai"] if rule.startswith("/v1/") else []
    return "_".join([method.lower(), *prefix, *parts]).replace("-", "_").replace(".", "_")


def _error_codes(method: str, rule: str, roles: frozenset[Role] | None, op: _Op) -> dict[int, list[str]]:
    """Status → the error codes a route can answer with it: those of its kind, then its own."""
    errors: list[type[NexaError]] = []
    if roles is not None:
        errors += [Unauthenticated, Forbidden]
    if op.body_kind != "none" or op.params:
        errors += [ContractError]
    if op.body_kind != "none" or method in {"POST", "PUT"}:
        errors += [PayloadTooLarge]
    if _path_params(rule):
        errors += [NotFound]
    if (method, rule) in ROUTE_ROLES and refused_while_recovering(method, rule):
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
