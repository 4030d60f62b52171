"""A resource module for tests only: one route, declared once
(`tests/control/test_declare.py` builds an app of it)."""

from __future__ import annotations

from quart import Response

from nexa.contracts.api import Health
from nexa.contracts.domain import Role
from nexa.control.http.api_io import actor, json_response
from nexa.control.http.declare import route
from nexa.control.http.state import AppState
from nexa.errors import Conflict

ROLES = frozenset({Role.AUDIT})


@route(
    "POST",
    "/api/v1/test-echo/<word>",
    roles=ROLES,
    summary="Echo a word with the caller's role (a test's route)",
    tag="test",
    answer=Health,
    status=201,
    body_kind="empty",
    errors=(Conflict,),
)
async def echo(s: AppState, word: str) -> Response:
    if word == "taken":
        raise Conflict("that word is taken")
    return json_response(Health(status=f"{word} from {actor().role}"), 201)
