"""A node's epoch claims count only within what the controller issued or signed (issue 30 point 1).

A hostile node drives its own CurveZMQ channel by hand (`RawNode`, real keys, real zmq, a real
controller in this trio run) and claims, in validly signed hellos and heartbeats, epochs it never
accepted: 2^63-1, 2^63-2 and one above the controller's. Each claim is refused, counted (in
`/metrics` and on the node), audited and ignored; the controller still pushes, finishes recovery,
starts again and revokes that node. A claim backed by a set the controller's key signed (as after
a restore from an older backup) counts, and recovery takes an epoch above it.
"""

from __future__ import annotations

import base64
import time
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa import security
from nexa.channel import framing
from nexa.config import ChannelConfig
from nexa.contracts.bounds import MAX_EPOCH, MAX_SEQ
from nexa.contracts.domain import SYSTEM
from nexa.contracts.wire import AssignmentSet, Hello
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.fleet import claims
from nexa.control.fleet.keyring import SIGNING_FILE
from nexa.control.service import KEYS_DIR, serve_control
from nexa.control.store.sql import Db, txn
from nexa.errors import EpochExhausted
from tests.conftest import Controller, free_port, local_config, start_controller
from tests.support.api import metric, node_view, wait_for
from tests.support.rawnode import RawNode, enroll

REJECTED = "nexa_node_messages_rejected_total"
UNPROVEN = "unproven_epoch"


def _hello(node: RawNode, epoch: int, generation: int = 1, **proof: str) -> list[bytes]:
    node.seq += 1
    msg = Hello(node_id=node.node_id, seq=node.seq, ts=time.time(), agent_version="t", epoch=epoch, **proof)
    msg = attrs.evolve(msg, generation=generation)
    return node.frames(msg)


def _beat(node: RawNode, epoch: int, generation: int = 1) -> list[bytes]:
    return node.frames(attrs.evolve(node.heartbeat(), epoch=epoch, generation=generation))


def _proof(node_id: str, epoch: int, key: security.SigningKey) -> dict[str, str]:
    """A set signed at `epoch` for `node_id`, as a node keeps it and sends it (`proof_set`)."""
    signed = AssignmentSet(node_id=node_id, epoch=epoch, generation=1, lease_expires_at=time.time() + 60)
    _, body, sig = framing.encode_frames(signed, key)
    return {"proof_set": body.decode(), "proof_signature": base64.b64encode(sig).decode()}


async def _status(c: Controller) -> tuple[str, int]:
    async with c.client() as http:
        ready = (await http.get("/readyz")).json()["status"]
        epoch = (await http.get("/version")).json()["epoch"]
    return ready, epoch


async def _refused(c: Controller, node_id: str, at_least: int) -> None:
    async def counted() -> bool:
        return (await node_view(c, node_id))["channel"].get(UNPROVEN, 0) >= at_least

    await wait_for(counted)
    assert await metric(c, REJECTED, reason=UNPROVEN) >= at_least


async def _revoke(c: Controller, node_id: str) -> None:
    async with c.client() as http:
        resp = await http.post(f"/api/v1/nodes/{node_id}/revoke")
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "Revoked"


async def test_epoch_claims_at_the_bounds_are_refused_counted_and_ignored(controller: Controller, dial: Any) -> None:
    evil = await dial(await enroll(controller, "evil"))
    _, issued = await _status(controller)
    with trio.fail_after(10):
        await evil.send(_hello(evil, MAX_SEQ))
        pushed = await evil.receive_set()  # not taken for a newer state: the controller still pushes
    assert pushed.epoch == issued
    await _refused(controller, "evil", 1)
    for claim in (MAX_EPOCH, issued + 1):
        await evil.send(_beat(evil, claim))
    await _refused(controller, "evil", 3)
    assert await _status(controller) == ("ready", issued)  # no recovery, the epoch unchanged
    async with controller.client() as http:
        events = (await http.get("/api/v1/audit", params={"action": "node.message.rejected"})).json()["events"]
    [event] = [e for e in events if e["target"] == "node/evil"]  # audited (at most every 5 s per node)
    assert UNPROVEN in event["detail"] and str(MAX_SEQ) in event["detail"]
    show = await node_view(controller, "evil")
    assert show["state"] == "Ready" and show["channel"][UNPROVEN] >= 3  # marked, still heard
    await _revoke(controller, "evil")


