"""Controller key rotation against a real controller and a real `nexa node` process (issue 17, point 6).

`nexa keys rotate-controller` under inference load: no request fails; the node pins the new key
(announced signed with the old one) and keeps it across a restart, and the sets the controller
now signs with the new key are accepted; a receipt from before the rotation still verifies,
online and offline (`nexa receipts verify`, picked by key id), and not against the new key alone;
the retired key stays on disk (0600). A caller who is not admin is refused and nothing changes.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from nexa.control.fleet import keyring
from nexa.node import identity
from tests.conftest import ControllerProcess
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, make_key, node_view, ok, wait_for
from tests.support.cluster import SimCluster, chat_until, sim_cluster
from tests.support.models import audit_events, registry_config

TIMEOUT_S = 60


def _nexa(cluster: SimCluster, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NEXA_URL": cluster.controller.url, "NEXA_TOKEN": cluster.controller.admin_key}
    return subprocess.run(
        [sys.executable, "-m", "nexa", *argv], capture_output=True, text=True, timeout=120, check=False, env=env
    )


async def _receipt(cluster: SimCluster) -> dict[str, Any]:
    body = {
        "version": "nexa.v1",
        "idempotency_key": "before-rotation",
        "workload_id": "wl-before",
        "capability": "completion",
        "model": "chat",
        "payload": {"prompt": "hello"},
    }
    async with cluster.client(cluster.inference_key) as http:
        done = await ok(http.post("/api/v1/workloads", json=body))
    receipt: dict[str, Any] = done["receipt"]
    return receipt


@pytest.mark.slow
async def test_the_controller_rotates_its_keys_under_load_and_old_receipts_still_verify(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1) as cluster:
        await cluster.deploy("chat-a", replicas=1)
        node = cluster.nodes[0]
        receipt = await _receipt(cluster)
        old_id = receipt["key_id"]
        async with cluster.client() as http:
            before = await ok(http.get("/api/v1/receipts/public-key"))
            assert before["key_id"] == old_id
            operator = await make_key(cluster.controller, "operator")
            async with cluster.client(operator) as op:
                assert_envelope(await op.post("/api/v1/controller/rotate-keys"), 403, "forbidden")
            assert await ok(http.get("/api/v1/receipts/public-key")) == before  # the refusal changed nothing

        answers: list[int] = []
        stop = trio.Event()
        async with trio.open_nursery() as load:
            load.start_soon(chat_until, cluster, answers, stop)
            await wait_for(lambda: _served(answers, 3), timeout_s=TIMEOUT_S)
            rotated = await trio.to_thread.run_sync(_nexa, cluster, "keys", "rotate-controller", "--json")
            assert rotated.returncode == 0, rotated.stdout + rotated.stderr
            out = json.loads(rotated.stdout)
            new_id = out["key_id"]
            assert out["previous_key_id"] == old_id != new_id and out["announced_to"] == 1

            async def pinned() -> bool:
                await trio.lowlevel.checkpoint()
                return (
                    identity.load_enrollment(node.state_dir).controller_signing_public_key == out["signing_public_key"]
                )

            await wait_for(pinned, timeout_s=TIMEOUT_S)
            served = len(answers)
            await wait_for(lambda: _served(answers, served + 5), timeout_s=TIMEOUT_S)
            stop.set()
        assert answers and set(answers) == {200}, sorted(set(answers))
        print(f"controller keys rotated under load: {len(answers)} chat completions, none failed")

        # A restarted agent keeps the pinned keys and accepts the set signed with the new key.
        await node.restart_until_renewed(TIMEOUT_S)
        assert (await node_view(cluster.controller, node.node_id))["state"] == "Ready"
        await cluster.wait_ready("chat-a", 1)

        # The old key is kept (private, 0600) and listed with its id; the audit trail has the rotation.
        keys_dir = cluster.controller.state_dir / "keys"
        mode = (keys_dir / f"retired-{old_id}-signing.pem").stat().st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert [r.key_id for r in keyring.load_or_create_keys(keys_dir).retired] == [old_id]
        async with cluster.client() as http:
            listed = await ok(http.get("/api/v1/receipts/public-key"))
            events = [e for e in await audit_events(http) if e["action"] == "controller.keys_rotated"]
        assert listed["key_id"] == new_id and [k["key_id"] for k in listed["keys"]] == [new_id, old_id]
        assert len(events) == 1 and old_id in events[0]["detail"]

        # The receipt from before verifies: online, and offline with the listed keys, picked by id.
        path = tmp_path / "receipt.json"
        path.write_text(json.dumps(receipt))
        keys_file = tmp_path / "keys.json"
        listing = await trio.to_thread.run_sync(_nexa, cluster, "receipts", "key", "--json")
        keys_file.write_text(listing.stdout)
        online = await trio.to_thread.run_sync(_nexa, cluster, "receipts", "verify", str(path))
        assert online.returncode == 0 and f"key {old_id}" in online.stdout, online.stdout + online.stderr
        offline = await trio.to_thread.run_sync(
            _nexa,
            cluster,
            "receipts",
            "verify",
            str(path),
            "--public-key",
            f"@{keys_file}",
            "--url",
            "http://0.0.0.0:9",
        )
        assert offline.returncode == 0 and "valid" in offline.stdout, offline.stdout + offline.stderr
        # Against the new key alone it does not verify (and says why).
        alone = await trio.to_thread.run_sync(
            _nexa, cluster, "receipts", "verify", str(path), "--public-key", out["signing_public_key"]
        )
        assert alone.returncode == 1 and "INVALID" in alone.stdout and old_id in alone.stdout


async def _served(answers: list[int], n: int) -> bool:
    await trio.lowlevel.checkpoint()
    return len(answers) >= n


def _key_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_a_rotation_whose_second_endpoint_is_taken_changes_nothing_and_succeeds_once_it_is_free(
    controller_process: ControllerProcess,
) -> None:
    # The rotation serves its new Curve key on the channel's second endpoint (here the channel's
    # port + 1) before it writes a key file: another socket holding that port refuses it whole.
    url, keys_dir = controller_process.url, controller_process.state_dir / "keys"
    headers = {"Authorization": f"Bearer {controller_process.admin_key}"}
    before, pinned = _key_files(keys_dir), httpx.get(f"{url}/version").json()["controller_fingerprint"]
    second = controller_process.channel_port + 1
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", second))
        holder.listen()
        refused = httpx.post(f"{url}/api/v1/controller/rotate-keys", headers=headers, timeout=30)
        error = assert_envelope(refused, 409, "rotation_endpoint_in_use")
        assert error["retryable"] is True
        assert f"tcp://127.0.0.1:{second}" in error["message"] and "rotation_listen" in error["message"]
        assert _key_files(keys_dir) == before
        assert httpx.get(f"{url}/version").json()["controller_fingerprint"] == pinned
    rotated = httpx.post(f"{url}/api/v1/controller/rotate-keys", headers=headers, timeout=30)
    assert rotated.status_code == 200, rotated.text
    assert rotated.json()["controller_fingerprint"] != pinned
    assert _key_files(keys_dir) != before
    assert controller_process.proc is not None and controller_process.proc.poll() is None


@pytest.mark.slow
def test_an_audit_checkpoint_signed_before_a_rotation_still_verifies(controller_process: ControllerProcess) -> None:
    """Issue 30 point 14: `nexa audit verify --against` a head kept from before a rotation verifies
    against the retired key's public half; one signed by a key the controller never had is refused."""
    cp = controller_process
    head_file = cp.state_dir.parent / "head.json"
    kept = cp.cli("audit", "head", "--json")
    assert kept.returncode == 0, kept.stderr
    head_file.write_text(kept.stdout)
    headers = {"Authorization": f"Bearer {cp.admin_key}"}
    rotated = httpx.post(f"{cp.url}/api/v1/controller/rotate-keys", headers=headers, timeout=30)
    assert rotated.status_code == 200, rotated.text
    checked = cp.cli("audit", "verify", "--against", str(head_file))
    assert checked.returncode == 0, checked.stderr
    forged = json.loads(kept.stdout)
    forged["public_key"] = "A" * 43 + "="
    head_file.write_text(json.dumps(forged))
    refused = cp.cli("audit", "verify", "--against", str(head_file))
    assert refused.returncode == 1 and "INVALID (the checkpoint was signed by another key" in refused.stderr
