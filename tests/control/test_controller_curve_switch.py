"""The controller's Curve key switch after `nexa keys rotate-controller` (issue 17, point 6), against
a real controller and a real `nexa node` process.

From the rotation on, the controller's one ROUTER serves the new Curve key on its second endpoint
(`[channel] rotation_listen`) beside the old one; the node redials it (make before break) under
chat-completion load and no request fails. When the short overlap (`[nodes] key_overlap_s`) ends,
the controller serves the new key alone: a peer that dials the old endpoint with the old key is
refused (counted as `needs_reenrollment`), new enrollments are told the new key and endpoint (the
fingerprint `nexa node doctor` checks still matches), and a node restarted afterwards connects with
the new key.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import trio

from nexa import security
from nexa.channel import links
from nexa.control.fleet import keyring
from nexa.node import identity
from tests.realparts import BuiltImages, S3Store
from tests.support.api import metric, node_view, ok, wait_for
from tests.support.cluster import chat_until, sim_cluster
from tests.support.messaging import hello
from tests.support.models import audit_events, registry_config

REJECTED = "nexa_node_messages_rejected_total"
#: Long enough for the node to redial well within it on a loaded machine.
OVERLAP_S = 15.0
TIMEOUT_S = 60


@pytest.mark.slow
async def test_the_channel_switches_to_the_new_curve_key_under_load_and_refuses_the_old(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    cfg = attrs.evolve(cfg, nodes=attrs.evolve(cfg.nodes, key_overlap_s=OVERLAP_S))
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1) as cluster:
        await cluster.deploy("chat-a", replicas=1)
        node = cluster.nodes[0]
        before = identity.load_enrollment(node.state_dir)
        answers: list[int] = []

        async def served(n: int) -> bool:
            await trio.lowlevel.checkpoint()
            return len(answers) >= n

        async def switched() -> bool:
            async with cluster.client() as http:
                return any(e["action"] == "controller.curve_switched" for e in await audit_events(http))

        stop = trio.Event()
        async with trio.open_nursery() as load:
            load.start_soon(chat_until, cluster, answers, stop)
            await wait_for(lambda: served(3), timeout_s=TIMEOUT_S)
            rotated = await cluster.cli("keys", "rotate-controller", "--json")
            assert rotated.returncode == 0, rotated.stdout + rotated.stderr
            out = json.loads(rotated.stdout)
            assert out["curve_public_key"] != before.controller_curve_public_key

            async def redialled() -> bool:
                await trio.lowlevel.checkpoint()
                record = identity.load_enrollment(node.state_dir)
                return record.controller_curve_public_key == out["curve_public_key"]

            await wait_for(redialled, timeout_s=TIMEOUT_S)
            moved = identity.load_enrollment(node.state_dir)
            assert moved.channel_endpoint != before.channel_endpoint
            # A second rotation waits for this one's switch (typed refusal, nothing changes).
            again = await cluster.cli("keys", "rotate-controller", "--json")
            assert again.returncode != 0 and "overlap" in again.stderr, again.stdout + again.stderr
            await wait_for(switched, timeout_s=OVERLAP_S + TIMEOUT_S)
            count = len(answers)
            await wait_for(lambda: served(count + 5), timeout_s=TIMEOUT_S)
            stop.set()
        assert answers and set(answers) == {200}, sorted(set(answers))
        print(f"Curve key switched under load: {len(answers)} chat completions, none failed")

        async def old_channel_closed() -> bool:  # drained, then closed by the node (make before break)
            await trio.lowlevel.checkpoint()
            assert node.log is not None
            return "closed the channel of the controller's previous Curve key" in node.log.read_text()

        await wait_for(old_channel_closed, timeout_s=TIMEOUT_S)

        # On disk: the new key is the current one, on the other endpoint; the old one kept (0600).
        keys_dir = cluster.controller.state_dir / "keys"
        keys = keyring.load_or_create_keys(keys_dir)
        assert (keys.curve.public, keys.slot, keys.next_curve) == (out["curve_public_key"], 1, None)
        assert keys.retired_curve is not None and keys.retired_curve.public == before.controller_curve_public_key

        # A peer that dials the old endpoint with the old server key gets no channel: refused, counted.
        refused = await metric(cluster.controller, REJECTED, reason="needs_reenrollment")
        stranger = links.generate_curve_keypair()
        old = links.Uplink(
            before.channel_endpoint,
            curve=stranger,
            server_curve_public=before.controller_curve_public_key,
            signing_key=security.generate_signing_key(),
            controller_key=security.PublicKey.from_b64(out["signing_public_key"]),
            reconnect_ivl_s=0.05,
            reconnect_ivl_max_s=0.2,
        )
        async with trio.open_nursery() as dialling:
            await dialling.start(old.run)
            old.send_nowait(hello("stranger"))

            async def refused_more() -> bool:
                return await metric(cluster.controller, REJECTED, reason="needs_reenrollment") > refused

            await wait_for(refused_more, timeout_s=TIMEOUT_S)
            assert old.statistics().sent == 0
            dialling.cancel_scope.cancel()

        # New enrollments pin the new keys: the fingerprint the node checks (`nexa node doctor`).
        record = identity.load_enrollment(node.state_dir)
        async with cluster.client() as http:
            version = await ok(http.get("/version"))
        pinned = security.controller_fingerprint(
            record.controller_signing_public_key, record.controller_curve_public_key
        )
        assert version["controller_fingerprint"] == pinned == out["controller_fingerprint"]

        # A node restarted after the switch connects with the new key and is sent its set.
        await node.restart_until_renewed(TIMEOUT_S)
        view = await node_view(cluster.controller, node.node_id)
        assert view["state"] == "Ready" and not view["needs_reenrollment"]
        await cluster.wait_ready("chat-a", 1)
