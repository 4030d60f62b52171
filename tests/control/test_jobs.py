"""Jobs (`nexa.control.operations.jobs`) through the real API: client jobs created, updated, refused once
finished, listed with filters and pages; a backup recorded as a `backup` job; a canary rollout as
a `rollout` job that finishes. The staleness rule runs on a store with a clock the test moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa import security
from nexa.config import BackupConfig, StoreConfig
from nexa.contracts.domain import SYSTEM
from nexa.contracts.evidence import JobCreate, JobKind, JobState, JobUpdate
from nexa.control import store as st
from nexa.control.operations.jobs import STALE_AFTER_S, Jobs
from nexa.telemetry import Metrics
from tests.conftest import Controller, local_config, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, make_key, ok, wait_for
from tests.support.models import audit_events
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401
from tests.support.rollout import canary_running, fleet_of, two_versions, until, view

Json = dict[str, Any]


async def test_client_jobs_are_created_updated_refused_once_finished_and_listed(controller: Controller) -> None:
    operator = await make_key(controller, "operator")
    async with controller.client(operator) as http:
        bench = await ok(http.post("/api/v1/jobs", json={"kind": "benchmark", "title": "bench concurrency 1..8"}), 201)
        sim = await ok(http.post("/api/v1/jobs", json={"kind": "sim", "title": "sim seed 7"}), 201)
        assert bench["state"] == "running" and bench["progress"] is None and bench["finished_at"] is None
        assert bench["id"].startswith("job_") and bench["kind"] == "benchmark"

        moved = await ok(http.post(f"/api/v1/jobs/{bench['id']}", json={"progress": 0.5, "summary": "c=4"}))
        assert moved["state"] == "running" and moved["progress"] == 0.5 and moved["summary"] == "c=4"
        done = await ok(http.post(f"/api/v1/jobs/{sim['id']}", json={"state": "succeeded", "summary": "8/8 passed"}))
        assert done["state"] == "succeeded" and done["progress"] == 1.0 and done["finished_at"] is not None
        assert_envelope(await http.post(f"/api/v1/jobs/{sim['id']}", json={"progress": 0.1}), 409, "conflict")
        assert (await ok(http.get(f"/api/v1/jobs/{sim['id']}"))) == done

        # Bad bodies and kinds: a typed 400 that changes nothing.
        for bad in (
            {"kind": "backup", "title": "mine"},
            {"kind": "rollout", "title": "mine"},
            {"kind": "benchmark", "title": ""},
            {"kind": "benchmark", "title": "x\ny"},
            {"kind": "nope", "title": "t"},
            {"kind": "sim", "title": "t", "extra": 1},
        ):
            assert_envelope(await http.post("/api/v1/jobs", json=bad), 400, "invalid_request")
        for bad_update in ({"progress": 1.5}, {"link": "https://elsewhere/"}, {"summary": "x" * 501}, {"state": "x"}):
            resp = await http.post(f"/api/v1/jobs/{bench['id']}", json=bad_update)
            assert_envelope(resp, 400, "invalid_request")
        assert (await ok(http.get(f"/api/v1/jobs/{bench['id']}"))) == moved
        assert_envelope(await http.get("/api/v1/jobs/job_0000000000000000"), 404, "not_found")
        assert_envelope(await http.post("/api/v1/jobs/job_0000000000000000", json={}), 404, "not_found")

        listed = await ok(http.get("/api/v1/jobs"))
        assert [j["id"] for j in listed["jobs"]] == [sim["id"], bench["id"]]  # newest first
        assert [j["id"] for j in (await ok(http.get("/api/v1/jobs", params={"kind": "sim"})))["jobs"]] == [sim["id"]]
        running = await ok(http.get("/api/v1/jobs", params={"state": "running"}))
        assert [j["id"] for j in running["jobs"]] == [bench["id"]]
        first = await ok(http.get("/api/v1/jobs", params={"limit": 1}))
        assert [j["id"] for j in first["jobs"]] == [sim["id"]] and first["next_cursor"]
        rest = await ok(http.get("/api/v1/jobs", params={"limit": 1, "cursor": first["next_cursor"]}))
        assert [j["id"] for j in rest["jobs"]] == [bench["id"]] and rest["next_cursor"] is None
        assert_envelope(await http.get("/api/v1/jobs", params={"kind": "nope"}), 400, "invalid_request")
        assert_envelope(await http.get("/api/v1/jobs", params={"cursor": "bogus"}), 400, "invalid_request")

    async with controller.client() as admin:
        created = [e for e in await audit_events(admin) if e["action"] == "job.create"]
        assert sorted(e["target"] for e in created) == sorted([f"job/{bench['id']}", f"job/{sim['id']}"])
        assert all(e["actor_role"] == "operator" for e in created)
    monitoring = await make_key(controller, "monitoring")
    async with controller.client(monitoring) as http:
        assert_envelope(await http.get("/api/v1/jobs"), 403, "forbidden")


async def test_a_running_client_job_with_no_update_for_ten_minutes_is_failed(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    now = [1_000_000.0]
    async with st.open_store(tmp_path, store_cfg, inline=True) as store:
        jobs = Jobs(store, Metrics(), clock=lambda: now[0])
        stale = await jobs.create(SYSTEM, JobCreate(kind=JobKind.SIM, title="sim seed 1"))
        fresh = await jobs.create(SYSTEM, JobCreate(kind=JobKind.BENCHMARK, title="bench"))
        backup = await jobs.record(JobKind.BACKUP, "backup")
        now[0] += STALE_AFTER_S - 1
        await jobs.update(SYSTEM, fresh.id, JobUpdate(progress=0.2))
        assert (await jobs.get(stale.id)).state is JobState.RUNNING
        now[0] += 2
        failed = await jobs.get(stale.id)
        assert failed.state is JobState.FAILED and failed.summary == "no update for 10 min"
        assert failed.finished_at == now[0]
        assert (await jobs.get(fresh.id)).state is JobState.RUNNING
        assert (await jobs.get(backup)).state is JobState.RUNNING  # the controller's own jobs are not stale
        [listed] = (await jobs.page(JobKind.SIM, None, None, 10))[0]
        assert listed == failed
    async with st.open_store(tmp_path, store_cfg, inline=True) as store:  # stored so, not only shown so
        assert (await store.run(st.get_job, stale.id)) == failed


async def test_each_backup_is_recorded_as_a_backup_job(nursery: trio.Nursery, tmp_path: Path) -> None:
    key_file = tmp_path / "backup.key"
    security.write_key_file(key_file, security.new_backup_key().encode(), private=True)
    cfg = attrs.evolve(local_config(tmp_path), backup=BackupConfig(key_file=str(key_file)))
    c = await start_controller(nursery, cfg)
    async with c.client() as http:
        made = await ok(http.post("/api/v1/backups"), 201)
        [job] = (await ok(http.get("/api/v1/jobs", params={"kind": "backup"})))["jobs"]
        assert job["state"] == "succeeded" and job["progress"] == 1.0 and job["title"] == "backup"
        assert job["link"] == f"/api/v1/backups/{made['name']}" and made["name"] in job["summary"]
        assert not [e for e in await audit_events(http) if e["action"] == "job.create"]
    c.stopping.set()


async def test_a_backup_left_running_by_a_stopped_controller_is_failed_when_it_starts_again(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    cfg = local_config(tmp_path)
    async with st.open_store(Path(cfg.state_dir), inline=True) as store:  # what a killed process left
        jobs = Jobs(store, Metrics())
        backup = await jobs.record(JobKind.BACKUP, "backup")
        sim = await jobs.create(SYSTEM, JobCreate(kind=JobKind.SIM, title="sim seed 1"))
    c = await start_controller(nursery, cfg)
    async with c.client() as http:
        left = await ok(http.get(f"/api/v1/jobs/{backup}"))
        assert left["state"] == "failed" and left["finished_at"] is not None
        assert "the controller stopped during the backup" in left["summary"] and "nexa backup" in left["summary"]
        # A client's job is its client's to finish (or the staleness rule's); rollouts carry on.
        assert (await ok(http.get(f"/api/v1/jobs/{sim.id}")))["state"] == "running"
    c.stopping.set()


async def test_a_backup_refused_for_want_of_a_key_records_no_job(controller: Controller) -> None:
    async with controller.client() as http:
        assert_envelope(await http.post("/api/v1/backups"), 409, "backup_not_configured")
        assert (await ok(http.get("/api/v1/jobs")))["jobs"] == []


@pytest.mark.slow
async def test_a_canary_rollout_is_a_rollout_job_that_finishes(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2", "n3")
    async with dep_reg.client() as http:
        await two_versions(http, s3_store, test_images)
        await canary_running(http, fleet)

        async def rollout_jobs() -> list[Json]:
            return list((await ok(http.get("/api/v1/jobs", params={"kind": "rollout"})))["jobs"])

        [job] = await rollout_jobs()
        assert job["state"] == "running" and job["progress"] == 0.25
        assert job["title"] == "rollout chat-a: canary tiny@v2 beside tiny@v1"
        await ok(http.post("/api/v1/deployments/chat-a/promote"))
        [promoted] = await rollout_jobs()
        assert promoted["id"] == job["id"] and promoted["state"] == "running" and promoted["progress"] >= 0.5
        # Controller jobs take no client update.
        assert_envelope(await http.post(f"/api/v1/jobs/{job['id']}", json={"progress": 0.9}), 400, "invalid_request")

        async def all_ready() -> bool:
            v = await view(http)
            fleet.ready(*v["deployment"]["placed"])
            return v["deployment"]["rollout"] is None

        await wait_for(all_ready, timeout_s=60)
        await until(http, lambda v: v["deployment"]["rollout"] is None)

        async def finished() -> bool:
            return (await rollout_jobs())[0]["state"] == "succeeded"

        await wait_for(finished, timeout_s=60)
        [done] = await rollout_jobs()
        assert done["id"] == job["id"] and done["progress"] == 1.0 and done["finished_at"] is not None

        # A new canary, rolled back: its job fails.
        await ok(http.post("/api/v1/deployments/chat-a/canary", json={**_canary_v1(), "replicas": 1}), 201)
        await ok(http.post("/api/v1/deployments/chat-a/rollback"))
        newest = (await rollout_jobs())[0]
        assert newest["id"] != job["id"] and newest["state"] == "failed" and "rolled back" in newest["summary"]


def _canary_v1() -> Json:
    return {"model": {"model": "tiny", "version": "v1"}, "weight": 0.2}
