"""Every change rolled out under watch, end to end: four real `nexa node` agents running `sim`
runtimes, with no spare room (each node fits one replica), clients sending steadily through the
official `openai` SDK the whole time.

A new runtime image that works rolls through replica by replica: each new replica soaks (a
short `soak_s` here) before the next old one is stopped. A bad image (its runtime fails every
request before any output, by the sim runtime's faults file, `images`) is reverted after its
first replica: the revert is audited with the figures, counted, and its rollout job failed. So is
one whose runtime answers slowly (the faults' `slow_ms`), by the deployment's latency objectives.

"No request failed that had not started" is exact here: the bad runtime answers every request
with an error before its first byte, so every attempt it gets is retried on another replica by
the gateway (before any output, `nexa.control.datapath.gateway`); a request may fail only once
output of it reached the client. None does, so every request the clients sent is answered.

Then the operator's hand through the CLI: pause, status, resume, undo, and the typed refusals
(pausing twice, resuming a running rollout, undoing where none runs, a change that changes nothing).

A rollout policy with a suite gate (`rollout_policy.suite`), one replica with room for a second:
each new replica (started beside the old one, which keeps serving) that soaked its time waits for
a measured run of the suite against the new replicas alone (`nexa eval run --rollout`, as an
operator runs it; a run against the whole deployment does not count); an image whose runtime
answers right passes and rolls through, one whose runtime answers wrong (the sim runtime's `wrong`,
for that image alone) fails every case of the run and is reverted, audited with its pass rates.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, ok
from tests.support.cluster import SIM_ARGS, SimCluster, free_runtime_port, node_host, sim_cluster
from tests.support.cluster import wait_until as _wait_until
from tests.support.console import csrf, sign_in
from tests.support.models import registry_config
from tests.support.oci import push_index
from tests.support.rollout import audit
from tests.support.watched import (
    BAD_PLATFORMS,
    GOOD_PLATFORMS,
    register,
    rolled_to_one,
    rollout_status,
    send_steadily,
    suite_gate_stage,
    suite_revert,
    view,
    waits_for_suite,
)

pytestmark = pytest.mark.slow

Json = dict[str, Any]
POLICY = {"soak_s": 2.0, "min_requests": 5}
CLIENTS = 4
TIMEOUT_S = 120


async def wait_until(what: str, check: Any) -> Any:
    """`cluster.wait_until` with this module's longer bound (its own is 40 s)."""
    return await _wait_until(what, check, timeout_s=TIMEOUT_S)


async def deploy_full(cluster: SimCluster, *, policy: Json = POLICY, objectives: Json | None = None) -> None:
    """Four replicas of alias `chat`, each reserving more than half a node's memory: no spare room."""
    async with cluster.client() as http:
        nodes = (await ok(http.get("/api/v1/nodes")))["nodes"]
        total = min(n["inventory"]["memory_total_bytes"] for n in nodes)
        port = free_runtime_port([node_host(i) for i in range(1, len(cluster.nodes) + 1)])
        body = {
            "name": "chat-a",
            "runtime": "sim",
            "alias": "chat",
            "replicas": 4,
            "resources": {"accelerators": 0, "memory_bytes": int(total * 0.55), "cpus": 0.5},
            "options": {"port": port, "command": SIM_ARGS},
            "rollout_policy": policy,
            **({"objectives": objectives} if objectives else {}),
        }
        await ok(http.post("/api/v1/deployments", json=body), 201)
        surge = {**body, "name": "probe", "replicas": 1}
        placed = await ok(http.post("/api/v1/capacity/forecast", json=surge))
        assert placed["feasible"] is False  # not one more replica fits anywhere
    await cluster.wait_ready("chat-a", 4)


async def rolled_to(cluster: SimCluster, runtime: str) -> bool:
    """The rollout ended with every replica of the spec `runtime` names, each Ready."""
    v = await view(cluster)
    dep = v["deployment"]
    return dep["rollout"] is None and dep["runtime"] == runtime and v["ready"] == 4


async def change(cluster: SimCluster, runtime: str) -> None:
    async with cluster.client() as http:
        await ok(http.post("/api/v1/deployments/chat-a/change", json={"runtime": runtime}))


