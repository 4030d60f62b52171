"""`nexa.control.cluster.follow` and the `refresh` methods it calls: two "controllers" on one SQLite file
(the first `Store` from `open_store`, the second a second pair of apsw connections on the same
file), each with its own accounts, model registry, fleet, deployments and quotas. A write through
one shows on the other after one poll of its change feed; events that change no record re-read
nothing; quotas split their limits among the live controllers; a follower never writes what its
nodes report and never signs a set."""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio

from nexa import security
from nexa.channel import links
from nexa.channel.links import Uplink
from nexa.config import (
    ChannelConfig,
    ClusterConfig,
    NodesConfig,
    Seconds,
)
from nexa.contracts import wire
from nexa.contracts.api import KeyCreate, TenantCreate
from nexa.contracts.deployments import ReplicaMember
from nexa.contracts.domain import SYSTEM, NodeAdminState, Role, TenantId
from nexa.contracts.groups import GroupMember, GroupRunRecord
from nexa.contracts.models import ModelRef, RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.contracts.usage import QuotaLimits
from nexa.contracts.wire import DesiredAssignments
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.cluster.follow import PARTS, quota_share, touched
from nexa.control.cluster.forward import FORWARDED_HEADER
from nexa.control.datapath.quotas import Quotas
from nexa.control.fleet.nodes import Fleet
from nexa.control.fleet.southbound import Southbound
from nexa.control.service import KEYS_DIR
from nexa.errors import QuotaExceeded, Unauthenticated
from nexa.telemetry import Metrics
from tests.conftest import gb10_inventory, start_controller
from tests.support.deployments import placed_deployment
from tests.support.follow import Side, cluster_config, enroll, two_sides, until_leads
from tests.support.postgres import pg_url_fixture, postgres_fixture  # noqa: F401
from tests.support.relay import wait_until
from tests.support.usage import usage_record

ACME = TenantId("acme")
REF = ModelRef(model="tiny", version="v1")
TIMEOUT_S = 10


@pytest.fixture
async def sides(tmp_path: Path) -> AsyncIterator[tuple[Side, Side]]:
    async with two_sides(tmp_path) as pair:
        yield pair


def hello(node_id: str, seq: int = 1, epoch: int = 0) -> wire.Hello:
    return wire.Hello(node_id=node_id, seq=seq, ts=time.time(), agent_version="test", epoch=epoch)


def heartbeat(node_id: str, seq: int) -> wire.Heartbeat:
    return wire.Heartbeat(
        node_id=node_id,
        seq=seq,
        ts=time.time(),
        inventory=gb10_inventory(),
        free_memory_bytes=64 << 30,
        free_accelerators=1,
        assignments=[],
    )


# ---- what an audit action touches -----------------------------------------------------------------


def test_audit_actions_name_the_state_they_change() -> None:
    assert touched(["key.create", "tenant.create"]) == {"accounts"}
    assert touched(["model.approve", "alias.promote", "runtime.register", "model.evaluate"]) == {"models"}
    assert touched(["deployment.scale", "deployment.canary.auto_rollback"]) == {"deployments", "fleet"}
    assert touched(["node.enroll", "node.cordon", "node.keys_rotated", "enrollment_token.create"]) == {"fleet"}
    assert touched(["quota.set"]) == {"quotas"}
    # What one controller saw on its own channel, and events that change no cached record.
    local = ["node.reachable", "node.unreachable", "node.message.rejected", "node.rotate_keys_requested"]
    assert touched([*local, "console.sign_in", "job.create", "benchmark.record", "POST /api/v1/keys"]) == set()
    assert set(PARTS) == {"accounts", "models", "fleet", "deployments", "quotas"}


def test_quota_shares_count_the_controllers_seen_lately() -> None:
    def row(name: str, seen_at: float) -> st.ControllerRow:
        return st.ControllerRow(id=name, address="", role="follower", epoch=1, started_at=0.0, seen_at=seen_at)

    rows = [row("c", 100.0), row("a", 99.0), row("old", 50.0)]
    assert quota_share(rows, "b", now=100.0, lease_s=5.0) == (3, 1)  # a, b (always), c; old is gone
    assert quota_share([], "b", now=100.0, lease_s=5.0) == (1, 0)


# ---- a write through one store shows on the other after a poll --------------------------------------


