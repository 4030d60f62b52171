"""A suite gate the controller runs itself, across a change of leader (issue 36, points 2 and 3): two
`nexa control` processes on one PostgreSQL database, two real `nexa node` agents running `sim` runtimes
with a channel to each controller, and a canary whose suite gate the controllers run.

The leader starts the gate's measured run (every answer on the canary's node slowed, so it is in
flight a while) and is SIGKILLed. The other controller takes the lease, finds the run the dead leader
left in flight (its job still `running` in the shared store), fails it as interrupted, runs the gate
again itself, and records exactly one run, which lets it promote the canary. Nothing is asked of
an operator, and nothing is run twice after that."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from nexa.control.service import KEYS_DIR
from tests.conftest import Controller, ControllerProcess, free_channel_port, free_port
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import sim_fleet
from tests.support.cluster import wait_until as _wait_until
from tests.support.evals import slow_gated_canary
from tests.support.follow import until_leads
from tests.support.models import registry_config_file
from tests.support.postgres import pg_url_fixture, postgres_fixture  # noqa: F401

pytestmark = pytest.mark.slow

Json = dict[str, Any]
TIMEOUT_S = 120


async def wait_until(what: str, check: Any) -> Any:
    return await _wait_until(what, check, timeout_s=TIMEOUT_S)


def controller(tmp_path: Path, name: str, s3: S3Store, pg_url: str) -> tuple[ControllerProcess, Path]:
    """Controller `name` on `pg_url` (a 2 s lease), and its config file."""
    (tmp_path / name).mkdir()
    process = ControllerProcess(state_dir=tmp_path / name / "state", port=free_port(), channel_port=free_channel_port())
    cluster = (
        f'[store]\nurl = "{pg_url}"\n'
        f'[cluster]\nlease_s = 2.0\nrenew_s = 0.5\nrefresh_s = 0.1\ncontroller_id = "{name}"\n'
        f'address = "{process.url}"\n'
    )
    return process, registry_config_file(tmp_path / name, s3, cluster)


async def test_a_leader_killed_during_its_gate_run_is_followed_by_one_that_runs_it_again_and_records_it_once(
    tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, pg_url: str
) -> None:
    a, a_config = controller(tmp_path, "a", s3_store, pg_url)
    b, b_config = controller(tmp_path, "b", s3_store, pg_url)
    try:
        await trio.to_thread.run_sync(functools.partial(a.start, "--config", str(a_config), timeout_s=60))
        assert a.admin_key is not None
        # Every controller on a store shares the controller keys (copied, as an operator does).
        shutil.copytree(a.state_dir / KEYS_DIR, b.state_dir / KEYS_DIR)
        await trio.to_thread.run_sync(functools.partial(b.start, "--config", str(b_config), timeout_s=60))
        key = a.admin_key
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=a.url, headers=headers, trust_env=False) as http:
            await until_leads(http)
        first = Controller(a.url, key, a.state_dir, trio.Event())
        dials = (f"tcp://127.0.0.1:{a.channel_port}", f"tcp://127.0.0.1:{b.channel_port}")
        async with sim_fleet(first, tmp_path, s3_store, test_images, nodes=2, controllers=dials) as cluster:
            await slow_gated_canary(cluster)  # the controller's run will be in flight a while

            async with httpx.AsyncClient(base_url=b.url, headers=headers, trust_env=False, timeout=30) as second:

                async def eval_jobs(http: httpx.AsyncClient) -> list[Json]:
                    return list((await ok(http.get("/api/v1/jobs", params={"kind": "eval"})))["jobs"])

                async def running() -> list[Json]:
                    async with cluster.client() as http:
                        return [j for j in await eval_jobs(http) if j["state"] == "running"]

                [left] = await wait_until("the leader's run in flight", running)
                await trio.to_thread.run_sync(a.kill)
                with trio.fail_after(TIMEOUT_S):
                    await until_leads(second)

                async def recorded() -> list[Json]:
                    return list((await ok(second.get("/api/v1/eval/runs")))["runs"])

                [run] = await wait_until("the run made again by the new leader, recorded", recorded)
                assert run["passed"] and run["version"] == "v2" and run["run"]["canary"]
                jobs = {j["id"]: j for j in await eval_jobs(second)}
                assert jobs[left["id"]]["state"] == "failed"
                assert jobs[left["id"]]["summary"].startswith("interrupted: its controller stopped")
                assert [j["state"] for i, j in jobs.items() if i != left["id"]] == ["succeeded"]
                await trio.sleep(2)  # nothing more is run: the gate has its result
                assert len(await recorded()) == 1 and len(await eval_jobs(second)) == 2
                promoted = await ok(second.post("/api/v1/deployments/chat-a/promote"))
                assert promoted["deployment"]["deployment"]["model"] == {"model": "tiny", "version": "v2"}
                starts = (await ok(second.get("/api/v1/audit", params={"action": "eval.gate.run"})))["events"]
                assert len(starts) == 2, starts  # the dead leader's start, and the new leader's
    finally:
        a.kill()
        b.kill()
