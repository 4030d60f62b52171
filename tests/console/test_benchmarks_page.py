"""The console's Benchmarks pages against a real controller with a `nexa node` serving a deployment:
runs recorded through the HTTP API (`POST /api/v1/benchmarks`, as `nexa bench` posts them) list
newest first and paged, a new one shows live, a run's page has its figures and its curves as uPlot
charts in Chromium (the right series on each), what broke the objectives, client text escaped, and
the job a run finished links to it; how the curves are cut from a run's steps, on its own."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from nexa.contracts.evidence import BenchPoint, Percentiles
from nexa.control.console.benchmarks import PAGE_SIZE, curves, ordered
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SimCluster, sim_cluster
from tests.support.console import CHROMIUM, sign_in, signed_in_page
from tests.support.models import registry_config

LIVE_MS = 5000
CLIENT = "<img src=x onerror=alert(1)>"


def _pct(base: float) -> dict[str, float]:
    return {"p50": base, "p95": base * 2, "p99": base * 3}


def _step(c: int | None = None, rate: float | None = None, errors: int = 0) -> dict[str, Any]:
    x = c or rate or 1
    return {
        "concurrency": c,
        "rate_rps": rate,
        "duration_s": 5.0,
        "requests": 100,
        "errors": {"overloaded": errors} if errors else {},
        "ttft_ms": _pct(10.0 * x),
        "tpot_ms": _pct(1.0),
        "e2e_ms": _pct(50.0 * x),
        "overhead_ms": _pct(0.5),
        "tokens_per_s": 80.0 * x,
        "requests_per_s": 2.0 * x,
    }


def _run(kind: str, points: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    body = {
        "deployment": "chat-a",
        "model": "chat",
        "kind": kind,
        "started_at": time.time() - 30,
        "duration_s": 30.0,
        "points": points,
        "seed": 7,
    }
    body.update(over)
    return body


# ---- pure: the curves --------------------------------------------------------------------------------


def _point(**kw: Any) -> BenchPoint:
    return BenchPoint(duration_s=1.0, requests=10, **kw)


def test_a_sweep_gives_latency_and_throughput_against_concurrency_in_rising_order() -> None:
    points = [
        _point(concurrency=4, ttft_ms=Percentiles(p50=4, p95=8), requests_per_s=4.0),
        _point(concurrency=1, ttft_ms=Percentiles(p50=1, p95=2, p99=3), e2e_ms=Percentiles(p99=9)),
        _point(concurrency=4, requests_per_s=99.0),  # the same x twice: the first one stays
    ]
    charts = curves(points)
    assert [c["id"] for c in charts] == ["latency-concurrency", "throughput-concurrency"]
    latency, throughput = charts
    assert latency["x"] == [1.0, 4.0]
    assert [s["label"] for s in latency["series"]] == [  # type: ignore[attr-defined]
        "TTFT p50",
        "TTFT p95",
        "TTFT p99",
        "e2e p50",
        "e2e p95",
        "e2e p99",
    ]
    assert [s["values"] for s in latency["series"]][:3] == [[1, 4], [2, 8], [3, None]]  # type: ignore[attr-defined]
    assert [s["values"] for s in latency["series"]][5] == [9, None]  # type: ignore[attr-defined]
    assert [(s["label"], s["unit"]) for s in throughput["series"]] == [  # type: ignore[attr-defined]
        ("requests/s", "req/s"),
        ("tokens/s", "tok/s"),
    ]
    assert throughput["series"][0]["values"] == [0.0, 4.0]  # type: ignore[index]
    assert [p.concurrency for p in ordered(points)] == [1, 4, 4]


def test_rate_steps_give_curves_against_the_offered_rate_and_no_steps_none() -> None:
    charts = curves([_point(rate_rps=20.0, tokens_per_s=5.0), _point(rate_rps=2.5)])
    assert [c["id"] for c in charts] == ["latency-rate", "throughput-rate"]
    assert charts[1]["x"] == [2.5, 20.0]
    assert charts[1]["series"][1]["values"] == [0.0, 5.0]  # type: ignore[index]
    assert curves([]) == []


# ---- a real controller and node, then Chromium ---------------------------------------------------------


async def _post_run(cluster: SimCluster, body: dict[str, Any]) -> dict[str, Any]:
    async with cluster.client() as api:
        return await ok(api.post("/api/v1/benchmarks", json=body), 201)


def _browse(cluster: SimCluster, ids: dict[str, str], trio_call: Any) -> None:
    from playwright.sync_api import expect

    with signed_in_page(cluster.controller.url, cluster.controller.admin_key) as page:
        page.get_by_role("link", name="Benchmarks").click()
        expect(page.locator("#live")).to_contain_text("No benchmark yet: run nexa bench concurrency --deployment NAME")
        # A run recorded while the page is open shows without a reload.
        sweep = trio_call(
            _post_run,
            cluster,
            _run(
                "concurrency",
                [_step(c=4), _step(c=1), _step(c=8, errors=5), _step(c=2)],
                job=ids["job"],
                client_version=CLIENT,
            ),
        )
        rows = page.locator("#benchmarks-table tbody tr")
        expect(rows).to_have_count(1, timeout=LIVE_MS)
        saturation = trio_call(
            _post_run, cluster, _run("saturation", [_step(rate=10.0), _step(rate=5.0), _step(rate=20.0)])
        )
        expect(rows).to_have_count(2, timeout=LIVE_MS)
        expect(rows.first).to_have_attribute("id", f"run-{saturation['id']}")  # newest first
        row = page.locator(f"#run-{sweep['id']}")
        expect(row).to_contain_text("concurrency")
        expect(row.locator("[data-verdict]")).to_have_text("breaks objectives")
        expect(row.locator("td.num")).to_contain_text("4")

        # The sweep's page: its steps in order, the breach, latency and throughput against concurrency.
        row.get_by_role("link", name=sweep["id"]).click()
        expect(page).to_have_url(re.compile(rf"/console/benchmarks/{sweep['id']}$"))
        steps = page.locator("#points-table tbody th")
        expect(steps).to_have_text(["c=1", "c=2", "c=4", "c=8"])
        expect(page.locator("#broken li")).to_have_text(["c=8: error rate 0.0500 > 0.01"])
        expect(page.locator("#recommended")).to_have_text("4 per replica")
        expect(page.locator("#main")).to_contain_text(f"client {CLIENT}")  # shown as sent, never an element
        assert page.locator("#main img").count() == 0
        for chart, series in (("latency-concurrency", 6), ("throughput-concurrency", 2)):
            expect(page.locator(f"#chart-{chart} canvas")).to_have_count(1)
            expect(page.locator(f"#chart-{chart} .u-legend .u-series")).to_have_count(1 + series)  # + the x axis
        expect(page.locator("#chart-latency-rate")).to_have_count(0)

        # The saturation run's page: throughput against the offered rate.
        page.goto(f"/console/benchmarks/{saturation['id']}")
        expect(page.locator("#points-table tbody th")).to_have_text(["rate 5/s", "rate 10/s", "rate 20/s"])
        expect(page.locator("#chart-throughput-rate .u-legend .u-series")).to_have_count(3)
        expect(page.locator("#chart-throughput-rate canvas")).to_have_count(1)
        expect(page.locator("#chart-latency-concurrency")).to_have_count(0)

        # The job the sweep finished links to the sweep's page.
        page.get_by_role("link", name="Jobs").click()
        job = page.locator(f"#job-{ids['job']}")
        expect(job.locator("[data-state]")).to_have_text("succeeded")  # the run ended; its verdict is its summary
        expect(job.locator(".summary")).to_contain_text("breaks 1")
        job.locator("a.record").click()
        expect(page).to_have_url(re.compile(rf"/console/benchmarks/{sweep['id']}$"))


@pytest.mark.slow
async def test_the_benchmarks_pages(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    assert await trio.Path(CHROMIUM).exists(), "Debian's chromium is required (apt-get install chromium)"
    async with sim_cluster(nursery, tmp_path, registry_config(tmp_path, s3_store), s3_store, test_images, nodes=1) as c:
        await c.deploy("chat-a", replicas=1)
        async with c.client() as api:
            job = await ok(
                api.post("/api/v1/jobs", json={"kind": "benchmark", "title": "bench concurrency chat 1..8"}), 201
            )

        def trio_call(fn: Any, *args: Any) -> Any:
            return trio.from_thread.run(fn, *args)

        await trio.to_thread.run_sync(_browse, c, {"job": job["id"]}, trio_call)

        # HTTP: paging (one page, then the rest), filters, and the refusals that change nothing.
        for _ in range(PAGE_SIZE):
            await _post_run(c, _run("concurrency", [_step(c=1)]))
        async with httpx.AsyncClient(base_url=c.controller.url, timeout=10) as http:
            assert (await sign_in(http, c.controller.admin_key)).status_code == 303
            first = (await http.get("/console/benchmarks")).text
            assert first.count('<tr id="run-') == PAGE_SIZE
            cursor = re.search(r'id="next-page" href="/console/benchmarks\?cursor=([^"&]+)"', first)
            assert cursor, "a full page links to the next"
            rest = (await http.get("/console/benchmarks", params={"cursor": cursor.group(1)})).text
            assert rest.count('<tr id="run-') == 2 and 'id="next-page"' not in rest
            other = (await http.get("/console/benchmarks", params={"deployment": "chat-b"})).text
            assert (
                "No benchmark of deployment chat-b yet: run <code>nexa bench concurrency --deployment chat-b</code>"
                in other
            )
            missing = await http.get("/console/benchmarks/bench_00000000deadbeef")
            assert missing.status_code == 404 and "nexa benchmarks list" in missing.text
            assert (await http.get("/console/benchmarks", params={"cursor": "x"})).status_code == 400
        async with c.client() as api:
            listed = await ok(api.get("/api/v1/benchmarks", params={"limit": 1000}))
        assert len(listed["runs"]) == PAGE_SIZE + 2
