"""Usage, quota and receipt-key routes. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

import time
from typing import Final

import attrs
from quart import Response, request

from nexa.contracts import pages
from nexa.contracts.api import ReceiptPublicKey
from nexa.contracts.domain import Role, TenantId
from nexa.contracts.usage import QuotaLimits, QuotaList, QuotaView, UsageReport
from nexa.control.datapath.metering import Meter
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page, query_float
from nexa.control.http.declare import ADMIN, AUDITORS, PAGE_QUERY, UNIX_S, Param, route
from nexa.control.http.state import AppState
from nexa.errors import ContractError, NotFound

_CSV: Final = "text/csv"
_USAGE_QUERY: Final = (
    *PAGE_QUERY,
    Param(name="since", schema=UNIX_S, description="default: 30 days before until (page with the answer's)"),
    Param(name="until", schema=UNIX_S, description="default: now (page with the answer's)"),
    Param(name="format", schema={"enum": ["json", "csv"], "default": "json"}),
    Param(name="tenant", schema=str),
    Param(name="model", schema=str),
)


@route(
    "GET",
    "/api/v1/usage",
    roles=AUDITORS,
    summary="Usage by tenant, model and UTC day",
    tag="usage",
    answer=UsageReport,
    also=(_CSV,),
    params=_USAGE_QUERY,
)
async def usage(s: AppState) -> Response:
    """Usage by tenant, model and UTC day; `?format=csv` for a CSV file. Default: the last 30 days.

    The JSON form is a page of groups (`?cursor=&limit=`); the CSV file has every group."""
    until = query_float("until") or time.time()
    since = query_float("since") or until - 30 * 86400
    if since > until:
        raise ContractError("since: must not be after until", problems=("since",))
    fmt = request.args.get("format", "json")
    if fmt not in {"json", "csv"}:
        raise ContractError("format: json or csv", problems=("format",))
    tenant, model = request.args.get("tenant"), request.args.get("model")
    if fmt == "csv":
        if "cursor" in request.args or "limit" in request.args:
            raise ContractError("the CSV form has every group: leave cursor and limit out", problems=("cursor",))
        report = await s.meter.usage(since=since, until=until, tenant=tenant, model=model)
        response = Response(Meter.to_csv(report), content_type="text/csv; charset=utf-8")
        response.headers["Content-Disposition"] = 'attachment; filename="nexa-usage.csv"'
        return response
    after, limit = page("usage", (str, str, str))
    report = await s.meter.usage(
        since=since,
        until=until,
        tenant=tenant,
        model=model,
        after=None if after is None else (str(after[0]), str(after[1]), str(after[2])),
        limit=limit + 1,
    )
    rows, last = pages.cut(report.rows, limit, lambda r: (r.day, r.tenant, r.model))
    return json_response(attrs.evolve(report, rows=rows, next_cursor=next_cursor("usage", last)))


@route("GET", "/api/v1/quotas", roles=ADMIN, summary="Every tenant's quota and use", tag="usage", answer=QuotaList)
async def quotas(s: AppState) -> Response:
    return json_response(s.quotas.all(time.time()))


@route("GET", "/api/v1/quotas/<tenant>", roles=ADMIN, summary="A tenant's quota and use", tag="usage", answer=QuotaView)
async def quota(s: AppState, tenant: str) -> Response:
    if not s.accounts.tenant_exists(TenantId(tenant)):
        raise NotFound(f"no tenant {tenant}")
    return json_response(s.quotas.view(TenantId(tenant), time.time()))


@route(
    "PUT",
    "/api/v1/quotas/<tenant>",
    roles=ADMIN,
    summary="Set a tenant's quota",
    tag="usage",
    request=QuotaLimits,
    answer=QuotaView,
)
async def set_quota(s: AppState, tenant: str) -> Response:
    req = await body(QuotaLimits)
    return json_response(await s.quotas.set(actor(), TenantId(tenant), req))


@route(
    "GET",
    "/api/v1/receipts/public-key",
    roles=frozenset({Role.INFERENCE, Role.AUDIT, Role.OPERATOR, Role.ADMIN}),
    summary="The key workload receipts are signed with, and every current and retired key by id",
    tag="usage",
    answer=ReceiptPublicKey,
)
async def receipts_public_key(s: AppState) -> Response:
    rotation, pub = s.key_rotation, s.signing_key.public  # every key by id: `nexa receipts verify`
    listed = rotation.keys.listed() if rotation else []
    return json_response(ReceiptPublicKey(public_key=pub.b64, key_id=pub.fingerprint, keys=listed))