async def test_keys_and_tenants_follow_the_store(sides: tuple[Side, Side]) -> None:
    a, b = sides
    secret, key = await a.accounts.create_key(SYSTEM, KeyCreate(role=Role.OPERATOR, name="ci"))
    await a.accounts.create_tenant(SYSTEM, TenantCreate(id=ACME))
    with pytest.raises(Unauthenticated):
        b.accounts.authenticate(secret)  # not seen yet
    assert await b.feed.poll() == {"accounts"}
    assert b.accounts.authenticate(secret).id == key.id
    assert b.accounts.tenant_exists(ACME)

    await a.accounts.revoke_key(SYSTEM, key.id)
    assert await b.feed.poll() == {"accounts"}
    with pytest.raises(Unauthenticated):
        b.accounts.authenticate(secret)  # revoked on the leader: refused here too
    assert await b.feed.poll() == set()  # nothing new: nothing re-read


async def test_nodes_follow_the_store_and_keep_what_this_controller_hears(sides: tuple[Side, Side]) -> None:
    a, b = sides
    node_id, _, curve = await enroll(a.fleet)
    assert await b.feed.poll() == {"fleet"}
    assert b.fleet.authorize_curve(curve.public) == node_id  # its channel is admitted here too
    await b.fleet.heard(node_id, hello(node_id))
    await b.fleet.heard(node_id, beat := heartbeat(node_id, 2))
    heard_at = b.fleet.get(node_id).last_seen

    await a.fleet.act(SYSTEM, node_id, "cordon")
    version = b.fleet.version
    assert await b.feed.poll() == {"fleet"}
    live = b.fleet.get(node_id)
    assert live.node.admin_state is NodeAdminState.CORDONED
    assert (live.reachable, live.last_seen, live.inventory) == (True, heard_at, beat.inventory)
    assert b.fleet.version > version  # the gateway's serving sets are made again

    await a.fleet.act(SYSTEM, node_id, "revoke")
    await b.feed.poll()
    assert b.fleet.authorize_curve(curve.public) is None
    assert not b.fleet.get(node_id).reachable


async def test_a_nodes_reachability_on_another_channel_re_reads_nothing(sides: tuple[Side, Side]) -> None:
    a, b = sides
    node_id, _, _ = await enroll(a.fleet)
    await b.feed.poll()
    await a.fleet.heard(node_id, hello(node_id))  # audited `node.reachable` by the leader
    await a.fleet.mark_unreachable(a.fleet.get(node_id))  # and `node.unreachable`
    assert await b.feed.poll() == set()
    assert not b.fleet.get(node_id).reachable  # never heard here: its own view


async def test_models_deployments_and_their_node_sets_follow_the_store(sides: tuple[Side, Side]) -> None:
    a, b = sides
    node_id, _, _ = await enroll(a.fleet)
    runtime = RuntimeRecord(
        name="sim",
        kind=RuntimeKind.SIM,
        version="1",
        image="registry.test/sim@sha256:" + "0" * 64,
        media_type="application/vnd.oci.image.index.v1+json",
        registered_at=time.time(),
        registered_by=None,
    )
    await a.store.run(st.insert_runtime, runtime, audit_draft(SYSTEM, "runtime.register", "runtime/sim"))
    dep = placed_deployment(node_id, REF)
    sets = [DesiredAssignments(node_id=node_id, generation=2)]
    await a.store.run(st.save_deployment, dep.name, dep, None, sets, audit_draft(SYSTEM, "deployment.create", "d"))
    assert await b.feed.poll() == {"models", "fleet", "deployments"}
    assert b.models.runtime("sim") == runtime
    assert [v.deployment.name for v in b.deployments.all()] == ["chat-a"]
    assert b.fleet.get(node_id).desired.generation == 2  # a follower takes the leader's sets

    # The leader's own set, newer in memory than the store's (acknowledged, not yet written), stays.
    live = a.fleet.get(node_id)
    live.desired = attrs.evolve(live.desired, generation=5)
    await a.feed.poll()
    assert a.fleet.get(node_id).desired.generation == 5

    await a.store.run(st.save_deployment, dep.name, None, None, [], audit_draft(SYSTEM, "deployment.delete", "d"))
    await b.feed.poll()
    assert b.deployments.all() == []


