"""The management API's retention routes: policies (admin), retained records (the
`retention-reader` role reads them, decrypted; admin lists them) and purges (admin).
`RetentionHandlers` is a mixin of `api._Handlers` (one method per route, named after it); each is a
thin adapter onto `control.datapath.retention.Retention`.
"""

from __future__ import annotations

from typing import Protocol

from quart import Response, request

from nexa.contracts import pages
from nexa.contracts.retention import RetainedList, RetentionPolicySet, RetentionPurge
from nexa.control.datapath.retention import Retention
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page


class RetentionState(Protocol):
    """What these routes need of `api.AppState`."""

    retention: Retention | None


class RetentionHandlers:
    _s: RetentionState

    async def get_retention_policies(self) -> Response:
        return json_response(Retention.of(self._s.retention).policies())

    async def get_retention_policies_by_name(self, name: str) -> Response:
        return json_response(Retention.of(self._s.retention).policy(name))

    async def put_retention_policies_by_name(self, name: str) -> Response:
        req = await body(RetentionPolicySet)
        return json_response(await Retention.of(self._s.retention).set_policy(actor(), name, req))

    async def delete_retention_policies_by_name(self, name: str) -> Response:
        return json_response(await Retention.of(self._s.retention).delete_policy(actor(), name))

    async def get_retention_records(self) -> Response:
        after, limit = page("retained", (float, str))
        records = await Retention.of(self._s.retention).page(
            request_id=request.args.get("request_id"),
            tenant=request.args.get("tenant"),
            policy=request.args.get("policy"),
            after=None if after is None else (float(after[0]), str(after[1])),
            limit=limit + 1,
        )
        records, last = pages.cut(records, limit, lambda r: (r.stored_at, r.id))
        return json_response(RetainedList(records=records, next_cursor=next_cursor("retained", last)))

    async def get_retention_records_by_record_id(self, record_id: str) -> Response:
        return json_response(await Retention.of(self._s.retention).read(actor(), record_id))

    async def post_retention_purge(self) -> Response:
        return json_response(await Retention.of(self._s.retention).purge(actor(), await body(RetentionPurge)))
