"""The gateway's serving sets are made once per change (`views.ServingSets`), and every change shows
up in the next request's set: a deployment removed, a replica going Ready and unready, a node lost.

The store, fleet and desired state are the real ones; the node channel's push is a stand-in (no
node is connected), and the node's messages are handed to the fleet as the channel would.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest

from nexa import security
from nexa.channel import links
from nexa.config import NodesConfig, PlacementConfig, StoreConfig
from nexa.contracts.api import EnrollmentTokenCreate, EnrollRequest
from nexa.contracts.deployments import ROLLOUT_EVAL_PREFIX, Replica, Rollout
from nexa.contracts.domain import SYSTEM
from nexa.contracts.models import ModelRef
from nexa.contracts.wire import AssignmentStatus, DesiredAssignments, Heartbeat, Hello, RuntimeState
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.deployments import evalreplica
from nexa.control.deployments.desired import Desired
from nexa.control.deployments.records import Entry
from nexa.control.deployments.views import ServingSets, serving
from nexa.control.fleet.nodes import Fleet
from nexa.errors import ModelNotServed, NotFound
from nexa.telemetry import Metrics
from tests.conftest import gb10_inventory
from tests.support.deployments import placed_deployment
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401

REF = ModelRef(model="tiny", version="v1")


class NoPush:
    recovering = False

    async def push_now(self, node_id: str) -> None:
        return None


@attrs.define
class Parts:
    fleet: Fleet
    desired: Desired
    sets: ServingSets
    node_id: str
    seq: int = 1

    async def beat(self, *ready: str) -> None:
        self.seq += 1
        statuses = [AssignmentStatus(assignment_id=r, state=RuntimeState.READY) for r in ready]
        msg = Heartbeat(
            node_id=self.node_id,
            seq=self.seq,
            ts=time.time(),
            inventory=gb10_inventory(),
            free_memory_bytes=64 << 30,
            free_accelerators=1,
            assignments=statuses,
        )
        await self.fleet.heard(self.node_id, msg)

    def check(self) -> list[str]:
        """The cached set is the one made from scratch now; its replica ids."""
        cached = self.sets.get(REF, alias="chat")
        assert cached == serving(self.desired, REF, alias="chat")
        return [r.replica_id for r in cached.replicas]


class NoRegistry:
    """A registry that knows no runtime (a serving set then records no gated API served) and keeps
    no evaluation (so none moves the serving sets on)."""

    evaluations_version = 0

    def runtime(self, name: str) -> None:
        raise NotFound(f"no runtime {name}")


@pytest.fixture
async def parts(tmp_path: Path, store_cfg: StoreConfig) -> AsyncIterator[Parts]:
    metrics = Metrics()
    async with st.open_store(tmp_path / "state", store_cfg) as store:
        fleet = Fleet(NodesConfig(), store, metrics)
        await fleet.load()
        key, curve = security.generate_signing_key(), links.generate_curve_keypair()
        secret, _ = await fleet.create_token(SYSTEM, EnrollmentTokenCreate(ttl_s=60))
        node = await fleet.enroll(
            EnrollRequest(token=secret, hostname="n1", signing_public_key=key.public.b64, curve_public_key=curve.public)
        )
        dep = placed_deployment(node.id, REF)
        draft = audit_draft(SYSTEM, "deployment.create", "deployment/chat-a")
        await store.run(
            st.save_deployment, dep.name, dep, None, [DesiredAssignments(node_id=node.id, generation=1)], draft
        )
        desired = Desired(
            store,
            metrics,
            fleet,
            models=NoRegistry(),  # type: ignore[arg-type]  # no new replica is placed here
            southbound=NoPush(),  # type: ignore[arg-type]
            placement=PlacementConfig(),
        )
        await desired.load()
        await fleet.heard(node.id, Hello(node_id=node.id, seq=1, ts=time.time(), agent_version="test"))
        yield Parts(fleet, desired, ServingSets(desired), node.id)


async def test_each_change_shows_up_in_the_next_serving_set(parts: Parts) -> None:
    assert parts.check() == []  # deployed, no replica Ready yet
    same = parts.sets.get(REF, alias="chat")
    assert parts.sets.get(REF, alias="chat") is same  # nothing changed: the same set, not made again

    await parts.beat("chat-a-r1")
    assert parts.check() == ["chat-a-r1"]  # the replica went Ready
    ready = parts.sets.get(REF, alias="chat")
    await parts.beat("chat-a-r1")
    assert parts.sets.get(REF, alias="chat") is ready  # a heartbeat saying the same changes nothing

    await parts.beat()
    assert parts.check() == []  # it went unready
    await parts.beat("chat-a-r1")
    assert parts.check() == ["chat-a-r1"]

    await parts.fleet.mark_unreachable(parts.fleet.get(parts.node_id))
    assert parts.check() == []  # the node was lost
    await parts.beat("chat-a-r1")
    assert parts.check() == ["chat-a-r1"]  # and came back

    await parts.fleet.act(SYSTEM, parts.node_id, "revoke")
    assert parts.check() == []  # revoked

    before = parts.desired.entry("chat-a")
    await parts.desired.commit(SYSTEM, "deployment.delete", before, None)
    assert parts.sets.get(REF, alias="chat").deployments == []  # the deployment change
    assert parts.check() == []


async def test_a_deployment_added_shows_up_in_the_next_serving_set(parts: Parts) -> None:
    await parts.beat("chat-a-r1")
    assert parts.sets.get(REF, alias="chat").deployments == ["chat-a"]
    added = attrs.evolve(parts.desired.entry("chat-a").deployment, name="chat-b", placed=[])
    await parts.desired.commit(SYSTEM, "deployment.create", None, Entry(added, None))
    assert parts.sets.get(REF, alias="chat").deployments == ["chat-a", "chat-b"]
    assert parts.check() == ["chat-a-r1"]


async def test_a_rollouts_new_replicas_alone_serve_its_suite_gates_model_name(parts: Parts) -> None:
    """`nexa-eval-rollout.chat-a` (`ROLLOUT_EVAL_PREFIX`): the Ready replicas of the deployment's spec
    now, never the old ones beside them, and only while a rollout runs."""
    name = ROLLOUT_EVAL_PREFIX + "chat-a"
    dep = parts.desired.entry("chat-a").deployment
    old = Replica(id="chat-a-r0", node_id=parts.node_id, model=REF, spec="sim:an-older-spec")
    rolling = attrs.evolve(
        dep, placed=[old, *dep.placed], rollout=Rollout(from_=REF, to=REF, reason="change", started_at=1.0)
    )
    parts.desired.entries["chat-a"] = Entry(rolling, None)  # in memory: serving sets read only that
    await parts.beat("chat-a-r0", "chat-a-r1")
    both = serving(parts.desired, REF, alias="chat").replicas
    assert sorted(r.replica_id for r in both) == ["chat-a-r0", "chat-a-r1"]
    pinned = serving(parts.desired, REF, alias=name)
    assert [r.replica_id for r in pinned.replicas] == ["chat-a-r1"] and pinned.deployments == ["chat-a"]
    assert evalreplica.served_to(parts.desired, name, "any-key") == REF
    assert serving(parts.desired, ModelRef(model="tiny", version="v2"), alias=name).replicas == []

    done = attrs.evolve(rolling, rollout=None)
    parts.desired.entries["chat-a"] = Entry(done, None)
    assert serving(parts.desired, REF, alias=name).replicas == []
    with pytest.raises(ModelNotServed, match="no rollout in progress"):
        evalreplica.served_to(parts.desired, name, "any-key")
