"""The console's Jobs page against a real controller: jobs made and moved on through the HTTP API
(`POST /api/v1/jobs`, `POST /api/v1/jobs/<id>`) show as rows with their progress bar, update live
in Chromium without a reload, carry client text escaped, link to their records, and are refused to
roles that may not list jobs; what turns a job's link into a console link, on its own."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from nexa.control.console.jobs import Record, record_link
from nexa.control.console.pages import fmt_duration
from tests.conftest import Controller
from tests.support.api import make_key, ok
from tests.support.console import CHROMIUM, sign_in, signed_in_page

#: A change must show without a reload within this many milliseconds (the live views' promise: two ticks, and slack).
LIVE_MS = 5000
SCRIPT_TITLE = '<script>document.title="owned"</script> bench "chat" & co'


# ---- pure: records and durations -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("link", "want"),
    [
        (None, None),
        ("", None),
        (
            "/api/v1/benchmarks/bench_0123abcd",
            Record(href="/console/benchmarks/bench_0123abcd", text="/api/v1/benchmarks/bench_0123abcd"),
        ),
        ("/api/v1/deployments/chat-a", Record(href="/console/deployments/chat-a", text="/api/v1/deployments/chat-a")),
        ("/api/v1/backups/nexa-1700000000.nxb", Record(text="/api/v1/backups/nexa-1700000000.nxb")),
        ("/api/v1/backups", Record(text="/api/v1/backups")),
        (
            "/api/v1/qualifications/qual_0123456789abcdef",
            Record(
                href="/console/models#qualification-qual_0123456789abcdef",
                text="/api/v1/qualifications/qual_0123456789abcdef",
            ),
        ),
        # Anything else stays text: no other path, no scheme, no way out of the segment.
        ("/api/v1/benchmarks/../keys", Record(text="/api/v1/benchmarks/../keys")),
        ("/api/v1/benchmarks/a/b", Record(text="/api/v1/benchmarks/a/b")),
        ("/api/v1/keys", Record(text="/api/v1/keys")),
        ("javascript:alert(1)", Record(text="javascript:alert(1)")),
    ],
)
def test_a_jobs_link_becomes_a_console_link_only_for_known_records(link: str | None, want: Record | None) -> None:
    assert record_link(link) == want


def test_durations_read_at_a_glance() -> None:
    assert [fmt_duration(s) for s in (None, -1, 0.84, 42.4, 200, 7500)] == [
        "—",
        "0.0 s",
        "0.8 s",
        "42 s",
        "3 min 20 s",
        "2 h 05 min",
    ]


# ---- HTTP: a real controller ------------------------------------------------------------------------


async def _job(api: httpx.AsyncClient, kind: str, title: str) -> dict[str, Any]:
    return await ok(api.post("/api/v1/jobs", json={"kind": kind, "title": title}), 201)


async def test_the_jobs_page_lists_jobs_escaped_and_refuses_bad_filters(controller: Controller) -> None:
    async with controller.client() as api:
        empty = None
        async with httpx.AsyncClient(base_url=controller.url, timeout=10) as http:
            assert (await sign_in(http, controller.admin_key)).status_code == 303
            empty = (await http.get("/console/jobs")).text
            assert "No job yet: run <code>nexa bench concurrency --deployment NAME</code>" in empty
            bench = await _job(api, "benchmark", SCRIPT_TITLE)
            sim = await _job(api, "sim", "sim seed 7")
            await ok(
                api.post(f"/api/v1/jobs/{sim['id']}", json={"state": "succeeded", "summary": "8/8 steps <b>pass</b>"})
            )
            page = await http.get("/console/jobs")
            assert page.status_code == 200
            html = page.text
            assert "<script>document.title" not in html and "<b>pass</b>" not in html
            assert "&lt;script&gt;document.title=&#34;owned&#34;&lt;/script&gt;" in html
            assert "8/8 steps &lt;b&gt;pass&lt;/b&gt;" in html
            assert html.index(f'id="job-{sim["id"]}"') < html.index(f'id="job-{bench["id"]}"')  # newest first
            only = (await http.get("/console/jobs", params={"kind": "sim"})).text
            assert f'id="job-{sim["id"]}"' in only and f'id="job-{bench["id"]}"' not in only
            none = (await http.get("/console/jobs", params={"kind": "rollout"})).text
            assert "No rollout job." in none
            for bad in ({"kind": "cron"}, {"state": "done"}, {"cursor": "not-a-cursor"}):
                refused = await http.get("/console/jobs", params=bad)
                assert refused.status_code == 400, bad
                assert "must be one of" in refused.text or "not a cursor of this list" in refused.text
        listed = await ok(api.get("/api/v1/jobs"))
        assert len(listed["jobs"]) == 2  # the refusals changed nothing


async def test_roles_that_may_not_list_jobs_see_no_jobs_or_benchmarks(controller: Controller) -> None:
    audit_key = await make_key(controller, "audit")
    inference_key = await make_key(controller, "inference", tenant="acme")
    async with httpx.AsyncClient(base_url=controller.url, timeout=10) as http:
        refused = await sign_in(http, inference_key)
        assert refused.status_code == 403 and "no console views" in refused.text
        assert (await http.get("/console/jobs")).headers["location"] == "/console/login"
        assert (await http.get("/console/events/jobs")).status_code == 401
    async with httpx.AsyncClient(base_url=controller.url, timeout=10) as http:
        assert (await sign_in(http, audit_key)).status_code == 303
        requests = (await http.get("/console/requests")).text
        assert 'href="/console/jobs"' not in requests and 'href="/console/benchmarks"' not in requests
        for path in ("/console/jobs", "/console/events/jobs", "/console/benchmarks", "/console/benchmarks/bench_0"):
            assert (await http.get(path)).status_code == 403, path


# ---- in Chromium ------------------------------------------------------------------------------------


def _browse(controller: Controller, jobs: dict[str, str], trio_call: Any) -> None:
    from playwright.sync_api import expect

    with signed_in_page(controller.url, controller.admin_key) as page:
        page.get_by_role("link", name="Jobs").click()
        rows = page.locator("#jobs-table tbody tr")
        expect(rows).to_have_count(2)
        bench = page.locator(f"#job-{jobs['bench']}")
        # The client's title is text: shown as sent, never run.
        expect(bench.locator(".job-title")).to_have_text(SCRIPT_TITLE)
        assert page.title() != "owned"
        expect(bench.locator("[data-state]")).to_have_text("running")
        expect(bench.locator("progress")).to_have_attribute("value", "0.25")
        expect(bench.locator(".pct")).to_have_text("25%")
        # Progress reported through the API shows without a reload.
        trio_call(_update, controller, jobs["bench"], {"progress": 0.75, "summary": "c=8 of 1..16"})
        expect(bench.locator(".pct")).to_have_text("75%", timeout=LIVE_MS)
        expect(bench.locator("progress")).to_have_attribute("value", "0.75")
        expect(bench.locator(".summary")).to_have_text("c=8 of 1..16")
        # It finishes with its record: a benchmark run links to its console page.
        trio_call(
            _update,
            controller,
            jobs["bench"],
            {"state": "failed", "summary": "breaks 1", "link": "/api/v1/benchmarks/bench_00000000000000aa"},
        )
        expect(bench.locator("[data-state]")).to_have_text("failed", timeout=LIVE_MS)
        expect(bench.locator("a.record")).to_have_attribute("href", "/console/benchmarks/bench_00000000000000aa")
        sim = page.locator(f"#job-{jobs['sim']}")
        expect(sim.locator("progress")).to_have_count(1)  # running, progress unknown: an indeterminate bar
        expect(sim.locator(".pct")).to_have_count(0)
        page.locator("#jobs-kind-sim").click()
        expect(rows).to_have_count(1)
        expect(rows.first).to_have_attribute("id", f"job-{jobs['sim']}")


async def _update(controller: Controller, job_id: str, body: dict[str, Any]) -> None:
    async with controller.client() as api:
        await ok(api.post(f"/api/v1/jobs/{job_id}", json=body))


@pytest.mark.slow
async def test_the_jobs_page_in_chromium(controller: Controller) -> None:
    assert await trio.Path(CHROMIUM).exists(), "Debian's chromium is required (apt-get install chromium)"
    async with controller.client() as api:
        bench = await _job(api, "benchmark", SCRIPT_TITLE)
        await ok(api.post(f"/api/v1/jobs/{bench['id']}", json={"progress": 0.25}))
        sim = await _job(api, "sim", "sim seed 7")

    def trio_call(fn: Any, *args: Any) -> Any:
        return trio.from_thread.run(fn, *args)

    await trio.to_thread.run_sync(_browse, controller, {"bench": bench["id"], "sim": sim["id"]}, trio_call)