async def test_a_recovering_controller_finishes_starts_again_and_revokes_whatever_a_node_claims(
    nursery: trio.Nursery, tmp_path: Path, dial: Any
) -> None:
    # A fixed channel port: the node dials the restarted controller where it enrolled.
    cfg = attrs.evolve(local_config(tmp_path), channel=ChannelConfig(listen=f"tcp://127.0.0.1:{free_port()}"))
    first = await start_controller(nursery, cfg)
    evil = await enroll(first, "evil")
    first.stopping.set()
    await trio.sleep(0.5)
    stopping = trio.Event()
    with trio.fail_after(15):
        started = await nursery.start(partial(serve_control, cfg, stopping=stopping, recover=True))
    c = Controller(url=started.urls[0], admin_key=first.admin_key, state_dir=Path(cfg.state_dir), stopping=stopping)
    ready, issued = await _status(c)
    assert ready == "recovering"
    await dial(evil)
    await evil.send(_hello(evil, MAX_SEQ))
    await evil.send(_beat(evil, MAX_EPOCH))
    await _refused(c, "evil", 2)

    async def finished() -> bool:
        return (await _status(c))[0] == "ready"

    await wait_for(finished)  # every node reported: recovery ended by itself, one epoch up
    assert (await _status(c))[1] == issued + 1
    await _revoke(c, "evil")
    c.stopping.set()
    await trio.sleep(0.5)
    again = await start_controller(nursery, cfg, admin_key=first.admin_key)
    assert await _status(again) == ("ready", issued + 2)
    again.stopping.set()


async def test_a_claim_above_the_issued_epoch_counts_only_with_a_set_this_controller_signed(
    controller: Controller, dial: Any
) -> None:
    forger = await dial(await enroll(controller, "forger"))
    honest = await dial(await enroll(controller, "honest"))
    _, issued = await _status(controller)
    # The controller's own key stands for the one that signed sets before its state was restored.
    key = security.load_signing_key(controller.state_dir / KEYS_DIR / SIGNING_FILE)
    ahead = issued + 5
    await forger.send(_hello(forger, ahead, **_proof("forger", ahead, forger.key)))  # signed by itself
    await forger.send(_hello(forger, ahead, **_proof("honest", ahead, key)))  # another node's set
    await _refused(controller, "forger", 2)
    assert (await _status(controller))[0] == "ready"
    # The honest node's proof counts: recovery begins and, every node having reported, ends one
    # epoch above the proven one (never above the forger's claim).
    await honest.send(_hello(honest, ahead, **_proof("honest", ahead, key)))

    async def above_the_proof() -> bool:
        return await _status(controller) == ("ready", ahead + 1)

    await wait_for(above_the_proof)
    assert (await node_view(controller, "honest"))["channel"].get(UNPROVEN, 0) == 0
    async with controller.client() as http:
        events = (await http.get("/api/v1/audit", params={"action": "recovery.finish"})).json()["events"]
    assert [e["detail"].split(";")[1].strip() for e in events] == [f"epoch above {ahead}"]


async def test_a_store_at_the_highest_epoch_says_so_and_changes_nothing(tmp_path: Path) -> None:
    def top(db: Db) -> None:
        with txn(db):
            db.execute("UPDATE meta SET value = ? WHERE key = 'epoch'", (MAX_EPOCH - 1,))

    async with st.open_store(tmp_path) as store:
        await store.run(top)
    async with st.open_store(tmp_path) as store:  # takes the last epoch there is
        assert store.epoch == MAX_EPOCH
        draft = audit_draft(SYSTEM, "recovery.finish", "controller")
        head = await store.run(st.audit_head)
        with pytest.raises(EpochExhausted, match="new state directory"):
            await store.run(st.end_recovery, 0, draft)
        assert await store.run(st.recovery_marker) is None and await store.run(st.audit_head) == head
    with pytest.raises(EpochExhausted, match="new state directory"):
        async with st.open_store(tmp_path):
            pass


def test_a_proof_counts_only_for_exactly_what_was_signed() -> None:
    key, other = security.generate_signing_key(), security.generate_signing_key()
    keys = {"current": other.public, "retired": key.public}  # a retired key's sets still count
    proof = _proof("n1", 9, key)

    def hello(**over: Any) -> Hello:
        base = Hello(node_id="n1", seq=1, ts=time.time(), agent_version="t", epoch=9, generation=1, **proof)
        return attrs.evolve(base, **over)

    assert claims.proof_problem("n1", hello(), keys) is None
    problems = {
        "none": claims.proof_problem("n1", hello(proof_set="", proof_signature=""), keys),
        "not base64": claims.proof_problem("n1", hello(proof_signature="%%%"), keys),
        "edited": claims.proof_problem("n1", hello(proof_set=proof["proof_set"].replace("9", "8")), keys),
        "unknown key": claims.proof_problem("n1", hello(), {"current": other.public}),
        "other node": claims.proof_problem("n2", hello(node_id="n2"), keys),
        "other generation": claims.proof_problem("n1", hello(generation=2), keys),
        "other epoch": claims.proof_problem("n1", hello(epoch=10), keys),
    }
    assert all(problems.values()), problems
    unsigned = framing.encode_frames(Hello(node_id="n1", seq=1, ts=1.0, agent_version="t"), key)
    not_a_set = {"proof_set": unsigned[1].decode(), "proof_signature": base64.b64encode(unsigned[2]).decode()}
    assert claims.proof_problem("n1", hello(**not_a_set), keys) is not None  # signed, but not as a set
