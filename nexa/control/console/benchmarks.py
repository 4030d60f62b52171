"""Benchmarks: the recorded runs of `nexa bench`, newest first and paged (`?deployment=&cursor=`), and
one run's page: its figures step by step, its curves as charts, and what broke the objectives.

Mirrors `GET /api/v1/benchmarks` and `GET /api/v1/benchmarks/<run_id>` (their roles decide who may
see it). Everything in a run came from a client: the templates escape it, and the chart data
travels in a data attribute as JSON (no inline script).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from quart import Blueprint, request

from nexa.contracts import pages
from nexa.contracts.evidence import BenchPoint, BenchRun, Percentiles
from nexa.control.console.pages import Console, Context, Refused, View
from nexa.control.console.sessions import Session

#: Runs on one page of the list.
PAGE_SIZE: Final = 50
#: The list's cursor: the API's (`Benchmarks.page` continues after a run's sort key).
CURSOR_KIND: Final = "benchmarks"
CURSOR_SHAPE: Final = (float, str)
#: The most characters of a deployment filter kept (deployment names are shorter).
_MAX_FILTER: Final = 128

_LATENCY: Final = (("TTFT", "ttft_ms"), ("e2e", "e2e_ms"))
_THROUGHPUT: Final = (("requests/s", "requests_per_s", "req/s"), ("tokens/s", "tokens_per_s", "tok/s"))


def register(bp: Blueprint, console: Console) -> None:
    state = console.state

    async def context(session: Session, now: float) -> Context:
        deployment = (request.args.get("deployment") or "").strip()[:_MAX_FILTER] or None
        cursor = request.args.get("cursor")
        after = None if cursor is None else pages.decode_cursor(CURSOR_KIND, cursor, CURSOR_SHAPE)
        runs: list[BenchRun] = []
        last = None
        if state.benchmarks is not None:
            runs, last = await state.benchmarks.page(deployment, after, PAGE_SIZE)
        return {
            "runs": runs,
            "deployment": deployment or "",
            "next_cursor": None if last is None else pages.encode_cursor(CURSOR_KIND, last),
        }

    console.add_view(bp, View("benchmarks", "Benchmarks", ("GET", "/api/v1/benchmarks"), context))

    @bp.get("/console/benchmarks/<run_id>")
    @console.handler
    async def run_page(run_id: str) -> Any:
        session = console.signed_in()
        console.view_allowed(session, "benchmarks")
        if state.benchmarks is None:
            raise Refused(404, "this controller records no benchmarks")
        run = await state.benchmarks.get(run_id)
        return await console.page(
            session,
            "benchmarks",
            "benchmark.html",
            title=f"Benchmark {run.id}",
            b=run,
            points=ordered(run.run.points),
            charts=curves(run.run.points),
        )


def ordered(points: Sequence[BenchPoint]) -> list[BenchPoint]:
    """The steps as the figures table lists them: by concurrency, then by offered rate."""
    return sorted(points, key=lambda p: (p.concurrency or 0, p.rate_rps or 0.0))


def curves(points: Sequence[BenchPoint]) -> list[dict[str, object]]:
    """The run's charts, as the page hands them to uPlot (`data-chart`): latency and throughput against
    concurrency (closed-loop steps) and against the offered rate (open-loop steps). A chart is left
    out when no step has its x; a series is None where a step had no figure of it."""
    charts: list[dict[str, object]] = []
    axes: tuple[tuple[str, str, Callable[[BenchPoint], float | None]], ...] = (
        ("concurrency", "concurrency", lambda p: p.concurrency),
        ("rate", "offered rate (req/s)", lambda p: p.rate_rps),
    )
    for key, x_label, x_of in axes:
        steps = _rising([(x, p) for p in points if (x := x_of(p)) is not None])
        if not steps:
            continue
        xs = [float(x) for x, _ in steps]
        latency = [
            {"label": f"{name} {q}", "unit": "ms", "values": [_pct(getattr(p, field), q) for _, p in steps]}
            for name, field in _LATENCY
            for q in ("p50", "p95", "p99")
        ]
        throughput = [
            {"label": label, "unit": unit, "values": [float(getattr(p, field)) for _, p in steps]}
            for label, field, unit in _THROUGHPUT
        ]
        charts.append(
            {
                "id": f"latency-{key}",
                "title": f"Latency against {x_label} (ms)",
                "x_label": x_label,
                "x": xs,
                "series": latency,
            }
        )
        charts.append(
            {
                "id": f"throughput-{key}",
                "title": f"Throughput against {x_label}",
                "x_label": x_label,
                "x": xs,
                "series": throughput,
            }
        )
    return charts


def _rising(steps: list[tuple[float, BenchPoint]]) -> list[tuple[float, BenchPoint]]:
    """The steps by x; uPlot's x must rise, so of two at the same x (a client may send them) the first is kept."""
    out: list[tuple[float, BenchPoint]] = []
    for x, p in sorted(steps, key=lambda step: step[0]):
        if not out or x > out[-1][0]:
            out.append((x, p))
    return out


def _pct(p: Percentiles, q: str) -> float | None:
    value: float | None = getattr(p, q)
    return value
