"""`nexa bench` end to end: the CLI as a subprocess against a controller, real `nexa node` agents on
127.0.0.11 and .12 and their `sim` runtimes; runs and jobs read back through the API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from nexa.contracts import codec
from nexa.contracts.evidence import BenchKind, BenchRun, BenchRunCreate, JobState
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SimCluster, gateway_cluster, new_key, wait_until

pytestmark = pytest.mark.slow
Json = dict[str, Any]


@pytest.fixture
async def cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[SimCluster]:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as c:
        await c.deploy("chat-a", replicas=2)
        yield c


async def bench(cluster: SimCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return await cluster.cli("bench", *args, "--inference-key", cluster.inference_key, "--duration-s", "1")


async def get(cluster: SimCluster, path: str) -> Json:
    async with cluster.client() as http:
        return await ok(http.get(path))


async def test_a_concurrency_sweep_is_recorded_with_a_point_per_step(cluster: SimCluster) -> None:
    done = await bench(cluster, "concurrency", "--deployment", "chat-a", "--concurrency", "1,2,4", "--json")
    assert done.returncode == 0, done.stderr
    run = codec.loads(codec.api, done.stdout, BenchRun)
    assert run.run.kind is BenchKind.CONCURRENCY and run.run.model == "chat" and run.replicas == 2
    assert [p.concurrency for p in run.run.points] == [1, 2, 4]
    for p in run.run.points:
        assert p.requests > 0 and p.errors == {} and p.tokens_per_s > 0 and p.requests_per_s > 0
        assert p.ttft_ms.p50 is not None and p.e2e_ms.p50 is not None and p.ttft_ms.p50 <= p.e2e_ms.p50
        assert p.ttft_ms.p95 is not None and p.e2e_ms.p95 is not None and p.ttft_ms.p95 <= p.e2e_ms.p95
        assert p.tpot_ms.p50 is not None and p.overhead_ms.p50 is not None
    assert run.run.memory_headroom_bytes is not None and run.run.memory_headroom_bytes > 0
    assert run.verdict.meets_objectives and run.verdict.recommended_concurrency == 2  # 4 per 2 replicas
    assert "step 3/3 c=4:" in done.stderr  # not a terminal: a plain line per step

    stored = await get(cluster, f"/api/v1/benchmarks/{run.id}")
    assert codec.api.structure(stored, BenchRun) == run
    job = await get(cluster, f"/api/v1/jobs/{run.run.job}")
    assert job["kind"] == "benchmark" and job["state"] == JobState.SUCCEEDED
    assert job["link"] == f"/api/v1/benchmarks/{run.id}"

    listed = await cluster.cli("benchmarks", "list", "--deployment", "chat-a")
    assert listed.returncode == 0 and run.id in listed.stdout and "meets objectives" in listed.stdout
    shown = await cluster.cli("benchmarks", "show", run.id)
    assert shown.returncode == 0 and "c=4" in shown.stdout
    assert "recommended max concurrency per replica: 2" in shown.stdout
    jobs = await cluster.cli("jobs", "list", "--kind", "benchmark")
    assert jobs.returncode == 0 and run.run.job in jobs.stdout and "succeeded" in jobs.stdout


async def test_saturation_stops_at_the_first_rate_that_breaks_the_objective(cluster: SimCluster) -> None:
    async with cluster.client() as http:
        await ok(http.post("/api/v1/deployments/chat-a/objectives", json={"ttft_p95_ms": 0.001}))
    done = await bench(cluster, "saturation", "--deployment", "chat-a", "--rates", "4,8,16", "--json")
    assert done.returncode == 0, done.stderr
    run = codec.loads(codec.api, done.stdout, BenchRun)
    assert [p.rate_rps for p in run.run.points] == [4.0]  # broke at once: the next rates were not sent
    assert "stopped at rate 4/s: ttft p95" in done.stderr
    assert not run.verdict.meets_objectives and run.verdict.recommended_concurrency is None
    assert any("ttft p95" in line for line in run.verdict.broken)

    plain = await bench(cluster, "saturation", "--deployment", "chat-a", "--rates", "4")
    assert plain.returncode == 0, plain.stderr
    assert "does not meet its objectives" in plain.stdout and "ttft p95" in plain.stdout


async def test_errors_are_counted_by_code_and_no_record_posts_nothing(cluster: SimCluster) -> None:
    for node in cluster.nodes:
        node.set_faults(fail="after", after_tokens=1)  # every stream breaks after its first token
    jobs_before = (await get(cluster, "/api/v1/jobs"))["jobs"]
    done = await bench(cluster, "concurrency", "--deployment", "chat-a", "--concurrency", "2", "--no-record", "--json")
    assert done.returncode == 0, done.stderr
    create = codec.loads(codec.api, done.stdout, BenchRunCreate)
    [p] = create.points
    assert p.requests > 0 and sum(p.errors.values()) == p.requests
    assert set(p.errors) and not set(p.errors) & {"transport", "timeout", "error"}  # the envelope's codes
    assert create.job is None
    assert (await get(cluster, "/api/v1/benchmarks"))["runs"] == []
    assert (await get(cluster, "/api/v1/jobs"))["jobs"] == jobs_before


async def test_cold_start_times_a_copy_and_deletes_it(cluster: SimCluster) -> None:
    done = await cluster.cli(
        "bench", "cold-start", "--deployment", "chat-a", "--inference-key", cluster.inference_key, "--json"
    )
    assert done.returncode == 0, done.stderr
    run = codec.loads(codec.api, done.stdout, BenchRun)
    ready_s, first_s = run.run.cold_start_ready_s, run.run.cold_start_first_token_s
    assert ready_s is not None and first_s is not None and 0 < ready_s <= first_s
    assert "chat-a-bench-cold-1" in done.stderr
    names = [d["deployment"]["name"] for d in (await get(cluster, "/api/v1/deployments"))["deployments"]]
    assert names == ["chat-a"]

    # The original's replicas may report a moment not Ready while their node takes the set without the copy.
    await cluster.wait_ready("chat-a", 2)
    other = await new_key(cluster, "inference", "beta")  # mixed: a second tenant
    argv = ["mixed", "--deployment", "chat-a", "--concurrency", "3", "--no-record", "--json", "--seed", "7"]
    mixed = await bench(cluster, *argv, "--inference-key", other)
    assert mixed.returncode == 0, mixed.stderr
    [p] = codec.loads(codec.api, mixed.stdout, BenchRunCreate).points
    assert p.requests >= 3 and p.errors == {} and p.ttft_ms.p50 is not None and p.tokens_per_s > 0
    tenants = {row["tenant"] for row in (await get(cluster, "/api/v1/usage"))["rows"]}
    assert {"acme", "beta"} <= tenants


async def test_bad_input_says_what_to_do_and_ctrl_c_cancels_the_job(cluster: SimCluster) -> None:
    unknown = await bench(cluster, "concurrency", "--deployment", "nope", "--concurrency", "1")
    assert unknown.returncode == 1 and "no deployment 'nope'" in unknown.stderr
    assert "Traceback" not in unknown.stderr and len(unknown.stderr.splitlines()) == 1
    bad = await bench(cluster, "concurrency", "--deployment", "chat-a", "--concurrency", "1,x")
    assert bad.returncode == 2 and "--concurrency" in bad.stderr
    wrong = await bench(cluster, "saturation", "--deployment", "chat-a", "--concurrency", "1")
    assert wrong.returncode == 2 and "--rates" in wrong.stderr
    nokey = await cluster.cli("bench", "concurrency", "--deployment", "chat-a")
    assert nokey.returncode == 2 and "NEXA_INFERENCE_KEY" in nokey.stderr
    assert (await get(cluster, "/api/v1/benchmarks"))["runs"] == []

    env = {**os.environ, "NEXA_URL": cluster.controller.url, "NEXA_TOKEN": cluster.controller.admin_key}
    env["NEXA_INFERENCE_KEY"] = cluster.inference_key
    argv = [sys.executable, "-m", "nexa", "bench", "long-stream", "--deployment", "chat-a", "--duration-s", "120"]
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; waited for in a thread below
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:

        async def running() -> str | None:
            items = (await get(cluster, "/api/v1/jobs?kind=benchmark&state=running"))["jobs"]
            return str(items[0]["id"]) if items else None

        job_id = await wait_until("the benchmark job", running)
        proc.send_signal(signal.SIGINT)
        _, err = await trio.to_thread.run_sync(lambda: proc.communicate(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "job is marked cancelled" in err
    job = await get(cluster, f"/api/v1/jobs/{job_id}")
    assert job["state"] == JobState.CANCELLED
    assert (await get(cluster, "/api/v1/benchmarks"))["runs"] == []
