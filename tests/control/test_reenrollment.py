"""A node offline through a whole controller key rotation overlap needs re-enrollment (issue 17,
point 6), against a real controller and real `nexa node` processes.

One node follows the rotation; the other is stopped before it and started again once the short
overlap (`[nodes] key_overlap_s`) has ended. It dials the old endpoint with the controller's old
Curve key, which from the overlap's end refuses every node's channel (ZAP; typed, counted): it is
marked (shown by `nexa nodes list` with the hint to re-enroll, stored, audited once) and it is
sent nothing: no set, no traffic. The node that followed (it redialled the new Curve key at the
other endpoint) stays Ready.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import apsw
import attrs
import pytest
import trio

from nexa.control import store as st
from nexa.node import identity
from tests.realparts import BuiltImages, S3Store
from tests.support.api import metric, node_view, wait_for
from tests.support.cluster import SimCluster, sim_cluster
from tests.support.models import audit_events, registry_config

REJECTED = "nexa_node_messages_rejected_total"
#: Long enough for the running node to pin the new key well within it on a loaded machine.
OVERLAP_S = 10.0
TIMEOUT_S = 60


@pytest.mark.slow
async def test_a_node_offline_through_the_overlap_needs_reenrollment_and_is_sent_nothing(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    cfg = attrs.evolve(cfg, nodes=attrs.evolve(cfg.nodes, key_overlap_s=OVERLAP_S))
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=2) as cluster:
        follower, offline = cluster.nodes
        old_key = identity.load_enrollment(offline.state_dir).controller_signing_public_key
        offline.kill(signal.SIGTERM)
        await wait_for(lambda: _state_is(cluster, offline.node_id, "Unreachable"), timeout_s=TIMEOUT_S)
        fence = identity.load_fence(offline.state_dir)
        last_heard = (await node_view(cluster.controller, offline.node_id))["last_heartbeat_at"]

        rotated = await cluster.cli("keys", "rotate-controller", "--json")
        assert rotated.returncode == 0, rotated.stdout + rotated.stderr
        out = json.loads(rotated.stdout)

        async def followed() -> bool:
            await trio.lowlevel.checkpoint()
            record = identity.load_enrollment(follower.state_dir)
            return record.controller_signing_public_key == out["signing_public_key"]

        await wait_for(followed, timeout_s=TIMEOUT_S)
        # The offline node missed the whole overlap.
        await trio.sleep(max(0.0, out["overlap_until"] - time.time()) + 0.5)
        assert identity.load_enrollment(offline.state_dir).controller_signing_public_key == old_key
        offline.start()

        async def marked() -> bool:
            return bool((await node_view(cluster.controller, offline.node_id))["needs_reenrollment"])

        await wait_for(marked, timeout_s=TIMEOUT_S)
        # Its channel was refused, typed and counted...
        assert await metric(cluster.controller, REJECTED, reason="needs_reenrollment") >= 1
        view = await node_view(cluster.controller, offline.node_id)
        assert view["state"] == "Unreachable" and "nexa node enroll" in view["hint"]
        assert view["last_heartbeat_at"] == last_heard  # none of its messages is recorded
        # ...audited once, with the retired key's id.
        async with cluster.client() as http:
            events = [e for e in await audit_events(http) if e["action"] == "node.needs_reenrollment"]
        assert [e["target"] for e in events] == [f"node/{offline.node_id}"]
        assert out["previous_key_id"] in events[0]["detail"] and events[0]["result"] == "rejected"

        # `nexa nodes list` shows it, with the hint; the node that followed stays Ready.
        listed = await cluster.cli("nodes", "list")
        assert listed.returncode == 0, listed.stderr
        rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:] if line.strip()}
        assert rows == {follower.node_id: "Ready", offline.node_id: "NeedsReenrollment"}, listed.stdout
        assert f"node {offline.node_id} needs re-enrollment: re-enroll: nexa tokens create" in listed.stderr
        assert "then on the node remove its state directory and run nexa node enroll" in listed.stderr

        # It was sent nothing: no set (its fence is as it was), no message it had to refuse.
        assert identity.load_fence(offline.state_dir) == fence
        assert offline.log is not None and "rejected a message from the controller" not in offline.log.read_text()
        assert (await node_view(cluster.controller, follower.node_id))["state"] == "Ready"

        # The mark is stored (the next start loads it), with the retired key's id.
        db = apsw.Connection(str(cluster.controller.state_dir / st.DB_FILE), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            assert st.load_reenrollment(db) == {offline.node_id: out["previous_key_id"]}
        finally:
            db.close()


async def _state_is(cluster: SimCluster, node_id: str, state: str) -> bool:
    return bool((await node_view(cluster.controller, node_id))["state"] == state)
