"""The console's comparison of two evaluation runs, against a real controller with a `nexa node`
serving a deployment: a suite registered and two runs recorded through the HTTP API (as `nexa eval
run` posts them), picked from the newest runs and compared in Chromium (per-metric B - A with its
95% interval, as `nexa eval compare` gives it); bad input answered with a page, and a role that may
not compare runs (audit) refused."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SimCluster, new_key, sim_cluster
from tests.support.console import CHROMIUM, sign_in, signed_in_page
from tests.support.models import registry_config

pytestmark = pytest.mark.slow
Json = dict[str, Any]

#: Three `exact` cases and one `contains` case counted as `format`.
SUITE = [
    {"id": f"q{i}", "request": {"prompt": f"question {i}"}, "scorer": {"kind": "exact", "expected": "yes"}}
    for i in range(3)
] + [{"id": "f", "request": {"prompt": "say ok"}, "scorer": {"kind": "contains", "expected": "ok"}, "metric": "format"}]


def _case(case_id: str, metric: str, passed: bool) -> Json:
    return {"id": case_id, "metric": metric, "score": 1.0 if passed else 0.0, "passed": passed}


async def _record(cluster: SimCluster, digest: str, exact_passes: bool) -> Json:
    body = {
        "suite": "qa", "digest": digest, "deployment": "chat-a", "model": "chat", "started_at": time.time(),
        "duration_s": 1.0, "concurrency": 1,
        "cases": [_case(f"q{i}", "exact", exact_passes) for i in range(3)] + [_case("f", "format", True)],
    }  # fmt: skip
    async with cluster.client() as api:
        return await ok(api.post("/api/v1/eval/runs", json=body), 201)


def _browse(cluster: SimCluster, a: str, b: str) -> None:
    from playwright.sync_api import expect

    with signed_in_page(cluster.controller.url, cluster.controller.admin_key) as page:
        page.goto("/console/evals/compare")
        expect(page.locator("#recent-runs tbody tr")).to_have_count(2)
        expect(page.locator("#recent-runs")).to_contain_text(a)
        page.locator("#run-a").fill(a)
        page.locator("#run-b").fill(b)
        page.locator("#compare-button").click()
        expect(page.locator("#compare-runs")).to_contain_text(f"A: {a}")
        exact = page.locator("#diff-exact")
        expect(exact.locator(".diff")).to_have_text("-1.000")
        expect(exact.locator(".significant")).to_have_text("yes")
        lo, hi = json.loads(exact.locator(".ci").inner_text())
        assert -1.0 <= lo < hi < 0.0
        expect(page.locator("#diff-format .diff")).to_have_text("+0.000")
        expect(page.locator("#diff-format .significant")).to_have_text("no")
        expect(page.locator("#different-suites")).to_have_count(0)
        expect(page.locator(".summary-table")).to_have_count(2)


async def test_two_evaluation_runs_compared_in_the_console(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    assert await trio.Path(CHROMIUM).exists(), "Debian's chromium is required (apt-get install chromium)"
    async with sim_cluster(nursery, tmp_path, registry_config(tmp_path, s3_store), s3_store, test_images, nodes=1) as c:
        await c.deploy("chat-a", replicas=1)
        content = "".join(json.dumps(case) + "\n" for case in SUITE)
        async with c.client() as api:
            suite = await ok(api.post("/api/v1/eval/suites", json={"name": "qa", "content": content}), 201)
        a = await _record(c, suite["digest"], exact_passes=True)
        b = await _record(c, suite["digest"], exact_passes=False)
        # The page shows what the API computes.
        async with c.client() as api:
            computed = await ok(api.get("/api/v1/eval/compare", params={"a": a["id"], "b": b["id"]}))
        exact = next(d for d in computed["metrics"] if d["metric"] == "exact")
        assert exact["pass_rate_diff"] == -1.0

        await trio.to_thread.run_sync(_browse, c, a["id"], b["id"])

        async with httpx.AsyncClient(base_url=c.controller.url, timeout=10) as http:
            assert (await sign_in(http, c.controller.admin_key)).status_code == 303
            ci = "[{:.3f}, {:.3f}]".format(*exact["pass_rate_diff_ci"])
            shown = (await http.get("/console/evals/compare", params={"a": a["id"], "b": b["id"]})).text
            assert ci in shown
            one = await http.get("/console/evals/compare", params={"a": a["id"]})
            assert one.status_code == 400 and "give both runs" in one.text
            missing = await http.get("/console/evals/compare", params={"a": a["id"], "b": "evrun_00000000deadbeef"})
            assert missing.status_code == 404 and "nexa eval runs" in missing.text
        async with httpx.AsyncClient(base_url=c.controller.url, timeout=10) as http:
            assert (await sign_in(http, await new_key(c, "audit"))).status_code == 303
            assert (await http.get("/console/evals/compare")).status_code == 403