async def test_a_follower_shows_each_group_as_the_leader_last_wrote_its_run(sides: tuple[Side, Side]) -> None:
    a, b = sides
    node_id, _, _ = await enroll(a.fleet)
    other, _, _ = await enroll(a.fleet, "n2")
    dep = placed_deployment(node_id, REF)
    [replica] = dep.placed
    members = [ReplicaMember(rank=0, node_id=node_id), ReplicaMember(rank=1, node_id=other)]
    dep = attrs.evolve(dep, nodes_per_replica=2, placed=[attrs.evolve(replica, members=members)])
    endpoints = [
        GroupMember(rank=m.rank, node_id=m.node_id, address=f"10.0.0.{m.rank + 1}", port=19100) for m in members
    ]
    starting = GroupRunRecord(replica_id=replica.id, deployment=dep.name, phase="starting", members=endpoints)
    draft = audit_draft(SYSTEM, "deployment.create", "d")
    await a.store.run(st.save_deployment, dep.name, dep, None, [], draft, [starting])
    await b.feed.poll()
    [group] = b.deployments.show(dep.name).groups
    assert (group.replica_id, group.state) == (replica.id, "starting")
    # The leader's group became Ready (a run written alone, audited): the follower shows it.
    ready = attrs.evolve(starting, phase="ready")
    await a.store.run(st.save_group_runs, dep.name, [ready], audit_draft(SYSTEM, "deployment.group", "d"))
    assert "deployments" in await b.feed.poll()
    assert [g.state for g in b.deployments.show(dep.name).groups] == ["ready"]


async def test_quota_limits_and_the_days_tokens_follow_the_store(sides: tuple[Side, Side]) -> None:
    a, b = sides
    await a.accounts.create_tenant(SYSTEM, TenantCreate(id=ACME))
    await a.quotas.set(SYSTEM, ACME, QuotaLimits(tokens_per_day=1000))
    assert await b.feed.poll() == {"accounts", "quotas"}
    now = time.time()
    assert b.quotas.view(ACME, now).limits == QuotaLimits(tokens_per_day=1000)

    running = b.quotas.admit(ACME, now, reserve_tokens=100)  # in flight here: no usage row yet
    await a.store.run(
        st.insert_usage,
        [usage_record(request_id="r1", tenant=ACME, prompt_tokens=450, completion_tokens=450, finished_at=now)],
    )  # another controller's usage
    await b.quotas.refresh_day(now=now)
    assert b.quotas.view(ACME, now).use.tokens_today == 1000
    with pytest.raises(QuotaExceeded) as refused:
        b.quotas.admit(ACME, now, reserve_tokens=100)
    assert refused.value.limit == "tokens_per_day"
    b.quotas.finish(running, 0, now)
    await b.quotas.refresh_day(now=now)
    assert b.quotas.view(ACME, now).use.tokens_today == 900
    b.quotas.admit(ACME, now)  # below the budget again


async def test_quota_shares_split_per_minute_and_concurrency_limits(sides: tuple[Side, Side]) -> None:
    a, _ = sides
    await a.accounts.create_tenant(SYSTEM, TenantCreate(id=ACME))
    now = time.time()

    async def admitted(limits: QuotaLimits, controllers: int, rank: int, *, finish: bool) -> int:
        """Requests one controller admits (each finished at once when `finish`) until refused."""
        await a.quotas.set(SYSTEM, ACME, limits)
        quotas = await Quotas.load(a.store, Metrics(), a.accounts.tenant_exists, now=now)
        quotas.share(controllers, rank)
        for count in range(100):
            try:
                ticket = quotas.admit(ACME, now)
            except QuotaExceeded:
                return count
            if finish:
                quotas.finish(ticket, 0, now)
        raise AssertionError("never refused")

    # 10 a minute over 3 controllers: 4, 3, 3 (the remainder to the first by id): 10 in all.
    per_minute = QuotaLimits(requests_per_minute=10)
    assert [await admitted(per_minute, 3, rank, finish=True) for rank in range(3)] == [4, 3, 3]
    assert await admitted(per_minute, 1, 0, finish=True) == 10
    # 2 at once over 3 controllers: at least one each.
    concurrent = QuotaLimits(concurrent_requests=2)
    assert [await admitted(concurrent, 3, rank, finish=False) for rank in range(3)] == [1, 1, 1]
    assert await admitted(concurrent, 2, 1, finish=False) == 1
    assert await admitted(concurrent, 1, 0, finish=False) == 2


