"""A controller started on an older state recovers: real `nexa node` processes, controllers in this run.

The state is made older the way an operator would: copied while the controller is stopped, changed
by a later controller, which stops; a controller started on the copy then meets nodes that accepted
sets it never signed. It serves inference on what they report Ready, refuses changes, pushes
nothing, shows its plan; `nexa recovery finish` takes an epoch above theirs and they accept it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa.config import ChannelConfig, HostPort, HttpConfig
from tests.conftest import Controller, free_port, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, ok
from tests.support.cluster import MESSAGES, TIMEOUT_S, SimCluster, sim_cluster, wait_until
from tests.support.models import registry_config

Json = dict[str, Any]


async def stopped(controller: Controller, nursery: trio.Nursery) -> None:
    """Stop the controller running in `nursery` (its only task) and wait until it has let go."""
    controller.stopping.set()
    with trio.fail_after(TIMEOUT_S):
        while nursery.child_tasks:  # noqa: ASYNC110 - waiting for serve_control to return
            await trio.sleep(0.05)


def fence(cluster: SimCluster, i: int) -> tuple[int, int]:
    data = json.loads((cluster.nodes[i].state_dir / "fence.json").read_text())
    return data["epoch"], data["generation"]


@pytest.mark.slow
async def test_a_controller_on_an_older_state_recovers_and_its_new_epoch_is_accepted(
    tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    # Fixed ports: every controller of the test answers where the nodes dial.
    cfg = attrs.evolve(
        registry_config(tmp_path, s3_store),
        http=HttpConfig(listen=HostPort(f"127.0.0.1:{free_port()}")),
        channel=ChannelConfig(listen=f"tcp://127.0.0.1:{free_port()}"),
    )
    state, older = Path(cfg.state_dir), tmp_path / "older-state"
    async with trio.open_nursery() as controllers, sim_cluster(controllers, tmp_path, cfg, s3_store, test_images) as c:
        await c.deploy("chat-a", replicas=2)
        ready = await c.wait_ready("chat-a", 2)
        assert sorted(ready.values()) == ["sim-1", "sim-2"], ready  # one replica on each node

        # The older state: a copy taken while stopped. A later controller then changes things.
        await stopped(c.controller, controllers)
        shutil.copytree(state, older)
        later = await start_controller(controllers, cfg, admin_key=c.controller.admin_key)
        await wait_until("both nodes back", lambda: _all_ready(c))
        async with c.client() as http:
            await ok(http.post("/api/v1/nodes/sim-2/cordon"))
        await c.deploy("chat-b", replicas=1)  # lands on sim-1: made after the copy
        made_later = next(iter(await c.wait_ready("chat-b", 1)))
        accepted = fence(c, 0)
        assert accepted[0] == 2  # the later controller's epoch

        # sim-2 goes away; the controller restarts on the older copy.
        c.nodes[1].kill()
        await stopped(later, controllers)
        restored = await start_controller(
            controllers, attrs.evolve(cfg, state_dir=str(older)), admin_key=c.controller.admin_key
        )
        try:
            # sim-1 reports an epoch this state never signed: recovery, nothing pushed.
            async def recovering_plan() -> Json | None:
                out = await c.cli("recovery", "plan", "--json")
                assert out.returncode == 0, out.stderr
                plan: Json = json.loads(out.stdout)
                return plan if plan["recovering"] and plan["pushes"] else None

            plan = await wait_until("a recovery plan", recovering_plan)
            assert "sim-1" in plan["reason"]
            assert plan["epoch"] == 2 and plan["next_epoch"] == 3
            [push] = plan["pushes"]
            assert (push["node_id"], push["accepted_epoch"], push["accepted_generation"]) == ("sim-1", *accepted)
            assert (push["epoch"], push["start"]) == (3, [])
            assert [(s["node_id"], s["assignment_id"], s["deployment"]) for s in plan["stops"]] == [
                ("sim-1", made_later, "chat-b")
            ]
            assert [r["node_id"] for r in plan["replacements"]] == ["sim-2"]
            assert plan["unheard"] == ["sim-2"]
            table = await c.cli("recovery", "plan")
            assert "recovering:" in table.stdout and made_later in table.stdout and "sim-2" in table.stdout

            async with c.client() as http:
                assert (await ok(http.get("/readyz")))["status"] == "recovering"
                # Inference goes on over the replica sim-1 reports Ready.
                async with c.client(c.inference_key) as inference:
                    body = {"model": "chat", "messages": MESSAGES}
                    answer = await ok(inference.post("/v1/chat/completions", json=body))
                    assert answer["choices"][0]["message"]["content"]
                # Every change is refused, and changes nothing.
                before = await ok(http.get("/api/v1/deployments"))
                refused = await http.post("/api/v1/deployments/chat-a/scale", json={"replicas": 3})
                envelope = assert_envelope(refused, 503, "recovering")
                assert "nexa recovery finish" in str(envelope["message"])
                assert await ok(http.get("/api/v1/deployments")) == before
            cordon = await c.cli("nodes", "cordon", "sim-1")
            assert cordon.returncode != 0 and "recovering" in cordon.stderr
            assert (await c.node_views())["sim-1"]["state"] == "Ready"
            assert fence(c, 0) == accepted  # nothing was pushed

            # Finish: an epoch above the nodes'; sim-1 accepts its restored set and stops chat-b.
            done = await c.cli("recovery", "finish", "--json")
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["epoch"] == 3

            async def sim1_on_3() -> bool:
                n = (await c.node_views())["sim-1"]
                running = {s["assignment_id"] for s in n["assignments"]}
                return n["acked_epoch"] == 3 and n["ack_reason"] is None and made_later not in running

            await wait_until("sim-1 accepting epoch 3", sim1_on_3)
            assert fence(c, 0)[0] == 3
            # sim-2 comes back: an older epoch than the controller's; it accepts its set too.
            c.nodes[1].start()

            async def sim2_on_3() -> bool:
                n = (await c.node_views())["sim-2"]
                return n["state"] == "Ready" and n["acked_epoch"] == 3 and n["ack_reason"] is None

            await wait_until("sim-2 accepting epoch 3", sim2_on_3)
            await c.wait_ready("chat-a", 2)
            async with c.client() as http:
                assert (await ok(http.get("/readyz")))["status"] == "ready"
                assert (await ok(http.get("/api/v1/recovery/plan")))["recovering"] is False
                assert_envelope(await http.post("/api/v1/recovery/finish"), 409, "not_recovering")
                events = (await ok(http.get("/api/v1/audit", params={"limit": 500})))["events"]
                await ok(http.post("/api/v1/nodes/sim-1/cordon"))  # writes are taken again
            actions = [e["action"] for e in events]
            assert "recovery.finish" in actions and "assignments.rejected" not in actions
        finally:
            await stopped(restored, controllers)


async def _all_ready(c: SimCluster) -> bool:
    views = await c.node_views()
    return len(views) == len(c.nodes) and all(n["state"] == "Ready" for n in views.values())
