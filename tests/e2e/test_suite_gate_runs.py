"""A rollout's suite gate the controller runs itself (`control.operations.suitegate`), end to end:
two real `nexa node` agents running `sim` runtimes taught the suite's answers, one replica with
room for a second, clients sending steadily through the official `openai` SDK the whole time, and
no operator running `nexa eval run`. Then a controller killed during its run, started again.

An image whose runtime answers right rolls through: once its replica soaked, the controller runs
the suite against the new replicas alone, as the gate's tenant (`--suite-tenant evals`, metered
as that tenant's), records it as the version's measured evaluation (visible through `nexa eval
runs` and the API, marked `rollout`, recorded by the controller) in an `eval` job, and the replica
passes. An image whose runtime answers wrong (the sim runtime's `wrong`, for that image alone) is
reverted after its first replica by the controller's failing run, audited with its pass rates; no
client request fails. A gate naming a tenant or a suite that does not exist, or a controller's
gate naming no tenant, is refused and changes nothing.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.conftest import Controller, ControllerProcess, free_port
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, ok
from tests.support.cluster import SimCluster, sim_cluster, sim_fleet
from tests.support.cluster import wait_until as _wait_until
from tests.support.evals import slow_gated_canary
from tests.support.models import registry_config, registry_config_file
from tests.support.rollout import audit
from tests.support.watched import (
    rolled_to_one,
    rollout_status,
    send_steadily,
    suite_gate_stage,
    suite_revert,
    view,
)

pytestmark = pytest.mark.slow

Json = dict[str, Any]
TIMEOUT_S = 120
CLIENTS = 2


async def wait_until(what: str, check: Any) -> Any:
    """`cluster.wait_until` with this module's longer bound (its own is 40 s)."""
    return await _wait_until(what, check, timeout_s=TIMEOUT_S)


async def get(cluster: SimCluster, path: str, **params: Any) -> Json:
    async with cluster.client() as http:
        return await ok(http.get(path, params=params))


async def test_the_controller_runs_the_gate_itself_passing_a_right_image_and_reverting_a_wrong_one(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=2) as cluster:
        generation = (await suite_gate_stage(cluster, test_images, "gate"))["deployment"]["generation"]
        async with cluster.client() as http:
            await ok(http.post("/api/v1/tenants", json={"id": "evals"}), 201)

        # Bad gates are typed refusals that change nothing.
        async with cluster.client() as http:

            async def refused(gate: Json, status: int, code: str) -> str:
                policy = {"soak_s": 1, "suite": gate}
                answer = await http.post(
                    "/api/v1/deployments/chat-a/change", json={"runtime": "sim-good", "rollout_policy": policy}
                )
                return str(assert_envelope(answer, status, code)["message"])

            nobody = await refused({"suite": "qa", "tenant": "nobody"}, 404, "not_found")
            assert "no tenant nobody" in nobody and "nexa tenants create nobody" in nobody
            assert "no suite nope" in await refused({"suite": "nope", "tenant": "evals"}, 404, "not_found")
            untold = await refused({"suite": "qa"}, 400, "invalid_request")
            assert "rollout_policy.suite.tenant: the tenant the controller runs the suite as" in untold
        cli = await cluster.cli(
            "deployments", "change", "chat-a", "--runtime", "sim-good", "--suite", "qa", "--suite-tenant", "nobody"
        )
        assert cli.returncode != 0 and "no tenant nobody" in cli.stderr
        alone = await cluster.cli("deployments", "change", "chat-a", "--runtime", "sim-good", "--suite-tenant", "evals")
        assert alone.returncode != 0 and "--suite-tenant goes with --suite SUITE" in alone.stderr
        assert (await view(cluster))["deployment"]["generation"] == generation
        assert (await get(cluster, "/api/v1/eval/runs"))["runs"] == []

        stop = trio.Event()
        outcomes: list[list[str]] = [[] for _ in range(CLIENTS)]
        async with trio.open_nursery() as clients:
            for mine in outcomes:
                clients.start_soon(trio.to_thread.run_sync, send_steadily, cluster, stop, mine)
            try:
                # The right image: the controller's own run passes its replica; nobody runs `nexa eval run`.
                # A longer soak: the status below is read while the rollout still holds the replica.
                gate = ("--suite", "qa", "--suite-tenant", "evals", "--soak-s", "4")
                changed = await cluster.cli("deployments", "change", "chat-a", "--runtime", "sim-good", *gate)
                assert changed.returncode == 0, changed.stderr
                shown = await cluster.cli("deployments", "rollout", "status", "chat-a")
                assert shown.returncode == 0, shown.stderr
                said = "suite qa (every pass rate >= 1): the controller runs it as tenant evals"
                assert said in shown.stdout, shown.stdout
                status = await rollout_status(cluster)
                assert status["rollout"]["policy"]["suite"] == {
                    "suite": "qa",
                    "min_pass_rate": 1.0,
                    "run_by": "controller",
                    "tenant": "evals",
                }
                await wait_until("the right image on the replica", lambda: rolled_to_one(cluster, "sim-good"))
                [run] = (await get(cluster, "/api/v1/eval/runs"))["runs"]
                assert run["passed"] and run["deployment"] == "chat-a" and run["recorded_by"] is None
                assert run["run"]["rollout"] and run["run"]["model"] == "nexa-eval-rollout.chat-a"
                assert {s["pass_rate"] for s in run["summaries"]} == {1.0}
                model = await get(cluster, "/api/v1/models/tiny/v1")
                [measured] = [e for e in model["evaluations"] if e["measured"]]
                assert (
                    measured["rollout"] and measured["run"] == run["id"] and measured["suite_digest"] == run["digest"]
                )
                listed = await cluster.cli("eval", "runs", "--suite", "qa")
                assert listed.returncode == 0 and run["id"] in listed.stdout
                async with cluster.client() as http:
                    watched = [e["detail"] for e in await audit(http, "deployment.rollout.watch")]
                    waited = [d for d in watched if " suite: " in d]
                    assert waited and "the controller runs it as tenant evals" in waited[0], watched
                    assert any(" passed: " in d and f"run {run['id']} passed" in d for d in watched), watched
                    [recorded] = await audit(http, "eval.run.record")
                    assert recorded["actor_key_id"] is None  # the controller itself
                    [begun] = await audit(http, "eval.gate.run")
                    assert begun["actor_key_id"] is None and "as tenant evals" in begun["detail"]
                jobs = (await get(cluster, "/api/v1/jobs", kind="eval"))["jobs"]
                [job] = [j for j in jobs if j["state"] == "succeeded"]
                assert "by the controller as tenant evals" in job["title"] and job["link"].endswith(run["id"])
                # Its calls went through the gateway as tenant evals: metered as that tenant's.
                usage = (await get(cluster, "/api/v1/usage", tenant="evals"))["rows"]
                assert sum(r["requests"] for r in usage) >= len(run["run"]["cases"]), usage

                # The wrong image: its replica soaks unbroken (its answers are not errors), the
                # controller's run fails every case, and the rollout reverts.
                changed = await cluster.cli("deployments", "change", "chat-a", "--runtime", "sim-wrong")
                assert changed.returncode == 0, changed.stderr
                revert = await suite_revert(cluster, timeout_s=TIMEOUT_S)
            finally:
                stop.set()
        runs = (await get(cluster, "/api/v1/eval/runs"))["runs"]
        failed = [r for r in runs if not r["passed"]]
        assert len(runs) == 2 and len(failed) == 1 and failed[0]["id"] in revert["detail"]
        async with cluster.client() as http:
            metrics = (await http.get("/metrics")).text
            assert 'nexa_rollout_reverts_total{deployment="chat-a"} 1.0' in metrics
        every = [o for mine in outcomes for o in mine]
        assert every and all(mine for mine in outcomes)
        assert [o for o in every if o != "ok"] == []  # no client request failed