async def test_a_new_image_rolls_replica_by_replica_and_a_bad_one_is_reverted_after_its_first(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=4) as cluster:
        host = test_images.busybox.partition("/")[0]
        good = await trio.to_thread.run_sync(push_index, host, "nexa-test/rollout-good", GOOD_PLATFORMS)
        bad = await trio.to_thread.run_sync(push_index, host, "nexa-test/rollout-bad", BAD_PLATFORMS)
        await register(cluster, "sim-good", good)
        await register(cluster, "sim-bad", bad)
        for node in cluster.nodes:
            node.set_faults(images={bad.partition("@")[2]: {"fail": "before", "status": 500}})
        await deploy_full(cluster)

        stop = trio.Event()
        outcomes: list[list[str]] = [[] for _ in range(CLIENTS)]
        async with trio.open_nursery() as clients:
            for mine in outcomes:
                clients.start_soon(trio.to_thread.run_sync, send_steadily, cluster, stop, mine)
            try:
                # The good image: one replica at a time, each soaking before the next is replaced.
                await change(cluster, "sim-good")
                await wait_until("the good image on every replica", lambda: rolled_to(cluster, "sim-good"))
                async with cluster.client() as http:
                    steps = await audit(http, "deployment.rollout.step")
                    watched = await audit(http, "deployment.rollout.watch")
                started = [e for e in steps if "started" in e["detail"]]
                assert len(started) == 4, [e["detail"] for e in steps]
                assert all("stopped" in e["detail"] for e in started)  # no room: stop one, start its replacement
                passed = [e for e in watched if " passed: " in e["detail"]]
                assert len(passed) == 4, [e["detail"] for e in watched]
                # Each replacement after the first waited for the one before it to pass its soak.
                for before, after in itertools.pairwise(started):
                    assert any(before["seq"] < p["seq"] < after["seq"] for p in passed)

                # The bad image: its first replica breaks the error-rate objective and is reverted.
                await change(cluster, "sim-bad")
                async with cluster.client() as http:

                    async def reverted() -> list[Json]:
                        return await audit(http, "deployment.rollout.revert")

                    [revert] = await wait_until("the bad image reverted", reverted)
                    assert "broke the objectives (error rate" in revert["detail"]
                    assert "back to runtime sim-good" in revert["detail"]
                    assert revert["actor_key_id"] is None  # the controller itself
                await wait_until("the good image back everywhere", lambda: rolled_to(cluster, "sim-good"))
                # Started more attempts meanwhile: the clients kept sending through the revert.
                await trio.sleep(0.5)
            finally:
                stop.set()
        async with cluster.client() as http:
            bad_steps = [e for e in await audit(http, "deployment.rollout.step") if e["seq"] > started[-1]["seq"]]
            bad_started = [e for e in bad_steps if e["seq"] < revert["seq"] and "started" in e["detail"]]
            assert len(bad_started) == 1, [e["detail"] for e in bad_steps]
            metrics = (await http.get("/metrics")).text
            assert 'nexa_rollout_reverts_total{deployment="chat-a"} 1.0' in metrics
            jobs = (await ok(http.get("/api/v1/jobs", params={"kind": "rollout"})))["jobs"]
            assert any(j["state"] == "failed" and "reverted" in j["summary"] for j in jobs), jobs
            status = await ok(http.get("/api/v1/deployments/chat-a/rollout"))
            assert status["rollout"] is None and status["runtime"] == "sim-good"
        every = [o for mine in outcomes for o in mine]
        assert len(every) > 50 and all(mine for mine in outcomes)
        assert [o for o in every if o != "ok"] == []

        # The operator's hand, through the CLI; a long soak keeps the rollout going meanwhile.
        changed = await cluster.cli("deployments", "change", "chat-a", "--runtime", "sim", "--soak-s", "600")
        assert changed.returncode == 0, changed.stderr
        assert "rolling out under watch" in changed.stdout
        async with cluster.client() as http:
            other = {"runtime": "sim-good", "rollout_policy": {"soak_s": 1, "min_requests": 5}}
            refused = await http.post("/api/v1/deployments/chat-a/change", json=other)
            assert_envelope(refused, 409, "rollout_in_progress")
        paused = await cluster.cli("deployments", "rollout", "pause", "chat-a")
        assert paused.returncode == 0, paused.stderr
        assert "paused (change)" in paused.stdout
        again = await cluster.cli("deployments", "rollout", "pause", "chat-a")
        assert again.returncode != 0 and "paused already" in again.stderr
        shown = await cluster.cli("deployments", "rollout", "status", "chat-a")
        assert shown.returncode == 0 and "each new replica soaks 600 s" in shown.stdout and " paused " in shown.stdout
        # The console's deployment page shows it, and resumes it behind its confirmation page.
        async with httpx.AsyncClient(base_url=cluster.controller.url, timeout=10) as browser:
            assert (await sign_in(browser, cluster.controller.admin_key)).status_code == 303
            page = (await browser.get("/console/deployments/chat-a")).text
            assert "Paused (change)" in page and 'id="rollout-steps"' in page and ">paused<" in page
            assert "/console/deployments/chat-a/rollout_resume" in page
            confirm = await browser.get("/console/deployments/chat-a/rollout_resume")
            assert confirm.status_code == 200 and "goes on" in confirm.text
            form = {"csrf_token": csrf(confirm.text), "confirm": "deployment chat-a"}
            acted = await browser.post("/console/deployments/chat-a/rollout_resume", data=form)
            assert acted.status_code in (200, 303), acted.text
        status = await cluster.cli("deployments", "rollout", "status", "chat-a")
        assert status.returncode == 0 and "rolling (change)" in status.stdout and "resumed" in status.stdout
        repaused = await cluster.cli("deployments", "rollout", "pause", "chat-a")
        assert repaused.returncode == 0, repaused.stderr
        resumed = await cluster.cli("deployments", "rollout", "resume", "chat-a")
        assert resumed.returncode == 0 and "rolling (change)" in resumed.stdout
        twice = await cluster.cli("deployments", "rollout", "resume", "chat-a")
        assert twice.returncode != 0 and "is not paused" in twice.stderr
        undone = await cluster.cli("deployments", "rollout", "undo", "chat-a")
        assert undone.returncode == 0, undone.stderr
        assert "(undo)" in undone.stdout and "runtime sim-good" in undone.stdout
        await wait_until("the undo to end", lambda: rolled_to(cluster, "sim-good"))
        none = await cluster.cli("deployments", "rollout", "undo", "chat-a")
        assert none.returncode != 0 and "no rollout in progress" in none.stderr
        async with cluster.client() as http:
            assert_envelope(await http.post("/api/v1/deployments/chat-a/rollout/pause"), 409, "no_rollout")
            nothing = await http.post("/api/v1/deployments/chat-a/change", json={"runtime": "sim-good"})
            assert_envelope(nothing, 400, "invalid_request")
            [undo] = await audit(http, "deployment.rollout.undo")
            assert undo["actor_key_id"]
            assert len(await audit(http, "deployment.rollout.revert")) == 1  # nothing more was reverted


