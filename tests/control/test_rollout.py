"""Canary, promote, rollback and alias-following through the real API: a controller checking a
real OCI registry and S3 store, RawNodes heartbeating real (GB10) inventories over the real
CurveZMQ channel, and every pushed set decoded with the controller's public signing key.

Replicas here ask for 70 GiB of a node's ~119 GiB unified pool, so a node holds one replica: a
rollout that needed a spare node could not proceed. The test decides when a replica is Ready
(the RawNode reports it in its heartbeats), so a rollout's waits can be watched. The automatic
rollback tests replace only the meter's figures (fault injection) in an otherwise real controller.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa.contracts import codec
from nexa.contracts.deployments import CanaryObjective, Deployment
from nexa.contracts.models import ModelRef
from nexa.contracts.usage import WindowStats
from nexa.control import service
from nexa.control.deployments import Deployments
from nexa.control.deployments.records import stamped
from nexa.control.deployments.rollout import RolloutWatcher, WindowSource, breach
from tests.conftest import Controller, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import TIMEOUT_S, assert_envelope, ok, wait_for
from tests.support.models import bring_to, registry_config
from tests.support.rollout import (
    BIG,
    V1,
    V2,
    Watch,
    assert_never_short,
    audit,
    big,
    canary_body,
    canary_running,
    finish_rollout,
    fleet_of,
    two_versions,
    until,
    versions,
    view,
    watch_views,
)

# ---- canary: start and its refusals -------------------------------------------------------------


async def test_a_canary_is_placed_on_extra_replicas_and_refusals_place_nothing(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2", "n3")
    async with dep_reg.client() as http:
        _, v2 = await two_versions(http, s3_store, test_images)
        await bring_to(http, s3_store, "tiny", "v3", "Evaluated")
        await ok(http.post("/api/v1/deployments", json=big()), 201)
        assert versions(await view(http)) == [("n1", "v1"), ("n2", "v1")]

        # The placement's own sets reach n1 and n2 first (pushed after the answer): count from them.
        async def pushed() -> bool:
            return all(fleet.sets[n] for n in ("n1", "n2"))

        await wait_for(pushed)
        generations = {n: len(fleet.sets[n]) for n in fleet.nodes}

        unapproved = {**canary_body(), "model": {"model": "tiny", "version": "v3"}}
        err = assert_envelope(
            await http.post("/api/v1/deployments/chat-a/canary", json=unapproved), 422, "model_not_approved"
        )
        assert "tiny@v3" in str(err["message"])
        expired = {"spdx_id": "Apache-2.0", "accepted_by": "legal", "expires_at": time.time() - 60}
        await ok(http.post("/api/v1/models/tiny/v2/license", json=expired))
        err = assert_envelope(
            await http.post("/api/v1/deployments/chat-a/canary", json=canary_body()), 422, "license_invalid"
        )
        assert "expired" in str(err["message"])
        await ok(http.post("/api/v1/models/tiny/v2/license", json={**expired, "expires_at": None}))
        err = assert_envelope(
            await http.post("/api/v1/deployments/chat-a/canary", json=canary_body(replicas=2)), 422, "unplaceable"
        )
        assert "n1: memory: needs" in str(err["message"])  # only n3 has room, for one
        for bad in (canary_body(weight=1.0), canary_body(weight=0), canary_body(min_requests=0)):
            assert_envelope(await http.post("/api/v1/deployments/chat-a/canary", json=bad), 400, "invalid_request")
        same = {**canary_body(), "model": V1}
        assert_envelope(await http.post("/api/v1/deployments/chat-a/canary", json=same), 409, "conflict")
        assert_envelope(await http.post("/api/v1/deployments/ghost/canary", json=canary_body()), 404, "not_found")
        assert (await view(http))["deployment"]["canary"] is None
        await trio.sleep(0.5)
        assert {n: len(fleet.sets[n]) for n in fleet.nodes} == generations  # nothing pushed

        started = await ok(http.post("/api/v1/deployments/chat-a/canary", json=canary_body(max_p95_ms=800)), 201)
        canary = started["deployment"]["canary"]
        assert canary["model"] == V2 and canary["weight"] == 0.2 and canary["replicas"] == 1
        assert canary["objective"] == {"max_error_rate": 0.05, "max_p95_ms": 800, "window_s": 60, "min_requests": 20}
        [c] = canary["placed"]
        assert c["node_id"] == "n3" and c["model"] == V2
        assert versions(started) == [("n1", "v1"), ("n2", "v1")]  # the deployment's own stay
        again = await http.post("/api/v1/deployments/chat-a/canary", json=canary_body())
        assert_envelope(again, 409, "rollout_in_progress")
        [event] = await audit(http, "deployment.canary.start")
        assert event["target"] == "deployment/chat-a" and "canary tiny@v2" in event["detail"]

    async def canary_pushed() -> bool:
        latest = fleet.latest("n3")
        return latest is not None and [a.id for a in latest.assignments] == [c["id"]]

    await wait_for(canary_pushed)
    latest = fleet.latest("n3")
    assert latest is not None
    [assignment] = latest.assignments
    assert assignment.deployment == "chat-a"
    assert assignment.runtime.artifact is not None and assignment.runtime.artifact.sha256 == v2["artifact"]["sha256"]
    assert assignment.runtime.memory_bytes == BIG


# ---- promote, rollback -------------------------------------------------------------------------


@pytest.mark.slow
async def test_promote_moves_the_alias_keeps_the_canary_and_replaces_one_at_a_time(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2", "n3")
    async with dep_reg.client() as http:
        await two_versions(http, s3_store, test_images)
        before = await canary_running(http, fleet)
        [canary] = before["deployment"]["canary"]["placed"]
        watch = Watch()
        nursery.start_soon(watch_views, dep_reg, "chat-a", watch)

        promoted = await ok(http.post("/api/v1/deployments/chat-a/promote"))
        receipt = promoted["alias"]
        assert (receipt["alias"], receipt["action"], receipt["from"], receipt["to"]) == ("chat", "promote", V1, V2)
        assert (await ok(http.get("/api/v1/aliases/chat")))["alias"]["target"] == V2
        dep = promoted["deployment"]["deployment"]
        assert dep["model"] == V2 and dep["canary"] is None
        assert dep["rollout"]["from"] == V1 and dep["rollout"]["to"] == V2 and dep["rollout"]["reason"] == "promote"
        assert canary["id"] in [r["id"] for r in dep["placed"]]  # the canary's replica is a regular one now

        # One extra replica (the canary) is Ready: the first step only stops an old one. The fleet
        # then has room (the freed node), so the next step starts v2 there first and keeps the last
        # v1 replica serving until the new one is Ready (make before break); then it stops it.
        stepped = await until(http, lambda v: sorted(ver for _, ver in versions(v)) == ["v1", "v2", "v2"])
        assert stepped["deployment"]["rollout"] is not None and stepped["ready"] == 2
        [fresh] = [r for r in stepped["deployment"]["placed"] if r["id"] != canary["id"] and r["model"] == V2]
        await trio.sleep(1.5)  # several reconciler passes: nothing stops before the new one is Ready
        assert sorted(ver for _, ver in versions(await view(http))) == ["v1", "v2", "v2"]
        fleet.ready(fresh)
        done = await until(http, lambda v: v["deployment"]["rollout"] is None)
        assert done["ready"] == 2 and done["deployment"]["previous"] == V1
        assert {r["id"] for r in done["deployment"]["placed"]} == {canary["id"], fresh["id"]}
        steps = await audit(http, "deployment.rollout.step")
        assert [e["detail"].split(":")[0] for e in steps] == ["tiny@v1 -> tiny@v2"] * 3
        assert "started" not in steps[0]["detail"] and "started" not in steps[2]["detail"]
        assert f"started {fresh['id']}" in steps[1]["detail"] and "stays until it is Ready" in steps[1]["detail"]
        assert len(await audit(http, "deployment.rollout.done")) == 1
        assert len(await audit(http, "deployment.promote")) == 1
    assert_never_short(watch, fleet, 2)


@pytest.mark.slow
async def test_rollback_removes_a_canary_then_undoes_a_promotion(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2", "n3")
    async with dep_reg.client() as http:
        await two_versions(http, s3_store, test_images)
        assert_envelope(await http.post("/api/v1/deployments/chat-a/rollback"), 404, "not_found")
        await canary_running(http, fleet)
        rolled = await ok(http.post("/api/v1/deployments/chat-a/rollback"))
        assert rolled["alias"] is None and rolled["deployment"]["deployment"]["canary"] is None
        assert versions(rolled["deployment"]) == [("n1", "v1"), ("n2", "v1")]
        assert (await ok(http.get("/api/v1/aliases/chat")))["alias"]["target"] == V1  # untouched
        [event] = await audit(http, "deployment.canary.rollback")
        assert "canary tiny@v2" in event["detail"] and "n3 generation" in event["detail"]

        async def n3_emptied() -> bool:
            latest = fleet.latest("n3")
            return latest is not None and latest.assignments == []

        await wait_for(n3_emptied)
        assert_envelope(await http.post("/api/v1/deployments/chat-a/promote"), 409, "no_canary")
        assert_envelope(await http.post("/api/v1/deployments/chat-a/rollback"), 409, "nothing_to_roll_back")

        # Promote a new canary, let the rollout finish, then roll the promotion back.
        await ok(http.post("/api/v1/deployments/chat-a/canary", json=canary_body()), 201)
        fleet.ready(*(await view(http))["deployment"]["canary"]["placed"])
        await until(http, lambda v: v["canary_ready"] == 1)
        await ok(http.post("/api/v1/deployments/chat-a/promote"))
        await finish_rollout(http, fleet)
        watch = Watch()
        nursery.start_soon(watch_views, dep_reg, "chat-a", watch)
        back = await ok(http.post("/api/v1/deployments/chat-a/rollback"))
        assert (back["alias"]["action"], back["alias"]["from"], back["alias"]["to"]) == ("rollback", V2, V1)
        assert back["deployment"]["deployment"]["rollout"]["reason"] == "rollback"
        done = await finish_rollout(http, fleet)
        assert [ver for _, ver in versions(done)] == ["v1", "v1"] and done["deployment"]["model"] == V1
        assert (await ok(http.get("/api/v1/aliases/chat")))["alias"]["target"] == V1
        assert len(await audit(http, "deployment.rollback")) == 1
    assert_never_short(watch, fleet, 2)


@pytest.mark.slow
async def test_a_pinned_deployment_promotes_and_rolls_back_without_an_alias(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2", "n3")
    async with dep_reg.client() as http:
        await two_versions(http, s3_store, test_images)
        await canary_running(http, fleet, alias=None, model=V1)
        promoted = await ok(http.post("/api/v1/deployments/chat-a/promote"))
        assert promoted["alias"] is None
        done = await finish_rollout(http, fleet)
        assert done["deployment"]["model"] == V2 and [v for _, v in versions(done)] == ["v2", "v2"]
        assert (await ok(http.get("/api/v1/aliases/chat")))["alias"]["target"] == V1  # not its alias
        back = await ok(http.post("/api/v1/deployments/chat-a/rollback"))
        assert back["alias"] is None and back["deployment"]["deployment"]["model"] == V1
        done = await finish_rollout(http, fleet)
        assert [v for _, v in versions(done)] == ["v1", "v1"] and done["deployment"]["previous"] is None
        assert_envelope(await http.post("/api/v1/deployments/chat-a/rollback"), 409, "nothing_to_roll_back")


# ---- following the alias -----------------------------------------------------------------------


@pytest.mark.slow
async def test_a_deployment_follows_its_alias_one_replica_at_a_time_without_spare_room(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2")  # full: one replica each, no spare node
    async with dep_reg.client() as http:
        await two_versions(http, s3_store, test_images)
        await ok(http.post("/api/v1/deployments", json=big()), 201)
        fleet.ready(*(await view(http))["deployment"]["placed"])
        await until(http, lambda v: v["ready"] == 2)
        watch = Watch()
        nursery.start_soon(watch_views, dep_reg, "chat-a", watch)

        await ok(http.post("/api/v1/aliases/chat/promote", json=V2))
        first = await until(http, lambda v: [ver for _, ver in versions(v)].count("v2") == 1)
        assert first["deployment"]["rollout"]["reason"] == "alias" and first["deployment"]["model"] == V2
        [(node, _)] = [(n, ver) for n, ver in versions(first) if ver == "v2"]
        assert node == "n1"  # in the room the stopped v1 replica freed
        await trio.sleep(1.5)
        assert versions(await view(http)) == versions(first)  # waits for it to be Ready
        done = await finish_rollout(http, fleet)
        assert versions(done) == [("n1", "v2"), ("n2", "v2")]
        [follow] = await audit(http, "deployment.follow")
        assert "alias chat points at tiny@v2" in follow["detail"]

        await ok(http.post("/api/v1/aliases/chat/rollback"))
        await until(http, lambda v: v["deployment"]["model"] == V1)
        done = await finish_rollout(http, fleet)
        assert versions(done) == [("n1", "v1"), ("n2", "v1")]
    assert_never_short(watch, fleet, 2)
    for node_id in ("n1", "n2"):
        # Each swap was one set: the old replica out and the new one in, never both held.
        swaps = [s for s in fleet.sets[node_id] if s.assignments]
        assert all(len(s.assignments) == 1 for s in swaps)


# ---- serving and automatic rollback (only the meter's figures are injected) ---------------------


@attrs.define
class InjectedMeter:
    """A WindowSource whose figures the test sets; records what the watcher asked."""

    stats: WindowStats = attrs.Factory(lambda: WindowStats(requests=0, errors=0, p95_ms=None))
    asked: list[tuple[str, bool | None, float]] = attrs.Factory(list)

    def window(self, deployment: str, *, canary: bool | None, seconds: float, now: float) -> WindowStats:
        self.asked.append((deployment, canary, seconds))
        return self.stats


@attrs.define
class Inside:
    meter: InjectedMeter = attrs.Factory(InjectedMeter)
    deployments: Deployments | None = None


@pytest.fixture
async def injected(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Controller, Inside]]:
    """A real controller whose rollout watcher reads the test's figures (and lets the test see its Deployments)."""
    inside = Inside()

    def watcher(deployments: Deployments, meter: WindowSource, *, interval_s: float = 1.0) -> RolloutWatcher:
        inside.deployments = deployments
        return RolloutWatcher(deployments, inside.meter, interval_s=0.05)

    monkeypatch.setattr(service, "RolloutWatcher", watcher)
    started = await start_controller(nursery, registry_config(tmp_path, s3_store))
    yield started, inside
    started.stopping.set()