async def test_a_controller_killed_during_its_run_runs_it_again_once_restarted_and_records_it_once(
    tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    """`nexa control` as a process, SIGKILLed while its canary's suite run is in flight (every answer
    slowed), started again on its state: the run left behind is failed as interrupted, the gate run
    again, and exactly one run recorded, which lets the canary be promoted."""
    config = registry_config_file(tmp_path, s3_store)
    # Fixed ports: the restarted controller answers where the nodes dial.
    process = ControllerProcess(state_dir=tmp_path / "state", port=free_port())
    await trio.to_thread.run_sync(functools.partial(process.start, "--config", str(config), timeout_s=60))
    assert process.admin_key is not None
    controller = Controller(process.url, process.admin_key, process.state_dir, trio.Event())
    try:
        async with sim_fleet(controller, tmp_path, s3_store, test_images, nodes=2) as cluster:
            await slow_gated_canary(cluster)  # the controller's run will be in flight a while

            async def eval_jobs() -> list[Json]:
                return list((await get(cluster, "/api/v1/jobs", kind="eval"))["jobs"])

            async def running() -> list[Json]:
                return [j for j in await eval_jobs() if j["state"] == "running"]

            [first] = await wait_until("the controller's run in flight", running)
            await trio.to_thread.run_sync(process.kill)
            await trio.to_thread.run_sync(functools.partial(process.start, "--config", str(config), timeout_s=60))

            async def recorded() -> list[Json]:
                return list((await get(cluster, "/api/v1/eval/runs"))["runs"])

            [run] = await wait_until("the run made again, recorded", recorded)
            assert run["passed"] and run["version"] == "v2" and run["run"]["canary"]
            jobs = {j["id"]: j for j in await eval_jobs()}
            assert jobs[first["id"]]["state"] == "failed"
            assert jobs[first["id"]]["summary"].startswith("interrupted: its controller stopped")
            assert [j["state"] for i, j in jobs.items() if i != first["id"]] == ["succeeded"]
            await trio.sleep(2)  # nothing more is run: the gate has its result
            assert len(await recorded()) == 1 and len(await eval_jobs()) == 2
            async with cluster.client() as http:
                promoted = await ok(http.post("/api/v1/deployments/chat-a/promote"))
            assert promoted["deployment"]["deployment"]["model"] == {"model": "tiny", "version": "v2"}
    finally:
        process.kill()