async def test_refresh_all_then_the_loop_polls(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    async with two_sides(tmp_path) as (a, b):
        await a.accounts.create_tenant(SYSTEM, TenantCreate(id=ACME))
        async with trio.open_nursery() as nursery:
            await nursery.start(b.feed.run)  # starts with a full re-read
            assert b.accounts.tenant_exists(ACME)
            secret, _ = await a.accounts.create_key(SYSTEM, KeyCreate(role=Role.OPERATOR, name="ci"))
            await trio.sleep(2 * ClusterConfig().refresh_s)
            assert b.accounts.authenticate(secret) is not None
            nursery.cancel_scope.cancel()


# ---- a follower hears its nodes but writes and signs nothing ----------------------------------------


async def test_a_follower_keeps_what_nodes_report_in_memory_only(sides: tuple[Side, Side]) -> None:
    a, b = sides
    node_id, _, _ = await enroll(a.fleet)
    await b.feed.poll()
    await b.fleet.heard(node_id, hello(node_id))
    await b.fleet.heard(node_id, beat := heartbeat(node_id, 2))  # no NotLeader, no write
    assert b.fleet.get(node_id).inventory == beat.inventory
    [(_, stored_inventory, _)] = await b.store.read(st.load_nodes)
    assert stored_inventory is None
    await a.fleet.heard(node_id, hello(node_id))
    await a.fleet.heard(node_id, beat := heartbeat(node_id, 3))  # the leader writes it
    [(_, stored_inventory, _)] = await a.store.read(st.load_nodes)
    assert stored_inventory == beat.inventory


async def test_a_follower_never_signs_a_set_nor_begins_recovery_until_it_leads(tmp_path: Path) -> None:
    leading = False
    with trio.fail_after(TIMEOUT_S):
        async with st.open_store(tmp_path) as store:
            metrics = Metrics()
            fleet = Fleet(NodesConfig(), store, metrics)
            await fleet.load()
            node_id, key, curve = await enroll(fleet)
            controller_key, controller_curve = security.generate_signing_key(), links.generate_curve_keypair()
            southbound = Southbound(
                ChannelConfig(listen="tcp://127.0.0.1:*"),
                NodesConfig(lease_s=Seconds(5.0)),
                fleet,
                metrics,
                curve=controller_curve,
                signing_key=controller_key,
                epoch=lambda: 3 if leading else 0,
                leading=lambda: leading,
            )
            async with trio.open_nursery() as nursery:
                endpoint = await nursery.start(southbound.run)
                uplink = Uplink(
                    endpoint,
                    curve=curve,
                    server_curve_public=controller_curve.public,
                    signing_key=key,
                    controller_key=controller_key.public,
                )
                await nursery.start(uplink.run)
                # It accepted epoch 2 from the leader: above this follower's 0, and no set answers.
                await uplink.send(hello(node_id, epoch=2))
                await wait_until(lambda: fleet.get(node_id).reachable)
                with trio.move_on_after(0.5):
                    got = await uplink.receive()
                    pytest.fail(f"a follower sent {type(got).__name__}")
                assert not southbound.recovering

                leading = True  # it takes the lease at epoch 3: every reachable node gets its set
                assert await southbound.lead() == 1
                pushed = await uplink.receive()
                assert isinstance(pushed, wire.AssignmentSet)
                assert (pushed.node_id, pushed.epoch) == (node_id, 3)
                nursery.cancel_scope.cancel()


# ---- two real controllers on one PostgreSQL database -------------------------------------------------


async def test_any_controller_takes_writes_and_shows_them_at_once(
    nursery: trio.Nursery, tmp_path: Path, pg_url: str
) -> None:
    with trio.fail_after(60):
        leader = await start_controller(nursery, cluster_config(tmp_path, "a", pg_url))
        # Every controller on a store shares the controller keys (copied, as an operator does).
        shutil.copytree(leader.state_dir / KEYS_DIR, tmp_path / "b" / "state" / KEYS_DIR)
        follower = await start_controller(nursery, cluster_config(tmp_path, "b", pg_url), admin_key=leader.admin_key)

        async with follower.client() as http:
            made = await http.post("/api/v1/tenants", json={"id": "acme"})
            assert made.status_code == 201, made.text
            assert made.headers[FORWARDED_HEADER] == "a"  # the leader made it
            listed = await http.get("/api/v1/tenants")  # read here, at once
            assert FORWARDED_HEADER not in listed.headers
            assert [t["id"] for t in listed.json()["tenants"]] == ["acme"]
            key = await http.post("/api/v1/keys", json={"role": "inference", "name": "app", "tenant": "acme"})
            assert key.status_code == 201, key.text
            page = await http.get("/console/login")  # the console's sessions live on the leader
            assert (page.status_code, page.headers[FORWARDED_HEADER]) == (200, "a")
        async with follower.client(key.json()["key"]) as inference:
            models = await inference.get("/v1/models")  # the gateway here knows the new key
            assert models.status_code == 200, models.text
            assert FORWARDED_HEADER not in models.headers

        leader.stopping.set()  # a clean stop releases the lease: the follower takes it
        async with follower.client() as http:
            await until_leads(http)
            made = await http.post("/api/v1/tenants", json={"id": "beta"})
            assert made.status_code == 201, made.text
            assert FORWARDED_HEADER not in made.headers  # served by itself, now the leader
        follower.stopping.set()
