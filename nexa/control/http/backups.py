"""Backup routes (made into [backup] dir, listed, downloaded with `nexa backup --out`) and the
recovery routes. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

import trio
from quart import Response

from nexa.contracts.backup import BackupList, BackupView
from nexa.contracts.recovery import RecoveryFinished, RecoveryPlan
from nexa.control.http.api_io import actor, json_response, next_cursor, no_body, page
from nexa.control.http.declare import ADMIN, OPERATORS, PAGE_QUERY, route
from nexa.control.http.state import AppState
from nexa.control.operations.backup import Backups
from nexa.control.operations.recovery import Recovery
from nexa.errors import BackupNotConfigured, NotFound, NotRecovering


@route(
    "POST",
    "/api/v1/backups",
    roles=ADMIN,
    summary="Back up the state now (database and controller keys, encrypted and signed) into backup.dir",
    tag="backups",
    body_kind="empty",
    answer=BackupView,
    status=201,
    errors=(BackupNotConfigured,),
)
async def create_backup(s: AppState) -> Response:
    await no_body()
    return json_response(await Backups.of(s.backups).create(actor()), 201)


@route(
    "GET",
    "/api/v1/backups",
    roles=ADMIN,
    summary="List the backups in backup.dir, oldest first",
    tag="backups",
    answer=BackupList,
    params=PAGE_QUERY,
)
async def list_backups(s: AppState) -> Response:
    after, limit = page("backups", (str,))
    views, last = await trio.to_thread.run_sync(Backups.of(s.backups).list_page, after, limit)
    return json_response(BackupList(backups=views, next_cursor=next_cursor("backups", last)))


@route(
    "GET",
    "/api/v1/backups/<name>",
    roles=ADMIN,
    summary="Download one backup file (`nexa backup --out`; restore it with `nexa restore`)",
    tag="backups",
    answer={"type": "string", "contentMediaType": "application/octet-stream"},
    media="application/octet-stream",
    errors=(NotFound,),
)
async def download_backup(s: AppState, name: str) -> Response:
    chunks = await Backups.of(s.backups).download(name)
    return Response(chunks, mimetype="application/octet-stream")


@route(
    "GET",
    "/api/v1/recovery/plan",
    roles=OPERATORS,
    summary="What ending recovery would change (empty outside recovery)",
    tag="recovery",
    answer=RecoveryPlan,
)
async def recovery_plan(s: AppState) -> Response:
    return json_response(Recovery.of(s.recovery).plan())


@route(
    "POST",
    "/api/v1/recovery/finish",
    roles=ADMIN,
    summary="End recovery: an epoch above every node's, then every node's set is pushed",
    tag="recovery",
    body_kind="empty",
    answer=RecoveryFinished,
    errors=(NotRecovering,),
)
async def finish_recovery(s: AppState) -> Response:
    await no_body()
    return json_response(await Recovery.of(s.recovery).finish(actor()))
