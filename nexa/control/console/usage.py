"""Requests: usage of the last day by tenant and model, and the request charts' series."""

from __future__ import annotations

from typing import Any, Final

from quart import Blueprint

from nexa.control.console.charts import RequestCharts
from nexa.control.console.pages import Console, Context, View
from nexa.control.console.sessions import Session

#: The usage table covers this many seconds back.
USAGE_SPAN_S: Final = 86400.0


def register(bp: Blueprint, console: Console, charts: RequestCharts) -> None:
    meter = console.state.meter

    async def context(session: Session, now: float) -> Context:
        report = await meter.usage(since=now - USAGE_SPAN_S, until=now + 1)
        return {"usage": report.rows, "summary": charts.summary(60)}

    console.add_view(bp, View("requests", "Requests", ("GET", "/api/v1/usage"), context))

    @bp.get("/console/requests/series")
    @console.handler
    async def series() -> Any:
        session = console.signed_in()
        console.view_allowed(session, "requests")
        return charts.series()
