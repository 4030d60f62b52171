"""Tenant routes (create, list). Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

from quart import Response

from nexa.contracts import pages
from nexa.contracts.api import TenantCreate, TenantList, TenantView
from nexa.contracts.domain import Tenant
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page
from nexa.control.http.declare import ADMIN, PAGE_QUERY, route
from nexa.control.http.state import AppState
from nexa.errors import AlreadyExists


@route(
    "POST",
    "/api/v1/tenants",
    roles=ADMIN,
    summary="Create a tenant",
    tag="tenants",
    request=TenantCreate,
    answer=TenantView,
    status=201,
    errors=(AlreadyExists,),
)
async def create_tenant(s: AppState) -> Response:
    req = await body(TenantCreate)
    tenant = await s.accounts.create_tenant(actor(), req)
    return json_response(_tenant_view(tenant), 201)


@route(
    "GET", "/api/v1/tenants", roles=ADMIN, summary="List tenants", tag="tenants", answer=TenantList, params=PAGE_QUERY
)
async def list_tenants(s: AppState) -> Response:
    after, limit = page("tenants", (str,))
    tenants, last = pages.page_of(s.accounts.tenants(), lambda t: (t.id,), after, limit)
    return json_response(
        TenantList(tenants=[_tenant_view(t) for t in tenants], next_cursor=next_cursor("tenants", last))
    )


def _tenant_view(t: Tenant) -> TenantView:
    return TenantView(id=t.id, display_name=t.display_name, created_at=t.created_at)
