"""A new version followed from its alias rolls out under watch (`nexa.control.deployments.watch`):
each new replica soaks before the next old one stops, an operator pauses it, and the rollout's
state (policy, soaks, steps, pause) is in the store: a controller started again on the same state
reports it and carries it on. Nodes are RawNodes (real zmq over loopback) that report Ready on
the test's word; the watch's figures and the revert are end to end in tests/e2e/test_rollout_watch.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.conftest import start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, ok
from tests.support.models import registry_config
from tests.support.rollout import audit, big, fleet_of, two_versions, until, versions, view

pytestmark = pytest.mark.slow

POLICY = {"soak_s": 1.0, "min_requests": 5, "suite": None, "adapter_weight": 0.1}


async def test_an_alias_move_soaks_each_new_replica_and_a_paused_rollout_survives_a_restart(
    nursery: trio.Nursery, dial: Any, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with trio.open_nursery() as first:
        c = await start_controller(first, cfg)
        fleet = await fleet_of(c, dial, nursery, "n1", "n2", "n3")
        async with c.client() as http:
            await two_versions(http, s3_store, test_images)
            created = await ok(http.post("/api/v1/deployments", json=big(rollout_policy=POLICY)), 201)
            assert created["deployment"]["rollout_policy"] == POLICY
            fleet.ready(*created["deployment"]["placed"])
            await until(http, lambda v: v["ready"] == 2)
            generation = (await view(http))["deployment"]["generation"]
            for verb in ("pause", "resume", "undo"):
                refused = await http.post(f"/api/v1/deployments/chat-a/rollout/{verb}")
                assert_envelope(refused, 409, "no_rollout")
            assert (await view(http))["deployment"]["generation"] == generation  # refusals change nothing

            await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "tiny", "version": "v2"}))
            # n3 has room: the first v2 replica starts there while both v1 replicas serve.
            surged = await until(http, lambda v: versions(v) == [("n1", "v1"), ("n2", "v1"), ("n3", "v2")])
            rollout = surged["deployment"]["rollout"]
            assert rollout["reason"] == "alias" and rollout["policy"] == POLICY
            assert rollout["good"]["model"] == {"model": "tiny", "version": "v1"}
            [fresh] = [r for r in surged["deployment"]["placed"] if r["node_id"] == "n3"]
            fleet.ready(fresh)

            async def soaking() -> list[Any]:
                return [e for e in await audit(http, "deployment.rollout.watch") if " soaking: " in e["detail"]]

            await until(http, lambda v: v["ready"] == 3)
            with trio.fail_after(30):
                while not await soaking():  # noqa: ASYNC110 - polling the API
                    await trio.sleep(0.05)
            # Soaking: no old replica stops before the new one passed.
            assert versions(await view(http)) == [("n1", "v1"), ("n2", "v1"), ("n3", "v2")]
            stepped = await until(http, lambda v: sorted(ver for _, ver in versions(v)) == ["v1", "v2"])
            [passed] = [e for e in await audit(http, "deployment.rollout.watch") if " passed: " in e["detail"]]
            [stop] = [e for e in await audit(http, "deployment.rollout.step") if "stopped" in e["detail"]]
            assert passed["seq"] < stop["seq"] and fresh["id"] in passed["detail"]

            paused = await ok(http.post("/api/v1/deployments/chat-a/rollout/pause"))
            assert paused["rollout"]["paused"] is True and paused["new"] == 1
            assert_envelope(await http.post("/api/v1/deployments/chat-a/rollout/pause"), 409, "rollout_paused")
            assert stepped["deployment"]["rollout"] is not None
        c.stopping.set()

    again = await start_controller(nursery, cfg, admin_key=c.admin_key)
    try:
        async with again.client() as http:
            status = await ok(http.get("/api/v1/deployments/chat-a/rollout"))
            rollout = status["rollout"]
            assert rollout["paused"] is True and rollout["reason"] == "alias" and rollout["policy"] == POLICY
            assert [s["replica_id"] for s in rollout["soaks"] if s["passed"]] == [fresh["id"]]
            assert [s["what"] for s in rollout["steps"]][-1] == "paused"
            resumed = await ok(http.post("/api/v1/deployments/chat-a/rollout/resume"))
            assert resumed["rollout"]["paused"] is False
            [event] = await audit(http, "deployment.rollout.resume")
            assert event["actor_key_id"]
            # The policy alone is set at once: nothing rolls out, the running rollout keeps its own.
            before = (await view(http))["deployment"]
            bad = {"rollout_policy": {"soak_s": -1, "min_requests": 0}}
            err = assert_envelope(
                await http.post("/api/v1/deployments/chat-a/change", json=bad), 400, "invalid_request"
            )
            assert "rollout_policy.soak_s" in str(err["message"]) and "rollout_policy.min_requests" in str(
                err["message"]
            )
            assert (await view(http))["deployment"]["generation"] == before["generation"]
            policy = {"soak_s": 60.0, "min_requests": 50, "suite": None, "adapter_weight": 0.1}
            changed = await ok(http.post("/api/v1/deployments/chat-a/change", json={"rollout_policy": policy}))
            assert changed["deployment"]["rollout_policy"] == policy
            assert changed["deployment"]["rollout"]["policy"] == POLICY
            assert len(await audit(http, "deployment.rollout_policy")) == 1
    finally:
        again.stopping.set()