async def test_an_image_that_answers_slowly_is_reverted_by_the_latency_objectives(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=4) as cluster:
        host = test_images.busybox.partition("/")[0]
        slow = await trio.to_thread.run_sync(push_index, host, "nexa-test/rollout-slow", BAD_PLATFORMS)
        await register(cluster, "sim-slow", slow)
        for node in cluster.nodes:
            node.set_faults(images={slow.partition("@")[2]: {"slow_ms": 1500}})
        # A long enough soak for the slow replica to finish its few requests; they decide from 3 on.
        policy = {"soak_s": 8.0, "min_requests": 3}
        await deploy_full(cluster, policy=policy, objectives={"ttft_p95_ms": 750, "e2e_p95_ms": 750})

        stop = trio.Event()
        outcomes: list[list[str]] = [[] for _ in range(CLIENTS)]
        async with trio.open_nursery() as clients:
            for mine in outcomes:
                clients.start_soon(trio.to_thread.run_sync, send_steadily, cluster, stop, mine)
            try:
                await change(cluster, "sim-slow")
                async with cluster.client() as http:

                    async def reverted() -> list[Json]:
                        return await audit(http, "deployment.rollout.revert")

                    [revert] = await wait_until("the slow image reverted", reverted)
                assert "broke the objectives (" in revert["detail"] and " p95 " in revert["detail"], revert
                assert "error rate" not in revert["detail"].partition(")")[0]  # its answers were not errors
                assert "back to runtime sim" in revert["detail"]
                await wait_until("the first image back everywhere", lambda: rolled_to(cluster, "sim"))
            finally:
                stop.set()
        every = [o for mine in outcomes for o in mine]
        assert every and all(o == "ok" for o in every), [o for o in every if o != "ok"][:5]


