"""Adding a route touches one module: its one declaration (`http.declare.route`) gives the app its
handler and role check, the OpenAPI document its operation, and the console its roles."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexa.config import HttpConfig
from nexa.contracts.api import KeyCreate
from nexa.contracts.domain import SYSTEM, KeyId, Role
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.console.sessions import new_session
from nexa.control.http import nodes, openapi, records, resources
from nexa.control.http.api import create_app
from nexa.control.http.declare import collect
from nexa.telemetry import Metrics
from tests.support import declared_route
from tests.support.api import bare_state

_ROUTE = ("POST", "/api/v1/test-echo/<word>")


async def test_one_declaration_gives_the_route_its_handler_roles_console_check_and_openapi(tmp_path: Path) -> None:
    async with st.open_store(tmp_path / "state") as store:
        metrics = Metrics()
        accounts = await Accounts.load(store, metrics)
        auditor, _ = await accounts.create_key(SYSTEM, KeyCreate(role=Role.AUDIT))
        operator, _ = await accounts.create_key(SYSTEM, KeyCreate(role=Role.OPERATOR))
        state = bare_state(accounts=accounts, store=store, metrics=metrics, ready=True)
        app = create_app(HttpConfig(), state, (*resources.MODULES, declared_route))
        client = app.test_client()

        # The handler serves it, for the declared role.
        resp = await client.post("/api/v1/test-echo/hello", headers={"Authorization": f"Bearer {auditor}"})
        assert resp.status_code == 201
        assert await resp.get_json() == {"status": "hello from audit"}
        taken = await client.post("/api/v1/test-echo/taken", headers={"Authorization": f"Bearer {auditor}"})
        assert (taken.status_code, (await taken.get_json())["error"]["code"]) == (409, "conflict")
        # Its role check runs before the handler: another role is refused (and audited), no key is 401.
        refused = await client.post("/api/v1/test-echo/hello", headers={"Authorization": f"Bearer {operator}"})
        assert (refused.status_code, (await refused.get_json())["error"]["code"]) == (403, "forbidden")
        denied = await store.read(st.list_audit, st.AuditQuery(after_seq=0, limit=100, action=" ".join(_ROUTE)))
        assert [e.target for e in denied] == ["/api/v1/test-echo/hello"]
        assert (await client.post("/api/v1/test-echo/hello")).status_code == 401
        # Left out of the modules, the route does not exist.
        bare = create_app(HttpConfig(), state).test_client()
        assert (
            await bare.post("/api/v1/test-echo/hello", headers={"Authorization": f"Bearer {auditor}"})
        ).status_code == 404

        # The console's role checks read the same declaration.
        console = app.extensions["nexa.console"]
        assert console.may(new_session(_key_id(accounts, Role.AUDIT), Role.AUDIT, None, now=0), _ROUTE)
        assert not console.may(new_session(_key_id(accounts, Role.OPERATOR), Role.OPERATOR, None, now=0), _ROUTE)

    # Its OpenAPI operation comes from the same declaration.
    doc = openapi.document((*openapi.routes(), *collect([declared_route])))
    op = doc["paths"]["/api/v1/test-echo/{word}"]["post"]
    assert op["operationId"] == "post_test_echo_by_word"
    assert op["summary"] == declared_route.echo.summary and op["tags"] == ["test"]
    assert op["x-nexa-roles"] == ["audit"] and op["security"] == [{"bearer": []}]
    assert op["responses"]["201"]["content"]["application/json"]["schema"]["$ref"].endswith("/Health")
    assert op["responses"]["409"]["x-nexa-error-codes"] == ["conflict"]
    assert op["responses"]["403"]["x-nexa-error-codes"] == ["forbidden"]
    assert op["requestBody"]["required"] is False
    assert "/api/v1/test-echo/{word}" not in openapi.document()["paths"]


def _key_id(accounts: Accounts, role: Role) -> KeyId:
    return next(k.id for k in accounts.api_keys() if k.role is role)


def test_the_console_refuses_to_start_on_an_action_or_view_whose_route_is_not_declared() -> None:
    state = bare_state()
    # The console's cordon action mirrors a route of the nodes module; without it, no app.
    without_nodes = [m for m in resources.MODULES if m is not nodes]
    with pytest.raises(LookupError, match=r"/api/v1/nodes/<node_id>/cordon"):
        create_app(HttpConfig(), state, without_nodes)
    # Its benchmarks view mirrors GET /api/v1/benchmarks (of the records module).
    without_records = [m for m in resources.MODULES if m is not records]
    with pytest.raises(LookupError, match=r"console view benchmarks names a route no resource module declares"):
        create_app(HttpConfig(), state, without_records)
