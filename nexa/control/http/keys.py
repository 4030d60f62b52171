"""API-key routes (create, list, show, revoke, rotate) and the controller's own key rotation.
Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

from quart import Response

from nexa.contracts import pages
from nexa.contracts.api import ControllerKeysRotated, KeyCreate, KeyCreated, KeyList, KeyRotate, KeyRotated, KeyView
from nexa.contracts.domain import ApiKey, KeyId
from nexa.control.fleet.keyring import KeyRotation
from nexa.control.http.api_io import actor, body, json_response, next_cursor, no_body, optional_body, page
from nexa.control.http.declare import ADMIN, PAGE_QUERY, route
from nexa.control.http.state import AppState
from nexa.errors import Conflict, NotFound, Unavailable


@route(
    "POST",
    "/api/v1/keys",
    roles=ADMIN,
    summary="Create an API key (its secret is shown once)",
    tag="keys",
    request=KeyCreate,
    answer=KeyCreated,
    status=201,
    errors=(NotFound,),
)
async def create_key(s: AppState) -> Response:
    req = await body(KeyCreate)
    secret, key = await s.accounts.create_key(actor(), req)
    return json_response(KeyCreated(key=secret, info=key_view(key)), 201)


@route("GET", "/api/v1/keys", roles=ADMIN, summary="List API keys", tag="keys", answer=KeyList, params=PAGE_QUERY)
async def list_keys(s: AppState) -> Response:
    after, limit = page("keys", (float, str))
    keys, last = pages.page_of(s.accounts.api_keys(), lambda k: (k.created_at, k.id), after, limit)
    return json_response(KeyList(keys=[key_view(k) for k in keys], next_cursor=next_cursor("keys", last)))


@route(
    "GET", "/api/v1/keys/<key_id>", roles=ADMIN, summary="One API key", tag="keys", answer=KeyView, errors=(NotFound,)
)
async def show_key(s: AppState, key_id: str) -> Response:
    return json_response(key_view(s.accounts.api_key(KeyId(key_id))))


@route(
    "DELETE",
    "/api/v1/keys/<key_id>",
    roles=ADMIN,
    summary="Revoke an API key",
    tag="keys",
    answer=KeyView,
    errors=(Conflict,),
)
async def revoke_key(s: AppState, key_id: str) -> Response:
    key = await s.accounts.revoke_key(actor(), KeyId(key_id))
    return json_response(key_view(key))


@route(
    "POST",
    "/api/v1/keys/<key_id>/rotate",
    roles=ADMIN,
    summary="Issue a successor key (its secret is shown once); the old key expires after the grace period",
    tag="keys",
    request=KeyRotate,
    body_kind="optional",
    answer=KeyRotated,
    status=201,
    errors=(NotFound, Conflict),
)
async def rotate_key(s: AppState, key_id: str) -> Response:
    req = await optional_body(KeyRotate)
    secret, successor, old = await s.accounts.rotate_key(actor(), KeyId(key_id), req)
    return json_response(KeyRotated(key=secret, info=key_view(successor), previous=key_view(old)), 201)


@route(
    "POST",
    "/api/v1/controller/rotate-keys",
    roles=ADMIN,
    summary="New controller keys, announced to every node signed with the current one",
    tag="keys",
    body_kind="empty",
    answer=ControllerKeysRotated,
    # Conflict: a rotation's overlap is still running, other controllers run on the store, or the second
    # channel endpoint cannot be bound (nothing changed); Unavailable: no keyring (not configured).
    errors=(Conflict, Unavailable),
)
async def rotate_controller_keys(s: AppState) -> Response:
    await no_body()
    return json_response(await KeyRotation.of(s.key_rotation).rotate(actor()))


def key_view(key: ApiKey) -> KeyView:
    return KeyView(
        id=key.id,
        name=key.name,
        role=key.role,
        tenant=key.tenant,
        created_at=key.created_at,
        created_by=key.created_by,
        revoked_at=key.revoked_at,
        expires_at=key.expires_at,
        rotated_to=key.rotated_to,
        priorities=list(key.granted),
    )