async def test_a_suite_gate_lets_a_right_image_through_and_reverts_one_that_answers_wrong(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=2) as cluster:
        generation = (await suite_gate_stage(cluster, test_images, "suite"))["deployment"]["generation"]

        # Bad gates are typed refusals that change nothing.
        async with cluster.client() as http:
            gate = {"suite": "nope", "run_by": "operator"}
            unknown = {"runtime": "sim-good", "rollout_policy": {"soak_s": 1, "suite": gate}}
            err = assert_envelope(await http.post("/api/v1/deployments/chat-a/change", json=unknown), 404, "not_found")
            assert "no suite nope" in str(err["message"])
            rate = {"runtime": "sim-good", "rollout_policy": {"suite": {"suite": "qa", "min_pass_rate": 1.5}}}
            err = assert_envelope(
                await http.post("/api/v1/deployments/chat-a/change", json=rate), 400, "invalid_request"
            )
            assert "rollout_policy.suite.min_pass_rate: from 0 to 1" in str(err["message"])
        refused = await cluster.cli(
            "deployments", "change", "chat-a", "--runtime", "sim-good", "--suite", "nope", "--suite-run-by", "operator"
        )
        assert refused.returncode != 0 and "no suite nope" in refused.stderr
        assert (await view(cluster))["deployment"]["generation"] == generation

        # The right image: its replica soaks, waits for the suite, and passes once a run passes.
        changed = await cluster.cli(
            "deployments", "change", "chat-a", "--runtime", "sim-good", "--suite", "qa", "--suite-run-by", "operator"
        )
        assert changed.returncode == 0, changed.stderr
        status = await wait_until("the new replica waits for its suite", lambda: waits_for_suite(cluster))
        command = "nexa eval run qa --deployment chat-a --rollout --min-pass-rate 1"
        assert status["rollout"]["policy"]["suite"] == {
            "suite": "qa",
            "min_pass_rate": 1.0,
            "run_by": "operator",
            "tenant": None,
        }
        assert command in status["suite"] and "soaked unbroken and wait" in status["suite"]
        shown = await cluster.cli("deployments", "rollout", "status", "chat-a")
        assert shown.returncode == 0 and "suite    replica(s) " in shown.stdout and command in shown.stdout
        assert "waits for its suite" in shown.stdout
        async with httpx.AsyncClient(base_url=cluster.controller.url, timeout=10) as browser:
            assert (await sign_in(browser, cluster.controller.admin_key)).status_code == 303
            page = (await browser.get("/console/deployments/chat-a")).text
            assert 'id="rollout-suite"' in page and "wait for suite qa" in page
        surged = await view(cluster)  # surge-first: the old replica serves beside the new one
        assert surged["ready"] == 2 and len({r["node_id"] for r in surged["deployment"]["placed"]}) == 2
        # Held: a run against the whole deployment (the old replica too) passes, but does not count.
        whole = await cluster.cli(
            "eval", "run", "qa", "--deployment", "chat-a", "--inference-key", cluster.inference_key
        )
        assert whole.returncode == 0, whole.stdout + whole.stderr
        await trio.sleep(2)
        assert (await rollout_status(cluster))["rollout"]["reason"] == "change"
        assert not any(s["passed"] for s in (await rollout_status(cluster))["rollout"]["soaks"])
        passed_run = await suite_run(cluster, "--rollout")
        assert passed_run.returncode == 0, passed_run.stdout + passed_run.stderr
        await wait_until("the right image on the replica", lambda: rolled_to_one(cluster, "sim-good"))
        async with cluster.client() as http:
            watched = [e["detail"] for e in await audit(http, "deployment.rollout.watch")]
            assert any(" suite: " in d and "no measured run yet" in d for d in watched), watched
            assert any(" passed: " in d and "suite qa with every pass rate >= 1: run evrun_" in d for d in watched)
            assert await audit(http, "deployment.rollout.revert") == []

        # The wrong image: its replica soaks unbroken (its answers are not errors), the run fails, it reverts.
        changed = await cluster.cli("deployments", "change", "chat-a", "--runtime", "sim-wrong")
        assert changed.returncode == 0, changed.stderr
        await wait_until("the wrong replica waits for its suite", lambda: waits_for_suite(cluster))
        failed_run = await cluster.cli(
            "eval",
            "run",
            "qa",
            "--deployment",
            "chat-a",
            "--rollout",
            "--json",
            "--inference-key",
            cluster.inference_key,
        )
        assert failed_run.returncode == 1, failed_run.stdout + failed_run.stderr
        # Every case went to the new (wrong) replica alone: the old one beside it answers right.
        assert all(s["pass_rate"] == 0.0 for s in json.loads(failed_run.stdout)["summaries"]), failed_run.stdout
        await suite_revert(cluster, timeout_s=TIMEOUT_S)
        async with cluster.client() as http:
            metrics = (await http.get("/metrics")).text
            assert 'nexa_rollout_reverts_total{deployment="chat-a"} 1.0' in metrics
            jobs = (await ok(http.get("/api/v1/jobs", params={"kind": "rollout"})))["jobs"]
            assert any(j["state"] == "failed" and "reverted" in j["summary"] for j in jobs), jobs
        # The gate is off with --no-suite: the policy alone, nothing rolls out.
        off = await cluster.cli("deployments", "change", "chat-a", "--no-suite")
        assert off.returncode == 0, off.stderr
        dep = (await view(cluster))["deployment"]
        assert dep["rollout"] is None and dep["rollout_policy"]["suite"] is None


async def suite_run(cluster: SimCluster, *flags: str) -> subprocess.CompletedProcess[str]:
    """`nexa eval run qa --deployment chat-a FLAGS`, as an operator runs it."""
    return await cluster.cli(
        "eval", "run", "qa", "--deployment", "chat-a", *flags, "--inference-key", cluster.inference_key
    )
