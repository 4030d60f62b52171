"""The `signed-sets` step's impostor: a fifth `nexa node` agent (127.0.0.15), enrolled with the sim's
controller, whose enrollment names an endpoint the sim serves itself with `nexa.channel.links`. The
impostor holds the sim controller's Curve keys (from the sim's own state dir, as anyone who copied
that directory would), so the agent connects; what it offers is judged by the real agent:

- a set signed by a fresh Ed25519 key: never acked, the agent logs the bad signature;
- a set signed with the controller's key (accepted), then older ones replayed (an older generation,
  an older epoch): acked `accepted=false` with `stale_generation` / `stale_epoch`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Final

import trio

from nexa import security
from nexa.channel import links
from nexa.contracts import wire
from nexa.demo import Node, enroll_node
from nexa.localparts import free_ports
from nexa.node import identity
from nexa.sim.campaign import Figures, check
from nexa.sim.cluster import Cluster

IMPOSTOR_NODE: Final = 5
#: What the agent logs for a set no controller key in force signed.
BAD_SIGNATURE_LOG: Final = "no controller key in force signed it"
#: The window a forged set's (absent) answer is awaited in.
NO_ANSWER_S: Final = 2.0
TIMEOUT_S: Final = 60.0


def _offer(node_id: str, epoch: int, generation: int) -> wire.AssignmentSet:
    return wire.AssignmentSet(
        node_id=node_id, epoch=epoch, generation=generation, lease_expires_at=time.time() + 60, assignments=[]
    )


async def _next_ack(link: links.Link, node_id: str) -> wire.Ack:
    while True:
        got = await link.receive()
        if isinstance(got, links.Inbound) and got.node_id == node_id and isinstance(got.message, wire.Ack):
            return got.message


async def _next_beat(link: links.Link, node_id: str) -> None:
    while True:
        got = await link.receive()
        if isinstance(got, links.Inbound) and got.node_id == node_id:
            return


def _logged(node: Node, text: str) -> bool:
    return any(text in p.read_text(errors="replace") for p in node.config.parent.glob(f"{node.config.stem}*.log"))


async def signed_sets(cluster: Cluster) -> Figures:
    control_dir = cluster.control_dir / "keys"
    curve = links.load_curve_keypair(control_dir, name="controller-curve")
    signing = security.signing_key_from_pem(
        (control_dir / "controller-signing.pem").read_bytes(), source="the sim controller's signing key"
    )
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    node = await enroll_node(
        cluster.the_api().http,
        cluster.root,
        IMPOSTOR_NODE,
        cluster.store,
        cluster.creds,
        plan=cluster.plan,
        prefix="impostor",
        channel_endpoint=endpoint,
    )
    cluster.extra.append(node)
    state: Path = node.state_dir
    node_id = identity.load_enrollment(state).node_id
    curve_public = links.load_curve_public(state / "curve.pub")
    node_key = security.load_signing_key(state / identity.SIGNING_KEY_FILE).public
    link = links.Link(
        endpoint,
        curve=curve,
        signing_key=signing,
        authorize={curve_public: node_id}.get,
        node_key={node_id: node_key}.get,
    )
    figures: Figures = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        with trio.fail_after(TIMEOUT_S):
            await _next_beat(link, node_id)
            await link.send(node_id, _offer(node_id, 2, 1), key=security.generate_signing_key())
            while not _logged(node, BAD_SIGNATURE_LOG):  # noqa: ASYNC110 - polling the agent's log
                await trio.sleep(0.1)
        forged_ack: wire.Ack | None = None
        with trio.move_on_after(NO_ANSWER_S):
            forged_ack = await _next_ack(link, node_id)
        check(forged_ack is None, f"the forged set was answered: accepted={forged_ack and forged_ack.accepted}")
        figures["forged_refused"] = 1
        with trio.fail_after(TIMEOUT_S):
            await _next_beat(link, node_id)  # the agent came back after the bad signature
            await link.send(node_id, _offer(node_id, 2, 2))
            accepted = await _next_ack(link, node_id)
            check(accepted.accepted, f"the controller-signed set was refused: {accepted.reason} {accepted.detail}")
            await link.send(node_id, _offer(node_id, 2, 1))
            stale_generation = await _next_ack(link, node_id)
            await link.send(node_id, _offer(node_id, 1, 9))
            stale_epoch = await _next_ack(link, node_id)
        nursery.cancel_scope.cancel()
    for ack, reason in (
        (stale_generation, wire.RejectReason.STALE_GENERATION),
        (stale_epoch, wire.RejectReason.STALE_EPOCH),
    ):
        check(
            not ack.accepted and ack.reason is reason,
            f"a replayed set: expected accepted=false {reason}, got accepted={ack.accepted} {ack.reason}",
        )
    fence = identity.load_fence(state)
    check((fence.epoch, fence.generation) == (2, 2), f"the agent's fence moved to {fence.epoch}/{fence.generation}")
    figures.update(stale_refused=2, accepted_epoch=fence.epoch, accepted_generation=fence.generation)
    await cluster.the_api().post(f"/api/v1/nodes/{node_id}/revoke")
    return figures
