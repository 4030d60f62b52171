"""A test double for a node agent on the controller's channel, built from the real pieces (keys, a
Curve DEALER, signed frames), so a test can also send what a real agent never would."""

from __future__ import annotations

import time
from typing import Any

import attrs

from nexa import security
from nexa.channel import framing, links
from nexa.contracts import codec, wire
from nexa.contracts.api import EnrollResponse
from tests.conftest import Controller, gb10_inventory


@attrs.define
class RawNode:
    node_id: str
    key: security.SigningKey
    curve: links.CurveKeyPair
    enrolled: EnrollResponse
    pump: links.ZmqPump | None = None
    seq: int = 0
    #: Assignment ids this node reports as Ready in its heartbeats.
    ready: set[str] = attrs.field(factory=set)
    #: Inventory fields this node reports over the GB10 one's (what its inventory.json claims).
    claims: dict[str, Any] = attrs.field(factory=dict)
    #: Report in heartbeats the (epoch, generation) of the last set received, as an agent that
    #: applied it does (off: 0, 0, as before).
    report_generation: bool = False
    #: The (epoch, generation) of the last set received.
    applied: tuple[int, int] = (0, 0)

    def frames(self, msg: wire.WireMessage, *, key: security.SigningKey | None = None) -> list[bytes]:
        return framing.encode_frames(msg, key or self.key)

    def liveness(self, *, node_id: str | None = None, state_seq: int | None = None) -> list[bytes]:
        """A liveness beat's frames (unsigned: the channel authenticates it), naming the last seq sent."""
        return framing.encode_liveness(node_id or self.node_id, self.seq if state_seq is None else state_seq)

    def heartbeat(
        self,
        *,
        seq: int | None = None,
        ts: float | None = None,
        node_id: str | None = None,
        state_interval_s: float = 0.0,
    ) -> wire.Heartbeat:
        if seq is None:
            self.seq += 1
            seq = self.seq
        return wire.Heartbeat(
            node_id=node_id or self.node_id,
            seq=seq,
            ts=time.time() if ts is None else ts,
            inventory=attrs.evolve(gb10_inventory(self.node_id), **self.claims),
            free_memory_bytes=100 << 30,
            free_accelerators=1,
            assignments=[
                wire.AssignmentStatus(assignment_id=aid, state=wire.RuntimeState.READY) for aid in sorted(self.ready)
            ],
            state_interval_s=state_interval_s,
            epoch=self.applied[0] if self.report_generation else 0,
            generation=self.applied[1] if self.report_generation else 0,
        )

    async def send(self, frames: list[bytes]) -> None:
        assert self.pump is not None
        await self.pump.send(frames)

    async def receive_set(self) -> wire.AssignmentSet:
        msg = await self.receive()
        assert isinstance(msg, wire.AssignmentSet)
        return msg

    async def receive(self) -> wire.ControllerMessage:
        """The next signed message from the controller, verified against its key."""
        assert self.pump is not None
        frames = await self.pump.receive()
        controller = security.PublicKey.from_b64(self.enrolled.controller_signing_public_key)
        msg: wire.ControllerMessage = framing.decode_frames([f.bytes for f in frames], controller, wire.FROM_CONTROLLER)
        if isinstance(msg, wire.AssignmentSet):
            self.applied = max(self.applied, (msg.epoch, msg.generation))
        return msg


async def enroll(c: Controller, name: str, labels: str = "") -> RawNode:
    key = security.generate_signing_key()
    curve = links.generate_curve_keypair()
    async with c.client() as http:
        token = (await http.post("/api/v1/enrollment-tokens", json={"ttl_s": 60, "labels": _labels(labels)})).json()
        resp = await http.post(
            "/api/v1/enroll",
            json={
                "token": token["token"],
                "hostname": name,
                "signing_public_key": key.public.b64,
                "curve_public_key": curve.public,
            },
        )
    assert resp.status_code == 201, resp.text
    enrolled = codec.structure(codec.api, resp.json(), EnrollResponse)
    return RawNode(node_id=enrolled.node_id, key=key, curve=curve, enrolled=enrolled)


def _labels(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if item)
