"""The recovery drill: four `nexa node` agents serve while load runs; the controller's disk "dies".

`nexa backup --out` is taken while the load runs; more changes follow (a scale-down, a new
deployment behind another alias, a cordon, a tenant and its key). The controller is SIGKILLed, its
state directory deleted, `nexa restore` puts the backup on a new directory, and `nexa control`
starts there with the same address and ports. The nodes reconnect without re-enrollment, requests
succeed again, and the recovery plan lists exactly the post-backup changes the fleet shows; the
ones it cannot see (cordon, tenant, key) are gone. The fourth node, down with the controller, comes
back and recovery ends by itself. `nexa audit verify` passes and a receipt from before the backup
verifies offline. The time from the controller's start to its first answered request is printed.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.conftest import Controller, ControllerProcess, free_port
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import MESSAGES, SimCluster, sim_fleet, wait_until
from tests.support.models import registry_config_file

Json = dict[str, Any]


@attrs.define
class Load:
    """Chat completions sent back to back by a few workers; each answer recorded with its times.
    `stopping` ends each worker after its request in flight (one cancelled mid-answer would leave
    its request stream to the garbage collector: a ResourceWarning, an error under the test settings)."""

    url: str
    key: str
    #: (sent, done, status or exception name), monotonic seconds.
    results: list[tuple[float, float, str]] = attrs.Factory(list)
    stopping: bool = False

    async def run(self, workers: int = 2) -> None:
        async with trio.open_nursery() as n:
            for _ in range(workers):
                n.start_soon(self._worker)

    async def _worker(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        body = {"model": "chat", "messages": MESSAGES}
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10) as http:
            while not self.stopping:
                sent = time.monotonic()
                try:
                    resp = await http.post("/v1/chat/completions", json=body)
                    outcome = str(resp.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                self.results.append((sent, time.monotonic(), outcome))
                await trio.sleep(0.02)  # pacing, not synchronisation

    def succeeded(self, *, after: float = 0.0) -> list[tuple[float, float, str]]:
        return [r for r in self.results if r[2] == "200" and r[1] > after]


def _nexa(*args: str) -> subprocess.CompletedProcess[str]:
    """`nexa ARGS` with no controller URL or key: offline commands."""
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "nexa", *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


async def _started(cp: ControllerProcess, config: Path) -> None:
    await trio.to_thread.run_sync(functools.partial(cp.start, "--config", str(config), timeout_s=60))


async def _placed(c: SimCluster, deployment: str) -> dict[str, str]:
    """replica id → node id of every replica the controller placed for `deployment`."""
    async with c.client() as http:
        dep = await ok(http.get(f"/api/v1/deployments/{deployment}"))
    return {r["id"]: r["node_id"] for r in dep["deployment"]["placed"]}


async def _runs(c: SimCluster) -> dict[str, set[str]]:
    """node id → the assignment ids it reports."""
    return {n: {s["assignment_id"] for s in v["assignments"]} for n, v in (await c.node_views()).items()}


@pytest.mark.slow
# A request cut by the SIGKILL strands httpx's request-body generator, which trio finalizes with a
# ResourceWarning (encode/httpx#3686, as in tests/node/test_artifacts.py): httpx's, not nexa's.
@pytest.mark.filterwarnings("ignore:Async generator 'httpx\\.:ResourceWarning")
@pytest.mark.filterwarnings("ignore:Async generator 'httpcore\\.:ResourceWarning")
async def test_the_recovery_drill(tmp_path: Path, s3_store: S3Store, test_images: BuiltImages) -> None:
    backup_key, backup = tmp_path / "backup.key", tmp_path / "drill.nxbk"
    assert _nexa("keygen", "--backup", "--out", str(backup_key)).returncode == 0
    config = registry_config_file(tmp_path, s3_store, f'[backup]\nkey_file = "{backup_key}"\n')
    # Fixed ports: the restored controller answers where the nodes dial.
    first = ControllerProcess(state_dir=tmp_path / "state", port=free_port())
    restored = ControllerProcess(state_dir=tmp_path / "restored", port=first.port, channel_port=first.channel_port)
    await _started(first, config)
    assert first.admin_key is not None
    controller = Controller(first.url, first.admin_key, first.state_dir, trio.Event())
    try:
        async with sim_fleet(controller, tmp_path, s3_store, test_images, nodes=4) as c, trio.open_nursery() as bg:
            await c.deploy("chat-a", replicas=4)
            load = Load(c.controller.url, c.inference_key)
            bg.start_soon(load.run)
            await wait_until("load answered", lambda: _async(len(load.succeeded()) >= 10))

            # Before the backup: a receipted workload, and what the fleet looks like.
            envelope = {
                "version": "nexa.v1",
                "idempotency_key": "drill-1",
                "workload_id": "wl-drill",
                "capability": "chat",
                "model": "chat",
                "payload": {"messages": MESSAGES},
            }
            async with c.client(c.inference_key) as http:
                receipt = (await ok(http.post("/api/v1/workloads", json=envelope)))["receipt"]
            async with c.client() as http:
                receipt_key = (await ok(http.get("/api/v1/receipts/public-key")))["public_key"]
            (tmp_path / "receipt.json").write_text(json.dumps(receipt))
            restored_a = await _placed(c, "chat-a")
            enrolled = {n: v["enrolled_at"] for n, v in (await c.node_views()).items()}
            assert sorted(enrolled) == ["sim-1", "sim-2", "sim-3", "sim-4"]

            taken = await c.cli("backup", "--out", str(backup))
            assert taken.returncode == 0 and "written to" in taken.stdout, taken.stderr

            # After the backup: changes the fleet shows, and changes only the store knew.
            async with c.client() as http:
                await ok(http.post("/api/v1/deployments/chat-a/scale", json={"replicas": 3}))
                await ok(http.post("/api/v1/nodes/sim-4/cordon"))
                await ok(http.post("/api/v1/aliases/later/promote", json={"model": "tiny", "version": "v1"}))
                await ok(http.post("/api/v1/tenants", json={"id": "later"}), 201)
                later_key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "later"}), 201))[
                    "key"
                ]
            await c.deploy("chat-b", replicas=2, alias="later")
            [(removed, removed_on)] = [(r, n) for r, n in restored_a.items() if r not in await _placed(c, "chat-a")]
            made_later = await _placed(c, "chat-b")
            assert "sim-4" not in made_later.values()  # cordoned before chat-b was placed
            await wait_until("the scale-down applied", lambda: _gone(c, removed_on, removed))
            async with c.client(later_key) as http:
                await ok(http.post("/v1/chat/completions", json={"model": "later", "messages": MESSAGES}))

            # The disk dies: SIGKILL, state deleted; the fourth node goes down with it.
            killed_at = time.monotonic()
            first.kill()
            c.nodes[3].kill()
            shutil.rmtree(first.state_dir)
            done = _nexa("restore", str(backup), "--state-dir", str(restored.state_dir), "--key-file", str(backup_key))
            assert done.returncode == 0 and "audit chain ok" in done.stdout, done.stderr

            started_at = time.monotonic()
            await _started(restored, config)
            restored.admin_key = first.admin_key
            await wait_until("serving again", lambda: _async(load.succeeded(after=started_at)))
            serving_at = load.succeeded(after=started_at)[0][1]
            print(f"\nrecovery drill: controller start to serving again: {serving_at - started_at:.2f} s (4 nodes)")

            # The plan: exactly the post-backup changes the three heard nodes show.
            async def recovering_plan() -> Json | None:
                async with c.client() as http:
                    plan: Json = await ok(http.get("/api/v1/recovery/plan"))
                return plan if plan["recovering"] and len(plan["pushes"]) == 3 else None

            plan = await wait_until("a plan with three nodes heard", recovering_plan)
            assert "restored from a backup" in plan["reason"]
            assert (plan["epoch"], plan["next_epoch"]) == (2, 3)
            heard = ["sim-1", "sim-2", "sim-3"]
            assert [(p["node_id"], p["accepted_epoch"], p["epoch"]) for p in plan["pushes"]] == [
                (n, 1, 3) for n in heard
            ]
            starts = {p["node_id"]: p["start"] for p in plan["pushes"]}
            assert starts == {n: [removed] if n == removed_on else [] for n in heard}
            stops = {(s["node_id"], s["assignment_id"], s["deployment"]) for s in plan["stops"]}
            assert stops == {(n, r, "chat-b") for r, n in made_later.items()}
            assert {(r["replica_id"], r["node_id"]) for r in plan["replacements"]} == {
                (r, n) for r, n in restored_a.items() if n == "sim-4"
            }
            assert plan["unheard"] == ["sim-4"]
            # What the fleet cannot show is gone with the lost state: the cordon, the tenant, its key.
            views = await c.node_views()
            assert views["sim-4"]["admin_state"] == "active"
            assert {n: v["enrolled_at"] for n, v in views.items()} == enrolled  # nobody re-enrolled
            async with c.client() as http:
                tenants = (await ok(http.get("/api/v1/tenants")))["tenants"]
                assert "later" not in {t["id"] for t in tenants}
            async with c.client(later_key) as http:
                lost = await http.post("/v1/chat/completions", json={"model": "chat", "messages": MESSAGES})
                assert lost.status_code == 401, lost.text

            # The fourth node comes back: every node has reported, recovery ends by itself.
            c.nodes[3].start()

            async def ended() -> bool:
                async with c.client() as http:
                    return (await ok(http.get("/api/v1/recovery/plan")))["recovering"] is False

            await wait_until("recovery ending by itself", ended)
            finished = await c.cli("audit", "list", "--action", "recovery.finish", "--json")
            [event] = json.loads(finished.stdout)["events"]
            assert event["actor_key_id"] is None and "every node reported" in event["detail"]

            async def restored_fleet() -> bool:
                views, runs = await c.node_views(), await _runs(c)
                return (
                    all(v["acked_epoch"] == 3 and v["ack_reason"] is None for v in views.values())
                    and not set(made_later) & set().union(*runs.values())
                    and set(restored_a) == set(await c.ready_replicas("chat-a"))
                )

            await wait_until("the restored sets accepted at epoch 3", restored_fleet)
            verified = await c.cli("audit", "verify")
            assert verified.returncode == 0, verified.stdout + verified.stderr
            async with c.client() as http:
                assert (await ok(http.get("/api/v1/receipts/public-key")))["public_key"] == receipt_key
            offline = _nexa("receipts", "verify", str(tmp_path / "receipt.json"), "--public-key", receipt_key)
            assert offline.returncode == 0 and "valid" in offline.stdout, offline.stderr
            load.stopping = True

        # The load: no failure but those the controller's absence explains; all good once it served.
        down = [r for r in load.results if r[2] != "200" and r[1] >= killed_at and r[0] < serving_at]
        unexplained = [r for r in load.results if r[2] != "200" and r not in down]
        print(
            f"recovery drill load: {len(load.results)} requests, {len(load.succeeded())} answered,"
            f" {len(down)} failed while the controller was down ({sorted({r[2] for r in down})})"
        )
        assert unexplained == []
        assert load.succeeded(after=serving_at)
    finally:
        first.kill()
        restored.kill()


async def _async(value: Any) -> Any:
    return value


async def _gone(c: SimCluster, node: str, assignment: str) -> bool:
    return assignment not in (await _runs(c))[node]
