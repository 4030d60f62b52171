"""Benchmark runs (`nexa.control.operations.benchmarks`): the verdict rule (pure), then recorded, listed,
paged and read back through the real API of a controller with a deployment on RawNodes; its
refusals (400 changing nothing, 404), audit rows, and a run finishing the job it names."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import trio

from nexa.contracts.evidence import BenchPoint, Percentiles, ServiceObjectives
from nexa.control.operations.benchmarks import judge
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, make_key, ok
from tests.support.bench import bench_run
from tests.support.deployments import body, registry_ready
from tests.support.models import audit_events
from tests.support.rollout import fleet_of

Json = dict[str, Any]

OBJECTIVES = ServiceObjectives(ttft_p95_ms=500, e2e_p95_ms=2000, max_error_rate=0.01)


def _point(
    c: int | None = None, *, ttft: float = 100, e2e: float = 900, errors: int = 0, rate: float | None = None
) -> BenchPoint:
    return BenchPoint(
        concurrency=c,
        rate_rps=rate,
        duration_s=10,
        requests=1000,
        errors={"overloaded": errors} if errors else {},
        ttft_ms=Percentiles(p50=ttft / 2, p95=ttft, p99=ttft * 1.2),
        e2e_ms=Percentiles(p50=e2e / 2, p95=e2e, p99=e2e * 1.2),
    )


def test_each_set_objective_is_checked_per_step_and_the_concurrency_is_per_replica() -> None:
    points = [_point(1), _point(2), _point(4), _point(8, ttft=499.9), _point(16, ttft=812), _point(32, errors=11)]
    verdict = judge(OBJECTIVES, 2, points)
    assert not verdict.meets_objectives
    assert verdict.broken == ["c=16: ttft p95 812 ms > 500 ms", "c=32: error rate 0.0110 > 0.01"]
    assert verdict.recommended_concurrency == 4  # 8 met everything, over 2 replicas
    assert judge(OBJECTIVES, 16, points[:1]).recommended_concurrency == 1  # at least 1 when any met
    assert judge(OBJECTIVES, 1, [_point(1, ttft=900)]).recommended_concurrency is None
    # The default objectives check the error rate only.
    lenient = judge(ServiceObjectives(), 1, [_point(64, ttft=10_000, e2e=90_000, errors=10)])
    assert lenient.meets_objectives and lenient.recommended_concurrency == 64
    # Rate steps: judged, but they recommend no concurrency.
    rated = judge(OBJECTIVES, 1, [_point(rate=20, e2e=2500), _point(rate=10)])
    assert rated.broken == ["rate 20/s: e2e p95 2500 ms > 2000 ms"] and rated.recommended_concurrency is None


@pytest.mark.slow
async def test_runs_are_judged_kept_listed_and_refused_when_bad(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    await fleet_of(dep_reg, dial, nursery, "n1", "n2")
    operator = await make_key(dep_reg, "operator")
    async with dep_reg.client() as admin:
        await registry_ready(admin, s3_store, test_images)
        await ok(admin.post("/api/v1/deployments", json=body(replicas=2)), 201)
    async with dep_reg.client(operator) as http:
        # No objectives set: only the default error rate is checked; 8 over 2 replicas.
        first = await ok(http.post("/api/v1/benchmarks", json=bench_run()), 201)
        assert first["verdict"] == {"meets_objectives": True, "broken": [], "recommended_concurrency": 4}
        assert first["replicas"] == 2 and first["objectives"]["ttft_p95_ms"] is None
        assert first["recorded_by"] == operator.split("_")[1] and first["run"]["seed"] == 7

        objectives = {"ttft_p95_ms": 500, "tpot_p95_ms": None, "e2e_p95_ms": 1000, "max_error_rate": 0.01}
        shown = await ok(http.post("/api/v1/deployments/chat-a/objectives", json=objectives))
        assert shown["deployment"]["objectives"] == objectives
        assert (await ok(http.get("/api/v1/deployments/chat-a")))["deployment"]["objectives"] == objectives
        second = await ok(http.post("/api/v1/benchmarks", json=bench_run()), 201)
        assert second["verdict"] == {
            "meets_objectives": False,
            "broken": ["c=8: ttft p95 650 ms > 500 ms"],
            "recommended_concurrency": 2,
        }
        assert second["objectives"] == objectives

        listed = await ok(http.get("/api/v1/benchmarks"))
        assert [r["id"] for r in listed["runs"]] == [second["id"], first["id"]]  # newest first
        page1 = await ok(http.get("/api/v1/benchmarks", params={"limit": 1, "deployment": "chat-a"}))
        assert [r["id"] for r in page1["runs"]] == [second["id"]]
        page2 = await ok(http.get("/api/v1/benchmarks", params={"limit": 1, "cursor": page1["next_cursor"]}))
        assert [r["id"] for r in page2["runs"]] == [first["id"]] and page2["next_cursor"] is None
        assert (await ok(http.get("/api/v1/benchmarks", params={"deployment": "other"})))["runs"] == []
        assert await ok(http.get(f"/api/v1/benchmarks/{first['id']}")) == first
        assert_envelope(await http.get("/api/v1/benchmarks/bench_0000000000000000"), 404, "not_found")

        # Refusals: typed, and nothing is kept.
        unknown = await http.post("/api/v1/benchmarks", json=bench_run("ghost"))
        assert "nexa deployments list" in assert_envelope(unknown, 404, "not_found")["message"]  # type: ignore[operator]
        both = {"concurrency": 1, "rate_rps": 2, "duration_s": 1, "requests": 1}
        for bad in (
            {**bench_run(), "kind": "nope"},
            {**bench_run(), "extra": 1},
            {**bench_run(), "points": [both]},
            {**bench_run(), "points": [{"concurrency": 1, "duration_s": 1, "requests": 1, "errors": {"x": 2}}]},
            {**bench_run(), "points": [{"concurrency": 0, "duration_s": 1, "requests": 1}]},
            {**bench_run(), "model": ""},
            {**bench_run(), "job": "../etc"},
            {**bench_run(), "points": [{"concurrency": 1, "duration_s": 1, "requests": 1, "ttft_ms": {"p95": -1}}]},
        ):
            assert_envelope(await http.post("/api/v1/benchmarks", json=bad), 400, "invalid_request")
        bad_objectives = {"ttft_p95_ms": -5}
        resp = await http.post("/api/v1/deployments/chat-a/objectives", json=bad_objectives)
        assert_envelope(resp, 400, "invalid_request")
        assert_envelope(await http.post("/api/v1/deployments/ghost/objectives", json={}), 404, "not_found")
        assert_envelope(await http.get("/api/v1/benchmarks", params={"deployment": "Bad Name"}), 400, "invalid_request")
        assert len((await ok(http.get("/api/v1/benchmarks")))["runs"]) == 2

        # A run that names its job finishes it, linking the run.
        job = await ok(http.post("/api/v1/jobs", json={"kind": "benchmark", "title": "bench chat-a"}), 201)
        assert_envelope(
            await http.post("/api/v1/benchmarks", json=bench_run(job="job_0000000000000000")), 404, "not_found"
        )
        third = await ok(http.post("/api/v1/benchmarks", json=bench_run(job=job["id"])), 201)
        finished = await ok(http.get(f"/api/v1/jobs/{job['id']}"))
        assert finished["state"] == "succeeded" and finished["link"] == f"/api/v1/benchmarks/{third['id']}"
        assert "breaks 1" in finished["summary"] and "recommended concurrency 2" in finished["summary"]
    async with dep_reg.client() as admin:
        recorded = [e for e in await audit_events(admin) if e["action"] == "benchmark.record"]
        assert [e["target"] for e in recorded] == [f"benchmark/{r['id']}" for r in (first, second, third)]
        assert [e["action"] for e in await audit_events(admin) if e["action"] == "deployment.objectives"]
    monitoring = await make_key(dep_reg, "monitoring")
    async with dep_reg.client(monitoring) as http:
        assert_envelope(await http.post("/api/v1/benchmarks", json=bench_run()), 403, "forbidden")


async def _nexa(c: Controller, *args: str) -> str:
    env = {**os.environ, "NEXA_URL": c.url, "NEXA_TOKEN": c.admin_key}
    done = await trio.run_process(
        [sys.executable, "-m", "nexa", *args], capture_stdout=True, capture_stderr=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


@pytest.mark.slow
async def test_the_cli_sets_objectives_on_create_and_update_and_show_shows_them(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    await fleet_of(dep_reg, dial, nursery, "n1")
    async with dep_reg.client() as admin:
        await registry_ready(admin, s3_store, test_images)
    create = ("deployments", "create", "chat-a", "--runtime", "llama", "--alias", "chat", "--accelerators", "1")
    await _nexa(dep_reg, *create, "--slo-ttft-p95-ms", "500", "--slo-max-error-rate", "0.02")
    shown = await _nexa(dep_reg, "deployments", "show", "chat-a")
    assert "slo      ttft p95 500 ms, tpot p95 -, e2e p95 -, max error rate 0.02" in shown
    await _nexa(dep_reg, "deployments", "update", "chat-a", "--slo-e2e-p95-ms", "3000")
    shown = await _nexa(dep_reg, "deployments", "show", "chat-a")
    assert "slo      ttft p95 500 ms, tpot p95 -, e2e p95 3000 ms, max error rate 0.02" in shown
    as_json = json.loads(await _nexa(dep_reg, "deployments", "show", "chat-a", "--json"))
    assert as_json["deployment"]["objectives"] == {
        "ttft_p95_ms": 500,
        "tpot_p95_ms": None,
        "e2e_p95_ms": 3000,
        "max_error_rate": 0.02,
    }
    # `off` stops checking one figure and leaves the others as they were.
    await _nexa(dep_reg, "deployments", "update", "chat-a", "--slo-ttft-p95-ms", "off")
    shown = await _nexa(dep_reg, "deployments", "show", "chat-a")
    assert "slo      ttft p95 -, tpot p95 -, e2e p95 3000 ms, max error rate 0.02" in shown