async def asked_again(meter: InjectedMeter, times: int = 5) -> None:
    """Wait until the watcher has looked `times` more times."""
    target = len(meter.asked) + times
    with trio.fail_after(TIMEOUT_S):
        while len(meter.asked) < target:  # noqa: ASYNC110 - the watcher runs in this trio run
            await trio.sleep(0.02)


async def test_serving_flags_ready_canary_replicas_and_carries_the_weight(
    injected: tuple[Controller, Inside], dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    c, inside = injected
    assert inside.deployments is not None
    fleet = await fleet_of(c, dial, nursery, "n1", "n2", "n3")
    async with c.client() as http:
        await two_versions(http, s3_store, test_images)
        await ok(http.post("/api/v1/deployments", json=big()), 201)
        await ok(http.post("/api/v1/deployments/chat-a/canary", json=canary_body(weight=0.25)), 201)
        v = await view(http)
        fleet.ready(*v["deployment"]["placed"])
        await until(http, lambda v: v["ready"] == 2)
        v1 = ModelRef(model="tiny", version="v1")
        before = inside.deployments.serving(v1, alias="chat")
        assert before.canary_weight == 0 and not any(r.canary for r in before.replicas)  # canary not Ready yet
        fleet.ready(*v["deployment"]["canary"]["placed"])
        await until(http, lambda v: v["canary_ready"] == 1)
    serving = inside.deployments.serving(v1, alias="chat")
    assert serving.canary_weight == 0.25 and serving.deployments == ["chat-a"]
    [canary] = [r for r in serving.replicas if r.canary]
    assert canary.node_id == "n3" and canary.model == ModelRef(model="tiny", version="v2")
    stable = sorted((r.node_id, r.model.version) for r in serving.replicas if not r.canary)
    assert stable == [("n1", "v1"), ("n2", "v1")]
    pinned = inside.deployments.serving(v1)  # the same deployment asked for by version
    assert len(pinned.replicas) == 3 and pinned.canary_weight == 0.25


async def test_a_canary_breaking_its_objective_is_rolled_back_with_the_figures_audited(
    injected: tuple[Controller, Inside], dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    c, inside = injected
    meter = inside.meter
    fleet = await fleet_of(c, dial, nursery, "n1", "n2", "n3")
    async with c.client() as http:
        await two_versions(http, s3_store, test_images)
        await ok(http.post("/api/v1/deployments", json=big()), 201)
        objective = {"max_error_rate": 0.1, "max_p95_ms": 500, "window_s": 30, "min_requests": 20}
        await ok(http.post("/api/v1/deployments/chat-a/canary", json={**canary_body(), "objective": objective}), 201)

        meter.stats = WindowStats(requests=19, errors=19, p95_ms=9000.0)  # too few requests to tell
        await asked_again(meter)
        meter.stats = WindowStats(requests=100, errors=10, p95_ms=500.0)  # exactly at the limits
        await asked_again(meter)
        assert (await view(http))["deployment"]["canary"] is not None
        assert await audit(http, "deployment.canary.auto_rollback") == []
        assert all(d == "chat-a" and canary is True and 0 < s <= 30 for d, canary, s in meter.asked)

        meter.stats = WindowStats(requests=40, errors=12, p95_ms=812.5)
        rolled = await until(http, lambda v: v["deployment"]["canary"] is None)
        assert versions(rolled) == [("n1", "v1"), ("n2", "v1")]  # the stable replicas stay
        [event] = await audit(http, "deployment.canary.auto_rollback")
    assert event["actor_key_id"] is None and event["result"] == "ok" and event["target"] == "deployment/chat-a"
    detail = event["detail"]
    for figure in (
        "canary tiny@v2",
        "error rate 0.3000 > 0.1",
        "p95 812.5 ms > 500 ms",
        "requests 40",
        "errors 12",
        "max error rate 0.1",
        "max p95 500 ms",
        "window 30 s",
        "min requests 20",
        "n3 generation",
    ):
        assert figure in detail, (figure, detail)

    async def n3_emptied() -> bool:
        latest = fleet.latest("n3")
        return latest is not None and latest.assignments == []

    await wait_for(n3_emptied)


def test_breach_needs_enough_requests_and_a_figure_over_its_limit() -> None:
    objective = CanaryObjective(max_error_rate=0.05, max_p95_ms=None, min_requests=20)
    assert breach(objective, WindowStats(requests=19, errors=19, p95_ms=1e6)) is None
    assert breach(objective, WindowStats(requests=20, errors=1, p95_ms=1e6)) is None  # 0.05, no p95 limit
    assert breach(objective, WindowStats(requests=20, errors=2, p95_ms=None)) == "error rate 0.1000 > 0.05"
    timed = CanaryObjective(max_error_rate=1.0, max_p95_ms=250, min_requests=1)
    assert breach(timed, WindowStats(requests=5, errors=0, p95_ms=250.0)) is None
    assert breach(timed, WindowStats(requests=5, errors=0, p95_ms=251.0)) == "p95 251.0 ms > 250 ms"


async def nexa_cli(c: Controller, *args: str) -> tuple[int, str, str]:
    """`python -m nexa ARGS` against the controller, as an operator runs it."""
    env = {**os.environ, "NEXA_URL": c.url, "NEXA_TOKEN": c.admin_key}
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "nexa", *args], env=env, capture_stdout=True, capture_stderr=True, check=False
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.mark.slow
async def test_the_cli_starts_shows_promotes_and_rolls_back_a_canary(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2", "n3")
    async with dep_reg.client() as http:
        await two_versions(http, s3_store, test_images)
        await ok(http.post("/api/v1/deployments", json=big()), 201)
    canary = ["deployments", "canary", "chat-a", "--model", "tiny", "--version", "v2", "--weight", "0.1"]
    rc, out, err = await nexa_cli(dep_reg, *canary, "--max-p95-ms", "900", "--min-requests", "50")
    assert rc == 0, err
    assert "canary   tiny@v2: 0/1 Ready, weight 0.1" in out and "p95 <= 900 ms" in out and "50 requests" in out
    rc, _, err = await nexa_cli(dep_reg, *canary)
    assert rc == 1 and "rollout_in_progress" in err
    rc, out, err = await nexa_cli(dep_reg, "deployments", "show", "chat-a", "--json")
    assert rc == 0, err
    objective = json.loads(out)["deployment"]["canary"]["objective"]
    assert objective == {"max_error_rate": 0.05, "max_p95_ms": 900, "window_s": 60, "min_requests": 50}

    async with dep_reg.client() as http:
        fleet.ready(*(await view(http))["deployment"]["canary"]["placed"])
        await until(http, lambda v: v["canary_ready"] == 1)
    rc, out, err = await nexa_cli(dep_reg, "deployments", "promote", "chat-a")
    assert rc == 0, err
    assert "rollout  tiny@v1 -> tiny@v2 (promote)" in out
    assert "alias chat: generation 2, tiny@v1 -> tiny@v2 (promote" in out
    async with dep_reg.client() as http:
        await finish_rollout(http, fleet)
    rc, out, err = await nexa_cli(dep_reg, "deployments", "rollback", "chat-a")
    assert rc == 0, err
    assert "rollout  tiny@v2 -> tiny@v1 (rollback)" in out and "(rollback; audit event" in out
    rc, out, err = await nexa_cli(dep_reg, "deployments", "show", "chat-a")
    assert rc == 0 and "tiny:v1" in out


def test_a_deployment_stored_before_rollouts_still_loads() -> None:
    old = {
        "name": "chat-a",
        "runtime": "llama",
        "alias": "chat",
        "model": V1,
        "replicas": 1,
        "resources": {"accelerators": 1, "memory_bytes": None, "cpus": 1.0},
        "options": {"port": 18100, "command": [], "env": {}, "health_command": []},
        "placement": {"policy": "spread", "node_selector": {}, "data_classes": [], "arch": None, "tolerations": []},
        "created_at": 1.0,
        "created_by": None,
        "updated_at": 1.0,
        "generation": 2,
        "placed": [{"id": "chat-a-0001", "node_id": "n1", "gpus": ["nvidia.com/gpu=0"]}],
    }
    dep = codec.loads(codec.store, json.dumps(old), Deployment)
    assert dep.canary is None and dep.rollout is None and dep.previous is None
    assert dep.placed[0].model is None
    assert stamped(dep).placed[0].model == ModelRef(model="tiny", version="v1")  # what it ran
