"""Health and meta routes: liveness, readiness, version, the cluster's controllers, metrics and
the OpenAPI document. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

import time
from typing import Final

import trio
from quart import Response

from nexa import __version__
from nexa.contracts.api import ClusterView, Health, Readiness, VersionInfo
from nexa.control.http.api_io import json_response
from nexa.control.http.declare import MONITORS, OPERATORS, route
from nexa.control.http.state import AppState
from nexa.errors import Unavailable
from nexa.telemetry import METRICS_CONTENT_TYPE

#: Media type of the metrics answer.
_TEXT: Final = "text/plain"
_ANY_OBJECT: Final = {"type": "object"}


@route("GET", "/healthz", roles=None, summary="Liveness", tag="meta", answer=Health)
async def healthz(s: AppState) -> Response:
    return json_response(Health(status="ok"))


@route(
    "GET",
    "/readyz",
    roles=None,
    summary="Readiness, role and epoch",
    tag="meta",
    answer=Readiness,
    errors=(Unavailable,),
)
async def readyz(s: AppState) -> Response:
    if not s.ready:
        raise Unavailable("the controller is starting or stopping")
    # Recovering serves reads and inference: ready for traffic, and it says so.
    recovering = s.recovery is not None and s.recovery.active
    lead, status = s.leadership, "recovering" if recovering else "ready"
    if lead is None:
        return json_response(Readiness(status=status, epoch=s.store.epoch if s.store is not None else 0))
    return json_response(Readiness(status=status, role=lead.role, epoch=lead.epoch, lease_age_s=lead.lease_age_s))


@route("GET", "/version", roles=None, summary="Version and store epoch", tag="meta", answer=VersionInfo)
async def version(s: AppState) -> Response:
    return json_response(
        VersionInfo(
            version=__version__,
            epoch=s.epoch(),
            started_at=s.started_at,
            controller_fingerprint=s.controller_keys.fingerprint,
            now=time.time(),
            max_clock_skew_s=s.max_clock_skew_s,
            recovering=s.recovery is not None and s.recovery.active,
        )
    )


# Each controller's role, epoch and lease age.
@route(
    "GET",
    "/api/v1/cluster",
    roles=frozenset({*MONITORS, *OPERATORS}),
    summary="The controllers on this store and which one leads",
    tag="meta",
    answer=ClusterView,
)
async def cluster(s: AppState) -> Response:
    lead = s.leadership
    if lead is None:
        raise Unavailable("this controller runs without a leadership (a test's app)")
    view: ClusterView = await lead.view()
    return json_response(view)


@route(
    "GET", "/metrics", roles=MONITORS, summary="Prometheus metrics", tag="meta", answer={"type": "string"}, media=_TEXT
)
async def metrics(s: AppState) -> Response:
    for role, count in s.accounts.active_keys_by_role().items():
        s.metrics.api_keys.labels(role.value).set(count)
    s.fleet.refresh_gauges()
    # The fleet's figures are read here, on the loop; the text (long with a large fleet) is
    # written on a worker thread, so a scrape never stalls the data path.
    fleet = s.fleet.figures()
    body = await trio.to_thread.run_sync(s.metrics.render, fleet)
    return Response(body, status=200, content_type=METRICS_CONTENT_TYPE)


# Shapes only, no state: SDK generators fetch it keyless.
@route("GET", "/api/v1/openapi.json", roles=None, summary="This OpenAPI document", tag="meta", answer=_ANY_OBJECT)
async def openapi_document(s: AppState) -> Response:
    if not s.openapi:
        raise Unavailable("no OpenAPI document was built")
    return Response(s.openapi, status=200, content_type="application/json")
