"""Node key rotation against a real controller and a real `nexa node` process (issue 17, point 5).

The node rotates through `nexa node rotate-keys` on its state directory, then again when the
operator asks with `nexa nodes rotate`, while chat completions run through it the whole time: no
request fails, the node stays Ready, the store holds the new keys. The old keys are then refused:
a channel opened with the old Curve key (ZAP), and a message signed with the old signing key; a
rotation signed with a key the node never had changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import apsw
import pytest
import trio

from nexa import security
from nexa.channel import framing, links
from nexa.contracts import wire
from nexa.contracts.api import EnrollResponse
from nexa.control import store as st
from nexa.node import identity
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, make_key, metric, node_view, wait_for
from tests.support.cluster import MESSAGES, SimCluster, sim_cluster
from tests.support.models import audit_events, registry_config
from tests.support.rawnode import RawNode, enroll

REJECTED = "nexa_node_messages_rejected_total"
TIMEOUT_S = 60


def _nexa(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nexa", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def _disk_keys(state_dir: Path) -> tuple[security.SigningKey, links.CurveKeyPair]:
    return security.load_signing_key(state_dir / "node.key"), links.load_curve_keypair(state_dir)


def _stored_keys(cluster: SimCluster, node_id: str) -> tuple[str, str]:
    """The node's keys in the controller's database (a read-only connection beside the controller's)."""
    db = apsw.Connection(str(cluster.controller.state_dir / st.DB_FILE), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        rows = db.execute("SELECT signing_public_key, curve_public_key FROM node WHERE id = ?", (node_id,)).fetchall()
    finally:
        db.close()
    return str(rows[0][0]), str(rows[0][1])


async def _rotations(cluster: SimCluster, node_id: str) -> list[dict[str, Any]]:
    async with cluster.client() as http:
        events = await audit_events(http)
    return [e for e in events if e["action"] == "node.keys_rotated" and e["target"] == f"node/{node_id}"]


class _Load:
    """Chat completions one after another through the gateway; every answer is counted. `stopping`
    ends the loop after the request in flight: a request cancelled mid-answer would leave its
    response for the garbage collector to close (a ResourceWarning, an error under the test settings)."""

    def __init__(self) -> None:
        self.ok = 0
        self.failed: list[str] = []
        self.stopping = False

    async def run(self, cluster: SimCluster, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with cluster.client(cluster.inference_key) as http:
            task_status.started()
            while not self.stopping:
                stream = self.ok % 2 == 0
                body = {"model": "chat", "messages": MESSAGES, "stream": stream}
                resp = await http.post("/v1/chat/completions", json=body)
                if resp.status_code == 200 and (not stream or "data: [DONE]" in resp.text):
                    self.ok += 1
                else:
                    self.failed.append(f"{resp.status_code} {resp.text[:200]}")


async def test_asking_a_node_to_rotate_is_refused_when_it_cannot_be_asked(controller: Controller) -> None:
    """Each refusal is typed and changes nothing (no audit event): unknown node, no channel,
    revoked node, a caller who is not admin (that one is audited as a refusal, as every 403 is)."""
    node = await enroll(controller, "quiet")  # enrolled, never connected
    async with controller.client() as http:
        assert_envelope(await http.post("/api/v1/nodes/nope/rotate-keys"), 404, "not_found")
        err = assert_envelope(await http.post(f"/api/v1/nodes/{node.node_id}/rotate-keys"), 503, "node_unreachable")
        assert err["retryable"] is True and "nexa node rotate-keys" in str(err["message"])
        operator = await make_key(controller, "operator")
        async with controller.client(operator) as op:
            assert_envelope(await op.post(f"/api/v1/nodes/{node.node_id}/rotate-keys"), 403, "forbidden")
        assert (await http.post(f"/api/v1/nodes/{node.node_id}/revoke")).status_code == 200
        assert_envelope(await http.post(f"/api/v1/nodes/{node.node_id}/rotate-keys"), 409, "conflict")
        actions = {e["action"] for e in await audit_events(http)}
    assert "node.rotate_keys_requested" not in actions and "node.keys_rotated" not in actions


@pytest.mark.slow
async def test_a_node_rotates_its_keys_under_load_and_the_old_ones_are_refused(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, dial: Any
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1) as cluster:
        await cluster.deploy("chat-a", replicas=1)
        node = cluster.nodes[0]
        old_key, old_curve = _disk_keys(node.state_dir)
        load = _Load()
        async with trio.open_nursery() as mine:
            await mine.start(load.run, cluster)

            # 1. On the node: `nexa node rotate-keys` (the running agent sends them and switches).
            rotated = await trio.to_thread.run_sync(
                _nexa, "node", "rotate-keys", "--state-dir", str(node.state_dir), "--wait", str(TIMEOUT_S)
            )
            assert rotated.returncode == 0, rotated.stdout + rotated.stderr
            assert "keys rotated" in rotated.stdout
            key1, curve1 = _disk_keys(node.state_dir)
            assert key1.public != old_key.public and curve1.public != old_curve.public
            assert not (node.state_dir / identity.NEXT_KEYS_DIR).exists()
            assert _stored_keys(cluster, node.node_id) == (key1.public.b64, curve1.public)
            assert len(await _rotations(cluster, node.node_id)) == 1

            # 2. The operator asks: `nexa nodes rotate`, through the channel.
            env = {"NEXA_URL": cluster.controller.url, "NEXA_TOKEN": cluster.controller.admin_key}
            asked = await trio.to_thread.run_sync(lambda: _nexa("nodes", "rotate", node.node_id, env=env))
            assert asked.returncode == 0, asked.stdout + asked.stderr

            async def rotated_again() -> bool:
                return (
                    _disk_keys(node.state_dir)[0].public != key1.public
                    and not (node.state_dir / identity.NEXT_KEYS_DIR).exists()
                )

            await wait_for(rotated_again, timeout_s=TIMEOUT_S)
            key2, curve2 = _disk_keys(node.state_dir)
            assert _stored_keys(cluster, node.node_id) == (key2.public.b64, curve2.public)
            actions = [e["action"] for e in (await _audit(cluster))]
            assert "node.rotate_keys_requested" in actions
            assert len(await _rotations(cluster, node.node_id)) == 2

            # Requests keep succeeding on the new channel, then the load stops.
            served = load.ok
            await wait_for(lambda: _at_least(load, served + 5), timeout_s=TIMEOUT_S)
            load.stopping = True
        assert load.failed == [], load.failed
        print(f"two rotations under load: {load.ok} chat completions, none failed")

        async def old_channels_closed() -> bool:
            assert node.log is not None
            return node.log.read_text().count("closed the channel of the node's previous keys") >= 2

        await wait_for(old_channels_closed, timeout_s=TIMEOUT_S)
        assert (await node_view(cluster.controller, node.node_id))["state"] == "Ready"

        await _old_keys_are_refused(cluster, dial, node.node_id, old_key, old_curve, key2, curve2)


async def _audit(cluster: SimCluster) -> list[dict[str, Any]]:
    async with cluster.client() as http:
        return await audit_events(http)


async def _at_least(load: _Load, n: int) -> bool:
    await trio.lowlevel.checkpoint()
    return load.ok >= n


async def _old_keys_are_refused(
    cluster: SimCluster,
    dial: Any,
    node_id: str,
    old_key: security.SigningKey,
    old_curve: links.CurveKeyPair,
    key: security.SigningKey,
    curve: links.CurveKeyPair,
) -> None:
    c = cluster.controller
    record = identity.load_enrollment(cluster.nodes[0].state_dir)
    info = EnrollResponse(
        node_id=node_id,
        controller_signing_public_key=record.controller_signing_public_key,
        controller_curve_public_key=record.controller_curve_public_key,
        channel_endpoint=record.channel_endpoint,
        labels={},
    )
    # The old Curve key: ZAP refuses the channel (counted as unknown_key, audited as a retired key).
    stale = RawNode(node_id=node_id, key=old_key, curve=old_curve, enrolled=info)
    before = await metric(c, REJECTED, reason="unknown_key")
    await dial(stale)
    await stale.send(stale.frames(_beat(stale)))
    await wait_for(lambda: _counted(c, "unknown_key", before + 1), timeout_s=TIMEOUT_S)

    async def retired_audited() -> bool:
        events = await _audit(cluster)
        return any("rotated away from" in e["detail"] for e in events if e["action"] == "node.message.rejected")

    await wait_for(retired_audited, timeout_s=TIMEOUT_S)

    # The node's current Curve key but the old signing key: the message is refused.
    forged = RawNode(node_id=node_id, key=old_key, curve=curve, enrolled=info)
    await dial(forged)
    before = await metric(c, REJECTED, reason="bad_signature")
    await forged.send(forged.frames(_beat(forged)))
    await wait_for(lambda: _counted(c, "bad_signature", before + 1), timeout_s=TIMEOUT_S)

    # A rotation signed with a key the node never had changes nothing.
    rotations = len(await _rotations(cluster, node_id))
    stranger = security.generate_signing_key()
    bogus = wire.RotateKeys(
        node_id=node_id,
        seq=time.time_ns() // 1000,
        ts=time.time(),
        signing_public_key=stranger.public.b64,
        curve_public_key=links.generate_curve_keypair().public,
    )
    before = await metric(c, REJECTED, reason="bad_signature")
    await forged.send(framing.encode_frames(bogus, stranger))
    await wait_for(lambda: _counted(c, "bad_signature", before + 1), timeout_s=TIMEOUT_S)
    assert len(await _rotations(cluster, node_id)) == rotations
    assert _stored_keys(cluster, node_id) == (key.public.b64, curve.public)
    assert (await node_view(c, node_id))["state"] == "Ready"


async def _counted(c: Any, reason: str, at_least: float) -> bool:
    return await metric(c, REJECTED, reason=reason) >= at_least


def _beat(node: RawNode) -> wire.Heartbeat:
    return node.heartbeat(seq=time.time_ns() // 1000)
