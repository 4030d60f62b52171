"""Retention routes: policies (admin), retained records (the `retention-reader` role reads them,
decrypted; admin lists them) and purges (admin); each a thin adapter onto
`control.datapath.retention.Retention`. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

from quart import Response, request

from nexa.contracts import pages
from nexa.contracts.domain import Role
from nexa.contracts.retention import (
    RetainedList,
    RetainedPayload,
    RetentionPolicy,
    RetentionPolicyList,
    RetentionPolicySet,
    RetentionPurge,
    RetentionPurged,
)
from nexa.control.datapath.retention import Retention
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page
from nexa.control.http.declare import ADMIN, PAGE_QUERY, Param, route
from nexa.control.http.state import AppState
from nexa.errors import Unavailable

_POLICY = "/api/v1/retention/policies/<name>"


@route(
    "GET",
    "/api/v1/retention/policies",
    roles=ADMIN,
    summary="Retention policies",
    tag="retention",
    answer=RetentionPolicyList,
)
async def list_policies(s: AppState) -> Response:
    return json_response(Retention.of(s.retention).policies())


@route("GET", _POLICY, roles=ADMIN, summary="One retention policy", tag="retention", answer=RetentionPolicy)
async def show_policy(s: AppState, name: str) -> Response:
    return json_response(Retention.of(s.retention).policy(name))


@route(
    "PUT",
    _POLICY,
    roles=ADMIN,
    summary="Create or replace a retention policy (TTL, tenants)",
    tag="retention",
    request=RetentionPolicySet,
    answer=RetentionPolicy,
)
async def set_policy(s: AppState, name: str) -> Response:
    req = await body(RetentionPolicySet)
    return json_response(await Retention.of(s.retention).set_policy(actor(), name, req))


@route(
    "DELETE",
    _POLICY,
    roles=ADMIN,
    summary="Delete a retention policy (what it kept stays until its TTL)",
    tag="retention",
    answer=RetentionPolicy,
)
async def delete_policy(s: AppState, name: str) -> Response:
    return json_response(await Retention.of(s.retention).delete_policy(actor(), name))


# Ids, sizes, times: never a payload.
@route(
    "GET",
    "/api/v1/retention/records",
    roles=frozenset({Role.RETENTION_READER, Role.ADMIN}),
    summary="Retained records (ids, sizes, times; never a payload), oldest first",
    tag="retention",
    answer=RetainedList,
    params=(
        *PAGE_QUERY,
        Param(name="request_id", schema=str, description="only this request id's"),
        Param(name="tenant", schema=str, description="only this tenant's"),
        Param(name="policy", schema=str, description="only this policy's"),
    ),
)
async def list_records(s: AppState) -> Response:
    after, limit = page("retained", (float, str))
    records = await Retention.of(s.retention).page(
        request_id=request.args.get("request_id"),
        tenant=request.args.get("tenant"),
        policy=request.args.get("policy"),
        after=None if after is None else (float(after[0]), str(after[1])),
        limit=limit + 1,
    )
    records, last = pages.cut(records, limit, lambda r: (r.stored_at, r.id))
    return json_response(RetainedList(records=records, next_cursor=next_cursor("retained", last)))


# The payload, decrypted; audited. Only the retention-reader role (not admin) reads it.
@route(
    "GET",
    "/api/v1/retention/records/<record_id>",
    roles=frozenset({Role.RETENTION_READER}),
    summary="A retained request and its answer, decrypted (audited)",
    tag="retention",
    answer=RetainedPayload,
    errors=(Unavailable,),
)
async def read_record(s: AppState, record_id: str) -> Response:
    return json_response(await Retention.of(s.retention).read(actor(), record_id))


@route(
    "POST",
    "/api/v1/retention/purge",
    roles=ADMIN,
    summary="Purge retained payloads now, by request id, tenant or policy (audited)",
    tag="retention",
    request=RetentionPurge,
    answer=RetentionPurged,
)
async def purge(s: AppState) -> Response:
    return json_response(await Retention.of(s.retention).purge(actor(), await body(RetentionPurge)))
